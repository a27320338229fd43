"""Sending a big binary frame without the websockets library's copies of it (the data plane's relayed chunks).

``Connection.send`` serializes a frame into a ``BytesIO`` (a copy of the payload, another for
``getvalue``, and on a client the masked copy before both), then writes the result. For the
session's small frames that is nothing; for relayed chunks (512 KiB frames, a GiB a transfer)
it was the largest cost of the relay's senders after the kernel's: 17 % of a relaying client's
samples in ``Frame.serialize`` (bench/data_plane.py ``--profile``).

:func:`send_frame` sends a binary frame of at least :data:`BULK_MIN_BYTES` itself: the header
(RFC 6455 §5.2: FIN, opcode 2, the length in 7, 16 or 64 bits, the mask bit and key on a
client) and the payload go to the transport as two buffers; a client masks the payload with a
fresh key from ``os.urandom`` (one copy, the library's C ``apply_mask``), a server writes it as
it is (no copy: an immutable ``bytes`` the transport may hold until it is sent). It then waits
for the transport's buffer to drain, as ``send`` does. Anything else — text, small frames, a
connection that is not open, a compression extension, a fragmented send in progress, a mutable
server payload — goes through ``send`` unchanged, so the library keeps every rule it enforces.
Frames from both paths are whole writes on one event loop, so they never interleave; the
library's own control frames (ping, pong, close) go between them as usual.
"""

from __future__ import annotations

import asyncio
import os
import struct
from typing import Final

from websockets.asyncio.connection import Connection
from websockets.protocol import CLIENT, OPEN

try:
    from websockets.speedups import apply_mask
except ImportError:  # pragma: no cover - the C extension ships in every wheel we install
    from websockets.utils import apply_mask

__all__ = ["BULK_MIN_BYTES", "frame_header", "send_frame"]

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
    length = len(frame) if not isinstance(frame, memoryview) else frame.nbytes
    transport = ws.transport
    client = ws.protocol.side is CLIENT
    if (text or length < BULK_MIN_BYTES or ws.protocol.state is not OPEN or ws.protocol.extensions
            or ws.send_in_progress is not None or transport is None or transport.is_closing()
            or (not client and type(frame) is not bytes)):
        await ws.send(frame, text=text)
        return
    if client:
        mask = os.urandom(4)
        transport.writelines((frame_header(length, mask), apply_mask(frame, mask)))
    else:
        transport.writelines((frame_header(length), frame))
    try:
        await ws.drain()
    except Exception as exc:  # the transport broke under the write: close as send() does
        ws.set_connection_exc(exc)
        transport.abort()
        await asyncio.shield(ws.connection_lost_waiter)
        raise ws.close_exc from exc
