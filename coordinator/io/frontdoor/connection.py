"""The coordinator's per-connection pieces: its websocket connection class and a session's writer.

``Session`` is one open websocket as the front door holds it (coordinator/io/frontdoor/door.py): its
outgoing queue and the writer task that sends what is pending as coalesced frames.

``FailFastConnection`` stops reading a peer that sent an oversize frame.

websockets 17.4 detects a frame over ``max_size`` from its header (``PayloadTooBig``) and
*fails* the connection (RFC 6455 §7.1.7): it writes a 1009 close frame, half-closes TCP and
then keeps reading, discarding everything until the peer's EOF or the close timeout
(``Protocol.discard``). A peer that is in the middle of sending 10 MiB therefore still
costs the coordinator reading 10 MiB, on the event loop every other session shares
(docs/OPERATIONS.md §Test matrix row 16). ``FailFastConnection`` closes the transport as soon as that close
frame is written: asyncio flushes the queued 1009 frame first, then the socket is closed,
and because the peer's unread payload is still in the kernel buffer the kernel resets the
connection instead of reading it. A well-behaved peer that reads while it writes (every
websockets client does) sees the 1009 close frame; one that does not may see only the reset.

It also hands each whole data frame to the session's reader right where the library parsed it
(``frame_sink``: coordinator/io/frontdoor/reader.py ``FrameReader``), instead of queueing it for the
reader's task to be woken for: a fragmented message, and a text frame the reader cannot take
(not UTF-8), go to the library's queue as before, and so does every frame after them.
"""

from __future__ import annotations

import asyncio
import traceback
from dataclasses import dataclass, field
from typing import Any

import msgspec
import structlog
from websockets.asyncio.server import ServerConnection
from websockets.exceptions import ConnectionClosed
from websockets.frames import CloseCode

from coordinator.auth import Principal
from protocol import Codec
from protocol import errors as codes
from protocol.chunkview import DataChunkView, own_frame
from wireio.frame_sink import SinkReceive
from wireio.wsbulk import BULK_MIN_BYTES, send_frame, takes_frame_now, write_frame

log = structlog.get_logger("coordinator.io.frontdoor.server")

# Coalesced frames stay under websockets' default 1 MiB receive limit of our peers.
MAX_OUT_FRAME_BYTES = 512 * 1024
TAKE_BYTES = 4 << 20  # a writer takes about this much of a long backlog at a time
FRAME_TARGET_BYTES = MAX_OUT_FRAME_BYTES * 3 // 4  # a batch cut by recent message sizes aims at this


class FailFastConnection(SinkReceive, ServerConnection):
    """A ``ServerConnection`` that closes its transport right after sending 1009 (message too big), reads
    big binary frames (relayed chunks) past the library's copies (wireio/wsbulk.py ``BulkReceive``), and
    hands whole data frames, text ones too, to its ``frame_sink`` (module docstring; wireio/frame_sink.py
    ``SinkReceive``)."""

    takes_text = True

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        sent = self.protocol.close_sent
        if sent is not None and sent.code == CloseCode.MESSAGE_TOO_BIG and not self.transport.is_closing():
            # The 1009 frame is already in the transport's buffer; close() sends it, then
            # closes the socket without reading the rest of the oversize payload.
            self.transport.close()


@dataclass(eq=False)
class Session:
    """One open websocket: its outgoing queue and the writer that drains it."""

    conn_id: int
    ws: ServerConnection
    codec: Codec
    role: str = ""
    io: list[int] = field(default_factory=lambda: [0, 0, 0, 0])  # FrameCounters: its role's counters
    pending: list[Any] = field(default_factory=list)
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    close_with: tuple[int, str] | None = None
    principal: Principal | None = None
    killed: bool = False  # closed by the server itself (a limit, a revoked token): input is dropped
    writer: asyncio.Task[None] | None = None
    unsent: int = 0  # encoded bytes the writer has taken (its batch's frames) and not yet handed to the socket
    msg_bytes: float = 0.0  # the encoded size of this session's recent messages (0: nothing sent yet)
    parked: bool = False  # the writer waits on ``wake`` with nothing in hand (send_now may write in its place)
    sent_now: bool = False  # send_now wrote a frame this loop turn: the turn's later batches go to the writer

    def pending_bytes(self) -> int:
        """About how many bytes wait in ``pending``, from at most 64 evenly spaced messages."""
        pending = self.pending
        sample = pending[:: max(1, len(pending) // 64)]
        return sum(map(approx_bytes, sample)) * len(pending) // max(1, len(sample))

    def out_bytes(self) -> int:
        """Bytes waiting for the peer: the writer's encoded frames not yet sent (exact), the
        socket's write buffer (exact) and the messages not yet encoded (estimated)."""
        transport = self.ws.transport
        buffered = transport.get_write_buffer_size() if transport is not None else 0
        return self.unsent + buffered + (self.pending_bytes() if self.pending else 0)

    async def write_loop(self) -> None:
        """Send everything pending as one frame per wake-up; close when the core asked to."""
        ws, codec = self.ws, self.codec
        try:
            while True:
                self.parked = True
                try:
                    await self.wake.wait()
                finally:
                    self.parked = False
                self.wake.clear()
                while self.pending:
                    batch = self._take()
                    frames = self._frames(batch)
                    # The real size of what is taken: a slow reader's backlog is judged by it
                    # (finding 2 of issue 17: a ``plans`` reply used to count as 64 bytes).
                    self.unsent = sum(map(len, frames)) if len(frames) > 1 else len(frames[0])
                    size = self.unsent / len(batch)  # exact: what the next batch is cut by
                    self.msg_bytes = size if not self.msg_bytes else 0.5 * (self.msg_bytes + size)
                    for frame in frames:
                        self.io[2] += 1  # FrameCounters.FRAMES_OUT, BYTES_OUT
                        self.io[3] += len(frame)
                        await send_frame(ws, frame, codec.text)  # big ones without the library's copies
                        self.unsent -= len(frame)
                if self.close_with is not None:
                    await ws.close(*self.close_with)
                    return
        except ConnectionClosed:
            return
        except Exception:
            # A frame that cannot be encoded must cost this session, never the coordinator.
            log.error(
                "cannot send to a session; closing it", conn_id=self.conn_id, exception=traceback.format_exc()
            )
            await ws.close(codes.CLOSE_INTERNAL, "internal error; see coordinator log")

    def send_now(self, msgs: list[Any]) -> bool:
        """Write ``msgs`` as one frame now, in the caller's step, in the writer's place; False: nothing written.

        Only while the writer is parked with nothing pending (so nothing it holds can be overtaken), the
        session is not closing, and the connection takes the frame without waiting (open, not paused over its
        high-water mark, no other send under way); a frame of ``BULK_MIN_BYTES`` or more (a relayed chunk: the
        writer's send copies it less; a batch it would cut), or one that cannot be encoded, is left to the writer
        too (it sends, cuts, or logs and closes; recent messages' sizes say so before encoding, as a chunk's type
        does). A lone step's reply then leaves in the step that released it (``CoreDriver.deliver``), not a loop
        turn later from the writer's task, woken for it. At most one frame a loop turn: a batch that comes later in
        the same turn (the next step released by the same commit, another peer's step) goes to the writer, which
        coalesces the rest of the turn into one frame, as before send_now. A write that fails on the way aborts the
        connection, as ``send`` would.
        """
        if (self.sent_now or not self.parked or self.pending or self.close_with is not None or self.killed
                or len(msgs) > 32 or type(msgs[0]) is DataChunkView or self.msg_bytes * len(msgs) >= BULK_MIN_BYTES):
            return False
        ws = self.ws
        if not takes_frame_now(ws):
            return False
        try:
            frame = self._encode(msgs)
        except Exception:
            return False  # the writer encodes it again, and logs and closes the session
        size = len(frame)
        if size >= BULK_MIN_BYTES:
            return False  # the writer's send: a big frame (a relayed chunk) without the library's copies, or cut
        write_frame(ws, self.codec.text, frame)
        self.sent_now = True  # until this turn ends: the steps after it in this turn coalesce in the writer
        asyncio.get_running_loop().call_soon(self._turn_over)
        io = self.io
        io[2] += 1  # FrameCounters.FRAMES_OUT, BYTES_OUT
        io[3] += size
        each = size / len(msgs)
        self.msg_bytes = each if not self.msg_bytes else 0.5 * (self.msg_bytes + each)
        return True

    def _turn_over(self) -> None:
        self.sent_now = False

    def _take(self) -> list[Any]:
        """The next batch: everything pending, or a long backlog's first few MiB (by estimate), so the
        writer never encodes tens of MB in one go on the loop everyone shares (issue 17 finding 1)."""
        pending = self.pending
        if len(pending) <= 32:
            self.pending = []
            return pending
        if self.msg_bytes:
            # Cut by the exact size of the last messages sent, so a batch fits one frame: no
            # oversize frame to encode twice, and no per-message sizing on the hot path.
            count = max(32, int(FRAME_TARGET_BYTES / self.msg_bytes))
            if len(pending) <= count:
                self.pending = []
                return pending
            self.pending = pending[count:]
            return pending[:count]
        if self.pending_bytes() <= TAKE_BYTES:  # nothing sent yet: the sampled estimate
            self.pending = []
            return pending
        size = 0
        for index, msg in enumerate(pending):
            size += approx_bytes(msg)
            if size > TAKE_BYTES and index:
                self.pending = pending[index:]
                return pending[:index]
        self.pending = []
        return pending

    def _frames(self, batch: list[Any]) -> list[bytes]:
        """Encode ``batch`` as one frame, or as several when one would exceed what peers accept.

        The common case encodes once. An oversize batch (a burst to a slow reader) is cut into
        runs by each message's estimated size and each run encoded once more, instead of being
        re-encoded in halves (N log N work and twice the memory for a large backlog).
        """
        if len(batch) == 1 or self.msg_bytes * len(batch) < MAX_OUT_FRAME_BYTES:
            frame = self._encode(batch)
            if len(frame) <= MAX_OUT_FRAME_BYTES or len(batch) == 1:
                return [frame]
        # else recent messages were large (relayed chunks): cut first, not encoded whole and then again
        frames: list[bytes] = []
        start = size = 0
        for index, msg in enumerate(batch):
            n = approx_bytes(msg)
            if index > start and size + n > MAX_OUT_FRAME_BYTES:
                frames += self._frames_halving(batch[start:index])
                start, size = index, 0
            size += n
        frames += self._frames_halving(batch[start:])
        return frames

    def _frames_halving(self, batch: list[Any]) -> list[bytes]:
        """Encode ``batch``, halving it while a frame still exceeds the limit (the size estimate
        is a lower bound, so a run of large messages can still come out too big)."""
        frame = self._encode(batch)
        if len(frame) <= MAX_OUT_FRAME_BYTES or len(batch) == 1:
            return [frame]
        half = len(batch) // 2
        return self._frames_halving(batch[:half]) + self._frames_halving(batch[half:])

    def _encode(self, batch: list[Any]) -> bytes:
        """One frame: a relayed chunk alone, that came in alone, is the frame it came in (protocol/chunkview.py)."""
        if len(batch) == 1 and type(batch[0]) is DataChunkView and not self.codec.text:
            frame = own_frame(batch[0])
            if frame is not None:
                return frame
        return self.codec.encode_safe(batch)


def approx_bytes(msg: Any) -> int:
    """A cheap estimate of one message's encoded size: exact for pre-encoded ones, else its
    string or bytes ``data`` (events carry the large payloads), else a size per row of the
    replies that carry lists (``plans``, ``workers``, ``subscribed``), else a small constant."""
    if isinstance(msg, msgspec.Raw):
        return len(msg)
    data = getattr(msg, "data", None)
    if isinstance(data, str | bytes | memoryview):
        return len(data) + 64
    rows = getattr(msg, "plans", None) or getattr(msg, "workers", None) or getattr(msg, "plan_ids", None)
    if isinstance(rows, list):
        return 64 + ROW_BYTES * len(rows)
    return 64


ROW_BYTES = 160  # what one row of a listing (a plan summary, a worker, a plan id) is counted as, at least


async def close_or_abort(ws: ServerConnection, code: int, reason: str, timeout_s: float) -> None:
    try:
        async with asyncio.timeout(timeout_s):
            await ws.close(code, reason)
    except TimeoutError:
        ws.transport.abort()
