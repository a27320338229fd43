"""The waiting reason of a queued submit, cached per signature, follows every registry and drain change."""

from __future__ import annotations

import pytest

from coordinator.placement.placer import PlacementConfig
from protocol.messages import DrainWorker, Ok, Requirements, Submit
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


def test_a_plan_requiring_a_pool_name_as_a_tag_is_told_to_use_pool(h: Harness) -> None:
    """Tag 'cpu' required while the workers carry pool:cpu (started with --pool cpu): the reason says --pool cpu."""
    h.worker("w1", tags=["pool:cpu"])
    c = h.client()
    plan = h.submit(c, requirements=Requirements(tags=["cpu"]))
    assert h.core.plans[plan].waiting_reason == (
        "no worker handling op 'echo' has tags [cpu]; workers of pool 'cpu' carry the tag pool:cpu, not 'cpu': "
        "submit with --pool cpu (the tag pool:cpu)")
    placed = h.submit(c, requirements=Requirements(tags=["pool:cpu"]))
    assert h.core.plans[placed].state == "leased"


def test_a_plan_requiring_a_pool_of_workers_that_only_carry_its_name_is_told_so(h: Harness) -> None:
    """pool:cpu required while the workers carry the plain tag cpu: the reason names both ways out."""
    h.worker("w1", tags=["cpu"])
    c = h.client()
    plan = h.submit(c, requirements=Requirements(tags=["pool:cpu"]))
    reason = h.core.plans[plan].waiting_reason
    assert reason is not None and reason.startswith("no worker handling op 'echo' has tags [pool:cpu]; workers "
                                                    "tagged 'cpu' are not in pool 'cpu'")
    assert "--tags cpu" in reason and "fleetwire worker --pool cpu" in reason


def test_a_cluster_shard_names_the_plans_pool_instead_of_saying_no_worker_is_connected() -> None:
    """In cluster mode a core sees one shard's workers: no worker there names the plan's pool, not "connected"."""
    shard = Harness(placement=PlacementConfig(cluster=True))
    c = shard.client()
    none = shard.submit(c)
    cpu = shard.submit(c, requirements=Requirements(tags=["pool:cpu", "gpu"]))
    assert shard.core.plans[none].waiting_reason == (
        "no worker of the default pool (workers with no tags) handles op 'echo': a plan with no tags waits for one; "
        "to run on the workers of pool NAME submit it with --pool NAME")
    assert shard.core.plans[cpu].waiting_reason == (
        "no worker of pool 'cpu' handles op 'echo': workers join it with `fleetwire worker --pool cpu`")
    shard.worker("w1", ops=["sleep"])  # a worker of another op: the reasons stay true
    assert shard.core.plans[none].waiting_reason.startswith("no worker of the default pool")
    single = Harness()  # one coordinator sees every worker: "no connected worker" is the truth there
    assert single.core.plans[single.submit(single.client())].waiting_reason == "no connected worker handles op 'echo'"
