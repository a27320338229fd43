"""The autoscaler with a fake clock: the desired count, delays, cooldown, no flapping, and its place in the core."""

from __future__ import annotations

import itertools
import random
import sys
from typing import Any

import pytest

from coordinator import Coordinator, CoreConfig
from coordinator.autoscaler import (
    UNFIT_POOL,
    AutoscaleConfig,
    Autoscaler,
    Decision,
    PoolNeeds,
    PoolSignal,
    pool_signals,
    unfit_idle,
)
from coordinator.io.ops.hooks import HookRunner
from protocol.messages import Capabilities, Event, Hello, Requirements, Submit, Subscribe


def run(scaler: Autoscaler, samples: list[tuple[float, int, int]], pool: str = "p") -> list[Decision]:
    """Feeds (time, ongoing, current) samples of one pool; returns every decision made."""
    decisions: list[Decision] = []
    for now, ongoing, current in samples:
        decisions += scaler.observe(now, {pool: PoolSignal(ongoing, current)})
    return decisions


def every(step_s: float, until_s: float, ongoing: int, current: int, start_s: float = 0.0) -> list[Any]:
    """Samples every ``step_s`` from ``start_s`` to ``until_s`` with a steady signal."""
    count = int((until_s - start_s) / step_s) + 1
    return [(start_s + i * step_s, ongoing, current) for i in range(count)]


def test_desired_is_ceil_of_ongoing_over_target_clamped() -> None:
    """desired = clamp(ceil(ongoing / target), min, max)."""
    scaler = Autoscaler(AutoscaleConfig(target_per_worker=4, min_workers=1, max_workers=5))
    assert [scaler.desired(n) for n in (0, 1, 4, 5, 8, 9, 100)] == [1, 1, 1, 2, 2, 3, 5]


def test_upscale_waits_for_the_signal_to_hold_the_delay() -> None:
    """A higher desired count is acted on only after it held upscale_delay_s; then the target moves."""
    scaler = Autoscaler(AutoscaleConfig(target_per_worker=2, upscale_delay_s=30, cooldown_s=0))
    assert run(scaler, every(1, 29, ongoing=8, current=1)) == []  # desired 4 from t=0 (target 1)
    [decision] = run(scaler, [(30.0, 8, 1)])
    assert (decision.action, decision.current, decision.desired, decision.held_s) == ("scale_up", 1, 4, 30.0)
    assert scaler.desired_replicas() == {"p": 4}
    assert run(scaler, every(1, 100, ongoing=8, current=1, start_s=31)) == []  # at the target: nothing more


def test_upscale_acts_on_the_level_that_held_the_whole_time() -> None:
    """When the signal varied during the wait, the decision is the smallest desired count seen."""
    scaler = Autoscaler(AutoscaleConfig(target_per_worker=1, upscale_delay_s=10, cooldown_s=0))
    samples = [(0.0, 6, 2), (3.0, 9, 2), (6.0, 4, 2), (10.0, 9, 2)]
    [decision] = run(scaler, samples)
    assert decision.desired == 4


def test_downscale_uses_its_own_longer_delay() -> None:
    """A lower desired count waits downscale_delay_s (600 s by default), not the upscale delay."""
    scaler = Autoscaler(AutoscaleConfig(target_per_worker=4))
    assert run(scaler, every(10, 590, ongoing=0, current=3)) == []
    [decision] = run(scaler, [(600.0, 0, 3)])
    assert (decision.action, decision.current, decision.desired) == ("scale_down", 3, 0)


def test_cooldown_spaces_actions_out() -> None:
    """After an action, the next one waits for the cooldown even when its own delay has passed."""
    scaler = Autoscaler(AutoscaleConfig(target_per_worker=1, upscale_delay_s=5, cooldown_s=60))
    [first] = run(scaler, every(1, 5, ongoing=3, current=1))
    assert first.at_s == 5 and first.desired == 3
    decisions = run(scaler, every(1, 70, ongoing=6, current=3, start_s=6))
    assert [(d.at_s, d.desired) for d in decisions] == [(65.0, 6)]


def test_a_noisy_signal_does_not_flap() -> None:
    """A load jittering around the threshold never holds long enough: at most one move, never back and forth."""
    rng = random.Random(7)
    scaler = Autoscaler(AutoscaleConfig(target_per_worker=4, upscale_delay_s=30, downscale_delay_s=600, cooldown_s=60))
    samples = [(float(t), rng.choice((7, 8, 9, 10)), 2) for t in range(3600)]  # desired flips between 2 and 3
    decisions = run(scaler, samples)
    assert len(decisions) <= 1
    assert all(d.action == "scale_up" for d in decisions)


def test_a_pool_that_disappears_scales_down_then_is_forgotten() -> None:
    """A pool with nothing ongoing any more is treated as zero load; at min_workers it is forgotten."""
    scaler = Autoscaler(AutoscaleConfig(target_per_worker=1, downscale_delay_s=10, cooldown_s=0))
    run(scaler, [(0.0, 2, 2)])
    decisions = [d for t in range(0, 12) for d in scaler.observe(float(t), {})]
    assert [(d.action, d.desired) for d in decisions] == [("scale_down", 0)]
    assert scaler.observe(20.0, {}) == [] and scaler.desired_replicas() == {}


def test_bad_settings_are_refused() -> None:
    """A non-positive target or min > max is refused with a message naming the setting."""
    with pytest.raises(ValueError, match="target per worker"):
        Autoscaler(AutoscaleConfig(target_per_worker=0))
    with pytest.raises(ValueError, match="min"):
        Autoscaler(AutoscaleConfig(min_workers=3, max_workers=2))


def test_core_sends_decisions_to_admin_followers_and_the_hook() -> None:
    """In the core, pools come from queued and leased plans; decisions go to admins following all, and to Effects."""
    config = CoreConfig(autoscale=AutoscaleConfig(target_per_worker=2, upscale_delay_s=5, cooldown_s=0, interval_s=1))
    ids = (f"p{i}" for i in itertools.count(1))
    core = Coordinator(config, new_id=lambda: next(ids))
    core.open_session(1, "worker", 0.0)
    caps = Capabilities(ops=["train"], tags=["gpu"], max_concurrency=1)
    core.receive(1, Hello(worker_id="w", capabilities=caps), 0.0)
    core.open_session(2, "client", 0.0, principal="alice")
    core.open_session(3, "client", 0.0, principal="root", admin=True)
    core.open_session(4, "client", 0.0, principal="bob")
    core.receive(3, Subscribe(req_id=1, all=True), 0.0)
    core.receive(4, Subscribe(req_id=1, all=True), 0.0)
    for n in range(6):
        core.receive(2, Submit(req_id=n + 1, op="train", subscribe=False), 0.0)
    core.take_effects()
    for now in range(0, 7):
        core.tick(float(now))
    effects = core.take_effects()
    needs = {"op": "train", "tags": [], "accelerator": None, "model": None, "min_gpu_memory_bytes": 0,
             "python_env": None, "gpus": 0, "gpu_share": False, "gpu_memory_bytes": 0, "gpu_model": ""}
    assert effects.decisions == [
        {"pool": "op=train", "action": "scale_up", "current": 1, "desired": 3, "ongoing": 6, "alive": 1,
         "at_s": 5.0, "held_s": 5.0, "workers": [], "needs": needs, "reason": ""}
    ]
    admin_events = [m for m in effects.sends.get(3, []) if isinstance(m, Event) and m.kind == "autoscale"]
    assert [(e.plan_id, e.data["desired"], e.seq) for e in admin_events] == [("", 3, 1)]
    assert not [m for m in effects.sends.get(4, []) if isinstance(m, Event) and m.kind == "autoscale"]
    assert core.autoscaler is not None and core.autoscaler.desired_replicas() == {"op=train": 3}


async def test_hook_runner_gives_the_decision_as_json_on_stdin(tmp_path: pytest.TempPathFactory) -> None:
    """The hook command runs once per decision and reads the decision as one JSON object on stdin."""
    out = tmp_path / "decision.json"  # type: ignore[operator]
    script = f"import json, sys; json.dump(json.load(sys.stdin), open({str(out)!r}, 'w'))"
    runner = HookRunner(f"{sys.executable} -c \"{script}\"", timeout_s=30)
    runner.run([{"pool": "op=train", "desired": 3}])
    await runner.close()
    assert (runner.runs, runner.failures) == (1, 0)
    assert out.read_text() == '{"pool": "op=train", "desired": 3}'


def scaling_core(*workers: tuple[str, list[str]]) -> Coordinator:
    """A core whose autoscaler samples every second (scale-down delay 10 s) with these (id, tags) echo workers."""
    config = AutoscaleConfig(upscale_delay_s=2, downscale_delay_s=10, cooldown_s=0, interval_s=1)
    ids = (f"p{i}" for i in itertools.count(1))
    core = Coordinator(CoreConfig(autoscale=config), new_id=lambda: next(ids))
    for session, (worker_id, tags) in enumerate(workers, start=10):
        core.open_session(session, "worker", 0.0)
        core.receive(session, Hello(worker_id=worker_id, capabilities=Capabilities(ops=["echo"], tags=tags)), 0.0)
    core.open_session(1, "client", 0.0, principal="alice")
    return core


def ticks(core: Coordinator, start_s: int, until_s: int) -> list[dict[str, Any]]:
    """The decisions of ticks once a second from ``start_s`` to ``until_s``."""
    core.take_effects()
    for now in range(start_s, until_s + 1):
        core.tick(float(now))
    return core.take_effects().decisions


def test_a_scale_up_says_what_the_waiting_plans_need() -> None:
    """The decision for plans requiring tags cpu and pool:cpu carries them (and the op) in its needs."""
    core = scaling_core()
    core.receive(1, Submit(req_id=1, op="echo", subscribe=False, requirements=Requirements(tags=["pool:cpu", "cpu"])),
                 0.0)
    [decision] = ticks(core, 0, 3)
    assert decision["action"] == "scale_up" and decision["pool"] == "op=echo tags=cpu,pool:cpu"
    assert decision["needs"]["tags"] == ["cpu", "pool:cpu"] and decision["needs"]["op"] == "echo"
    assert PoolNeeds.from_dict(decision["needs"]) == PoolNeeds(op="echo", tags=("cpu", "pool:cpu"))


def test_an_idle_provider_worker_that_cannot_run_what_waits_is_drained_after_the_downscale_delay() -> None:
    """auto-1 (tag local) idles while a plan needing tag gpu waits: after 10 s it is named for removal and
    drained; a worker the operator started (manual) is left alone."""
    core = scaling_core(("auto-1", ["local"]), ("manual", ["local"]))
    assert core.autoscaler is not None
    core.autoscaler.managed = frozenset({"auto-1"})
    core.receive(1, Submit(req_id=1, op="echo", subscribe=False, requirements=Requirements(tags=["gpu"])), 0.0)
    assert [d["pool"] for d in ticks(core, 0, 9)] == ["op=echo tags=gpu"]  # its scale-up, nothing removed yet
    [removal] = ticks(core, 10, 12)
    assert (removal["pool"], removal["action"], removal["workers"]) == (UNFIT_POOL, "scale_down", ["auto-1"])
    assert removal["held_s"] == 10.0 and "unable to run" in removal["reason"]
    assert core.registry.get("auto-1").draining and not core.registry.get("manual").draining
    assert ticks(core, 13, 40) == []  # named once


def test_a_provider_worker_that_can_run_what_waits_or_is_busy_is_not_unfit() -> None:
    """A managed worker that meets a pool with plans, or holds a lease, or when nothing waits: not unfit."""
    core = scaling_core(("fit", ["gpu"]), ("idle", ["local"]))
    assert core.autoscaler is not None
    registry = core.registry
    assert unfit_idle(registry, {}, {"fit", "idle"}, 0.0) == ()  # nothing waits
    core.receive(1, Submit(req_id=1, op="echo", subscribe=False, requirements=Requirements(tags=["gpu"])), 0.0)
    core.receive(1, Submit(req_id=2, op="echo", subscribe=False, requirements=Requirements(tags=["gpu"])), 0.0)
    core.receive(1, Submit(req_id=3, op="echo", subscribe=False, requirements=Requirements(tags=["nope"])), 0.0)
    signals = pool_signals(core.queue, registry, core.plans, 0.0)
    assert registry.get("fit").leases  # it runs the gpu plans; the 'nope' plan waits
    assert unfit_idle(registry, signals, {"fit", "idle"}, 0.0) == ("idle",)
    assert unfit_idle(registry, signals, {"fit"}, 0.0) == ()
