"""A client's list_plans walks only its own plans (coordinator/operator_requests.py, issue 17 finding 11).

The core with a fake clock: what a listing is charged, and that it stays exact while plans are
submitted, forgotten by retention and their ids reused between listings.
"""

from __future__ import annotations

from protocol.messages import Done, ListPlans, Plans
from tests.unit.test_core import Harness, only
from tests.unit.test_durability_core import Durable, running_plan
from tests.unit.test_operator import admin


def listed(h: Harness, conn: int) -> list[str]:
    h.send(conn, ListPlans(req_id=1, limit=10_000))
    return [p.id for p in only(h.take(conn), Plans).plans]


def test_a_clients_listing_is_charged_its_own_plans_not_everyones() -> None:
    """Next to bob's 2,000 plans, alice's listing of her 3 costs a few work units; an admin's still sees all."""
    h = Harness()
    bob, alice = h.client("bob"), h.client("alice")
    for _ in range(2_000):
        h.submit(bob)
    mine = [h.submit(alice) for _ in range(3)]
    h.take(alice)
    before = h.core.outbox.work
    assert listed(h, alice) == mine[::-1]
    assert h.core.outbox.work - before < 100  # was >= 2,003: one unit per plan of every principal
    root = admin(h)
    h.send(root, ListPlans(req_id=2, limit=10_000))
    assert only(h.take(root), Plans).total == 2_003


def test_a_listing_stays_exact_as_plans_come_are_forgotten_and_ids_come_back() -> None:
    """Plans submitted between listings appear, forgotten ones go, a reused id is listed once, newest first."""
    h = Durable(plan_retention_s=100.0)
    c, w, first = running_plan(h, plan_id="job-1")
    h.send(w, Done(plan_id=first, attempt=1, outcome="succeeded", result=7, seq=2))
    other = h.client("bob")
    h.submit(other)
    assert listed(h, c) == ["job-1"]
    second = h.submit(c, op="nobody")
    assert listed(h, c) == [second, "job-1"]
    h.tick(101.0)  # job-1 is past its retention: forgotten
    assert "job-1" not in h.core.plans
    assert listed(h, c) == [second]
    h.submit(c, op="nobody", plan_id="job-1")  # the id again: a new plan, the newest
    assert listed(h, c) == ["job-1", second]
    assert listed(h, other) != [] and "job-1" not in listed(h, other)
