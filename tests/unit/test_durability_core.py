"""The core's durability rules with a fake clock: records, restart and grace, acks and de-duplication,
retries, hand-back, the reaper's circuit breaker and replay gaps (docs/SEMANTICS.md §Durability)."""

from __future__ import annotations

from typing import Any

import pytest
from structlog.testing import capture_logs

from coordinator import Coordinator, CoreConfig
from coordinator.io.stores.store import MemoryStore
from coordinator.records import PlanCreated, PlanStatus
from protocol import errors
from protocol.messages import (
    Accept,
    Accepted,
    Ack,
    Assign,
    Done,
    ErrorInfo,
    Event,
    Goodbye,
    Heartbeat,
    Resync,
    Submit,
    Subscribe,
    Welcome,
)
from tests.unit.test_core import Harness, check_invariant, kinds, only


class Durable(Harness):
    """A Harness whose records go to a real MemoryStore, and that can restart the core from it."""

    def __init__(self, store: MemoryStore | None = None, **config: Any) -> None:
        super().__init__(**config)
        self.config = config
        self.store = store if store is not None else MemoryStore()
        self.records: list[Any] = []

    def _pump(self) -> None:
        effects = self.core.take_effects()
        if effects.records:
            self.store.write(effects.records)
            self.records.extend(effects.records)
        for conn_id, msgs in effects.sends.items():
            self.inbox.setdefault(conn_id, []).extend(msgs)
            for msg in msgs:
                if isinstance(msg, Welcome):  # kept as an agent keeps it (Harness._pump)
                    self.secrets[msg.worker_id] = msg.session_secret
        self.closes.extend(effects.closes)
        check_invariant(self.core, self.now)

    def restart(self, now: float) -> None:
        """A new process: a fresh core restored from the store at ``now``; every session is gone."""
        self.now = now
        self.core = Coordinator(CoreConfig(**self.config), new_id=lambda: "unused")
        self.core.restore(self.store.load(), now)
        self.inbox.clear()
        self._pump()


def running_plan(h: Durable, worker_id: str = "w1", **submit: Any) -> tuple[int, int, str]:
    """A client, a worker and one plan running on it (attempt 1)."""
    w = h.worker(worker_id)
    c = h.client()
    plan_id = h.submit(c, **submit)
    assign = only(h.take(w), Assign)
    h.send(w, Accept(plan_id=plan_id, attempt=assign.attempt, seq=1))
    return c, w, plan_id


# ---------------------------------------------------------------- records


def test_submit_records_the_plan_in_the_same_step_as_accepted() -> None:
    """A submit's effects carry accepted and the PlanCreated/queued/status records together (§Durability)."""
    h = Durable()
    c = h.client()
    submit = Submit(req_id=1, op="echo", plan_id="job-1")
    h.core.receive(c, submit, 0.0)
    effects = h.core.take_effects()
    assert any(isinstance(m, Accepted) for m in effects.sends[c])
    created = [r for r in effects.records if isinstance(r, PlanCreated)]
    assert [(r.plan_id, r.submit) for r in created] == [("job-1", submit)]
    assert [r.kind for r in effects.records if isinstance(r, Event)] == ["queued", "waiting"]
    statuses = [r for r in effects.records if isinstance(r, PlanStatus)]
    assert len(statuses) == 1 and statuses[0].next_seq == 3  # one status per plan per step


def test_ephemeral_events_are_not_recorded_but_advance_next_seq() -> None:
    """An ephemeral event is no record of its own; the plan's status still carries the seq past it."""
    h = Durable()
    _, w, plan_id = running_plan(h)
    h.records.clear()
    h.send(w, Event(plan_id=plan_id, attempt=1, kind="token", data="a", ephemeral=True, seq=2))
    assert not [r for r in h.records if isinstance(r, Event)]
    assert [r.next_seq for r in h.records if isinstance(r, PlanStatus)] == [h.core.plans[plan_id].next_seq]


# ---------------------------------------------------------------- restart


def test_restart_queues_queued_plans_again_and_continues_their_seq() -> None:
    """After a restart a queued plan is placed when a worker comes, and its seq goes on from the store."""
    h = Durable()
    c = h.client()
    plan_id = h.submit(c)
    last = h.core.plans[plan_id].next_seq - 1
    h.restart(now=500.0)
    assert h.state(plan_id) == "queued"
    w = h.worker("w1")
    assign = only(h.take(w), Assign)
    assert (assign.plan_id, assign.attempt) == (plan_id, 1)
    assert h.core.plans[plan_id].events[-1].seq > last
    assert [e.seq for e in h.core.plans[plan_id].events] == list(range(1, h.core.plans[plan_id].next_seq))


def test_restart_leased_plan_continues_when_its_worker_reconnects_within_the_grace() -> None:
    """A running plan's worker that reconnects within one heartbeat timeout of the restart keeps the plan."""
    h = Durable(heartbeat_timeout_s=30.0)
    _, _, plan_id = running_plan(h)
    h.restart(now=1000.0)
    h.tick(1029.0)
    assert h.state(plan_id) == "running" and h.core.registry.get("w1").leases == {plan_id}
    w = h.worker("w1", running=[(plan_id, 1)])
    assert only(h.take(w), Welcome).continue_plans == [plan_id]
    h.send(w, Done(plan_id=plan_id, attempt=1, outcome="succeeded", result=7, seq=2))
    assert h.state(plan_id) == "succeeded" and h.core.plans[plan_id].attempt == 1


def test_restart_leased_plan_is_requeued_one_timeout_after_the_restart() -> None:
    """With no reconnect, the reaper requeues a restored lease at restart + timeout, never earlier."""
    h = Durable(heartbeat_timeout_s=30.0)
    _, _, plan_id = running_plan(h)
    h.restart(now=1000.0)  # the stored plan knows no time: the clock starts here
    assert h.tick(1030.0) == [] and h.state(plan_id) == "running"
    assert h.tick(1030.5) == ["w1"]
    plan = h.core.plans[plan_id]
    requeued = [e for e in plan.events if e.kind == "requeued"]
    assert plan.state == "queued" and len(requeued) == 1 and requeued[0].data["attempt"] == 2


def test_duplicate_submit_after_restart_returns_the_first_plan() -> None:
    """An idempotency key submitted before a restart and again after it yields one plan (matrix row 12)."""
    h = Durable()
    c = h.client()
    h.submit(c, plan_id="job-9")
    h.restart(now=10.0)
    c2 = h.client()
    assert h.submit(c2, plan_id="job-9") == "job-9"
    accepted = only(h.take(c2), Accepted)
    assert accepted.duplicate and len(h.core.plans) == 1


def test_restored_terminal_plan_replays_its_stream() -> None:
    """A plan that ended before the restart can still be watched from seq 0, with its result."""
    h = Durable()
    _, w, plan_id = running_plan(h)
    h.send(w, Done(plan_id=plan_id, attempt=1, outcome="succeeded", result={"x": 1}, seq=2))
    h.restart(now=5.0)
    c = h.client()
    h.send(c, Subscribe(req_id=9, plan_ids=[plan_id]))
    events = h.events(c, plan_id)
    assert kinds(events)[-1] == "succeeded" and events[-1].data["result"] == {"x": 1}
    assert h.core.plans[plan_id].info().result == {"x": 1}


# ---------------------------------------------------------------- ack and de-duplication


def test_ack_follows_the_highest_seq_of_a_step() -> None:
    """After a step with numbered worker messages, the worker gets ack(highest seq)."""
    h = Durable()
    _, w, plan_id = running_plan(h)
    assert only(h.take(w), Ack).seq == 1
    h.send(w, Event(plan_id=plan_id, attempt=1, kind="log", data="x", seq=2))
    assert only(h.take(w), Ack).seq == 2
    h.send(w, Heartbeat())
    assert h.take(w) == []  # nothing new to acknowledge


def test_resent_event_and_done_are_applied_once() -> None:
    """A re-sent event or done (same attempt, seq not above the last applied) is dropped, not forwarded."""
    h = Durable()
    c, w, plan_id = running_plan(h)
    h.take(c)
    log = Event(plan_id=plan_id, attempt=1, kind="log", data="x", seq=2)
    done = Done(plan_id=plan_id, attempt=1, outcome="succeeded", result=1, seq=3)
    for msg in (log, log, done, log, done):
        h.send(w, msg)
    assert kinds(h.events(c, plan_id)) == ["log", "succeeded"]
    assert h.core.counters["duplicates_dropped"] == 3
    assert not [m for m in h.take(w) if m.__class__.__name__ == "Error"]  # no stale_lease noise for re-sends


def test_deduplication_survives_a_restart() -> None:
    """After a restart, the worker's re-sent events already recorded are dropped; the newer ones pass."""
    h = Durable()
    _, w_old, plan_id = running_plan(h)
    h.send(w_old, Event(plan_id=plan_id, attempt=1, kind="log", data="a", seq=2))
    h.restart(now=50.0)
    c = h.client()
    h.send(c, Subscribe(req_id=1, plan_ids=[plan_id], from_seq=h.core.plans[plan_id].next_seq - 1))
    h.take(c)
    w = h.worker("w1", running=[(plan_id, 1)])
    h.send(w, Event(plan_id=plan_id, attempt=1, kind="log", data="a", seq=2))  # recorded before the crash
    h.send(w, Event(plan_id=plan_id, attempt=1, kind="log", data="b", seq=3))
    assert [e.data for e in h.events(c, plan_id)] == ["b"]


# ---------------------------------------------------------------- retries and hand-back


def test_handler_failure_is_retried_when_the_plan_asks_and_then_fails() -> None:
    """retries=2: two failed attempts are queued again (not counting against max_attempts), the third fails."""
    h = Durable()
    w = h.worker("w1")
    c = h.client()
    plan_id = h.submit(c, retries=2, max_attempts=1)
    boom = ErrorInfo(errors.HANDLER_ERROR, "ValueError: boom")
    for attempt in (1, 2, 3):
        assign = only(h.take(w), Assign)
        assert assign.attempt == attempt
        h.send(w, Done(plan_id=plan_id, attempt=attempt, outcome="failed", error=boom, seq=attempt))
    plan = h.core.plans[plan_id]
    assert plan.state == "failed" and plan.error == boom and plan.retried == 2
    requeued = [e.data["reason"] for e in plan.events if e.kind == "requeued"]
    assert len(requeued) == 2 and "retry 2 of 2" in requeued[1] and "boom" in requeued[0]


def test_handler_failure_without_retries_fails_at_once() -> None:
    """Without retries a done(failed) ends the plan failed on its first attempt."""
    h = Durable()
    _, w, plan_id = running_plan(h)
    h.send(w, Done(plan_id=plan_id, attempt=1, outcome="failed", error=ErrorInfo("handler_error", "x"), seq=2))
    assert h.state(plan_id) == "failed"


def test_goodbye_hands_unfinished_plans_back_at_once_without_spending_an_attempt() -> None:
    """A worker's goodbye requeues its running plan now (no reaper wait) and max_attempts=1 is not used up."""
    h = Durable()
    _, w1, plan_id = running_plan(h, max_attempts=1)
    w2 = h.worker("w2")
    h.send(w1, Goodbye(reason="SIGTERM"))
    plan = h.core.plans[plan_id]
    assert plan.worker_id == "w2" and plan.attempt == 2 and plan.state == "leased"
    assert only(h.take(w2), Assign).attempt == 2
    reasons = [e.data["reason"] for e in plan.events if e.kind == "requeued"]
    assert reasons == ["worker w1 left and handed it back"]
    assert plan.history[-1]["outcome"] == "handed_back"


def test_worker_lost_on_the_last_attempt_fails_with_the_attempt_history() -> None:
    """A plan that loses its worker on its last attempt fails worker_lost with every attempt in its detail."""
    h = Durable(heartbeat_timeout_s=10.0)
    _, w, plan_id = running_plan(h, max_attempts=2)
    h.close(w)
    h.tick(11.0)
    w2 = h.worker("w2")
    h.take(w2)
    h.close(w2)
    h.tick(22.0)
    plan = h.core.plans[plan_id]
    assert plan.state == "failed" and plan.error is not None and plan.error.code == errors.WORKER_LOST
    assert [(a["attempt"], a["worker_id"], a["outcome"]) for a in plan.error.detail["attempts"]] == [
        (1, "w1", "lost"),
        (2, "w2", "lost"),
    ]


# ---------------------------------------------------------------- reaper circuit breaker


def fleet(h: Durable, n: int) -> list[int]:
    return [h.worker(f"w{i}") for i in range(1, n + 1)]


def test_breaker_holds_the_reaper_when_most_workers_go_silent_at_once() -> None:
    """4 of 4 connected workers silent in one tick: nothing is reaped, loudly; after the hold they are."""
    h = Durable(heartbeat_timeout_s=10.0)
    fleet(h, 4)
    with capture_logs() as logs:
        assert h.tick(10.5) == []
    assert [e for e in logs if e["log_level"] == "error" and "circuit breaker OPEN" in e["event"]]
    assert h.core.counters["workers_reaped"] == 0 and h.core.recovery.breaker.trips == 1
    assert h.tick(20.0) == []  # still inside the hold (one heartbeat timeout)
    assert h.tick(20.6) == ["w1", "w2", "w3", "w4"]


def test_breaker_closes_when_the_workers_beat_again() -> None:
    """A coordinator that stalled reads the queued beats: nobody is reaped and the breaker closes."""
    h = Durable(heartbeat_timeout_s=10.0)
    conns = fleet(h, 3)
    assert h.tick(11.0) == []
    h.now = 11.1
    for conn in conns:
        h.send(conn, Heartbeat())
    with capture_logs() as logs:
        assert h.tick(15.0) == []
    assert h.core.recovery.breaker.opened_at is None
    assert [e for e in logs if "circuit breaker closed" in e["event"]]


def test_breaker_lets_a_minority_of_silent_workers_be_reaped() -> None:
    """One silent worker of four is reaped as usual."""
    h = Durable(heartbeat_timeout_s=10.0)
    conns = fleet(h, 4)
    h.now = 9.0
    for conn in conns[1:]:
        h.send(conn, Heartbeat())
    assert h.tick(10.5) == ["w1"]


@pytest.mark.parametrize("workers", [1, 2])
def test_breaker_needs_at_least_three_connected_workers(workers: int) -> None:
    """With fewer than three connected workers, silent ones are reaped at once."""
    h = Durable(heartbeat_timeout_s=10.0)
    fleet(h, workers)
    assert len(h.tick(10.5)) == workers


def test_breaker_never_holds_disconnected_workers() -> None:
    """A closed session is news about the worker: it is reaped even while the breaker holds the others."""
    h = Durable(heartbeat_timeout_s=10.0)
    conns = fleet(h, 4)
    h.close(conns[0])
    assert h.tick(10.5) == ["w1"]


# ---------------------------------------------------------------- replay gaps


def test_replay_reports_events_lost_in_a_restart_with_resync() -> None:
    """Ephemeral events lost in a restart are answered with resync(first..last, plan), never a silent gap."""
    h = Durable()
    _, w, plan_id = running_plan(h)
    for n in (2, 3):
        h.send(w, Event(plan_id=plan_id, attempt=1, kind="token", data=n, ephemeral=True, seq=n))
    h.send(w, Event(plan_id=plan_id, attempt=1, kind="log", data="kept", seq=4))
    before = [e.seq for e in h.core.plans[plan_id].events]
    h.restart(now=9.0)
    c = h.client()
    h.send(c, Subscribe(req_id=1, plan_ids=[plan_id], from_seq=before[-4]))
    msgs = [m for m in h.take(c) if isinstance(m, Event | Resync)]
    resync = only(msgs, Resync)
    assert (resync.first_seq, resync.last_seq) == (before[-3], before[-2])
    assert resync.plan is not None and resync.plan.state == "running" and not resync.recovered
    assert [m.kind if isinstance(m, Event) else "resync" for m in msgs] == ["resync", "log"]


def test_replay_without_gaps_sends_no_resync() -> None:
    """A plan whose every event is held replays them all from any seq, with no resync."""
    h = Durable()
    c, _, plan_id = running_plan(h)
    h.send(c, Subscribe(req_id=5, plan_ids=[plan_id], from_seq=1))
    assert not [m for m in h.take(c) if isinstance(m, Resync)]
    assert h.core.counters["resyncs_sent"] == 0
