"""Finished plans count against their owner's byte budget (issue 17 finding 3, coordinator/retention.py).

A principal's queued, running *and* retained plans share ``--max-bytes-per-client``: past it, that
principal's own oldest finished plans are forgotten (never another's, never its latest). The core
with a fake clock.
"""

from __future__ import annotations

from typing import Any

from protocol import errors
from protocol.messages import Accept, Assign, Done, Error, GetPlan, PlanReply
from tests.unit.test_core import Harness, only

RESULT = "r" * 100_000


def finish(h: Harness, client: int, worker: int, result: Any = RESULT) -> str:
    """Submit a plan from ``client``, run it on ``worker`` and finish it with ``result``."""
    plan_id = h.submit(client)
    assign = only(h.take(worker), Assign)
    h.send(worker, Accept(plan_id=plan_id, attempt=assign.attempt, seq=1))
    h.send(worker, Done(plan_id=plan_id, attempt=assign.attempt, outcome="succeeded", result=result, seq=2))
    assert h.state(plan_id) == "succeeded"
    return plan_id


def found(h: Harness, client: int, plan_id: str) -> bool:
    """Whether ``get_plan`` still finds the plan (False: plan_not_found)."""
    h.take(client)
    h.send(client, GetPlan(req_id=99, plan_id=plan_id))
    (reply,) = [m for m in h.take(client) if isinstance(m, PlanReply | Error)]
    if isinstance(reply, Error):
        assert reply.code == errors.PLAN_NOT_FOUND
        return False
    return True


def test_past_its_budget_a_principals_oldest_finished_plans_are_forgotten_not_anothers() -> None:
    """Finished plans with 100 KB results: the owner keeps what fits its budget, newest first; others keep theirs."""
    h = Harness(max_bytes_per_client=700_000)
    w = h.worker("w1")
    bob = h.client("bob")
    bobs = finish(h, bob, w)
    alice = h.client("alice")
    ids = [finish(h, alice, w) for _ in range(8)]
    budget = h.core.quota.max_bytes
    assert 0 < h.core.retention.principal_bytes("alice") <= budget
    kept = [pid for pid in ids if found(h, alice, pid)]
    assert kept == ids[len(ids) - len(kept):] and 1 < len(kept) < len(ids)  # the newest, in order
    assert h.core.counters["plans_forgotten.principal"] == len(ids) - len(kept)
    assert found(h, bob, bobs) and h.core.retention.principal_bytes("bob") > 100_000


def test_the_latest_finished_plan_is_kept_even_when_it_alone_is_over_the_budget() -> None:
    """A result bigger than the whole budget is still there to fetch; the next plan's end forgets it."""
    h = Harness(max_bytes_per_client=50_000)
    w = h.worker("w1")
    alice = h.client()
    first = finish(h, alice, w)
    assert found(h, alice, first)
    second = finish(h, alice, w)
    assert not found(h, alice, first) and found(h, alice, second)


def test_unfinished_plans_take_room_from_finished_ones_at_the_next_tick() -> None:
    """New queued plans share the budget: the owner's oldest finished plans make room at the reaper's tick."""
    h = Harness(max_bytes_per_client=700_000)
    w = h.worker("w1")
    alice = h.client()
    ids = [finish(h, alice, w) for _ in range(2)]
    assert all(found(h, alice, pid) for pid in ids)
    h.submit(alice, op="nobody", args="a" * 400_000)  # queued: no worker runs "nobody"
    h.tick(1.0)
    assert not found(h, alice, ids[0]) and found(h, alice, ids[1])
    assert h.core.retention.principal_bytes("alice") + h.core.quota.held_bytes("alice") <= h.core.quota.max_bytes


def test_without_a_byte_budget_finished_plans_are_not_charged() -> None:
    """--max-bytes-per-client 0 leaves finished plans to the retention's own bounds."""
    h = Harness(max_bytes_per_client=0)
    w = h.worker("w1")
    alice = h.client()
    ids = [finish(h, alice, w) for _ in range(8)]
    assert all(found(h, alice, pid) for pid in ids) and h.core.retention.principal_bytes("alice") == 0
