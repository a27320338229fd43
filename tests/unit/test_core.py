"""The coordinator core driven directly: sessions, plans, placement, reaping, with a fake clock."""

from __future__ import annotations

import itertools
import random
from collections.abc import Iterable
from typing import Any

import pytest
from structlog.testing import capture_logs

from coordinator import Coordinator, CoreConfig
from coordinator.devices import pick
from coordinator.placement.plan_queue import Signature
from protocol import DecodeFailure, errors
from protocol.messages import (
    Accept,
    Accepted,
    Assign,
    Cancel,
    Capabilities,
    Done,
    Error,
    ErrorInfo,
    Event,
    GetPlan,
    Goodbye,
    Heartbeat,
    Hello,
    ListWorkers,
    Load,
    Ok,
    PlanReply,
    Reject,
    Requirements,
    RunningPlan,
    Submit,
    Subscribe,
    Subscribed,
    Unsubscribe,
    Welcome,
    Workers,
)


class Harness:
    """A core, a fake clock, and an inbox per connection filled from the core's effects."""

    def __init__(self, **config: Any) -> None:
        self.now = 0.0
        ids = (f"p{i}" for i in itertools.count(1))
        self.core = Coordinator(CoreConfig(**config), new_id=lambda: next(ids))
        self.inbox: dict[int, list[Any]] = {}
        self.closes: list[tuple[int, int, str]] = []
        self.secrets: dict[str, str] = {}  # worker id -> its last welcome's session_secret, as an agent keeps it
        self._conns = itertools.count(1)
        self._req = itertools.count(1)

    def _pump(self) -> None:
        effects = self.core.take_effects()
        for conn_id, msgs in effects.sends.items():
            self.inbox.setdefault(conn_id, []).extend(msgs)
            for msg in msgs:
                if isinstance(msg, Welcome):
                    self.secrets[msg.worker_id] = msg.session_secret
        self.closes.extend(effects.closes)
        check_invariant(self.core, self.now)

    def worker(
        self,
        worker_id: str,
        *,
        ops: Iterable[str] = ("echo",),
        tags: Iterable[str] = (),
        max_concurrency: int = 1,
        running: Iterable[tuple[str, int]] = (),
    ) -> int:
        conn = next(self._conns)
        self.core.open_session(conn, "worker", self.now, address=f"10.0.0.{conn}:4000")
        caps = Capabilities(
            cpu_cores=4, ram_bytes=8_000_000_000, ops=list(ops), tags=list(tags), max_concurrency=max_concurrency
        )
        hello = Hello(
            worker_id=worker_id, capabilities=caps, running=[RunningPlan(p, a) for p, a in running],
            session_secret=self.secrets.get(worker_id, ""),  # a reconnecting agent presents it
        )
        self.send(conn, hello)
        return conn

    def client(self, principal: str = "alice") -> int:
        conn = next(self._conns)
        self.core.open_session(conn, "client", self.now, principal=principal)
        self._pump()
        return conn

    def send(self, conn: int, msg: Any) -> None:
        self.core.receive(conn, msg, self.now)
        self._pump()

    def submit(self, conn: int, op: str = "echo", **kw: Any) -> str:
        self.send(conn, Submit(req_id=next(self._req), op=op, **kw))
        accepted = [m for m in self.inbox.get(conn, []) if isinstance(m, Accepted)]
        return accepted[-1].plan_id

    def submit_all(self, conn: int, submits: Iterable[dict[str, Any]]) -> list[str]:
        """Submits (each its fields; op defaults to echo) from ``conn`` handed to the core in one batch, their ids.

        The invariant, a walk of every plan, is checked once after the batch instead of after each submit:
        building thousands of plans one ``submit`` at a time is quadratic. The core receives the same messages.
        """
        start = len(self.inbox.get(conn, []))
        count = 0
        for fields in submits:
            self.core.receive(conn, Submit(req_id=next(self._req), **{"op": "echo", **fields}), self.now)
            count += 1
        self._pump()
        accepted = [m.plan_id for m in self.inbox.get(conn, [])[start:] if isinstance(m, Accepted)]
        assert len(accepted) == count, self.inbox.get(conn, [])[start:][:5]
        return accepted

    def close(self, conn: int) -> None:
        self.core.close_session(conn, self.now)
        self._pump()

    def tick(self, now: float) -> list[str]:
        self.now = now
        reaped = self.core.tick(now)
        self._pump()
        return reaped

    def take(self, conn: int) -> list[Any]:
        return self.inbox.pop(conn, [])

    def events(self, conn: int, plan_id: str | None = None) -> list[Event]:
        return [m for m in self.take(conn) if isinstance(m, Event) and plan_id in (None, m.plan_id)]

    def state(self, plan_id: str) -> str:
        return self.core.plans[plan_id].state


def check_invariant(core: Coordinator, now: float) -> None:
    """No queued plan has an alive worker with room that could run it (§Placement)."""
    for plan in core.plans.values():
        if plan.state != "queued":
            continue
        sig = Signature.of(plan.op, plan.requirements, plan.avoid, plan.gpus)
        if core.queue.held(plan.owner, sig):
            continue  # its team is past a quota it may not borrow beyond (coordinator/sharing.py)
        if plan.id in core.graphs.graph.held or plan.id in core.graphs.waits:
            continue  # a plan it needs has not succeeded, or it waits for the busy worker holding its bytes
        if plan.deferred_until is not None:
            continue  # held for a greener hour (coordinator/carbon_holds.py)
        for record in core.registry.alive(now):
            devices_free = plan.gpus is None or pick(plan.gpus, record.capabilities, record.gpu_use) is not None
            assert not (record.has_capacity() and sig.admits(record) and devices_free), (plan.id, record.id)
    tallies: dict[int, tuple[Any, dict[str, int], set[str]]] = {}  # a listing's counts by owner (plans.py OwnerTally)
    for plan in core.plans.values():
        if plan.tally is not None:
            _, counts, queued = tallies.setdefault(id(plan.tally), (plan.tally, {}, set()))
            counts[plan.state] = counts.get(plan.state, 0) + 1
            if plan.state == "queued":
                queued.add(plan.id)
    for tally, counts, queued in tallies.values():
        assert {k: n for k, n in tally.counts.items() if n} == counts and set(tally.queued) == queued


def kinds(events: list[Event]) -> list[str]:
    return [e.kind for e in events]


def only(msgs: list[Any], cls: type) -> Any:
    found = [m for m in msgs if isinstance(m, cls)]
    assert len(found) == 1, msgs
    return found[0]


@pytest.fixture
def h() -> Harness:
    return Harness()


# ---------------------------------------------------------------- worker handshake


def test_hello_gets_welcome_with_settings(h: Harness) -> None:
    """hello registers the worker and is answered by welcome with the heartbeat settings and version."""
    h = Harness(heartbeat_interval_s=5.0, heartbeat_timeout_s=15.0, version="1.2.3")
    w = h.worker("w1")
    welcome = only(h.take(w), Welcome)
    assert (welcome.worker_id, welcome.heartbeat_interval_s, welcome.heartbeat_timeout_s, welcome.version) == (
        "w1",
        5.0,
        15.0,
        "1.2.3",
    )
    assert h.core.registry.is_alive("w1", 0.0)


def test_registration_is_logged_with_worker_id(h: Harness) -> None:
    """Registering a worker logs at info with the worker id bound."""
    with capture_logs() as logs:
        h.worker("w1")
    assert [
        e for e in logs if e["event"] == "worker registered" and e["worker_id"] == "w1" and e["log_level"] == "info"
    ]


@pytest.mark.parametrize(
    "msg",
    [
        Heartbeat(load=Load()),
        Accept(plan_id="p1", attempt=1, seq=1),
        Event(plan_id="p1", attempt=1, kind="k", data=None, seq=1),
        Done(plan_id="p1", attempt=1, outcome="succeeded", seq=1),
    ],
    ids=lambda m: type(m).__name__,
)
def test_message_before_hello_is_not_registered(h: Harness, msg: Heartbeat | Accept | Event | Done) -> None:
    """Any worker message before hello, a plan's own included, is answered with error not_registered."""
    conn = 99
    h.core.open_session(conn, "worker", 0.0)
    h.send(conn, msg)
    error = only(h.take(conn), Error)
    assert error.code == errors.NOT_REGISTERED
    assert type(msg).__name__.lower() in error.message


def test_second_hello_is_already_registered(h: Harness) -> None:
    """A second hello on one session is answered with error already_registered."""
    w = h.worker("w1")
    h.take(w)
    h.send(w, Hello(worker_id="w1", capabilities=Capabilities()))
    assert only(h.take(w), Error).code == errors.ALREADY_REGISTERED


def test_newer_session_replaces_older_with_4409(h: Harness) -> None:
    """The same worker id on a new session closes the old one with 4409; the old close does not disconnect it."""
    old = h.worker("w1")
    new = h.worker("w1")
    assert (old, errors.CLOSE_REPLACED) in [(c, code) for c, code, _ in h.closes]
    assert only(h.take(new), Welcome).worker_id == "w1"
    h.send(old, Heartbeat())  # ignored: that session is closing
    h.close(old)
    assert h.core.registry.is_alive("w1", h.now)
    assert h.core.registry.get("w1").conn_id == new


def test_heartbeat_keeps_worker_alive_and_records_load(h: Harness) -> None:
    """A beating worker is not reaped and its load is recorded."""
    w = h.worker("w1")
    for t in (10.0, 20.0, 30.0, 40.0):
        h.now = t
        h.send(w, Heartbeat(load=Load(in_flight=1)))
        assert h.tick(t) == []
    assert h.core.registry.get("w1").load == Load(in_flight=1)


# ---------------------------------------------------------------- the happy path


def test_submit_assign_accept_event_done_in_seq_order(h: Harness) -> None:
    """A plan runs end to end and the client sees every event once, in seq order."""
    w = h.worker("w1")
    h.take(w)
    c = h.client()
    plan_id = h.submit(c, args={"x": 1}, timeout_s=9.0)
    msgs = h.take(c)
    assert isinstance(msgs[0], Accepted) and msgs[0].state == "queued" and not msgs[0].duplicate
    assign = only(h.take(w), Assign)
    assert (assign.plan_id, assign.attempt, assign.op, assign.args, assign.timeout_s) == (
        plan_id,
        1,
        "echo",
        {"x": 1},
        9.0,
    )
    h.send(w, Accept(plan_id=plan_id, attempt=1))
    h.send(w, Event(plan_id=plan_id, attempt=1, kind="progress", data=0.5, ephemeral=True, seq=77))
    h.send(w, Done(plan_id=plan_id, attempt=1, outcome="succeeded", result={"x": 1}))
    events = [m for m in msgs if isinstance(m, Event)] + h.events(c)
    assert kinds(events) == ["queued", "leased", "running", "progress", "succeeded"]
    assert [e.seq for e in events] == [1, 2, 3, 4, 5]
    assert events[0].data == {}
    assert events[1].data == {"worker_id": "w1", "attempt": 1}
    assert events[2].data == {"worker_id": "w1", "attempt": 1}
    assert events[3].ephemeral and events[3].data == 0.5 and events[3].attempt == 1
    assert events[4].data == {"result": {"x": 1}, "worker_id": "w1", "attempt": 1}
    assert h.state(plan_id) == "succeeded"
    assert h.core.registry.get("w1").leases == set()
    assert h.core.counters["plans_submitted"] == 1 and h.core.counters["events_forwarded"] == 1


def test_failed_done_carries_the_error(h: Harness) -> None:
    """done(failed) ends the plan failed with the worker's error in the event and the record."""
    w = h.worker("w1")
    c = h.client()
    plan_id = h.submit(c)
    h.send(w, Done(plan_id=plan_id, attempt=1, outcome="failed", error=ErrorInfo("handler_error", "boom", {"line": 3})))
    last = h.events(c)[-1]
    assert last.kind == "failed"
    assert last.data == {
        "code": "handler_error",
        "message": "boom",
        "detail": {"line": 3},
        "worker_id": "w1",
        "attempt": 1,
    }
    assert h.core.plans[plan_id].error == ErrorInfo("handler_error", "boom", {"line": 3})


def test_worker_cancelled_done_ends_cancelled(h: Harness) -> None:
    """done(cancelled) from the worker itself ends the plan cancelled."""
    w = h.worker("w1")
    c = h.client()
    plan_id = h.submit(c)
    h.send(w, Done(plan_id=plan_id, attempt=1, outcome="cancelled"))
    assert h.state(plan_id) == "cancelled"
    assert h.events(c)[-1].kind == "cancelled"


def test_hot_path_does_not_log_at_info(h: Harness) -> None:
    """Submit, event forwarding and done log nothing at info or above."""
    w = h.worker("w1")
    c = h.client()
    with capture_logs() as logs:
        plan_id = h.submit(c)
        h.send(w, Accept(plan_id=plan_id, attempt=1))
        h.send(w, Event(plan_id=plan_id, attempt=1, kind="token", data="a"))
        h.send(w, Done(plan_id=plan_id, attempt=1, outcome="succeeded"))
    assert [e for e in logs if e["log_level"] in ("info", "warning", "error")] == []


def test_repeated_accept_changes_nothing(h: Harness) -> None:
    """A second accept of a running plan emits no second running event."""
    w = h.worker("w1")
    c = h.client()
    plan_id = h.submit(c)
    h.send(w, Accept(plan_id=plan_id, attempt=1))
    h.take(c)
    h.take(w)
    h.send(w, Accept(plan_id=plan_id, attempt=1))
    assert h.take(c) == [] and h.take(w) == []


def test_reserved_event_kind_is_refused(h: Harness) -> None:
    """A worker event with a lifecycle kind is answered invalid_message and not forwarded."""
    w = h.worker("w1")
    c = h.client()
    plan_id = h.submit(c)
    h.take(c)
    h.take(w)
    h.send(w, Event(plan_id=plan_id, attempt=1, kind="succeeded", data=1))
    error = only(h.take(w), Error)
    assert (error.code, error.plan_id) == (errors.INVALID_MESSAGE, plan_id)
    assert h.take(c) == [] and h.state(plan_id) == "leased"


def test_events_held_per_plan_are_bounded(h: Harness) -> None:
    """At most max_events_per_plan events are held for replay, the newest kept."""
    h = Harness(max_events_per_plan=20)
    w = h.worker("w1")
    c = h.client()
    plan_id = h.submit(c)
    for i in range(100):
        h.send(w, Event(plan_id=plan_id, attempt=1, kind="token", data=i, ephemeral=True))
    held = h.core.plans[plan_id].events
    assert len(held) <= 20 and held[-1].data == 99 and held[0].kind == "queued"


# ---------------------------------------------------------------- waiting and placement


def test_waiting_no_handler_then_placed_when_worker_appears(h: Harness) -> None:
    """A plan no worker handles waits with that reason and is assigned the moment one registers."""
    c = h.client()
    plan_id = h.submit(c, op="x")
    events = h.events(c)
    assert kinds(events) == ["queued", "waiting"]
    assert events[1].data == {"reason": "no connected worker handles op 'x'"}
    assert h.core.plans[plan_id].waiting_reason == "no connected worker handles op 'x'"
    w = h.worker("w1", ops=["x"])
    msgs = h.take(w)
    assert isinstance(msgs[0], Welcome) and only(msgs, Assign).plan_id == plan_id
    assert kinds(h.events(c)) == ["leased"]
    assert h.core.plans[plan_id].waiting_reason is None


def test_waiting_reason_for_missing_tags(h: Harness) -> None:
    """A worker with the op but not the tags changes the reason to name the tags."""
    c = h.client()
    h.submit(c, op="x", requirements=Requirements(tags=["gpu"]))
    h.take(c)
    h.worker("w1", ops=["x"])
    events = h.events(c)
    assert kinds(events) == ["waiting"]
    assert events[0].data == {"reason": "no worker handling op 'x' has tags [gpu]"}


def test_waiting_reason_at_capacity_then_placed_on_release(h: Harness) -> None:
    """With every matching worker full the plan says so, and is placed when a lease is released."""
    w = h.worker("w1")
    c = h.client()
    first = h.submit(c)
    second = h.submit(c)
    assert h.core.plans[second].waiting_reason == "the only matching worker (w1) is at capacity"
    h.worker("w2", max_concurrency=0)
    assert h.core.plans[second].waiting_reason == "all matching workers are at capacity"
    h.take(w)
    h.send(w, Done(plan_id=first, attempt=1, outcome="succeeded"))
    assert only(h.take(w), Assign).plan_id == second
    assert h.state(second) == "leased"


def test_waiting_is_emitted_only_when_the_reason_changes(h: Harness) -> None:
    """Workers that do not change the reason cause no new waiting event."""
    c = h.client()
    h.submit(c, op="x")
    h.take(c)
    h.worker("w1", ops=["y"])
    h.worker("w2", ops=["z"])
    h.tick(1.0)
    assert h.events(c) == []


def test_queue_order_is_priority_then_age(h: Harness) -> None:
    """When room appears, the highest priority goes first, and the oldest among equals."""
    w = h.worker("w1")
    c = h.client()
    busy = h.submit(c)
    low = h.submit(c, priority=0)
    high_old = h.submit(c, priority=5)
    high_new = h.submit(c, priority=5)
    h.take(w)
    order = []
    current = busy
    for _ in range(3):
        h.send(w, Done(plan_id=current, attempt=1, outcome="succeeded"))
        current = only(h.take(w), Assign).plan_id
        order.append(current)
    assert order == [high_old, high_new, low]


def test_placement_prefers_fewest_leases_then_least_recent(h: Harness) -> None:
    """Plans spread over workers by lease count, ties to the least recently assigned."""
    h.worker("a", max_concurrency=2)
    h.worker("b", max_concurrency=2)
    c = h.client()
    placed = [h.core.plans[h.submit(c)].worker_id for _ in range(4)]
    assert placed == ["a", "b", "a", "b"]


def test_placement_respects_tags(h: Harness) -> None:
    """A tagged plan goes only to a worker with all its tags."""
    h.worker("plain")
    h.worker("gpu", tags=["gpu", "a100"])
    c = h.client()
    plan_id = h.submit(c, requirements=Requirements(tags=["a100", "gpu"]))
    assert h.core.plans[plan_id].worker_id == "gpu"


def test_late_worker_that_beats_again_gets_work(h: Harness) -> None:
    """A worker past its timeout but not yet reaped gets placements as soon as it beats again."""
    w = h.worker("w1")
    c = h.client()
    h.now = 40.0
    plan_id = h.submit(c)
    assert h.state(plan_id) == "queued"
    h.send(w, Heartbeat())
    assert h.state(plan_id) == "leased"


# ---------------------------------------------------------------- cancel


def test_cancel_queued_plan(h: Harness) -> None:
    """Cancelling a queued plan ends it at once and it is never placed."""
    c = h.client()
    plan_id = h.submit(c)
    h.take(c)
    h.send(c, Cancel(req_id=7, plan_id=plan_id))
    msgs = h.take(c)
    assert kinds([m for m in msgs if isinstance(m, Event)]) == ["cancelled"]
    reply = only(msgs, PlanReply)
    assert (reply.req_id, reply.plan.state) == (7, "cancelled")
    w = h.worker("w1")
    assert not [m for m in h.take(w) if isinstance(m, Assign)]


def test_cancel_running_plan_holds_lease_until_done(h: Harness) -> None:
    """A cancelled running plan ends at once for the client, but its lease is held until the worker's done."""
    w = h.worker("w1")
    c = h.client()
    plan_id = h.submit(c)
    h.send(w, Accept(plan_id=plan_id, attempt=1))
    h.take(w)
    h.send(c, Cancel(req_id=1, plan_id=plan_id))
    assert only(h.take(w), Cancel) == Cancel(plan_id=plan_id, attempt=1)
    assert only(h.take(c), PlanReply).plan.state == "cancelled"
    waiting = h.submit(c)
    assert h.state(waiting) == "queued"  # the cancelled plan still holds the only slot
    h.take(c)
    h.send(w, Event(plan_id=plan_id, attempt=1, kind="log", data="late"))
    assert h.events(c, plan_id) == []  # the stream ended with cancelled
    h.send(w, Done(plan_id=plan_id, attempt=1, outcome="cancelled"))
    assert h.events(c, plan_id) == []
    assert h.state(plan_id) == "cancelled"
    assert only(h.take(w), Assign).plan_id == waiting


def test_cancel_terminal_plan_changes_nothing(h: Harness) -> None:
    """Cancelling a finished plan replies with its state and emits nothing."""
    w = h.worker("w1")
    c = h.client()
    plan_id = h.submit(c)
    h.send(w, Done(plan_id=plan_id, attempt=1, outcome="succeeded", result=1))
    h.take(c)
    h.send(c, Cancel(req_id=2, plan_id=plan_id))
    msgs = h.take(c)
    assert len(msgs) == 1 and msgs[0].plan.state == "succeeded"


# ---------------------------------------------------------------- reject and stale leases


def test_reject_requeues_and_avoids_that_worker(h: Harness) -> None:
    """A rejected plan is requeued, never offered to that worker again, and placed on another."""
    w1 = h.worker("w1")
    c = h.client()
    plan_id = h.submit(c)
    h.take(c)
    h.take(w1)
    h.send(w1, Reject(plan_id=plan_id, attempt=1, code="unknown_op", reason="no handler"))
    events = h.events(c)
    assert kinds(events) == ["requeued", "waiting"]
    assert events[0].data == {"reason": "worker w1 rejected it (unknown_op: no handler)", "attempt": 2}
    assert events[1].data == {"reason": "every matching worker rejected it (w1)"}
    assert not [m for m in h.take(w1) if isinstance(m, Assign)]
    w2 = h.worker("w2")
    assert only(h.take(w2), Assign).attempt == 2


def test_rejected_plan_is_offered_again_after_reregistration(h: Harness) -> None:
    """A worker that registers again (say, after a restart) is offered the plans it rejected."""
    w1 = h.worker("w1")
    c = h.client()
    plan_id = h.submit(c)
    h.send(w1, Reject(plan_id=plan_id, attempt=1, code="draining"))
    h.close(w1)
    again = h.worker("w1")
    assert only(h.take(again), Assign).attempt == 2
    assert h.core.plans[plan_id].avoid == frozenset()


def test_reject_after_accept_is_an_invalid_transition(h: Harness) -> None:
    """Rejecting a running plan is answered with invalid_transition and changes nothing."""
    w = h.worker("w1")
    c = h.client()
    plan_id = h.submit(c)
    h.send(w, Accept(plan_id=plan_id, attempt=1))
    h.take(w)
    h.send(w, Reject(plan_id=plan_id, attempt=1))
    assert only(h.take(w), Error).code == errors.INVALID_TRANSITION
    assert h.state(plan_id) == "running"


def test_stale_attempt_is_dropped_and_answered(h: Harness) -> None:
    """An event or done naming an older attempt is dropped, counted and answered stale_lease; one naming no
    attempt (0) is dropped and answered invalid_message, never stale_lease (whose attempt 0 would read "any")."""
    w = h.worker("w1")
    c = h.client()
    plan_id = h.submit(c)
    h.take(w)
    h.take(c)
    h.send(w, Event(plan_id=plan_id, attempt=0, kind="log"))
    h.send(w, Done(plan_id=plan_id, attempt=0, outcome="succeeded"))
    h.send(w, Done(plan_id="nope", attempt=1, outcome="succeeded"))
    replies = h.take(w)
    assert [(e.code, e.plan_id, e.attempt) for e in replies] == [
        (errors.INVALID_MESSAGE, plan_id, 0),
        (errors.INVALID_MESSAGE, plan_id, 0),
        (errors.STALE_LEASE, "nope", 1),
    ]
    assert h.core.counters["stale_dropped"] == 1
    assert h.take(c) == [] and h.state(plan_id) == "leased"
    h.send(w, Done(plan_id=plan_id, attempt=1, outcome="succeeded"))
    h.send(w, Done(plan_id=plan_id, attempt=1, outcome="failed"))  # a second done for the same attempt
    assert "already ended succeeded" in only(h.take(w), Error).message
    assert h.state(plan_id) == "succeeded"


def test_other_workers_lease_is_forbidden(h: Harness) -> None:
    """A worker that finishes a plan leased to another worker is closed 4403; the plan is untouched."""
    h.worker("w1")
    w2 = h.worker("w2")
    c = h.client()
    plan_id = h.submit(c)
    assert h.core.plans[plan_id].worker_id == "w1"
    h.take(w2)
    h.send(w2, Done(plan_id=plan_id, attempt=1, outcome="succeeded"))
    assert h.take(w2) == []
    assert [(conn, code) for conn, code, _ in h.closes] == [(w2, errors.CLOSE_FORBIDDEN)]
    assert h.state(plan_id) == "leased"


# ---------------------------------------------------------------- reaper and reconnect


def test_reaper_requeues_with_next_attempt_and_closes_4408(h: Harness) -> None:
    """A silent worker is reaped, its session closed 4408, and its plan requeued with attempt+1 elsewhere."""
    w1 = h.worker("w1")
    c = h.client()
    plan_id = h.submit(c)
    h.send(w1, Accept(plan_id=plan_id, attempt=1))
    h.now = 20.0
    w2 = h.worker("w2")
    h.take(c)
    with capture_logs() as logs:
        assert h.tick(31.0) == ["w1"]
    assert (w1, errors.CLOSE_HEARTBEAT_TIMEOUT) in [(conn, code) for conn, code, _ in h.closes]
    events = h.events(c)
    assert kinds(events) == ["requeued", "leased"]
    assert events[0].data == {"reason": "worker w1 stopped sending heartbeats", "attempt": 2}
    assert events[1].data == {"worker_id": "w2", "attempt": 2}
    assert only(h.take(w2), Assign).attempt == 2
    assert h.core.counters["workers_reaped"] == 1
    assert any(e["event"] == "plan requeued" and e["plan_id"] == plan_id for e in logs)
    # The old worker's late result is fenced off.
    assert h.core.plans[plan_id].attempt == 2


def test_reaper_fails_plan_after_max_attempts(h: Harness) -> None:
    """A plan whose last attempt is lost with its worker fails with worker_lost."""
    h.worker("w1")
    c = h.client()
    plan_id = h.submit(c, max_attempts=1)
    h.take(c)
    h.tick(31.0)
    events = h.events(c)
    assert kinds(events) == ["failed"]
    assert events[0].data["code"] == errors.WORKER_LOST
    assert events[0].data["worker_id"] == "w1" and events[0].data["attempt"] == 1
    assert h.state(plan_id) == "failed"


def test_poison_plan_fails_after_three_lost_workers(h: Harness) -> None:
    """With the default of 3 attempts, a plan that loses three workers fails and uses no fourth."""
    c = h.client()
    plan_id = h.submit(c)
    for i in range(3):
        h.worker(f"w{i}")
        assert h.core.plans[plan_id].attempt == i + 1
        h.tick(h.now + 31.0)
    assert h.state(plan_id) == "failed"
    h.worker("w9")
    assert h.state(plan_id) == "failed"


def test_disconnected_worker_keeps_leases_until_reaped(h: Harness) -> None:
    """A disconnect keeps the lease; a quick reconnect listing the plan continues it."""
    w = h.worker("w1")
    c = h.client()
    plan_id = h.submit(c)
    h.send(w, Accept(plan_id=plan_id, attempt=1))
    h.close(w)
    assert not h.core.registry.is_alive("w1", h.now)
    assert h.core.registry.get("w1").leases == {plan_id}
    h.now = 5.0
    w_again = h.worker("w1", running=[(plan_id, 1), ("ghost", 1)])
    welcome = only(h.take(w_again), Welcome)
    assert (welcome.continue_plans, welcome.abandon_plans) == ([plan_id], ["ghost"])
    h.send(w_again, Done(plan_id=plan_id, attempt=1, outcome="succeeded"))
    assert h.state(plan_id) == "succeeded"


def test_reconnect_without_a_held_plan_requeues_it(h: Harness) -> None:
    """A lease the reconnecting worker does not list is lost and the plan is requeued."""
    w = h.worker("w1")
    c = h.client()
    h.submit(c)
    h.close(w)
    h.take(c)
    w_again = h.worker("w1")
    events = h.events(c)
    assert kinds(events) == ["requeued", "leased"]
    assert events[1].data == {"worker_id": "w1", "attempt": 2}
    msgs = h.take(w_again)
    assert isinstance(msgs[0], Welcome) and only(msgs, Assign).attempt == 2


def test_reconnect_after_cancel_is_told_to_cancel(h: Harness) -> None:
    """A plan cancelled while its worker was away is continued and cancelled on reconnect."""
    w = h.worker("w1")
    c = h.client()
    plan_id = h.submit(c)
    h.close(w)
    h.send(c, Cancel(req_id=1, plan_id=plan_id))
    w_again = h.worker("w1", running=[(plan_id, 1)])
    msgs = h.take(w_again)
    assert msgs[0].continue_plans == [plan_id]
    assert only(msgs, Cancel) == Cancel(plan_id=plan_id, attempt=1)


def test_worker_back_from_partition_is_fenced(h: Harness) -> None:
    """A reaped worker that comes back is told to abandon its old attempt, and its late done is stale."""
    w1 = h.worker("w1")
    c = h.client()
    plan_id = h.submit(c)
    h.send(w1, Accept(plan_id=plan_id, attempt=1))
    h.now = 20.0
    h.worker("w2")
    h.tick(31.0)
    assert h.core.plans[plan_id].worker_id == "w2"
    back = h.worker("w1", running=[(plan_id, 1)])
    welcome = only(h.take(back), Welcome)
    assert (welcome.continue_plans, welcome.abandon_plans) == ([], [plan_id])
    h.send(back, Done(plan_id=plan_id, attempt=1, outcome="succeeded", result="old"))
    error = only(h.take(back), Error)
    assert error.code == errors.STALE_LEASE and "attempt 2 on worker w2" in error.message
    assert h.state(plan_id) == "leased" and h.core.plans[plan_id].result is None


def test_waiting_reason_is_current_after_a_late_worker_beats(h: Harness) -> None:
    """A plan submitted while its worker was late gets the right reason once the worker beats again."""
    w = h.worker("w1")
    c = h.client()
    h.submit(c)
    first_waiting = h.submit(c)
    h.worker("other", ops=["x"])  # a refresh: the queued group's reason is recorded
    h.now = 40.0  # w1 is late, not yet reaped
    late_waiting = h.submit(c)
    assert h.core.plans[late_waiting].waiting_reason == "no connected worker handles op 'echo'"
    h.send(w, Heartbeat())
    reason = "the only matching worker (w1) is at capacity"
    assert h.core.plans[first_waiting].waiting_reason == reason
    assert h.core.plans[late_waiting].waiting_reason == reason


def test_waiting_reason_follows_a_disconnect(h: Harness) -> None:
    """When the only matching worker leaves, a waiting plan's reason says no worker handles its op."""
    w = h.worker("w1")
    c = h.client()
    h.submit(c)
    waiting = h.submit(c)
    h.take(c)
    h.close(w)
    events = h.events(c, waiting)
    assert [e.data for e in events] == [{"reason": "no connected worker handles op 'echo'"}]


def test_goodbye_disconnects_and_closes(h: Harness) -> None:
    """goodbye is treated as a disconnect and the session is closed normally."""
    w = h.worker("w1")
    h.send(w, Goodbye(reason="draining"))
    assert (w, errors.CLOSE_NORMAL, "goodbye") in h.closes
    assert not h.core.registry.is_alive("w1", h.now)


def test_reaping_a_disconnected_worker_sends_no_close(h: Harness) -> None:
    """A worker already disconnected is reaped without a close effect."""
    w = h.worker("w1")
    h.close(w)
    assert h.tick(31.0) == ["w1"]
    assert h.closes == []


# ---------------------------------------------------------------- client requests


def test_idempotent_submit_returns_the_existing_plan(h: Harness) -> None:
    """Submitting an existing plan_id answers duplicate=True with its state and creates nothing."""
    h.worker("w1")
    c = h.client()
    first = h.submit(c, plan_id="job-1")
    h.take(c)
    again = h.submit(c, plan_id="job-1", op="other")
    msgs = h.take(c)
    accepted = msgs[0]
    assert isinstance(accepted, Accepted)
    assert (accepted.plan_id, accepted.duplicate, accepted.state) == ("job-1", True, "leased")
    assert first == again == "job-1"
    assert len(h.core.plans) == 1 and h.core.counters["plans_submitted"] == 1
    assert h.core.plans["job-1"].op == "echo"
    assert [e.seq for e in msgs[1:]] == [1, 2]  # the retry is subscribed to the whole stream


def test_another_principal_cannot_take_over_or_see_a_plan(h: Harness) -> None:
    """Plans of another principal are not found, and submitting their id makes a plan of one's own (ids are
    scoped per principal: tests/unit/test_plan_ids.py)."""
    alice = h.client("alice")
    h.submit(alice, plan_id="job-1", args="alices")
    bob = h.client("bob")
    h.send(bob, GetPlan(req_id=1, plan_id="job-1"))
    assert only(h.take(bob), Error).code == errors.PLAN_NOT_FOUND
    h.send(bob, Submit(req_id=2, op="echo", plan_id="job-1"))
    assert only(h.take(bob), Accepted) == Accepted(req_id=2, plan_id="job-1", state="queued")
    assert h.core.plans["job-1"].owner == "alice" and h.core.plans["job-1"].args == "alices"


@pytest.mark.parametrize("fields", [{"op": ""}, {"max_attempts": 0}, {"timeout_s": 0.0}, {"timeout_s": -2.5}])
def test_invalid_submit_is_invalid_argument(h: Harness, fields: dict[str, Any]) -> None:
    """An invalid submit is answered invalid_argument with its req_id, and no plan is made."""
    c = h.client()
    h.send(c, Submit(**{"req_id": 42, "op": "echo", **fields}))
    error = only(h.take(c), Error)
    assert (error.code, error.req_id) == (errors.INVALID_ARGUMENT, 42)
    assert h.core.plans == {}


def test_submit_without_subscribe_sends_no_events(h: Harness) -> None:
    """subscribe=False gets the accepted reply and no events."""
    c = h.client()
    h.submit(c, subscribe=False)
    msgs = h.take(c)
    assert len(msgs) == 1 and isinstance(msgs[0], Accepted)


def test_subscribe_replays_from_seq_then_streams(h: Harness) -> None:
    """subscribe answers subscribed, replays held events after from_seq, then streams live ones."""
    w = h.worker("w1")
    c = h.client()
    plan_id = h.submit(c, subscribe=False)
    h.send(w, Accept(plan_id=plan_id, attempt=1))
    watcher = h.client()
    h.send(watcher, Subscribe(req_id=5, plan_ids=[plan_id], from_seq=1))
    msgs = h.take(watcher)
    assert msgs[0] == Subscribed(req_id=5, plan_ids=[plan_id], last_seqs={plan_id: 3})  # where its stream ends
    assert [(e.seq, e.kind) for e in msgs[1:]] == [(2, "leased"), (3, "running")]
    h.send(w, Event(plan_id=plan_id, attempt=1, kind="log"))
    assert [e.seq for e in h.events(watcher)] == [4]


def test_subscribe_all_follows_current_and_future_plans(h: Harness) -> None:
    """all=True lists the principal's plans, replays them, and follows plans submitted later."""
    c = h.client()
    old = h.submit(c, subscribe=False)
    h.client("bob")
    watcher = h.client()
    h.send(watcher, Subscribe(req_id=1, all=True))
    msgs = h.take(watcher)
    assert msgs[0] == Subscribed(req_id=1, plan_ids=[old])
    new = h.submit(c, subscribe=False)
    assert {e.plan_id for e in h.events(watcher)} == {new}
    bob = h.client("bob")
    h.submit(bob)
    assert h.events(watcher) == []


def test_subscribe_unknown_plan_subscribes_nothing(h: Harness) -> None:
    """One unknown plan id answers plan_not_found and makes no subscription at all."""
    c = h.client()
    plan_id = h.submit(c, subscribe=False)
    watcher = h.client()
    h.send(watcher, Subscribe(req_id=3, plan_ids=[plan_id, "ghost"]))
    error = only(h.take(watcher), Error)
    assert (error.code, error.req_id, error.plan_id) == (errors.PLAN_NOT_FOUND, 3, "ghost")
    h.worker("w1")
    assert h.take(watcher) == []


def test_unsubscribe_stops_events(h: Harness) -> None:
    """After unsubscribe (by id or all) the session gets no more events of the plan."""
    c = h.client()
    plan_id = h.submit(c)
    h.take(c)
    h.send(c, Unsubscribe(req_id=9, plan_ids=[plan_id]))
    assert h.take(c) == [Ok(req_id=9)]
    h.worker("w1")
    assert h.take(c) == []
    h.send(c, Subscribe(req_id=10, all=True))
    h.send(c, Unsubscribe(req_id=11, all=True))
    h.take(c)
    h.submit(c, subscribe=False)
    assert h.events(c) == []


def test_unknown_plan_is_plan_not_found(h: Harness) -> None:
    """get_plan and cancel of an unknown plan answer plan_not_found with the req_id."""
    c = h.client()
    h.send(c, GetPlan(req_id=1, plan_id="ghost"))
    h.send(c, Cancel(req_id=2, plan_id="ghost"))
    replies = h.take(c)
    assert [(e.code, e.req_id, e.plan_id) for e in replies] == [
        (errors.PLAN_NOT_FOUND, 1, "ghost"),
        (errors.PLAN_NOT_FOUND, 2, "ghost"),
    ]


def test_get_plan_reports_the_record(h: Harness) -> None:
    """get_plan answers the plan's current state, attempt, worker and last seq."""
    h.worker("w1")
    c = h.client()
    plan_id = h.submit(c, priority=3)
    h.take(c)
    h.send(c, GetPlan(req_id=4, plan_id=plan_id))
    info = only(h.take(c), PlanReply).plan
    assert (info.id, info.state, info.attempt, info.worker_id, info.priority, info.last_seq) == (
        plan_id,
        "leased",
        1,
        "w1",
        3,
        2,
    )


def test_list_workers_rows_and_summary(h: Harness) -> None:
    """list_workers answers one row per worker, with the age of its last beat, and the summary."""
    h.worker("w2")
    w1 = h.worker("w1")
    h.close(w1)
    h.now = 4.0
    c = h.client()
    h.send(c, ListWorkers(req_id=8))
    reply = only(h.take(c), Workers)
    assert [(r.id, r.connected, r.alive, r.last_beat_age_s) for r in reply.workers] == [
        ("w1", False, False, 4.0),
        ("w2", True, True, 4.0),
    ]
    assert reply.summary == "1 workers (4 CPUs, 0 GPUs, 8.0 GB RAM)" == h.core.summary(h.now)


# ---------------------------------------------------------------- protocol errors and sessions


def test_decode_failure_becomes_error_frame(h: Harness) -> None:
    """A DecodeFailure is answered with an error carrying its code, message and req_id."""
    c = h.client()
    h.send(c, DecodeFailure(errors.INVALID_MESSAGE, "invalid 'submit' message: bad", req_id=12, type="submit"))
    assert h.take(c) == [Error(code=errors.INVALID_MESSAGE, message="invalid 'submit' message: bad", req_id=12)]
    assert h.core.counters["protocol_errors"] == 1


def test_too_many_protocol_errors_close_4400(h: Harness) -> None:
    """Reaching max_protocol_errors on a session closes it with 4400; later input is ignored."""
    h = Harness(max_protocol_errors=3)
    c = h.client()
    for _ in range(3):
        h.send(c, DecodeFailure(errors.BAD_FRAME, "not msgpack"))
    assert [(conn, code) for conn, code, _ in h.closes] == [(c, errors.CLOSE_PROTOCOL)]
    h.take(c)
    h.send(c, GetPlan(req_id=1, plan_id="x"))
    assert h.take(c) == []


def test_message_of_the_other_role_is_forbidden(h: Harness) -> None:
    """A worker message on a client session closes it 4403; a type of neither role is unknown_type."""
    c = h.client()
    h.send(c, DecodeFailure(errors.UNKNOWN_TYPE, "unknown message type 'welcome'", 3, "welcome"))
    assert only(h.take(c), Error).code == errors.UNKNOWN_TYPE
    h.send(c, Heartbeat())
    assert h.take(c) == []
    assert [(conn, code) for conn, code, _ in h.closes] == [(c, errors.CLOSE_FORBIDDEN)]


def test_close_session_is_idempotent(h: Harness) -> None:
    """Closing an unknown or already closed connection does nothing."""
    c = h.client()
    h.close(c)
    h.close(c)
    h.close(12345)
    h.send(c, GetPlan(req_id=1, plan_id="x"))
    assert h.take(c) == []


def test_closed_client_gets_no_more_events(h: Harness) -> None:
    """A closed client session is dropped from every subscription."""
    c = h.client()
    plan_id = h.submit(c)
    h.close(c)
    h.take(c)
    h.worker("w1")
    assert h.take(c) == []
    assert not h.core.subscriptions.followers(plan_id)


# ---------------------------------------------------------------- the invariant under random inputs


def test_placement_invariant_holds_under_random_inputs() -> None:
    """Random workers, submits, accepts, dones, cancels, rejects and reaps never leave a placeable plan queued."""
    rng = random.Random(1234)
    h = Harness()  # every input checks the invariant in Harness._pump
    c = h.client()
    workers: dict[str, int] = {}
    for step in range(600):
        h.now += rng.random() * 3
        action = rng.randrange(8)
        if action == 0 or not workers:
            wid = f"w{rng.randrange(6)}"
            ops = rng.sample(["a", "b", "c"], rng.randrange(1, 3))
            tags = rng.sample(["gpu", "x"], rng.randrange(0, 2))
            workers[wid] = h.worker(wid, ops=ops, tags=tags, max_concurrency=rng.randrange(0, 3))
        elif action == 1:
            tags = rng.sample(["gpu", "x"], rng.randrange(0, 2))
            h.submit(c, op=rng.choice("abcd"), priority=rng.randrange(3), requirements=Requirements(tags=tags))
        elif action in (2, 3):
            wid = rng.choice(list(workers))
            record = h.core.registry.get(wid) if wid in h.core.registry else None
            if record and record.leases:
                plan = h.core.plans[rng.choice(sorted(record.leases))]
                msg: Any = rng.choice(
                    [
                        Accept(plan_id=plan.id, attempt=plan.attempt),
                        Done(plan_id=plan.id, attempt=plan.attempt, outcome="succeeded"),
                        Reject(plan_id=plan.id, attempt=plan.attempt),
                    ]
                )
                h.send(workers[wid], msg)
        elif action == 4:
            live = [p for p in h.core.plans.values() if not p.terminal]
            if live:
                h.send(c, Cancel(req_id=step, plan_id=rng.choice(live).id))
        elif action == 5:
            wid = rng.choice(list(workers))
            h.send(workers[wid], Heartbeat())
        elif action == 6:
            wid = rng.choice(list(workers))
            h.close(workers.pop(wid))
        else:
            h.tick(h.now)
    assert h.core.counters["plans_submitted"] > 50
