"""A dialling side's binary frame, masked and written without the library's frame object (issue #29).

The SDK and the worker agent dial out, so every frame they send is masked (RFC 6455 §5.3). websockets' send of a
~60-byte session frame builds a ``Frame``, checks it, serializes it through a ``BytesIO`` and draws its mask key with
``secrets.token_bytes(4)``: a ``getrandom`` system call per frame. :func:`write_masked` writes the same bytes, the
header (RFC 6455 §5.2: FIN, opcode 2, the length in 7, 16 or 64 bits, the mask bit), the key and the payload masked
with the library's C ``apply_mask``, straight to the transport in one write.

Mask keys (:func:`mask_key`) still come from ``os.urandom``, the operating system's CSPRNG that ``secrets`` reads,
4 KiB at a time, cut into 1,024 keys. §5.3 asks that a key be unpredictable and that one key not make the next one
simple to predict: each key is four fresh bytes of the CSPRNG's output, so seeing any number of sent keys says
nothing about the keys not yet sent; only the process itself, which writes the payloads anyway, holds the ones
drawn ahead. Keys are popped from a list (one atomic step: two threads' loops never send one key twice), and a
forked child forgets the parent's keys (``os.register_at_fork``), so the two never send the same ones.

The library's state machine stays honest: a frame is written here only on a client connection that is open, with
no extension, no fragmented message in progress (``expect_continuation_frame``), none of the library's own writes
waiting and its debug log off. A final binary frame changes none of the protocol's state, so the library sees the
same connection as after its own ``send_binary``. Otherwise :func:`write_masked` returns False and the caller uses
the library's send, which raises what it raised before (a closing connection, a fragment in progress). Text,
close, ping and pong frames are always the library's. Used by ``wireio/wsbulk.py``'s ``write_frame`` and
``send_frame``, the writes of the SDK (``fleetwire/client.py``) and the worker agent (``worker_agent/agent.py``).
"""

from __future__ import annotations

import os
import struct
from typing import Final

from websockets.asyncio.connection import Connection
from websockets.protocol import CLIENT, OPEN

try:
    from websockets.speedups import apply_mask
except ImportError:  # pragma: no cover - the C extension ships in every wheel we install
    from websockets.utils import apply_mask

__all__ = ["KEY_BLOCK_BYTES", "mask_key", "masked_frame", "write_masked"]

#: Bytes drawn from ``os.urandom`` at a time: 1,024 mask keys.
KEY_BLOCK_BYTES: Final = 4096
_SPLIT_KEYS: Final = struct.Struct("4s" * (KEY_BLOCK_BYTES // 4)).unpack
#: A payload at least this long goes to the transport as two buffers (header and key, masked payload): not joined.
_JOIN_MAX_BYTES: Final = 16 << 10
#: The first two header bytes of a final, masked binary frame of each 7-bit length (0-125).
_SHORT_HEADS: Final = tuple(bytes((0x82, 0x80 | length)) for length in range(126))

_keys: list[bytes] = []


def mask_key() -> bytes:
    """Four fresh bytes of ``os.urandom``'s output, drawn :data:`KEY_BLOCK_BYTES` at a time (module docstring)."""
    try:
        return _keys.pop()
    except IndexError:
        _keys.extend(_SPLIT_KEYS(os.urandom(KEY_BLOCK_BYTES)))
        return _keys.pop()


def _forget_keys() -> None:
    _keys.clear()


os.register_at_fork(after_in_child=_forget_keys)


def _head(length: int) -> bytes:
    """The header of a final, masked binary frame of ``length`` payload bytes, without its key."""
    if length < 126:
        return _SHORT_HEADS[length]
    if length < 1 << 16:
        return struct.pack("!BBH", 0x82, 0xFE, length)
    return struct.pack("!BBQ", 0x82, 0xFF, length)


def masked_frame(payload: bytes | bytearray | memoryview) -> bytes:
    """One final binary frame as a client sends it: header, a fresh key and ``payload`` masked with it."""
    key = mask_key()
    length = len(payload) if type(payload) is not memoryview else payload.nbytes
    return b"".join((_head(length), key, apply_mask(payload, key)))


def write_masked(ws: Connection, payload: bytes | bytearray | memoryview) -> bool:
    """Write ``payload`` as one final binary frame of ``ws``, a client connection, now (module docstring): True.

    False, writing nothing, where the library must send it (not a client, not open, an extension, a fragmented
    message in progress, the library's own writes waiting, its debug log on, no transport or a closing one).
    An error of the transport's write is the caller's, as from the library's ``send_data``.
    """
    protocol = ws.protocol
    transport = ws.transport
    if (protocol.side is not CLIENT or protocol.state is not OPEN or protocol.extensions
            or protocol.expect_continuation_frame or protocol.writes or protocol.debug
            or transport is None or transport.is_closing()):  # fmt: skip
        return False
    try:  # mask_key(), inline: one call fewer on every frame
        key = _keys.pop()
    except IndexError:
        key = mask_key()
    length = len(payload) if type(payload) is not memoryview else payload.nbytes
    if length < 126:  # the session's frames
        transport.write(b"".join((_SHORT_HEADS[length], key, apply_mask(payload, key))))
    elif length < _JOIN_MAX_BYTES:
        transport.write(b"".join((_head(length), key, apply_mask(payload, key))))
    else:  # a big frame: its masked copy is the only one
        transport.writelines((_head(length) + key, apply_mask(payload, key)))
    return True
