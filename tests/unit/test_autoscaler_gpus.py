"""The autoscaler and device needs (fake clock): GPU pools are their own, sized by what a provisioned worker has."""

from __future__ import annotations

import itertools

from coordinator import Coordinator, CoreConfig
from coordinator.autoscaler import AutoscaleConfig, Autoscaler, PoolSignal
from protocol.messages import Capabilities, GpuInfo, Hello, Resources, Submit


def core_with(config: AutoscaleConfig, *workers: tuple[str, Capabilities]) -> Coordinator:
    """A core with an autoscaler (samples every second) and these workers registered at t=0."""
    ids = (f"p{i}" for i in itertools.count(1))
    core = Coordinator(CoreConfig(autoscale=config), new_id=lambda: next(ids))
    for session, (worker_id, caps) in enumerate(workers, start=10):
        core.open_session(session, "worker", 0.0)
        core.receive(session, Hello(worker_id=worker_id, capabilities=caps), 0.0)
    core.open_session(1, "client", 0.0, principal="alice")
    return core


def submit(core: Coordinator, count: int, gpus: float = 0) -> None:
    """``count`` python plans, each holding ``gpus`` devices."""
    resources = Resources(gpus=gpus) if gpus else None
    for n in range(count):
        core.receive(1, Submit(req_id=n + 1, op="python", subscribe=False, resources=resources), 0.0)


def decisions(core: Coordinator, until_s: int) -> list[dict[str, object]]:
    """The decisions the core makes ticking once a second up to ``until_s``."""
    core.take_effects()
    for now in range(0, until_s + 1):
        core.tick(float(now))
    return core.take_effects().decisions


CPU = Capabilities(ops=["python"], max_concurrency=8)
FAST = {"upscale_delay_s": 2, "cooldown_s": 0, "interval_s": 1}


def test_per_worker_is_bounded_by_the_devices_a_provisioned_worker_has() -> None:
    """Plans of 2 GPUs on 4-GPU workers: two per worker; without worker_gpus, the plain target; too few: never."""
    four = Autoscaler(AutoscaleConfig(target_per_worker=4, worker_gpus=4))
    assert [four.desired(n, gpus=2) for n in (1, 2, 3, 6)] == [1, 1, 2, 3]
    assert four.desired(6) == 2  # plans without devices: target_per_worker
    assert Autoscaler(AutoscaleConfig(target_per_worker=4)).desired(6, gpus=2) == 2
    one = Autoscaler(AutoscaleConfig(target_per_worker=4, worker_gpus=1, upscale_delay_s=0, cooldown_s=0))
    assert one.observe(0.0, {"op=python gpus=2": PoolSignal(ongoing=3, current=0, gpus=2)}) == []
    assert one.unprovisionable() == {"op=python gpus=2": 2}


def test_a_queued_two_gpu_plan_scales_up_a_pool_of_its_own_ignoring_cpu_workers() -> None:
    """A queued gpus=2 plan is a pool 'op=python gpus=2' of 0 workers (the CPU worker is not counted): scale up."""
    core = core_with(AutoscaleConfig(target_per_worker=4, worker_gpus=2, **FAST), ("cpu", CPU))
    submit(core, 1, gpus=2)
    [decision] = decisions(core, 3)
    assert (decision["pool"], decision["action"], decision["alive"], decision["current"], decision["desired"]) == (
        "op=python gpus=2", "scale_up", 0, 0, 1)


def test_a_pool_no_provisioned_worker_could_serve_is_not_scaled() -> None:
    """worker_gpus=1 and plans needing 2: no decision, and the pool is named as unprovisionable."""
    core = core_with(AutoscaleConfig(target_per_worker=4, worker_gpus=1, **FAST), ("cpu", CPU))
    submit(core, 3, gpus=2)
    assert decisions(core, 5) == []
    assert core.autoscaler is not None and core.autoscaler.unprovisionable() == {"op=python gpus=2": 2}


def test_leased_gpu_plans_count_in_their_gpu_pool_with_the_gpu_worker_only() -> None:
    """Running gpus=1 plans count in 'op=python gpus=1', whose only member is the GPU worker."""
    gpus = [GpuInfo(name="H100", index=i) for i in range(4)]
    gpu_caps = Capabilities(ops=["python"], max_concurrency=4, gpus=gpus)
    core = core_with(AutoscaleConfig(target_per_worker=1, worker_gpus=4, **FAST), ("cpu", CPU), ("gpu", gpu_caps))
    submit(core, 4, gpus=1)  # all four leased on the GPU worker
    core.take_effects()
    core.tick(0.0)
    scaler = core.autoscaler
    assert scaler is not None
    assert scaler.members("op=python gpus=1") == ("gpu",)
    made = decisions(core, 3)
    assert [(d["pool"], d["current"], d["desired"]) for d in made] == [("op=python gpus=1", 1, 4)]
