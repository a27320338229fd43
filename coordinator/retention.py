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
* Bytes per principal (issue 17 finding 3): a principal's finished plans are charged to the same
  ``--max-bytes-per-client`` budget as its unfinished ones (:class:`~coordinator.limits.PlanQuota`),
  so what one client holds (queued, running and retained) stays within its budget. Past it, that
  principal's *own* oldest finished plans are forgotten first (``plans_forgotten.principal``), never
  another principal's, and never its most recent finished plan (its result was just sent; a client
  that asks for it next still finds it). Finished plans are forgotten rather than a new ``submit``
  refused: retention is a cache of results, and a refusal would hold the principal back for a whole
  retention window. Checked when one of its plans ends and at each reaper tick. Not applied when
  both bounds above are 0 (the operator asked to keep every plan).
* A plan whose lease is still held (cancelled while running: the slot stays claimed until
  the worker's ``done``) is kept until the lease is released, so that ``done`` finds it.
* End times survive restarts. The core has no wall clock: the driver tells it the offset from
  its ``now`` (monotonic) to Unix time (:attr:`Retention.wall_offset`), a plan's end is stamped
  ``plan.ended_at = now + wall_offset`` and stored with its status (``PlanStatus.ended_at``).
  On restore (:meth:`Retention.restored`) a finished plan's retention runs from that stored
  time: a plan that ended 23 h before a restart is forgotten 1 h after it (24 h retention). A
  plan stored without an end time (an older store) counts as ended at the restore, and the time
  is written back, so it is counted once.

Cost: appending an entry ``(ended_at, plan, bytes)`` to a deque when a plan ends (in end order, so the
oldest is first) and to its owner's deque, sizing its args and result once, and at each reaper tick
popping the expired ones: O(expired) per sweep, nothing per message. An entry forgotten for its
principal's budget is marked dead (it lets go of its plan) and skipped when the global deque reaches
it; dead entries are dropped in one pass once they outnumber the live ones. A sweep handles at most
:data:`MAX_PER_SWEEP` of them (after a restart many restored finished plans may expire in the same tick): the rest go
at the next ticks, so no tick stalls the loop or makes one huge store transaction.

Depends on the state it prunes (plans, registry, subscriptions) and the journal, all handed in;
coordinator/streams.py tells it when a plan ends.
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING, Any

import structlog

if TYPE_CHECKING:
    from coordinator.journal import Journal
    from coordinator.limits import PlanQuota
    from coordinator.plans import Plan, PlanNames, Subscriptions
    from coordinator.registry import WorkerRegistry

__all__ = ["DEFAULT_RETENTION_BYTES", "MAX_PER_SWEEP", "Retention"]

log = structlog.get_logger(__name__)

MAX_PER_SWEEP = 5_000  # expired plans looked at per tick (a tick is at most 1 s apart by default)
DEFAULT_RETENTION_BYTES = 1 << 30  # --plan-retention-bytes: 1 GiB of finished plans


#: One finished plan in retention: ``[ended at, plan, size]``, a list (cheaper to make than an object,
#: mutable unlike a tuple). Its plan is None once it is no longer counted: a dead entry holds no plan.
_Ended = list
_AT, _PLAN, _SIZE = 0, 1, 2


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
        quota: the per-principal budget (``max_bytes`` of :class:`~coordinator.limits.PlanQuota`,
            ``--max-bytes-per-client``) that a principal's finished plans share with its unfinished
            ones; None or a 0 budget: no per-principal bound (nor when both bounds above are 0,
            which keeps every plan).
        names: the plans whose name is not their key (coordinator/plans.py): a forgotten one's entry goes.

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
        quota: PlanQuota | None = None,
        names: PlanNames | None = None,
    ) -> None:
        self._plans = plans
        self._names = names  # a forgotten plan's name is free again (plans.py PlanNames)
        self._registry = registry
        self._subscriptions = subscriptions
        self._journal = journal
        self._counters = counters
        self.retention_s = retention_s
        self.max_bytes = max_bytes
        self.wall_offset = 0.0
        self.retained_bytes = 0
        # Only while retention is bounded at all: --plan-retention 0 with --plan-retention-bytes 0 keeps every plan.
        charged = quota is not None and quota.max_bytes > 0 and (retention_s > 0 or max_bytes > 0)
        self._quota = quota if charged else None
        self._ended: deque[_Ended[Any]] = deque()
        self._live = 0  # live entries; the rest of self._ended are dead ones not yet reached
        self._by_owner: dict[str, deque[_Ended[Any]]] = {}  # principal -> its live entries, oldest first
        self._owner_bytes: dict[str, int] = {}
        self.max_per_sweep = MAX_PER_SWEEP
        counters.update({"plans_forgotten": 0, "plans_forgotten.time": 0, "plans_forgotten.bytes": 0,
                         "plans_forgotten.principal": 0})

    def __len__(self) -> int:
        return self._live

    @property
    def bounded(self) -> bool:
        """Whether finished plans are ever forgotten."""
        return self.retention_s > 0 or self.max_bytes > 0

    def principal_bytes(self, principal: str) -> int:
        """What ``principal``'s finished plans in retention hold now."""
        return self._owner_bytes.get(principal, 0)

    def ended(self, plan: Plan, now: float) -> None:
        """The plan just reached a terminal state at ``now`` (monotonic seconds): stamp and track it."""
        plan.ended_at = now + self.wall_offset
        if self.retention_s > 0 or self.max_bytes > 0:  # self.bounded, inlined: this runs for every plan
            self._track(now, plan)
            quota = self._quota
            if quota is not None:
                owner = plan.owner
                if self._owner_bytes[owner] + quota.held_bytes(owner) > quota.max_bytes:
                    self._fit_principal(owner, now)

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
        entry = [ended_at, plan, size]
        self._ended.append(entry)
        self._live += 1
        self.retained_bytes += size
        if self._quota is not None:
            owner = plan.owner
            mine = self._by_owner.get(owner)
            if mine is None:
                mine = self._by_owner[owner] = deque()
                self._owner_bytes[owner] = 0
            mine.append(entry)
            self._owner_bytes[owner] += size

    def _untrack(self, entry: _Ended[Any], *, owner_head: bool) -> Plan:
        """Stop counting ``entry`` and return its plan (``owner_head``: it is already off its owner's deque)."""
        plan: Plan = entry[_PLAN]
        entry[_PLAN] = None
        self._live -= 1
        size: int = entry[_SIZE]
        self.retained_bytes -= size
        if self._quota is None:
            return plan
        owner = plan.owner
        mine = self._by_owner.get(owner)
        if mine is None:
            return plan
        if not owner_head:
            if mine and mine[0] is entry:  # both deques are in end order: it is nearly always the head
                mine.popleft()
            else:
                mine.remove(entry)
        left = self._owner_bytes[owner] - size
        if mine:
            self._owner_bytes[owner] = left
        else:
            del self._by_owner[owner]
            del self._owner_bytes[owner]
        return plan

    def _fit_principal(self, owner: str, now: float) -> int:
        """Forget ``owner``'s oldest finished plans while it holds more than its budget; returns how many.

        Its most recent finished plan is kept, and so is a plan whose lease is still held.
        """
        quota = self._quota
        mine = self._by_owner.get(owner)
        if quota is None or mine is None:
            return 0
        budget = quota.max_bytes - quota.held_bytes(owner)
        forgotten = 0
        kept: list[Plan] = []
        look = min(len(mine), self.max_per_sweep)
        while look > 0 and len(mine) > 1 and self._owner_bytes[owner] > budget:
            look -= 1
            plan = self._untrack(mine.popleft(), owner_head=True)
            if self._plans.get(plan.id) is not plan or not plan.terminal:
                continue
            if self._lease_held(plan):
                kept.append(plan)
                continue
            self._forget(plan)
            forgotten += 1
        for plan in kept:  # counted again from now, behind every other entry
            self._track(now, plan)
        ended = self._ended
        if len(ended) > 2 * self._live + 64:  # dead entries wait for a sweep to reach them: bound them
            self._ended = deque(entry for entry in ended if entry[_PLAN] is not None)
        if forgotten:
            self._counters["plans_forgotten"] += forgotten
            self._counters["plans_forgotten.principal"] += forgotten
        return forgotten

    def sweep(self, now: float) -> int:
        """Forget finished plans past the retention before ``now``, then past the byte bound; returns how many."""
        ended = self._ended
        if not ended:
            return 0
        by_time = self._sweep(now, now - self.retention_s, "time") if self.retention_s > 0 else 0
        by_bytes = self._sweep(now, None, "bytes") if self.max_bytes and self.retained_bytes > self.max_bytes else 0
        by_principal = 0
        quota = self._quota
        if quota is not None:  # unfinished plans submitted since their last end may have taken the room
            owner_bytes = self._owner_bytes
            over = [o for o, held in owner_bytes.items() if held + quota.held_bytes(o) > quota.max_bytes]
            for owner in over:
                by_principal += self._fit_principal(owner, now)
        forgotten = by_time + by_bytes + by_principal
        if forgotten:
            log.info("forgot finished plans past their retention", plans=forgotten, by_time=by_time,
                     by_bytes=by_bytes, by_principal=by_principal, retention_s=self.retention_s,
                     retained_bytes=self.retained_bytes, max_bytes=self.max_bytes)  # fmt: skip
        return forgotten

    def _sweep(self, now: float, horizon: float | None, reason: str) -> int:
        """Forget from the oldest: those ended before ``horizon``, or (None) while over the byte bound."""
        ended = self._ended
        plans = self._plans
        forgotten = 0
        kept: list[Plan] = []
        budget = self.max_per_sweep
        while ended and budget > 0:
            if horizon is None:
                if self.retained_bytes <= self.max_bytes:
                    break
            elif ended[0][_AT] >= horizon:
                break
            budget -= 1
            entry = ended.popleft()
            if entry[_PLAN] is None:
                continue  # forgotten already for its principal's budget
            plan = self._untrack(entry, owner_head=False)
            if plans.get(plan.id) is not plan or not plan.terminal:
                continue  # already gone (cannot happen today; cheap to be safe)
            if self._lease_held(plan):
                kept.append(plan)  # look again one retention later
                continue
            self._forget(plan)
            forgotten += 1
        for plan in kept:  # stamped now: still in end order behind every entry left
            self._track(now, plan)
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
        if plan.name is not None and self._names is not None:
            self._names.forget(plan)
        if plan.tally is not None:  # its owner's listing counts (plans.py OwnerTally)
            plan.tally.remove(plan)
        subscriptions = self._subscriptions
        for conn_id in list(subscriptions.followers(plan.id)):
            subscriptions.remove(plan.id, conn_id)
        self._journal.forgotten(plan)


def _first(entry: tuple[float, Plan]) -> float:
    return entry[0]
