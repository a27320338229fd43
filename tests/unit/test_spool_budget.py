"""The spool's room rules (worker_agent/spool.py) on a real directory: inputs kept in memory are bounded in all,
a digest mismatch starts an input again from 0 a bounded number of times, and the sweep keeps what a waiting
plan still needs."""

from __future__ import annotations

from pathlib import Path

from tests.integration.data_helpers import digest
from worker_agent.spool import Spool
from worker_agent.spool_files import INPUT_MISMATCH, INPUT_RESTARTS


def test_inputs_kept_in_memory_are_bounded_in_all(tmp_path: Path) -> None:
    """Small inputs past the memory budget go to files; dropping an attempt gives its memory back."""
    spool = Spool(tmp_path / "spool", memory_bytes=1024, memory_budget_bytes=4096, clock=lambda: 0.0)
    entries = [spool.declare(f"p{n}", 1, "x", 1000, digest(b"")) for n in range(6)]
    assert [entry.path is None for entry in entries] == [True] * 4 + [False] * 2
    assert spool.memory_used == 4000
    spool.drop_inputs("p0", 1)
    spool.drop_inputs("p5", 1)
    assert spool.memory_used == 3000
    assert spool.declare("p9", 1, "x", 1000, digest(b"")).path is None


def test_a_digest_mismatch_starts_the_input_again_from_zero_then_fails(tmp_path: Path) -> None:
    """Damaged bytes are dropped and the input waits for them again from offset 0; the sound copy then verifies.
    Past INPUT_RESTARTS mismatches it fails input_mismatch naming the input."""
    spool = Spool(tmp_path / "spool", memory_bytes=4, clock=lambda: 0.0)
    good = b"0123456789"
    entry = spool.declare("p", 1, "x", len(good), digest(good))  # on disk (over memory_bytes)
    entry.write(b"0123X56789")
    entry.finish()
    assert (entry.state, entry.received, entry.restarts) == ("receiving", 0, 1)
    assert "'x'" in entry.mismatch and "send it again from offset 0" in entry.mismatch
    entry.write(good)
    entry.finish()
    assert entry.state == "verified" and entry.path is not None and entry.path.read_bytes() == good
    bad = spool.declare("p", 1, "y", len(good), digest(good))
    for _ in range(INPUT_RESTARTS + 1):
        bad.write(b"X" * len(good))
        bad.finish()
    assert bad.state == "failed" and bad.error is not None and bad.error.code == INPUT_MISMATCH
    assert "'y'" in bad.error.message


def test_the_sweep_keeps_the_inputs_of_a_plan_waiting_for_a_slot(tmp_path: Path) -> None:
    """Inputs older than the stale age go, unless ``keep`` says their attempt is live (prefetched, not yet running)."""
    now = [0.0]
    spool = Spool(tmp_path / "spool", clock=lambda: now[0])
    spool.declare("waiting", 1, "x", 3, digest(b"abc"))
    spool.declare("gone", 1, "x", 3, digest(b"abc"))
    now[0] = 700.0
    spool.sweep(600.0, keep=lambda plan_id, attempt: plan_id == "waiting")
    assert spool.input("waiting", 1, "x") is not None and spool.input("gone", 1, "x") is None
