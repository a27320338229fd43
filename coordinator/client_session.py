"""The client session of the core (docs/SEMANTICS.md §Client session): submit, subscribe, cancel, look up.

What it owns: the handling of every message a client sends; operator requests are passed on
to coordinator/operator_requests.py.

Rules:

* **Plan ids are scoped per principal** (docs/SEMANTICS.md §Plan ids; coordinator/plans.py
  ``PlanNames``). A client session sees and names its own plans by the ids it submitted; an
  admin session sees every principal's, by key. Another principal's plan does not exist for a
  client: a request naming its id answers as for an id nobody uses (``plan_not_found``, "no
  plan with id ..."), and a submit of that id makes a new plan of the caller's (``accepted``, the
  same frames as for an unused id) under a key of the core's making. Every request resolves
  ``(principal, id)`` through the names first (one truth test while none is aliased).
* A submit with a plan id the principal already uses is the retry of a submit whose reply
  was lost: answered ``accepted(duplicate=True)``, and with ``subscribe`` its whole stream.
* A new plan over the principal's plan limit, or past its team's ``max_queued``, is refused
  (``too_many_plans``) and nothing changes.
* ``get_usage`` answers the usage ledger's totals (coordinator/sharing.py): an admin's, everyone's;
  a client's, its own.
* A submit marked ``recovered`` (the SDK re-sending an accepted plan this coordinator no longer
  knows) is a new plan like any other, logged and counted (``plans_recovered_from_client``).
* **Reading never changes a plan.** A ``subscribe`` (whatever its ``from_seq``), ``get_plan`` or
  listing leaves every plan's numbering as it was: ``subscribed.last_seqs`` tells the subscriber
  where each named plan's stream ends, so one that saw events a store loss took (its ``from_seq``
  past that end) takes the next events as new ones (fleetwire/session.py). A ``from_seq`` past
  the end gives live events only, with no replay.
* Subscribers of a new plan (the submitter, followers of all its owner's plans) are added
  before its first event, so none of them misses seq 1. One unknown id in a ``subscribe``
  subscribes to nothing.

Depends on the collaborators it is handed: the outbox, streams, scheduler and operator
requests, with the core's shared tables they act on (coordinator/state.py: plans and their names, the
registry, subscriptions, the plan quota, the journal and the counters).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, assert_never

import msgspec
import structlog

from coordinator.data_plane import data_problem
from coordinator.placement.placer import hints_problem
from coordinator.plans import EVERY_PRINCIPAL, Plan, advance, held_size, submit_problem
from protocol import errors
from protocol.messages import (
    COPY_OP,
    Accepted,
    Cancel,
    DataChunk,
    DataCredit,
    DataEnd,
    DataGrant,
    DataOpen,
    DataTicket,
    DrainWorker,
    Error,
    ErrorInfo,
    FromClient,
    GetPlan,
    GetUsage,
    ListPlans,
    ListWorkers,
    Ok,
    PlanReply,
    ReleaseDevice,
    ReleasePlan,
    RemoveWorker,
    Submit,
    Subscribe,
    Subscribed,
    UndrainWorker,
    Unsubscribe,
    Workers,
)

if TYPE_CHECKING:
    from coordinator.carbon_holds import CarbonHolds
    from coordinator.data_plane import DataPlane
    from coordinator.effects import Outbox
    from coordinator.operator_requests import OperatorRequests
    from coordinator.relay import Relay
    from coordinator.scheduling import Scheduler
    from coordinator.sessions import Session
    from coordinator.sharing import Sharing
    from coordinator.state import CoreState
    from coordinator.streams import Streams

__all__ = ["ClientSessions"]

log = structlog.get_logger(__name__)


class ClientSessions:
    """Handles client sessions' messages.

    Args:
        state: the core's shared tables (coordinator/state.py): plans and their names, the registry
            (``list_workers``; a cancelled plan's worker is told), subscriptions, the plan quota,
            the journal (a new plan's record) and the counters.
        outbox: replies and refusals.
        streams: plans' events, and their replay to a new subscriber.
        scheduler: places a new plan and numbers it.
        operator: answers ``list_plans``, ``drain_worker``, ``undrain_worker`` and ``remove_worker``.
        new_id: makes a plan id when the client gives none, or a key when another plan holds the one it gave.
        data: answers ``data_ticket`` (coordinator/data_plane.py); None: refused.
        relay: carries ``data_open``/``data_chunk``/``data_credit``/``data_end`` (coordinator/relay.py); None: ignored.
        version: the coordinator's version, said in ``workers`` answers (``fleetwire status``).
        sharing: teams' ``max_queued`` at submit, ``get_usage`` (coordinator/sharing.py); None: neither.

    Attributes:
        carbon: holds plans with a deadline for a greener hour, answers ``release_plan`` (coordinator/carbon_holds.py;
            the core sets it); None: a deadline is refused.
    """

    carbon: CarbonHolds | None = None

    def __init__(
        self,
        state: CoreState,
        *,
        outbox: Outbox,
        streams: Streams,
        scheduler: Scheduler,
        operator: OperatorRequests,
        new_id: Callable[[], str],
        data: DataPlane | None = None,
        relay: Relay | None = None,
        version: str = "",
        sharing: Sharing | None = None,
    ) -> None:
        self._state = state
        self._sharing = sharing
        self._outbox = outbox
        self._streams = streams
        self._scheduler = scheduler
        self._operator = operator
        self._new_id = new_id
        self._data = data
        self._relay = relay
        self._version = version  # the coordinator's, in ``workers`` answers

    def on_message(self, s: Session, msg: FromClient, now: float) -> None:
        """One message from a client session."""
        match msg:
            case Submit():
                self._submit(s, msg, now)
            case Subscribe():
                self._subscribe(s, msg)
            case Unsubscribe():
                self._unsubscribe(s, msg)
            case Cancel():
                self._cancel(s, msg)
            case GetPlan():
                plan = self._visible_plan(s, msg.plan_id, msg.req_id)
                if plan is not None:
                    self._outbox.send(s.conn_id, PlanReply(req_id=msg.req_id, plan=plan.info(s.admin)))
            case ListWorkers():
                self._list_workers(s, msg, now)
            case ListPlans():
                self._operator.list_plans(s, msg)
            case GetUsage():
                if self._sharing is not None:  # an admin sees everyone's usage, a client its own
                    self._outbox.send(s.conn_id, self._sharing.usage(msg, s.principal, s.admin))
            case DrainWorker():
                self._operator.drain(s, msg, now)
            case UndrainWorker():
                self._operator.undrain(s, msg, now)
            case RemoveWorker():
                self._operator.remove(s, msg, now)
            case ReleaseDevice():
                self._operator.release_device(s, msg)
            case ReleasePlan():
                self._release(s, msg, now)
            case DataTicket():
                plan = self._visible_plan(s, msg.plan_id, msg.req_id)
                if plan is not None and self._data is not None:
                    source: Plan | None = plan
                    if msg.output and msg.direction == "get" and plan.state == "succeeded":
                        source = self._lineage_source(s, msg, plan, now)  # a rebuild's grant names the rebuild
                    if source is not None:
                        shown = msg.plan_id if source is plan else None
                        self._data.answer(s.conn_id, source, msg.direction, msg.req_id, now, shown=shown)
            case DataOpen():
                if self._relay is not None:
                    self._relay.open(s, msg, self._find(s, msg.plan_id), now)
            case DataChunk() | DataCredit() | DataEnd():
                if self._relay is not None:
                    keys = self._state.names.keys
                    if keys and not s.admin:  # the relay knows streams by the plan's key
                        key = keys.get((s.principal, msg.plan_id))
                        if key is not None:
                            msg = msgspec.structs.replace(msg, plan_id=key)
                    self._relay.on_data(s.conn_id, msg)
            case _:
                assert_never(msg)

    # ------------------------------------------------------------------ handlers

    def _list_workers(self, s: Session, msg: ListWorkers, now: float) -> None:
        # Its own function: the comprehension's variables would be cells made at every on_message call.
        registry = self._state.registry
        rows = [registry.info(r.id, now) for r in registry]
        self._outbox.send(s.conn_id, Workers(req_id=msg.req_id, workers=rows, summary=registry.summary(now),
                                             version=self._version))  # fmt: skip

    def _submit(self, s: Session, msg: Submit, now: float) -> None:
        problem = submit_problem(msg) or hints_problem(msg.hints)
        if problem is None and (msg.inputs or msg.outputs or msg.replicas or msg.op == COPY_OP):
            problem = data_problem(msg)
        if problem is not None:
            self._outbox.send(s.conn_id, Error(code=errors.INVALID_ARGUMENT, message=problem, req_id=msg.req_id))
            return
        state = self._state
        plans, subscriptions = state.plans, state.subscriptions
        name = msg.plan_id
        # Usually a new id: no plan holds it as a key and none is known by another name (no _own call).
        if name is not None and (state.names.keys or name in plans):
            existing = self._own(s.principal, name)
            if existing is not None:
                # The retry of a submit whose reply was lost: same plan, and (when asked) its whole stream.
                self._outbox.send(s.conn_id, Accepted(req_id=msg.req_id, plan_id=existing.shown_id(s.admin),
                                                      state=existing.state, duplicate=True))  # fmt: skip
                if msg.subscribe:
                    subscriptions.add(existing.id, s.conn_id)
                    self._streams.replay(s.conn_id, existing, 0)
                return
        graphs = self._scheduler.graphs
        if graphs is not None and (msg.after or (msg.inputs and any(spec.ref is not None for spec in msg.inputs))):
            msg, problem = graphs.resolve(msg, s.principal, functools.partial(self._find, s))  # ids -> keys
            if problem is not None:
                self._outbox.send(s.conn_id, Error(code=errors.INVALID_ARGUMENT, message=problem, req_id=msg.req_id))
                return
        quota = state.quota
        plan = Plan.from_submit(msg, "", s.principal, 0)
        if plan.deadline_at is not None or msg.deadline_s is not None:  # made absolute, recorded so (carbon_holds.py)
            msg, problem = self.carbon.admit(plan, msg, now) if self.carbon else (msg, "deadlines are not served here")
            if problem is not None:
                self._outbox.send(s.conn_id, Error(code=errors.INVALID_ARGUMENT, message=problem, req_id=msg.req_id))
                return
        size = held_size(plan) if quota.max_bytes else 0
        over_quota = quota.refusal(s.principal, size)
        if over_quota is None and self._sharing is not None and self._sharing.queued_quotas:  # its team's max_queued
            over_quota = self._sharing.submit_refusal(s.principal)
        if over_quota is not None:
            self._outbox.refuse_submit(s, msg.req_id, over_quota)
            return
        plan_id = name
        while plan_id is None or plan_id in plans:
            plan_id = self._new_id()
        plan.id, plan.order = plan_id, next(self._scheduler.orders)
        if plan_id != name and name is not None:  # another plan holds that key: its owner knows it by its name
            plan.name = name
            state.names.keys[plan.owner, name] = plan_id
        plans[plan_id] = plan
        quota.add(plan.owner, plan_id, size)
        state.counters["plans_submitted"] += 1
        if msg.recovered:  # rare: the SDK re-sent an accepted plan this coordinator lost (a store loss)
            state.counters["plans_recovered_from_client"] += 1
            log.warning("plan recovered from its client: the store had lost it", plan_id=plan_id, owner=plan.owner)
        state.journal.created(plan, msg)
        shown = plan_id if s.admin or plan.name is None else plan.name  # plan.shown_id, inlined
        self._outbox.send(s.conn_id, Accepted(req_id=msg.req_id, plan_id=shown, state="queued"))
        # Subscribers go in before the first event so none of them misses seq 1.
        if msg.subscribe:
            subscriptions.add(plan_id, s.conn_id)
        for conn_id in subscriptions.all_followers(plan.owner):
            subscriptions.add(plan_id, conn_id)
        self._streams.emit(plan, "queued", {}, small=True)
        if plan.deadline_at is not None and self.carbon is not None and self.carbon.hold(plan, now):
            return  # held for a greener hour, out of the queue (coordinator/carbon_holds.py)
        self._scheduler.enqueue(plan, now)

    def _subscribe(self, s: Session, msg: Subscribe) -> None:
        targets: dict[str, Plan] = {}
        for plan_id in msg.plan_ids:
            plan = self._visible_plan(s, plan_id, msg.req_id)
            if plan is None:
                return  # one unknown id and nothing is subscribed
            targets[plan_id] = plan
        if msg.all:
            plans = self._state.plans
            # An admin session follows every principal's plans (EVERY_PRINCIPAL), now and future.
            self._state.subscriptions.add_all(EVERY_PRINCIPAL if s.admin else s.principal, s.conn_id)
            if s.admin:
                targets.update((p.id, p) for p in plans.values())
            else:
                principal = s.principal
                targets.update((p.name or p.id, p) for p in plans.values() if p.owner == principal)
            self._outbox.charge(len(plans))  # rows scanned (coordinator/limits.py §Cost per principal)
        # Each named plan's stream end: a subscriber past it learns that this stream is behind the one it
        # saw (a store loss) and takes the next events as new. Nothing here moves a plan's numbering.
        last_seqs = {plan_id: targets[plan_id].next_seq - 1 for plan_id in msg.plan_ids}
        self._outbox.send(s.conn_id, Subscribed(req_id=msg.req_id, plan_ids=list(targets), last_seqs=last_seqs))
        # Followed and replayed plan by plan; a large replay goes out in slices (Streams.pump).
        self._streams.subscribe_replay(s.conn_id, targets.values(), msg.from_seq)

    def _unsubscribe(self, s: Session, msg: Unsubscribe) -> None:
        if msg.all:
            self._state.subscriptions.drop(s.conn_id)
            self._streams.drop_replays(s.conn_id)
        keys = [plan.id for plan in map(functools.partial(self._find, s), msg.plan_ids) if plan is not None]
        for key in keys:
            self._state.subscriptions.remove(key, s.conn_id)
        if keys:
            self._streams.drop_replays(s.conn_id, keys)
        self._outbox.send(s.conn_id, Ok(req_id=msg.req_id))

    def _cancel(self, s: Session, msg: Cancel) -> None:
        plan = self._visible_plan(s, msg.plan_id, msg.req_id)
        if plan is None:
            return
        graphs = self._scheduler.graphs
        if msg.with_dependants and graphs is not None and not plan.terminal:
            together = [plan, *graphs.dependants(plan)]  # cancelled, not failed upstream_failed (plan_graphs.py)
            with graphs.ending_together(together):
                for dependant in together[1:]:
                    self._stop(dependant, dependant.id, "cancelled with a plan it needs")
                self._stop(plan, msg.plan_id, "cancelled by the client")
        else:
            self._stop(plan, msg.plan_id, "cancelled by the client")
        self._outbox.send(s.conn_id, PlanReply(req_id=msg.req_id, plan=plan.info(s.admin)))

    def _stop(self, plan: Plan, shown: str, why: str) -> None:
        """Cancel an unfinished plan (a finished one is left as it is); ``shown``: the id the session named."""
        if not plan.terminal:
            was = plan.state
            advance(plan, "cancel")
            plan.error = ErrorInfo(errors.CANCELLED, why)
            plan.waiting_reason = None
            registry = self._state.registry
            if was == "queued":
                self._scheduler.dequeue(plan)
                if plan.deadline_at is not None and self.carbon is not None:  # held for carbon: its slots freed
                    self.carbon.forget(plan, self._streams.now)
            elif plan.worker_id is not None and plan.worker_id in registry:
                # The lease stays claimed until the worker's done for this attempt (or its reaping),
                # so the slot is not handed out while the handler may still be stopping.
                conn_id = registry.get(plan.worker_id).conn_id
                if conn_id is not None:
                    self._outbox.send(conn_id, Cancel(plan_id=plan.id, attempt=plan.attempt))
            log.info("plan cancelled", plan_id=plan.id, was=was, worker_id=plan.worker_id)
            self._streams.emit(plan, "cancelled", {"reason": why}, small=True)
            if plan.id != shown and self._relay is not None:  # the core tells the relay of msg.plan_id only
                self._relay.plan_moved(plan.id)  # its put streams end at once, as any cancelled plan's

    def _release(self, s: Session, msg: ReleasePlan, now: float) -> None:
        """``release_plan``: a plan held for carbon is placed now (its owner, or an admin); answered with its record."""
        plan = self._visible_plan(s, msg.plan_id, msg.req_id)
        if plan is None:
            return
        if plan.state == "queued" and self.carbon is not None and self.carbon.release(plan, now):
            log.info("plan released from its carbon hold", plan_id=plan.id, by=s.principal)
        self._outbox.send(s.conn_id, PlanReply(req_id=msg.req_id, plan=plan.info(s.admin)))

    # ------------------------------------------------------------------ plan ids (docs/SEMANTICS.md §Plan ids)

    def _own(self, principal: str, name: str) -> Plan | None:
        """``principal``'s plan it submitted as ``name``, or None."""
        plans, aliases = self._state.plans, self._state.names.keys
        if aliases:  # only once some plan id was taken
            key = aliases.get((principal, name))
            if key is not None:
                return plans.get(key)
        plan = plans.get(name)
        # Its key is ``name``, and so is its name (not a plan of the same owner known by another one).
        if plan is not None and plan.owner == principal and plan.name is None:
            return plan
        return None

    def _find(self, s: Session, plan_id: str) -> Plan | None:
        """The plan ``plan_id`` names for this session (an admin's: the key), or None."""
        return self._state.plans.get(plan_id) if s.admin else self._own(s.principal, plan_id)

    def _lineage_source(self, s: Session, msg: DataTicket, plan: Plan, now: float) -> Plan | None:
        """The plan holding a copy of ``msg.output`` of succeeded ``plan`` (itself, or a rebuild of it); None when
        answered here: a rebuild is making it again (a grant naming it, without a ticket), or it is lost for good
        (``output_lost``). docs/SEMANTICS.md §Graphs, coordinator/plan_graphs.py ``output_source``."""
        graphs = self._scheduler.graphs
        if graphs is None or not any(spec.name == msg.output for spec in plan.produced):
            return plan
        failed = self._find(s, msg.lost) if msg.lost else None
        source = graphs.output_source(plan, msg.output, failed.id if failed is not None else "", now)
        if isinstance(source, Plan):
            return source
        if isinstance(source, str):
            self._outbox.send(s.conn_id, DataGrant(
                req_id=msg.req_id, plan_id=msg.plan_id, attempt=plan.attempt, worker_id="", url="", ticket="",
                rebuilding=graphs.name_of(source)))  # fmt: skip
            return None
        self._outbox.send(s.conn_id, Error(code=source.code, message=source.message, req_id=msg.req_id,
                                           plan_id=msg.plan_id))  # fmt: skip
        return None

    def _visible_plan(self, s: Session, plan_id: str, req_id: int) -> Plan | None:
        """The plan ``plan_id`` names for this session; otherwise answer plan_not_found.

        Another principal's plan does not exist for a client session: the same code, words and
        fields as an id nobody uses, so no answer tells the two apart (no existence oracle).
        """
        plan = self._state.plans.get(plan_id) if s.admin else self._own(s.principal, plan_id)
        if plan is not None:
            return plan
        message = f"no plan with id {plan_id!r}"
        self._outbox.send(s.conn_id, Error(code=errors.PLAN_NOT_FOUND, message=message, req_id=req_id, plan_id=plan_id))
        return None
