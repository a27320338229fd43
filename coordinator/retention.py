"""Retention of finished plans: forgotten past ``--plan-retention`` seconds, or past ``--plan-retention-bytes``.

Without it the coordinator keeps every plan forever, in memory (each with its held events)
and in the store, so a long-running coordinator grows without bound. Like Ray and Dask,
finished work is dropped after a while (docs/SEMANTICS.md §Retention):

* A plan that reached a terminal state (succeeded, failed, cancelled) more than the
  retention ago is removed from the core's plans and subscriptions, and a
  :class:`~coordinator.records.PlanForgotten` record deletes it from the store in the
  normal group commit. Afterwards ``get_plan``, ``subscribe`` and ``cancel`` of its id answer
  ``plan_not_found``, and a ``submit`` with its id creates a new plan: idempotency of a
  client-chosen id holds for the retention window.
* Bytes bound as well: when the finished plans' retained bytes (:meth:`Plan.retained_bytes
  <coordinator.plans.Plan.retained_bytes>`: args, result, held events and a fixed overhead)
  exceed ``max_bytes``, the oldest finished plans are forgotten until they fit, whatever their
  age. Each bound works alone (0 turns it off); counted by reason (``plans_forgotten.time``,
  ``plans_forgotten.bytes``).
* A plan whose lease is still held (cancelled while running: the slot stays claimed until
  the worker's ``done``) is kept until the lease is released, so that ``done`` finds it.
* End times survive restarts. The core has no wall clock: the driver tells it the offset from
  its ``now`` (monotonic) to Unix time (:attr:`Retention.wall_offset`), a plan's end is stamped
  ``plan.ended_at = now + wall_offset`` and stored with its status (``PlanStatus.ended_at``).
  On restore (:meth:`Retention.restored`) a finished plan's retention runs from that stored
  time: a plan that ended 23 h before a restart is forgotten 1 h after it (24 h retention). A
  plan stored without an end time (an older store) counts as ended at the restore, and the time
  is written back, so it is counted once.

Cost: appending ``(ended_at, plan, bytes)`` to a deque when a plan ends (in end order, so the
oldest is first), sizing its args and result once, and at each reaper tick popping the expired
ones: O(expired) per sweep, nothing per message. A sweep handles at most :data:`MAX_PER_SWEEP`
of them (after a restart many restored finished plans may expire in the same tick): the rest go
at the next ticks, so no tick stalls the loop or makes one huge store transaction.

Depends on the state it prunes (plans, registry, subscriptions) and the journal, all handed in;
coordinator/streams.py tells it when a plan ends.
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING

import structlog

if TYPE_CHECKING:
    from coordinator.plans import Plan, Subscriptions
    from coordinator.records import Journal
    from coordinator.registry import WorkerRegistry

__all__ = ["DEFAULT_RETENTION_BYTES", "MAX_PER_SWEEP", "Retention"]

log = structlog.get_logger(__name__)

MAX_PER_SWEEP = 5_000  # expired plans looked at per tick (a tick is at most 1 s apart by default)
DEFAULT_RETENTION_BYTES = 1 << 30  # --plan-retention-bytes: 1 GiB of finished plans


class Retention:
    """Finished plans in end order, forgotten once older than ``retention_s`` or past ``max_bytes``.

    Args:
        plans: the core's plans by id; forgotten ones are removed.
        registry: the workers, whose leases keep a cancelled plan until its ``done``.
        subscriptions: followers of a forgotten plan are dropped from it.
        journal: a forgotten plan's record (:class:`~coordinator.records.PlanForgotten`) goes here.
        counters: the core's counters (``plans_forgotten``, and by reason ``plans_forgotten.time``
            and ``plans_forgotten.bytes``).
        retention_s: seconds a finished plan is kept; 0: no time bound.
        max_bytes: retained bytes of all finished plans together; 0: no byte bound.

    Attributes:
        wall_offset: Unix time minus the core's ``now``, set by the driver (0 in tests whose
            fake clock is the wall clock).
        retained_bytes: what the finished plans in the deque hold now.
    """

    def __init__(
        self,
        *,
        plans: dict[str, Plan],
        registry: WorkerRegistry,
        subscriptions: Subscriptions,
        journal: Journal,
        counters: dict[str, int],
        retention_s: float,
        max_bytes: int = DEFAULT_RETENTION_BYTES,
    ) -> None:
        self._plans = plans
        self._registry = registry
        self._subscriptions = subscriptions
        self._journal = journal
        self._counters = counters
        self.retention_s = retention_s
        self.max_bytes = max_bytes
        self.wall_offset = 0.0
        self.retained_bytes = 0
        self._ended: deque[tuple[float, Plan, int]] = deque()
        self.max_per_sweep = MAX_PER_SWEEP
        counters.update({"plans_forgotten": 0, "plans_forgotten.time": 0, "plans_forgotten.bytes": 0})

    def __len__(self) -> int:
        return len(self._ended)

    @property
    def bounded(self) -> bool:
        """Whether finished plans are ever forgotten."""
        return self.retention_s > 0 or self.max_bytes > 0

    def ended(self, plan: Plan, now: float) -> None:
        """The plan just reached a terminal state at ``now`` (monotonic seconds): stamp and track it."""
        plan.ended_at = now + self.wall_offset
        if self.bounded:
            self._track(now, plan)

    def restored(self, plans: list[Plan], now: float) -> None:
        """Finished plans loaded from a store at ``now``: their retention runs from their stored end.

        A plan without one (written by an older coordinator) ends now, and its status is
        written again with that time.
        """
        entries: list[tuple[float, Plan]] = []
        for plan in plans:
            if plan.ended_at is None:
                plan.ended_at = now + self.wall_offset
                self._journal.touched(plan)
            # A clock set back since: never later than now.
            entries.append((min(plan.ended_at - self.wall_offset, now), plan))
        if not self.bounded:
            return
        entries.sort(key=_first)
        for ended_at, plan in entries:
            self._track(ended_at, plan)

    def _track(self, ended_at: float, plan: Plan) -> None:
        size = plan.retained_bytes()
        self._ended.append((ended_at, plan, size))
        self.retained_bytes += size

    def sweep(self, now: float) -> int:
        """Forget finished plans past the retention before ``now``, then past the byte bound; returns how many."""
        ended = self._ended
        if not ended:
            return 0
        by_time = self._sweep(now, now - self.retention_s, "time") if self.retention_s > 0 else 0
        by_bytes = self._sweep(now, None, "bytes") if self.max_bytes and self.retained_bytes > self.max_bytes else 0
        forgotten = by_time + by_bytes
        if forgotten:
            log.info("forgot finished plans past their retention", plans=forgotten, by_time=by_time,
                     by_bytes=by_bytes, retention_s=self.retention_s, retained_bytes=self.retained_bytes,
                     max_bytes=self.max_bytes)  # fmt: skip
        return forgotten

    def _sweep(self, now: float, horizon: float | None, reason: str) -> int:
        """Forget from the oldest: those ended before ``horizon``, or (None) while over the byte bound."""
        ended = self._ended
        plans = self._plans
        forgotten = 0
        kept: list[tuple[float, Plan, int]] = []
        budget = self.max_per_sweep
        while ended and budget > 0:
            if horizon is None:
                if self.retained_bytes <= self.max_bytes:
                    break
            elif ended[0][0] >= horizon:
                break
            budget -= 1
            entry = ended.popleft()
            _, plan, size = entry
            self.retained_bytes -= size
            if plans.get(plan.id) is not plan or not plan.terminal:
                continue  # already gone (cannot happen today; cheap to be safe)
            if self._lease_held(plan):
                kept.append(entry)  # look again one retention later
                continue
            self._forget(plan)
            forgotten += 1
        for entry in kept:  # stamped now: still in end order behind every entry left
            self._track(now, entry[1])
        if forgotten:
            self._counters["plans_forgotten"] += forgotten
            self._counters[f"plans_forgotten.{reason}"] += forgotten
        return forgotten

    def _lease_held(self, plan: Plan) -> bool:
        """A cancelled plan whose worker has not sent its ``done`` yet still holds a slot."""
        registry = self._registry
        worker_id = plan.worker_id
        return worker_id is not None and worker_id in registry and plan.id in registry.get(worker_id).leases

    def _forget(self, plan: Plan) -> None:
        del self._plans[plan.id]
        subscriptions = self._subscriptions
        for conn_id in list(subscriptions.followers(plan.id)):
            subscriptions.remove(plan.id, conn_id)
        self._journal.forgotten(plan)


def _first(entry: tuple[float, Plan]) -> float:
    return entry[0]
