"""Per-plan GPU devices in the core (fake clock): free-device accounting, wait reasons, release on every ending."""

from __future__ import annotations

from typing import Any

import pytest

from protocol import errors
from protocol.messages import (
    Accept,
    Assign,
    Cancel,
    Capabilities,
    Done,
    Error,
    Goodbye,
    GpuInfo,
    Hello,
    ListWorkers,
    Reject,
    Resources,
    RunningPlan,
    Submit,
    Workers,
)
from tests.unit.test_core import Harness, only


def gpu_worker(h: Harness, worker_id: str, gpus: list[tuple[int, str]], *, slots: int = 8, share: int = 1,
               running: list[RunningPlan] | None = None) -> int:
    """Register a worker with ``gpus`` as (memory GB, model) and ``slots`` plan slots."""
    conn = next(h._conns)
    h.core.open_session(conn, "worker", h.now, address=f"10.0.0.{conn}:4000")
    caps = Capabilities(
        cpu_cores=8, ops=["shell"], max_concurrency=slots, gpu_share=share, accelerator="gpu",
        gpus=[GpuInfo(name=model, memory_bytes=gb * 10**9, index=i) for i, (gb, model) in enumerate(gpus)],
    )
    h.send(conn, Hello(worker_id=worker_id, capabilities=caps, running=running or [],
                       session_secret=h.secrets.get(worker_id, "")))
    return conn


def gpu_plan(h: Harness, client: int, gpus: float, **resources: Any) -> str:
    return h.submit(client, "shell", resources=Resources(gpus=gpus, **resources))


def assigns(h: Harness, conn: int) -> list[Assign]:
    return [m for m in h.take(conn) if isinstance(m, Assign)]


@pytest.fixture
def h() -> Harness:
    return Harness()


def test_each_plan_gets_distinct_devices_and_the_fifth_waits_saying_why(h: Harness) -> None:
    """Four 1-GPU plans take the four devices; a fifth waits naming what is missing, and runs on a release."""
    w = gpu_worker(h, "w1", [(80, "H100")] * 4)
    c = h.client()
    ids = [gpu_plan(h, c, 1) for _ in range(4)]
    sent = assigns(h, w)
    assert sorted(d for a in sent for d in a.devices) == [0, 1, 2, 3]
    assert all(a.resources is not None and a.resources.gpus == 1 for a in sent)
    fifth = gpu_plan(h, c, 1)
    assert h.state(fifth) == "queued"
    assert h.core.plans[fifth].waiting_reason == "needs 1 free GPU; largest free: 0 on w1"
    freed = next(a for a in sent if a.plan_id == ids[2]).devices
    h.send(w, Accept(plan_id=ids[2], attempt=1))
    h.send(w, Done(plan_id=ids[2], attempt=1, outcome="succeeded"))
    again = only(h.take(w), Assign)
    assert again.plan_id == fifth and again.devices == freed


def test_memory_and_model_filter_devices(h: Harness) -> None:
    """A plan needing ≥ 40 GB of an H100 gets only such devices; the waiting reason names the largest free count."""
    w = gpu_worker(h, "w3", [(24, "NVIDIA A10"), (80, "NVIDIA H100 80GB HBM3"), (80, "NVIDIA H100 80GB HBM3")])
    c = h.client()
    first = gpu_plan(h, c, 1, gpu_memory_gb=40, accelerator="h100")
    assert only(h.take(w), Assign).devices in ([1], [2])
    second = gpu_plan(h, c, 2, gpu_memory_gb=40, accelerator="H100")
    assert h.core.plans[second].waiting_reason == "needs 2 free GPUs with ≥ 40 GB (h100); largest free: 1 on w3"
    h.send(w, Done(plan_id=first, attempt=1, outcome="succeeded"))
    assert sorted(only(h.take(w), Assign).devices) == [1, 2]


def test_more_gpus_than_any_worker_names_the_largest(h: Harness) -> None:
    """A plan asking more devices than any worker has waits with a reason naming the largest worker."""
    gpu_worker(h, "small", [(80, "H100")] * 2)
    gpu_worker(h, "big", [(80, "H100")] * 4)
    c = h.client()
    plan = gpu_plan(h, c, 8)
    assert h.core.plans[plan].waiting_reason == "needs 8 GPUs; the largest matching worker is big with 4"


@pytest.mark.parametrize(
    ("resources", "field"),
    [
        (Resources(gpus=-1), "resources.gpus must be >= 0"),
        (Resources(gpus=1.5), "resources.gpus must be a whole number"),
        (Resources(gpus=0.5), "resources.share=true"),
        (Resources(gpus=65), "resources.gpus must be at most 64"),
        (Resources(gpus=1, gpu_memory_gb=-2), "resources.gpu_memory_gb"),
        (Resources(gpu_memory_gb=40), "need resources.gpus >= 1"),
    ],
)
def test_bad_resources_are_refused_at_submit(h: Harness, resources: Resources, field: str) -> None:
    """Negative, fractional-unshared or absurd device counts are refused: invalid_argument naming the field."""
    c = h.client()
    h.send(c, Submit(req_id=99, op="shell", resources=resources))
    error = only(h.take(c), Error)
    assert error.code == errors.INVALID_ARGUMENT and field in error.message
    assert not h.core.plans


def test_shared_fraction_runs_only_where_devices_are_shared(h: Harness) -> None:
    """gpus=0.5 with share waits on a worker without --gpu-share, and two share one device where K=2."""
    plain = gpu_worker(h, "plain", [(80, "H100")])
    c = h.client()
    first = gpu_plan(h, c, 0.5, share=True)
    assert "no matching worker shares its GPUs" in (h.core.plans[first].waiting_reason or "")
    shared = gpu_worker(h, "shared", [(80, "H100")], share=2)
    second = gpu_plan(h, c, 0.5, share=True)
    got = assigns(h, shared)
    assert [a.devices for a in got] == [[0], [0]] and {a.plan_id for a in got} == {first, second}
    assert not assigns(h, plain)


@pytest.mark.parametrize("ending", ["succeeded", "failed", "cancelled", "reject", "cancel", "goodbye", "reaped"])
def test_devices_are_released_however_the_lease_ends(h: Harness, ending: str) -> None:
    """Done of every outcome, a reject, a cancel, a worker leaving or being reaped: the devices are free again."""
    w = gpu_worker(h, "w1", [(80, "H100")] * 2)
    c = h.client()
    plan = gpu_plan(h, c, 2)
    assert only(h.take(w), Assign).devices == [0, 1]
    record = h.core.registry.get("w1")
    assert record.gpus_free() == 0
    if ending in ("succeeded", "failed", "cancelled"):
        h.send(w, Accept(plan_id=plan, attempt=1))
        h.send(w, Done(plan_id=plan, attempt=1, outcome=ending))  # type: ignore[arg-type]
    elif ending == "reject":
        h.send(w, Reject(plan_id=plan, attempt=1, code="rejected", reason="busy"))
    elif ending == "cancel":
        h.send(c, Cancel(plan_id=plan, req_id=7))
        h.send(w, Done(plan_id=plan, attempt=1, outcome="cancelled"))
    elif ending == "goodbye":
        h.send(w, Goodbye(reason="stopping"))
    else:
        h.tick(1000.0)
    if "w1" in h.core.registry:
        assert h.core.registry.get("w1").gpus_free() == 2
        assert not h.core.registry.get("w1").gpu_held


def test_reconnect_keeps_the_devices_its_running_plans_hold(h: Harness) -> None:
    """A worker that reconnects still running a plan keeps that plan's devices counted; a new plan gets the others."""
    w = gpu_worker(h, "w1", [(80, "H100")] * 2)
    c = h.client()
    plan = gpu_plan(h, c, 1)
    held = only(h.take(w), Assign).devices
    h.send(w, Accept(plan_id=plan, attempt=1))
    h.close(w)
    w = gpu_worker(h, "w1", [(80, "H100")] * 2, running=[RunningPlan(plan, 1, devices=held)])
    gpu_plan(h, c, 1)
    other = only(h.take(w), Assign).devices
    assert set(other).isdisjoint(held)


def test_workers_listing_shows_devices_in_use(h: Harness) -> None:
    """list_workers reports how many plans hold each device."""
    gpu_worker(h, "w1", [(80, "H100")] * 3)
    c = h.client()
    gpu_plan(h, c, 2)
    h.send(c, ListWorkers(req_id=5))
    row = only(h.take(c), Workers).workers[0]
    assert sorted(row.gpu_use) == [0, 1, 1]
