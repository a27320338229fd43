"""A binary frame written without the library's frame object: a dialling side's masked, a server's plain (issue #29).

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

The coordinator's server connections send the same frames unmasked (§5.1: a server never masks), and the library's
send costs them the same ``Frame``, its checks and a ``BytesIO`` a frame: :func:`write_binary` writes a server's
frame as the header and the payload in one write (a small frame joined: one copy, as the library's ``getvalue``; a
big immutable ``bytes``, a relayed chunk, as two buffers with no copy; a big mutable one joined, so the transport
never holds a buffer its owner may change), and a client's as :func:`write_masked` does.

The library's state machine stays honest: a frame is written here only on a connection that is open, with no
extension, no fragmented message in progress (``expect_continuation_frame``), none of the library's own writes
waiting and its debug log off. A final binary frame changes none of the protocol's state, so the library sees the
same connection as after its own ``send_binary``. Otherwise :func:`write_binary` (and :func:`write_masked`) returns
False and the caller uses the library's send, which raises what it raised before (a closing connection, a fragment
in progress). Text, close, ping and pong frames are always the library's. Used by ``wireio/wsbulk.py``'s
``write_frame`` and ``send_frame``: the writes of the SDK (``fleetwire/client.py``), the worker agent
(``worker_agent/agent.py``) and the coordinator's sessions (``coordinator/io/frontdoor/connection.py``).
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

__all__ = ["KEY_BLOCK_BYTES", "mask_key", "masked_frame", "write_binary", "write_masked"]

#: Bytes drawn from ``os.urandom`` at a time: 1,024 mask keys.
KEY_BLOCK_BYTES: Final = 4096
_SPLIT_KEYS: Final = struct.Struct("4s" * (KEY_BLOCK_BYTES // 4)).unpack
#: A payload at least this long goes to the transport as two buffers (header and key, masked payload): not joined.
_JOIN_MAX_BYTES: Final = 16 << 10
#: The first two header bytes of a final, masked binary frame of each 7-bit length (0-125).
_SHORT_HEADS: Final = tuple(bytes((0x82, 0x80 | length)) for length in range(126))
#: The header of a final, unmasked (a server's) binary frame of each 7-bit length (0-125).
_PLAIN_HEADS: Final = tuple(bytes((0x82, length)) for length in range(126))

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


def _plain_head(length: int) -> bytes:
    """The header of a final, unmasked binary frame of ``length`` payload bytes (a server's)."""
    if length < 126:
        return _PLAIN_HEADS[length]
    if length < 1 << 16:
        return struct.pack("!BBH", 0x82, 126, length)
    return struct.pack("!BBQ", 0x82, 127, length)


def write_binary(ws: Connection, payload: bytes | bytearray | memoryview) -> bool:
    """Write ``payload`` as one final binary frame of ``ws`` now, masked on a client, plain on a server (module
    docstring): True.

    False, writing nothing, where the library must send it (not open, an extension, a fragmented message in
    progress, the library's own writes waiting, its debug log on, no transport or a closing one).
    An error of the transport's write is the caller's, as from the library's ``send_data``.
    """
    protocol = ws.protocol
    transport = ws.transport
    if (protocol.state is not OPEN or protocol.extensions or protocol.expect_continuation_frame or protocol.writes
            or protocol.debug or transport is None or transport.is_closing()):  # fmt: skip
        return False
    length = len(payload) if type(payload) is not memoryview else payload.nbytes
    if protocol.side is not CLIENT:  # a server's frame: never masked (RFC 6455 §5.1)
        if length < 126:  # the session's frames
            transport.write(_PLAIN_HEADS[length] + payload)
        elif length < _JOIN_MAX_BYTES or type(payload) is not bytes:  # small, or mutable: the transport's own copy
            transport.write(_plain_head(length) + payload)
        else:  # a big immutable frame (a relayed chunk): no copy
            transport.writelines((_plain_head(length), payload))
        return True
    try:  # mask_key(), inline: one call fewer on every frame
        key = _keys.pop()
    except IndexError:
        key = mask_key()
    if length < 126:  # the session's frames
        transport.write(b"".join((_SHORT_HEADS[length], key, apply_mask(payload, key))))
    elif length < _JOIN_MAX_BYTES:
        transport.write(b"".join((_head(length), key, apply_mask(payload, key))))
    else:  # a big frame: its masked copy is the only one
        transport.writelines((_head(length) + key, apply_mask(payload, key)))
    return True


def write_masked(ws: Connection, payload: bytes | bytearray | memoryview) -> bool:
    """:func:`write_binary` on a client connection; False, writing nothing, on a server's (it must not mask)."""
    return ws.protocol.side is CLIENT and write_binary(ws, payload)
