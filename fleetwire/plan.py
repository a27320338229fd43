"""``Plan``: one plan's event stream and outcome, as the client session receives them.

A ``Plan`` is fed by its ``Client``'s reader (``_feed``), never by I/O of its own:
events are buffered in ``seq`` order, replays of a ``seq`` already held are dropped,
and the terminal event (``succeeded``, ``failed``, ``cancelled``; docs/PROTOCOL.md
§Lifecycle events) fixes the outcome that ``result()`` returns or raises.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any, Final

from fleetwire.errors import FleetwireConnectionError, PlanCancelled, PlanFailed
from protocol import errors as codes
from protocol.messages import TERMINAL_STATES, ErrorInfo, Event, PlanInfo, PlanStateName, Resync

if TYPE_CHECKING:
    from fleetwire.client import Client

__all__ = ["Plan"]

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


class Plan:
    """A submitted or watched plan: its event stream, state and outcome.

    Made by ``Client.submit`` and ``Client.watch``, never directly. Attributes reflect
    the events received so far: ``state`` (``None`` until the first lifecycle event of
    a watched plan), ``attempt``, ``worker_id``, ``last_seq``; ``duplicate`` is true when
    ``submit`` found an existing plan with the given ``plan_id``.
    """

    def __init__(
        self,
        client: Client,
        plan_id: str,
        *,
        state: PlanStateName | None = None,
        duplicate: bool = False,
        from_seq: int = 0,
        live: bool = False,
    ) -> None:
        self.id = plan_id
        self.state: PlanStateName | None = state
        self.duplicate = duplicate
        self.attempt = 0
        self.worker_id: str | None = None
        self.last_seq = from_seq
        self._client = client
        self._live = live
        self._events: list[Event] = []
        # Made by the first waiter and dropped by ``_wake``: most plans of a large batch
        # are never waited on while they run, and an Event per plan costs at 20k plans/s.
        self._changed: asyncio.Event | None = None
        # The outcome, once known: from the terminal event or a terminal PlanInfo.
        self._final: PlanStateName | None = None
        self._result: Any = None
        self._failure: ErrorInfo | None = None
        self._cancel_reason = ""
        self._lost: FleetwireConnectionError | None = None
        self.resyncs = 0  # runs of events the coordinator could no longer replay (see ``_resync``)

    def __repr__(self) -> str:
        return f"<Plan {self.id} {self.state or 'unknown'} seq={self.last_seq}>"

    def done(self) -> bool:
        """Whether the plan reached a terminal state (succeeded, failed or cancelled)."""
        return self._final is not None

    def events(self) -> AsyncIterator[Event]:
        """Every event received for this plan, in ``seq`` order, from the first.

        Ends after the terminal event (``succeeded``, ``failed`` or ``cancelled``).
        Each call starts a new iterator from the beginning of the buffer.

        Raises:
            FleetwireConnectionError: the session ended before the terminal event
                (after yielding every event received until then).
        """
        return _PlanEvents(self)

    async def result(self) -> Any:
        """Wait for the plan to end and return its result.

        Raises:
            PlanFailed: the plan failed; ``code``, ``message`` and ``detail`` say why.
            PlanCancelled: the plan was cancelled.
            FleetwireConnectionError: the session ended before the plan did.
        """
        while self._final is None:
            if self._lost is not None:
                raise self._lost
            await self._changed_event().wait()
        if self._final == "succeeded":
            return self._result
        if self._final == "cancelled":
            raise PlanCancelled(self.id, self._cancel_reason)
        failure = self._failure or ErrorInfo(code=codes.INTERNAL, message="")
        raise PlanFailed(
            failure.message,
            plan_id=self.id,
            code=failure.code,
            detail=failure.detail,
            worker_id=self.worker_id,
            attempt=self.attempt,
        )

    async def cancel(self) -> PlanInfo:
        """Cancel the plan; same as ``client.cancel(plan.id)``."""
        return await self._client.cancel(self.id)

    # ---- fed by the client's reader

    def _go_live(self) -> Plan:
        self._live = True
        return self

    def _feed(self, event: Event) -> None:
        if not self._live or self._final is not None:
            return
        if event.seq:
            if event.seq <= self.last_seq:
                return  # a replay of an event this plan already holds
            self.last_seq = event.seq
        self._events.append(event)
        state = _STATE_OF_KIND.get(event.kind)
        if state is not None:
            data = event.data if isinstance(event.data, dict) else {}
            self.state = state
            if isinstance(data.get("attempt"), int):
                self.attempt = data["attempt"]
            if "worker_id" in data:
                self.worker_id = data["worker_id"]
            if state == "succeeded":
                self._result = data.get("result")
            elif state == "failed":
                self._failure = ErrorInfo(
                    code=str(data.get("code", codes.INTERNAL)),
                    message=str(data.get("message", "")),
                    detail=data.get("detail"),
                )
            elif state == "cancelled":
                self._cancel_reason = str(data.get("reason", ""))
            if state in TERMINAL_STATES:
                self._final = state
        self._wake()

    def _resync(self, msg: Resync) -> None:
        """The coordinator no longer holds seqs ``first_seq..last_seq``: say so in the stream.

        ``events()`` yields a marker ``Event(kind="resync", seq=last_seq, data={"recovered":
        False, "first_seq", "last_seq", "state"})`` in their place, so the stream has no silent
        gap; the plan's state comes from the record the coordinator sent with it.
        """
        if not self._live or self._final is not None or msg.last_seq <= self.last_seq:
            return
        info = msg.plan
        data = {"recovered": msg.recovered, "first_seq": max(msg.first_seq, self.last_seq + 1),
                "last_seq": msg.last_seq, "state": info.state if info is not None else None}  # fmt: skip
        self._events.append(Event(plan_id=self.id, kind="resync", data=data, seq=msg.last_seq))
        self.last_seq = msg.last_seq
        self.resyncs += 1
        if info is not None:
            if info.state not in TERMINAL_STATES:
                self.state = info.state
            self._finish_from_info(info)  # ends it when its terminal event was among the missing ones
        self._wake()

    def _finish_from_info(self, info: PlanInfo) -> None:
        """End a watched plan whose terminal event came before ``from_seq``."""
        if self._final is not None or info.state not in TERMINAL_STATES or info.last_seq > self.last_seq:
            return  # not ended, or its terminal event is still on its way in the replay
        self.state = self._final = info.state
        self.attempt = info.attempt
        self.worker_id = info.worker_id
        self._result = info.result
        if info.error is not None:
            self._failure = info.error
        self._wake()

    def _fail(self, error: FleetwireConnectionError) -> None:
        if self._final is None and self._lost is None:
            self._lost = error
            self._wake()

    def _wake(self) -> None:
        # One Event per generation: every waiter of this generation wakes, later
        # waiters wait on the next one. Works for any number of iterators.
        if self._changed is not None:
            self._changed.set()
            self._changed = None

    def _changed_event(self) -> asyncio.Event:
        """The Event the next ``_wake`` sets (made on demand)."""
        if self._changed is None:
            self._changed = asyncio.Event()
        return self._changed


class _PlanEvents(AsyncIterator[Event]):
    """An iterator over one plan's buffered and future events."""

    def __init__(self, plan: Plan) -> None:
        self._plan = plan
        self._index = 0

    async def __anext__(self) -> Event:
        plan = self._plan
        while True:
            if self._index < len(plan._events):
                event = plan._events[self._index]
                self._index += 1
                return event
            if plan._final is not None:
                raise StopAsyncIteration
            if plan._lost is not None:
                raise plan._lost
            await plan._changed_event().wait()
