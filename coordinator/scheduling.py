"""Queue <-> placement <-> leases: where a queued plan goes, and what happens when a lease is lost.

What it owns: the submit order of new plans, moving plans between the queue and workers'
leases (docs/SEMANTICS.md §Placement), and the ``waiting`` reasons of queued plans with the
per-signature cache that keeps them cheap.

Rules:

* Invariant after every input: no queued plan has an alive worker with room that can run it.
  The core calls :meth:`Scheduler.enqueue` for a plan that becomes queued,
  :meth:`Scheduler.fill_worker` for a worker that gains room, and
  :meth:`Scheduler.refresh_waiting` when the set of alive workers (or their drain marks) changed.
* A plan's lease is lost with its worker (reaped, reconnected without it, drained past its
  deadline): the plan is requeued, or failed with ``worker_lost`` after its last attempt.
  Retries and hand-backs do not count against ``max_attempts`` (``plan.free_attempts``).
* A queued plan says why it waits (``waiting``), again only when the reason changes.
* Callers make the plan's table move (coordinator/plans.py ``advance``) before
  :meth:`Scheduler.requeue`; :meth:`Scheduler.assign` and :meth:`Scheduler.lease_lost` make their own.

Depends on the registry, placement (coordinator/placement/), the queue, streams
(coordinator/streams.py) and the outbox (coordinator/effects.py); handlers call it, never the reverse.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import structlog

from coordinator.limits import TokenBucket
from coordinator.placement.plan_queue import Signature, explain_wait
from coordinator.placement.policies import POLICY_NAMES
from coordinator.plans import SMALL_EVENT_BYTES, advance
from coordinator.receipts import projection
from protocol import errors
from protocol.messages import Assign, Cancel, ErrorInfo, Revoke
from protocol.tracecontext import UNSAMPLED, UNSAMPLED_SHORT

if TYPE_CHECKING:
    from coordinator.data_plane import DataPlane
    from coordinator.effects import Outbox
    from coordinator.graphs.hooks import GraphHooks
    from coordinator.placement.placer import Placement
    from coordinator.placement.plan_queue import PlanQueue
    from coordinator.plans import Plan
    from coordinator.registry import WorkerRegistry
    from coordinator.sharing import Sharing
    from coordinator.streams import Streams
    from coordinator.workers import WorkerRecord

__all__ = ["PLACEMENT_COUNTERS", "Scheduler", "note_attempt"]

log = structlog.get_logger(__name__)

# Placements are counted per policy under "placements.<policy>" (coordinator/io/ops/metrics.py turns the
# suffix into the ``policy`` label); the policies are in coordinator/placement/policies.py.
PLACEMENT_COUNTERS = tuple(f"placements.{name}" for name in POLICY_NAMES)
_PLACEMENT_KEYS = dict(zip(POLICY_NAMES, PLACEMENT_COUNTERS, strict=True))  # policy -> its counter, made once

#: Work units per second (one per queued group explained, one per plan told its new reason) that
#: re-explaining waiting reasons may take, and at most ``WAIT_WORK_BURST`` in one loop turn; the rest
#: waits for the next tick.
WAIT_WORK_RATE = 2_000.0
WAIT_WORK_BURST = 500


def note_attempt(plan: Plan, outcome: str, reason: str) -> None:
    """Add the attempt that just ended to the plan's history (the detail of a final failure)."""
    entry: dict[str, Any] = {"attempt": plan.attempt, "worker_id": plan.worker_id, "outcome": outcome}
    entry["reason"] = reason
    plan.history.append(entry)


def _waits_aside(
    fits: Callable[[Plan, WorkerRecord], bool], graphs: GraphHooks, now: float
) -> Callable[[Plan, WorkerRecord], bool]:
    """``fits``, and a consumer waiting for another, busy holder is not taken (``Scheduler.fill_worker`` with
    ``graphs.waits``): made here, so its cells are made only then."""

    def waits_fits(plan: Plan, worker: WorkerRecord) -> bool:
        return fits(plan, worker) and graphs.may_take(plan, worker, now)

    return waits_fits


class Scheduler:
    """Places queued plans on workers, requeues lost leases and explains why plans wait.

    Args:
        registry: the workers and their leases.
        plans: the core's plans by id.
        queue: the queued plans, grouped by signature.
        placement: the placement policies (which worker, KV room, stealing).
        streams: where lifecycle events (``leased``, ``waiting``, ``requeued``, ``failed``) go.
        outbox: where ``assign`` and ``revoke`` go.
        counters: the core's counters (placements per policy, ``plans_requeued``).
        data: a leased plan with inputs or outputs gets its ``data_ready`` event from it (None: never).
        sharing: quotas, nominations and preempted attempts (coordinator/sharing.py); None: none.
    """

    def __init__(
        self,
        *,
        registry: WorkerRegistry,
        plans: dict[str, Plan],
        queue: PlanQueue,
        placement: Placement,
        streams: Streams,
        outbox: Outbox,
        counters: dict[str, int],
        data: DataPlane | None = None,
        sharing: Sharing | None = None,
    ) -> None:
        self._data = data
        self._sharing = sharing
        self._registry = registry
        self._plans = plans
        self._queue = queue
        self._placement = placement
        self._streams = streams
        self._outbox = outbox
        self._counters = counters
        counters.update(dict.fromkeys(PLACEMENT_COUNTERS, 0))
        self.orders: Iterator[int] = itertools.count(1)
        """The submit order of new plans (``next(orders)``): ties between equal priorities go to the older plan."""
        self._wait_reasons: dict[Signature, str] = {}  # see _wait_reason
        self._wait_stamp = (-1, -1)
        self._wait_budget = TokenBucket(WAIT_WORK_RATE, WAIT_WORK_BURST, float("inf"), 0.0)  # see _explain
        self._deferred: set[str] = set()  # ops whose groups wait for the tick's explanation (_explain)
        self._defer_all = False
        self._pending = False
        self.graphs: GraphHooks | None = None
        """Plan graphs' part in placing plans with references or ``after`` (coordinator/plan_graphs.py); None: none."""

    # ------------------------------------------------------------------ submit order

    def continue_orders(self, last: int) -> None:
        """After a restore: new plans are numbered after ``last``, the highest order restored."""
        self.orders = itertools.count(last + 1)

    # ------------------------------------------------------------------ placement (§Placement)

    def enqueue(self, plan: Plan, now: float) -> None:
        """Place a queued plan now if an alive worker with room can run it, else queue it and say why."""
        # Queue wait runs from here to the next attempt's accept (coordinator/stats.py).
        plan.queued_at_s, plan.started_at_s = now, None
        graphs = self.graphs if plan.graphed else None
        if graphs is not None and graphs.hold(plan, now):
            return  # a plan it needs has not succeeded (held, its reason said), or it failed with one (plan_graphs.py)
        signature = Signature.of(plan.op, plan.requirements, plan.avoid, plan.gpus)
        pool = self._registry.matching(signature, signature.admits)
        if graphs is not None:  # the workers holding its bytes, or none while it waits for a busy one
            pool = graphs.narrow(plan, pool, now)
        queue = self._queue
        sharing = self._sharing
        quotas = sharing if sharing is not None and sharing.quotas else None  # some team has a quota
        # Only KV room (or a team past a quota it may not borrow beyond) can leave a group queued while a
        # worker has a slot: a newcomer waits its turn.
        ahead = (quotas is not None and quotas.held(plan, signature)) or queue.has_ahead(
            signature, plan.priority, plan.order, plan.owner
        )
        best = None if ahead else self._placement.choose(plan, pool, now)
        if best is not None:
            self.assign(plan, best)
            return
        alone = queue.push(plan.id, signature, plan.priority, plan.order, plan.owner)
        reason = self._wait_reason(signature, now)
        if reason == "waiting for placement":  # room somewhere, but not for this plan's KV blocks
            reason = self._placement.kv_reason(plan, pool) or reason
        if quotas is not None:  # its team's quota is why it waits (coordinator/sharing.py)
            reason = quotas.quota_reason(plan) or reason
        if graphs is not None:  # it waits for the busy worker that holds its bytes
            reason = graphs.wait_reason(plan) or reason
        if alone:  # a new group: its only plan's reason is the group's (no refresh need visit it)
            queue.set_group_reason(signature, reason)
        elif reason != queue.group_reason(signature):
            queue.set_group_reason(signature, None)  # the group's plans disagree: the next refresh visits them
        self._set_waiting(plan, reason)

    def queue_restored(self, plan: Plan, now: float) -> None:
        """Queue a plan restored from the store, keeping the waiting reason it was stored with.

        No worker is connected during a restore, so :meth:`enqueue` would say so for every
        queued plan, and the first registration would say the stored reason again: two events
        and two store writes per queued plan, for a state that lasts one restart. The reason is
        worked out again, and emitted only if it changed, when workers come back (:meth:`refresh_waiting`).
        """
        plan.queued_at_s, plan.started_at_s = now, None
        if plan.graphed and self.graphs is not None and self.graphs.hold(plan, now):
            return  # held by its graph, or failed with a plan it needs (plan_graphs.py)
        signature = Signature.of(plan.op, plan.requirements, plan.avoid, plan.gpus)
        self._queue.push(plan.id, signature, plan.priority, plan.order, plan.owner)
        self._queue.set_group_reason(signature, None)  # the next refresh visits each of its plans

    def fill_worker(self, record: WorkerRecord, now: float) -> None:
        """Give a worker with room the best queued plans it can run, one signature check per group."""
        if not self._registry.is_alive(record.id, now):
            return
        if self._sharing is not None and self._sharing.nominated:  # a preemption made room here for a plan
            self.fill_nominated(record, now)
        if record.has_capacity():
            graphs = self.graphs
            if graphs is not None and graphs.waits:  # a consumer waiting for another, busy holder is not taken here
                self._fill_slots(record, _waits_aside(self._placement.fits, graphs, now))
            else:
                self._fill_slots(record, self._placement.fits)
        # Nothing queued it can run and a slot free: take back an unstarted lease from the most backlogged
        # (only with prefetch: without it no worker holds leases beyond its slots; no call per plan then).
        while self._placement.config.prefetch > 0 and (stolen := self._placement.steal_for(record, now)) is not None:
            plan, victim = stolen
            if victim.conn_id is not None:
                self._outbox.send(victim.conn_id, Revoke(plan_id=plan.id, attempt=plan.attempt))

    def _fill_slots(self, record: WorkerRecord, fits: Callable[[Plan, WorkerRecord], bool]) -> None:
        """``fill_worker``'s placing, for a worker with room: its closures (their cells) are made here, once a call,
        not at every call of ``fill_worker`` (CPython 3.11 makes a function's cells at each call, used or not)."""
        plans, queue = self._plans, self._queue

        def admits(sig: Signature) -> bool:
            return sig.admits(record)

        def fits_id(pid: str) -> bool:
            return fits(plans[pid], record)

        # It can run no signature of another op, nor one whose first tag it lacks: those are not looked at.
        ops, tags = record.capabilities.ops, record.capabilities.tags
        while True:
            plan_id = queue.best_for(admits, fits_id, ops, tags)
            if plan_id is None:
                break
            self.assign(plans[plan_id], record)
            if not record.has_capacity():
                break

    def fill_nominated(self, record: WorkerRecord, now: float) -> None:
        """Place the plan a preemption made room for on this worker (coordinator/sharing.py), if it still
        waits and fits a free slot here; otherwise it is placed like any other."""
        sharing = self._sharing
        plan_id = None if sharing is None else sharing.take_nomination(record.id)
        if plan_id is None or record.draining or len(record.leases) >= record.capabilities.max_concurrency:
            return
        signature = self._queue.signature_of(plan_id)
        if signature is None or not signature.admits(record) or not self._registry.is_alive(record.id, now):
            return
        plan = self._plans[plan_id]
        if self._placement.fits(plan, record):
            self.assign(plan, record)

    def preempted(self, plan: Plan, worker_id: str, why: str, now: float, *, noticed: bool) -> None:
        """A preempted attempt ended without succeeding (its lease is released): queued again, the attempt not
        counted (docs/SEMANTICS.md §Preemption). ``noticed``: its ``preempted`` event went out with the
        ``preempt`` (else, a host interruption, it goes out now)."""
        advance(plan, "preempt")
        plan.free_attempts += 1
        note_attempt(plan, "preempted", why)
        if self._sharing is not None:
            self._sharing.preempted(plan)
        if not noticed:
            self._streams.emit(plan, "preempted", {"reason": why, "worker_id": worker_id, "attempt": plan.attempt},
                               small=True)  # fmt: skip
        self.requeue(plan, f"preempted on worker {worker_id}: {why}", now)

    def take_back_preempted(self, plan: Plan, now: float) -> None:
        """A preempted attempt outlived its grace (coordinator/sharing.py ``overdue``): the worker is told to
        cancel it, its lease is released, the waiting plan goes there, and the plan is queued again."""
        worker_id = plan.worker_id
        registry = self._registry
        if worker_id is None or worker_id not in registry:
            return
        record = registry.get(worker_id)
        if record.conn_id is not None:
            self._outbox.send(record.conn_id, Cancel(plan_id=plan.id, attempt=plan.attempt))
        registry.release(worker_id, plan.id)
        self.fill_nominated(record, now)
        self.preempted(plan, worker_id, f"it did not stop within the preemption grace on worker {worker_id}", now,
                       noticed=True)  # fmt: skip
        self.fill_worker(record, now)

    def assign(self, plan: Plan, record: WorkerRecord) -> None:
        """Lease a queued plan to a worker with room: the next attempt starts (``leased``)."""
        self._queue.discard(plan.id)
        advance(plan, "assign")
        plan.attempt += 1
        plan.worker_id = record.id
        plan.waiting_reason = None
        registry, placement = self._registry, self._placement
        registry.claim(record.id, plan.id, plan.gpus)
        placed_tokens = placement.claimed(plan, record)
        if placed_tokens:
            registry.count_placed_tokens(record.id, placed_tokens)
        # What the receipt compares with (coordinator/receipts.py); no output tokens: nothing to project.
        plan.projected = projection(plan.hints, record) if plan.hints.max_output_tokens > 0 else None
        self._counters[_PLACEMENT_KEYS[plan.hints.policy or placement.config.policy]] += 1  # policy_name, inlined
        if record.conn_id is not None:
            traceparent = plan.traceparent  # "00" (the caller's "no") in one character to a worker that reads it
            if traceparent == UNSAMPLED and record.short_unsampled:  # (a record's field: no struct attribute read)
                traceparent = UNSAMPLED_SHORT
            assign = Assign(
                plan_id=plan.id, attempt=plan.attempt, op=plan.op, args=plan.args, timeout_s=plan.timeout_s,
                inputs=plan.inputs, outputs=plan.outputs, traceparent=traceparent,
            )
            if plan.gpus is not None:
                assign.resources = plan.resources
                assign.devices = list(registry.devices_of(record.id, plan.id))
            if plan.graphed and self.graphs is not None:  # references: their sizes, digests, where to fetch them
                assign.inputs, assign.pulls = self.graphs.assign_inputs(plan, record)
            self._outbox.send(record.conn_id, assign)
        if plan.sampled and self._streams.tracing:  # the queue span ends here, with its placement (§Tracing)
            self._streams.note(plan, "leased", (placement.policy_name(plan), record.id))
        self._streams.emit(plan, "leased", {"worker_id": record.id, "attempt": plan.attempt}, small=True)
        if (plan.inputs or plan.outputs) and self._data is not None:  # where the client sends and fetches bytes
            plan.produced = []
            self._streams.emit(plan, "data_ready", self._data.ready_event(plan))

    def adopt(self, plan: Plan, record: WorkerRecord, attempt: int, devices: Sequence[int] = ()) -> None:
        """Lease a queued plan to the worker that runs (or ran) its ``attempt``: a store loss took
        that lease (docs/SEMANTICS.md §Recovery from clients and workers).

        No ``assign`` goes out (the worker has the plan); the stream says ``leased`` again, with
        ``recovered: true``, and the worker's ``done`` for that attempt is then accepted.
        """
        self._queue.discard(plan.id)
        advance(plan, "assign")
        plan.attempt = attempt
        plan.worker_id = record.id
        plan.waiting_reason = None
        self._registry.claim(record.id, plan.id, plan.gpus, devices)
        placed_tokens = self._placement.claimed(plan, record)
        if placed_tokens:
            self._registry.count_placed_tokens(record.id, placed_tokens)
        data = {"worker_id": record.id, "attempt": attempt, "recovered": True}
        if plan.sampled and self._streams.tracing:  # the queue span ends here (§Tracing)
            self._streams.note(plan, "leased", None)
        self._streams.emit(plan, "leased", data, small=True)

    def dequeue(self, plan: Plan) -> None:
        """A queued plan ended (cancelled) before it was placed: it leaves the queue."""
        self._queue.discard(plan.id)

    def requeue(self, plan: Plan, why: str, now: float) -> None:
        """A leased/running plan is back to queued (the table move is done); tell its stream and place it."""
        plan.worker_id = None
        self._counters["plans_requeued"] += 1
        log.info("plan requeued", plan_id=plan.id, reason=why, next_attempt=plan.attempt + 1)
        self._streams.emit(plan, "requeued", {"reason": why, "attempt": plan.attempt + 1}, small=True)
        self.enqueue(plan, now)

    def lease_lost(self, plan: Plan, worker_id: str, why: str, now: float) -> None:
        """The worker holding the plan's lease is gone: requeue it, or fail it after its last attempt."""
        if plan.terminal or plan.worker_id != worker_id:
            return  # a cancelled plan only held the lease; nothing is left to do
        note_attempt(plan, "lost", why)
        if plan.attempt - plan.free_attempts >= plan.max_attempts:  # retries and hand-backs are free
            advance(plan, "worker_lost.final")
            message = f"{why} on attempt {plan.attempt} of {plan.max_attempts}; no attempts left"
            log.warning("plan failed: worker lost", plan_id=plan.id, worker_id=worker_id, attempt=plan.attempt)
            error = ErrorInfo(errors.WORKER_LOST, message, {"attempts": list(plan.history)})
            self._streams.fail(plan, worker_id, error)
        else:
            advance(plan, "worker_lost")
            self.requeue(plan, why, now)

    # ------------------------------------------------------------------ waiting reasons

    def refresh_waiting(self, now: float, ops: Iterable[str] | None = None) -> None:
        """Re-explain the queued groups after the set of alive workers changed.

        ``ops``: the ops of the workers that changed (connected, left, drained, revived); only
        groups of those ops are re-explained, with the groups whose reason is not known yet
        (a group's reason depends only on the workers that handle its op). None: every group.
        A group's plans are visited only when its reason changed since the last refresh.
        Nothing queued: nothing to explain (a registration then costs no pass over the workers).
        """
        self._wait_reasons.clear()  # drains and revivals change reasons without a registry change
        self._placement.room_may_have_changed()
        if self._queue:
            self._explain(ops, now)

    def catch_up_waiting(self, now: float) -> None:
        """At each tick: explain the groups a refresh left for later (past its work budget)."""
        if self._pending and self._queue:
            ops = None if self._defer_all else list(self._deferred)  # [] still explains the unexplained groups
            self._pending, self._defer_all, self._deferred = False, False, set()
            self._explain(ops, now)

    def _defer(self, ops: Iterable[str] | None) -> None:
        self._pending = True
        if ops is None:
            self._defer_all = True
        else:
            self._deferred.update(ops)

    def _explain(self, ops: Iterable[str] | None, now: float) -> None:
        """Explain each group and tell its plans when their reason changed, within the work budget.

        Each group explained and each plan told cost one unit of :data:`WAIT_WORK_RATE` per second
        (at most :data:`WAIT_WORK_BURST` at once): worker churn under a deep queue whose reasons flip at
        every (dis)connect costs a bounded amount of work per second and per loop turn (issue 17
        finding 5). Past the budget the rest of the groups of ``ops`` wait for the tick
        (:meth:`catch_up_waiting`), which explains them again.
        """
        queue = self._queue
        budget = self._wait_budget
        budget.tokens = min(float(budget.burst), budget.tokens + (now - budget.last_s) * budget.rate)
        budget.last_s = now
        if budget.tokens < 1:
            self._defer(ops)
            return
        alive: list[WorkerRecord] | None = None
        for signature in queue.iter_signatures(ops, unexplained=True):
            if alive is None:
                alive = list(self._registry.iter_alive(now))  # explain_wait needs no order
            if budget.tokens < 1:
                self._defer(ops)
                return
            budget.tokens -= 1
            reason = explain_wait(signature, alive, cluster=self._placement.config.cluster)
            if reason == queue.group_reason(signature):
                continue
            plans = self._plans
            sharing = self._sharing if self._sharing is not None and self._sharing.quotas else None
            for plan_id in queue.plans_in(signature):
                plan = plans[plan_id]
                told = reason if sharing is None else sharing.quota_reason(plan) or reason  # its team's quota
                if plan.waiting_reason == told:
                    continue  # told already (on a visit that ran out of budget)
                if budget.tokens < 1:
                    queue.set_group_reason(signature, None)  # its plans disagree until the tick goes on
                    self._defer(ops)
                    return
                budget.tokens -= 1
                self._set_waiting(plan, told, recorded=False)  # churn: not a store row each (streams.py)
            queue.set_group_reason(signature, reason)

    def _set_waiting(self, plan: Plan, reason: str, *, recorded: bool = True) -> None:
        if plan.waiting_reason != reason:  # §Plan lifecycle: emitted again only when the reason changes
            plan.waiting_reason = reason
            plan.drop_superseded("waiting", SMALL_EVENT_BYTES)  # only the newest reason in a row is held
            self._streams.emit(plan, "waiting", {"reason": reason}, small=True, recorded=recorded)

    def _wait_reason(self, signature: Signature, now: float) -> str:
        """Why a plan just queued waits: explain_wait, cached per signature until room may have changed.

        explain_wait walks every alive worker; with thousands of them that was most of a queued
        submit. The cache is dropped when the registry changes (membership, connection), a lease
        is released, or a drain, undrain or revival ends in :meth:`refresh_waiting`: without
        those no worker gains room or requirements, so the reason is what explain_wait would say
        (a worker falling silent is corrected by the reaper's refresh). "waiting for placement"
        (room somewhere, not for this plan's KV blocks) depends on the plan: never cached.
        """
        cache = self._wait_reasons
        registry = self._registry
        stamp = (registry.generation, registry.releases)
        if self._wait_stamp != stamp:
            cache.clear()
            self._wait_stamp = stamp
        reason = cache.get(signature)
        if reason is None:
            reason = explain_wait(signature, registry.iter_alive(now), cluster=self._placement.config.cluster)
            # Free devices change with every claim, not only with releases: a GPU group's reason is not kept.
            if reason != "waiting for placement" and signature.gpus is None:
                cache[signature] = reason
        return reason
