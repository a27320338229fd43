"""The coordinator's decisions, with no I/O: the sans-I/O core the asyncio server drives.

The server feeds inputs and carries out the effects:

* :meth:`Coordinator.open_session` / :meth:`~Coordinator.close_session`: a connection came
  or went (for any reason);
* :meth:`Coordinator.receive`: one decoded message (or ``DecodeFailure``) from a connection;
* :meth:`Coordinator.tick`: the clock moved; the reaper runs;
* :meth:`Coordinator.take_effects`: the frames to send (per connection, in order) and the
  connections to close, accumulated since the last call.

Time comes in as ``now`` (monotonic seconds) and plan ids from the ``new_id`` callable, so
tests drive the core with a fake clock and fixed ids. Nothing here awaits, reads a clock,
or draws a random number. docs/SEMANTICS.md is the contract; sections are cited as §Name.

Invariant after every input: no queued plan has an alive worker with room that can run
it. Placement runs where that could break: on submit, on a worker's (re)registration or
return to life, on a lease release, after a requeue.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import structlog

from coordinator import client_session, scopes, worker_session
from coordinator.autoscaler import AutoscaleConfig, Autoscaler, pool_signals
from coordinator.limits import PlanQuota
from coordinator.operator_requests import OperatorRequests
from coordinator.placement.placer import Placement, PlacementConfig
from coordinator.placement.plan_queue import PlanQueue, Signature, explain_wait
from coordinator.placement.policies import POLICY_NAMES
from coordinator.plans import (
    EVERY_PRINCIPAL,
    SMALL_EVENT_BYTES,
    Plan,
    Subscriptions,
    advance,
)
from coordinator.records import StoredPlan
from coordinator.recovery import Recovery, note_attempt
from coordinator.registry import WorkerRecord, WorkerRegistry
from coordinator.retention import Retention
from coordinator.stats import PlanTimings
from protocol import errors
from protocol.codec import DecodeFailure
from protocol.messages import (
    TERMINAL_STATES,
    Accept,
    Ack,
    Assign,
    Cancel,
    Done,
    DrainWorker,
    Error,
    ErrorInfo,
    Event,
    GetPlan,
    Goodbye,
    Heartbeat,
    Hello,
    ListPlans,
    ListWorkers,
    Reject,
    Revoke,
    Submit,
    Subscribe,
    UndrainWorker,
    Unsubscribe,
)

__all__ = ["Coordinator", "CoreConfig", "Effects"]

log = structlog.get_logger(__name__)

# Placements are counted per policy under "placements.<policy>" (coordinator/io/metrics.py turns the
# suffix into the ``policy`` label); the policies are in coordinator/placement/policies.py.
PLACEMENT_COUNTERS = " ".join(f"placements.{name}" for name in POLICY_NAMES)

Role = Literal["worker", "client"]
WorkerMessage = Hello | Heartbeat | Accept | Reject | Event | Done | Goodbye
ClientMessage = (
    Submit | Subscribe | Unsubscribe | Cancel | GetPlan | ListWorkers | ListPlans | DrainWorker | UndrainWorker
)
_WORKER_TYPES = (Hello, Heartbeat, Accept, Reject, Event, Done, Goodbye)
_CLIENT_TYPES = (
    Submit, Subscribe, Unsubscribe, Cancel, GetPlan, ListWorkers, ListPlans, DrainWorker, UndrainWorker
)


@dataclass(frozen=True)
class CoreConfig:
    """Settings of the core; the server fills them from flags."""

    heartbeat_interval_s: float = 10.0
    heartbeat_timeout_s: float = 30.0
    max_protocol_errors: int = 100  # per session; reaching it closes the session with 4400
    max_plans_per_principal: int = 0  # unfinished plans per client principal (0: no limit; coordinator/limits.py)
    max_events_per_plan: int = 10_000  # events held in memory per plan (coordinator/plans.py)
    max_event_bytes_per_plan: int = 64 << 20  # ... and their payload bytes (0: no byte bound)
    version: str = ""  # the coordinator's version, put in ``welcome``
    breaker_fraction: float = 0.5  # reaper circuit breaker: share of connected workers stale at once
    breaker_min_workers: int = 3  # ... among at least this many connected workers (coordinator/recovery.py)
    placement: PlacementConfig = field(default_factory=PlacementConfig)  # coordinator/placement/placer.py
    autoscale: AutoscaleConfig | None = None  # None: no autoscaler (coordinator/autoscaler.py)
    plan_retention_s: float = 86_400.0  # finished plans are forgotten this long after they end (0: never)


@dataclass
class Effects:
    """What the server must do: commit ``records``, then send ``sends`` (each list in order), then ``closes``.

    No frame of a step may leave before the step's records are durable (coordinator/io/commit.py).
    """

    sends: dict[int, list[Any]] = field(default_factory=dict)
    closes: list[tuple[int, int, str]] = field(default_factory=list)  # (conn_id, close code, reason)
    records: list[Any] = field(default_factory=list)  # coordinator/records.py
    decisions: list[dict[str, Any]] = field(default_factory=list)  # autoscaler decisions, for the hook command


@dataclass(eq=False)
class _Session:
    """One connection, as the core sees it."""

    conn_id: int
    role: Role
    principal: str
    address: str
    admin: bool = False
    worker_id: str | None = None  # set by ``hello``; cleared when the id moves on
    closing: bool = False  # a close was asked for; later input is ignored
    protocol_errors: int = 0
    worker_ids: str | None = None  # the glob of worker ids its token may register (coordinator/scopes.py)
    quota_refusals: int = 0


class Coordinator:
    """The coordinator state machine: registry, plans, queue, sessions and subscriptions.

    Args:
        config: settings.
        new_id: makes a plan id when the client gives none.
    """

    def __init__(self, config: CoreConfig, new_id: Callable[[], str]) -> None:
        self.config = config
        self.registry = WorkerRegistry(config.heartbeat_timeout_s, prefetch=config.placement.prefetch)
        self.plans: dict[str, Plan] = {}
        self.placement = Placement(self.registry, self.plans, config.placement)
        self.autoscaler = Autoscaler(config.autoscale) if config.autoscale is not None else None
        self.queue = PlanQueue()
        self.subscriptions = Subscriptions()
        # Every counter exists from the start, so a metrics scrape never misses one.
        self.counters: dict[str, int] = dict.fromkeys(
            "plans_submitted plans_requeued events_forwarded stale_dropped protocol_errors workers_reaped"
            f" heartbeats {PLACEMENT_COUNTERS} plans_revoked scope_refused plans_refused".split(),
            0,
        )
        self.timings = PlanTimings()  # queue-wait and run-time histograms (coordinator/io/metrics.py exports them)
        self.operator = OperatorRequests(self)  # list_plans, drain_worker, undrain_worker (operator_requests.py)
        self.recovery = Recovery(self)  # records, acks, restore, hand-back, retries (coordinator/recovery.py)
        self.retention = Retention(self, config.plan_retention_s)  # forgets old finished plans (retention.py)
        self._clock = 0.0  # the ``now`` of the input being handled: when a plan ends (retention)
        self._new_id = new_id
        self._quota = PlanQuota(config.max_plans_per_principal)  # coordinator/limits.py
        self._sessions: dict[int, _Session] = {}
        self._submit_order = itertools.count(1)
        self._effects = Effects()
        self._wait_reasons: dict[Signature, str] = {}  # see _wait_reason
        self._wait_stamp = (-1, -1)

    # ================================================================== driver API

    def open_session(
        self,
        conn_id: int,
        role: Role,
        now: float,
        *,
        principal: str = "",
        address: str = "",
        admin: bool = False,
        worker_ids: str | None = None,
    ) -> None:
        """A connection was accepted. ``admin`` sessions see every principal's plans.

        ``worker_ids`` limits the ids a worker session may register (a glob; None: any).

        Raises:
            ValueError: ``conn_id`` is already open (a driver bug).
        """
        if conn_id in self._sessions:
            raise ValueError(f"connection {conn_id} is already open")
        self._sessions[conn_id] = _Session(conn_id, role, principal, address, admin, worker_ids=worker_ids)

    def receive(self, conn_id: int, msg: Any, now: float) -> None:
        """One message from a connection: a Struct of its role's inbound union, or a DecodeFailure."""
        session = self._sessions.get(conn_id)
        if session is None or session.closing:
            return
        self._clock = now
        if isinstance(msg, DecodeFailure):
            if msg.code == errors.UNKNOWN_TYPE and scopes.foreign_type(session.role, msg.type):
                self._forbid(session, f"a {session.role} session may not send {msg.type!r}", "foreign_type")
            else:
                self._protocol_error(session, msg.code, msg.message, req_id=msg.req_id)
        elif session.role == "worker" and isinstance(msg, _WORKER_TYPES):
            worker_session.on_worker(self, session, msg, now)
        elif session.role == "client" and isinstance(msg, _CLIENT_TYPES):
            client_session.on_client(self, session, msg, now)
        else:
            config = getattr(type(msg), "__struct_config__", None)
            tag = getattr(config, "tag", None) or type(msg).__name__
            if scopes.foreign_type(session.role, tag):
                self._forbid(session, f"a {session.role} session may not send {tag!r}", "foreign_type")
                return
            self._protocol_error(
                session,
                errors.UNKNOWN_TYPE,
                f"message type {tag!r} is not accepted on a {session.role} session",
                req_id=getattr(msg, "req_id", 0),
            )

    def close_session(self, conn_id: int, now: float) -> None:
        """The connection is gone, for any reason. Idempotent; an unknown id is a no-op."""
        session = self._sessions.pop(conn_id, None)
        if session is None:
            return
        self._effects.sends.pop(conn_id, None)  # nothing can reach it any more
        self.recovery.forget(conn_id)
        if session.role == "worker":
            worker_session.detach_worker(self, session, now)
        else:
            self.subscriptions.drop(conn_id)

    def tick(self, now: float) -> list[str]:
        """Reap workers silent past the timeout (§Registry); returns their ids, sorted.

        Finished plans past their retention are forgotten first (coordinator/retention.py).
        """
        self._clock = now
        self.retention.sweep(now)
        self.operator.tick(now)  # drained workers whose deadline passed hand their plans back
        self._autoscale(now)
        # The breaker holds back a mass of silent workers: the coordinator itself is suspect.
        lost = self.recovery.breaker.admit(self.registry.stale(now), self.registry, now)
        if not lost:
            return []
        for record in lost:
            session = self._sessions.get(record.conn_id) if record.conn_id is not None else None
            if session is not None and session.worker_id == record.id:
                session.worker_id = None
                silent_s = now - record.last_beat_s
                self._close(
                    session,
                    errors.CLOSE_HEARTBEAT_TIMEOUT,
                    f"no heartbeat for {silent_s:.1f} s (timeout {self.config.heartbeat_timeout_s:g} s)",
                )
        reaped = self.registry.reap(now, only={r.id for r in lost})
        self.placement.forget(reaped)
        self.counters["workers_reaped"] += len(reaped)
        leases = [(self.plans[pid], r.id) for r in lost for pid in r.leases if pid in self.plans]
        leases.sort(key=lambda pair: (-pair[0].priority, pair[0].order))  # requeue best first
        for plan, worker_id in leases:
            self._lease_lost(plan, worker_id, f"worker {worker_id} stopped sending heartbeats", now)
        self._refresh_waiting(now)
        return reaped

    def take_effects(self) -> Effects:
        """What accumulated since the last call; the core forgets it."""
        for conn_id, seq in self.recovery.take_acks():  # sent only once the records below are committed
            self._send(conn_id, Ack(seq=seq))
        effects, self._effects = self._effects, Effects()
        effects.records = self.recovery.take_records()
        return effects

    def restore(self, stored: list[StoredPlan], now: float) -> None:
        """Load the plans a store kept, before any session opens (coordinator/recovery.py).

        Queued plans are queued again; leased and running ones wait one heartbeat timeout,
        from ``now``, for their worker to reconnect and claim them.
        """
        queued = self.recovery.restore(stored, now)
        for plan in self.plans.values():  # restored unfinished plans count against their owner's quota
            if not plan.terminal:
                self._quota.add(plan.owner, plan.id)
            else:  # when it really ended is not stored: its retention runs from the restore
                self.retention.ended(plan, now)
        for plan in queued:
            self._enqueue(plan, now)

    def summary(self, now: float) -> str:
        """``"N workers (C CPUs, G GPUs, R GB RAM)"`` over alive workers."""
        return self.registry.summary(now)

    # ================================================================== subscriptions

    def _replay(self, s: _Session, plan: Plan, from_seq: int) -> None:
        for msg in self.recovery.replay(plan, from_seq):  # held events, with a resync for any gap
            self._send(s.conn_id, msg)

    def _emit(self, plan: Plan, kind: str, data: Any, *, ephemeral: bool = False, small: bool = False) -> None:
        """Stamp the next seq on an event of the plan and send it to its subscribers.

        ``small``: a lifecycle event whose data the core built from a few scalars (not sized).
        """
        event = plan.append_event(
            kind, data, attempt=plan.attempt, ephemeral=ephemeral, max_events=self.config.max_events_per_plan,
            max_bytes=self.config.max_event_bytes_per_plan, size=SMALL_EVENT_BYTES if small else None,
        )
        self.recovery.journal.emitted(plan, event)
        for conn_id in self.subscriptions.followers(plan.id):
            self._send(conn_id, event)
        if kind in TERMINAL_STATES:  # the stream's last event: the plan no longer counts against its owner
            self._quota.release(plan.owner, plan.id)
            self.retention.ended(plan, self._clock)

    def _fail(self, plan: Plan, worker_id: str | None, error: ErrorInfo) -> None:
        """Record why the plan failed (the table move is done) and end its stream with ``failed``."""
        plan.error = error
        data = {"code": error.code, "message": error.message, "detail": error.detail, "worker_id": worker_id}
        self._emit(plan, "failed", {**data, "attempt": plan.attempt})

    # ================================================================== placement (§Placement)

    def _enqueue(self, plan: Plan, now: float) -> None:
        """Place a queued plan now if an alive worker with room can run it, else queue it and say why."""
        # Queue wait runs from here to the next attempt's accept (coordinator/stats.py).
        plan.queued_at_s, plan.started_at_s = now, None
        signature = Signature.of(plan.op, plan.requirements, plan.avoid)
        pool = self.registry.matching(signature, signature.admits)
        # Only KV room can leave a group queued while a worker has a slot: a newcomer waits its turn.
        ahead = self.queue.has_ahead(signature, plan.priority, plan.order)
        best = None if ahead else self.placement.choose(plan, pool, now)
        if best is not None:
            self._assign(plan, best)
            return
        self.queue.push(plan.id, signature, plan.priority, plan.order)
        reason = self._wait_reason(signature, now)
        if reason == "waiting for placement":  # room somewhere, but not for this plan's KV blocks
            reason = self.placement.kv_reason(plan, pool) or reason
        if reason != self.queue.group_reason(signature):
            self.queue.set_group_reason(signature, None)  # the group's plans disagree: the next refresh visits them
        self._set_waiting(plan, reason)

    def _fill_worker(self, record: WorkerRecord, now: float) -> None:
        """Give a worker with room the best queued plans it can run, one signature check per group."""
        if not self.registry.is_alive(record.id, now):
            return
        plans, fits = self.plans, self.placement.fits
        while record.has_capacity():
            plan_id = self.queue.best_for(lambda sig: sig.admits(record), lambda pid: fits(plans[pid], record))
            if plan_id is None:
                break
            self._assign(self.plans[plan_id], record)
        # Nothing queued it can run and a slot free: take back an unstarted lease from the most backlogged.
        while (stolen := self.placement.steal_for(record, now)) is not None:
            plan, victim = stolen
            if victim.conn_id is not None:
                self._send(victim.conn_id, Revoke(plan_id=plan.id, attempt=plan.attempt))

    def _assign(self, plan: Plan, record: WorkerRecord) -> None:
        self.queue.discard(plan.id)
        advance(plan, "assign")
        plan.attempt += 1
        plan.worker_id = record.id
        plan.waiting_reason = None
        self.registry.claim(record.id, plan.id)
        self.placement.claimed(plan, record)
        self.counters[f"placements.{self.placement.policy_name(plan)}"] += 1
        if record.conn_id is not None:
            assign = Assign(plan_id=plan.id, attempt=plan.attempt, op=plan.op, args=plan.args, timeout_s=plan.timeout_s)
            self._send(record.conn_id, assign)
        self._emit(plan, "leased", {"worker_id": record.id, "attempt": plan.attempt}, small=True)

    def _autoscale(self, now: float) -> None:
        """Feed the autoscaler; its decisions go to admin followers and to the server's hook command."""
        if self.autoscaler is None or not self.autoscaler.due(now):
            return
        signals = pool_signals(self.queue, self.registry, self.plans, now)
        for decision in self.autoscaler.observe(now, signals):
            data = decision.as_dict()
            self._effects.decisions.append(data)
            log.info("autoscaler decision", **data)
            event = Event(plan_id="", kind="autoscale", data=data, seq=self.autoscaler.decisions_made)
            for conn_id in self.subscriptions.all_followers(EVERY_PRINCIPAL):
                self._send(conn_id, event)

    def _set_waiting(self, plan: Plan, reason: str) -> None:
        if plan.waiting_reason != reason:  # §Plan lifecycle: emitted again only when the reason changes
            plan.waiting_reason = reason
            self._emit(plan, "waiting", {"reason": reason}, small=True)

    def _wait_reason(self, signature: Signature, now: float) -> str:
        """Why a plan just queued waits: explain_wait, cached per signature until room may have changed.

        explain_wait walks every alive worker; with thousands of them that was most of a queued
        submit. The cache is dropped when the registry changes (membership, connection), a lease
        is released, or a drain, undrain or revival ends in :meth:`_refresh_waiting`: without
        those no worker gains room or requirements, so the reason is what explain_wait would say
        (a worker falling silent is corrected by the reaper's refresh). "waiting for placement"
        (room somewhere, not for this plan's KV blocks) depends on the plan: never cached.
        """
        cache = self._wait_reasons
        stamp = (self.registry.generation, self.registry.releases)
        if self._wait_stamp != stamp:
            cache.clear()
            self._wait_stamp = stamp
        reason = cache.get(signature)
        if reason is None:
            reason = explain_wait(signature, self.registry.iter_alive(now))
            if reason != "waiting for placement":
                cache[signature] = reason
        return reason

    def _refresh_waiting(self, now: float) -> None:
        """Re-explain every queued group after the set of alive workers changed.

        A group's plans are visited only when its reason changed since the last refresh.
        Nothing queued: nothing to explain (a registration then costs no pass over the workers).
        """
        self._wait_reasons.clear()  # drains and revivals change reasons without a registry change
        self.placement.room_may_have_changed()
        if not self.queue:
            return
        alive = list(self.registry.iter_alive(now))  # explain_wait needs no order
        for signature in self.queue.signatures():
            reason = explain_wait(signature, alive)
            if reason == self.queue.group_reason(signature):
                continue
            for plan_id in self.queue.plans_in(signature):
                self._set_waiting(self.plans[plan_id], reason)
            self.queue.set_group_reason(signature, reason)

    def _requeue(self, plan: Plan, why: str, now: float) -> None:
        """A leased/running plan is back to queued (the table move is done); tell its stream and place it."""
        plan.worker_id = None
        self.counters["plans_requeued"] += 1
        log.info("plan requeued", plan_id=plan.id, reason=why, next_attempt=plan.attempt + 1)
        self._emit(plan, "requeued", {"reason": why, "attempt": plan.attempt + 1}, small=True)
        self._enqueue(plan, now)

    def _lease_lost(self, plan: Plan, worker_id: str, why: str, now: float) -> None:
        """The worker holding the plan's lease is gone: requeue it, or fail it after its last attempt."""
        if plan.terminal or plan.worker_id != worker_id:
            return  # a cancelled plan only held the lease; nothing is left to do
        note_attempt(plan, "lost", why)
        if plan.attempt - plan.free_attempts >= plan.max_attempts:  # retries and hand-backs are free
            advance(plan, "worker_lost.final")
            message = f"{why} on attempt {plan.attempt} of {plan.max_attempts}; no attempts left"
            log.warning("plan failed: worker lost", plan_id=plan.id, worker_id=worker_id, attempt=plan.attempt)
            self._fail(plan, worker_id, ErrorInfo(errors.WORKER_LOST, message, {"attempts": list(plan.history)}))
        else:
            advance(plan, "worker_lost")
            self._requeue(plan, why, now)

    # ================================================================== effects

    def _send(self, conn_id: int, msg: Any) -> None:
        session = self._sessions.get(conn_id)
        if session is not None and not session.closing:
            self._effects.sends.setdefault(conn_id, []).append(msg)

    def _close(self, s: _Session, code: int, reason: str) -> None:
        if not s.closing:
            s.closing = True
            self._effects.closes.append((s.conn_id, code, reason))

    def _forbid(self, s: _Session, reason: str, kind: scopes.ScopeReason) -> None:
        """Close a session that overstepped its role or token (4403), changing nothing else (scopes.py)."""
        self.counters["scope_refused"] += 1
        key = f"scope_refused.{kind}"  # by reason, for /metrics (coordinator/io/metrics.py)
        self.counters[key] = self.counters.get(key, 0) + 1
        log.warning(
            "refused: out of scope", reason=reason, conn_id=s.conn_id, role=s.role, principal=s.principal,
            address=s.address, worker_id=s.worker_id,
        )
        self._close(s, errors.CLOSE_FORBIDDEN, reason[:120])  # a close reason holds at most 123 bytes

    def _refuse_submit(self, s: _Session, req_id: int, reason: str) -> None:
        """Answer a submit over the principal's plan limit; the first refusal per session is logged."""
        s.quota_refusals += 1
        self.counters["plans_refused"] += 1
        if s.quota_refusals == 1:
            log.warning("refused: plan limit", conn_id=s.conn_id, principal=s.principal, address=s.address)
        self._send(s.conn_id, Error(code=errors.TOO_MANY_PLANS, message=reason, req_id=req_id))

    def _protocol_error(
        self, s: _Session, code: str, message: str, *, req_id: int = 0, plan_id: str | None = None
    ) -> None:
        """Answer a message that broke the protocol; too many on one session close it with 4400."""
        s.protocol_errors += 1
        self.counters["protocol_errors"] += 1
        self._send(s.conn_id, Error(code=code, message=message, req_id=req_id, plan_id=plan_id))
        if s.protocol_errors >= self.config.max_protocol_errors:
            self._close(s, errors.CLOSE_PROTOCOL, f"too many protocol errors ({s.protocol_errors})")
