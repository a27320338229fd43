"""Carbon-aware time shifting (issue #31): plans with a deadline wait for a greener hour.

The pure part, one module per concern:

================  =====================================================================
module            owns
================  =====================================================================
``forecast``      rows (CSV, provider JSON), a zone's step function, the latest values
                  per zone with recent history, staleness
``sources``       ``--carbon-forecast`` sources (file, command, HTTP) and when to fetch;
                  the driver (coordinator/io/) does the fetching
``planner``       the decision per plan (hold until when and where, or run now), the
                  slot calendar per zone, re-planning, the waiting reason
``accounting``    ``avoided_co2e_g``: the rule, and why it does not overstate
================  =====================================================================

Nothing here reads a clock: every call takes ``now`` in Unix seconds (UTC).
"""

from coordinator.carbon_time.accounting import Avoided, avoided_co2e
from coordinator.carbon_time.forecast import (
    ForecastBook,
    ForecastError,
    ForecastRow,
    StepForecast,
    parse_csv,
    parse_json,
    parse_rows,
    parse_time,
)
from coordinator.carbon_time.planner import Deferrable, Hold, Run, ShiftConfig, ShiftStats, TimeShifter, latest_start_s
from coordinator.carbon_time.sources import FeedOutcome, ForecastFeed, ForecastSource, parse_source

__all__ = [
    "Avoided", "Deferrable", "FeedOutcome", "ForecastBook", "ForecastError", "ForecastFeed", "ForecastRow",
    "ForecastSource", "Hold", "Run", "ShiftConfig", "ShiftStats", "StepForecast", "TimeShifter", "avoided_co2e",
    "latest_start_s", "parse_csv", "parse_json", "parse_rows", "parse_source", "parse_time",
]
