"""The provisioning autoscaler on a fake clock: removal choice, rate limit, backoff, drain, remove_worker."""

from __future__ import annotations

from typing import Any

import pytest

from coordinator.autoscaler import AutoscaleConfig, Autoscaler, Backoff, PoolSignal, drained_out, pick_removals
from protocol import errors
from protocol.messages import Accept, Cancel, Done, Drain, Error, Heartbeat, Load, Ok, RemoveWorker
from tests.unit.test_core import Harness, only
from tests.unit.test_operator import admin, ask


def test_rate_limit_caps_each_scale_up_at_max_step() -> None:
    """A scale-up adds at most max_step workers per action; the rest comes after the cooldown."""
    scaler = Autoscaler(AutoscaleConfig(target_per_worker=1, upscale_delay_s=0, cooldown_s=10, max_step=2))
    first = scaler.observe(0.0, {"p": PoolSignal(8, 1)})
    assert [(d.current, d.desired) for d in first] == [(1, 3)]
    assert scaler.observe(5.0, {"p": PoolSignal(8, 3)}) == []  # cooldown
    second = scaler.observe(10.0, {"p": PoolSignal(8, 3)})
    assert [(d.current, d.desired) for d in second] == [(3, 5)]


def test_bad_provisioning_settings_are_refused() -> None:
    """A negative max_step or drain deadline is refused naming the setting."""
    with pytest.raises(ValueError, match="max_step"):
        AutoscaleConfig(max_step=-1).check()
    with pytest.raises(ValueError, match="drain deadline"):
        AutoscaleConfig(drain_deadline_s=float("nan")).check()


def test_backoff_doubles_to_its_cap_and_resets_on_success() -> None:
    """Each failure in a row doubles the wait (fake clock) up to cap_s; a success resets it."""
    backoff = Backoff(base_s=1, cap_s=5)
    assert [backoff.failed(0.0) for _ in range(5)] == [1, 2, 4, 5, 5]
    assert not backoff.ready(4.9) and backoff.ready(5.0)
    backoff.succeeded()
    assert backoff.ready(0.0) and backoff.failed(10.0) == 1


def _busy_core(**config: Any) -> tuple[Harness, dict[str, int]]:
    """Three echo workers: w2 running p1 since t=0, w3 running p2 since t=4, w1 idle; now is t=5."""
    h = Harness(**config)
    c = h.client()
    conns = {"w2": h.worker("w2")}
    h.send(conns["w2"], Accept(plan_id=h.submit(c), attempt=1))
    h.now = 4.0
    conns["w3"] = h.worker("w3")
    h.send(conns["w3"], Accept(plan_id=h.submit(c), attempt=1))
    h.now = 5.0
    conns["w1"] = h.worker("w1")
    for conn in conns.values():
        h.send(conn, Heartbeat(load=Load()))
    assert (h.core.plans["p1"].worker_id, h.core.plans["p2"].worker_id) == ("w2", "w3")
    return h, conns


def test_pick_removals_takes_idle_workers_first_then_the_least_work_lost() -> None:
    """Idle first; among busy ones, the one whose plans ran the shortest (least work lost)."""
    h, _ = _busy_core()
    workers = list(h.core.registry)
    assert pick_removals(workers, 1, h.core.plans, 5.0) == ["w1"]
    assert pick_removals(workers, 2, h.core.plans, 5.0) == ["w1", "w3"]  # p2 ran 1 s, p1 5 s
    assert pick_removals(workers, 3, h.core.plans, 5.0) == ["w1", "w3", "w2"]
    assert pick_removals(workers, 0, h.core.plans, 5.0) == []


def test_scale_down_names_its_workers_drains_them_and_says_when_they_drained_out() -> None:
    """The core's scale-down decision lists the workers it removes (idle first), drains them with the
    configured deadline, and drained_out turns true once their plans end."""
    h, conns = _busy_core(autoscale=AutoscaleConfig(
        target_per_worker=1, min_workers=1, downscale_delay_s=0, upscale_delay_s=0, cooldown_s=0, interval_s=0,
        drain_deadline_s=30,
    ))
    h.take(conns["w1"])
    h.send(conns["w2"], Done(plan_id="p1", attempt=1, outcome="succeeded"))  # 1 ongoing (p2): desired 1 of 3
    h.now = 6.0
    h.core.tick(6.0)
    effects = h.core.take_effects()
    for conn_id, msgs in effects.sends.items():
        h.inbox.setdefault(conn_id, []).extend(msgs)
    [decision] = effects.decisions
    assert (decision["action"], decision["desired"], decision["workers"]) == ("scale_down", 1, ["w1", "w2"])
    downs = [w for w in h.core.registry if w.draining]
    assert sorted(w.id for w in downs) == ["w1", "w2"]  # both idle; w3 still runs p2
    assert any(isinstance(m, Drain) and m.deadline_s == 30 for m in h.take(conns["w1"]))
    assert drained_out(h.core.registry, h.core.plans, "w1") and drained_out(h.core.registry, h.core.plans, "w2")
    assert not drained_out(h.core.registry, h.core.plans, "w3")
    h.send(conns["w3"], Done(plan_id="p2", attempt=1, outcome="succeeded"))
    assert drained_out(h.core.registry, h.core.plans, "w3")


def test_remove_worker_requeues_its_plans_at_once_and_refuses_its_id() -> None:
    """remove_worker: ok, the worker gets cancel and is closed 4410, its plan is requeued, its hello refused."""
    h = Harness()
    c = h.client()
    w1 = h.worker("w1")
    plan = h.submit(c)
    h.send(w1, Accept(plan_id=plan, attempt=1))
    h.take(w1)
    ask(h, admin(h), RemoveWorker(req_id=3, worker_id="w1"), Ok)
    assert only(h.take(w1), Cancel).plan_id == plan
    assert (w1, errors.CLOSE_REMOVED) in [(conn, code) for conn, code, _ in h.closes]
    assert "w1" not in h.core.registry and h.state(plan) == "queued"
    assert h.core.plans[plan].free_attempts == 1  # no attempt spent
    again = h.worker("w1")
    assert (again, errors.CLOSE_REMOVED) in [(conn, code) for conn, code, _ in h.closes]
    assert "w1" not in h.core.registry
    h.worker("w2")
    assert h.core.plans[plan].worker_id == "w2"


def test_remove_worker_needs_admin_and_a_known_worker() -> None:
    """A client token gets forbidden, an unknown id unknown_worker; nothing changes."""
    h = Harness()
    c = h.client()
    h.worker("w1")
    assert ask(h, c, RemoveWorker(req_id=4, worker_id="w1"), Error).code == errors.FORBIDDEN
    error = ask(h, admin(h), RemoveWorker(req_id=5, worker_id="ghost"), Error)
    assert error.code == errors.UNKNOWN_WORKER and "ghost" in error.message
    assert "w1" in h.core.registry
