"""Waiting reasons re-explained under worker churn are not store rows, and seqs are still never reused.

Issue 17 finding 5 (bench phase ``f5-distinct``): a worker that connects and leaves in a loop
flips every queued plan's reason; each flip was an event row and a status write. The core with a
fake clock and a real MemoryStore (tests/unit/test_durability_core.py ``Durable``).
"""

from __future__ import annotations

from coordinator.records import PlanStatus
from coordinator.streams import UNRECORDED_SEQ_RESERVE
from protocol.messages import Accept, Assign, Done, Event, Requirements, Resync, Subscribe
from tests.unit.test_core import only
from tests.unit.test_durability_core import Durable


def churn(h: Durable, times: int, start: float = 0.0) -> None:
    """A worker without the plans' tags connects and leaves ``times`` times, a second apart (within the budget)."""
    for i in range(times):
        h.tick(start + i)
        h.close(h.worker("w1"))


def test_churn_writes_no_waiting_rows_and_one_status_per_reserve_of_flips() -> None:
    """200 connects and leaves: no waiting Event records, a status per 64 flips, the stored next_seq always ahead."""
    h = Durable(worker_reconnect_rate=0)  # no reconnect budget (test_reconnect_budget.py): the flips are the point
    c = h.client()
    pid = h.submit(c, requirements=Requirements(tags=["gpu"]))
    h.records.clear()
    stored_next = 0
    for i in range(200):
        churn(h, 1, float(i))
        statuses = [r.next_seq for r in h.records if isinstance(r, PlanStatus) and r.plan_id == pid]
        stored_next = max([stored_next, *statuses])
        assert stored_next >= h.core.plans[pid].next_seq  # every seq sent is below what a restart resumes at
    plan = h.core.plans[pid]
    flips = plan.next_seq - 3  # after queued (1) and the recorded first waiting (2)
    assert flips >= 200
    assert not [r for r in h.records if isinstance(r, Event) and r.plan_id == pid]
    statuses = [r for r in h.records if isinstance(r, PlanStatus) and r.plan_id == pid]
    assert len(statuses) <= flips // UNRECORDED_SEQ_RESERVE + 1


def test_after_a_restart_seqs_resume_past_the_unrecorded_ones_and_a_replay_resyncs_them() -> None:
    """Restarted: the next event's seq is past every seq sent before; a full replay says resync for the gap."""
    h = Durable()
    c = h.client()
    pid = h.submit(c, requirements=Requirements(tags=["gpu"]))
    churn(h, 30)
    sent = h.core.plans[pid].next_seq - 1
    h.restart(now=100.0)
    churn(h, 1, 100.0)
    plan = h.core.plans[pid]
    assert plan.events[-1].seq > sent and plan.events[-1].kind == "waiting"
    c = h.client()
    h.send(c, Subscribe(req_id=1, plan_ids=[pid], from_seq=0))
    msgs = [m for m in h.take(c) if isinstance(m, Event | Resync)]
    assert [m.kind if isinstance(m, Event) else "resync" for m in msgs] == ["queued", "resync", "waiting"]
    resync = msgs[1]  # the superseded and the unrecorded reasons: one run, never a silent gap
    assert isinstance(resync, Resync) and resync.first_seq == 2 and resync.last_seq == plan.events[-1].seq - 1


def test_a_finished_plan_records_its_true_next_seq_so_a_restart_reports_its_last_seq() -> None:
    """A plan that ends after unrecorded flips: its last status holds the real next_seq (no reservation left), so
    after a restart get_plan's last_seq is its terminal event's seq (bench/chaos.py counted these as duplicates)."""
    h = Durable()
    c = h.client()
    pid = h.submit(c, requirements=Requirements(tags=["gpu"]))
    churn(h, 5)
    w = h.worker("w2", tags=["gpu"])
    assign = only(h.take(w), Assign)
    h.send(w, Accept(plan_id=pid, attempt=assign.attempt, seq=1))
    h.send(w, Done(plan_id=pid, attempt=assign.attempt, outcome="succeeded", result=1, seq=2))
    plan = h.core.plans[pid]
    terminal_seq = plan.events[-1].seq
    assert plan.events[-1].kind == "succeeded"
    statuses = [r for r in h.records if isinstance(r, PlanStatus) and r.plan_id == pid]
    assert statuses[-1].next_seq == terminal_seq + 1
    h.restart(now=100.0)
    assert h.core.plans[pid].info().last_seq == terminal_seq
