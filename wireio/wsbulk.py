"""Sending a big binary frame without the websockets library's copies of it (the data plane's relayed chunks).

``Connection.send`` serializes a frame into a ``BytesIO`` (a copy of the payload, another for
``getvalue``, and on a client the masked copy before both), then writes the result. For the
session's small frames that is nothing; for relayed chunks (256 KiB frames, a GiB a transfer)
it was the largest cost of the relay's senders after the kernel's: 17 % of a relaying client's
samples in ``Frame.serialize`` (bench/data_plane.py ``--profile``).

:func:`send_frame` sends a binary frame itself (``wireio/wsmask.py`` ``write_binary``): the header
(RFC 6455 §5.2: FIN, opcode 2, the length in 7, 16 or 64 bits, the mask bit and key on a
client) and the payload go to the transport; a client masks the payload with a fresh key (one
copy, the library's C ``apply_mask``), a server writes a big immutable ``bytes`` as it is (no
copy: the transport may hold it until it is sent) and a small or mutable one joined to its
header (one copy). It then waits for the transport's buffer to drain, as ``send`` does.
Anything else — text, a connection that is not open, a compression extension, a fragmented
send in progress — goes through ``send`` unchanged, so the library keeps every rule it enforces.
Frames from both paths are whole writes on one event loop, so they never interleave; the
library's own control frames (ping, pong, close) go between them as usual.

:class:`BulkReceive` is the same on the reading side, a mixin for the library's connection classes
(``create_connection``): the library appends every read to a buffer, slices each frame out of it
and joins it into the message (three copies of every byte, and a buffer that grows and moves);
relayed chunk frames cost ~0.2 CPU s per GiB there. The mixin follows the frame boundaries of
the stream itself: a final binary frame of at least :data:`BULK_MIN_BYTES` (within the
connection's size limit, masked as the side requires, not inside a fragmented message, while the
connection is open) is kept as the reads that carry it, joined once whole (one copy, none for a frame
that was one read) and unmasked once on a server, then handed to the
library as the frame it parsed would have been (``process_event``: the same queue, order and flow
control); every other byte goes to the library as it came, so it parses and answers everything
else itself (control frames, fragments, a frame over the limit: 1009) and keeps every rule.
It takes over right after the opening handshake's HTTP head (its first blank line), once the
library's parser is seen waiting there for a frame with nothing buffered; where it is not (a
handshake that failed, a library that parses otherwise), the library reads everything, as before.
Bulk frames are only taken while the connection is open, so bytes after a refused handshake (a
401's body) always reach the library as they came.
"""

from __future__ import annotations

import asyncio
import contextlib
import struct
from typing import Final

from websockets.asyncio.client import ClientConnection
from websockets.asyncio.connection import Connection
from websockets.frames import Frame, Opcode
from websockets.protocol import OPEN, SERVER, Protocol, State

from protocol.transfer.http1 import head_end
from wireio.wsmask import write_binary

try:
    from websockets.speedups import apply_mask
except ImportError:  # pragma: no cover - the C extension ships in every wheel we install
    from websockets.utils import apply_mask

__all__ = ["BULK_MIN_BYTES", "BulkClientConnection", "BulkReceive", "frame_header", "send_frame", "takes_frame_now",
           "write_frame", "write_frame_now"]  # fmt: skip

#: The smallest binary frame sent by :func:`send_frame` itself (smaller: the library's copies cost nothing).
BULK_MIN_BYTES: Final = 64 << 10
_FIN_BINARY: Final = 0x82
_MASKED: Final = 0x80


def frame_header(length: int, mask: bytes = b"") -> bytes:
    """The RFC 6455 header of one final binary frame of ``length`` payload bytes (masked with ``mask``)."""
    bit = _MASKED if mask else 0
    if length < 126:
        head = struct.pack("!BB", _FIN_BINARY, bit | length)
    elif length < 1 << 16:
        head = struct.pack("!BBH", _FIN_BINARY, bit | 126, length)
    else:
        head = struct.pack("!BBQ", _FIN_BINARY, bit | 127, length)
    return head + mask


async def send_frame(ws: Connection, frame: bytes | bytearray | memoryview, text: bool = False) -> None:
    """``await ws.send(frame, text=text)``, with a big binary frame written without the library's copies.

    Raises:
        websockets.ConnectionClosed: as ``send`` does, when the connection is closed or breaks.
    """
    # Any binary frame, a client's masked or a server's plain, is written by wireio/wsmask.py where it may.
    if text or getattr(ws, "send_in_progress", None) is not None or not write_binary(ws, frame):
        await ws.send(frame, text=text)
        return
    transport = ws.transport
    try:
        await ws.drain()
    except Exception as exc:  # the transport broke under the write: close as send() does
        with contextlib.suppress(AttributeError):
            ws.set_connection_exc(exc)
        transport.abort()
        await asyncio.shield(ws.connection_lost_waiter)
        raise ws.close_exc from exc


class BulkReceive(Connection):
    """Reads big binary frames without the library's copies (see the module docstring); mix in first."""

    _bulk_reader: _BulkReader | None = None
    _bulk_scan: bytes | None = b""  # the HTTP head's last 3 bytes so far; None: decided (reading frames, or off)
    bulk_frames = 0
    """Frames read here rather than by the library (tests, and to see that it is on)."""
    small_frames = 0
    """Small binary frames read here, whole in one read (tests)."""

    def data_received(self, data: bytes) -> None:
        reader = self._bulk_reader
        if reader is not None:
            reader.feed(data)
            return
        tail = self._bulk_scan
        if tail is None:  # off: the library reads everything
            super().data_received(data)
            return
        # The opening handshake: its HTTP head (a request or a 101 answer) ends at the first blank line;
        # the frames start right after it, where the library's parser then waits (checked, not assumed).
        joined = tail + data[: 1 << 16]
        end = head_end(joined, len(joined))  # protocol/transfer/http1.py
        if end < 0:
            self._bulk_scan = joined[-3:] if len(data) < 1 << 16 else None  # a head this long: leave it
            super().data_received(data)
            return
        cut = end - len(tail)
        super().data_received(data[:cut])
        self._bulk_scan = None
        if not _at_frame_boundary(self.protocol):
            if cut < len(data):
                super().data_received(data[cut:])
            return
        reader = self._bulk_reader = _BulkReader(self)
        if cut < len(data):
            reader.feed(data[cut:])

    def _bulk_pass(self, data: bytes | memoryview) -> None:
        """Bytes the library reads itself (whole frames' worth, or the rest of one it has begun)."""
        super().data_received(data)  # type: ignore[arg-type]  # its reader appends any buffer

    def _small_frame(self, payload: bytes) -> None:
        """A whole small final binary frame read here (``_BulkReader._read_head``): to the library's message queue."""
        self.small_frames += 1
        self.process_event(Frame(Opcode.BINARY, payload))

    def _bulk_frame(self, payload: bytes) -> None:
        """A whole bulk frame: to the library's message queue, as one it parsed."""
        self.bulk_frames += 1
        self.process_event(Frame(Opcode.BINARY, payload))


class BulkClientConnection(BulkReceive, ClientConnection):
    """The SDK's and the worker agent's connection to the coordinator (``connect(create_connection=...)``)."""


_HEADER, _BULK, _PASS = 0, 1, 2


class _BulkReader:
    """The frame boundaries of one connection's stream: bulk frames read here, every other byte passed on."""

    __slots__ = ("_conn", "_head", "_left", "_mask", "_masked", "_parts", "_state")

    def __init__(self, conn: BulkReceive) -> None:
        self._conn = conn
        self._masked = conn.protocol.side is SERVER  # a server reads masked frames (RFC 6455 §5.1)
        self._state = _HEADER
        self._head = bytearray()  # a header read so far
        # A bulk frame's payload as it came: the reads' bytes (immutable) or views of them, joined once it is whole.
        # (Not a bytearray of its length filled by slice assignment: CPython zero-fills that, and copies a memoryview
        # assigned to a slice into a temporary bytearray first: three passes over every byte before the join's one.)
        self._parts: list[bytes | memoryview] = []
        self._mask = b""
        self._left = 0  # _PASS: payload bytes still for the library; _BULK: still to come

    def feed(self, data: bytes) -> None:
        view = memoryview(data)
        pos, end = 0, len(data)
        while pos < end:
            state = self._state
            if state == _BULK:
                count = min(self._left, end - pos)
                part = data if count == end and pos == 0 else view[pos : pos + count]
                self._parts.append(part if type(data) is bytes else bytes(part))  # a mutable read's bytes: copied
                self._left -= count
                pos += count
                if not self._left:  # whole: its parts joined (one copy), unmasked once on a server
                    parts, self._parts, self._state = self._parts, [], _HEADER
                    payload = b"".join(parts)
                    self._conn._bulk_frame(apply_mask(payload, self._mask) if self._masked else payload)
            elif state == _PASS:
                count = min(self._left, end - pos)
                self._conn._bulk_pass(data if count == end and pos == 0 else view[pos : pos + count])
                self._left -= count
                pos += count
                if not self._left:
                    self._state = _HEADER
            else:
                pos = self._read_head(view, pos, end)

    def _read_head(self, view: memoryview, pos: int, end: int) -> int:
        """Take header bytes from ``view[pos:end]``; once whole, decide the frame's path. Where it got to."""
        head = self._head
        begin = -1 if head else pos  # where the frame starts in ``view`` when its whole header is in it
        while True:
            need = 2
            if len(head) >= 2:
                ext = head[1] & 0x7F
                need += (2 if ext == 126 else 8 if ext == 127 else 0) + (4 if head[1] & 0x80 else 0)
            if len(head) >= need:
                break
            if pos == end:
                return pos  # more header to come
            count = min(need - len(head), end - pos)
            head += view[pos : pos + count]
            pos += count
        ext = head[1] & 0x7F
        at = 2 if ext < 126 else 4 if ext == 126 else 10
        length = ext if ext < 126 else int.from_bytes(head[2:at], "big")
        masked = bool(head[1] & 0x80)
        protocol = self._conn.protocol
        limit = getattr(protocol, "max_message_size", 0)  # None: no limit; 0: a library that names it otherwise
        fragment = getattr(protocol, "max_fragment_size", None)
        if length < BULK_MIN_BYTES and begin >= 0 and pos + length <= end:
            # A small frame whole in this read (the session's frames). A final binary one that the library would
            # queue as it is is made here, as a bulk frame is (no pass through the library's parser); any other
            # goes to the library in one piece, its header and payload together (one pass of its parser, not two).
            stop = pos + length
            if (head[0] == 0x82 and masked == self._masked and (limit is None or length <= limit)
                    and (fragment is None or length <= fragment) and protocol.state is OPEN
                    and getattr(protocol, "current_size", 0) is None):  # fmt: skip
                payload = apply_mask(view[pos:stop], bytes(head[at : at + 4])) if masked else bytes(view[pos:stop])
                head.clear()
                self._conn._small_frame(payload)
            else:
                head.clear()
                self._conn._bulk_pass(view[begin:stop])
            return stop
        if (head[0] == 0x82 and masked == self._masked and length >= BULK_MIN_BYTES
                and (limit is None or length <= limit)
                and (fragment is None or length <= fragment) and protocol.state is OPEN
                and getattr(protocol, "current_size", 0) is None):  # fmt: skip
            self._mask = bytes(head[at : at + 4]) if masked else b""
            self._left = length
            self._state = _BULK
        else:  # the library parses this frame: its header now, its payload as it comes
            self._conn._bulk_pass(bytes(head))
            self._left = length
            self._state = _PASS if length else _HEADER
        self._head = bytearray()
        return pos


def takes_frame_now(ws: Connection) -> bool:
    """Whether ``ws`` takes a frame now, in the caller's step, without making a sender wait: open, its transport's
    buffer under the high-water mark (else ``send`` would wait in ``drain``; the writer's ``send`` keeps the
    backpressure), not closing, and no other send under way (its fragments must not interleave)."""
    transport = ws.transport
    return not (ws.protocol.state is not State.OPEN or ws.paused or getattr(ws, "send_in_progress", None) is not None
                or transport is None or transport.is_closing())  # fmt: skip


def write_frame(ws: Connection, text: bool, frame: bytes | memoryview) -> None:
    """Write ``frame`` to ``ws`` now, in the caller's step (:func:`takes_frame_now` said it may); a binary frame
    (a client's masked, a server's plain) by ``wireio/wsmask.py`` where it may. A write that fails on the way aborts
    the connection, as ``send`` would: its reader then sees it end."""
    try:
        if text:
            ws.protocol.send_text(frame)
            ws.send_data()
        elif not write_binary(ws, frame):  # a binary frame without the library's frame object (wsmask)
            ws.protocol.send_binary(frame)
            ws.send_data()
    except Exception as exc:  # the transport broke under the write
        with contextlib.suppress(AttributeError):
            ws.set_connection_exc(exc)
        ws.transport.abort()


def write_frame_now(ws: Connection, text: bool, frame: bytes) -> bool:
    """:func:`write_frame` when :func:`takes_frame_now`; False, writing nothing, when not."""
    if not takes_frame_now(ws):
        return False
    write_frame(ws, text, frame)
    return True


def _at_frame_boundary(protocol: Protocol) -> bool:
    """Whether the library's parser waits for a frame's first byte with nothing buffered (its frame loop's
    ``at_eof``): only then do this reader's boundaries and the library's agree. Anything else: False."""
    try:
        if protocol.reader.buffer or protocol.reader.eof:
            return False
    except AttributeError:
        return False
    chain: list[str] = []
    generator = getattr(protocol, "parser", None)
    while generator is not None and len(chain) < 8:
        chain.append(getattr(generator, "__name__", ""))
        generator = getattr(generator, "gi_yieldfrom", None)
    return chain[-2:] == ["parse", "at_eof"]
