"""bench/cluster_chaos.py keeps working: a tiny run against real PostgreSQL and coordinators, and its checker bites.

No figure is asserted (the failover targets live in the bench's report): only that the run
finishes, the checker passes, and that the checker flags planted gaps, duplicates, illegal
transitions and stale-epoch commits.
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path
from typing import Any

import pytest

from protocol.messages import Event
from tests.integration.bench_run import run_bench
from tests.pg import missing_reason

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench"
sys.path.insert(0, str(BENCH))

import cluster_chaos  # noqa: E402

TINY = ["--coordinators", "3", "--shards", "3", "--sims", "6", "--agents", "1", "--kills", "1", "--rate", "2",
        "--settle", "0.5", "--lease-ttl", "1", "--lease-renew", "0.25", "--stall-extra", "1",
        "--worker-kill-every", "0.5", "--agent-kill-every", "5", "--drain", "20", "--db-freeze", "2"]  # fmt: skip


@pytest.mark.timeout(120)
def test_cluster_chaos_bench_tiny_run_passes_its_checker(tmp_path: Path) -> None:
    """A tiny chaos run (kill -9, SIGSTOP past the lease, SIGTERM, a 2 s database freeze) loses, duplicates and gaps
    nothing, and reports per fault kind when clients and workers were back."""
    if (reason := missing_reason()) is not None:
        pytest.skip(reason)

    rc, out, err = asyncio.run(run_bench(BENCH / "cluster_chaos.py", [*TINY, "--logs", str(tmp_path), "--json"], 110))
    lines = [line for line in out.splitlines() if line.startswith("{")]
    assert lines, f"no result (exit {rc}):\n{out[-2000:]}\n{err[-3000:]}"
    r = json.loads(lines[-1])
    assert rc == 0, f"checker failed: {json.dumps(r, indent=1)[:4000]}"
    assert r["kills"] == 1 and r["acknowledged"] > 0 and r["commits_logged"] > 0
    assert (r["lost"], r["duplicated"], r["gaps"], r["stale_epoch_commits"]) == (0, 0, 0, 0)
    assert r["stall_all_fenced"] is True
    # Each fault kind says how long clients and workers took to be back once their shard was served again.
    assert set(r["back_after_served"]) == {"kill -9", "SIGSTOP", "SIGTERM", "db freeze"}
    assert all(row["lost"] == 0 for row in r["back_after_served"].values())


def _ev(seq: int, kind: str) -> Event:
    return Event(plan_id="p", kind=kind, seq=seq)


def test_stream_checker_flags_gaps_duplicates_and_illegal_transitions() -> None:
    """The checker's stream rules: a clean stream passes; a gap, a repeat, two endings, a jump are each named."""
    clean = [_ev(1, "queued"), _ev(2, "leased"), _ev(3, "running"), _ev(4, "requeued"), _ev(5, "leased"),
             _ev(6, "succeeded")]  # fmt: skip
    assert cluster_chaos.stream_problems(clean, contiguous=True) == []
    gap = [_ev(1, "queued"), _ev(3, "leased"), _ev(4, "running"), _ev(5, "succeeded")]
    assert any("gap" in p for p in cluster_chaos.stream_problems(gap, contiguous=True))
    repeat = [_ev(1, "queued"), _ev(2, "leased"), _ev(2, "leased"), _ev(3, "running"), _ev(4, "succeeded")]
    assert any("duplicate seqs" in p for p in cluster_chaos.stream_problems(repeat, contiguous=False))
    twice = [_ev(1, "queued"), _ev(2, "leased"), _ev(3, "running"), _ev(4, "succeeded"), _ev(5, "failed")]
    assert any("2 terminal" in p for p in cluster_chaos.stream_problems(twice, contiguous=True))
    jump = [_ev(1, "queued"), _ev(2, "running"), _ev(3, "succeeded")]
    problems = cluster_chaos.stream_problems(jump, contiguous=True)
    assert any("illegal transition queued -> running" in p for p in problems)
    marker = Event(plan_id="p", kind="resync", seq=66, data={"recovered": False, "first_seq": 3, "last_seq": 66})
    resynced = [_ev(1, "queued"), _ev(2, "waiting"), marker, _ev(67, "leased"), _ev(68, "running"),
                _ev(69, "succeeded")]  # fmt: skip
    assert cluster_chaos.stream_problems(resynced, contiguous=True) == []  # the marker stands for seqs 3..66
    late = Event(plan_id="p", kind="resync", seq=66, data={"recovered": False, "first_seq": 5, "last_seq": 66})
    skipped = [_ev(1, "queued"), _ev(2, "waiting"), late, _ev(67, "leased"), _ev(68, "running"), _ev(69, "succeeded")]
    assert any("gap" in p for p in cluster_chaos.stream_problems(skipped, contiguous=True))  # 3..4 unaccounted


def test_checker_counts_a_commit_under_a_stale_epoch_and_an_epoch_going_back() -> None:
    """A logged write whose writer epoch is not the lease's, and a lease epoch that decreased, both fail the run."""
    commits: list[dict[str, Any]] = [
        {"writer_epoch": 3, "lease_epoch": 3, "writer_shard": 1, "shard": 1, "lease_live": True},
        {"writer_epoch": 2, "lease_epoch": 3, "writer_shard": 1, "shard": 1, "lease_live": True},
    ]
    leases: list[dict[str, Any]] = [
        {"old_epoch": 2, "new_epoch": 3, "old_owner": "a", "new_owner": "b"},
        {"old_epoch": 3, "new_epoch": 3, "old_owner": "b", "new_owner": "c"},
    ]
    r = cluster_chaos.check([], [], [], [], commits, leases, [])
    assert r["stale_epoch_commits"] == 1 and r["epoch_regressions"] == 1
    assert not cluster_chaos.passed({**r, "stall_all_fenced": None})
