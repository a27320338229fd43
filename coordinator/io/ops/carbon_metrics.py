"""``/metrics`` families of carbon time shifting (docs/OPERATIONS.md §Carbon time shifting).

Read at scrape time from the core's :class:`~coordinator.carbon_holds.CarbonHolds` (the plans held, the
forecast book) and the usage ledger (what held plans avoided), never on the hot path. The ``zone``
label has one value per zone the forecast source names.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Final

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

if TYPE_CHECKING:
    from coordinator.core import Coordinator

__all__ = ["CARBON_METRIC_NAMES", "carbon_families"]

#: The families :func:`carbon_families` yields (counters get ``_total`` in the exposition).
CARBON_METRIC_NAMES: Final = (
    "fleetwire_carbon_plans_held",
    "fleetwire_carbon_holds",
    "fleetwire_carbon_releases",
    "fleetwire_carbon_not_held",
    "fleetwire_carbon_avoided_grams",
    "fleetwire_carbon_forecast_age_seconds",
    "fleetwire_carbon_forecast_horizon_seconds",
    "fleetwire_carbon_forecast_fetches",
    "fleetwire_carbon_forecast_failures",
)


def carbon_families(core: Coordinator, now: float) -> Iterator[Metric]:
    """Plans held now, holds and releases so far, what held plans avoided, and each zone's forecast age and horizon."""
    carbon, counters = core.carbon, core.counters
    yield GaugeMetricFamily("fleetwire_carbon_plans_held", "Plans with a deadline held for a greener hour now.",
                            value=len(carbon.held))  # fmt: skip
    for name, key, doc in (
        ("fleetwire_carbon_holds", "carbon_held", "Plans with a deadline the coordinator held for a greener hour."),
        ("fleetwire_carbon_releases", "carbon_released", "Held plans released: their window began, released early "
                                                         "(release_plan), or a re-plan said run now."),
        ("fleetwire_carbon_not_held", "carbon_not_held", "Plans with a deadline placed at once: now was greenest, or "
                                                         "no usable forecast, expected run or worker (logged)."),
        ("fleetwire_carbon_forecast_fetches", "carbon_forecast_fetches", "Forecast fetches that succeeded."),
        ("fleetwire_carbon_forecast_failures", "carbon_forecast_failures", "Forecast fetches that failed (the "
                                                                           "previous forecast stays)."),
    ):
        yield CounterMetricFamily(name, doc, value=counters.get(key, 0))
    avoided = sum(totals.avoided_co2e_g for totals in core.sharing.ledger.totals("team").values())
    yield GaugeMetricFamily("fleetwire_carbon_avoided_grams", "gCO2e that plans held for a greener hour avoided, by "
                            "their receipts (negative when held plans ran dirtier than at submit).", value=avoided)
    unix = carbon.unix(now)
    age = GaugeMetricFamily("fleetwire_carbon_forecast_age_seconds", "Seconds since the zone's forecast was "
                            "received.", labels=["zone"])  # fmt: skip
    horizon = GaugeMetricFamily("fleetwire_carbon_forecast_horizon_seconds", "Seconds from now to the end of the "
                                "zone's forecast (negative: it ended).", labels=["zone"])  # fmt: skip
    book = carbon.book
    for zone, received in sorted(book.received_s().items()):
        age.add_metric([zone], unix - received)
        forecast = book.forecast(zone)
        if forecast is not None:
            horizon.add_metric([zone], forecast.end_s - unix)
    yield age
    yield horizon
