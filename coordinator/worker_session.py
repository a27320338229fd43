"""The worker session of the core (docs/SEMANTICS.md §Worker session): hello to goodbye.

Functions of the :class:`~coordinator.core.Coordinator` (passed as ``core``), split out of
coordinator/core.py to keep each module readable; the core dispatches every worker message
to :func:`on_worker` and a closed worker session to :func:`detach_worker`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, assert_never

import structlog

from coordinator import scopes
from coordinator.errors import InvalidTransition
from coordinator.plans import (
    RESERVED_KINDS,
    Plan,
    advance,
    done_event,
)
from protocol import errors
from protocol.messages import (
    Accept,
    Cancel,
    Done,
    Error,
    ErrorInfo,
    Event,
    Goodbye,
    Heartbeat,
    Hello,
    Reject,
    Welcome,
)

if TYPE_CHECKING:
    from coordinator.core import Coordinator, WorkerMessage, _Session

log = structlog.get_logger(__name__)


def on_worker(core: Coordinator, s: _Session, msg: WorkerMessage, now: float) -> None:
    if isinstance(msg, Hello):
        hello(core, s, msg, now)
        return
    worker_id = s.worker_id
    if worker_id is None or worker_id not in core.registry:
        what = type(msg).__name__.lower()
        core._protocol_error(s, errors.NOT_REGISTERED, f"send hello before {what}; this session has no worker id")
        return
    if isinstance(msg, Accept | Reject | Event | Done) and core.recovery.duplicate(s.conn_id, worker_id, msg):
        return  # a re-send of a message already applied (after a reconnect): acked, not applied twice
    match msg:
        case Heartbeat():
            heartbeat(core, worker_id, msg, now)
        case Accept():
            accept(core, s, worker_id, msg, now)
        case Reject():
            reject(core, s, worker_id, msg, now)
        case Event():
            worker_event(core, s, worker_id, msg)
        case Done():
            done(core, s, worker_id, msg, now)
        case Goodbye():
            log.info("worker said goodbye", worker_id=worker_id, reason=msg.reason)
            detach_worker(core, s, now)
            core.recovery.hand_back(worker_id, now)  # its unfinished plans: requeued now, no attempt spent
            core._close(s, errors.CLOSE_NORMAL, "goodbye")
        case _:
            assert_never(msg)

def hello(core: Coordinator, s: _Session, msg: Hello, now: float) -> None:
    if s.worker_id is not None:
        core._protocol_error(s, errors.ALREADY_REGISTERED, f"this session is already worker {s.worker_id!r}")
        return
    worker_id = msg.worker_id
    if not worker_id:
        core._protocol_error(s, errors.INVALID_MESSAGE, "hello.worker_id must not be empty")
        return
    refused = scopes.worker_id_refused(s.worker_ids, worker_id)
    if refused is not None:
        core._forbid(s, refused, "worker_id")
        return
    reconnect = worker_id in core.registry
    if reconnect:
        held_by = core.registry.get(worker_id).conn_id
        older = core._sessions.get(held_by) if held_by is not None else None
        if older is not None and older is not s:
            older.worker_id = None  # its close must not disconnect the new session
            core._close(older, errors.CLOSE_REPLACED, f"worker id {worker_id!r} registered on a newer session")
    record = core.registry.register(worker_id, msg.capabilities, now, address=s.address, conn_id=s.conn_id)
    core.placement.registered(record)
    s.worker_id = worker_id
    keep: list[str] = []
    abandon: list[str] = []
    for running in msg.running:
        plan = core.plans.get(running.plan_id)
        ours = plan is not None and plan.worker_id == worker_id and plan.attempt == running.attempt
        (keep if ours and running.plan_id in record.leases else abandon).append(running.plan_id)
    log.info(
        "worker registered",
        worker_id=worker_id,
        reconnect=reconnect,
        ops=msg.capabilities.ops,
        max_concurrency=msg.capabilities.max_concurrency,
        continue_plans=keep,
        abandon_plans=abandon,
    )
    core._send(
        s.conn_id,
        Welcome(
            worker_id=worker_id,
            heartbeat_interval_s=core.config.heartbeat_interval_s,
            heartbeat_timeout_s=core.config.heartbeat_timeout_s,
            continue_plans=keep,
            abandon_plans=abandon,
            version=core.config.version,
            prefetch=core.config.placement.prefetch,
        ),
    )
    core.operator.registered(record, now)  # a drained worker stays drained across reconnects
    # Leases it did not list are gone on its side (an assign lost in flight, a restart):
    # those attempts are lost exactly as if the worker had died.
    missing = [core.plans[pid] for pid in record.leases.difference(keep) if pid in core.plans]
    for plan in sorted(missing, key=lambda p: (-p.priority, p.order)):
        core.registry.release(worker_id, plan.id)
        core._lease_lost(plan, worker_id, f"worker {worker_id} reconnected without it", now)
    for plan_id in keep:
        plan = core.plans[plan_id]
        if plan.terminal:  # cancelled while it was away: the first cancel went to the old session
            core._send(s.conn_id, Cancel(plan_id=plan_id, attempt=plan.attempt))
    # A worker that registers again may have new handlers or have stopped draining:
    # the plans it rejected may be offered to it once more.
    for plan_id in core.queue.forgive(worker_id):
        core.plans[plan_id].avoid -= {worker_id}
    core._fill_worker(record, now)
    core._refresh_waiting(now)

def heartbeat(core: Coordinator, worker_id: str, msg: Heartbeat, now: float) -> None:
    core.counters["heartbeats"] += 1
    was_alive = core.registry.is_alive(worker_id, now)
    record = core.registry.heartbeat(worker_id, msg.load, now)
    if not was_alive:  # it fell silent past the timeout but beat before the reaper ran
        core._fill_worker(record, now)
        core._refresh_waiting(now)

def lease(core: Coordinator, s: _Session, worker_id: str, plan_id: str, attempt: int) -> Plan | None:
    """The plan if (plan_id, attempt) is this worker's current lease; otherwise answer stale_lease."""
    plan = core.plans.get(plan_id)
    if (
        plan is not None
        and plan.attempt == attempt
        and plan.worker_id == worker_id
        and plan_id in core.registry.get(worker_id).leases
    ):
        return plan
    if plan is not None:
        trespass = scopes.lease_of_another(plan.worker_id, plan.attempt, worker_id, attempt)
        if trespass is not None:
            core._forbid(s, f"plan {plan_id!r} {trespass}", "foreign_lease")
            return None
    core.counters["stale_dropped"] += 1
    why = "the coordinator has no such plan" if plan is None else plan.lease_note()
    message = f"plan {plan_id!r} attempt {attempt} is not your lease ({why}); stop running it"
    core._send(s.conn_id, Error(code=errors.STALE_LEASE, message=message, plan_id=plan_id, attempt=attempt))
    return None

def accept(core: Coordinator, s: _Session, worker_id: str, msg: Accept, now: float) -> None:
    plan = lease(core, s, worker_id, msg.plan_id, msg.attempt)
    # A repeated accept (running) or one after a cancel (terminal) changes nothing.
    if plan is not None and plan.state == "leased":
        advance(plan, "accept")
        core.timings.started(plan, now)
        core._emit(plan, "running", {"worker_id": worker_id, "attempt": plan.attempt}, small=True)

def reject(core: Coordinator, s: _Session, worker_id: str, msg: Reject, now: float) -> None:
    plan = lease(core, s, worker_id, msg.plan_id, msg.attempt)
    if plan is None:
        return
    record = core.registry.get(worker_id)
    revoked = msg.code == errors.REVOKED  # it dropped an unstarted plan we revoked (§Placement, stealing)
    if not plan.terminal:
        try:
            advance(plan, "revoke" if revoked else "reject")
        except InvalidTransition as exc:
            core._protocol_error(s, exc.code, f"{exc}: a plan cannot be rejected after accept", plan_id=plan.id)
            return
        if revoked:
            core.counters["plans_revoked"] += 1
            why = f"revoked from worker {worker_id} before it started, to run on an idle worker"
        else:
            plan.avoid = plan.avoid | {worker_id}
            why = f"worker {worker_id} rejected it ({msg.code}" + (f": {msg.reason})" if msg.reason else ")")
        core.registry.release(worker_id, plan.id)
        plan.free_attempts += 1  # it never ran: not counted against max_attempts (coordinator/recovery.py)
        core._requeue(plan, why, now)
    else:
        core.registry.release(worker_id, plan.id)
    core._fill_worker(record, now)

def worker_event(core: Coordinator, s: _Session, worker_id: str, msg: Event) -> None:
    if msg.kind in RESERVED_KINDS:
        core._protocol_error(
            s,
            errors.INVALID_MESSAGE,
            f"event kind {msg.kind!r} is reserved for the coordinator's lifecycle events; use another kind",
            plan_id=msg.plan_id,
        )
        return
    plan = lease(core, s, worker_id, msg.plan_id, msg.attempt)
    # A cancelled plan's stream has ended with its terminal event; later output is dropped.
    if plan is not None and not plan.terminal:
        core.counters["events_forwarded"] += 1
        core._emit(plan, msg.kind, msg.data, ephemeral=msg.ephemeral)

def done(core: Coordinator, s: _Session, worker_id: str, msg: Done, now: float) -> None:
    plan = lease(core, s, worker_id, msg.plan_id, msg.attempt)
    if plan is None:
        return
    record = core.registry.get(worker_id)
    core.registry.release(worker_id, plan.id)
    if not plan.terminal and msg.outcome == "failed" and plan.retried < plan.retries:
        why = f"worker {worker_id} reported a failure without an error"
        core.recovery.retry(plan, worker_id, msg.error or ErrorInfo(errors.HANDLER_ERROR, why), now)
    elif not plan.terminal:  # a cancelled plan only waited for this done to free the lease
        advance(plan, done_event(msg.outcome))
        core.timings.finished(plan, msg.outcome, now)
        match msg.outcome:
            case "succeeded":
                plan.result = msg.result
                data = {"result": msg.result, "worker_id": worker_id, "attempt": plan.attempt}
                core._emit(plan, "succeeded", data)
            case "failed":
                why = f"worker {worker_id} reported a failure without an error"
                core._fail(plan, worker_id, msg.error or ErrorInfo(errors.HANDLER_ERROR, why))
            case "cancelled":
                plan.error = ErrorInfo(errors.CANCELLED, f"cancelled by worker {worker_id}")
                core._emit(plan, "cancelled", {"reason": f"cancelled by worker {worker_id}"}, small=True)
            case _:
                assert_never(msg.outcome)
    core._fill_worker(record, now)

def detach_worker(core: Coordinator, s: _Session, now: float) -> None:
    """The session no longer speaks for its worker; the record stays (with its leases) until reaped."""
    worker_id, s.worker_id = s.worker_id, None
    if worker_id is None or worker_id not in core.registry:
        return
    record = core.registry.get(worker_id)
    if record.conn_id != s.conn_id:
        return
    core.registry.disconnect(worker_id)
    log.info("worker disconnected", worker_id=worker_id, leases=sorted(record.leases))
    core._refresh_waiting(now)
