"""The worker session of the core (docs/SEMANTICS.md §Worker session): hello to goodbye, and the reaper.

What it owns: the handling of every message a worker sends, a worker session's detach, and
reaping the workers silent past the heartbeat timeout (§Registry).

Rules:

* Nothing but ``hello`` is accepted before the session has registered a worker id
  (``not_registered``); a second ``hello`` is ``already_registered``; the id must be one the
  session's token may register (4403 otherwise).
* A live worker id is not taken over without proof (docs/SEMANTICS.md §Worker identity): a
  ``hello`` for an id whose session is still open must carry the id's ``session_secret`` (from
  its last ``welcome``) or come with the holder's client certificate (mTLS identity), unless the
  holder has been silent for two heartbeat intervals; otherwise the newcomer is refused
  (``error(worker_id_in_use)`` naming the holder's address, then 4409) and the holder keeps its
  session. With proof, the newer session takes the id and the older one is closed 4409; the
  record, its leases and its drain mark carry over. Leases the worker does not list in ``hello.running`` are lost
  as if it had died; listed ones whose plan was cancelled meanwhile are cancelled again.
* ``accept``/``reject``/``event``/``done`` name a lease (plan id, attempt). One that is not the
  worker's current lease is answered ``stale_lease`` (or 4403 when it is another worker's).
  Re-sends of numbered messages after a reconnect are acked, not applied twice
  (coordinator/recovery.py).
* A listed lease of a plan the coordinator has queued at an older attempt was lost with the
  store's tail (or the plan was, and its client resubmitted it): it is leased back to the worker
  and continued, so its result is not lost nor the plan run twice (§Recovery from clients and
  workers); its ``done`` counts in ``results_recovered_from_worker``.
* A closed session leaves its worker registered (not connected) with its leases for the
  reconnect grace (``--worker-reconnect-grace-s``, coordinator/registry.py), so a worker that
  reconnects in time keeps its plans; past it the reaper requeues them, without waiting for the
  heartbeat timeout (a killed worker's connection closes at once). Within the grace the id stays
  its holder's: a ``hello`` without its ``session_secret`` (or the holder's client certificate)
  is refused ``error(worker_id_in_use)`` with ``retry_after_s`` = the grace left, then 4409, so a
  worker token cannot take the id, and its plans' continuations, while the holder reconnects.
* A worker id that registers in a tight loop is refused (coordinator/reconnects.py): past its
  reconnect budget a ``hello`` gets ``error(too_many_reconnects)`` with ``retry_after_s`` and the
  session is closed 4429 (the driver's penalty box then answers its upgrades 429), before
  anything changes; the holder of a live id keeps it. A session whose upgrade named its id
  (``?worker_id=``, the key of that penalty) must say the same id in ``hello`` (4403 otherwise).
* A clean stop is not a crash: ``heartbeat.leaving`` drains the worker at once (no new plans),
  and ``goodbye`` hands its unfinished plans back and removes it (``workers_left``, not
  ``workers_reaped``). An operator's drain mark outlives the goodbye: the id comes back drained.

Depends on the collaborators it is handed: the outbox, streams, scheduler, recovery and
operator requests, with the session table, registry, plans, queue and placement they act on.
"""

from __future__ import annotations

import hmac
from collections.abc import Callable
from typing import TYPE_CHECKING, assert_never

import structlog

from coordinator import scopes
from coordinator.errors import InvalidTransition
from coordinator.plans import RESERVED_KINDS, SMALL_EVENT_BYTES, Plan, advance, done_event
from coordinator.receipts import Footprint, settle
from coordinator.records import Journal
from protocol import caps, errors
from protocol.messages import (
    PROTOCOL_VERSION,
    Accept,
    Cancel,
    DataChunk,
    DataCredit,
    DataEnd,
    Done,
    Error,
    ErrorInfo,
    Event,
    FromWorker,
    Goodbye,
    Heartbeat,
    Hello,
    Receipt,
    Reject,
    Welcome,
)

if TYPE_CHECKING:
    from coordinator.data_plane import DataPlane
    from coordinator.effects import Outbox
    from coordinator.operator_requests import OperatorRequests
    from coordinator.placement.placer import Placement
    from coordinator.placement.plan_queue import PlanQueue
    from coordinator.reconnects import ReconnectBudget
    from coordinator.recovery import Recovery
    from coordinator.registry import WorkerRegistry
    from coordinator.relay import Relay
    from coordinator.scheduling import Scheduler
    from coordinator.sessions import Session, SessionTable
    from coordinator.stats import PlanTimings
    from coordinator.streams import Streams
    from coordinator.timeouts import RunTimeouts
    from coordinator.workers import WorkerRecord

__all__ = ["WorkerSessions"]

log = structlog.get_logger(__name__)

MAX_DRAINED_GONE = 4096  # drained ids remembered after their goodbye; beyond this the oldest are forgotten
# The worker messages that carry a ``seq`` and are acked, most frequent first: isinstance tries them in
# order, and each miss on a msgspec Struct class goes through its metaclass.
NUMBERED = (Done, Event, Accept, Reject)


class WorkerSessions:
    """Handles worker sessions' messages, their detach, and the reaper.

    Args:
        sessions: the open sessions (an older session of a re-registering worker is found here).
        registry: the workers.
        plans: the core's plans by id.
        queue: the queued plans (a re-registered worker's rejects are forgiven there).
        placement: told of (re)registrations and reaped workers.
        timings: queue-wait and run-time histograms.
        counters: the core's counters.
        outbox: replies, closes and refusals.
        streams: plans' lifecycle events.
        scheduler: fills workers with room, requeues lost leases, refreshes waiting reasons.
        recovery: de-duplication, hand-back, retries and the reaper's breaker.
        operator: tells a drained worker again after its ``welcome``.
        heartbeat_interval_s: put in ``welcome``.
        heartbeat_timeout_s: put in ``welcome``; silence past it gets a worker reaped.
        version: the coordinator's version, put in ``welcome``.
        prefetch: leases a worker may hold beyond its concurrency, put in ``welcome``.
        new_secret: makes a ``welcome.session_secret`` (unguessable: the core's ``new_secret``).
        data: the data-plane ticket keys, put in ``welcome``; outputs' tickets in ``succeeded``.
        relay: carries the worker's ``data_chunk``/``data_credit``/``data_end`` (coordinator/relay.py).
        timeouts: starts a running attempt's ``timeout_s`` clock (coordinator/timeouts.py).
        reconnects: each worker id's registration budget (coordinator/reconnects.py); None: none.
    """

    def __init__(
        self,
        *,
        sessions: SessionTable,
        registry: WorkerRegistry,
        plans: dict[str, Plan],
        queue: PlanQueue,
        placement: Placement,
        timings: PlanTimings,
        counters: dict[str, int],
        outbox: Outbox,
        streams: Streams,
        scheduler: Scheduler,
        recovery: Recovery,
        operator: OperatorRequests,
        heartbeat_interval_s: float,
        heartbeat_timeout_s: float,
        version: str,
        prefetch: int,
        data: DataPlane | None = None,
        new_secret: Callable[[], str] = lambda: "",
        relay: Relay | None = None,
        timeouts: RunTimeouts | None = None,
        footprint: Footprint | None = None,
        journal: Journal | None = None,
        reconnects: ReconnectBudget | None = None,
    ) -> None:
        self._reconnects = reconnects
        self._timeouts = timeouts
        self._footprint = footprint if footprint is not None else Footprint()
        self._journal = journal
        self._data = data
        self._relay = relay
        self._new_secret = new_secret
        self._secrets: dict[str, str] = {}  # worker id -> the session_secret of its last welcome
        self._leaving: set[str] = set()  # ids drained by their own heartbeat.leaving, not by an operator
        self._drained_gone: dict[str, None] = {}  # operator-drained ids that left with goodbye (oldest first)
        self._removed: dict[str, None] = {}  # ids an operator removed (remove_worker); their hello is refused
        self._identities: dict[str, str] = {}  # worker id -> the client certificate (mTLS) of its last holder
        # A holder silent this long (two missed beats) may be replaced without proof: a restarted
        # worker whose old connection is half-open gets its id back before the reaper's timeout.
        self._silent_takeover_s = min(heartbeat_timeout_s, 2 * heartbeat_interval_s)
        self._sessions = sessions
        self._registry = registry
        self._plans = plans
        self._queue = queue
        self._placement = placement
        self._timings = timings
        self._counters = counters
        self._outbox = outbox
        self._scheduler = scheduler
        self._recovery = recovery
        self._operator = operator
        self._heartbeat_interval_s = heartbeat_interval_s
        self._heartbeat_timeout_s = heartbeat_timeout_s
        self._version = version
        self._prefetch = prefetch
        # Bound once: these run for every message of every plan.
        self._send = outbox.send
        self._protocol_error = outbox.protocol_error
        self._emit = streams.emit
        self._fail = streams.fail
        self._fill_worker = scheduler.fill_worker
        self._refresh_waiting = scheduler.refresh_waiting
        self._duplicate = recovery.duplicate
        # Leases recovered from their worker (hello) -> attempt: its done counts as a recovered result.
        # An entry whose done never comes (the worker died) stays: a few bytes, after a store loss only.
        self._adopted: dict[str, int] = {}

    def on_message(self, s: Session, msg: FromWorker, now: float) -> None:
        """One message from a worker session."""
        if isinstance(msg, Hello):
            self._hello(s, msg, now)
            return
        worker_id = s.worker_id
        if worker_id is None or worker_id not in self._registry:
            what = type(msg).__name__.lower()
            self._protocol_error(s, errors.NOT_REGISTERED, f"send hello before {what}; this session has no worker id")
            return
        if isinstance(msg, NUMBERED) and self._duplicate(s.conn_id, worker_id, msg):
            return  # a re-send of a message already applied (after a reconnect): acked, not applied twice
        match msg:  # the per-plan messages first: each case is an isinstance test
            case Done():
                self._done(s, worker_id, msg, now)
            case Accept():
                self._accept(s, worker_id, msg, now)
            case Event():
                self._event(s, worker_id, msg, now)
            case Heartbeat():
                self._heartbeat(worker_id, msg, now)
            case Reject():
                self._reject(s, worker_id, msg, now)
            case Goodbye():
                self._goodbye(s, worker_id, msg, now)
            case DataChunk() | DataCredit() | DataEnd():
                if self._relay is not None:
                    self._relay.on_data(s.conn_id, msg)
            case _:
                assert_never(msg)

    def _goodbye(self, s: Session, worker_id: str, msg: Goodbye, now: float) -> None:
        """The worker leaves on purpose: its plans go back to the queue and its record goes at once."""
        log.info("worker said goodbye", worker_id=worker_id, reason=msg.reason)
        record = self._registry.get(worker_id)
        ours = record.conn_id == s.conn_id
        if ours:  # not alive from here: the hand-back below must not place its plans back on it
            self._registry.disconnect(worker_id)
        self._recovery.hand_back(worker_id, now)  # its unfinished plans: requeued now, no attempt spent
        s.worker_id = None
        self._outbox.close(s, errors.CLOSE_NORMAL, "goodbye")
        if not ours:
            return  # a newer session holds the id
        if record.draining and worker_id not in self._leaving:  # the operator's mark: kept for its return
            self._drained_gone[worker_id] = None
            while len(self._drained_gone) > MAX_DRAINED_GONE:
                del self._drained_gone[next(iter(self._drained_gone))]
        self._leaving.discard(worker_id)
        self._registry.remove(worker_id)
        self._secrets.pop(worker_id, None)
        self._identities.pop(worker_id, None)
        self._placement.forget([worker_id])
        self._counters["workers_left"] += 1
        log.info("worker left", worker_id=worker_id, leases=sorted(record.leases))
        self._refresh_waiting(now, record.capabilities.ops)  # only its ops' groups can change their reason

    def remove(self, worker_id: str, now: float) -> None:
        """An operator removed the worker for good (``remove_worker``; the id is registered).

        Its live attempts are cancelled on the worker and the plans requeued at no cost in
        attempts (as after ``goodbye``); its session is closed 4410 and a later ``hello`` with
        its id is refused the same way (the last :data:`MAX_DRAINED_GONE` ids are remembered).
        """
        registry, plans = self._registry, self._plans
        record = registry.get(worker_id)
        session = self._sessions.get(record.conn_id) if record.conn_id is not None else None
        if record.conn_id is not None:
            for plan_id in sorted(record.leases):
                plan = plans.get(plan_id)
                if plan is not None and not plan.terminal and plan.worker_id == worker_id:
                    self._outbox.send(record.conn_id, Cancel(plan_id=plan_id, attempt=plan.attempt))
            registry.disconnect(worker_id)  # not alive from here: the hand-back must not place plans on it
        leases = sorted(record.leases)
        self._recovery.hand_back(worker_id, now, removed=True)
        if session is not None and session.worker_id == worker_id:
            session.worker_id = None
            self._outbox.close(session, errors.CLOSE_REMOVED, "removed by an operator")
        self._removed[worker_id] = None
        while len(self._removed) > MAX_DRAINED_GONE:
            del self._removed[next(iter(self._removed))]
        self._drained_gone.pop(worker_id, None)
        self._leaving.discard(worker_id)
        registry.remove(worker_id)
        self._secrets.pop(worker_id, None)
        self._identities.pop(worker_id, None)
        self._placement.forget([worker_id])
        log.info("worker removed by an operator", worker_id=worker_id, leases=leases)
        self._refresh_waiting(now, record.capabilities.ops)

    def detach(self, s: Session, now: float) -> None:
        """The session no longer speaks for its worker; the record stays (with its leases) for the reconnect grace."""
        worker_id, s.worker_id = s.worker_id, None
        registry = self._registry
        if worker_id is None or worker_id not in registry:
            return
        record = registry.get(worker_id)
        if record.conn_id != s.conn_id:
            return
        registry.disconnect(worker_id, now)  # its reconnect grace starts (coordinator/registry.py)
        log.info("worker disconnected", worker_id=worker_id, leases=sorted(record.leases),
                 reconnect_grace_s=registry.reconnect_grace_s)  # fmt: skip
        self._refresh_waiting(now, record.capabilities.ops)

    def reap(self, now: float) -> list[str]:
        """Reap workers silent past the timeout, or disconnected past the reconnect grace (§Registry), unless
        the breaker holds; returns their ids, sorted.

        Their sessions are closed (4408) and their leases requeued, best first, or failed after
        their last attempt.
        """
        registry = self._registry
        # The breaker holds back a mass of silent workers: the coordinator itself is suspect.
        lost = self._recovery.breaker.admit(registry.stale(now), registry, now)
        if not lost:
            return []
        for record in lost:
            session = self._sessions.get(record.conn_id) if record.conn_id is not None else None
            if session is not None and session.worker_id == record.id:
                session.worker_id = None
                silent_s = now - record.last_beat_s
                self._outbox.close(
                    session,
                    errors.CLOSE_HEARTBEAT_TIMEOUT,
                    f"no heartbeat for {silent_s:.1f} s (timeout {self._heartbeat_timeout_s:g} s)",
                )
        reaped = registry.reap(now, only={r.id for r in lost})
        for worker_id in reaped:
            self._secrets.pop(worker_id, None)
            self._identities.pop(worker_id, None)
            self._leaving.discard(worker_id)
        self._placement.forget(reaped)
        self._counters["workers_reaped"] += len(reaped)
        plans = self._plans
        why = {r.id: self._lost_because(r, now) for r in lost}
        leases = [(plans[pid], r.id) for r in lost for pid in r.leases if pid in plans]
        leases.sort(key=lambda pair: (-pair[0].priority, pair[0].order))  # requeue best first
        for plan, worker_id in leases:
            self._scheduler.lease_lost(plan, worker_id, why[worker_id], now)
        self._refresh_waiting(now)
        return reaped

    def _lost_because(self, record: WorkerRecord, now: float) -> str:
        """Why a reaped worker's plans were taken back, for their streams."""
        at, grace = record.disconnected_at_s, self._registry.reconnect_grace_s
        if at is not None and grace is not None and now - at > grace:
            return (f"worker {record.id}'s connection closed {now - at:.1f} s ago and it did not reconnect "
                    f"within the reconnect grace ({grace:g} s)")  # fmt: skip
        return f"worker {record.id} stopped sending heartbeats"

    # ------------------------------------------------------------------ handlers

    def _hello(self, s: Session, msg: Hello, now: float) -> None:
        if s.worker_id is not None:
            self._protocol_error(s, errors.ALREADY_REGISTERED, f"this session is already worker {s.worker_id!r}")
            return
        if msg.protocol != PROTOCOL_VERSION:  # docs/PROTOCOL.md §5: the session stays unregistered
            self._protocol_error(
                s, errors.INVALID_ARGUMENT,
                f"hello.protocol is {msg.protocol}; this coordinator speaks fleetwire protocol {PROTOCOL_VERSION} "
                "only: run a worker of the coordinator's major version",
            )
            return
        worker_id = msg.worker_id
        if not worker_id:
            self._protocol_error(s, errors.INVALID_MESSAGE, "hello.worker_id must not be empty")
            return
        too_long = caps.too_long("hello.worker_id", worker_id, caps.MAX_WORKER_ID_BYTES)
        if too_long is not None:
            self._protocol_error(s, errors.INVALID_ARGUMENT, too_long)
            return
        refused = scopes.worker_id_refused(s.worker_ids, worker_id)
        if refused is None and s.named_worker_id is not None and worker_id != s.named_worker_id:
            # The upgrade named another id: the penalty box keyed it so; a hello may not switch ids.
            refused = (f"hello.worker_id {worker_id!r} is not the id {s.named_worker_id!r} this connection's "
                       "upgrade named (?worker_id=)")  # fmt: skip
        if refused is not None:
            self._outbox.forbid(s, refused, "worker_id")
            return
        if worker_id in self._removed:  # an operator removed it for good (remove_worker)
            log.warning("refused: removed worker id", worker_id=worker_id, address=s.address)
            why = f"removed by an operator; refused until the coordinator restarts: worker {worker_id}"
            self._outbox.close(s, errors.CLOSE_REMOVED, why[:120])
            return
        reconnects = self._reconnects
        if reconnects is not None and (wait_s := reconnects.wait_s(worker_id, now)) > 0:
            self._refuse_reconnect(s, worker_id, wait_s)
            return
        registry, plans = self._registry, self._plans
        reconnect = worker_id in registry
        secret = self._secrets.get(worker_id, "")
        proven = bool(secret) and hmac.compare_digest(msg.session_secret.encode(), secret.encode())
        # Without proof, a hello does not continue the leases of an id this coordinator issued a
        # secret for: the worker that holds them would have presented it (a restarted process runs
        # nothing; an impostor must not receive them). After a coordinator restart no secret exists.
        may_continue = proven or not secret
        if reconnect:
            held_by = registry.get(worker_id).conn_id
            older = self._sessions.get(held_by) if held_by is not None else None
            if older is not None and older is not s:
                if not (proven or (s.identity and s.identity == older.identity)):
                    silent_s = now - registry.get(worker_id).last_beat_s
                    if silent_s <= self._silent_takeover_s:
                        self._refuse_takeover(s, older, worker_id, silent_s)
                        return
                    log.warning("worker id taken over from a silent session", worker_id=worker_id,
                                holder=older.address, newcomer=s.address, silent_s=round(silent_s, 3))
                older.worker_id = None  # its close must not disconnect the new session
                why = f"worker id {worker_id!r} registered on a newer session"
                self._outbox.close(older, errors.CLOSE_REPLACED, why)
            elif secret and not proven and not (s.identity and s.identity == self._identities.get(worker_id)):
                left_s = registry.in_grace(worker_id, now)
                if left_s is not None:  # its holder may be reconnecting: the id and its plans stay its own
                    self._refuse_in_grace(s, worker_id, left_s, now)
                    return
        if reconnects is not None:
            reconnects.spend(worker_id, now)  # a refused takeover above took none
        old_ops = registry.get(worker_id).capabilities.ops if reconnect else []  # their groups' reasons change too
        record = registry.register(worker_id, msg.capabilities, now, address=s.address, conn_id=s.conn_id)
        self._identities[worker_id] = s.identity
        if worker_id in self._leaving:  # it announced a stop, then came back: its own drain is over
            self._leaving.discard(worker_id)
            record.draining = False
        if worker_id in self._drained_gone:  # drained by the operator, left with goodbye: still drained
            del self._drained_gone[worker_id]
            record.draining = True
        if not proven:  # a new holder without the old secret: the old secret proves nothing any more
            secret = self._secrets[worker_id] = self._new_secret()
        record.data_url = msg.data_url
        record.version = msg.version
        self._placement.registered(record)
        s.worker_id = worker_id
        keep: list[str] = []
        abandon: list[str] = []
        for running in msg.running:
            plan = plans.get(running.plan_id)
            ours = plan is not None and plan.worker_id == worker_id and plan.attempt == running.attempt
            ours = ours and may_continue
            if plan is not None and not ours and plan.state == "queued" and plan.attempt < running.attempt:
                # An attempt this coordinator never handed out as far as it knows: a store loss took
                # the lease (or the whole plan, resubmitted since by its client). The worker runs it
                # or holds its done: lease it back rather than run the plan twice.
                log.warning("lease recovered from its worker: the store had lost it",
                            plan_id=plan.id, worker_id=worker_id, attempt=running.attempt)  # fmt: skip
                self._scheduler.adopt(plan, record, running.attempt, running.devices)
                self._adopted[plan.id] = running.attempt
                ours = True
            (keep if ours and running.plan_id in record.leases else abandon).append(running.plan_id)
            if ours and plan is not None and plan.gpus is not None:  # a restore: the devices it runs on
                registry.hold_devices(worker_id, plan.id, plan.gpus, running.devices)
        log.info(
            "worker registered",
            worker_id=worker_id,
            reconnect=reconnect,
            ops=msg.capabilities.ops,
            max_concurrency=msg.capabilities.max_concurrency,
            continue_plans=keep,
            abandon_plans=abandon,
        )
        self._send(
            s.conn_id,
            Welcome(
                worker_id=worker_id,
                heartbeat_interval_s=self._heartbeat_interval_s,
                heartbeat_timeout_s=self._heartbeat_timeout_s,
                continue_plans=keep,
                abandon_plans=abandon,
                version=self._version,
                prefetch=self._prefetch,
                data_keys=self._data.worker_keys(worker_id) if self._data is not None else [],
                session_secret=secret,
            ),
        )
        self._operator.registered(record, now)  # a drained worker stays drained across reconnects
        # Leases it did not list are gone on its side (an assign lost in flight, a restart):
        # those attempts are lost exactly as if the worker had died.
        missing = [plans[pid] for pid in record.leases.difference(keep) if pid in plans]
        for plan in sorted(missing, key=lambda p: (-p.priority, p.order)):
            registry.release(worker_id, plan.id)
            self._scheduler.lease_lost(plan, worker_id, f"worker {worker_id} reconnected without it", now)
        for plan_id in keep:
            plan = plans[plan_id]
            if plan.terminal:  # cancelled while it was away: the first cancel went to the old session
                self._send(s.conn_id, Cancel(plan_id=plan_id, attempt=plan.attempt))
            elif self._timeouts is not None and plan.timeout_s is not None:
                self._timeouts.watch(plan, now)  # after a coordinator restart its clock starts now
        # A worker that registers again may have new handlers or have stopped draining:
        # the plans it rejected may be offered to it once more.
        for plan_id in self._queue.forgive(worker_id):
            plans[plan_id].avoid -= {worker_id}
        self._fill_worker(record, now)
        self._refresh_waiting(now, [*record.capabilities.ops, *old_ops])

    def _refuse_takeover(self, s: Session, holder: Session, worker_id: str, silent_s: float) -> None:
        """Refuse ``s`` the live id ``worker_id``: error(worker_id_in_use) naming the holder, then 4409."""
        self._counters["takeovers_refused"] = self._counters.get("takeovers_refused", 0) + 1
        message = (
            f"worker id {worker_id!r} is held by a live session from {holder.address or 'an unknown address'} "
            f"(last beat {silent_s:.1f} s ago); only that worker may take it over (hello.session_secret from its "
            f"welcome, or the same client certificate). Give each worker its own id (--id); a restarted worker "
            f"gets its id once the old session closes or stays silent for {self._silent_takeover_s:g} s"
        )
        log.warning("refused hello: worker id held by a live session", worker_id=worker_id, holder=holder.address,
                    newcomer=s.address)  # fmt: skip
        self._send(s.conn_id, Error(code=errors.WORKER_ID_IN_USE, message=message))
        self._outbox.close(s, errors.CLOSE_REPLACED, f"worker id in use by a live session from {holder.address}"[:120])

    def _refuse_in_grace(self, s: Session, worker_id: str, left_s: float, now: float) -> None:
        """Refuse ``s`` the id of a worker whose session closed within the reconnect grace: error(worker_id_in_use)
        with ``retry_after_s`` = the grace left, then 4409."""
        self._counters["takeovers_refused"] = self._counters.get("takeovers_refused", 0) + 1
        record = self._registry.get(worker_id)
        gone_s = now - (record.disconnected_at_s or now)
        message = (
            f"worker id {worker_id!r} belongs to a worker from {record.address or 'an unknown address'} whose "
            f"connection closed {gone_s:.1f} s ago: it may reconnect for {left_s:.1f} s more and continue its "
            "plans, and only it may take the id back (hello.session_secret from its welcome, or the same client "
            f"certificate). Retry in {left_s:.1f} s; give each worker its own id (--id)"
        )
        log.warning("refused hello: worker id held for its reconnecting holder", worker_id=worker_id,
                    holder=record.address, newcomer=s.address, grace_left_s=round(left_s, 3))  # fmt: skip
        self._send(s.conn_id, Error(code=errors.WORKER_ID_IN_USE, message=message, retry_after_s=left_s))
        self._outbox.close(s, errors.CLOSE_REPLACED, f"worker id {worker_id} is held for its reconnecting holder"[:120])

    def _refuse_reconnect(self, s: Session, worker_id: str, wait_s: float) -> None:
        """Refuse ``s`` the id ``worker_id``, past its reconnect budget: error(too_many_reconnects), then 4429."""
        self._counters["worker_reconnects_refused"] = self._counters.get("worker_reconnects_refused", 0) + 1
        budget = self._reconnects
        assert budget is not None
        message = (
            f"worker id {worker_id!r} registered more often than its reconnect budget allows ({budget.burst} at once, "
            f"then {budget.rate:g} per second: coordinator flags --worker-reconnect-burst, --worker-reconnect-rate); "
            f"a worker that reconnects in a loop is refused. Retry in {wait_s:.1f} s, and find out why its sessions "
            "end (its log, the coordinator's close codes)"
        )
        log.warning("refused hello: worker reconnects too often", worker_id=worker_id, address=s.address,
                    retry_after_s=round(wait_s, 3))  # fmt: skip
        self._send(s.conn_id, Error(code=errors.TOO_MANY_RECONNECTS, message=message, retry_after_s=wait_s))
        self._outbox.close(s, errors.CLOSE_RATE_LIMITED, f"worker {worker_id} reconnects too often; retry in "
                                                          f"{wait_s:.1f} s"[:120])

    def _heartbeat(self, worker_id: str, msg: Heartbeat, now: float) -> None:
        self._counters["heartbeats"] += 1
        was_alive = self._registry.is_alive(worker_id, now)
        record = self._registry.heartbeat(worker_id, msg.load, now)
        if msg.leaving and not record.draining:  # stopping: no new plans (cleared when it registers again)
            record.draining = True
            self._leaving.add(worker_id)
            log.info("worker leaving: no new plans", worker_id=worker_id, leases=len(record.leases))
        if not was_alive:  # it fell silent past the timeout but beat before the reaper ran
            self._fill_worker(record, now)
            self._refresh_waiting(now, record.capabilities.ops)

    def _lease(self, s: Session, worker_id: str, plan_id: str, attempt: int) -> Plan | None:
        """The plan if (plan_id, attempt) is this worker's current lease; otherwise answer stale_lease."""
        if attempt < 1:  # no attempt (an event's default 0) is never a lease: say so, and stop nothing (PROTOCOL.md §4)
            why = f"attempt must be the lease attempt of its assign (1 or more), got {attempt}; send it every time"
            self._protocol_error(s, errors.INVALID_MESSAGE, f"plan {plan_id!r}: {why}", plan_id=plan_id)
            return None
        plan = self._plans.get(plan_id)
        if (
            plan is not None
            and plan.attempt == attempt
            and plan.worker_id == worker_id
            and plan_id in self._registry.get(worker_id).leases
        ):
            return plan
        if plan is not None:
            holder = plan.worker_id
            held = holder is not None and holder in self._registry and plan_id in self._registry.get(holder).leases
            trespass = scopes.lease_of_another(plan.worker_id, plan.attempt, worker_id, attempt, held=held)
            if trespass is not None:
                self._outbox.forbid(s, f"plan {plan_id!r} {trespass}", "foreign_lease")
                return None
        self._counters["stale_dropped"] += 1
        why = "the coordinator has no such plan" if plan is None else plan.lease_note()
        message = f"plan {plan_id!r} attempt {attempt} is not your lease ({why}); stop running it"
        self._send(s.conn_id, Error(code=errors.STALE_LEASE, message=message, plan_id=plan_id, attempt=attempt))
        return None

    def _accept(self, s: Session, worker_id: str, msg: Accept, now: float) -> None:
        plan = self._lease(s, worker_id, msg.plan_id, msg.attempt)
        # A repeated accept (running) or one after a cancel (terminal) changes nothing.
        if plan is not None and plan.state == "leased":
            advance(plan, "accept")
            self._timings.started(plan, now)
            self._emit(plan, "running", {"worker_id": worker_id, "attempt": plan.attempt}, small=True)
            if self._timeouts is not None and plan.timeout_s is not None:
                self._timeouts.watch(plan, now)

    def _reject(self, s: Session, worker_id: str, msg: Reject, now: float) -> None:
        plan = self._lease(s, worker_id, msg.plan_id, msg.attempt)
        if plan is None:
            return
        registry = self._registry
        record = registry.get(worker_id)
        revoked = msg.code == errors.REVOKED  # it dropped an unstarted plan we revoked (§Placement, stealing)
        if not plan.terminal:
            try:
                advance(plan, "revoke" if revoked else "reject")
            except InvalidTransition as exc:
                self._protocol_error(s, exc.code, f"{exc}: a plan cannot be rejected after accept", plan_id=plan.id)
                return
            if revoked:
                self._counters["plans_revoked"] += 1
                why = f"revoked from worker {worker_id} before it started, to run on an idle worker"
            else:
                plan.avoid = plan.avoid | {worker_id}
                why = f"worker {worker_id} rejected it ({msg.code}" + (f": {msg.reason})" if msg.reason else ")")
            registry.release(worker_id, plan.id)
            plan.free_attempts += 1  # it never ran: not counted against max_attempts (coordinator/recovery.py)
            self._scheduler.requeue(plan, why, now)
        else:
            registry.release(worker_id, plan.id)
        self._fill_worker(record, now)

    def _event(self, s: Session, worker_id: str, msg: Event, now: float) -> None:
        if msg.kind in RESERVED_KINDS:
            self._protocol_error(
                s,
                errors.INVALID_MESSAGE,
                f"event kind {msg.kind!r} is reserved for the coordinator's lifecycle events; use another kind",
                plan_id=msg.plan_id,
            )
            return
        plan = self._lease(s, worker_id, msg.plan_id, msg.attempt)
        # A cancelled plan's stream has ended with its terminal event; later output is dropped.
        if plan is not None and not plan.terminal:
            self._counters["events_forwarded"] += 1
            self._emit(plan, msg.kind, msg.data, ephemeral=msg.ephemeral)
            if msg.kind == "input_received" and self._timeouts is not None and plan.timeout_s is not None:
                self._timeouts.watch(plan, now)  # the last input in: the handler starts, so does its clock

    def _done(self, s: Session, worker_id: str, msg: Done, now: float) -> None:
        plan = self._lease(s, worker_id, msg.plan_id, msg.attempt)
        if plan is None:
            return
        registry = self._registry
        record = registry.get(worker_id)
        registry.release(worker_id, plan.id)
        if self._adopted and self._adopted.pop(plan.id, None) == msg.attempt and not plan.terminal:
            self._counters["results_recovered_from_worker"] += 1
        receipt = msg.receipt
        if receipt is None and plan.projected is not None:  # the worker measured nothing: the projection stays
            receipt = Receipt(estimated=True, source="none")
        if receipt is not None:  # every attempt's energy counts; the plan keeps its last one's
            receipt = settle(receipt, plan.projected)
            assert receipt is not None
            self._footprint.add(plan.owner, plan.op, receipt)
            plan.receipt = receipt
            if plan.terminal and self._journal is not None:  # cancelled before this done: its record gets it
                self._journal.touched(plan)
        elif plan.receipt is not None and not plan.terminal:
            plan.receipt = None  # an earlier attempt's: this last one measured nothing
        if not plan.terminal and msg.outcome == "failed" and plan.retried < plan.retries:
            why = f"worker {worker_id} reported a failure without an error"
            self._recovery.retry(plan, worker_id, msg.error or ErrorInfo(errors.HANDLER_ERROR, why), now)
        elif not plan.terminal:  # a cancelled plan only waited for this done to free the lease
            advance(plan, done_event(msg.outcome))
            self._timings.finished(plan, msg.outcome, now)
            match msg.outcome:
                case "succeeded":
                    plan.result = msg.result
                    data = {"result": msg.result, "worker_id": worker_id, "attempt": plan.attempt}
                    # The result is sized once (the event, listings and retention reuse it); the rest is small.
                    size: int | None = SMALL_EVENT_BYTES + plan.result_bytes()
                    if plan.receipt is not None:
                        data["receipt"] = plan.receipt
                        size = None
                    if msg.outputs or plan.outputs:  # where to fetch them: docs/PROTOCOL.md §Data plane
                        plan.produced = msg.outputs
                        data["outputs"] = {o.name: [o.size, o.digest] for o in msg.outputs}
                        size = None
                    self._emit(plan, "succeeded", data, size=size)
                case "failed":
                    why = f"worker {worker_id} reported a failure without an error"
                    self._fail(plan, worker_id, msg.error or ErrorInfo(errors.HANDLER_ERROR, why))
                case "cancelled":
                    plan.error = ErrorInfo(errors.CANCELLED, f"cancelled by worker {worker_id}")
                    self._emit(plan, "cancelled", {"reason": f"cancelled by worker {worker_id}"}, small=True)
                case _:
                    assert_never(msg.outcome)
        self._fill_worker(record, now)
