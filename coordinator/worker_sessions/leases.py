"""A lease's traffic (docs/SEMANTICS.md §Worker session): ``accept``, ``reject``, ``event`` and ``done``.

What it owns: checking that a message names the worker's current lease, and what each of the
four does to its plan; and which leases were recovered from their worker (:attr:`Leases.adopted`).

Rules:

* ``accept``/``reject``/``event``/``done`` name a lease (plan id, attempt). One that is not the
  worker's current lease is answered ``stale_lease`` (or 4403 when it is another worker's). An
  attempt below 1 is never a lease: ``invalid_message``, and nothing is stopped.
  Re-sends of numbered messages after a reconnect are acked, not applied twice
  (coordinator/recovery.py; coordinator/worker_sessions/dispatch.py asks before calling here).
* A repeated ``accept`` (running) or one after a cancel (terminal) changes nothing. A ``reject``
  after ``accept`` is a protocol error; a rejected plan is requeued at no cost in attempts and
  avoids that worker; a ``reject(revoked)`` answers the coordinator's revoke (§Placement, stealing).
* A cancelled plan's stream has ended with its terminal event: later ``event`` s are dropped,
  and its ``done`` only frees the lease (and records the attempt's energy).
* A ``done(failed)`` of a plan with retries left queues it again (coordinator/recovery.py).
* A ``done(failed, ticket_refused)`` (a holder refused the ticket for an input: a key it had not learned yet,
  docs/SEMANTICS.md §Graphs) queues the plan again with a fresh ticket, the attempt not counted, as
  ``output_lost`` is; at most :data:`FREE_TICKET_RETRIES` times a plan (its history says how many), then it is
  an ordinary failure (retried up to ``retries``, else the plan fails ``ticket_refused``).
* A ``done`` that does not succeed of a preempted attempt (the coordinator's ``preempt``, or
  ``done.preempted``: its host is being interrupted) queues the plan again, the attempt not
  counted; the plan the preemption made room for is placed on that worker first (coordinator/sharing.py).
* The ``done`` of a lease recovered from its worker at ``hello``
  (coordinator/worker_sessions/registration.py) counts in ``results_recovered_from_worker``.

Depends on the outbox, streams, scheduler, recovery and run timeouts it is handed, and the core's
shared state (coordinator/state.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Final, assert_never

from coordinator import scopes
from coordinator.errors import InvalidTransition
from coordinator.graphs.lineage import DEFAULT_MAX_REBUILDS
from coordinator.plans import RESERVED_KINDS, SMALL_EVENT_BYTES, Plan, advance, done_event
from coordinator.receipts import settle
from coordinator.scheduling import note_attempt
from protocol import errors
from protocol.messages import TERMINAL_STATES, Accept, Done, Error, ErrorInfo, Event, Receipt, Reject
from protocol.tracecontext import trace_id_of

if TYPE_CHECKING:
    from coordinator.carbon_holds import CarbonHolds
    from coordinator.effects import Outbox
    from coordinator.recovery import Recovery
    from coordinator.scheduling import Scheduler
    from coordinator.sessions import Session
    from coordinator.sharing import Sharing
    from coordinator.state import CoreState
    from coordinator.streams import Streams
    from coordinator.timeouts import RunTimeouts

__all__ = ["FREE_TICKET_RETRIES", "Leases"]

FREE_TICKET_RETRIES: Final = DEFAULT_MAX_REBUILDS
"""``ticket_refused`` attempts a plan gets back free: the bound an ``output_lost`` consumer has (its producer is
rebuilt at most that many times), so a holder that never accepts the key cannot keep a plan going round."""


class Leases:
    """Applies a worker's ``accept``, ``reject``, ``event`` and ``done`` to the plan of its lease.

    Args:
        state: the core's shared tables (coordinator/state.py).
        outbox: ``stale_lease`` answers and protocol errors.
        streams: plans' lifecycle events (``running``, ``succeeded``, ...) and the worker's own.
        scheduler: requeues a rejected plan, fills the worker whose lease ended.
        recovery: retries a failed plan with retries left.
        timeouts: starts a running attempt's ``timeout_s`` clock (coordinator/timeouts.py).
        sharing: which attempts were preempted, the ledger's receipts (coordinator/sharing.py); None: none.

    Attributes:
        adopted: leases recovered from their worker at ``hello`` -> attempt: its done counts as a
            recovered result. An entry whose done never comes (the worker died) stays: a few bytes,
            after a store loss only.
        carbon: observes each op's run times; what a plan held for carbon avoided goes in its receipts
            (coordinator/carbon_holds.py; the core sets it). None: neither.
    """

    carbon: CarbonHolds | None = None

    def __init__(
        self,
        state: CoreState,
        *,
        outbox: Outbox,
        streams: Streams,
        scheduler: Scheduler,
        recovery: Recovery,
        timeouts: RunTimeouts | None = None,
        sharing: Sharing | None = None,
    ) -> None:
        self._state = state
        self._sharing = sharing
        self._outbox = outbox
        self._streams = streams
        self._scheduler = scheduler
        self._recovery = recovery
        self._timeouts = timeouts
        self.adopted: dict[str, int] = {}

    def _lease(self, s: Session, worker_id: str, plan_id: str, attempt: int) -> Plan | None:
        """The plan if (plan_id, attempt) is this worker's current lease; otherwise answer stale_lease."""
        if attempt < 1:  # no attempt (an event's default 0) is never a lease: say so, and stop nothing (PROTOCOL.md §4)
            why = f"attempt must be the lease attempt of its assign (1 or more), got {attempt}; send it every time"
            self._outbox.protocol_error(s, errors.INVALID_MESSAGE, f"plan {plan_id!r}: {why}", plan_id=plan_id)
            return None
        state = self._state
        plan = state.plans.get(plan_id)
        registry = state.registry
        if (
            plan is not None
            and plan.attempt == attempt
            and plan.worker_id == worker_id
            and (record := registry.record_of(worker_id)) is not None
            and plan_id in record.leases
        ):
            return plan
        if plan is not None:
            holder = plan.worker_id
            held = holder is not None and holder in registry and plan_id in registry.get(holder).leases
            trespass = scopes.lease_of_another(plan.worker_id, plan.attempt, worker_id, attempt, held=held)
            if trespass is not None:
                self._outbox.forbid(s, f"plan {plan_id!r} {trespass}", "foreign_lease")
                return None
        state.counters["stale_dropped"] += 1
        why = "the coordinator has no such plan" if plan is None else plan.lease_note()
        message = f"plan {plan_id!r} attempt {attempt} is not your lease ({why}); stop running it"
        self._outbox.send(s.conn_id, Error(code=errors.STALE_LEASE, message=message, plan_id=plan_id, attempt=attempt))
        return None

    def accept(self, s: Session, worker_id: str, msg: Accept, now: float, plan: Plan | None = None) -> None:
        """The worker started the lease's attempt: the plan runs. ``plan``: the lease, already checked
        (``Recovery.lease``); None: checked here."""
        if plan is None:
            plan = self._lease(s, worker_id, msg.plan_id, msg.attempt)
        # A repeated accept (running) or one after a cancel (terminal) changes nothing.
        if plan is not None and plan.state == "leased":
            advance(plan, "accept")
            self._state.timings.started(plan, now)
            self._streams.emit(plan, "running", {"worker_id": worker_id, "attempt": plan.attempt}, small=True)
            if self._timeouts is not None and plan.timeout_s is not None:
                self._timeouts.watch(plan, now)

    def reject(self, s: Session, worker_id: str, msg: Reject, now: float) -> None:
        """The worker did not start the lease's attempt (or dropped it, revoked): the plan goes back to the queue."""
        plan = self._lease(s, worker_id, msg.plan_id, msg.attempt)
        if plan is None:
            return
        registry = self._state.registry
        record = registry.get(worker_id)
        revoked = msg.code == errors.REVOKED  # it dropped an unstarted plan we revoked (§Placement, stealing)
        if not plan.terminal:
            try:
                advance(plan, "revoke" if revoked else "reject")
            except InvalidTransition as exc:
                self._outbox.protocol_error(
                    s, exc.code, f"{exc}: a plan cannot be rejected after accept", plan_id=plan.id
                )
                return
            if revoked:
                self._state.counters["plans_revoked"] += 1
                why = f"revoked from worker {worker_id} before it started, to run on an idle worker"
            else:
                plan.avoid = plan.avoid | {worker_id}
                why = f"worker {worker_id} rejected it ({msg.code}" + (f": {msg.reason})" if msg.reason else ")")
            registry.release(worker_id, plan.id)
            plan.free_attempts += 1  # it never ran: not counted against max_attempts (coordinator/recovery.py)
            self._scheduler.requeue(plan, why, now)
        else:
            registry.release(worker_id, plan.id)
        self._scheduler.fill_worker(record, now)

    def event(self, s: Session, worker_id: str, msg: Event, now: float, plan: Plan | None = None) -> None:
        """An event of the lease's attempt goes to the plan's stream. ``plan``: as :meth:`accept`'s."""
        if msg.kind in RESERVED_KINDS:
            self._outbox.protocol_error(
                s,
                errors.INVALID_MESSAGE,
                f"event kind {msg.kind!r} is reserved for the coordinator's lifecycle events; use another kind",
                plan_id=msg.plan_id,
            )
            return
        if plan is None:
            plan = self._lease(s, worker_id, msg.plan_id, msg.attempt)
        # A cancelled plan's stream has ended with its terminal event; later output is dropped.
        if plan is not None and plan.state not in TERMINAL_STATES:  # Plan.terminal, inlined: once per event
            self._state.counters["events_forwarded"] += 1
            self._streams.emit(plan, msg.kind, msg.data, ephemeral=msg.ephemeral)
            if msg.kind == "input_received" and self._timeouts is not None and plan.timeout_s is not None:
                self._timeouts.watch(plan, now)  # the last input in: the handler starts, so does its clock

    def done(self, s: Session, worker_id: str, msg: Done, now: float, plan: Plan | None = None) -> None:
        """The lease's attempt ended: the lease is freed, and the plan ends (or is retried). ``plan``: as
        :meth:`accept`'s."""
        if plan is None and (plan := self._lease(s, worker_id, msg.plan_id, msg.attempt)) is None:
            return
        state = self._state
        registry = state.registry
        record = registry.get(worker_id)
        sharing = self._sharing
        noticed = sharing is not None and plan.id in sharing.stopping_plans  # asked before the release forgets it
        registry.release(worker_id, plan.id)
        if self.adopted and self.adopted.pop(plan.id, None) == msg.attempt and not plan.terminal:
            state.counters["results_recovered_from_worker"] += 1
        if msg.receipt is not None or plan.projected is not None or plan.receipt is not None:  # else nothing to settle
            self._settle_receipt(plan, msg.receipt)
        ended = plan.state in TERMINAL_STATES  # a cancelled plan only waited for this done to free the lease
        if (noticed or msg.preempted) and msg.outcome != "succeeded" and not ended:
            # Preempted (docs/SEMANTICS.md §Preemption): the plan it made room for goes here first, then it
            # is queued again, the attempt not counted. One that succeeded within its grace has simply ended.
            self._scheduler.fill_nominated(record, now)
            why = msg.error.message if msg.error is not None and msg.error.message else "it was preempted"
            self._scheduler.preempted(plan, worker_id, why, now, noticed=noticed)
        elif not ended and msg.outcome == "failed" and (graphs := self._scheduler.graphs) is not None and (
            graphs.output_missing(plan, msg.error)
        ):  # an input it takes from another plan was not found: queued again, not counted; it is made again
            advance(plan, "retry")
            plan.free_attempts += 1
            note_attempt(plan, "failed", f"{errors.OUTPUT_LOST}: {msg.error.message if msg.error else ''}")
            self._scheduler.requeue(plan, f"an input it takes from another plan was lost on worker {worker_id}", now)
        elif not ended and msg.outcome == "failed" and _free_ticket_retry(plan, msg.error):
            # A holder refused the input's ticket: most likely it had not learned the key that signed it yet (a
            # rotation, in cluster mode another core's). Queued again with a fresh ticket, not counted.
            advance(plan, "retry")
            plan.free_attempts += 1
            note_attempt(plan, "failed", f"{errors.TICKET_REFUSED}: {msg.error.message if msg.error else ''}")
            self._scheduler.requeue(plan, f"a worker holding an input refused its ticket (pulled on worker "
                                          f"{worker_id}); placed again with a fresh ticket", now)  # fmt: skip
        elif not ended and msg.outcome == "failed" and plan.retried < plan.retries:
            why = f"worker {worker_id} reported a failure without an error"
            self._recovery.retry(plan, worker_id, msg.error or ErrorInfo(errors.HANDLER_ERROR, why), now)
        elif not ended and not (
            plan.replicas and msg.outcome == "succeeded" and (graphs := self._scheduler.graphs) is not None
            and graphs.replicate(plan, worker_id, msg, now)
        ):  # (a success held for copies of its outputs on other workers ends later: coordinator/plan_graphs.py)
            self.finish(plan, worker_id, msg, now)
        self._scheduler.fill_worker(record, now)

    def finish(self, plan: Plan, worker_id: str, msg: Done, now: float,
               copies: dict[str, list[str]] | None = None) -> None:
        """The plan ends as its worker's ``done`` says; ``copies``: the workers holding each replicated output
        (a success held for its copies, ended by the plan graph: coordinator/plan_graphs.py)."""
        advance(plan, done_event(msg.outcome))
        self._state.timings.finished(plan, msg.outcome, now)
        if msg.outcome == "succeeded" and self.carbon is not None:  # its op's run times (carbon_holds.py)
            self.carbon.ran(plan, now)
        self._ended(plan, worker_id, msg, copies)

    def _settle_receipt(self, plan: Plan, receipt: Receipt | None) -> None:
        """Every attempt's energy counts in the footprint; the plan keeps its last attempt's receipt."""
        if receipt is None and plan.projected is not None:  # the worker measured nothing: the projection stays
            receipt = Receipt(estimated=True, source="none")
        if receipt is not None:
            receipt = settle(receipt, plan.projected)
            assert receipt is not None
            worker_id, registry = plan.worker_id, self._state.registry
            if plan.deferred and self.carbon is not None and worker_id is not None and worker_id in registry:
                zone = registry.get(worker_id).capabilities.carbon_zone  # what its wait avoided
                self.carbon.account(plan, receipt, zone, self._streams.now)
            if plan.traceparent:  # the receipt names the plan's trace (docs/OPERATIONS.md §Tracing)
                receipt.trace_id = trace_id_of(plan.traceparent)
            self._state.footprint.add(plan.owner, plan.op, receipt)
            if self._sharing is not None:
                self._sharing.receipt(plan, receipt)  # the usage ledger's tokens, joules, gCO2e
            plan.receipt = receipt
            if plan.terminal:  # cancelled before this done: its record gets it
                self._state.journal.touched(plan)
        elif plan.receipt is not None and not plan.terminal:
            plan.receipt = None  # an earlier attempt's: this last one measured nothing

    def _ended(self, plan: Plan, worker_id: str, msg: Done, copies: dict[str, list[str]] | None = None) -> None:
        """The plan's terminal event, by the outcome its worker reported."""
        match msg.outcome:
            case "succeeded":
                plan.result = msg.result
                data = {"result": msg.result, "worker_id": worker_id, "attempt": plan.attempt}
                # The result is sized once (the event, listings and retention reuse it); the rest is small.
                size: int | None = SMALL_EVENT_BYTES + plan.result_bytes()
                if copies is not None:  # where the replicated outputs are (coordinator/plan_graphs.py)
                    data["copies"] = copies
                    size = None
                if plan.receipt is not None:
                    data["receipt"] = plan.receipt
                    size = None
                if msg.outputs or plan.outputs:  # where to fetch them: docs/PROTOCOL.md §Data plane
                    plan.produced = msg.outputs
                    data["outputs"] = {o.name: [o.size, o.digest] for o in msg.outputs}
                    size = None
                self._streams.emit(plan, "succeeded", data, size=size)
            case "failed":
                why = f"worker {worker_id} reported a failure without an error"
                self._streams.fail(plan, worker_id, msg.error or ErrorInfo(errors.HANDLER_ERROR, why))
            case "cancelled":
                plan.error = ErrorInfo(errors.CANCELLED, f"cancelled by worker {worker_id}")
                self._streams.emit(plan, "cancelled", {"reason": f"cancelled by worker {worker_id}"}, small=True)
            case _:
                assert_never(msg.outcome)


def _free_ticket_retry(plan: Plan, error: ErrorInfo | None) -> bool:
    """Whether a ``ticket_refused`` failure gets its attempt back: fewer than :data:`FREE_TICKET_RETRIES` before it
    (the plan's stored history counts them, so the bound holds across a restart)."""
    if error is None or error.code != errors.TICKET_REFUSED:
        return False
    prefix = f"{errors.TICKET_REFUSED}:"
    refused = sum(1 for entry in plan.history if str(entry.get("reason", "")).startswith(prefix))
    return refused < FREE_TICKET_RETRIES
