"""Retention of finished plans: a plan that ended more than ``--plan-retention`` seconds ago is forgotten.

Without it the coordinator keeps every plan forever, in memory (each with its held events)
and in the store, so a long-running coordinator grows without bound. Like Ray and Dask,
finished work is dropped after a while (docs/SEMANTICS.md §Retention):

* A plan that reached a terminal state (succeeded, failed, cancelled) more than the
  retention ago is removed from the core's plans and subscriptions, and a
  :class:`~coordinator.records.PlanForgotten` record deletes it from the store in the
  normal group commit. Afterwards ``get_plan``, ``subscribe`` and ``cancel`` of its id answer
  ``plan_not_found``, and a ``submit`` with its id creates a new plan: idempotency of a
  client-chosen id holds for the retention window.
* A plan whose lease is still held (cancelled while running: the slot stays claimed until
  the worker's ``done``) is kept until the lease is released, so that ``done`` finds it.
* Plans restored after a restart that had already ended count as ended at the restore: a
  restart only ever lengthens their stay.

Cost: appending ``(ended_at, plan)`` to a deque when a plan ends (in end order, so the
oldest is first), and at each reaper tick popping the expired ones: O(expired) per sweep,
nothing per message. A sweep handles at most :data:`MAX_PER_SWEEP` of them (after a restart
every restored finished plan expires in the same tick): the rest go at the next ticks, so no
tick stalls the loop or makes one huge store transaction. Retention 0 keeps every plan (the
deque stays empty).

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

__all__ = ["MAX_PER_SWEEP", "Retention"]

log = structlog.get_logger(__name__)

MAX_PER_SWEEP = 5_000  # expired plans looked at per tick (a tick is at most 1 s apart by default)


class Retention:
    """Finished plans in end order, forgotten once older than ``retention_s``.

    Args:
        plans: the core's plans by id; forgotten ones are removed.
        registry: the workers, whose leases keep a cancelled plan until its ``done``.
        subscriptions: followers of a forgotten plan are dropped from it.
        journal: a forgotten plan's record (:class:`~coordinator.records.PlanForgotten`) goes here.
        counters: the core's counters (``plans_forgotten``).
        retention_s: seconds a finished plan is kept; 0 keeps them forever.
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
    ) -> None:
        self._plans = plans
        self._registry = registry
        self._subscriptions = subscriptions
        self._journal = journal
        self._counters = counters
        self.retention_s = retention_s
        self._ended: deque[tuple[float, Plan]] = deque()
        self.max_per_sweep = MAX_PER_SWEEP
        counters["plans_forgotten"] = 0

    def __len__(self) -> int:
        return len(self._ended)

    def ended(self, plan: Plan, now: float) -> None:
        """The plan just reached a terminal state at ``now`` (monotonic seconds)."""
        if self.retention_s > 0:
            self._ended.append((now, plan))

    def sweep(self, now: float) -> int:
        """Forget every finished plan that ended more than the retention before ``now``; returns how many."""
        ended = self._ended
        if not ended:
            return 0
        plans = self._plans
        horizon = now - self.retention_s
        forgotten = 0
        kept: list[tuple[float, Plan]] = []
        budget = self.max_per_sweep
        while ended and ended[0][0] < horizon and budget > 0:
            budget -= 1
            _, plan = ended.popleft()
            if plans.get(plan.id) is not plan or not plan.terminal:
                continue  # already gone (cannot happen today; cheap to be safe)
            if self._lease_held(plan):
                kept.append((now, plan))  # look again one retention later
                continue
            self._forget(plan)
            forgotten += 1
        ended.extend(kept)  # stamped now: still in end order behind every entry left
        if forgotten:
            self._counters["plans_forgotten"] += forgotten
            log.info("forgot finished plans past their retention", plans=forgotten, retention_s=self.retention_s)
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
