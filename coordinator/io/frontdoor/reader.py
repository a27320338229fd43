"""The per-connection driver: reads a session's frames and feeds them to what serves it.

Theory of operation. Every websocket session the front door (coordinator/io/frontdoor/door.py)
admits is served by a :class:`SessionHandler`: on a core's port, the core's session
(coordinator/io/frontdoor/core_driver.py ``CoreSession``); on a cluster's main port, a view session
across shards (coordinator/io/cluster/sessions.py) or a session moved to its shard's owner
(coordinator/io/cluster/host.py). :func:`read_frames` is the same loop for all of them, like
websockets' ``data_received``: decode a frame, ask the read policy (coordinator/read_policy.py),
hand the messages on, apply the verdict. What it never does: decide what a message means (the
handler's), send frames (the session's writer, coordinator/io/frontdoor/connection.py), or keep
counts of sessions (the door's).

The contract of a handler, in the order the door and the reader call it:

* ``opened(now)`` once, right after the upgrade, before any frame is read;
* ``await received(msgs, frame_bytes, now)`` for each frame within the message rate, never two at
  once; it returns the work units the messages cost beyond one each (coordinator/limits.py: rows
  a listing scanned, events a replay sent), and may yield to the loop (a frame over the frame
  budget). An exception it raises ends the connection;
* ``closed(now, code)`` exactly once: when the connection ended (``code`` None), or at once when
  the server closed it (``code``: 4429 flood, 4503 slow consumer, 4401 revoked token); from then
  on what the peer still sends is dropped and the handler is told nothing more.

A handler may also be an :class:`InlineHandler` (the core's sessions are): one that can take a
frame's messages without waiting. Its frames then go to it from the connection's ``data_received``
itself (coordinator/io/frontdoor/connection.py ``FailFastConnection``), with no task woken per frame:
while the reader is idle (nothing queued, no frame under way, no pause), a whole data frame is
decoded, admitted, taken and judged right there. Whatever needs waiting goes to the reader's task,
and every frame read meanwhile queues behind it, in order, so never two frames at once:

* the rest of a frame its handler stopped in (``take`` returns where it stopped: the frame budget
  was spent, or a message waits for a look-up; ``await finish(...)`` does the rest);
* a verdict other than ``READ_ON`` (a pause, the store's backlog over its bound);
* an exception the handler raised (the task raises it: the connection ends as before).

While the task has frames queued past the connection's ``max_queue`` (websockets' own high-water
mark), the transport stops reading, as websockets' queue would. A frame the library must assemble
(a fragmented message) or judge (a text frame that is not UTF-8), and frames that were already in
websockets' queue when the session started, go to the task through websockets' own ``recv``: from a
fragmented message on, all of them do.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

from coordinator.io.frontdoor.connection import FailFastConnection, Session
from coordinator.io.stores.backlog import Backlog
from coordinator.read_policy import FLOOD, READ_ON, ConnectionPolicy, Verdict

__all__ = ["FrameReader", "InlineHandler", "SessionHandler", "read_frames"]


class SessionHandler(Protocol):
    """The server side of one websocket session, as :func:`read_frames` and the door drive it (module docstring)."""

    def opened(self, now: float) -> None:
        """The upgrade is done; no frame has been read yet."""

    async def received(self, msgs: list[Any], frame_bytes: int, now: float) -> int:
        """One frame's messages, decoded, read at ``now``; returns the work units spent beyond one per message."""

    def closed(self, now: float, code: int | None) -> None:
        """The session ended (``code`` None), or the server closed it with ``code``; called once."""


@runtime_checkable
class InlineHandler(SessionHandler, Protocol):
    """A handler whose frames can be taken without a task (module docstring): ``received`` is ``take``, then
    ``finish`` when ``take`` stopped early."""

    def take(self, msgs: list[Any], frame_bytes: int, now: float) -> tuple[int, int]:
        """Hand on ``msgs`` from the first while none needs waiting: (how many were handled, work units spent).

        Fewer than ``len(msgs)`` handled: the rest waits for :meth:`finish` (the frame budget was spent, or the
        next message waits for a look-up); what was handled so far went out.
        """

    async def finish(self, msgs: list[Any], index: int, frame_bytes: int) -> int:
        """Hand on ``msgs[index:]``, where :meth:`take` stopped; the work units they spent."""


async def read_frames(
    session: Session, handler: SessionHandler, policy: ConnectionPolicy, *,
    kill: Callable[[Session, int, str], None], store: Backlog[Any] | None, clock: Callable[[], float],
) -> None:  # fmt: skip
    """Feed ``session``'s frames to ``handler`` within ``policy``'s verdicts until the connection ends.

    ``kill``: the door's close of a session (a flood: :data:`~coordinator.read_policy.FLOOD`);
    ``store``: the records waiting for the store, which readers wait on when over their bound
    (coordinator/io/stores/backlog.py; None: no store behind this port). Raises
    ``ConnectionClosed`` when the peer goes away mid-frame; the door handles it. An
    :class:`InlineHandler` on a connection that takes a frame sink (``FailFastConnection``) gets its
    frames from ``data_received`` (:class:`FrameReader`); any other, from this task.
    """
    reader = FrameReader(session, handler, policy, kill=kill, store=store, clock=clock)
    if isinstance(handler, InlineHandler) and reader.attach(handler):
        await reader.run()
        return
    async for frame in session.ws:
        await reader.step(frame)


class FrameReader:
    """One session's frames to its handler: inline from ``data_received`` while idle, else by the session's task.

    The connection calls :meth:`frame` for each whole data frame and :meth:`fallback` / :meth:`lost` as
    their names say (coordinator/io/frontdoor/connection.py ``FailFastConnection``); the door's task runs
    :meth:`run` until the connection ends. Module docstring: what is done where.
    """

    __slots__ = ("_busy", "_error", "_held", "_job", "_library", "_lost", "_paused", "_queue", "_verdict", "_wake",
                 "clock", "handler", "high", "inline", "kill", "low", "policy", "session", "store")

    def __init__(
        self, session: Session, handler: SessionHandler, policy: ConnectionPolicy, *,
        kill: Callable[[Session, int, str], None], store: Backlog[Any] | None, clock: Callable[[], float],
    ) -> None:  # fmt: skip
        self.session = session
        self.handler = handler
        self.inline: InlineHandler | None = None  # the handler, once frames go to it from data_received
        self.policy = policy
        self.kill = kill
        self.store = store
        self.clock = clock
        self.high: int | None = None  # frames queued past this: the transport stops reading (max_queue)
        self.low = 0  # ... until they are down to this
        self._queue: deque[bytes | str] = deque()  # frames read while the task is busy, in order
        self._busy = False  # the task has something to do: frames that arrive queue behind it
        self._job: tuple[list[Any], int, int, int, float] | None = None  # a frame take() stopped in
        self._verdict: Verdict | None = None  # a verdict of an inline frame to wait out
        self._error: BaseException | None = None  # the handler's exception, raised by the task
        self._library = False  # frames go to websockets' queue: the task reads them with recv()
        self._held = False  # websockets' queue held frames when the session began: recv() takes those first
        self._lost = False  # the connection ended: the task returns once the queue is empty
        self._paused = False  # the transport's reading is paused (queue over ``high``)
        self._wake: asyncio.Future[None] | None = None  # the task waits on it while idle

    def attach(self, handler: InlineHandler) -> bool:
        """Take the connection's frames from ``data_received`` on; False: it cannot give them (read with recv)."""
        ws = self.session.ws
        if not isinstance(ws, FailFastConnection):  # nothing would call frame()
            return False
        try:
            held = len(ws.recv_messages.frames)  # websockets' queue: frames read before the session began
        except AttributeError:  # not websockets 17's asyncio connection: read with recv()
            return False
        high = ws.max_queue_high
        self.high = high
        self.low = (ws.max_queue_low if ws.max_queue_low is not None else high // 4) if high is not None else 0
        self._busy = self._held = bool(held)  # those first, with recv(), in order
        self.inline = handler
        ws.frame_sink = self
        return True

    # ------------------------------------------------------------------ called by the connection

    def frame(self, data: bytes | bytearray | memoryview, text: bool) -> bool:
        """One whole data frame, in ``data_received``; False: the library must judge it (text that is not UTF-8)."""
        frame: bytes | str
        if text:
            try:
                frame = str(data, "utf-8")
            except UnicodeDecodeError:
                return False
        else:
            frame = data if type(data) is bytes else bytes(data)
        if self._busy:
            queue = self._queue
            queue.append(frame)
            if self.high is not None and len(queue) > self.high and not self._paused:
                self._paused = True
                self.session.ws.transport.pause_reading()
            return True
        try:
            admitted = self._admit(frame)
            if admitted is None:
                return True
            msgs, now, pause = admitted
            index, spent = self.inline.take(msgs, len(frame), now)  # type: ignore[union-attr]  # attached
            if index < len(msgs):  # the rest of the frame waits: the task finishes it
                self._job = (msgs, index, spent, len(frame), pause)
                self._start()
                return True
            verdict = self._verdict_of(len(msgs), len(frame), spent, pause)
        except Exception as exc:  # the task raises it: the connection ends as on the task's path
            self._error = exc
            self._start()
            return True
        if verdict is not READ_ON:
            self._verdict = verdict
            self._start()
        return True

    def fallback(self) -> None:
        """A frame the library assembles (a fragmented message): from now on every frame is read with recv()."""
        self._library = True
        self._start()

    def lost(self) -> None:
        """The connection ended: the task hands on what is queued, then returns."""
        self._lost = True
        self._start()

    def _start(self) -> None:
        self._busy = True
        wake = self._wake
        if wake is not None and not wake.done():
            wake.set_result(None)

    # ------------------------------------------------------------------ the session's task

    async def run(self) -> None:
        """Do what the inline path left (module docstring) until the connection ends; raises what the handler raised."""
        ws = self.session.ws
        assert isinstance(ws, FailFastConnection)  # attached
        queue = self._queue
        try:
            while True:
                if self._error is not None:
                    raise self._error
                if self._held:  # frames read before the session began (its first ones), in websockets' queue
                    self._held = False
                    while len(ws.recv_messages.frames):
                        await self.step(await ws.recv())
                elif self._job is not None:
                    msgs, index, spent, frame_bytes, pause = self._job
                    self._job = None
                    spent += await self.inline.finish(msgs, index, frame_bytes)  # type: ignore[union-attr]
                    await self._after(len(msgs), frame_bytes, spent, pause)
                elif self._verdict is not None:
                    verdict, self._verdict = self._verdict, None
                    await self._wait(verdict)
                elif queue:
                    frame = queue.popleft()
                    if self._paused and len(queue) <= self.low:
                        self._paused = False
                        ws.transport.resume_reading()
                    await self.step(frame)
                elif self._library:
                    ws.frame_sink = None  # websockets' queue only, from here on
                    async for frame in ws:
                        await self.step(frame)
                    return
                elif self._lost:
                    return
                else:  # idle: frames go to the handler from data_received until something needs the task
                    self._busy = False
                    self._wake = asyncio.get_running_loop().create_future()
                    try:
                        await self._wake
                    finally:
                        self._wake = None
        finally:
            ws.frame_sink = None
            if self._paused:
                self._paused = False
                ws.transport.resume_reading()

    async def step(self, frame: bytes | str) -> None:
        """One frame on the task's path: decode, admit, hand on, apply the verdict."""
        admitted = self._admit(frame)
        if admitted is None:
            return
        msgs, now, pause = admitted
        spent = await self.handler.received(msgs, len(frame), now)
        await self._after(len(msgs), len(frame), spent, pause)

    def _admit(self, frame: bytes | str) -> tuple[list[Any], float, float] | None:
        """Count ``frame``, decode it and admit its messages: (messages, now, pause), or None when they are
        dropped (the session is closing) or the session was killed for a flood."""
        session = self.session
        io = session.io
        io[0] += 1  # FrameCounters.FRAMES_IN, BYTES_IN
        io[1] += len(frame)
        if session.killed:
            return None  # closing: what it still sends is dropped
        now = self.clock()
        msgs = session.codec.decode(frame)
        pause = self.policy.admit(len(msgs), now)
        if pause is None:
            self.kill(session, *FLOOD)
            return None
        return msgs, now, pause

    def _verdict_of(self, messages: int, frame_bytes: int, spent: int, pause: float) -> Verdict:
        # Charged when handed on (a handler may have yielded, or waited on a database read).
        store = self.store
        return self.policy.after(messages, frame_bytes, spent, self.clock(), pause, store is not None and store.over)

    async def _after(self, messages: int, frame_bytes: int, spent: int, pause: float) -> None:
        verdict = self._verdict_of(messages, frame_bytes, spent, pause)
        if verdict is not READ_ON:
            await self._wait(verdict)

    async def _wait(self, verdict: Verdict) -> None:
        if verdict.wait_for_store and self.store is not None:
            await self.store.drained()  # the disk is behind: stop reading until it catches up
        if verdict.pause_s:
            await asyncio.sleep(verdict.pause_s)  # throttle: stop reading until the buckets refill
