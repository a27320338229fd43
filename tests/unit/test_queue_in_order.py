"""A queue group whose plans come in order (one priority, submit order: the throughput path) is kept as a sorted
list whose dead front is stepped over instead of popped off a heap; one pushed out of order makes it a heap again.
Either way the queue answers as its (priority, order) rule says."""

from __future__ import annotations

import heapq

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from coordinator.placement import plan_queue
from coordinator.placement.plan_queue import PlanQueue, Signature

SIGNATURES = [Signature(op="x"), Signature(op="x", tags=("a",))]

# ("push", plan, signature, priority, order) re-queues a plan; ("drop", plan) takes it out; ("best",) asks.
_STEP = st.one_of(
    st.tuples(st.just("push"), st.integers(0, 9), st.integers(0, 1), st.integers(0, 2), st.integers(0, 30)),
    st.tuples(st.just("drop"), st.integers(0, 9)),
    st.tuples(st.just("best")),
)


@settings(max_examples=400, deadline=None)
@given(st.lists(_STEP, max_size=60), st.booleans())
def test_the_queue_answers_by_priority_then_order(steps: list[tuple], rising: bool) -> None:
    """best_for, has_ahead and plans_in agree with the rule over the live plans, pushed in order or not."""
    queue = PlanQueue()
    live: dict[str, tuple[Signature, int, int, int]] = {}  # plan -> (signature, priority, order, push number)
    counter = pushes = 0
    for step in steps:
        if step[0] == "push":
            _, n, index, priority, order = step
            if rising:  # in order: one priority, each later than the last
                priority, counter = 0, counter + 1
                order = counter
            plan_id = f"p{n}"
            queue.push(plan_id, SIGNATURES[index], priority, order)
            pushes += 1  # equal (priority, order): the earlier push first
            live[plan_id] = (SIGNATURES[index], priority, order, pushes)
        elif step[0] == "drop":
            assert queue.discard(f"p{step[1]}") == (live.pop(f"p{step[1]}", None) is not None)
        keys = {plan_id: (-priority, order, push, plan_id) for plan_id, (_, priority, order, push) in live.items()}
        expected = min(keys.values())[3] if keys else None
        assert queue.best_for(lambda sig: True) == expected
        for signature in SIGNATURES:
            mine = sorted(key for plan_id, key in keys.items() if live[plan_id][0] == signature)
            assert queue.plans_in(signature) == [key[3] for key in mine]
            assert queue.has_ahead(signature, 1, 15) == any(key[:2] < (-1, 15) for key in mine)


def test_plans_in_order_leave_without_a_heappop(monkeypatch: pytest.MonkeyPatch) -> None:
    """5,000 plans queued in order and placed one by one: no heappop, and the list keeps no long dead front."""
    queue = PlanQueue()
    signature = SIGNATURES[0]

    def no_pop(heap: list) -> object:
        raise AssertionError("a heappop on an ordered group")

    monkeypatch.setattr(plan_queue.heapq, "heappop", no_pop)
    for order in range(5000):
        queue.push(f"p{order}", signature, 0, order)
    for order in range(4990):
        assert queue.best_for(lambda sig: True) == f"p{order}"
        queue.discard(f"p{order}")
    monkeypatch.undo()
    group = queue._groups[signature]
    assert len(group.heap) < 200  # the dead front let go as it grew
    queue.push("late", signature, 1, 0)  # out of order (a higher priority): a heap again, and first
    assert queue.best_for(lambda sig: True) == "late"
    assert queue.plans_in(signature) == ["late"] + [f"p{order}" for order in range(4990, 5000)]
    assert heapq.nsmallest(1, group.heap)[0][3] == "late"
