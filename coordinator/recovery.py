"""Durability rules of the core: records, acks and de-duplication, restart, hand-back, retries.

Rules (docs/SEMANTICS.md §Durability):

* **Records.** Every new plan, durable event and plan change goes to the :class:`Journal`;
  the core hands the records out with its effects and the server commits them before it
  sends any frame of the same step.
* **Ack and de-duplication.** A worker numbers its ``accept``/``reject``/``event``/``done``
  messages (``seq``, one counter per worker process). After a step, every worker session that
  sent numbered messages gets ``ack(highest seq)``, which the server releases only after the
  step's records are committed: the worker drops what is acknowledged and re-sends the rest
  after a reconnect. A plan remembers (attempt, highest seq) applied for its current lease, and
  a message of that lease at or below it is a re-send: dropped silently (counted).
* **Restart.** :meth:`Recovery.restore` rebuilds plans from a store, and the names of those
  whose key is not their owner's id for them (``PlanCreated.submit.plan_id``: coordinator/plans.py
  ``PlanNames``). Queued plans are queued again. A leased or running plan stays leased to its
  worker, which is registered as a disconnected worker whose last beat is *now*: it has one
  heartbeat timeout to reconnect and claim its plans (``hello.running``); otherwise the reaper
  takes them back as for any lost worker. Liveness clocks start at the restart, never at a stored time.
* **Hand-back.** A worker that says ``goodbye`` gives back its unfinished leases at once; they
  are queued again without waiting for the reaper, and the attempt does not count against
  ``max_attempts``.
* **Retries.** A ``done(failed)`` of a plan submitted with ``retries > 0`` queues it again
  (also without counting against ``max_attempts``) until its retries are used.
* **Replay gaps** are the streams' rule (coordinator/streams.py): a ``resync`` in place of each
  missing run of events.

:class:`ReaperBreaker` is the reaper's circuit breaker: when most connected workers go silent
in the same tick, suspect the coordinator itself (a stalled loop, a cut on its side) and hold
the reaping for one heartbeat timeout, as Kubernetes stops evicting when every zone looks
unhealthy.

Depends on the plans, registry and journal it is handed, and requeues through the scheduler
(coordinator/scheduling.py); the core's handlers call it, never the reverse.
"""

from __future__ import annotations

from collections.abc import Iterable
from sys import intern
from typing import TYPE_CHECKING

import structlog

from coordinator.plans import Plan, PlanNames, advance
from coordinator.records import Record, StoredPlan
from coordinator.scheduling import note_attempt
from protocol.messages import Accept, Capabilities, Done, ErrorInfo, Event, Reject

if TYPE_CHECKING:
    from coordinator.journal import Journal
    from coordinator.registry import WorkerRegistry
    from coordinator.scheduling import Scheduler
    from coordinator.workers import WorkerRecord

__all__ = ["ReaperBreaker", "Recovery", "plan_from_store"]

log = structlog.get_logger(__name__)

COUNTERS = ("duplicates_dropped", "plans_handed_back", "plans_retried", "plans_restored", "reaper_breaker_trips")


def plan_from_store(stored: StoredPlan) -> Plan:
    """A plan as it was when its last record was written."""
    created, status = stored.created, stored.status
    plan = Plan.from_submit(created.submit, created.plan_id, intern(created.owner), created.order)
    plan.op = intern(plan.op)  # a few distinct owners and ops over every plan: shared, not one copy each
    name = created.submit.plan_id  # what its owner submitted: its key unless another plan held that (plans.py)
    if name is not None and name != created.plan_id:
        plan.name = name
    plan.events = sorted(stored.events, key=lambda e: e.seq)
    plan.recount()
    last_held = plan.events[-1].seq if plan.events else 0
    if status is not None:
        plan.state = intern(status.state)  # type: ignore[assignment]  # a PlanStateName still
        plan.attempt = status.attempt
        plan.worker_id = status.worker_id
        plan.result = status.result
        plan.error = status.error
        plan.waiting_reason = status.waiting_reason
        plan.worker_seq = status.worker_seq
        plan.retried = status.retried
        plan.free_attempts = status.free_attempts
        plan.history = list(status.history)
        plan.next_seq = status.next_seq
        plan.ended_at = status.ended_at
        plan.receipt = status.receipt
        plan.produced = status.produced
        plan.submitted_at, plan.deferred = status.submitted_at, status.deferred  # a deadline's (carbon_holds.py)
        plan.deferred_until = status.deferred_until
    plan.rebuild_of = created.rebuild_of
    plan.next_seq = max(plan.next_seq, last_held + 1)
    return plan


class ReaperBreaker:
    """Decides which stale workers the reaper may drop now.

    Only *connected* stale workers count: a closed session is news about the worker, but
    silence on an open one may be the coordinator not reading. When more than ``fraction`` of
    the connected workers (and at least ``min_workers`` of them are connected) are stale in one
    tick, the breaker opens: those workers are kept (not alive, so nothing is placed on them)
    for up to ``hold_s``; a stalled coordinator reads their queued beats well before that.
    Workers still stale after the hold are reaped. Disconnected stale workers are always reaped.

    Args:
        fraction: share of connected workers stale at once that opens the breaker (0..1).
        min_workers: fewer connected workers than this never open it.
        hold_s: how long it holds at most.
    """

    def __init__(self, fraction: float = 0.5, min_workers: int = 3, hold_s: float = 30.0) -> None:
        if not 0 < fraction <= 1:
            raise ValueError(f"breaker fraction must be in (0, 1], got {fraction}")
        self.fraction = fraction
        self.min_workers = min_workers
        self.hold_s = hold_s
        self.opened_at: float | None = None
        self.trips = 0

    def admit(self, stale: list[WorkerRecord], registry: WorkerRegistry, now: float) -> list[WorkerRecord]:
        """The stale workers that may be reaped at ``now``."""
        suspects = [r for r in stale if r.connected]
        if suspects:
            connected = registry.connected_count()  # O(1): counting sorted every worker per tick
            mass = connected >= self.min_workers and len(suspects) > self.fraction * connected
        else:
            connected, mass = 0, False
        if not mass:
            if self.opened_at is not None:
                log.warning("reaper circuit breaker closed", held_s=round(now - self.opened_at, 3))
                self.opened_at = None
            return stale
        if self.opened_at is None:
            self.opened_at = now
            self.trips += 1
            log.error(
                "reaper circuit breaker OPEN: most workers went silent at once; suspecting the coordinator "
                "itself (stalled loop or network cut on its side), not reaping them",
                stale=len(suspects),
                connected=connected,
                hold_s=self.hold_s,
                worker_ids=[r.id for r in suspects[:20]],
            )
        if now - self.opened_at < self.hold_s:
            return [r for r in stale if not r.connected]
        log.error("reaper circuit breaker: still silent after the hold; reaping them",
                  stale=len(suspects), held_s=round(now - self.opened_at, 3))  # fmt: skip
        self.opened_at = None
        return stale


class Recovery:
    """The core's durability side: journal, acks, de-duplication, restore, hand-back and retries.

    Args:
        plans: the core's plans by id (filled by :meth:`restore`).
        registry: the workers and their leases.
        scheduler: requeues handed-back and retried plans, and numbers new plans after a restore.
        journal: the records of each step.
        counters: the core's counters (:data:`COUNTERS`).
        heartbeat_timeout_s: how long a restored lease waits for its worker; the breaker's hold.
        breaker_fraction: see :class:`ReaperBreaker`.
        breaker_min_workers: see :class:`ReaperBreaker`.
        names: the plans whose name is not their key (coordinator/plans.py), rebuilt by :meth:`restore`.
    """

    def __init__(
        self,
        *,
        plans: dict[str, Plan],
        registry: WorkerRegistry,
        scheduler: Scheduler,
        journal: Journal,
        counters: dict[str, int],
        heartbeat_timeout_s: float,
        breaker_fraction: float,
        breaker_min_workers: int,
        names: PlanNames | None = None,
    ) -> None:
        self._plans = plans
        self._names = names  # restored plans' names that are not their keys go here
        self._registry = registry
        self._scheduler = scheduler
        self._counters = counters
        self._heartbeat_timeout_s = heartbeat_timeout_s
        self.journal = journal
        self.breaker = ReaperBreaker(breaker_fraction, breaker_min_workers, heartbeat_timeout_s)
        self._acked: dict[int, int] = {}  # worker session -> highest seq received
        self._ack_due: dict[int, int] = {}  # sessions owed an ack after this step -> its seq
        counters.update(dict.fromkeys(COUNTERS, 0))

    # ------------------------------------------------------------------ effects

    def take_records(self) -> list[Record]:
        """The records of this step."""
        return self.journal.take()

    def take_acks(self) -> list[tuple[int, int]]:
        """(worker session, seq) for every session owed an ``ack`` after this step."""
        if not self._ack_due:
            return []
        due, self._ack_due = self._ack_due, {}
        return list(due.items())

    def forget(self, conn_id: int) -> None:
        """A session closed."""
        self._acked.pop(conn_id, None)
        self._ack_due.pop(conn_id, None)

    # ------------------------------------------------------------------ ack and de-duplication

    def duplicate(self, conn_id: int, worker_id: str, msg: Accept | Reject | Event | Done) -> bool:
        """Note a numbered worker message for the ack; True when it was applied before (a re-send)."""
        seq = msg.seq
        if seq <= 0:
            return False
        if seq > self._acked.get(conn_id, 0):
            self._acked[conn_id] = self._ack_due[conn_id] = seq
        plan = self._plans.get(msg.plan_id)
        leased = msg.attempt  # read once: on a union of Structs each read is a generic attribute lookup
        if plan is None or plan.worker_id != worker_id or plan.attempt != leased:
            return False  # not this worker's current lease: the core answers stale_lease
        attempt, applied = plan.worker_seq
        if attempt == leased and seq <= applied:
            self._counters["duplicates_dropped"] += 1
            return True
        plan.worker_seq = (leased, seq)
        return False

    def lease(self, conn_id: int, worker_id: str, msg: Accept | Event | Done) -> Plan | bool:
        """:meth:`duplicate` for a plan's own three messages, and the lease's check in the same look-up.

        Returns:
            The plan when ``msg`` names the worker's current lease (its plan, attempt and the record's lease)
            and is not a re-send; True for a re-send (acked, dropped); False otherwise: the caller's
            ``Leases._lease`` checks it again and answers (``stale_lease``, ``invalid_message``, 4403).
        """
        seq = msg.seq
        if seq > 0 and seq > self._acked.get(conn_id, 0):
            self._acked[conn_id] = self._ack_due[conn_id] = seq
        plan_id = msg.plan_id
        plan = self._plans.get(plan_id)
        leased = msg.attempt  # read once: on a union of Structs each read is a generic attribute lookup
        if plan is None or plan.worker_id != worker_id or plan.attempt != leased:
            return False  # not this worker's current lease: the core answers stale_lease
        if seq > 0:
            attempt, applied = plan.worker_seq
            if attempt == leased and seq <= applied:
                self._counters["duplicates_dropped"] += 1
                return True
            plan.worker_seq = (leased, seq)
        if leased >= 1 and (record := self._registry.record_of(worker_id)) is not None and plan_id in record.leases:
            return plan
        return False

    # ------------------------------------------------------------------ restart

    def restore(self, stored: Iterable[StoredPlan], now: float) -> list[Plan]:
        """Load plans after a restart; returns the queued ones, best first, for the core to place.

        Raises:
            ValueError: the coordinator already holds plans.
        """
        plans = self._plans
        if plans:
            raise ValueError("restore() must run on a coordinator that holds no plan yet")
        queued: list[Plan] = []
        held: dict[str, list[Plan]] = {}
        last_order = 0
        names = self._names
        for item in stored:
            plan = plan_from_store(item)
            plans[plan.id] = plan
            if plan.name is not None and names is not None:
                names.add(plan)
            last_order = max(last_order, plan.order)
            if plan.state == "queued":
                queued.append(plan)
            elif plan.worker_id is None:  # a live lease without a worker is never written; be safe
                plan.state = "queued"
                queued.append(plan)
            elif plan.replicas and plan.state == "running" and plan.produced:
                continue  # its worker's success is held for copies of its outputs: no lease (plan_graphs.py)
            elif not plan.terminal:
                held.setdefault(plan.worker_id, []).append(plan)
        registry = self._registry
        for worker_id, leased in held.items():
            # A placeholder: disconnected, last beat now. Its reconnect (hello) continues the
            # plans it lists; without one the reaper requeues them after one heartbeat timeout.
            registry.register(worker_id, Capabilities(max_concurrency=0), now)
            registry.disconnect(worker_id)
            for plan in leased:
                registry.claim(worker_id, plan.id)
        self._scheduler.continue_orders(last_order)
        self._counters["plans_restored"] = len(plans)
        log.info(
            "restored plans from the store",
            plans=len(plans),
            queued=len(queued),
            leased=sum(len(p) for p in held.values()),
            awaited_workers=sorted(held),
            grace_s=self._heartbeat_timeout_s,
        )
        return sorted(queued, key=lambda p: (-p.priority, p.order))

    # ------------------------------------------------------------------ hand-back and retries

    def hand_back(self, worker_id: str, now: float, removed: bool = False) -> None:
        """A leaving worker's unfinished leases go back to the queue now, at no cost in attempts.

        ``removed``: an operator removed it (``remove_worker``) rather than it saying goodbye.
        """
        registry, plans = self._registry, self._plans
        if worker_id not in registry:
            return
        record = registry.get(worker_id)
        leased = sorted((plans[p] for p in record.leases if p in plans), key=lambda p: (-p.priority, p.order))
        for plan in leased:
            registry.release(worker_id, plan.id)
            if plan.terminal or plan.worker_id != worker_id:
                continue  # a cancelled plan only waited for this worker to let go
            advance(plan, "handback")
            plan.free_attempts += 1
            self._counters["plans_handed_back"] += 1
            how = "was removed by an operator" if removed else "left"
            note_attempt(plan, "handed_back", f"worker {worker_id} {how}" + ("" if removed else " (goodbye)"))
            self._scheduler.requeue(plan, f"worker {worker_id} {how} and handed it back", now)

    def retry(self, plan: Plan, worker_id: str, error: ErrorInfo, now: float) -> None:
        """A failed attempt of a plan with retries left: queue it again."""
        advance(plan, "retry")
        plan.retried += 1
        plan.free_attempts += 1
        self._counters["plans_retried"] += 1
        note_attempt(plan, "failed", f"{error.code}: {error.message}")
        why = (
            f"attempt {plan.attempt} failed on worker {worker_id} ({error.code}: {error.message}); "
            f"retry {plan.retried} of {plan.retries}"
        )
        self._scheduler.requeue(plan, why, now)
