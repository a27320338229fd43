"""``PlanStream``: one plan's event stream and outcome, as a session receives them (sans-I/O).

Theory of operation (docs/PROTOCOL.md §Client session, §Lifecycle events):

* A stream is fed by its ``ClientSession`` (``feed``, ``resync``), never by I/O of its own.
  It takes events only once it is *live*: from its ``accepted`` (a new plan's stream starts
  after it) or from its own ``subscribed`` (whose replay starts the stream from ``from_seq``).
* Events are buffered in ``seq`` order; a replay of a ``seq`` already held is dropped, so a
  stream resubscribed after a reconnect goes on with no gap and no duplicate.
* The terminal event (``succeeded``, ``failed``, ``cancelled``), or a terminal ``PlanInfo``
  whose terminal event this stream will never see, fixes the outcome that ``outcome()``
  returns or raises. A session that ends first marks the stream ``lost``.
* A plan the coordinator lost (a store loss) and the session resubmitted (``recover``) starts
  its stream again: a ``recovered`` marker event, then the new stream from ``seq`` 1.
* A plan whose stream the coordinator holds only up to an earlier ``seq`` than this one (a store
  loss took its latest events; ``subscribed.last_seqs`` says so) goes on from there
  (``rewind``): a ``rewound`` marker event, then the coordinator's next events, numbered again.
* Every marker (``resync``, ``recovered``, ``rewound``) explains itself: its ``data`` has a
  ``reason`` a person can read (``fleetwire watch`` prints it).
* Every change sets the stream's ``waker`` once (then drops it) and calls ``on_change``: the
  asyncio ``Plan`` handle (fleetwire/plan.py) puts an ``asyncio.Event`` there while someone waits.
  Nothing here awaits, sleeps or allocates per event beyond the buffer, and the stream holds no
  reference back to its handle: no reference cycle per plan for the garbage collector to find.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Final, Protocol

import msgspec

from fleetwire.errors import FleetwireConnectionError, PlanCancelled, PlanFailed
from protocol import errors as codes
from protocol.messages import TERMINAL_STATES, ErrorInfo, Event, PlanInfo, PlanStateName, Receipt, Resync

__all__ = ["RESYNC_REASON", "REWOUND_REASON", "PlanStream"]

#: The ``reason`` of a ``resync`` marker: why a replay can lack events (docs/PROTOCOL.md §6, *Events and seq*).
RESYNC_REASON: Final = (
    "the coordinator no longer holds these events: it keeps no superseded waiting reasons, no ephemeral "
    "events (tokens, progress) of a plan that ended or from before a restart, and at most 10,000 events a plan"
)

#: The ``reason`` of a ``rewound`` marker (docs/SEMANTICS.md §Recovery from clients and workers).
REWOUND_REASON: Final = (
    "coordinator lost the latest events of this stream (a store loss); the next ones are numbered again"
)

# Lifecycle event kind -> the plan state it implies (docs/PROTOCOL.md §Lifecycle events).
_STATE_OF_KIND: Final[dict[str, PlanStateName]] = {
    "queued": "queued",
    "requeued": "queued",
    "waiting": "queued",
    "leased": "leased",
    "running": "running",
    "succeeded": "succeeded",
    "failed": "failed",
    "cancelled": "cancelled",
}


_ABSENT: Final = object()  # a key not in an event's data


class Waker(Protocol):
    """What a stream sets at its next change (an ``asyncio.Event`` in the ``Plan`` handle)."""

    def set(self) -> None:
        """Wake whoever waits for the stream's next change."""
        ...


class PlanStream:
    """One plan's events, state and outcome as received so far.

    Args:
        plan_id: the plan.
        state: its state when known (from ``accepted``); None until the first lifecycle
            event of a watched plan.
        from_seq: events up to this ``seq`` are not wanted (a watch from a later point).
        live: take events at once (a new plan, after its ``accepted``).

    Attributes:
        id: the plan id.
        state, attempt, worker_id: what the latest lifecycle event (or plan record) says.
        last_seq: the ``seq`` of the latest event received (or stood in for by a resync).
        live: whether events are taken (see the module docstring).
        resyncs: runs of events the coordinator could no longer replay (see ``resync``).
        recovered: times the session resubmitted the plan after the coordinator lost it (see ``recover``).
        rewound: times the coordinator's stream was found behind this one (see ``rewind``).
        events: every event taken, in ``seq`` order.
        final: the terminal state, once known.
        receipt: the energy and carbon receipt its terminal event (or record) carried; None: none.
        lost: why the session ended before the plan did, if it did.
        waker: set (once, then dropped) at the next change; whoever waits puts it there. None: nobody waits.
        on_change: called after every change, when set (None: nothing to call).
    """

    __slots__ = (
        "__dict__",  # for the rare attributes below, set only on the plans that need them
        "_applied",
        "_attempt",
        "_receipt",
        "_result",
        "_state",
        "_worker_id",
        "events",
        "final",
        "id",
        "last_seq",
        "live",
        "on_change",
        "waker",
    )

    # Rare: what a store loss, a failure, a cancel or a lost session leaves. The class holds the defaults, so a
    # new stream sets none of them (a plan of a large batch usually never does).
    resyncs: int = 0
    recovered: int = 0
    rewound: int = 0
    lost: FleetwireConnectionError | None = None
    _failure: ErrorInfo | None = None
    _cancel_reason: str = ""

    def __init__(
        self, plan_id: str, *, state: PlanStateName | None = None, from_seq: int = 0, live: bool = False
    ) -> None:
        self.id = plan_id
        self._state: PlanStateName | None = state
        self._attempt = 0
        self._worker_id: str | None = None
        self._applied = 0  # events[:_applied] are in _state, _attempt, _worker_id (see _catch_up)
        self.last_seq = from_seq
        self.live = live
        self.events: list[Event] = []
        self.final: PlanStateName | None = None
        self._receipt: Any = None  # as the terminal event carried it; converted when read (:attr:`receipt`)
        self.waker: Waker | None = None
        self.on_change: Callable[[], None] | None = None
        self._result: Any = None

    def __repr__(self) -> str:
        return f"<PlanStream {self.id} {self.state or 'unknown'} seq={self.last_seq}>"

    def done(self) -> bool:
        """Whether the plan reached a terminal state (succeeded, failed or cancelled)."""
        return self.final is not None

    # state, attempt and worker_id follow the lifecycle events when read: feed() only keeps the events, so a
    # plan whose state nobody reads (a large batch's, awaited for its result) never works them out.

    @property
    def state(self) -> PlanStateName | None:
        """The state the latest lifecycle event (or the plan's record) implies; None while unknown."""
        if self._applied < len(self.events):
            self._catch_up()
        return self._state

    @state.setter
    def state(self, value: PlanStateName | None) -> None:
        self._catch_up()
        self._state = value

    @property
    def attempt(self) -> int:
        """The attempt the latest lifecycle event names (0 before the first lease)."""
        if self._applied < len(self.events):
            self._catch_up()
        return self._attempt

    @attempt.setter
    def attempt(self, value: int) -> None:
        self._catch_up()
        self._attempt = value

    @property
    def worker_id(self) -> str | None:
        """The worker of the latest attempt, once leased."""
        if self._applied < len(self.events):
            self._catch_up()
        return self._worker_id

    @worker_id.setter
    def worker_id(self, value: str | None) -> None:
        self._catch_up()
        self._worker_id = value

    def _catch_up(self) -> None:
        """Apply the lifecycle events taken since the last call, in order (docs/PROTOCOL.md §Lifecycle events)."""
        events = self.events
        for index in range(self._applied, len(events)):
            event = events[index]
            state = _STATE_OF_KIND.get(event.kind)
            if state is None:
                continue  # not a lifecycle event (output, a marker)
            self._state = state
            data = event.data
            if data and isinstance(data, dict):  # a lifecycle event's placement: {} and None say nothing
                attempt = data.get("attempt")
                if isinstance(attempt, int):
                    self._attempt = attempt
                worker_id = data.get("worker_id", _ABSENT)
                if worker_id is not _ABSENT:
                    self._worker_id = worker_id
        self._applied = len(events)

    @property
    def receipt(self) -> Receipt | None:
        """The plan's energy and carbon receipt (docs/PROTOCOL.md §Receipt); None before it ended or without one."""
        receipt = self._receipt = _receipt(self._receipt)
        return receipt

    def outcome(self) -> Any:
        """The result of a plan that succeeded.

        Raises:
            RuntimeError: the plan has not ended yet.
            PlanFailed: the plan failed; ``code``, ``message`` and ``detail`` say why.
            PlanCancelled: the plan was cancelled.
        """
        if self.final == "succeeded":
            return self._result
        if self.final == "cancelled":
            raise PlanCancelled(self.id, self._cancel_reason)
        if self.final is None:
            raise RuntimeError(f"plan {self.id} has not ended yet")
        failure = self._failure or ErrorInfo(code=codes.INTERNAL, message="")
        raise PlanFailed(
            failure.message,
            plan_id=self.id,
            code=failure.code,
            detail=failure.detail,
            worker_id=self.worker_id,
            attempt=self.attempt,
        )

    def changed(self) -> None:
        """Tell whoever waits that the stream changed: its ``waker`` (set once, then dropped), ``on_change``."""
        waker = self.waker
        if waker is not None:
            self.waker = None
            waker.set()
        if self.on_change is not None:
            self.on_change()

    # ---- fed by the session

    def go_live(self) -> PlanStream:
        """Take events from now on (its ``subscribed`` arrived); returns the stream."""
        self.live = True
        return self

    def feed(self, event: Event) -> None:
        """Take one event of this plan (dropped when not live, ended, or already held).

        ``ClientSession.receive_frame`` has a copy of this for a plan's one stream (the hot path): keep the two alike.
        """
        if self.final is not None or not self.live:
            return
        seq = event.seq
        if seq > self.last_seq:
            self.last_seq = seq
        elif seq:
            return  # a replay of an event this stream already holds (seq 0: an unnumbered one, taken)
        self.events.append(event)  # its state, attempt and worker id are worked out when read (_catch_up)
        if event.kind in TERMINAL_STATES:
            self.finish(event)
        waker = self.waker  # as changed(), inline: this runs for every event
        if waker is not None:
            self.waker = None
            waker.set()
        if self.on_change is not None:
            self.on_change()

    def finish(self, event: Event) -> None:
        """Take the outcome of the plan's terminal event (``feed``, and its copy in ``ClientSession.receive_frame``)."""
        data = event.data
        if event.kind == "succeeded" and type(data) is dict:  # the usual end
            self._result = data.get("result")
            self._receipt = data.get("receipt")
            self.final = "succeeded"
            return
        if not isinstance(data, dict):
            data = {}
        state: PlanStateName = _STATE_OF_KIND[event.kind]
        if state == "succeeded":
            self._result = data.get("result")
        elif state == "failed":
            self._failure = ErrorInfo(
                code=str(data.get("code", codes.INTERNAL)),
                message=str(data.get("message", "")),
                detail=data.get("detail"),
            )
        else:
            self._cancel_reason = str(data.get("reason", ""))
        self.final = state
        self._receipt = data.get("receipt")

    def resync(self, msg: Resync) -> None:
        """The coordinator no longer holds seqs ``first_seq..last_seq``: say so in the stream.

        A marker ``Event(kind="resync", seq=last_seq, data={"recovered": False, "first_seq",
        "last_seq", "state", "reason"})`` stands in for them, so the stream has no silent gap; the
        plan's state comes from the record the coordinator sent with it.
        """
        if not self.live or self.final is not None or msg.last_seq <= self.last_seq:
            return
        info = msg.plan
        data = {"recovered": msg.recovered, "first_seq": max(msg.first_seq, self.last_seq + 1),
                "last_seq": msg.last_seq, "state": info.state if info is not None else None,
                "reason": RESYNC_REASON}  # fmt: skip
        self.events.append(Event(plan_id=self.id, kind="resync", data=data, seq=msg.last_seq))
        self.last_seq = msg.last_seq
        self.resyncs += 1
        if info is not None:
            if info.state not in TERMINAL_STATES:
                self.state = info.state
            self.finish_from_info(info)  # ends it when its terminal event was among the missing ones
        self.changed()

    def recover(self, reason: str) -> None:
        """The coordinator lost the plan and the session resubmitted it (same id and spec): start again.

        A marker ``Event(kind="recovered", seq=0, data={"reason", "last_seq"})`` (``last_seq``: the
        last seq of the lost stream) goes into the stream; the new stream's events follow from seq 1.
        """
        if self.final is not None:
            return
        data = {"reason": reason, "last_seq": self.last_seq}
        self.events.append(Event(plan_id=self.id, kind="recovered", data=data, seq=0))
        self.last_seq = 0
        self.state = "queued"
        self.recovered += 1
        self.changed()

    def rewind(self, last_seq: int) -> bool:
        """The coordinator's stream of this plan ends at ``last_seq``, before this one's: a store loss took
        the latest events it had sent. Its next events, numbered from ``last_seq + 1`` again, are new ones.

        A marker ``Event(kind="rewound", seq=last_seq, data={"reason", "last_seq"})`` (``last_seq``: the
        last seq this stream had) goes into the stream, and the stream takes seqs after ``last_seq``.
        Returns whether it rewound (False: the coordinator is not behind, or the plan ended here).
        """
        if self.final is not None or not 0 <= last_seq < self.last_seq:
            return False
        data = {"reason": REWOUND_REASON, "last_seq": self.last_seq}
        self.events.append(Event(plan_id=self.id, kind="rewound", data=data, seq=last_seq))
        self.last_seq = last_seq
        self.rewound += 1
        self.changed()
        return True

    def finish_from_info(self, info: PlanInfo) -> None:
        """End the stream from the plan's record when its terminal event came before ``last_seq``.

        Used for a watch from a later ``seq`` and for a resync: the terminal event is then
        never replayed, and the record says how the plan ended.
        """
        if self.final is not None or info.state not in TERMINAL_STATES or info.last_seq > self.last_seq:
            return  # not ended, or its terminal event is still on its way in the replay
        self.state = self.final = info.state
        self.attempt = info.attempt
        self.worker_id = info.worker_id
        self._result = info.result
        self._receipt = info.receipt
        if info.error is not None:
            self._failure = info.error
        self.changed()

    def fail(self, error: FleetwireConnectionError) -> None:
        """The session ended (or lost the plan) before the plan did."""
        if self.final is None and self.lost is None:
            self.lost = error
            self.changed()


def _receipt(value: Any) -> Receipt | None:
    """A terminal event's ``receipt`` (a map on the wire) as a :class:`Receipt`; None when absent or malformed."""
    if isinstance(value, Receipt) or value is None:
        return value
    try:
        return msgspec.convert(value, Receipt)
    except (msgspec.ValidationError, TypeError):
        return None
