"""wireio/wsmask.py write_binary on a server's connection (the coordinator's sends): plain frames written past
websockets' frame object, read back byte for byte by the library's own client; where the library must send (not open,
an extension, a fragment in progress, its own writes waiting, its debug log on, text), it does, as before."""

from __future__ import annotations

import asyncio
import os
from typing import Any

import pytest
from websockets.asyncio.client import connect
from websockets.asyncio.server import ServerConnection, serve
from websockets.exceptions import ConnectionClosed, ProtocolError
from websockets.frames import Frame, Opcode

from coordinator.io.frontdoor.connection import FailFastConnection
from wireio.wsbulk import BULK_MIN_BYTES, send_frame, write_frame
from wireio.wsmask import write_binary, write_masked

#: RFC 6455 §5.2's length boundaries (7, 16, 64 bits), the module's join limit, and the bulk path's.
SIZES = [0, 1, 125, 126, 127, 65535, 65536, (16 << 10) - 1, 16 << 10, BULK_MIN_BYTES + 1, 300_000]


async def serve_with(handler: Any, **kwargs: Any) -> Any:
    return serve(handler, "127.0.0.1", 0, create_connection=FailFastConnection, max_size=None, **kwargs)


@pytest.mark.parametrize("kind", [bytes, bytearray, memoryview])
async def test_a_real_client_reads_every_size_a_server_writes_without_the_librarys_frames(
    kind: type, library_frames: list[Frame]
) -> None:
    """write_frame and send_frame of the coordinator's connection: every boundary size, bytes or not, read back by
    websockets' client byte for byte and in order, with pings and text between them; no binary frame is the
    library's (the client sends only text here)."""
    sent = [os.urandom(n) for n in SIZES]
    done: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    async def handler(ws: ServerConnection) -> None:
        for index, data in enumerate(sent):
            payload = kind(data) if kind is not memoryview else memoryview(bytearray(data))
            if index % 2:
                write_frame(ws, False, payload)
            else:
                await send_frame(ws, payload)
            await ws.ping()
        write_frame(ws, True, b"text stays text")
        await done

    async with await serve_with(handler, compression=None) as server:
        port = next(iter(server.sockets)).getsockname()[1]
        async with connect(f"ws://127.0.0.1:{port}", compression=None, max_size=None) as ws:
            got = [await asyncio.wait_for(ws.recv(), 5) for _ in sent]
            assert await asyncio.wait_for(ws.recv(), 5) == "text stays text"
            done.set_result(None)
    assert got == sent
    assert Opcode.TEXT in {f.opcode for f in library_frames}
    assert not [f for f in library_frames if f.opcode is Opcode.BINARY]


async def test_a_server_never_hands_the_transport_a_buffer_its_owner_may_change() -> None:
    """A big mutable payload is joined to its header (the transport's own copy); a big bytes one goes as it is."""
    seen: asyncio.Future[tuple[list[Any], bytes]] = asyncio.get_running_loop().create_future()

    async def handler(ws: ServerConnection) -> None:
        buffers: list[Any] = []
        transport = ws.transport
        real_write, real_writelines = transport.write, transport.writelines

        def write(data: Any) -> None:
            buffers.append(data)
            real_write(data)

        def writelines(items: Any) -> None:
            items = list(items)
            buffers.extend(items)
            real_writelines(items)

        transport.write, transport.writelines = write, writelines  # type: ignore[method-assign]
        mutable = bytearray(os.urandom(BULK_MIN_BYTES + 1))
        immutable = bytes(mutable)
        write_frame(ws, False, mutable)
        mutable[:4] = b"XXXX"  # its owner reuses it at once: what was sent must not change
        write_frame(ws, False, immutable)
        transport.write, transport.writelines = real_write, real_writelines  # type: ignore[method-assign]
        seen.set_result((buffers, immutable))
        await ws.wait_closed()

    async with await serve_with(handler, compression=None) as server:
        port = next(iter(server.sockets)).getsockname()[1]
        async with connect(f"ws://127.0.0.1:{port}", compression=None, max_size=None) as ws:
            first, second = await asyncio.wait_for(ws.recv(), 5), await asyncio.wait_for(ws.recv(), 5)
    buffers, immutable = await seen
    assert all(type(buffer) is bytes for buffer in buffers)
    assert any(buffer is immutable for buffer in buffers)  # the bytes frame: not copied
    assert first[4:] == second[4:] and first[:4] == second[:4] != b"XXXX"


async def test_the_library_sends_what_is_not_a_plain_open_server_frame(library_frames: list[Frame]) -> None:
    """Compression negotiated, the library's debug log on or its own writes waiting, a fragment in progress, or a
    closed connection: write_binary writes nothing and the library's send runs as before (a fragment's rule raises
    ProtocolError; a closed connection ConnectionClosed). write_masked never writes a server's frame."""
    checks: asyncio.Queue[Any] = asyncio.Queue()

    async def handler(ws: ServerConnection) -> None:
        if ws.protocol.extensions:  # permessage-deflate: the library's frames
            await checks.put(write_binary(ws, b"x"))
            await send_frame(ws, b"deflated")
            await ws.wait_closed()
            return
        await checks.put(write_masked(ws, b"x"))
        ws.protocol.debug = True
        await checks.put(write_binary(ws, b"x"))
        ws.protocol.debug = False
        ws.protocol.send_binary(b"held")  # the library's own write, not yet sent
        await checks.put(write_binary(ws, b"x"))
        ws.send_data()
        ws.protocol.send_binary(b"first part", fin=False)  # a fragmented message begun
        await checks.put(write_binary(ws, b"x"))
        try:
            ws.protocol.send_binary(b"x")  # what write_frame's fallback meets: the library's rule, as before
        except ProtocolError:
            await checks.put("ProtocolError")
        ws.protocol.send_continuation(b", last", fin=True)
        ws.send_data()
        await checks.put(write_binary(ws, b"then ours"))
        await ws.wait_closed()
        await checks.put(write_binary(ws, b"late"))
        try:
            await send_frame(ws, b"late")
        except ConnectionClosed:
            await checks.put("ConnectionClosed")

    async with await serve_with(handler) as server:
        port = next(iter(server.sockets)).getsockname()[1]
        async with connect(f"ws://127.0.0.1:{port}") as ws:
            assert await asyncio.wait_for(ws.recv(), 5) == b"deflated"
        assert await checks.get() is False
        async with connect(f"ws://127.0.0.1:{port}", compression=None) as ws:
            assert [await asyncio.wait_for(ws.recv(), 5) for _ in range(3)] == [b"held", b"first part, last",
                                                                                b"then ours"]  # fmt: skip
        got = [await asyncio.wait_for(checks.get(), 5) for _ in range(8)]
    assert got == [False, False, False, False, "ProtocolError", True, False, "ConnectionClosed"]
    binaries = [bytes(f.data) for f in library_frames if f.opcode in (Opcode.BINARY, Opcode.CONT)]
    assert binaries == [b"deflated", b"held", b"first part", b", last"]
