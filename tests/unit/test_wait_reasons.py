"""The waiting reason of a queued submit, cached per signature, follows every registry and drain change."""

from __future__ import annotations

import pytest

from protocol.messages import DrainWorker, Ok, Submit
from tests.unit.test_core import Harness
from tests.unit.test_operator import admin, ask


@pytest.fixture
def h() -> Harness:
    """A core with a fake clock (tests/unit/test_core.py's harness)."""
    return Harness()


def test_a_new_worker_changes_the_reason_of_the_next_submit(h: Harness) -> None:
    """After a registration the next queued submit is explained afresh, not from the cached reason."""
    h.worker("w1")
    c = h.client()
    h.submit(c)
    second = h.submit(c)
    assert h.core.plans[second].waiting_reason == "the only matching worker (w1) is at capacity"
    h.worker("w2", max_concurrency=0)
    third = h.submit(c)
    assert h.core.plans[third].waiting_reason == "all matching workers are at capacity"


def test_a_drain_changes_the_reason_of_the_next_submit(h: Harness) -> None:
    """A drain (no registry membership change) still drops the cached reason."""
    h.worker("w1")
    c = h.client()
    h.submit(c)
    second = h.submit(c)
    assert h.core.plans[second].waiting_reason == "the only matching worker (w1) is at capacity"
    ask(h, admin(h), DrainWorker(req_id=1, worker_id="w1"), Ok)
    assert h.core.plans[second].waiting_reason == "the only matching worker (w1) is draining"
    third = h.submit(c)
    assert h.core.plans[third].waiting_reason == "the only matching worker (w1) is draining"


def test_the_reason_of_an_unhandled_op_is_reused_and_then_corrected(h: Harness) -> None:
    """Plans of an op no worker handles share one reason until a worker for it registers."""
    c = h.client()
    first = h.submit(c, op="x")
    second = h.submit(c, op="x")
    assert h.core.plans[first].waiting_reason == h.core.plans[second].waiting_reason
    assert h.core.plans[second].waiting_reason == "no connected worker handles op 'x'"
    h.worker("w1", ops=["x"], max_concurrency=0)
    third = h.submit(c, op="x")
    assert h.core.plans[third].waiting_reason == "the only matching worker (w1) is at capacity"
    assert h.core.plans[first].waiting_reason == "the only matching worker (w1) is at capacity"


def test_submit_with_an_empty_plan_id_is_refused(h: Harness) -> None:
    """Submit(plan_id="") is invalid_argument: an empty id is not an idempotency key."""
    c = h.client()
    h.send(c, Submit(req_id=7, op="echo", plan_id=""))
    (reply,) = h.take(c)
    assert reply.code == "invalid_argument" and reply.req_id == 7 and "plan_id" in reply.message
    assert h.core.plans == {}
