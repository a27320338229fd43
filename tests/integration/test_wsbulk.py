"""protocol/wsbulk.py: big binary frames written past the websockets library, checked by the library's own reader."""

from __future__ import annotations

import asyncio
import os

import pytest
from websockets.asyncio.client import connect
from websockets.asyncio.server import ServerConnection, serve
from websockets.exceptions import ConnectionClosed
from websockets.frames import Frame, Opcode

from protocol.wsbulk import BULK_MIN_BYTES, frame_header, send_frame

SIZES = [0, 1, 125, 126, 65535, 65536, BULK_MIN_BYTES - 1, BULK_MIN_BYTES, 512 << 10, (1 << 20) + 3]


@pytest.mark.parametrize("length", [0, 125, 126, 65535, 65536, 1 << 20, (1 << 32) + 1])
@pytest.mark.parametrize("mask", [b"", b"\x01\x02\x03\x04"])
def test_the_header_is_the_one_the_library_writes(length: int, mask: bytes) -> None:
    """RFC 6455 §5.2 lengths (7, 16 and 64 bits) and the mask bit, against websockets' own serializer."""
    if length > 1 << 20:  # the library needs the payload; the header alone is checked by its fields
        head = frame_header(length, mask)
        assert head[:2] == bytes([0x82, (0x80 if mask else 0) | 127]) and int.from_bytes(head[2:10]) == length
        return
    payload = bytes(length)
    expected = Frame(Opcode.BINARY, payload).serialize(mask=bool(mask))
    header_len = len(expected) - length - len(mask)
    assert frame_header(length, mask)[: header_len] == expected[:header_len]


def payloads() -> list[bytes]:
    return [os.urandom(n) for n in SIZES]


async def echo(ws: ServerConnection) -> None:
    """Sends every message back through send_frame (a server: unmasked), a ping after each."""
    async for message in ws:
        await send_frame(ws, message, text=isinstance(message, str))  # type: ignore[arg-type]
        await ws.ping()  # a control frame between bulk ones


async def test_frames_both_ways_arrive_whole_and_in_order_among_small_and_control_frames() -> None:
    """A client's masked bulk frames and a server's unmasked ones are read back by websockets byte for byte."""
    sent = payloads()
    async with serve(echo, "127.0.0.1", 0, compression=None, max_size=None) as server:
        port = next(iter(server.sockets)).getsockname()[1]
        async with connect(f"ws://127.0.0.1:{port}", compression=None, max_size=None) as ws:
            for data in sent:
                await send_frame(ws, data)  # a client: masked with a fresh key
            await send_frame(ws, "text stays text", text=True)  # type: ignore[arg-type]
            got = [await ws.recv() for _ in sent]
            assert await ws.recv() == "text stays text"
    assert got == sent


async def test_a_mutable_server_payload_goes_through_the_library() -> None:
    """A bytearray a caller may reuse is not handed to the transport as is (the library copies it)."""
    data = bytearray(os.urandom(BULK_MIN_BYTES * 2))

    async def send_then_scribble(ws: ServerConnection) -> None:
        await send_frame(ws, data)
        data[:] = bytes(len(data))  # the caller reuses its buffer at once

    expected = bytes(data)
    async with serve(send_then_scribble, "127.0.0.1", 0, compression=None, max_size=None) as server:
        port = next(iter(server.sockets)).getsockname()[1]
        async with connect(f"ws://127.0.0.1:{port}", compression=None, max_size=None) as ws:
            assert await ws.recv() == expected


async def test_a_closed_connection_raises_connection_closed() -> None:
    """As ws.send does: the bulk path never writes to a connection that is not open."""
    closed = asyncio.Event()

    async def close_at_once(ws: ServerConnection) -> None:
        await ws.close()
        closed.set()

    async with serve(close_at_once, "127.0.0.1", 0, compression=None) as server:
        port = next(iter(server.sockets)).getsockname()[1]
        async with connect(f"ws://127.0.0.1:{port}", compression=None) as ws:
            await ws.wait_closed()
            with pytest.raises(ConnectionClosed):
                await send_frame(ws, os.urandom(BULK_MIN_BYTES))
