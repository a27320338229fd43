"""wireio/wsbulk.py: big binary frames written past the websockets library, checked by the library's own reader."""

from __future__ import annotations

import asyncio
import contextlib
import os
import random

import pytest
from websockets.asyncio.client import ClientConnection, connect
from websockets.asyncio.server import ServerConnection, serve
from websockets.exceptions import ConnectionClosed
from websockets.frames import Frame, Opcode

from wireio.wsbulk import BULK_MIN_BYTES, BulkReceive, frame_header, send_frame

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


# ---------------------------------------------------------------------------------------------- BulkReceive


class BulkServer(BulkReceive, ServerConnection):
    """What the coordinator's connections are: the library's, reading bulk frames through BulkReceive."""


def _stream() -> tuple[bytes, list[bytes | str]]:
    """Masked frames as a client sends them, and the messages they make: small, bulk, text, control, fragmented."""
    rng = random.Random(7)
    big = [rng.randbytes(n) for n in (BULK_MIN_BYTES, 70_000, 200_003, 1 << 20)]
    frames = [
        (Frame(Opcode.BINARY, b"small"), b"small"),
        (Frame(Opcode.BINARY, big[0]), big[0]),  # exactly the threshold
        (Frame(Opcode.PING, b""), None),  # a 6-byte frame (header and mask), answered by the library
        (Frame(Opcode.TEXT, "hé".encode()), "hé"),
        (Frame(Opcode.BINARY, big[1]), big[1]),
        (Frame(Opcode.BINARY, big[2][:100_000], fin=False), None),  # a fragmented message: the library's
        (Frame(Opcode.CONT, big[2][100_000:]), big[2]),
        (Frame(Opcode.BINARY, b""), b""),
        (Frame(Opcode.BINARY, big[3]), big[3]),  # 64-bit length
        (Frame(Opcode.BINARY, big[1][:BULK_MIN_BYTES - 1]), big[1][:BULK_MIN_BYTES - 1]),
    ]
    stream = b"".join(frame.serialize(mask=True) for frame, _ in frames)
    return stream, [message for _, message in frames if message is not None]


def _chunkings(stream: bytes) -> list[list[bytes]]:
    """The same stream cut three ways: a byte at a time through every header, at random, and whole."""
    rng = random.Random(11)
    bytewise, pos = [], 0
    while pos < len(stream):
        step = 1 if pos < 400 or rng.random() < 0.02 else rng.randint(1, 300_000)
        bytewise.append(stream[pos : pos + step])
        pos += step
    cuts = sorted(rng.sample(range(1, len(stream)), 60))
    random_cuts = [stream[a:b] for a, b in zip([0, *cuts], [*cuts, len(stream)], strict=True)]
    return [bytewise, random_cuts, [stream]]


async def test_bulk_frames_are_read_past_the_library_and_every_other_frame_by_it() -> None:
    """Fed to a live server connection in every cut: the messages come out whole and in order, bulk ones read by
    BulkReceive (in one piece each: a bytes of their own), the rest by the library as before."""
    stream, expected = _stream()
    connections: asyncio.Queue[ServerConnection] = asyncio.Queue()
    done = asyncio.Event()

    async def hold(ws: ServerConnection) -> None:
        await connections.put(ws)
        await done.wait()

    async with serve(hold, "127.0.0.1", 0, compression=None, max_size=2 << 20, create_connection=BulkServer) as srv:
        port = next(iter(srv.sockets)).getsockname()[1]
        for chunks in _chunkings(stream):
            async with connect(f"ws://127.0.0.1:{port}", compression=None) as client:
                ws = await connections.get()
                assert isinstance(ws, BulkServer)
                for piece in chunks:  # as if they came from the socket, cut so
                    ws.data_received(piece)
                got = [await ws.recv() for _ in expected]
                assert got == expected
                assert ws.bulk_frames == 3  # the three of at least BULK_MIN_BYTES, unfragmented
                await client.ping()  # the session still works both ways
        done.set()


async def test_a_bulk_sized_frame_over_the_limit_gets_the_librarys_1009() -> None:
    """A frame past the connection's max_size is the library's to refuse, as without BulkReceive."""
    async def read(ws: ServerConnection) -> None:
        with contextlib.suppress(ConnectionClosed):
            await ws.recv()

    async with serve(read, "127.0.0.1", 0, compression=None, max_size=BULK_MIN_BYTES * 2,
                     create_connection=BulkServer) as srv:
        port = next(iter(srv.sockets)).getsockname()[1]
        async with connect(f"ws://127.0.0.1:{port}", compression=None, max_size=None) as ws:
            await ws.send(os.urandom(BULK_MIN_BYTES * 2 + 1))
            with pytest.raises(ConnectionClosed) as closed:
                await ws.recv()
    assert closed.value.rcvd is not None and closed.value.rcvd.code == 1009


class BulkClient(BulkReceive, ClientConnection):
    """What the SDK's and the agent's connections are."""


async def test_a_client_reads_the_servers_unmasked_bulk_frames() -> None:
    """The other side: unmasked frames from a server, bulk ones read by BulkReceive, pings answered by the library."""
    messages: list[bytes | str] = [b"x", os.urandom(BULK_MIN_BYTES), "text", os.urandom(300_001), b""]

    async def send_all(ws: ServerConnection) -> None:
        for message in messages:
            await ws.send(message)
            await ws.ping()
        await ws.wait_closed()

    async with serve(send_all, "127.0.0.1", 0, compression=None) as srv:
        port = next(iter(srv.sockets)).getsockname()[1]
        async with connect(f"ws://127.0.0.1:{port}", compression=None, max_size=None,
                           create_connection=BulkClient) as ws:
            assert [await ws.recv() for _ in messages] == messages
            assert isinstance(ws, BulkClient) and ws.bulk_frames == 2


class CountingServer(BulkServer):
    """Counts the pieces BulkReceive hands the library."""

    passes = 0

    def _bulk_pass(self, data: bytes | memoryview) -> None:
        self.passes += 1
        super()._bulk_pass(data)


async def test_a_small_frame_whole_in_a_read_is_read_here_or_reaches_the_library_in_one_piece() -> None:
    """The session's frames (small, each whole in its read, or several in one): a final binary one is read here, as a
    bulk frame is (no pass through the library's parser); any other goes to the library in one pass, its header and
    payload together, not the header and then the payload. A header cut across reads goes the library's way."""
    frames = [Frame(Opcode.BINARY, b"submit"), Frame(Opcode.TEXT, "hé".encode()), Frame(Opcode.BINARY, b"x" * 300)]
    wire = [frame.serialize(mask=True) for frame in frames]
    expected: list[bytes | str] = [b"submit", "hé", b"x" * 300]
    connections: asyncio.Queue[ServerConnection] = asyncio.Queue()
    done = asyncio.Event()

    async def hold(ws: ServerConnection) -> None:
        await connections.put(ws)
        await done.wait()

    seen = []
    async with serve(hold, "127.0.0.1", 0, compression=None, create_connection=CountingServer) as srv:
        port = next(iter(srv.sockets)).getsockname()[1]
        try:
            for reads in [wire, [b"".join(wire)], [wire[0][:1], wire[0][1:], *wire[1:]]]:
                async with connect(f"ws://127.0.0.1:{port}", compression=None):
                    ws = await connections.get()
                    assert isinstance(ws, CountingServer)
                    for piece in reads:
                        ws.data_received(piece)
                    assert [await asyncio.wait_for(ws.recv(), 5) for _ in expected] == expected
                    seen.append((ws.passes, ws.small_frames))
        finally:
            done.set()
    assert seen == [(1, 2), (1, 2), (3, 1)]
