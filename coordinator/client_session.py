"""The client session of the core (docs/SEMANTICS.md §Client session): submit, subscribe, cancel.

Functions of the :class:`~coordinator.core.Coordinator` (passed as ``core``), split out of
coordinator/core.py; the core dispatches every client message to :func:`on_client`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, assert_never

import structlog

from coordinator.placement.placer import hints_problem
from coordinator.plans import (
    EVERY_PRINCIPAL,
    Plan,
    advance,
    submit_problem,
)
from protocol import errors
from protocol.messages import (
    Accepted,
    Cancel,
    DrainWorker,
    Error,
    ErrorInfo,
    GetPlan,
    ListPlans,
    ListWorkers,
    Ok,
    PlanReply,
    Submit,
    Subscribe,
    Subscribed,
    UndrainWorker,
    Unsubscribe,
    Workers,
)

if TYPE_CHECKING:
    from coordinator.core import ClientMessage, Coordinator, _Session

log = structlog.get_logger(__name__)


def on_client(core: Coordinator, s: _Session, msg: ClientMessage, now: float) -> None:
    match msg:
        case Submit():
            submit(core, s, msg, now)
        case Subscribe():
            subscribe(core, s, msg)
        case Unsubscribe():
            unsubscribe(core, s, msg)
        case Cancel():
            cancel(core, s, msg)
        case GetPlan():
            plan = visible_plan(core, s, msg.plan_id, msg.req_id)
            if plan is not None:
                core._send(s.conn_id, PlanReply(req_id=msg.req_id, plan=plan.info()))
        case ListWorkers():
            rows = [core.registry.info(r.id, now) for r in core.registry]
            core._send(s.conn_id, Workers(req_id=msg.req_id, workers=rows, summary=core.registry.summary(now)))
        case ListPlans():
            core.operator.list_plans(s, msg)
        case DrainWorker():
            core.operator.drain(s, msg, now)
        case UndrainWorker():
            core.operator.undrain(s, msg, now)
        case _:
            assert_never(msg)

def submit(core: Coordinator, s: _Session, msg: Submit, now: float) -> None:
    problem = submit_problem(msg) or hints_problem(msg.hints)
    if problem is not None:
        core._send(s.conn_id, Error(code=errors.INVALID_ARGUMENT, message=problem, req_id=msg.req_id))
        return
    if msg.plan_id is not None and msg.plan_id in core.plans:
        existing = core.plans[msg.plan_id]
        if not visible(core, s, existing):
            message = f"plan id {msg.plan_id!r} is already used by another client; choose another"
            core._send(s.conn_id, Error(code=errors.INVALID_ARGUMENT, message=message, req_id=msg.req_id))
            return
        # The retry of a submit whose reply was lost: same plan, and (when asked) its whole stream.
        core._send(
            s.conn_id, Accepted(req_id=msg.req_id, plan_id=existing.id, state=existing.state, duplicate=True)
        )
        if msg.subscribe:
            core.subscriptions.add(existing.id, s.conn_id)
            core._replay(s, existing, 0)
        return
    over_quota = core._quota.refusal(s.principal)
    if over_quota is not None:
        core._refuse_submit(s, msg.req_id, over_quota)
        return
    plan_id = msg.plan_id
    while plan_id is None or plan_id in core.plans:
        plan_id = core._new_id()
    plan = core.plans[plan_id] = Plan.from_submit(msg, plan_id, s.principal, next(core._submit_order))
    core._quota.add(plan.owner, plan_id)
    core.counters["plans_submitted"] += 1
    core.recovery.journal.created(plan, msg)
    core._send(s.conn_id, Accepted(req_id=msg.req_id, plan_id=plan_id, state="queued"))
    # Subscribers go in before the first event so none of them misses seq 1.
    if msg.subscribe:
        core.subscriptions.add(plan_id, s.conn_id)
    for conn_id in core.subscriptions.all_followers(plan.owner):
        core.subscriptions.add(plan_id, conn_id)
    core._emit(plan, "queued", {}, small=True)
    core._enqueue(plan, now)

def subscribe(core: Coordinator, s: _Session, msg: Subscribe) -> None:
    targets: dict[str, Plan] = {}
    for plan_id in msg.plan_ids:
        plan = visible_plan(core, s, plan_id, msg.req_id)
        if plan is None:
            return  # one unknown id and nothing is subscribed
        targets[plan_id] = plan
    if msg.all:
        # An admin session follows every principal's plans (EVERY_PRINCIPAL), now and future.
        core.subscriptions.add_all(EVERY_PRINCIPAL if s.admin else s.principal, s.conn_id)
        targets.update((p.id, p) for p in core.plans.values() if visible(core, s, p))
    core._send(s.conn_id, Subscribed(req_id=msg.req_id, plan_ids=list(targets)))
    for plan in targets.values():
        core.subscriptions.add(plan.id, s.conn_id)
        core._replay(s, plan, msg.from_seq)

def unsubscribe(core: Coordinator, s: _Session, msg: Unsubscribe) -> None:
    if msg.all:
        core.subscriptions.drop(s.conn_id)
    for plan_id in msg.plan_ids:
        core.subscriptions.remove(plan_id, s.conn_id)
    core._send(s.conn_id, Ok(req_id=msg.req_id))

def cancel(core: Coordinator, s: _Session, msg: Cancel) -> None:
    plan = visible_plan(core, s, msg.plan_id, msg.req_id)
    if plan is None:
        return
    if not plan.terminal:
        was = plan.state
        advance(plan, "cancel")
        plan.error = ErrorInfo(errors.CANCELLED, "cancelled by the client")
        plan.waiting_reason = None
        if was == "queued":
            core.queue.discard(plan.id)
        elif plan.worker_id is not None and plan.worker_id in core.registry:
            # The lease stays claimed until the worker's done for this attempt (or its reaping),
            # so the slot is not handed out while the handler may still be stopping.
            conn_id = core.registry.get(plan.worker_id).conn_id
            if conn_id is not None:
                core._send(conn_id, Cancel(plan_id=plan.id, attempt=plan.attempt))
        log.info("plan cancelled", plan_id=plan.id, was=was, worker_id=plan.worker_id)
        core._emit(plan, "cancelled", {"reason": "cancelled by the client"}, small=True)
    core._send(s.conn_id, PlanReply(req_id=msg.req_id, plan=plan.info()))

def visible(core: Coordinator, s: _Session, plan: Plan) -> bool:
    return s.admin or plan.owner == s.principal

def visible_plan(core: Coordinator, s: _Session, plan_id: str, req_id: int) -> Plan | None:
    """The plan if this session may see it; otherwise answer plan_not_found (others' plans do not exist)."""
    plan = core.plans.get(plan_id)
    if plan is not None and visible(core, s, plan):
        return plan
    core._send(
        s.conn_id,
        Error(code=errors.PLAN_NOT_FOUND, message=f"no plan with id {plan_id!r}", req_id=req_id, plan_id=plan_id),
    )
    return None
