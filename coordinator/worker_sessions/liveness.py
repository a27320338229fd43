"""A worker's liveness (docs/SEMANTICS.md §Registry): heartbeats, a session's detach, and the reaper.

What it owns: what a ``heartbeat`` changes, what a closed session leaves behind, and reaping the
workers silent past the heartbeat timeout or gone past the reconnect grace.

Rules:

* A ``heartbeat`` refreshes the worker's load and last beat; one from a worker that fell silent
  past the timeout but beat before the reaper ran puts it back to work at once.
* ``heartbeat.leaving`` drains the worker at once (no new plans): a clean stop is not a crash
  (its ``goodbye`` follows: coordinator/worker_sessions/registration.py).
* A closed session leaves its worker registered (not connected) with its leases for the
  reconnect grace (``--worker-reconnect-grace-s``, coordinator/registry.py), so a worker that
  reconnects in time keeps its plans; past it the reaper requeues them, without waiting for the
  heartbeat timeout (a killed worker's connection closes at once).
* The reaper closes a silent worker's session (4408) and requeues its leases, best first, or
  fails them after their last attempt, unless the breaker holds: a mass of silent workers at
  once makes the coordinator itself suspect (coordinator/recovery.py ``ReaperBreaker``).

Depends on the outbox, scheduler and recovery it is handed, the ids' marks
(coordinator/worker_sessions/registration.py ``Identities``) and the core's shared state
(coordinator/state.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import structlog

from protocol import errors
from protocol.messages import Heartbeat

if TYPE_CHECKING:
    from coordinator.effects import Outbox
    from coordinator.recovery import Recovery
    from coordinator.scheduling import Scheduler
    from coordinator.sessions import Session
    from coordinator.state import CoreState
    from coordinator.worker_sessions.registration import Identities
    from coordinator.workers import WorkerRecord

__all__ = ["Liveness"]

log = structlog.get_logger(__name__)


class Liveness:
    """Heartbeats, detached sessions and the reaper.

    Args:
        state: the core's shared tables (coordinator/state.py).
        outbox: the reaper's closes.
        scheduler: fills a worker back to life, requeues a reaped worker's leases, refreshes waiting reasons.
        recovery: the reaper's breaker.
        identities: a leaving worker's mark; a reaped worker's proofs are forgotten there.
        heartbeat_timeout_s: silence past it gets a worker reaped (said in the close).
    """

    def __init__(
        self,
        state: CoreState,
        *,
        outbox: Outbox,
        scheduler: Scheduler,
        recovery: Recovery,
        identities: Identities,
        heartbeat_timeout_s: float,
    ) -> None:
        self._state = state
        self._outbox = outbox
        self._scheduler = scheduler
        self._recovery = recovery
        self._identities = identities
        self._heartbeat_timeout_s = heartbeat_timeout_s

    def heartbeat(self, worker_id: str, msg: Heartbeat, now: float) -> None:
        """The worker beat: its load and last beat are new; ``leaving`` drains it."""
        state = self._state
        state.counters["heartbeats"] += 1
        was_alive = state.registry.is_alive(worker_id, now)
        blocked = state.registry.get(worker_id).gpu_blocked
        record = state.registry.heartbeat(worker_id, msg.load, now)
        if record.gpu_blocked != blocked:  # a device was quarantined or released (docs/OPERATIONS.md §GPU health)
            log.warning("worker devices quarantined", worker_id=worker_id, devices=list(record.gpu_blocked))
            if was_alive:
                self._scheduler.fill_worker(record, now)
                self._scheduler.refresh_waiting(now, record.capabilities.ops)
        if msg.leaving and not record.draining:  # stopping: no new plans (cleared when it registers again)
            record.draining = True
            self._identities.leaving.add(worker_id)
            log.info("worker leaving: no new plans", worker_id=worker_id, leases=len(record.leases))
        if not was_alive:  # it fell silent past the timeout but beat before the reaper ran
            self._scheduler.fill_worker(record, now)
            self._scheduler.refresh_waiting(now, record.capabilities.ops)

    def detach(self, s: Session, now: float) -> None:
        """The session no longer speaks for its worker; the record stays (with its leases) for the reconnect grace."""
        worker_id, s.worker_id = s.worker_id, None
        registry = self._state.registry
        if worker_id is None or worker_id not in registry:
            return
        record = registry.get(worker_id)
        if record.conn_id != s.conn_id:
            return
        registry.disconnect(worker_id, now)  # its reconnect grace starts (coordinator/registry.py)
        log.info("worker disconnected", worker_id=worker_id, leases=sorted(record.leases),
                 reconnect_grace_s=registry.reconnect_grace_s)  # fmt: skip
        self._scheduler.refresh_waiting(now, record.capabilities.ops)

    def reap(self, now: float) -> list[str]:
        """Reap workers silent past the timeout, or disconnected past the reconnect grace (§Registry), unless
        the breaker holds; returns their ids, sorted.

        Their sessions are closed (4408) and their leases requeued, best first, or failed after
        their last attempt.
        """
        state = self._state
        registry = state.registry
        # The breaker holds back a mass of silent workers: the coordinator itself is suspect.
        lost = self._recovery.breaker.admit(registry.stale(now), registry, now)
        if not lost:
            return []
        for record in lost:
            session = state.sessions.get(record.conn_id) if record.conn_id is not None else None
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
            self._identities.forget(worker_id)
        state.placement.forget(reaped)
        state.counters["workers_reaped"] += len(reaped)
        plans = state.plans
        why = {r.id: self._lost_because(r, now) for r in lost}
        leases = [(plans[pid], r.id) for r in lost for pid in r.leases if pid in plans]
        leases.sort(key=lambda pair: (-pair[0].priority, pair[0].order))  # requeue best first
        for plan, worker_id in leases:
            self._scheduler.lease_lost(plan, worker_id, why[worker_id], now)
        self._scheduler.refresh_waiting(now)
        return reaped

    def _lost_because(self, record: WorkerRecord, now: float) -> str:
        """Why a reaped worker's plans were taken back, for their streams."""
        at, grace = record.disconnected_at_s, self._state.registry.reconnect_grace_s
        if at is not None and grace is not None and now - at > grace:
            return (f"worker {record.id}'s connection closed {now - at:.1f} s ago and it did not reconnect "
                    f"within the reconnect grace ({grace:g} s)")  # fmt: skip
        return f"worker {record.id} stopped sending heartbeats"
