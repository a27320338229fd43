"""The worker's bounded queue of messages waiting to be sent, and how they become frames.

Messages wait here while the session's writer is busy and while the worker is disconnected
(plans keep running across sessions; docs/SEMANTICS.md §Worker session). When the queue grows
past its limit, it sheds in this order: stale heartbeats, then the oldest ephemeral events
(down to 90 % of the limit, so shedding is amortised), then the oldest durable events (down to
the limit). ``accept``, ``reject``, ``done`` and ``goodbye`` are never shed: each plan has at
most a few of them, and losing one would leave the coordinator's plan state wrong.

Acknowledgement (docs/SEMANTICS.md §Durability). Plan messages (``accept``, ``reject``, ``event``,
``done``) carry the worker's ``seq``. Once sent they move to the *unacked* list until the
coordinator's ``ack(seq)`` says they are recorded (:meth:`Outbox.ack`); :meth:`Outbox.rewind`
puts whatever is still unacked back in front of the queue for the next session, so a message
the coordinator never recorded (a dropped connection, a coordinator crash) is sent again, and
the coordinator drops the copies it already has. The unacked list has the same bound and
shedding order as the queue.

Results a store loss took (docs/SEMANTICS.md §Recovery from clients and workers). An acknowledged
``done`` is kept a while longer: the last :data:`KEEP_ACKED_DONE` of them. ``hello`` lists their
plans (:meth:`Outbox.recent_done`) with the running ones; a coordinator that lost the result with
its store's tail still holds (or has queued again) that lease and continues it, and
:meth:`Outbox.welcomed` puts those ``done`` s back in front of the queue; a coordinator that has
the result abandons them and they are forgotten. A lost tail holds the newest commits, so the
newest results are the ones worth keeping.

:class:`SendQueue` is the one way in: the plan runner and the session both queue through its
``send``, which numbers plan messages and wakes the session's writer, :func:`write_frames`: it
coalesces what is queued into frames, waiting a few loop turns for more unless waiting cannot help
(a stream's event after a wait that gathered nothing goes at once: a token's time to first byte;
one that comes while the writer waits with nothing queued is written by ``send`` itself, in its
caller's step, when the connection takes it without waiting).
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Awaitable, Callable, Collection, Iterable
from typing import Any, Final

import structlog

import protocol
from protocol import Codec, errors
from protocol.relay import MAX_CHUNK_BYTES

log = structlog.get_logger(__name__)

__all__ = [
    "COALESCE_TURNS", "FLUSH_MAX_MESSAGES", "KEEP_ACKED_DONE", "Outbox", "SendQueue", "encode_frames", "write_frames",
]

#: Acknowledged ``done`` s kept for a coordinator whose store lost them (see the module docstring).
KEEP_ACKED_DONE: Final = 128

#: Loop turns the writer waits, at most, for more messages to join a frame (:func:`write_frames`).
COALESCE_TURNS: Final = 4

#: The most messages a turn's flush writes itself (a lone plan's few: accept, events, done); a burst of plans that
#: ended in one turn (a frame of assigns) is left to the writer, whose coalescing turns gather the next frames' too.
FLUSH_MAX_MESSAGES: Final = 8

_NUMBERED = (protocol.Accept, protocol.Reject, protocol.Event, protocol.Done)  # carry ``seq``; acked
_NUMBERED_TYPES = frozenset(_NUMBERED)


class Outbox:
    """FIFO of outgoing messages with a bound on its length.

    Args:
        limit: the most messages held; ``dropped`` counts those shed to keep to it.
    """

    def __init__(self, limit: int = 10_000) -> None:
        if limit < 1:
            raise ValueError(f"outbox limit must be >= 1, got {limit}")
        self.limit = limit
        self.dropped = 0
        self._items: deque[Any] = deque()
        self._unacked: deque[Any] = deque()  # sent plan messages (seq > 0) not yet acknowledged
        self._acked_done: deque[Any] = deque(maxlen=KEEP_ACKED_DONE)  # the newest acknowledged done s

    @property
    def unacked(self) -> int:
        """Plan messages sent and not yet acknowledged."""
        return len(self._unacked)

    def __len__(self) -> int:
        return len(self._items)

    def __bool__(self) -> bool:
        return bool(self._items)

    @property
    def newest(self) -> Any:
        """The message queued last; None when the queue is empty."""
        return self._items[-1] if self._items else None

    def append(self, msg: Any) -> int:
        """Queue one message; returns how many older messages were shed to make room."""
        self._items.append(msg)
        return self._shed() if len(self._items) > self.limit else 0

    def take(self, max_count: int) -> list[Any]:
        """Remove and return up to ``max_count`` of the oldest messages."""
        items = self._items
        if len(items) <= max_count:
            batch = list(items)
            items.clear()
            return batch
        return [items.popleft() for _ in range(max_count)]

    def requeue(self, msgs: Iterable[Any]) -> None:
        """Put messages that could not be sent back at the front, in order; heartbeats are
        dropped (a later session sends fresh ones)."""
        self._items.extendleft(reversed([m for m in msgs if not isinstance(m, protocol.Heartbeat)]))
        if len(self._items) > self.limit:
            self._shed()

    def sent(self, msgs: Iterable[Any]) -> None:
        """``msgs`` went out: keep the numbered ones until they are acknowledged."""
        self._unacked.extend([m for m in msgs if type(m) in _NUMBERED_TYPES and m.seq > 0])
        if len(self._unacked) > self.limit:
            before = len(self._unacked)
            self._unacked = _shed_events(self._unacked, self.limit)
            self.dropped += before - len(self._unacked)

    def ack(self, seq: int) -> int:
        """The coordinator recorded everything up to ``seq``: forget it. Returns how many were dropped.

        The unacked list is in sending order, and a session sends in ``seq`` order (a new one re-sends what is
        unacked first), so what is acked is a prefix of it: taken from the front, the rest left in place."""
        unacked = self._unacked
        if unacked and unacked[-1].seq <= seq:  # all of it (the usual ack): one pass, no pop a message
            acked_done = self._acked_done
            for m in unacked:
                if type(m) is protocol.Done:
                    acked_done.append(m)
            dropped = len(unacked)
            unacked.clear()
            return dropped
        dropped = 0
        while unacked and unacked[0].seq <= seq:
            m = unacked.popleft()
            if type(m) is protocol.Done:
                self._acked_done.append(m)
            dropped += 1
        return dropped

    def rewind(self) -> None:
        """A new session starts: everything unacknowledged goes back in front of the queue, in order."""
        if self._unacked:
            self._items.extendleft(reversed(self._unacked))
            self._unacked.clear()
            if len(self._items) > self.limit:
                self._shed()

    def discard_heartbeats(self) -> None:
        """Drop queued heartbeats: they describe a session that is over."""
        if any(isinstance(m, protocol.Heartbeat) for m in self._items):
            self._items = deque(m for m in self._items if not isinstance(m, protocol.Heartbeat))

    def purge(self, plan_id: str, attempt: int | None = None) -> None:
        """Drop every queued message of a plan (of one attempt when given)."""

        def keep(m: Any) -> bool:
            if getattr(m, "plan_id", None) != plan_id:
                return True
            return attempt is not None and getattr(m, "attempt", None) != attempt

        self._items = deque(m for m in self._items if keep(m))
        self._unacked = deque(m for m in self._unacked if keep(m))
        if any(not keep(m) for m in self._acked_done):
            self._acked_done = deque((m for m in self._acked_done if keep(m)), maxlen=KEEP_ACKED_DONE)

    def pending_done(self) -> list[protocol.RunningPlan]:
        """Plans whose ``done`` is queued (they finished while the worker was disconnected)."""
        return [
            protocol.RunningPlan(plan_id=m.plan_id, attempt=m.attempt)
            for m in (*self._unacked, *self._items)
            if isinstance(m, protocol.Done)
        ]

    def recent_done(self, exclude: Collection[str] = ()) -> list[protocol.RunningPlan]:
        """Plans whose acknowledged ``done`` is still kept, for ``hello`` (except the plans in ``exclude``,
        listed already at another attempt)."""
        return [
            protocol.RunningPlan(plan_id=m.plan_id, attempt=m.attempt)
            for m in self._acked_done
            if m.plan_id not in exclude
        ]

    def welcomed(self, continue_plans: Iterable[str]) -> int:
        """A session began: the kept acknowledged ``done`` s of plans the coordinator continues go back in
        front of the queue (its store lost them); the others are forgotten. Returns how many go back."""
        if not self._acked_done:
            return 0
        continued = set(continue_plans)
        again = [m for m in self._acked_done if m.plan_id in continued]
        self._acked_done.clear()
        self._items.extendleft(reversed(again))
        return len(again)

    def _shed(self) -> int:
        before = len(self._items)
        self._items = deque(m for m in self._items if not isinstance(m, protocol.Heartbeat))
        excess = len(self._items) - (self.limit - self.limit // 10)
        if excess > 0:
            excess = self._drop_oldest(excess, lambda m: isinstance(m, protocol.Event) and m.ephemeral)
        excess = len(self._items) - self.limit
        if excess > 0:
            self._drop_oldest(excess, lambda m: isinstance(m, protocol.Event))
        shed = before - len(self._items)
        self.dropped += shed
        return shed

    def _drop_oldest(self, count: int, droppable: Any) -> int:
        kept: deque[Any] = deque()
        for m in self._items:
            if count > 0 and droppable(m):
                count -= 1
            else:
                kept.append(m)
        self._items = kept
        return count


def _shed_events(items: deque[Any], limit: int) -> deque[Any]:
    """``items`` cut to ``limit`` by dropping the oldest ephemeral events, then the oldest events."""
    excess = len(items) - limit
    for ephemeral_only in (True, False):
        if excess <= 0:
            break
        kept: deque[Any] = deque()
        for m in items:
            if excess > 0 and isinstance(m, protocol.Event) and (m.ephemeral or not ephemeral_only):
                excess -= 1
            else:
                kept.append(m)
        items = kept
    return items



class SendQueue:
    """What the worker has to send: numbers plan messages, queues them, wakes the writer.

    The plan runner and the session share one; the session's writer (:func:`write_frames`) drains ``outbox``
    and waits on ``wakeup`` when it is empty. While it waits, a stream's event that comes spaced from the
    last message is not queued but written at once through ``direct`` (set by the writer).

    Args:
        outbox_limit: the outbox's bound (see :class:`Outbox`).
        logger: where to warn that the outbox shed messages (the agent's bound logger).
    """

    def __init__(self, outbox_limit: int, logger: Any) -> None:
        self.outbox = Outbox(outbox_limit)
        self.wakeup = asyncio.Event()  # the outbox has something for the writer
        #: Set by the writer while it waits with nothing queued and the last message went out spaced: writes one
        #: message now (True), or cannot (False: the connection would make it wait; it is queued instead).
        self.direct: Callable[[Any], bool] | None = None
        #: Set by the writer while it waits with nothing queued: the first message queued schedules it (the end of
        #: the loop turn) instead of waking the writer; it writes a finished plan's messages at once (write_frames).
        self.flush_soon: Callable[[], None] | None = None
        self._log = logger
        self._seq = 0
        self._woken = False  # wakeup was set since the writer last cleared it: the next sends need not set it

    def send(self, msg: Any) -> None:
        """Queue ``msg`` for the coordinator; ``accept``, ``reject``, ``event`` and ``done`` get the next ``seq``."""
        if type(msg) in _NUMBERED_TYPES or isinstance(msg, _NUMBERED):  # one counter for every plan message: the
            # coordinator acks up to it (the exact type first: a set lookup, not four isinstance tests for a done)
            self._seq += 1
            msg.seq = self._seq
        direct = self.direct
        if direct is not None and type(msg) is protocol.Event and direct(msg):
            return
        outbox = self.outbox
        items = outbox._items
        items.append(msg)  # Outbox.append, without its call
        if len(items) > outbox.limit and outbox._shed():
            self._log.warning("outbox full: dropped old events", dropped_total=outbox.dropped)
        if not self._woken:  # the writer is woken once however many messages come before it runs
            self._woken = True
            self.direct = None  # something is queued: what comes next queues behind it
            flush_soon = self.flush_soon
            if flush_soon is not None:
                self.flush_soon = None
                flush_soon()
            else:
                self.wakeup.set()

    def park(self) -> None:
        """The writer found the outbox empty and waits on ``wakeup``: the next ``send`` wakes it."""
        self._woken = False
        self.wakeup.clear()

    def forget(self, plan_id: str, attempt: int | None = None) -> None:
        """Send nothing more that is queued or unacknowledged for a plan (of one attempt when given)."""
        self.outbox.purge(plan_id, attempt)


async def write_frames(
    queue: SendQueue,
    codec: Codec,
    send: Callable[[bytes], Awaitable[None]],
    *,
    max_frame_bytes: int,
    max_batch: int,
    finishing: Callable[[], bool],
    after_round: Callable[[], None] | None = None,
    write_now: Callable[[bytes], bool] | None = None,
) -> None:
    """A session's writer: sends what ``queue`` holds with ``send``, coalesced into as few frames as fit.

    Returns when the queue is empty and ``finishing()`` says so; a failed ``send`` puts the messages of that frame
    and the ones after it back in front of the queue and raises. ``after_round()`` runs after each round of
    frames (the relay reads its next chunks then).

    Coalescing: with something queued, the writer first waits up to :data:`COALESCE_TURNS` loop turns while the
    queue still grows, so a plan that ends at once sends its ``accept``, events and ``done`` as one frame (one
    send, one coordinator wake-up, one frame to the client instead of three of each). But where waiting cannot
    help it sends at once (TCP_NODELAY with autocorking): when the newest message is an ``event`` (a token's
    time to first byte) and the writer's last wait gathered nothing (messages come spaced, not in bursts). One
    loop turn after such a send says whether the stream came in a burst after all: then the next rounds wait.

    Written at once: with ``write_now`` (a synchronous write of one frame; False when the connection cannot take
    it without waiting: over its high-water mark, closing, or another send under way), such an event that comes
    while the writer waits with nothing queued is not queued at all: ``queue.send`` encodes and writes it in the
    caller's own step, with no wake-up of this task (the turn after decides, as above, if the next may too).

    Flushed at the turn's end: with ``write_now``, the first message queued while the writer waits schedules a
    flush (``queue.flush_soon``) instead of waking it; when the newest message then is a plan's ``done`` and at most
    :data:`FLUSH_MAX_MESSAGES` are queued (a lone plan that ended in that turn), they are written there, as one
    round; else the writer is woken and coalesces as above (a burst gathers the next turns' messages too).
    """
    await _FrameWriter(queue, codec, send, max_frame_bytes, max_batch, after_round, write_now).run(finishing)


class _FrameWriter:
    """:func:`write_frames`' state: whether the writer is parked, whether messages come spaced, and the
    callbacks it hands ``queue`` while parked (``direct``: an event written at once; ``flush_soon``)."""

    def __init__(
        self,
        queue: SendQueue,
        codec: Codec,
        send: Callable[[bytes], Awaitable[None]],
        max_frame_bytes: int,
        max_batch: int,
        after_round: Callable[[], None] | None,
        write_now: Callable[[bytes], bool] | None,
    ) -> None:
        self.queue, self.outbox, self.codec, self.send = queue, queue.outbox, codec, send
        self.max_frame_bytes, self.max_batch = max_frame_bytes, max_batch
        self.after_round, self.write_now = after_round, write_now
        self.loop = asyncio.get_running_loop()
        self.spaced = True  # the last wait for more messages gathered nothing: an event may go at once
        self.parked = False  # waiting on wakeup with nothing queued

    def direct(self, msg: Any) -> bool:
        """Write one event now, in the caller's step (False: the connection cannot take it without waiting)."""
        write_now, outbox = self.write_now, self.outbox
        assert write_now is not None
        chunks = encode_frames(self.codec, [msg], self.max_frame_bytes)  # [] when it cannot be sent at all (logged)
        if chunks:
            frame, msgs = chunks[0]
            if not write_now(frame):
                return False
            outbox.sent(msgs)  # kept until acked, as the writer's
        self.queue.direct = None  # what comes in this loop turn queues up: a burst goes coalesced
        self.spaced = False
        self.loop.call_soon(self.turn_after)
        if self.after_round is not None:
            self.after_round()
        return True

    def turn_after(self) -> None:
        if not self.outbox:  # nothing followed in the turn after: the stream is spaced, the next event may go at once
            self.spaced = True
            if self.parked and self.write_now is not None:
                self.queue.direct = self.direct

    def flush_soon(self) -> None:
        self.loop.call_soon(self.flush)

    def flush(self) -> None:
        """The end of the turn in which messages came to a parked writer: when the newest is a plan's ``done``
        (it ended: an on-loop plan's ``accept``, events and ``done`` all came in this turn), what is queued is
        written now, as one round, in this callback; anything else wakes the writer, which coalesces as before.
        A lone plan's result then leaves a turn sooner, without the writer's wake-up or the library's send."""
        queue, outbox, write_now = self.queue, self.outbox, self.write_now
        if (not self.parked or write_now is None or not outbox or len(outbox) > FLUSH_MAX_MESSAGES
                or type(outbox.newest) is not protocol.Done):
            queue.wakeup.set()
            return
        chunks = encode_frames(self.codec, outbox.take(self.max_batch), self.max_frame_bytes)
        for index, (frame, msgs) in enumerate(chunks):
            if not write_now(frame):  # the connection would make a sender wait: the writer sends the rest
                outbox.requeue([m for _, chunk in chunks[index:] for m in chunk])
                break
            outbox.sent(msgs)  # kept until acked, as the writer's
        if self.after_round is not None:
            self.after_round()
        if outbox:
            queue.wakeup.set()
            return
        queue.park()  # still waiting with nothing queued: the next message schedules a flush again
        queue.flush_soon = self.flush_soon
        if self.spaced:
            queue.direct = self.direct

    async def run(self, finishing: Callable[[], bool]) -> None:
        queue, outbox = self.queue, self.outbox
        while True:
            if not outbox:
                if finishing():
                    return
                queue.park()
                self.parked = True
                if self.write_now is not None:
                    queue.flush_soon = self.flush_soon
                    if self.spaced:
                        queue.direct = self.direct
                try:
                    await queue.wakeup.wait()
                finally:
                    self.parked = False
                    queue.direct = None
                    queue.flush_soon = None
                continue
            eager = self.spaced and type(outbox.newest) is protocol.Event
            if not eager:
                self.spaced = await _coalesce(outbox)
            await _send_round(outbox, self.codec, self.send, self.max_batch, self.max_frame_bytes)
            if self.after_round is not None:
                self.after_round()
            if eager:
                await asyncio.sleep(0)  # did more follow in the next turn? then the next rounds wait for it
                self.spaced = not outbox


async def _coalesce(outbox: Outbox) -> bool:
    """Wait while ``outbox`` still grows, at most :data:`COALESCE_TURNS` loop turns; whether the first turn
    gathered nothing (the messages come spaced, not in a burst)."""
    queued = len(outbox)
    await asyncio.sleep(0)
    if len(outbox) == queued:
        return True
    for _ in range(COALESCE_TURNS - 1):
        queued = len(outbox)
        await asyncio.sleep(0)
        if len(outbox) == queued:
            break
    return False


async def _send_round(outbox: Outbox, codec: Codec, send: Callable[[bytes], Awaitable[None]], max_batch: int,
                      max_frame_bytes: int) -> None:  # fmt: skip
    """Send up to ``max_batch`` of what ``outbox`` holds as frames; a failed send puts the messages of that frame
    and the ones after it back in front and raises."""
    chunks = encode_frames(codec, outbox.take(max_batch), max_frame_bytes)
    for index, (frame, msgs) in enumerate(chunks):
        try:
            await send(frame)
        except BaseException:
            outbox.requeue([m for _, chunk in chunks[index:] for m in chunk])
            raise
        outbox.sent(msgs)  # kept until acked; rewound and re-sent by the next session


def encode_frames(codec: Codec, msgs: list[Any], max_frame_bytes: int) -> list[tuple[bytes, list[Any]]]:
    """Encode ``msgs`` into as few frames as fit ``max_frame_bytes``, each with its messages.

    A single message above the limit is never sent: the coordinator would close the session,
    and resending it after every reconnect would wedge the worker. Handlers' payloads are
    checked in msgpack, but JSON can be larger, so: an oversized ``done`` becomes a failed
    ``done`` saying why, and any other oversized (or unencodable) message is dropped and logged.

    A batch that starts or ends with relayed chunks (``data_chunk``, up to 256 KiB each) is cut
    into runs of at most one chunk's bytes first (half a frame when that is less), so each byte
    is encoded once, not once per halving of a batch that was too big, and a chunk goes alone in
    its frame: the coordinator passes such a frame on as it is, without encoding it again
    (protocol/chunkview.py).
    """
    if len(msgs) > 1 and (type(msgs[0]) is protocol.DataChunk or type(msgs[-1]) is protocol.DataChunk):
        runs = _chunk_runs(msgs, min(max_frame_bytes // 2, MAX_CHUNK_BYTES))
        if len(runs) > 1:
            return [frame for run in runs for frame in encode_frames(codec, run, max_frame_bytes)]
    try:
        frame = codec.encode(msgs)
    except (TypeError, ValueError, OverflowError) as exc:
        if len(msgs) == 1:
            log.error("dropping unencodable message", msg_type=type(msgs[0]).__name__, error=str(exc))
            return []
        frame = b""
    if frame and len(frame) <= max_frame_bytes:
        return [(frame, msgs)]
    if frame and len(msgs) == 1:
        msg = msgs[0]
        why = f"{len(frame)} bytes encoded; the frame limit is {max_frame_bytes}"
        if isinstance(msg, protocol.Done):
            error = protocol.ErrorInfo(code=errors.HANDLER_ERROR, message=f"the plan's result is {why}")
            done = protocol.Done(plan_id=msg.plan_id, attempt=msg.attempt, outcome="failed", error=error)
            return [(codec.encode([done]), [done])]
        log.error("dropping an oversized message", msg_type=type(msg).__name__, reason=why)
        return []
    mid = len(msgs) // 2
    return encode_frames(codec, msgs[:mid], max_frame_bytes) + encode_frames(codec, msgs[mid:], max_frame_bytes)


def _chunk_runs(msgs: list[Any], limit: int) -> list[list[Any]]:
    """``msgs`` cut into runs whose relayed chunks' bytes add up to at most ``limit`` each (one chunk at least)."""
    runs: list[list[Any]] = []
    start = size = 0
    for index, msg in enumerate(msgs):
        n = len(msg.data) if type(msg) is protocol.DataChunk else 0
        if index > start and size + n > limit:
            runs.append(msgs[start:index])
            start, size = index, 0
        size += n
    runs.append(msgs[start:])
    return runs
