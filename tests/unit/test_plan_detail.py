"""``get_plan`` carries what the dashboard's plan detail shows: owner, attempt history, end time."""

from __future__ import annotations

from protocol.messages import Accept, Done, GetPlan, ListPlans, PlanReply, Plans
from tests.unit.test_core import Harness, only


def test_get_plan_has_owner_history_and_end_time() -> None:
    """A plan lost with its worker and finished on another reports its owner, the lost attempt and when it ended."""
    h = Harness()
    w1 = h.worker("w1")
    c = h.client("alice")
    plan_id = h.submit(c)
    h.send(w1, Accept(plan_id=plan_id, attempt=1))
    h.now = 20.0
    w2 = h.worker("w2")
    assert h.tick(31.0) == ["w1"]  # w1 stopped beating: attempt 1 lost, attempt 2 on w2
    h.send(w2, Accept(plan_id=plan_id, attempt=2))
    h.send(w2, Done(plan_id=plan_id, attempt=2, outcome="succeeded", result=1))
    h.take(c)
    h.send(c, GetPlan(req_id=7, plan_id=plan_id))
    info = only(h.take(c), PlanReply).plan
    assert info.owner == "alice"
    assert [(e["attempt"], e["worker_id"]) for e in info.history] == [(1, "w1")]
    assert "heartbeats" in info.history[0]["reason"]
    assert info.ended_at is not None and info.ended_at >= 31.0  # the core's wall offset is 0 here
    h.send(c, ListPlans(req_id=8))
    row = only(h.take(c), Plans).plans[0]
    assert row.history == []  # listings stay summaries: the history comes with get_plan
