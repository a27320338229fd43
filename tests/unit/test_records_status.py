"""``status_of`` builds a status record positionally (issue #29): each field comes from the plan's field of its name."""

from __future__ import annotations

import msgspec

from coordinator.journal import status_of
from coordinator.plans import Plan
from coordinator.records import PlanStatus
from protocol.messages import ErrorInfo, OutputSpec, Receipt, Submit


def busy_plan(state: str) -> Plan:
    """A plan whose every status field differs from its default and from the others."""
    plan = Plan.from_submit(Submit(req_id=1, op="echo", args=1), "p1", "alice", 1)
    plan.state = state  # type: ignore[assignment]
    plan.attempt, plan.worker_id, plan.next_seq, plan.seq_recorded = 3, "w7", 9, 40
    plan.result, plan.error = {"r": 1}, ErrorInfo("handler_error", "boom")
    plan.waiting_reason, plan.worker_seq, plan.retried, plan.free_attempts = "why", (3, 11), 2, 1
    plan.history = [{"attempt": 1}]
    plan.ended_at, plan.receipt = 123.5, Receipt(estimated=True, source="none")
    plan.produced = [OutputSpec(name="out", size=5, digest="d")]
    plan.submitted_at, plan.deferred, plan.deferred_until = 100.25, True, 200.75
    return plan


def test_status_of_takes_each_field_from_the_plan_field_of_its_name() -> None:
    """Each PlanStatus field equals the plan's attribute of its name (next_seq: the reservation while unfinished)."""
    for state, next_seq in (("running", 40), ("succeeded", 9)):
        plan = busy_plan(state)
        status = status_of(plan)
        assert isinstance(status, PlanStatus)
        fields = msgspec.structs.asdict(status)
        assert fields.pop("plan_id") == plan.id
        assert fields.pop("next_seq") == next_seq
        for name, value in fields.items():
            assert value == getattr(plan, name), name
        assert status.history is not plan.history  # a copy: the plan's history grows after the record is taken
