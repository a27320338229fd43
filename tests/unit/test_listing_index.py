"""A client's list_plans walks only its own plans (coordinator/operator_requests.py, issue 17 finding 11).

The core with a fake clock: what a listing is charged, and that it stays exact while plans are
submitted, forgotten by retention and their ids reused between listings.
"""

from __future__ import annotations

from protocol.messages import Assign, Cancel, Done, ListPlans, Plans, Submit
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
    h.submit_all(bob, ({} for _ in range(2_000)))  # one batch: the harness's invariant checked once
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


def counted(h: Harness, conn: int) -> tuple[dict[str, int], int, list[str]]:
    """A listing's counts, total and queue."""
    h.send(conn, ListPlans(req_id=3, limit=50))
    reply = only(h.take(conn), Plans)
    return reply.counts, reply.total, reply.queue


def truth(h: Harness, owner: str) -> dict[str, int]:
    """``owner``'s plans counted by state, the slow way."""
    counts: dict[str, int] = {}
    for plan in h.core.plans.values():
        if plan.owner == owner:
            counts[plan.state] = counts.get(plan.state, 0) + 1
    return counts


def test_a_clients_counts_and_queue_follow_every_transition_without_a_walk() -> None:
    """Counts and queue from the owner's tally match a full count through run, done, cancel, requeue and forgetting."""
    h = Durable(plan_retention_s=100.0)
    c, w, first = running_plan(h, plan_id="job-1")
    assert counted(h, c)[0] == truth(h, "alice") == {"running": 1}  # the listing tallies what exists
    waiting = [h.submit(c, op="echo", priority=p) for p in (0, 5, 0)]  # the worker is busy: queued
    assert counted(h, c) == (truth(h, "alice"), 4, [waiting[1], waiting[0], waiting[2]])  # priority, then age
    h.send(w, Done(plan_id=first, attempt=1, outcome="succeeded", result=1, seq=2))  # the next one starts
    assert counted(h, c)[0] == truth(h, "alice") == {"succeeded": 1, "leased": 1, "queued": 2}
    h.send(c, Cancel(req_id=9, plan_id=waiting[2]))
    assert counted(h, c)[0] == truth(h, "alice")
    h.close(w)
    h.tick(h.now + 60.0)  # the worker is reaped: its running plan goes back to the queue
    counts, total, queue = counted(h, c)
    assert counts == truth(h, "alice") and total == sum(counts.values()) and set(queue) == {waiting[0], waiting[1]}
    h.tick(h.now + 200.0)  # the finished ones are past their retention: forgotten
    assert "job-1" not in h.core.plans
    assert counted(h, c)[0] == truth(h, "alice")


def test_a_listing_page_walks_only_the_page_not_all_of_its_plans() -> None:
    """A client with 2,000 finished plans listing 10 is charged for about the page, not for 2,000 rows."""
    h = Harness()
    w, c = h.worker("w1", max_concurrency=1), h.client()
    h.take(w)
    for i in range(2_000):  # straight to the core; the harness's invariant is checked once, after the loop
        h.core.receive(c, Submit(req_id=100_000 + i, op="echo"), h.now)
        assign = only(h.core.take_effects().sends[w], Assign)
        done = Done(plan_id=assign.plan_id, attempt=assign.attempt, outcome="succeeded", result=0, seq=1)
        h.core.receive(w, done, h.now)
    h._pump()
    h.take(c)
    counted(h, c)  # the first listing indexes the plans
    before = h.core.outbox.work
    h.send(c, ListPlans(req_id=4, limit=10))
    reply = only(h.take(c), Plans)
    assert len(reply.plans) == 10 and reply.total == 2_000 and reply.counts == {"succeeded": 2_000}
    assert reply.next_cursor
    assert h.core.outbox.work - before < 100  # was > 2,000: every plan walked for the counts
