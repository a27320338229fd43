"""A worker's connect or disconnect looks only at the queued groups of its own ops (issue 17 finding 5).

Plans with distinct tag lists make one signature (group) each; before the op index every worker
(dis)connect re-explained every group and offered every group to the worker. The core with a fake
clock; ``explain_wait`` and ``Signature.admits`` are counted (the real functions still run).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from coordinator import scheduling
from coordinator.placement.plan_queue import Signature
from protocol.messages import Capabilities, Hello, Requirements, Submit
from tests.unit.test_core import Harness

N = 300  # queued plans, each with its own tag list (its own group)


@pytest.fixture
def counted(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, int]]:
    """Counts of explain_wait and Signature.admits calls while the test runs."""
    if not scheduling.__file__ or not scheduling.__file__.endswith(".py"):  # built with FLEETWIRE_MYPYC=1 (setup.py)
        pytest.skip("compiled callers call explain_wait and admits directly: a patched name counts nothing")
    counts = {"explain": 0, "admits": 0}
    explain, admits = scheduling.explain_wait, Signature.admits

    def counting_explain(*args: Any, **kwargs: Any) -> str:
        counts["explain"] += 1
        return explain(*args, **kwargs)

    def counting_admits(self: Signature, worker: Any) -> bool:
        counts["admits"] += 1
        return admits(self, worker)

    monkeypatch.setattr(scheduling, "explain_wait", counting_explain)
    monkeypatch.setattr(Signature, "admits", counting_admits)
    yield counts


def queue_distinct(h: Harness, op: str, n: int = N) -> list[str]:
    """``n`` queued plans of ``op``, each with a tag list of its own."""
    c = h.client("bob")
    for i in range(n):
        h.core.receive(c, Submit(req_id=i + 1, op=op, requirements=Requirements(tags=[f"t{i}"])), h.now)
    h.core.take_effects()
    return sorted(pid for pid, plan in h.core.plans.items() if plan.op == op)


def churn(h: Harness, times: int) -> None:
    """A worker of op 'echo' connects and disconnects ``times`` times (straight to the core: the
    harness's invariant check would count as visits too)."""
    caps = Capabilities(cpu_cores=1, ram_bytes=1 << 30, ops=["echo"], max_concurrency=1)
    for i in range(times):
        conn = 10_000 + i
        h.core.open_session(conn, "worker", h.now, address="10.0.0.9:4000")
        h.core.receive(conn, Hello(worker_id="churn", capabilities=caps), h.now)
        h.core.take_effects()
        h.core.close_session(conn, h.now)
        h.core.take_effects()


def test_a_worker_of_another_op_connects_and_leaves_without_visiting_the_groups(counted: dict[str, int]) -> None:
    """Hundreds of distinct groups under op 'nobody': a worker of op 'echo' coming and going costs none of them."""
    h = Harness()
    ids = queue_distinct(h, "nobody")
    reasons = {pid: h.core.plans[pid].waiting_reason for pid in ids}
    counted.update(explain=0, admits=0)
    churn(h, 5)
    assert counted["explain"] < 5 * 2 and counted["admits"] < 5 * 2  # not N per connect
    assert {pid: h.core.plans[pid].waiting_reason for pid in ids} == reasons


def test_a_worker_of_the_plans_op_still_changes_their_reason(counted: dict[str, int]) -> None:
    """The groups of the worker's op are re-explained at its connect and disconnect, each once."""
    h = Harness()
    ids = queue_distinct(h, "echo", n=20)
    assert h.core.plans[ids[0]].waiting_reason == "no connected worker handles op 'echo'"
    counted.update(explain=0)
    w = h.worker("w1", ops=("echo",))
    assert counted["explain"] == 20
    assert h.core.plans[ids[0]].waiting_reason.startswith("no worker handling op 'echo' has tags")
    h.close(w)
    assert h.core.plans[ids[0]].waiting_reason == "no connected worker handles op 'echo'"


def test_a_group_without_a_reason_yet_is_explained_at_any_workers_connect() -> None:
    """Restored plans keep their stored reason until a worker connects; then every such group is re-explained."""
    h = Harness()
    ids = queue_distinct(h, "nobody", n=3)
    queue = h.core.queue
    for signature in queue.signatures():
        queue.set_group_reason(signature, None)  # as after a restore (Scheduler.queue_restored)
    for pid in ids:
        h.core.plans[pid].waiting_reason = "stale"
    h.worker("w1", ops=("echo",))
    assert {h.core.plans[pid].waiting_reason for pid in ids} == {"no connected worker handles op 'nobody'"}
    assert queue.signatures(["echo"], unexplained=True) == []


def test_past_the_work_budget_reasons_are_caught_up_at_the_next_ticks(monkeypatch: pytest.MonkeyPatch) -> None:
    """A refresh that would tell hundreds of plans a new reason stops at its budget; each tick tells the next ones."""
    monkeypatch.setattr(scheduling, "WAIT_WORK_RATE", 100.0)
    monkeypatch.setattr(scheduling, "WAIT_WORK_BURST", 100)
    h = Harness()
    c = h.client()
    ids = [h.submit(c, requirements=Requirements(tags=["gpu"])) for _ in range(300)]
    ids += [h.submit(c, requirements=Requirements(tags=["tpu"])) for _ in range(10)]
    before = "no connected worker handles op 'echo'"

    def stale() -> int:
        return sum(h.core.plans[pid].waiting_reason == before for pid in ids)

    assert stale() == 310
    h.worker("w1")  # handles echo, has neither tag: every reason changes
    assert stale() == 310 - 99  # one unit for the group, 99 plans told
    ticks = 0
    while stale():
        left = stale()
        ticks += 1
        h.tick(h.now + 1.0)  # 100 units back
        assert left - stale() <= 100 and ticks <= 4
    assert h.core.plans[ids[-1]].waiting_reason == "no worker handling op 'echo' has tags [tpu]"


def test_a_flipping_reason_holds_only_the_newest_waiting_event() -> None:
    """A worker that comes and goes 50 times: the queued plan's held events do not grow with the flips."""
    h = Harness(worker_reconnect_rate=0)  # no reconnect budget (test_reconnect_budget.py): the flips are the point
    c = h.client()
    pid = h.submit(c, requirements=Requirements(tags=["gpu"]))
    for i in range(50):
        h.tick(float(i))  # a second apart: within the work budget
        w = h.worker("w1")
        h.close(w)
    plan = h.core.plans[pid]
    assert [e.kind for e in plan.events].count("waiting") == 1 and plan.next_seq > 100
    assert plan.events[-1].data == {"reason": plan.waiting_reason}


def test_a_worker_is_offered_only_the_groups_whose_first_tag_it_has(counted: dict[str, int]) -> None:
    """Hundreds of groups under the worker's op, each needing its own tag: the worker checks the few it may run."""
    h = Harness()
    ids = queue_distinct(h, "echo")
    counted.update(admits=0)
    churn(h, 5)  # no tags: none of them
    assert counted["admits"] < 5 * 2
    h.worker("tagged", tags=["t7", "t250"], max_concurrency=4)
    leased = [pid for pid in ids if h.state(pid) == "leased"]
    assert sorted(h.core.plans[pid].requirements.tags[0] for pid in leased) == ["t250", "t7"]
