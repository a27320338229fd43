"""A view session's catch-up from stored rows (coordinator/views.py): new events, resyncs for gaps."""

from __future__ import annotations

from coordinator.plans import Plan
from coordinator.views import Watched, catch_up
from protocol.messages import Event, Resync, Submit


def stored(seqs: list[int], *, state: str = "running", next_seq: int = 0) -> Plan:
    plan = Plan.from_submit(Submit(req_id=1, op="echo"), "p", "alice", 1)
    plan.events = [Event(plan_id="p", kind="progress", seq=seq) for seq in seqs]
    plan.state = state  # type: ignore[assignment]
    plan.next_seq = next_seq or (seqs[-1] + 1 if seqs else 1)
    return plan


def kinds(msgs: list[object]) -> list[object]:
    return [(m.first_seq, m.last_seq) if isinstance(m, Resync) else m.seq for m in msgs]  # type: ignore[attr-defined]


def test_sends_only_new_events_and_a_resync_for_each_seq_the_rows_never_held() -> None:
    """From seq 1: 1, 2, resync 3..3, 4; then only what came after; a finished plan's missing tail is resynced."""
    w = Watched(key=7, plan_id="p", shard=0, expected=1)
    assert kinds(catch_up(stored([1, 2, 4]), w)) == [1, 2, (3, 3), 4]
    assert w.expected == 5 and w.since == 4
    assert catch_up(stored([1, 2, 4]), w) == []  # read again, nothing new
    assert kinds(catch_up(stored([1, 2, 4, 5, 6], state="succeeded", next_seq=8), w)) == [5, 6, (7, 7)]
    assert w.expected == 8


def test_a_watch_from_a_later_seq_skips_what_the_subscriber_saw() -> None:
    """from_seq 2 (expected 3): the events from 3 on only."""
    w = Watched(key=7, plan_id="p", shard=0, expected=3)
    assert kinds(catch_up(stored([1, 2, 3, 4]), w)) == [3, 4]
