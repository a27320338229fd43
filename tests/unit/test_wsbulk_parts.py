"""wireio/wsbulk.py's reader: a bulk frame's payload kept as the reads that carry it and joined once (DP29).

The frames' contents, order and every cut of the stream are tests/integration/test_wsbulk.py's; these check the
copies: a read that is a whole payload is handed on as it is, a frame cut across reads is held once (no zeroed
buffer of its size and then a copy of it), and a mutable read's bytes are copied before the caller reuses it.
"""

from __future__ import annotations

import os
import tracemalloc
from types import SimpleNamespace
from typing import Any

from websockets.frames import Frame, Opcode
from websockets.protocol import CLIENT, OPEN, SERVER

from wireio.wsbulk import _BulkReader


class _Conn:
    """What _BulkReader reads of a connection, and what it hands on."""

    def __init__(self, side: Any) -> None:
        self.protocol = SimpleNamespace(side=side, max_message_size=None, max_fragment_size=None, state=OPEN,
                                        current_size=None)  # fmt: skip
        self.frames: list[bytes] = []

    def _bulk_frame(self, payload: bytes) -> None:
        self.frames.append(payload)

    def _small_frame(self, payload: bytes) -> None:
        self.frames.append(payload)

    def _bulk_pass(self, data: Any) -> None:
        raise AssertionError("a bulk frame went to the library")


def _header(length: int) -> bytes:
    return Frame(Opcode.BINARY, bytes(length)).serialize(mask=False)[:-length]


def test_a_read_that_is_the_whole_payload_is_handed_on_as_it_is() -> None:
    payload = os.urandom(256 << 10)
    conn = _Conn(CLIENT)  # a client reads the server's unmasked frames
    reader = _BulkReader(conn)  # type: ignore[arg-type]
    reader.feed(_header(len(payload)))
    reader.feed(payload)
    assert conn.frames == [payload] and conn.frames[0] is payload  # no copy (was a buffer's bytes: a new object)


def test_a_frame_cut_across_reads_is_held_once() -> None:
    payload = os.urandom(1 << 20)
    stream = _header(len(payload)) + payload
    reads = [stream[pos : pos + (64 << 10)] for pos in range(0, len(stream), 64 << 10)]
    conn = _Conn(CLIENT)
    reader = _BulkReader(conn)  # type: ignore[arg-type]
    tracemalloc.start()
    try:
        for read in reads:
            reader.feed(read)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert conn.frames == [payload]
    # The join's one copy, and little else (a zeroed bytearray of the frame's size and then bytes() of it: 2 MiB).
    assert peak < 1.25 * len(payload), peak


def test_a_servers_masked_frame_cut_across_reads_and_a_mutable_read() -> None:
    payload = os.urandom((128 << 10) + 3)
    stream = Frame(Opcode.BINARY, payload).serialize(mask=True)
    conn = _Conn(SERVER)  # a server reads the client's masked frames
    reader = _BulkReader(conn)  # type: ignore[arg-type]
    reader.feed(stream[:1000])
    middle = bytearray(stream[1000:90_000])  # a caller's buffer, reused once fed
    reader.feed(middle)  # type: ignore[arg-type]
    middle[:] = bytes(len(middle))
    reader.feed(stream[90_000:])
    assert conn.frames == [payload]
