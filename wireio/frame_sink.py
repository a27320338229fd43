"""A session's frames dispatched where they are read, without websockets' message queue (issue #29).

``async for frame in ws`` takes each frame through the library's queue (``Assembler.put``/``get``), a future and a
step of the reader task before the session's dispatch, which never awaits. :class:`SinkConnection` hands a whole
final binary frame to its ``frame_sink`` from ``process_event`` instead (the library's and ``wireio/wsbulk.py``'s
parsers call it from ``data_received``): decoded and dispatched there, in the order read. Anything else (a text
frame, a fragment) detaches the sink and goes to the library's queue, the reader's ``async for`` from then on (in
order: every frame before it was dispatched already). Control frames are the library's as before.

:class:`FrameSink` is the reader's side: :meth:`FrameSink.read` dispatches the frames queued before it attached
with ``recv``, attaches, and waits until the sink is detached (then reads with ``async for``), the connection is
lost, or a dispatch raised (re-raised by ``read``, as the ``async for`` loop raised it). Used by the worker agent
(``worker_agent/agent.py``) and the SDK's session (``fleetwire/client.py``).

:class:`SinkReceive` is the connections' side, shared with the coordinator's front door: its ``FailFastConnection``
(``coordinator/io/frontdoor/connection.py``) mixes it in with :attr:`SinkReceive.takes_text` set, its one hook: a
whole text frame goes to the sink too, and the sink may refuse a frame (``frame`` returns False: text that is not
UTF-8), which then goes to the library's queue, and every frame after it, as a fragment does.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable
from typing import Any, Protocol

from websockets.asyncio.client import ClientConnection
from websockets.frames import Frame, Opcode

from wireio.wsbulk import BulkReceive

__all__ = ["FrameSink", "FrameTaker", "SinkConnection", "SinkReceive"]

BINARY, TEXT, CONT = Opcode.BINARY, Opcode.TEXT, Opcode.CONT


class FrameTaker(Protocol):
    """Where a connection's whole data frames go as they are parsed (:class:`FrameSink`; the coordinator's
    ``FrameReader``, coordinator/io/frontdoor/reader.py)."""

    def frame(self, data: bytes | bytearray | memoryview, text: bool) -> bool:
        """One whole data frame; False: not taken (the library's queue gets it, and every later one)."""

    def fallback(self) -> None:
        """Detached: from now on frames go to the library's queue (a fragment, a text frame, a refused frame)."""

    def lost(self) -> None:
        """The connection ended (the sink is detached)."""


class SinkReceive(BulkReceive):
    """Whole data frames to ``frame_sink`` while one is attached, in ``process_event`` (module docstring); mix in
    first. Binary ones only, unless :attr:`takes_text`."""

    frame_sink: FrameTaker | None = None
    takes_text = False
    """The hook: whole text frames go to the sink too (the coordinator's sessions); else a text frame detaches it."""

    def process_event(self, event: Any) -> None:
        sink = self.frame_sink
        if sink is not None and type(event) is Frame:
            opcode = event.opcode
            if opcode is BINARY or opcode is TEXT or opcode is CONT:
                if (event.fin and (opcode is BINARY or (opcode is TEXT and self.takes_text))
                        and sink.frame(event.data, opcode is TEXT)):  # fmt: skip
                    return
                self.frame_sink = None  # the library's queue from this frame on, behind those dispatched
                sink.fallback()
        super().process_event(event)

    def connection_lost(self, exc: Exception | None) -> None:
        super().connection_lost(exc)
        sink = self.frame_sink
        if sink is not None:
            self.frame_sink = None
            sink.lost()


class SinkConnection(SinkReceive, ClientConnection):
    """A client connection (the SDK's, the worker agent's): big binary frames read past the library's copies
    (``wireio/wsbulk.py``), whole final binary frames to ``frame_sink`` while one is attached."""


class FrameSink:
    """Dispatches a session's frames in the connection's ``process_event`` (module docstring).

    ``dispatch``: called with each message of a frame when ``decode`` is given, else with the frame itself (bytes,
    or str from the library's queue after a text frame); it must not await. ``text``: the session's encoding is
    text (its frames are never binary: the sink is not attached).
    """

    def __init__(
        self,
        dispatch: Callable[[Any], None],
        decode: Callable[[bytes | str], Iterable[Any]] | None = None,
        *,
        text: bool = False,
    ) -> None:
        self._dispatch = dispatch
        self._decode = decode
        self._text = text
        self._ended: asyncio.Future[None] | None = None
        self._read_any = False
        self.frames = 0
        """Frames dispatched here, in ``process_event`` (tests)."""

    @property
    def answered(self) -> bool:
        """Whether any frame came to this session's reading (through the sink or the library's queue)."""
        return self._read_any or self.frames > 0

    def frame(self, data: bytes | bytearray | memoryview, text: bool = False) -> bool:
        """A whole binary frame (never text: :class:`SinkConnection` does not take it), always taken."""
        ended = self._ended
        if ended is None or ended.done():  # a dispatch raised: the session ends, nothing more is dispatched
            return True
        self.frames += 1
        try:
            decode = self._decode
            if decode is None:
                self._dispatch(data if type(data) is bytes else bytes(data))
            else:
                dispatch = self._dispatch
                for msg in decode(data if type(data) is bytes else bytes(data)):
                    dispatch(msg)
        except Exception as exc:  # the reader raises it, as its loop raised a failed dispatch
            ended.set_exception(exc)
        return True

    def detached(self) -> None:
        ended = self._ended
        if ended is not None and not ended.done():
            ended.set_result(None)

    fallback = lost = detached

    def _one(self, frame: bytes | str) -> None:
        self._read_any = True
        decode = self._decode
        if decode is None:
            self._dispatch(frame)
        else:
            for msg in decode(frame):
                self._dispatch(msg)

    async def read(self, ws: Any) -> None:
        """The session's reading until the connection ends (raises what a dispatch raised)."""
        if isinstance(ws, SinkConnection) and not self._text:
            try:
                queued = ws.recv_messages.frames  # websockets 17's: frames read before the session's reader began
            except AttributeError:  # another library version: its queue, as before
                queued = None
            if queued is not None:
                while len(queued):
                    self._one(await ws.recv())
                self._ended = asyncio.get_running_loop().create_future()
                ws.frame_sink = self
                try:
                    await self._ended
                finally:
                    if ws.frame_sink is self:
                        ws.frame_sink = None
        async for frame in ws:  # after a detach (or without a sink): the library's queue; ends when it closes
            self._one(frame)
