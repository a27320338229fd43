"""One principal's plans wait in the plan queue's own heaps; the fair order takes them when another comes."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from coordinator.placement.fair_queue import FairQueue
from coordinator.placement.fairshare import SLOT, Capacity
from coordinator.placement.plan_queue import Signature
from coordinator.teams import Member, Team, TeamBook
from protocol.messages import Requirements

SIGNATURES = [Signature.of("work", Requirements(tags=[f"t{i}"])) for i in range(3)]


def test_a_lone_principals_plans_wait_without_the_fair_order() -> None:
    """While every queued plan is alice's, the plan queue keeps them; bob's plan hands them to the fair order."""
    queue = FairQueue(capacity=Capacity(0.0, 2.0, 0.0))
    for order in range(3):
        queue.push(f"a{order}", SIGNATURES[0], 0, order, "alice")
    assert queue.order is None and queue.solo == "alice" and queue.owner_of("a1") == "alice"
    assert queue.shares.principal_account("alice").waiting == 1 and queue.waiting_of("alice") == 3
    queue.push("b0", SIGNATURES[0], 0, 3, "bob")
    assert queue.order is queue.fair and queue.solo is None and queue.owner_of("a1") == "alice"
    assert queue.shares.principal_account("alice").waiting == 1 and queue.waiting_of("alice") == 3
    queue.discard("a0")
    queue.started("alice", SLOT, 1.0)
    assert queue.best_for(lambda sig: True) == "b0"  # alice holds a slot, bob none
    for plan_id in ("b0", "a1", "a2"):
        queue.discard(plan_id)
    assert queue.order is None and len(queue) == 0  # empty: the next lone principal's plans need no order
    assert not queue.shares.principal_account("alice").waiting


def quota_book() -> TeamBook:
    """A book with a quota (of a team nobody is in): the fair order never leaves the queue's plans to it."""
    return TeamBook([Team("elsewhere", max_running=1)], {"x": Member("elsewhere")})


@settings(max_examples=100, deadline=None)
@given(ops=st.lists(st.tuples(st.sampled_from(["push", "push", "take", "end", "drop", "ahead", "forgive"]),
                              st.integers(0, 20), st.integers(0, 2), st.sampled_from(["alice", "alice", "bob"])),
                    max_size=100))
def test_the_queue_without_its_order_picks_what_the_order_picks(ops: list[tuple[str, int, int, str]]) -> None:
    """Whatever the pushes, takes, ends and drops of one or two principals: a queue that keeps a lone principal's
    plans itself picks, orders and counts as one whose fair order keeps every plan."""
    solo, fair = FairQueue(capacity=Capacity(0.0, 4.0, 0.0)), FairQueue(quota_book(), Capacity(0.0, 4.0, 0.0))
    running: list[str] = []
    order, now = 0, 0.0
    for op, number, prio, owner in ops:
        now += 0.5
        plan_id = f"{owner}{number}"
        signature = SIGNATURES[number % 3] if op != "forgive" else SIGNATURES[0].avoiding(["w"])
        if op in ("push", "forgive"):
            order += 1
            alone = solo.push(plan_id, signature, prio, order, owner), fair.push(plan_id, signature, prio, order, owner)
            assert alone[0] == alone[1]  # whether the plan is its group's only one
        elif op == "drop":
            assert solo.discard(plan_id) == fair.discard(plan_id)
        elif op == "ahead":
            assert solo.has_ahead(signature, prio, order, owner) == fair.has_ahead(signature, prio, order, owner)
        elif op == "take":
            picked = solo.best_for(lambda sig: True)
            assert picked == fair.best_for(lambda sig: True)
            if picked is not None:
                assert solo.owner_of(picked) == fair.owner_of(picked)
                for queue in (solo, fair):
                    taken = queue.owner_of(picked)
                    assert taken is not None
                    queue.discard(picked)
                    queue.started(taken, SLOT, now)
                running.append(picked)
        elif running:  # end
            ended = running.pop(number % len(running))
            who = "alice" if ended.startswith("alice") else "bob"
            solo.ended(who, SLOT, now)
            fair.ended(who, SLOT, now)
        if op == "forgive" or number == 7:
            assert solo.forgive("w") == fair.forgive("w")
        assert len(solo) == len(fair)
        for name in ("alice", "bob"):
            assert solo.waiting_of(name) == fair.waiting_of(name)
            mine, theirs = solo.shares.principal_account(name), fair.shares.principal_account(name)
            assert (mine.waiting, mine.running, mine.active) == (theirs.waiting, theirs.running, theirs.active)
    for signature in SIGNATURES:
        assert solo.plans_in(signature) == fair.plans_in(signature)
