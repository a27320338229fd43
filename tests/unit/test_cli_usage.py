"""``fleetwire usage``: --since durations and the JSON and CSV it prints (fleetwire/cli/usage.py)."""

from __future__ import annotations

import json

import pytest

from fleetwire.cli.main import build_parser
from fleetwire.cli.usage import COLUMNS, parse_since, print_usage
from protocol.messages import Usage, UsageTotals

ROWS = [UsageTotals(name="alice", team="ml", succeeded=40, slot_seconds=20.5, preemptions=1),
        UsageTotals(name="bob", team="web", succeeded=5, failed=1)]  # fmt: skip


def test_since_takes_durations_back_from_now() -> None:
    """24h, 90m, 7d and bare seconds go back from now; all and 0 mean all time."""
    now = 1_000_000.0
    assert parse_since("24h", now) == now - 86_400
    assert parse_since("90m", now) == now - 5_400
    assert parse_since("7d", now) == now - 7 * 86_400
    assert parse_since("3600", now) == now - 3_600
    assert parse_since("all", now) == parse_since("0", now) == 0.0


def test_a_bad_since_names_the_value() -> None:
    """A value that is not a duration is refused, naming it and the forms it takes."""
    with pytest.raises(ValueError, match=r"--since 'yesterday' is not a duration: give e.g. 24h"):
        parse_since("yesterday", 0.0)


def test_json_is_one_document_with_every_row(capsys: pytest.CaptureFixture[str]) -> None:
    """--json prints {"by", "since", "rows"} with every column of every row."""
    print_usage(Usage(req_id=1, by="principal", since=0.0, rows=ROWS), as_json=True, as_csv=False)
    doc = json.loads(capsys.readouterr().out)
    assert doc["by"] == "principal" and [r["name"] for r in doc["rows"]] == ["alice", "bob"]
    assert set(doc["rows"][0]) == set(COLUMNS) and doc["rows"][0]["preemptions"] == 1


def test_csv_by_team_has_a_header_and_no_team_column(capsys: pytest.CaptureFixture[str]) -> None:
    """--csv --by team: a header row, then one row per team, without the principal's team column."""
    rows = [UsageTotals(name="ml", succeeded=40), UsageTotals(name="web", succeeded=5)]
    print_usage(Usage(req_id=1, by="team", rows=rows), as_json=False, as_csv=True)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split(",") == [c for c in COLUMNS if c != "team"]
    assert lines[1].startswith("ml,40,0,0,")


def test_usage_and_preemptible_are_flags_of_the_cli() -> None:
    """`fleetwire usage --by team --since 24h --csv` and `fleetwire submit --preemptible` parse."""
    ns = build_parser().parse_args(["usage", "--by", "team", "--since", "24h", "--csv"])
    assert (ns.by, ns.since, ns.csv) == ("team", "24h", True)
    assert build_parser().parse_args(["submit", "echo", "--preemptible"]).preemptible
