"""Plans' event streams: every lifecycle and worker event, numbered, journaled and sent to the plan's followers.

What it owns: stamping the next ``seq`` on a plan's event (the plan holds the events), what a
stream's end does, and replaying a stream to a new subscriber (docs/SEMANTICS.md §Events).

Rules:

* Each event of a plan gets the next ``seq`` of that plan, is journaled (durable ones become
  records), then goes to every follower of the plan, in that order, within the same step.
* A terminal event (``succeeded``, ``failed``, ``cancelled``) ends the stream: the plan no
  longer counts against its owner's plan limit, and its retention starts at :attr:`Streams.now`.
* **Unrecorded events.** A ``waiting`` reason re-explained after workers came or went
  (``emit(recorded=False)``) goes to followers and is held for replay like any event, but is not
  written to the store: a worker connecting and leaving in a loop flipped every queued plan's
  reason, and each flip cost a store row (issue 17 finding 5). Seqs are still never reused: the
  plan's status is recorded with ``next_seq`` reserved :data:`UNRECORDED_SEQ_RESERVE` ahead
  (:attr:`Plan.seq_recorded`), written again only once the unrecorded events pass it, so one
  status write covers that many flips. After a restart the numbering resumes at the
  reservation; a replay from before it gets a ``resync`` for the seqs that were not recorded.
* **Replay gaps.** A replay that cannot give every seq after ``from_seq`` (ephemeral events
  lost in a restart, events past the per-plan bound) says so with ``resync`` in place of each
  missing run of events, never with a silent gap.
* **A replay only reads.** Whatever its ``from_seq``, a replay never changes the plan: one
  from past the stream's end sends nothing, and the plan's next event gets its next seq as
  ever (the subscriber learns the stream's end from ``subscribed.last_seqs``).
* **Each follower sees the plan by its own id.** A plan's events are held and journaled under
  its key. A plan whose owner knows it by another name (coordinator/plans.py, docs/SEMANTICS.md
  §Plan ids) goes to its owner's sessions under that name and to admin sessions under its key
  (events, ``resync``); every other plan's event goes to all its followers as the same object.

Depends on the outbox (coordinator/effects.py), subscriptions, journal, plan quota and
retention (coordinator/retention.py); knows nothing of placement or sessions' handlers.
"""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import msgspec

from coordinator.plans import SMALL_EVENT_BYTES, event_bytes
from protocol.messages import TERMINAL_STATES, ErrorInfo, Event, Resync

if TYPE_CHECKING:
    from coordinator.effects import Outbox
    from coordinator.journal import Journal
    from coordinator.limits import PlanQuota
    from coordinator.plans import Plan, Subscriptions
    from coordinator.retention import Retention
    from coordinator.sessions import SessionTable

__all__ = ["REPLAY_NOW_EVENTS", "REPLAY_SLICE_EVENTS", "UNRECORDED_SEQ_RESERVE", "Streams"]

REPLAY_NOW_EVENTS = 512  # a subscribe replaying at most this many events is answered in its own step
REPLAY_SLICE_EVENTS = 256  # ... a larger one goes out in slices of about this many, across loop turns
UNRECORDED_SEQ_RESERVE = 64  # seqs a plan's recorded status reserves ahead for unrecorded events (emit)
#: The lifecycle events a traced plan's spans are made of (coordinator/io/ops/tracing.py; not running: no span;
#: not leased: the scheduler notes it with its placement, coordinator/scheduling.py).
TRACED_KINDS = frozenset({"queued", "waiting", "requeued", "succeeded", "failed", "cancelled", "preempted"})


@dataclass(eq=False)
class _Replay:
    """A subscriber's replay under way: the plans still to replay, the first in progress."""

    conn_id: int
    plans: deque[Plan]
    from_seq: int
    expected: int = 0  # the next seq of plans[0] to send; 0: its replay has not started
    ids: set[str] = field(default_factory=set)


class Streams:
    """Emits plans' events to their followers and replays them to new subscribers.

    Args:
        outbox: where frames go.
        subscriptions: who follows which plan.
        journal: every emitted event is noted there (durable ones become records).
        quota: the per-principal plan limit, released when a plan's stream ends.
        retention: told when a plan ends.
        counters: the core's counters (``resyncs_sent``).
        max_events: events held in memory per plan.
        max_event_bytes: ... and their payload bytes (0: no byte bound).
        sessions: the open sessions (which followers are admin sessions, that see plans by key).
    """

    def __init__(
        self,
        *,
        outbox: Outbox,
        subscriptions: Subscriptions,
        plans: dict[str, Plan] | None = None,
        journal: Journal,
        quota: PlanQuota,
        retention: Retention,
        counters: dict[str, int],
        max_events: int,
        max_event_bytes: int,
        sessions: SessionTable | None = None,
    ) -> None:
        self.now = 0.0
        """The ``now`` of the input being handled (the core sets it): when a plan that ends now ended."""
        self.on_end: Callable[[Plan], None] | None = None
        """Told of each plan whose stream ended (the usage ledger's outcomes: coordinator/sharing.py)."""
        self.tracing = False
        """Note traced plans' lifecycle steps for the driver's spans (``note``; the driver sets it when it traces)."""
        self._outbox = outbox
        self._subscriptions = subscriptions
        self._plans = plans
        self._replays: deque[_Replay] = deque()
        self._journal = journal
        self._journaled = journal.events  # the journal's own list and dict (Journal.take empties them in place)
        self._dirty = journal.dirty
        self._quota = quota
        self._retention = retention
        self._counters = counters
        self._max_events = max_events
        self._max_event_bytes = max_event_bytes
        self._sessions: SessionTable = sessions if sessions is not None else {}
        counters["resyncs_sent"] = 0

    def emit(
        self, plan: Plan, kind: str, data: Any, *, ephemeral: bool = False, small: bool = False,
        size: int | None = None, recorded: bool = True,
    ) -> None:
        """Stamp the next seq on an event of the plan and send it to its followers.

        ``small``: a lifecycle event whose data the core built from a few scalars (not sized).
        ``size``: the payload's size when the caller already knows it (not sized again).
        ``recorded``: False for an event the store need not keep (a re-explained ``waiting``):
        only the plan's seq reservation is recorded, when the event passes it (module docstring).
        """
        # Plan.append_event, inlined (this runs for every event): the next seq stamped, the event held, the held
        # stream compacted past its bounds. Positional: Event's field order.
        event = Event(plan.id, kind, data, plan.next_seq, plan.attempt, ephemeral)
        plan.next_seq += 1
        held = plan.events
        held.append(event)
        plan.held_bytes += SMALL_EVENT_BYTES if small else event_bytes(data) if size is None else size
        max_bytes = self._max_event_bytes
        if len(held) > self._max_events or (max_bytes and plan.held_bytes > max_bytes):
            plan.compact(self._max_events, max_bytes)
        if ephemeral:
            plan.ephemeral_held = True  # its end drops them (Plan.drop_ephemeral); a plan with none skips the scan
        if plan.sampled and self.tracing and kind in TRACED_KINDS:  # data: a wait's reason (never a result to pack)
            self._outbox.traced((plan.traceparent, plan.id, plan.attempt, kind, data if kind == "waiting" else None))
        if recorded:  # self._journal.emitted(plan, event), inlined: this runs for every event
            if not ephemeral:
                self._journaled.append(event)
            self._dirty[plan.id] = plan
        elif plan.next_seq > plan.seq_recorded:  # past what the store has reserved: reserve the next run
            plan.seq_recorded = plan.next_seq + UNRECORDED_SEQ_RESERVE
            self._journal.touched(plan)
        outbox = self._outbox
        followers = self._subscriptions.by_plan.get(plan.id, ())  # Subscriptions.followers, inlined
        if plan.name is None:
            sessions, sends = outbox.sessions, outbox.sends
            for conn_id in followers:  # Outbox.send, inlined: this runs for every event and follower
                session = sessions.get(conn_id)
                if session is not None and not session.closing:
                    queued = sends.get(conn_id)
                    if queued is None:
                        sends[conn_id] = [event]
                    else:
                        queued.append(event)
        else:  # its owner's sessions know it by its name (module docstring)
            named = msgspec.structs.replace(event, plan_id=plan.name)
            for conn_id in followers:
                outbox.send(conn_id, event if self._by_key(conn_id) else named)
        if kind in TERMINAL_STATES:  # the stream's last event: the plan no longer counts against its owner
            self._quota.release(plan.owner, plan.id)
            if plan.ephemeral_held:  # a finished plan keeps its durable events only; a replay resyncs the rest
                plan.drop_ephemeral()
            self._retention.ended(plan, self.now)
            if self.on_end is not None:
                self.on_end(plan)

    def note(self, plan: Plan, kind: str, data: Any) -> None:
        """A step of a traced plan for the driver's spans (docs/OPERATIONS.md §Tracing), when its caller sampled it."""
        if plan.sampled and self.tracing:
            self._outbox.traced((plan.traceparent, plan.id, plan.attempt, kind, data))

    def fail(self, plan: Plan, worker_id: str | None, error: ErrorInfo) -> None:
        """Record why the plan failed (the table move is done) and end its stream with ``failed``."""
        plan.error = error
        data = {"code": error.code, "message": error.message, "detail": error.detail, "worker_id": worker_id}
        if plan.receipt is not None:  # the attempt's energy and carbon (coordinator/receipts.py)
            data["receipt"] = plan.receipt
        self.emit(plan, "failed", {**data, "attempt": plan.attempt})

    def replay(self, conn_id: int, plan: Plan, from_seq: int) -> None:
        """Send the held events after ``from_seq`` to a subscriber, with a ``resync`` for each missing run."""
        send = self._outbox.send
        expected = max(from_seq, 0) + 1
        admin = self._by_key(conn_id)
        name = None if admin else plan.name
        for event in plan.events_after(from_seq):
            if event.seq > expected:
                send(conn_id, self._resync(plan, expected, event.seq - 1, admin))
            send(conn_id, event if name is None else msgspec.structs.replace(event, plan_id=name))
            expected = event.seq + 1
        if expected < plan.next_seq:
            send(conn_id, self._resync(plan, expected, plan.next_seq - 1, admin))

    def _resync(self, plan: Plan, first: int, last: int, admin: bool) -> Resync:
        self._counters["resyncs_sent"] += 1
        return Resync(plan_id=plan.shown_id(admin), first_seq=first, last_seq=last, plan=plan.info(admin),
                      recovered=False)  # fmt: skip

    def _by_key(self, conn_id: int) -> bool:
        """Whether the session knows plans by their keys (an admin's) rather than its own names for them."""
        session = self._sessions.get(conn_id)
        return session is None or session.admin

    # ------------------------------------------------------------------ replays in slices (issue 17 finding 1)

    @property
    def replaying(self) -> int:
        """Replays under way (the driver pumps them, a slice per loop turn, while any are)."""
        return len(self._replays)

    def subscribe_replay(self, conn_id: int, plans: Iterable[Plan], from_seq: int) -> None:
        """Follow ``plans`` and replay each one's held events after ``from_seq`` to ``conn_id``.

        A small replay goes out at once. A large one (``subscribe(all, from_seq=0)`` over many
        plans) is charged now and sent by :meth:`pump`, a slice per call, so that it never holds
        the loop: a plan is followed only once its replay is sent, in the same step as its last
        slice, so its live events come after the replayed ones, never before or twice.
        """
        targets = list(plans)
        held = sum(len(plan.events) for plan in targets)
        self._outbox.charge(held + len(targets))  # events replayed (coordinator/limits.py §Cost per principal)
        if held <= REPLAY_NOW_EVENTS:
            add = self._subscriptions.add
            for plan in targets:
                add(plan.id, conn_id)
                self.replay(conn_id, plan, from_seq)
            return
        self._replays.append(_Replay(conn_id, deque(targets), from_seq, ids={p.id for p in targets}))

    def drop_replays(self, conn_id: int, plan_ids: Iterable[str] | None = None) -> None:
        """Stop replaying to ``conn_id`` (it closed or unsubscribed): every plan, or only ``plan_ids``."""
        if not self._replays:
            return
        if plan_ids is None:
            self._replays = deque(job for job in self._replays if job.conn_id != conn_id)
            return
        gone = set(plan_ids)
        for job in self._replays:
            if job.conn_id == conn_id and not gone.isdisjoint(job.ids):
                if job.plans and job.plans[0].id in gone:
                    job.expected = 0
                job.plans = deque(p for p in job.plans if p.id not in gone)
                job.ids -= gone
        self._replays = deque(job for job in self._replays if job.plans)

    def pump(self, budget: int, busy: Callable[[int], bool] | None = None) -> int:
        """Send up to about ``budget`` replayed events, round robin over the replays under way.

        ``busy(conn_id)``: the subscriber still has much unsent (it reads slowly); its replay
        waits. Returns the events sent (0: nothing could go now).
        """
        jobs = self._replays
        sent = 0
        waiting = 0
        while jobs and sent < budget and waiting < len(jobs):
            job = jobs.popleft()
            if busy is not None and busy(job.conn_id):
                jobs.append(job)
                waiting += 1
                continue
            waiting = 0
            sent += self._slice(job, min(REPLAY_SLICE_EVENTS, budget - sent))
            if job.plans:
                jobs.append(job)
        return sent

    def _slice(self, job: _Replay, budget: int) -> int:
        """Up to ``budget`` events of a replay (at least one step of progress); returns the units used."""
        send, conn_id, plans = self._outbox.send, job.conn_id, self._plans
        used = 0
        while job.plans and used < budget:
            plan = job.plans[0]
            if plans is not None and plans.get(plan.id) is not plan:  # forgotten meanwhile
                job.plans.popleft()
                job.expected = 0
                used += 1
                continue
            if job.expected == 0:
                job.expected = max(job.from_seq, 0) + 1
            events = plan.events
            start = bisect.bisect_left(events, job.expected, key=_seq)
            stop = min(len(events), start + budget - used)
            admin = plan.name is None or self._by_key(conn_id)
            for index in range(start, stop):
                event = events[index]
                if event.seq > job.expected:
                    send(conn_id, self._resync(plan, job.expected, event.seq - 1, admin))
                send(conn_id, event if admin else msgspec.structs.replace(event, plan_id=plan.name))
                job.expected = event.seq + 1
            used += stop - start + 1
            if stop < len(events):
                return used  # the rest of this plan in the next slice
            if job.expected < plan.next_seq:
                send(conn_id, self._resync(plan, job.expected, plan.next_seq - 1, admin))
            self._subscriptions.add(plan.id, conn_id)  # live from here on
            job.plans.popleft()
            job.ids.discard(plan.id)
            job.expected = 0
        return used


def _seq(event: Event) -> int:
    return event.seq
