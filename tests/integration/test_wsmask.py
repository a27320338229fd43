"""wireio/wsmask.py: a dialling side's binary frames masked and written past websockets' frame object, read back by
the library's own server; where the library must send (not open, a fragment in progress, text), it does, as before."""

from __future__ import annotations

import asyncio
import os
from typing import Any

import pytest
from websockets.asyncio.client import ClientConnection, connect
from websockets.asyncio.server import ServerConnection, serve
from websockets.exceptions import ConnectionClosed, ProtocolError
from websockets.frames import Frame, Opcode
from websockets.streams import StreamReader

import wireio.wsmask as wsmask
from wireio.frame_sink import SinkConnection
from wireio.wsbulk import BULK_MIN_BYTES, send_frame, write_frame
from wireio.wsmask import KEY_BLOCK_BYTES, mask_key, masked_frame, write_masked

#: RFC 6455 §5.2's length boundaries (7, 16, 64 bits), the module's join limit, and the bulk path's.
SIZES = [0, 1, 125, 126, 127, 65535, 65536, (16 << 10) - 1, 16 << 10, BULK_MIN_BYTES + 1, 300_000]


def parse(wire: bytes) -> list[Frame]:
    """The frames in ``wire`` as websockets' server-side parser reads them (it requires the mask)."""
    reader = StreamReader()
    reader.feed_data(wire)
    reader.feed_eof()
    frames = []
    while reader.buffer:
        parser = Frame.parse(reader.read_exact, mask=True, max_size=None)
        try:
            next(parser)
        except StopIteration as done:
            frames.append(done.value)
        else:
            raise AssertionError("a frame cut short")
    return frames


@pytest.mark.parametrize("length", SIZES)
def test_a_masked_frame_is_the_one_the_librarys_parser_reads(length: int) -> None:
    """Header, key and masked payload at every length boundary parse back to the payload, final and binary."""
    payload = os.urandom(length)
    wire = masked_frame(payload)
    (frame,) = parse(wire)
    assert (frame.opcode, frame.fin, bytes(frame.data)) == (Opcode.BINARY, True, payload)
    reference = Frame(Opcode.BINARY, payload).serialize(mask=True)  # its own: same length, a key of its own
    assert len(wire) == len(reference) and wire[: len(wire) - length - 4] == reference[: len(wire) - length - 4]


def test_each_frame_gets_a_key_of_its_own_from_one_urandom_call_a_block(monkeypatch: pytest.MonkeyPatch) -> None:
    """Keys are 4 bytes of os.urandom's output, drawn 4 KiB at a time: 2,500 frames, 3 calls, no key repeated."""
    wsmask._keys.clear()
    calls: list[int] = []
    real = os.urandom

    def counting(n: int) -> bytes:
        calls.append(n)
        return real(n)

    monkeypatch.setattr(wsmask.os, "urandom", counting)
    keys = [mask_key() for _ in range(2500)]
    assert calls == [KEY_BLOCK_BYTES] * 3
    assert all(len(key) == 4 for key in keys)
    assert len(set(keys)) > 2490  # 2^32 keys: a repeat among 2,500 is rare, a run of them is a bug
    frames = parse(masked_frame(b"same") + masked_frame(b"same"))
    assert [bytes(f.data) for f in frames] == [b"same", b"same"]


def test_a_forked_child_does_not_send_the_parents_next_keys() -> None:
    """The key block drawn before a fork is forgotten in the child: its first key is not the parent's next."""
    mask_key()  # a block drawn, keys left in it
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        os.write(write_end, mask_key())
        os._exit(0)
    os.close(write_end)
    child_key = os.read(read_end, 4)
    os.close(read_end)
    os.waitpid(pid, 0)
    assert len(child_key) == 4 and child_key != mask_key()


async def collect(ws: ServerConnection, into: asyncio.Queue[Any]) -> None:
    async for message in ws:
        await into.put(message)


@pytest.mark.parametrize("connection", [ClientConnection, SinkConnection])
async def test_a_real_server_reads_every_size_written_here_without_the_librarys_frames(
    connection: type[ClientConnection], library_frames: list[Frame]
) -> None:
    """write_frame and send_frame of a client (the SDK's and the worker's): masked frames the library's server reads
    byte for byte, in order, with text and pings between them; only text and control frames are the library's."""
    received: asyncio.Queue[Any] = asyncio.Queue()
    sent = [os.urandom(n) for n in SIZES]
    async with serve(lambda ws: collect(ws, received), "127.0.0.1", 0, compression=None, max_size=None) as server:
        port = next(iter(server.sockets)).getsockname()[1]
        async with connect(
            f"ws://127.0.0.1:{port}", compression=None, max_size=None, create_connection=connection
        ) as ws:
            for index, data in enumerate(sent):
                if index % 2:
                    write_frame(ws, False, data)
                else:
                    await send_frame(ws, data)
                await ws.ping()
            write_frame(ws, True, b"text stays text")
            got = [await asyncio.wait_for(received.get(), 5) for _ in sent]
            assert await asyncio.wait_for(received.get(), 5) == "text stays text"
    assert got == sent
    assert Opcode.TEXT in {f.opcode for f in library_frames}  # the server sends no binary frame here
    assert not [f for f in library_frames if f.opcode is Opcode.BINARY]


async def test_the_library_sends_what_is_not_a_plain_open_client_frame(library_frames: list[Frame]) -> None:
    """Compression negotiated, a fragment in progress, or a closed connection: write_masked writes nothing and the
    library's send runs as before (a fragment's rule raises ProtocolError; a closed connection ConnectionClosed)."""
    received: asyncio.Queue[Any] = asyncio.Queue()
    async with serve(lambda ws: collect(ws, received), "127.0.0.1", 0) as server:
        port = next(iter(server.sockets)).getsockname()[1]
        async with connect(f"ws://127.0.0.1:{port}") as ws:  # permessage-deflate: the library's frames
            assert ws.protocol.extensions and not write_masked(ws, b"x")
            await send_frame(ws, b"deflated")
            assert await asyncio.wait_for(received.get(), 5) == b"deflated"
        async with connect(f"ws://127.0.0.1:{port}", compression=None) as ws:
            ws.protocol.send_binary(b"first part", fin=False)  # a fragmented message begun
            assert not write_masked(ws, b"x")
            with pytest.raises(ProtocolError):
                ws.protocol.send_binary(b"x")  # what write_frame's fallback meets: the library's rule, as before
            ws.protocol.send_continuation(b", last", fin=True)
            ws.send_data()
            assert await asyncio.wait_for(received.get(), 5) == b"first part, last"
            assert write_masked(ws, b"then ours")
            assert await asyncio.wait_for(received.get(), 5) == b"then ours"
        assert not write_masked(ws, b"late")  # closed
        with pytest.raises(ConnectionClosed):
            await send_frame(ws, b"late")
    binaries = [f for f in library_frames if f.opcode in (Opcode.BINARY, Opcode.CONT)]
    assert [bytes(f.data) for f in binaries] == [b"deflated", b"first part", b", last"]


async def test_a_server_connection_is_never_masked_here() -> None:
    """write_masked refuses a server's connection (it must not mask): the library's send writes it."""
    result: asyncio.Future[bool] = asyncio.get_running_loop().create_future()

    async def handler(ws: ServerConnection) -> None:
        result.set_result(write_masked(ws, b"x"))
        await send_frame(ws, b"from the server")

    async with serve(handler, "127.0.0.1", 0, compression=None) as server:
        port = next(iter(server.sockets)).getsockname()[1]
        async with connect(f"ws://127.0.0.1:{port}", compression=None) as ws:
            assert await asyncio.wait_for(ws.recv(), 5) == b"from the server"
    assert result.result() is False
