"""Exit statuses (docs/OPERATIONS.md §Exit statuses) and the example systemd units agree: a crash or a
refused token restarts, usage (2), a damaged store (3), fencing and a removed worker (4) do not."""

from __future__ import annotations

import configparser
import re
from pathlib import Path

from coordinator.io.cluster.leases import EXIT_SHARD_FENCED
from fleetwire.cli.console import EXIT_FAILED, EXIT_USAGE
from fleetwire.cli.store import EXIT_STORE_DAMAGED
from worker_agent.session import EXIT_REMOVED

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "examples" / "deploy"


def _prevented(service: str) -> set[int]:
    unit = configparser.ConfigParser(strict=False, interpolation=None, comment_prefixes=("#", ";"))
    unit.optionxform = str  # type: ignore[assignment,method-assign]
    unit.read(DEPLOY / service)
    assert unit["Service"]["Restart"] == "on-failure"
    return {int(code) for code in unit["Service"]["RestartPreventExitStatus"].split()}


def test_coordinator_unit_restarts_crashes_not_usage_damage_or_fencing() -> None:
    """The coordinator unit prevents restarts for exactly 2, 3 and 4; 1 (crash, store write failed) restarts."""
    assert _prevented("fleetwire-coordinator.service") == {EXIT_USAGE, EXIT_STORE_DAMAGED, EXIT_SHARD_FENCED}
    assert EXIT_FAILED not in _prevented("fleetwire-coordinator.service")


def test_worker_unit_restarts_a_refused_token() -> None:
    """The worker unit prevents restarts only for usage errors (2) and a removed id (4): a refused token restarts."""
    assert _prevented("fleetwire-worker.service") == {EXIT_USAGE, EXIT_REMOVED}


def test_operations_table_names_the_same_codes() -> None:
    """OPERATIONS.md's exit-status table has rows 0-4 and says which ones the units restart."""
    text = (ROOT / "docs" / "OPERATIONS.md").read_text()
    table = text[text.index("### Exit statuses"):]
    rows = re.findall(r"^\| (\d) \|.*\| (\*\*yes\*\*|no)[^|]*\|$", table, flags=re.M)
    assert {int(code): said for code, said in rows} == {0: "no", 1: "**yes**", 2: "no", 3: "no", 4: "no"}
    assert "RestartPreventExitStatus=2 3 4" in text
