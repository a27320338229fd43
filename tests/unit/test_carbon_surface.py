"""What users and operators see of carbon time shifting: the CLI's --deadline, --carbon-forecast and
--carbon-option, the SDK's deadline_at, and the /metrics families (coordinator/io/ops/carbon_metrics.py)."""

from __future__ import annotations

import argparse
import json
from datetime import UTC, datetime, timedelta, timezone

import pytest
from prometheus_client.core import Metric

from coordinator.carbon_time import ForecastSource
from coordinator.io.ops.carbon_metrics import CARBON_METRIC_NAMES, carbon_families
from fleetwire.cli import console
from fleetwire.cli.main import build_parser
from fleetwire.cli.serve import server_settings
from fleetwire.cli.usage import print_usage
from fleetwire.submits import unix_time
from protocol.messages import Done, Receipt, Usage, UsageTotals
from tests.unit.test_carbon_holds import QUIET, T0, H, forecast, start, worker
from tests.unit.test_core import Harness


def test_deadline_is_a_duration_from_now_or_a_time() -> None:
    """--deadline 6h is deadline_s; an ISO time is deadline_at (with an offset as given, without: local time)."""
    assert console.deadline("6h") == (6 * H, None)
    assert console.deadline("90m") == (5400.0, None)
    assert console.deadline("2026-06-01T06:00Z") == (None, datetime(2026, 6, 1, 6, tzinfo=UTC).timestamp())
    assert console.deadline("2026-06-01T08:00+02:00") == (None, datetime(2026, 6, 1, 6, tzinfo=UTC).timestamp())
    local = datetime(2026, 6, 1, 6).astimezone().timestamp()
    assert console.deadline("2026-06-01T06:00") == (None, local)
    with pytest.raises(argparse.ArgumentTypeError, match="a duration like 6h or a time like"):
        console.deadline("2026-13-45T99:00")


def test_submit_flags_reach_the_parser() -> None:
    """`fleetwire submit --deadline 6h --expected-run 45m` parses to the two numbers the SDK sends."""
    ns = build_parser().parse_args(["submit", "echo", "--deadline", "6h", "--expected-run", "45m"])
    assert (ns.deadline, ns.expected_run) == ((6 * H, None), 2700.0)
    ns = build_parser().parse_args(["release", "p1", "p2"])
    assert ns.plan == ["p1", "p2"]


def test_sdk_deadline_at_takes_unix_seconds_or_an_aware_datetime_only() -> None:
    """A naive datetime is refused naming the fix; an aware one is converted; numbers pass as they are."""
    aware = datetime(2026, 6, 1, 6, tzinfo=timezone(timedelta(hours=2)))
    assert unix_time(aware) == aware.timestamp() and unix_time(1.5e9) == 1.5e9 and unix_time(None) is None
    with pytest.raises(ValueError, match="has no time zone"):
        unix_time(datetime(2026, 6, 1, 6))


def test_coordinator_carbon_flags_make_the_settings(tmp_path: object) -> None:
    """--carbon-forecast with its zone and interval, --carbon-option knobs; a bad knob names the flag."""
    parser = build_parser()
    ns = parser.parse_args(["coordinator", "--insecure", "--carbon-forecast", "cmd:cat rows.csv",
                            "--carbon-forecast-zone", "de", "--carbon-forecast-interval", "60",
                            "--carbon-option", "quantum_s=60", "--carbon-option", "queue_margin_s=5"])  # fmt: skip
    settings = server_settings(ns, (), ())
    assert settings.carbon_forecast == ForecastSource("command", "cat rows.csv", "DE", 60.0)
    assert (settings.core.carbon.quantum_s, settings.core.carbon.queue_margin_s) == (60.0, 5.0)
    assert settings.core.carbon.run_margin == 0.2  # the rest keep their defaults
    ns = parser.parse_args(["coordinator", "--insecure", "--carbon-option", "quantum_s=0"])
    with pytest.raises(ValueError, match="--carbon-option: quantum_s must be > 0"):
        server_settings(ns, (), ())
    ns = parser.parse_args(["coordinator", "--insecure", "--carbon-forecast", "x.csv", "--carbon-forecast-max-age",
                            "0"])  # fmt: skip
    with pytest.raises(ValueError, match="--carbon-forecast-max-age must be > 0"):
        server_settings(ns, (), ())
    assert server_settings(parser.parse_args(["coordinator", "--insecure"]), (), ()).carbon_forecast is None


def test_an_unknown_carbon_option_is_refused_naming_the_known_ones(capsys: pytest.CaptureFixture[str]) -> None:
    """--carbon-option speed=3: a usage error listing the knobs."""
    with pytest.raises(SystemExit):
        build_parser().parse_args(["coordinator", "--carbon-option", "speed=3"])
    assert "expected NAME=VALUE with NAME one of quantum_s, run_margin" in capsys.readouterr().err


def samples(metrics: list[Metric]) -> dict[tuple[str, tuple[str, ...]], float]:
    return {(s.name, tuple(s.labels.values())): s.value for m in metrics for s in m.samples}


def test_metrics_count_holds_and_what_they_avoided_and_each_zones_forecast() -> None:
    """Held now, holds and releases, the avoided grams the ledger summed, each zone's forecast age and horizon."""
    h = start(Harness(**QUIET), T0)
    w = worker(h, "w1")
    forecast(h, [300, 280, 250, 50, 60, 290, 300, 310, 320, 330])
    c = h.client()
    plan_id = h.submit(c, deadline_s=9 * H, expected_run_s=H)
    h.now = T0 + 600
    got = samples(list(carbon_families(h.core, h.now)))
    assert got[("fleetwire_carbon_plans_held", ())] == 1 and got[("fleetwire_carbon_holds_total", ())] == 1
    assert got[("fleetwire_carbon_forecast_age_seconds", ("DE",))] == 600
    assert got[("fleetwire_carbon_forecast_horizon_seconds", ("DE",))] == 10 * H - 600
    h.tick(T0 + 3 * H)  # its window: placed, run, done with 1 kWh
    h.take(w)
    h.now = T0 + 4 * H
    h.send(w, Done(plan_id=plan_id, attempt=1, outcome="succeeded", receipt=Receipt(joules=3.6e6, run_s=H)))
    got = samples(list(carbon_families(h.core, h.now)))
    assert got[("fleetwire_carbon_plans_held", ())] == 0 and got[("fleetwire_carbon_releases_total", ())] == 1
    assert got[("fleetwire_carbon_avoided_grams", ())] == 250  # 1 kWh at 50 instead of 300 g/kWh
    assert {m.name for m in carbon_families(h.core, h.now)} == set(CARBON_METRIC_NAMES)


def test_usage_shows_what_waiting_avoided(capsys: pytest.CaptureFixture[str]) -> None:
    """`fleetwire usage` has an AVOIDED-G column, and --json an avoided_co2e_g field, per row."""
    rows = [UsageTotals(name="alice", team="ml", succeeded=3, co2e_g=12.5, avoided_co2e_g=250.0)]
    print_usage(Usage(req_id=1, by="principal", rows=rows), as_json=True, as_csv=False)
    assert json.loads(capsys.readouterr().out)["rows"][0]["avoided_co2e_g"] == 250.0
    print_usage(Usage(req_id=1, by="principal", rows=rows), as_json=False, as_csv=False)
    table = capsys.readouterr().out.splitlines()
    assert "AVOIDED-G" in table[0] and "250.0" in table[1]
