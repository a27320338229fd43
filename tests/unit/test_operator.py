"""Operator requests in the core (list_plans, drain_worker, undrain_worker), admin visibility, plan timings."""

from __future__ import annotations

import itertools
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from coordinator.audit import snapshot
from coordinator.io.ops.metrics import METRIC_NAMES, build_registry, render
from coordinator.stats import FrameCounters, Histogram
from protocol import errors
from protocol.messages import (
    Accept,
    Assign,
    Cancel,
    Done,
    Drain,
    DrainWorker,
    Error,
    Heartbeat,
    ListPlans,
    ListWorkers,
    Load,
    Ok,
    Plans,
    Reject,
    Submit,
    Subscribe,
    Undrain,
    UndrainWorker,
    Workers,
)
from tests.unit.test_core import Harness, kinds, only

_req = itertools.count(1000)


@pytest.fixture
def h() -> Harness:
    """A core with a fake clock (tests/unit/test_core.py's harness)."""
    return Harness()


def admin(h: Harness, principal: str = "root") -> int:
    """An admin client session."""
    conn = max([0, *h.inbox, *h.core.sessions]) + 100
    h.core.open_session(conn, "client", h.now, principal=principal, admin=True)
    return conn


def ask(h: Harness, conn: int, msg: Any, cls: type) -> Any:
    h.send(conn, msg)
    return only(h.take(conn), cls)


def list_plans(h: Harness, conn: int, **kw: Any) -> Plans:
    return ask(h, conn, ListPlans(req_id=next(_req), **kw), Plans)  # type: ignore[no-any-return]


# ---------------------------------------------------------------------------- list_plans


def test_list_plans_is_newest_first_with_counts_and_the_queue_in_placement_order(h: Harness) -> None:
    """Plans come newest first; counts cover every state; the queue is ordered by priority, then age."""
    c = h.client()
    low = h.submit(c, op="train")
    high = h.submit(c, op="train", priority=5)
    w = h.worker("w1")
    done = h.submit(c)
    assign = only([m for m in h.take(w) if isinstance(m, Assign)], Assign)
    h.send(w, Accept(plan_id=done, attempt=assign.attempt))
    h.send(w, Done(plan_id=done, attempt=1, outcome="succeeded", result=1))
    reply = list_plans(h, c)
    assert [p.id for p in reply.plans] == [done, high, low]
    assert reply.queue == [high, low]
    assert reply.counts == {"succeeded": 1, "queued": 2}
    assert reply.total == 3
    assert reply.plans[1].waiting_reason == "no connected worker handles op 'train'"


def test_list_plans_filters_states_and_limits_but_counts_everything(h: Harness) -> None:
    """states filters the listing, limit caps it; total and counts still count all visible plans."""
    c = h.client()
    ids = [h.submit(c, op="train") for _ in range(5)]
    reply = list_plans(h, c, states=["queued"], limit=2)
    assert [p.id for p in reply.plans] == ids[:-3:-1]
    assert reply.total == 5 and reply.counts == {"queued": 5} and len(reply.queue) == 2
    assert list_plans(h, c, states=["succeeded"]).plans == []


def test_list_plans_shows_only_the_principals_plans_but_all_to_an_admin(h: Harness) -> None:
    """Another principal's plans are invisible to a client and visible to an admin session."""
    alice, bob = h.client("alice"), h.client("bob")
    a = h.submit(alice, op="train")
    b = h.submit(bob, op="train")
    assert [p.id for p in list_plans(h, alice).plans] == [a]
    root = admin(h)
    assert [p.id for p in list_plans(h, root).plans] == [b, a]


@pytest.mark.parametrize("limit", [0, -1, 10_001])
def test_list_plans_with_a_bad_limit_is_invalid_argument(h: Harness, limit: int) -> None:
    """A limit outside 1..10000 answers invalid_argument naming the range."""
    c = h.client()
    error = ask(h, c, ListPlans(req_id=7, limit=limit), Error)
    assert error.code == errors.INVALID_ARGUMENT and error.req_id == 7 and "1..10000" in error.message


def test_admin_subscribe_all_follows_every_principals_plans_now_and_later(h: Harness) -> None:
    """subscribe(all) on an admin session follows all principals' plans, including ones submitted later."""
    alice = h.client("alice")
    old = h.submit(alice, op="train")
    root = admin(h)
    h.send(root, Subscribe(req_id=1, all=True, from_seq=10**9))
    assert h.take(root)[0].plan_ids == [old]  # subscribed, and no replay past from_seq
    new = h.submit(h.client("bob"), op="train")
    assert kinds(h.events(root, new)) == ["queued", "waiting"]
    h.send(alice, Cancel(req_id=2, plan_id=old))
    assert kinds(h.events(root, old)) == ["cancelled"]


def test_client_subscribe_all_still_follows_only_its_principal(h: Harness) -> None:
    """A non-admin subscribe(all) does not see another principal's new plans."""
    alice = h.client("alice")
    h.send(alice, Subscribe(req_id=1, all=True))
    h.take(alice)
    h.submit(h.client("bob"), op="train")
    assert h.events(alice) == []


# ---------------------------------------------------------------------------- drain / undrain


def test_drain_stops_placement_tells_the_worker_and_explains_the_wait(h: Harness) -> None:
    """A drained worker is sent drain, gets no new plans, and waiting plans say it is draining."""
    c = h.client()
    w = h.worker("w1")
    h.take(w)
    assert ask(h, admin(h), DrainWorker(req_id=3, worker_id="w1", deadline_s=60), Ok).req_id == 3
    assert only(h.take(w), Drain).deadline_s == 60
    plan = h.submit(c)
    assert h.state(plan) == "queued"
    assert h.core.plans[plan].waiting_reason == "the only matching worker (w1) is draining"
    row = only(ask(h, c, ListWorkers(req_id=4), Workers).workers, object)
    assert row.draining is True


def test_undrain_places_the_waiting_plans_and_tells_the_worker(h: Harness) -> None:
    """undrain sends undrain to the worker and places what waited for it."""
    c = h.client()
    w = h.worker("w1")
    ask(h, admin(h), DrainWorker(req_id=1, worker_id="w1"), Ok)
    plan = h.submit(c)
    h.take(w)
    ask(h, admin(h), UndrainWorker(req_id=2, worker_id="w1"), Ok)
    msgs = h.take(w)
    assert isinstance(msgs[0], Undrain)
    assert only(msgs, Assign).plan_id == plan
    assert h.state(plan) == "leased"


def test_plans_rejected_while_draining_are_offered_again_after_undrain(h: Harness) -> None:
    """A plan the worker rejected (it was draining on its side) may go back to it once undrained."""
    c = h.client()
    w = h.worker("w1")
    plan = h.submit(c)
    h.send(w, Reject(plan_id=plan, attempt=1, code=errors.REJECTED, reason="draining"))
    assert h.state(plan) == "queued"
    ask(h, admin(h), UndrainWorker(req_id=1, worker_id="w1"), Ok)
    assert h.state(plan) == "leased"


def test_drain_deadline_takes_running_plans_back_and_cancels_them_on_the_worker(h: Harness) -> None:
    """When the deadline passes, the worker is sent cancel and its plans are requeued elsewhere."""
    c = h.client()
    w1 = h.worker("w1")
    plan = h.submit(c)
    h.send(w1, Accept(plan_id=plan, attempt=1))
    ask(h, admin(h), DrainWorker(req_id=1, worker_id="w1", deadline_s=5), Ok)
    h.tick(4.0)
    assert h.state(plan) == "running"
    w2 = h.worker("w2")
    h.take(w1)
    h.send(w1, Heartbeat(load=Load()))  # keep w1 alive past the deadline
    h.send(w2, Heartbeat(load=Load()))
    h.tick(5.0)
    assert only(h.take(w1), Cancel).attempt == 1
    assert h.core.plans[plan].worker_id == "w2" and h.core.plans[plan].attempt == 2
    assert "w1 was drained and its deadline passed" in str([e.data for e in h.events(c, plan)])
    # The old attempt's late done is stale, not a second outcome.
    h.send(w1, Done(plan_id=plan, attempt=1, outcome="cancelled"))
    assert only(h.take(w1), Error).code == errors.STALE_LEASE
    assert h.state(plan) == "leased"


def test_a_drained_worker_stays_drained_when_it_reconnects(h: Harness) -> None:
    """The drain survives a reconnect: the new session gets drain right after welcome."""
    c = h.client()
    w = h.worker("w1")
    ask(h, admin(h), DrainWorker(req_id=1, worker_id="w1"), Ok)
    h.close(w)
    w_again = h.worker("w1")
    msgs = h.take(w_again)
    assert type(msgs[0]).__name__ == "Welcome" and isinstance(msgs[1], Drain)
    plan = h.submit(c)
    assert h.state(plan) == "queued"


@pytest.mark.parametrize(
    ("msg", "code"),
    [
        (DrainWorker(req_id=5, worker_id="ghost"), errors.UNKNOWN_WORKER),
        (UndrainWorker(req_id=5, worker_id="ghost"), errors.UNKNOWN_WORKER),
        (DrainWorker(req_id=5, worker_id="w1", deadline_s=-1), errors.INVALID_ARGUMENT),
        (DrainWorker(req_id=5, worker_id="w1", deadline_s=float("nan")), errors.INVALID_ARGUMENT),
    ],
)
def test_bad_drain_requests_answer_a_clear_error_and_change_nothing(h: Harness, msg: Any, code: str) -> None:
    """An unknown worker or a bad deadline answers an error with the request's id; nothing is drained."""
    h.worker("w1")
    error = ask(h, admin(h), msg, Error)
    assert error.code == code and error.req_id == 5
    assert "ghost" in error.message or "deadline_s" in error.message
    assert not h.core.registry.get("w1").draining


@pytest.mark.parametrize(
    "msg", [DrainWorker(req_id=6, worker_id="w1", deadline_s=0), UndrainWorker(req_id=6, worker_id="w1")]
)
def test_drain_and_undrain_need_an_admin_token_and_change_nothing_otherwise(h: Harness, msg: Any) -> None:
    """A client (non-admin) session's drain/undrain gets error(forbidden) naming the admin token; nothing changes."""
    c = h.client()
    w = h.worker("w1")
    plan = h.submit(c)
    h.send(w, Accept(plan_id=plan, attempt=1))
    if isinstance(msg, UndrainWorker):  # something for a refused undrain to (not) undo
        ask(h, admin(h), DrainWorker(req_id=1, worker_id="w1"), Ok)
    h.take(w)
    before = snapshot(h.core)
    error = ask(h, c, msg, Error)
    assert error.code == errors.FORBIDDEN and error.req_id == 6
    assert "needs an admin token" in error.message
    assert snapshot(h.core) == before
    assert h.take(w) == []  # the worker was told nothing (no drain, undrain or cancel)
    h.tick(1.0)  # a zero deadline would have taken the plan back by now
    assert h.state(plan) == "running"


# ---------------------------------------------------------------------------- timings and metrics


def test_queue_wait_and_run_time_are_observed_on_the_fake_clock(h: Harness) -> None:
    """Queue wait runs from submit to accept, run time from accept to done, per outcome."""
    c = h.client()
    plan = h.submit(c)
    h.now = 2.0
    w = h.worker("w1")
    h.now = 2.5
    h.send(w, Accept(plan_id=plan, attempt=1))
    h.now = 10.0
    h.send(w, Done(plan_id=plan, attempt=1, outcome="succeeded"))
    timings = h.core.timings
    assert timings.queue_wait.count == 1 and timings.queue_wait.sum == 2.5
    assert timings.run_time["succeeded"].count == 1 and timings.run_time["succeeded"].sum == 7.5
    assert timings.run_time["failed"].count == 0


def test_histogram_buckets_are_cumulative_and_end_at_inf() -> None:
    """Values land in the first bucket whose bound is >= them; cumulative counts end with the total."""
    hist = Histogram((1.0, 5.0))
    for value in (0.5, 1.0, 3.0, 7.0, -2.0):
        hist.observe(value)
    assert hist.cumulative() == [(1.0, 3), (5.0, 4), (float("inf"), 5)]
    with pytest.raises(ValueError, match="strictly increasing"):
        Histogram((2.0, 1.0))


def test_metrics_exposition_parses_and_has_every_family(h: Harness) -> None:
    """The collector's output parses with prometheus_client's parser and has every documented family."""
    c = h.client()
    w = h.worker("w1", max_concurrency=2)
    h.send(w, Heartbeat(load=Load(in_flight=1, power_w=250.0, uj_per_token=900.0, zone_intensity_g_per_kwh=56.0)))
    plan = h.submit(c)
    h.send(w, Accept(plan_id=plan, attempt=1))
    h.submit(c, op="train")
    frames = FrameCounters()
    frames.of("worker")[FrameCounters.FRAMES_IN] += 3
    registry = build_registry(h.core, frames=frames, clock=lambda: h.now, version="9.9", process=False)
    families = {f.name: f for f in text_string_to_metric_families(render(registry).decode())}
    assert set(METRIC_NAMES) <= set(families), set(METRIC_NAMES) - set(families)

    def value(name: str, **labels: str) -> float:
        for sample in families[name].samples:
            if all(sample.labels.get(k) == v for k, v in labels.items()) and sample.name.startswith(name):
                return float(sample.value)
        raise AssertionError(f"no sample {name}{labels}")

    assert value("fleetwire_plans", state="running") == 1
    assert value("fleetwire_plans", state="queued") == 1
    assert value("fleetwire_queue_depth") == 1
    assert value("fleetwire_workers", state="alive") == 1
    assert value("fleetwire_worker_power_watts", worker="w1") == 250.0
    assert value("fleetwire_worker_carbon_intensity_grams_per_kwh", worker="w1") == 56.0
    assert value("fleetwire_heartbeats") == 1
    assert value("fleetwire_frames", role="worker", direction="in") == 3
    assert value("fleetwire_plan_queue_wait_seconds") >= 0  # the _bucket/_count samples exist
    assert value("fleetwire_info", version="9.9") == 1
    assert sum(s.value for s in families["fleetwire_placements"].samples) == 1


def test_security_refusals_are_exported() -> None:
    """A 4403 scope refusal (by reason) and a submit over the plan limit show up in their /metrics counters."""
    h = Harness(max_plans_per_client=1)
    c = h.client()
    h.submit(c)
    h.send(c, Submit(req_id=next(_req), op="echo"))  # over the limit: error(too_many_plans)
    h.send(h.client("bob"), Heartbeat())  # a worker message from a client: closed 4403
    registry = build_registry(h.core, clock=lambda: h.now, process=False)
    samples = {(s.name, s.labels.get("reason", "")): s.value
               for f in text_string_to_metric_families(render(registry).decode()) for s in f.samples}
    assert samples[("fleetwire_plans_refused_total", "")] == 1
    assert samples[("fleetwire_scope_refused_total", "foreign_type")] == 1
    assert samples[("fleetwire_scope_refused_total", "worker_id")] == 0


def test_autoscaler_desired_replicas_are_exported_per_pool() -> None:
    """With an autoscaler, each pool it watches has a fleetwire_autoscaler_desired_replicas sample."""
    from coordinator.autoscaler import AutoscaleConfig

    h = Harness(autoscale=AutoscaleConfig(interval_s=0.0))
    h.worker("w1")
    h.submit(h.client())
    h.tick(1.0)
    assert h.core.autoscaler is not None and h.core.autoscaler.desired_replicas()
    registry = build_registry(h.core, clock=lambda: h.now, process=False)
    family = next(f for f in text_string_to_metric_families(render(registry).decode())
                  if f.name == "fleetwire_autoscaler_desired_replicas")
    pools = {s.labels["pool"]: s.value for s in family.samples}
    assert pools == {pool: float(n) for pool, n in h.core.autoscaler.desired_replicas().items()}
