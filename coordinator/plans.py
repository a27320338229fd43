"""Plans: their record, their event stream and the one table their states move through.

Rules (docs/SEMANTICS.md §Plan lifecycle and events):

* A plan is ``queued`` when submitted. Placement ``assign``s it to a worker (``leased``);
  the worker's ``accept`` makes it ``running``; its ``done`` ends it with the worker's
  outcome. ``succeeded``, ``failed`` and ``cancelled`` are terminal: no event leaves them.
* A ``reject`` (or, later, a ``revoke``) of a leased plan puts it back to ``queued``.
* A lost worker's leased or running plan goes back to ``queued`` (``worker_lost``), or
  to ``failed`` once it has used its last attempt (``worker_lost.final``).
* A client ``cancel`` ends a queued, leased or running plan at once.
* A preempted attempt (``preempt``: stopped for another team's plan, or its host was interrupted)
  puts a leased or running plan back to ``queued``; the attempt does not count (coordinator/sharing.py).

Theory of operation. The table below is the whole state machine: :func:`advance` looks
up ``(state, event)`` and either moves the plan or raises
:class:`~coordinator.errors.InvalidTransition` naming both, leaving the plan untouched.
The worker's ``done`` is three events, ``done.<outcome>``, so that every key has exactly
one destination and the table stays data. The core decides *which* event applies
(e.g. whether a loss is final); this module only checks that the move is legal.

Attempts fence leases. A new plan has attempt 0 and every ``assign`` increments it, so
the first lease is attempt 1; a message naming an older attempt is stale.

Events. Every plan has one stream whose ``seq`` the coordinator stamps 1, 2, 3, ...
The stream is held in memory, bounded by ``max_events`` and ``max_bytes`` per plan (the
bytes are :func:`event_bytes`' estimate of the payloads): past either bound the oldest
ephemeral events go first, then the oldest durable ones (never the newest). Dropped durable
events stay in the store; a replay that needs them gets a ``resync`` (coordinator/recovery.py).
A finished plan keeps only its durable events (:meth:`Plan.drop_ephemeral`, at its end): the
ephemeral ones (tokens, progress) served the live stream, and a late replay gets a ``resync``
in their place. :meth:`Plan.retained_bytes` is what a finished plan is counted as by the
retention's byte bound (coordinator/retention.py).

Plan ids are scoped per principal (docs/SEMANTICS.md §Plan ids). A plan has a *key*
(:attr:`Plan.id`: the core's plans dict, store rows, worker messages, tickets) and a *name*, the
id its owner submitted. The key is the name unless a plan already holds that key (another
principal's, or one of the same owner's under a generated key); then the plan gets a fresh
key, keeps the name in :attr:`Plan.name` and :class:`PlanNames` maps ``(owner, name)`` to the
key. A client session sees and addresses its plans by name; an admin session, every plan by key.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final, Literal

import msgspec

from coordinator.devices import GpuNeed, resources_problem
from coordinator.errors import InvalidTransition
from protocol.caps import MAX_OP_BYTES, MAX_PLAN_ID_BYTES, MAX_TAG_BYTES, MAX_TAGS, tags_problem, too_long
from protocol.messages import (
    ErrorInfo,
    Event,
    InputSpec,
    Outcome,
    OutputSpec,
    PlanInfo,
    PlanStateName,
    Receipt,
    Requirements,
    Resources,
    RoutingHints,
    Submit,
)
from protocol.tracecontext import UNSAMPLED, UNSAMPLED_SHORT, is_sampled, trace_id_of, traceparent_problem

__all__ = [
    "EVERY_PRINCIPAL",
    "PLAN_OVERHEAD_BYTES",
    "RESERVED_KINDS",
    "TRANSITIONS",
    "OwnerTally",
    "Plan",
    "PlanEventName",
    "PlanNames",
    "Subscriptions",
    "advance",
    "deadline_problem",
    "done_event",
    "held_size",
    "submit_problem",
]

PlanEventName = Literal[
    "assign",
    "accept",
    "reject",
    "revoke",
    "cancel",
    "done.succeeded",
    "done.failed",
    "done.cancelled",
    "worker_lost",
    "worker_lost.final",
    "retry",
    "handback",
    "preempt",
    "timeout",
    "doom",
]

_LIVE: Final = ("leased", "running")

# THE transition table: (state, event) -> new state. Anything absent is illegal.
TRANSITIONS: Final[dict[tuple[PlanStateName, PlanEventName], PlanStateName]] = {
    ("queued", "assign"): "leased",
    ("queued", "cancel"): "cancelled",
    ("leased", "accept"): "running",
    ("leased", "reject"): "queued",
    ("leased", "revoke"): "queued",
    **{(state, "done.succeeded"): "succeeded" for state in _LIVE},
    **{(state, "done.failed"): "failed" for state in _LIVE},
    **{(state, "done.cancelled"): "cancelled" for state in _LIVE},
    **{(state, "worker_lost"): "queued" for state in _LIVE},
    **{(state, "worker_lost.final"): "failed" for state in _LIVE},
    **{(state, "cancel"): "cancelled" for state in _LIVE},
    # A failed attempt of a plan that asked for retries, and a plan its worker handed back
    # when it left (goodbye): both queued again without counting against max_attempts.
    **{(state, "retry"): "queued" for state in _LIVE},
    **{(state, "handback"): "queued" for state in _LIVE},
    # A preempted attempt (docs/SEMANTICS.md §Preemption): stopped for another team's plan, or its host
    # was interrupted; queued again without counting against max_attempts.
    **{(state, "preempt"): "queued" for state in _LIVE},
    # The coordinator's own timeout_s backstop: the worker never reported the attempt ended
    # (coordinator/timeouts.py). Only a running attempt has a clock.
    ("running", "timeout"): "failed",
    # A plan graph's consumer that cannot run: a plan it needs did not succeed, or an output it needs is lost
    # and cannot be made again (coordinator/plan_graphs.py). It never ran: it fails from the queue.
    ("queued", "doom"): "failed",
}

# The ``all`` subscription key of admin sessions: they follow every principal's plans.
# The NUL byte keeps it apart from any principal a token can name.
EVERY_PRINCIPAL: Final = "\x00*"

# Lifecycle kinds the coordinator stamps itself; a worker event using one is refused.
RESERVED_KINDS: Final = frozenset(
    {"queued", "waiting", "leased", "running", "requeued", "succeeded", "failed", "cancelled", "data_ready",
     "preempted"}
)

_DONE_EVENTS: Final[dict[Outcome, PlanEventName]] = {
    "succeeded": "done.succeeded",
    "failed": "done.failed",
    "cancelled": "done.cancelled",
}


done_event: Final[Callable[[Outcome], PlanEventName]] = _DONE_EVENTS.__getitem__
"""The table event for a worker's ``done`` with ``outcome`` (the dict's own lookup: no Python frame per plan)."""


@dataclass(eq=False, slots=True, init=False)
class Plan:
    """One plan, from submit to its terminal state.

    Attributes:
        id: its key: the client-chosen idempotency key, or generated (none given, or another plan held it).
        op: the handler name a worker must list in its capabilities.
        args: any msgpack value, passed to the handler untouched.
        requirements: what a worker must have.
        priority: higher is placed first.
        timeout_s: handed to the worker in ``assign``; None for no limit.
        max_attempts: leases a plan may lose to dead workers before it fails.
        owner: the principal of the client that submitted it.
        order: submit order number; the queue's age tie-break (older first).
        state: where it is in the table.
        attempt: the current (or last) lease number; 0 before the first assign.
        worker_id: the worker of the current (or last) lease.
        result: the handler's result once succeeded.
        error: why it failed.
        events: the held part of its stream, in seq order.
        next_seq: the seq the next event gets.
        waiting_reason: why it cannot be placed now, while queued.
        avoid: workers that rejected it; it is not offered to them again.
        queued_at_s: monotonic time it last entered the queue (submit or requeue).
        started_at_s: monotonic time its current attempt was accepted; None until then.
        hints: how it would like to be placed (policy, session key, prefix hashes, tokens).
        retries: handler failures it may retry (``submit.retries``).
        retried: retries used so far.
        free_attempts: attempts that do not count against ``max_attempts`` (retries, hand-backs).
        history: one entry per attempt that ended without ending the plan (lost, failed, handed back).
        worker_seq: (attempt, the worker's highest message seq applied): re-sent messages are dropped.
        held_bytes: :func:`event_bytes` of the held events.
        ephemeral_held: whether an ephemeral event was held since the last :meth:`drop_ephemeral`.
        ended_at: wall-clock seconds (Unix time) when it reached its terminal state; None before.
            Stored with its status, so its retention survives restarts (coordinator/retention.py).
        name: the id its owner submitted, when that is not ``id`` (a plan held that key: module
            docstring); None when its name is its key, as nearly always.
    """

    id: str
    op: str
    args: Any
    requirements: Requirements
    priority: int
    timeout_s: float | None
    max_attempts: int
    owner: str
    order: int
    state: PlanStateName
    attempt: int
    worker_id: str | None
    result: Any
    error: ErrorInfo | None
    events: list[Event]
    next_seq: int
    waiting_reason: str | None
    avoid: frozenset[str]
    queued_at_s: float
    started_at_s: float | None
    hints: RoutingHints
    retries: int
    retried: int
    free_attempts: int
    history: list[dict[str, Any]]
    worker_seq: tuple[int, int]
    held_bytes: int
    ephemeral_held: bool  # an ephemeral event was held since its last drop_ephemeral (else its end skips the scan)
    ended_at: float | None
    inputs: list[InputSpec]  # uploaded to its worker (coordinator/data_plane.py)
    outputs: list[str]  # output names the client declared
    produced: list[OutputSpec]  # outputs its last attempt left on its worker
    result_size: int  # event_bytes(result), once known (a finished plan's; -1: not sized yet)
    resources: Resources | None  # its device request, as submitted (None: none)
    gpus: GpuNeed | None  # the devices it holds while leased (coordinator/devices.py)
    projected: tuple[float, float] | None  # (J, gCO2e) placement projected at its last assign
    receipt: Receipt | None  # a finished plan's energy and carbon, measured and projected
    seq_recorded: int  # next_seq as far as the store has it reserved (unrecorded events: coordinator/streams.py)
    tally: OwnerTally | None  # its owner's counts by state, once a listing indexed it (operator_requests.py)
    name: str | None  # its owner's id for it when that is not its key (PlanNames); None: the key
    traceparent: str  # its caller's W3C trace context, from its submit ("": none; protocol/tracecontext.py)
    sampled: bool  # its caller sampled its trace: the one test a traced step makes (streams.py note)
    preemptible: bool  # it may be stopped and requeued for another team's plan (coordinator/sharing.py)
    after: list[str]  # keys of plans that must succeed first (coordinator/plan_graphs.py)
    deterministic: bool  # running it again gives the same outputs: a lost one may be made again
    graphed: bool  # it has references or ``after``: the graph decides when it is queued
    rebuild_of: str | None  # the key of the plan whose lost outputs it makes again (None: not a rebuild)
    replicas: dict[str, int]  # copies wanted of outputs, by name (submit.replicas)
    replicating: bool  # its success is held until copies of its outputs exist (coordinator/plan_graphs.py)
    # Carbon time shifting (coordinator/carbon_holds.py): by when it must finish (Unix seconds; None: no deadline,
    # placed at once), how long it runs (0: its op's median), its submit time (Unix), whether it was ever held.
    deadline_at: float | None
    expected_run_s: float
    submitted_at: float | None
    deferred: bool
    deferred_until: float | None  # held now: the start its hold waits for (Unix); None: not held

    def __init__(
        self,
        id: str,
        op: str,
        args: Any,
        requirements: Requirements,
        priority: int,
        timeout_s: float | None,
        max_attempts: int,
        owner: str,
        order: int,
        hints: RoutingHints | None = None,
    ) -> None:
        """A queued plan with these fields; every other field gets its default (each plan its own lists, dict and
        hints: ``hints`` None is a new empty one). What a submit sets beyond these, :meth:`from_submit` assigns.
        Written out rather than made by ``dataclass``: compiled (setup.py), this ``__init__`` is native, where the
        generated one runs interpreted, one call per plan with every field (issue #29)."""
        self.id = id
        self.op = op
        self.args = args
        self.requirements = requirements
        self.priority = priority
        self.timeout_s = timeout_s
        self.max_attempts = max_attempts
        self.owner = owner
        self.order = order
        self.state = "queued"
        self.attempt = 0
        self.worker_id = None
        self.result = None
        self.error = None
        self.events = []
        self.next_seq = 1
        self.waiting_reason = None
        self.avoid = frozenset()
        self.queued_at_s = 0.0
        self.started_at_s = None
        self.hints = RoutingHints() if hints is None else hints
        self.retries = 0
        self.retried = 0
        self.free_attempts = 0
        self.history = []
        self.worker_seq = (0, 0)
        self.held_bytes = 0
        self.ephemeral_held = False
        self.ended_at = None
        self.inputs = []
        self.outputs = []
        self.produced = []
        self.result_size = -1
        self.resources = None
        self.gpus = None
        self.projected = None
        self.receipt = None
        self.seq_recorded = 0
        self.tally = None
        self.name = None
        self.traceparent = ""
        self.sampled = False
        self.preemptible = False
        self.after = []
        self.deterministic = True
        self.graphed = False
        self.rebuild_of = None
        self.replicas = {}
        self.replicating = False
        self.deadline_at = None
        self.expected_run_s = 0.0
        self.submitted_at = None
        self.deferred = False
        self.deferred_until = None

    @classmethod
    def from_submit(cls, msg: Submit, plan_id: str, owner: str, order: int) -> Plan:
        """A new queued plan from a validated ``submit``."""
        # not ``cls``: compiled, a call of the class itself is a native call
        plan = Plan(plan_id, msg.op, msg.args, msg.requirements, msg.priority, msg.timeout_s, msg.max_attempts, owner,
                    order, msg.hints)  # fmt: skip
        plan.retries = msg.retries
        traceparent = msg.traceparent
        if traceparent:
            # The caller's "no" ("00", or "0": docs/PROTOCOL.md §4 submit), 99 plans in 100 at 1 %, is told apart
            # first and stays unsampled with no call (is_sampled is a Python call a plan in the interpreted core);
            # the plan holds one form: scheduling.py forwards it as each worker reads it.
            if traceparent == UNSAMPLED_SHORT or traceparent == UNSAMPLED:
                plan.traceparent = UNSAMPLED
            else:
                plan.traceparent = traceparent
                plan.sampled = is_sampled(traceparent)
        plan.inputs = msg.inputs
        plan.outputs = msg.outputs
        resources = msg.resources
        if resources is not None:
            plan.resources = resources
            plan.gpus = GpuNeed.of(resources)
        plan.preemptible = msg.preemptible
        plan.after = msg.after
        plan.deterministic = msg.deterministic
        plan.graphed = bool(msg.after) or (bool(msg.inputs) and any(spec.ref is not None for spec in msg.inputs))
        plan.deadline_at = msg.deadline_at  # deadline_s is made absolute at submit (coordinator/carbon_holds.py)
        plan.expected_run_s = msg.expected_run_s or 0.0
        plan.replicas = msg.replicas
        return plan

    @property
    def terminal(self) -> bool:
        """Whether the plan reached a final state."""
        return self.state in ("succeeded", "failed", "cancelled")

    def lease_note(self) -> str:
        """Where the plan's lease is now, for the message that refuses a stale one."""
        if self.terminal:
            return f"it already ended {self.state}"
        if self.replicating:
            return f"its attempt {self.attempt} succeeded; it waits for copies of its outputs on other workers"
        if self.state == "queued" or self.worker_id is None:
            return f"it is queued again after attempt {self.attempt}"
        return f"its lease is attempt {self.attempt} on worker {self.worker_id}"

    def append_event(
        self,
        kind: str,
        data: Any,
        attempt: int,
        ephemeral: bool,
        max_events: int,
        max_bytes: int = 0,
        size: int | None = None,
    ) -> Event:
        """Stamp the next ``seq`` on an event, hold it, and return it.

        Past ``max_events`` events or ``max_bytes`` held bytes (0: no byte bound) the held
        stream is compacted (see :meth:`compact`). ``size``: the payload's size when the
        caller knows it is small (the core's own lifecycle events), else :func:`event_bytes`.
        Streams.emit does the same inline (once per event).
        """
        event = Event(self.id, kind, data, self.next_seq, attempt, ephemeral)  # positional: Event's field order
        self.next_seq += 1
        self.events.append(event)
        self.held_bytes += event_bytes(data) if size is None else size
        if len(self.events) > max_events or (max_bytes and self.held_bytes > max_bytes):
            self.compact(max_events, max_bytes)
        if ephemeral:
            self.ephemeral_held = True
        return event

    def drop_superseded(self, kind: str, size: int) -> None:
        """Forget the newest held event if it is of ``kind`` (counted as ``size`` bytes): the caller is about
        to append a newer one that supersedes it (a ``waiting`` reason). Without it a queued plan whose
        reason flips at every worker (dis)connect held one event per flip (issue 17 finding 5). A
        replay from before it gets a ``resync`` for its seq, as after compaction."""
        events = self.events
        if events and events[-1].kind == kind:
            events.pop()
            self.held_bytes -= size

    def compact(self, max_events: int, max_bytes: int = 0) -> None:
        """Shrink the held stream under both bounds, oldest ephemeral events first.

        It drops a tenth more than needed so that a stream of tokens at the bound pays
        for one compaction per tenth of the bound, not one per event. The newest event is
        always kept, whatever its size.
        """
        sizes = [event_bytes(event.data) for event in self.events]
        count_excess = len(self.events) - max(1, max_events - max_events // 10)
        byte_excess = sum(sizes) - (max_bytes - max_bytes // 10) if max_bytes else 0
        last = len(self.events) - 1
        drop: set[int] = set()
        for durable_pass in (False, True):  # ephemeral events first, then the oldest durable ones
            for index, event in enumerate(self.events):
                if (count_excess <= 0 and byte_excess <= 0) or index == last:
                    break
                if index not in drop and event.ephemeral != durable_pass:
                    drop.add(index)
                    count_excess -= 1
                    byte_excess -= sizes[index]
        self.events = [event for index, event in enumerate(self.events) if index not in drop]
        self.held_bytes = sum(size for index, size in enumerate(sizes) if index not in drop)

    def drop_ephemeral(self) -> None:
        """Let go of the held ephemeral events (the plan ended: only the durable ones stay for replay)."""
        self.ephemeral_held = False
        events = self.events
        for event in events:  # a plain loop: a plan that held one ends (Streams.emit asks ephemeral_held first)
            if event.ephemeral:
                self.events = [event for event in events if not event.ephemeral]
                self.recount()
                return

    def retained_bytes(self) -> int:
        """What the plan holds, as the core sizes payloads: args, result, held events, and its own records.

        :data:`PLAN_OVERHEAD_BYTES` stands for the Python objects every plan has whatever its
        payloads (the plan, its submit fields, status, lifecycle events).
        """
        # result_bytes() + 16 is event_bytes(result), sized once for a finished plan (None: 16, as event_bytes(None)).
        return PLAN_OVERHEAD_BYTES + event_bytes(self.args) + self.result_bytes() + 16 + self.held_bytes

    def recount(self) -> None:
        """Set ``held_bytes`` from the held events (after they were replaced, e.g. on restore)."""
        self.held_bytes = sum(event_bytes(event.data) for event in self.events)

    def events_after(self, from_seq: int) -> list[Event]:
        """Held events with ``seq > from_seq``, in order."""
        start = bisect.bisect_right(self.events, from_seq, key=lambda e: e.seq)
        return self.events[start:]

    def result_bytes(self) -> int:
        """The result's size as :func:`event_bytes` counts it (0 without one); sized once the plan ended."""
        if self.result is None:
            return 0
        if self.result_size >= 0:
            return self.result_size
        size = event_bytes(self.result) - 16
        if self.state in ("succeeded", "failed", "cancelled"):  # finished (self.terminal, inlined): it stays as it is
            self.result_size = size
        return size

    def shown_id(self, admin: bool) -> str:
        """The id a session knows this plan by: its key for an admin session, its name for its owner's."""
        name = self.name
        return self.id if admin or name is None else name

    def summary(self, admin: bool = False) -> PlanInfo:
        """The listing (``plans``) view: no result body (its size instead), short error and reason.

        A listing must stay small whatever plans hold (issue 17 findings 5 and 11): the result is
        fetched on demand with ``get_plan``. ``admin``: an admin session's view (by key, with the
        owner and its name for a plan whose name is not its key); False: its owner's (by name).
        """
        error = self.error
        if error is not None and (error.detail is not None or len(error.message) > SUMMARY_TEXT):
            error = ErrorInfo(error.code, error.message[:SUMMARY_TEXT])
        reason = self.waiting_reason
        if reason is not None and len(reason) > SUMMARY_TEXT:
            reason = reason[: SUMMARY_TEXT - 3] + "..."
        name = self.name
        info = PlanInfo(
            id=self.id if admin or name is None else name,
            op=self.op,
            state=self.state,
            attempt=self.attempt,
            worker_id=self.worker_id,
            priority=self.priority,
            requirements=self.requirements,
            error=error,
            last_seq=self.next_seq - 1,
            waiting_reason=reason,
            result_bytes=self.result_bytes(),
        )
        if self.terminal:  # a finished plan's footprint: who, when, how much (``plans --since --by``)
            info.receipt, info.owner, info.ended_at = self.receipt, self.owner, self.ended_at
        if admin and name is not None:  # whose it is, and what its owner calls it
            info.owner, info.name = self.owner, name
        return info

    def summary_bytes(self) -> int:
        """About how many bytes :meth:`summary` encodes to (a page of a listing is bounded by them)."""
        size = 96 + len(self.id) + len(self.op) + len(self.worker_id or "")
        tags = self.requirements.tags
        if tags:
            size += sum(map(len, tags)) + 2 * len(tags)
        if self.waiting_reason is not None:
            size += min(len(self.waiting_reason), SUMMARY_TEXT)
        if self.error is not None:
            size += min(len(self.error.message), SUMMARY_TEXT) + len(self.error.code)
        if self.terminal:
            size += 24 + len(self.owner)
            if self.receipt is not None:
                size += RECEIPT_BYTES + sum(len(d) + 2 for d in self.receipt.devices)
        return size

    def info(self, admin: bool = False) -> PlanInfo:
        """The ``get_plan``/``cancel`` view of this plan (``admin``: as :meth:`summary`)."""
        name = self.name
        return PlanInfo(
            id=self.id if admin or name is None else name,
            op=self.op,
            state=self.state,
            attempt=self.attempt,
            worker_id=self.worker_id,
            priority=self.priority,
            requirements=self.requirements,
            result=self.result,
            error=self.error,
            last_seq=self.next_seq - 1,
            waiting_reason=self.waiting_reason,
            owner=self.owner,
            history=list(self.history),
            ended_at=self.ended_at,
            receipt=self.receipt,
            name=name if admin else None,
            trace_id=trace_id_of(self.traceparent),
        )


class PlanNames:
    """The keys of plans whose name is not their key, by ``(owner, name)`` (module docstring).

    A plan id is scoped per principal: two principals may submit the same id and neither sees
    the other's plan, nor learns that it exists. Nearly every plan's key is its name and has no
    entry here, so the usual look-up is one truth test of :attr:`keys` (empty) more.
    """

    __slots__ = ("keys",)

    def __init__(self) -> None:
        self.keys: dict[tuple[str, str], str] = {}
        """``(owner, name) -> key`` of every plan kept whose ``name`` is set."""

    def add(self, plan: Plan) -> None:
        """``plan`` (its ``name`` set) was created or restored."""
        if plan.name is not None:
            self.keys[plan.owner, plan.name] = plan.id

    def forget(self, plan: Plan) -> None:
        """``plan`` was forgotten: its name is free again."""
        name = plan.name
        if name is not None and self.keys.get((plan.owner, name)) == plan.id:
            del self.keys[plan.owner, name]


class OwnerTally:
    """One principal's plans counted by state, and its queued plans, kept as they move.

    A plan joins its owner's tally when a listing first indexes it (operator_requests.py, counted
    in the state it has then), moves with every :func:`advance`, and leaves it when it is forgotten
    (:meth:`remove`): a client's ``list_plans`` answers its counts and queue without walking all of
    its plans (issue 17, finding 11).
    """

    __slots__ = ("counts", "queued")

    def __init__(self) -> None:
        self.counts: dict[str, int] = {}
        self.queued: dict[str, Plan] = {}  # plan id -> plan, of those queued now

    def add(self, plan: Plan) -> None:
        """Count ``plan`` in its present state (it must not be counted yet)."""
        state = plan.state
        self.counts[state] = self.counts.get(state, 0) + 1
        if state == "queued":
            self.queued[plan.id] = plan
        plan.tally = self

    def remove(self, plan: Plan) -> None:
        """``plan`` is forgotten: no longer counted."""
        if plan.tally is self:
            self.counts[plan.state] -= 1
            self.queued.pop(plan.id, None)
            plan.tally = None

    def moved(self, plan: Plan, old: str, new: str) -> None:
        """``plan`` went from ``old`` to ``new``."""
        counts = self.counts
        counts[old] -= 1
        counts[new] = counts.get(new, 0) + 1
        if old == "queued":
            self.queued.pop(plan.id, None)
        elif new == "queued":
            self.queued[plan.id] = plan


def advance(plan: Plan, event: PlanEventName) -> PlanStateName:
    """Move ``plan`` along the table.

    Returns:
        The new state.

    Raises:
        InvalidTransition: ``(plan.state, event)`` is not in the table; the plan is unchanged.
    """
    try:
        new_state = TRANSITIONS[plan.state, event]
    except KeyError:
        raise InvalidTransition(plan.id, plan.state, event) from None
    tally = plan.tally
    if tally is not None and new_state != plan.state:
        tally.moved(plan, plan.state, new_state)
    plan.state = new_state
    return new_state


def submit_problem(msg: Submit) -> str | None:
    """Why a submit is invalid, in words a person can act on; None when it is valid."""
    if not msg.op.strip():
        return "op must be a non-empty handler name"
    if msg.max_attempts < 1:
        return f"max_attempts must be at least 1 (got {msg.max_attempts})"
    if msg.retries < 0:
        return f"retries must be >= 0 (got {msg.retries})"
    if msg.timeout_s is not None and not msg.timeout_s > 0:  # written so that NaN fails too
        return f"timeout_s must be a positive number of seconds or null (got {msg.timeout_s})"
    if msg.plan_id is not None and not msg.plan_id:
        return "plan_id must be non-empty when given"
    if msg.deadline_s is not None or msg.deadline_at is not None or msg.expected_run_s is not None:
        problem = deadline_problem(msg)
        if problem is not None:
            return problem
    if msg.requirements.min_gpu_memory_bytes < 0:
        return f"requirements.min_gpu_memory_bytes must be >= 0 (got {msg.requirements.min_gpu_memory_bytes})"
    if msg.resources is not None and (problem := resources_problem(msg.resources)) is not None:
        return problem
    traceparent = msg.traceparent
    if traceparent and traceparent != UNSAMPLED and traceparent != UNSAMPLED_SHORT:  # "0": "00" (PROTOCOL.md §4)
        problem = traceparent_problem(traceparent)
        if problem is not None:
            return f"submit.{problem}"
    # Name caps (protocol/caps.py): names go into logs, indexes and every reply about the plan.
    # The usual short names and a few short tags (a pool's, cluster mode routes by it) cannot exceed them:
    # a few tests in C on the hot path, no call per tag.
    short = len(msg.op) <= MAX_OP_BYTES // 4 and len(msg.plan_id or "") <= MAX_PLAN_ID_BYTES // 4
    tags = msg.requirements.tags
    if short and (not tags or (len(tags) <= MAX_TAGS and max(map(len, tags)) <= MAX_TAG_BYTES // 4)):
        return None
    return (
        too_long("op", msg.op, MAX_OP_BYTES)
        or too_long("plan_id", msg.plan_id, MAX_PLAN_ID_BYTES)
        or tags_problem("requirements.tags", msg.requirements.tags)
    )


def deadline_problem(msg: Submit) -> str | None:
    """Why a submit's ``deadline_s``/``deadline_at``/``expected_run_s`` are invalid (docs/SEMANTICS.md §Deadlines)."""
    if msg.deadline_s is not None and msg.deadline_at is not None:
        return "give deadline_s (seconds from now) or deadline_at (Unix seconds), not both"
    for name, value in (("deadline_s", msg.deadline_s), ("deadline_at", msg.deadline_at),
                        ("expected_run_s", msg.expected_run_s)):  # fmt: skip
        if value is not None and not 0 < value < math.inf:  # written so that NaN fails too
            return f"{name} must be a positive number of seconds (got {value})"
    if msg.deadline_at is not None and msg.deadline_at > 1e11:
        return f"deadline_at must be Unix seconds (got {msg.deadline_at:.0f}: milliseconds?)"
    return None


class Subscriptions:
    """Which client connections follow which plan streams.

    A connection follows plans one by one, or every plan of a principal (``all``), now and
    future; the core adds ``all`` followers of the owner to a new plan before its first
    event, so sending an event is one set lookup.
    """

    def __init__(self) -> None:
        self.by_plan: dict[str, set[int]] = {}
        """plan id -> connections following it; read by ``Streams.emit`` (a lookup per event, no call), changed
        only here."""
        self._by_conn: dict[int, set[str]] = {}
        self._all: dict[str, set[int]] = {}  # principal -> conns following all its plans
        self._all_of_conn: dict[int, str] = {}

    def followers(self, plan_id: str) -> set[int] | tuple[()]:
        """Connections following a plan."""
        return self.by_plan.get(plan_id, ())

    def plans_of(self, conn_id: int) -> set[str]:
        """Plans a connection follows one by one (a copy)."""
        return set(self._by_conn.get(conn_id, ()))

    def all_followers(self, principal: str) -> list[int]:
        """Connections following every plan of ``principal``, admin sessions (``EVERY_PRINCIPAL``) included."""
        if not self._all:
            return []  # the usual case: nobody follows all plans (a submit asks this every time)
        every = self._all.get(EVERY_PRINCIPAL)
        if every is None:
            return sorted(self._all.get(principal, ()))
        return sorted(every.union(self._all.get(principal, ())))

    def follows_all(self, conn_id: int) -> bool:
        """Whether the connection follows every plan of its principal."""
        return conn_id in self._all_of_conn

    def add(self, plan_id: str, conn_id: int) -> None:
        """Follow one plan. Idempotent."""
        # No setdefault(key, set()): a new plan's key is new, a connection's nearly never is.
        followers = self.by_plan.get(plan_id)
        if followers is None:
            self.by_plan[plan_id] = {conn_id}
        else:
            followers.add(conn_id)
        followed = self._by_conn.get(conn_id)
        if followed is None:
            self._by_conn[conn_id] = {plan_id}
        else:
            followed.add(plan_id)

    def remove(self, plan_id: str, conn_id: int) -> None:
        """Stop following one plan; a plan not followed is ignored."""
        _discard(self.by_plan, plan_id, conn_id)
        _discard(self._by_conn, conn_id, plan_id)

    def add_all(self, principal: str, conn_id: int) -> None:
        """Follow every plan of ``principal`` submitted from now on."""
        self._all.setdefault(principal, set()).add(conn_id)
        self._all_of_conn[conn_id] = principal

    def remove_all(self, conn_id: int) -> None:
        """Stop following future plans of the connection's principal."""
        principal = self._all_of_conn.pop(conn_id, None)
        if principal is not None:
            _discard(self._all, principal, conn_id)

    def drop(self, conn_id: int) -> None:
        """Forget a connection entirely."""
        for plan_id in self.plans_of(conn_id):
            self.remove(plan_id, conn_id)
        self.remove_all(conn_id)


def _discard(index: dict[Any, set[Any]], key: Any, member: Any) -> None:
    """Remove ``member`` from ``index[key]``, dropping the key once its set is empty."""
    members = index.get(key)
    if members is not None:
        members.discard(member)
        if not members:
            del index[key]

_encode = msgspec.msgpack.Encoder().encode
RECEIPT_BYTES: Final = 240  # a receipt's encoding without its device names, at most (its fields and floats)
SUMMARY_TEXT: Final = 512  # a listing's error message and waiting reason are cut to this many characters
SMALL_EVENT_BYTES: Final = 128  # what a lifecycle event of a few scalars is counted as (not encoded to size it)
# What a finished plan's Python objects take beyond its payloads (measured: tests/unit/test_retention.py).
PLAN_OVERHEAD_BYTES: Final = 1024


def held_size(plan: Plan) -> int:
    """What an unfinished plan is counted as against its owner's byte limit (coordinator/limits.py
    ``PlanQuota``): its args, its requirement tags and the fixed overhead of a plan."""
    size = PLAN_OVERHEAD_BYTES + event_bytes(plan.args)
    tags = plan.requirements.tags
    if tags:
        size += sum(map(len, tags)) + 64 * len(tags)  # each tag is its own str object (~50 bytes) + a slot
    return size


def event_bytes(data: Any) -> int:
    """A cheap estimate of an event payload's size, for the per-plan held-bytes bound.

    Exact enough where it matters (large string or bytes payloads: tokens, logs, blobs);
    a number is its msgpack size, worked out without encoding it (the usual small args and
    results); anything else is sized by its msgpack encoding, and 16 bytes of overhead per event.
    """
    if data is None:
        return 16
    kind = type(data)
    if kind is int:
        if 0 <= data < 1 << 16:  # the usual small int: fixint, uint8 or uint16
            return 17 if data < 128 else 18 if data < 256 else 19
        if -(1 << 63) <= data < 1 << 64:
            return _int_bytes(data) + 16
    if kind is float:
        return 25  # msgpack float 64
    if kind is bool:
        return 17
    if isinstance(data, str | bytes):
        return len(data) + 16
    try:
        return len(_encode(data)) + 16
    except (TypeError, ValueError, OverflowError):  # not encodable as msgpack: it cannot go out either
        return 64


def _int_bytes(value: int) -> int:
    """The msgpack size of an int within -2**63 .. 2**64-1 (as ``len(msgpack.encode(value))``)."""
    if -32 <= value < 128:
        return 1  # fixint
    if value >= 0:
        return 2 if value < 1 << 8 else 3 if value < 1 << 16 else 5 if value < 1 << 32 else 9
    return 2 if value >= -(1 << 7) else 3 if value >= -(1 << 15) else 5 if value >= -(1 << 31) else 9
