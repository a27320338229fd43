"""bench/_harness.py ``bench_env``: which of this process's FLEETWIRE_* variables the bench's processes get."""

from __future__ import annotations

import pytest

from tests import bench_scripts


def test_the_split_threshold_reaches_the_benchs_coordinators(monkeypatch: pytest.MonkeyPatch) -> None:
    """FLEETWIRE_PG_SPLIT_MIN_PLANS set for a run is passed on (a cluster bench's coordinators with and without the
    split, docs/PERFORMANCE.md §C29t); another FLEETWIRE_* variable is still dropped."""
    harness = bench_scripts.load("_harness.py", "bench_harness_env")
    monkeypatch.setenv("FLEETWIRE_PG_SPLIT_MIN_PLANS", "0")
    monkeypatch.setenv("FLEETWIRE_SOMETHING_ELSE", "1")
    env = harness.bench_env()
    assert env["FLEETWIRE_PG_SPLIT_MIN_PLANS"] == "0" and "FLEETWIRE_SOMETHING_ELSE" not in env
