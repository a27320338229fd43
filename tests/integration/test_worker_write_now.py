"""Writing a frame at once (wireio/wsbulk.py ``write_frame_now``, the worker's) on a real websocket over loopback:
it writes when the connection takes a frame without waiting, and refuses (writing nothing) when it would wait or is
closed, so the writer's awaited send keeps the backpressure."""

from __future__ import annotations

import asyncio
from typing import Any

from websockets.asyncio.client import connect
from websockets.asyncio.server import ServerConnection, serve

from wireio.wsbulk import write_frame_now


async def test_write_frame_now_writes_an_open_connection_and_refuses_a_paused_or_closed_one() -> None:
    """Binary and text frames arrive as written; over the high-water mark (paused) or closed: False, nothing sent."""
    received: asyncio.Queue[Any] = asyncio.Queue()

    async def handler(conn: ServerConnection) -> None:
        async for message in conn:
            await received.put(message)

    async with serve(handler, "127.0.0.1", 0, compression=None) as server:
        port = server.sockets[0].getsockname()[1]
        ws = await connect(f"ws://127.0.0.1:{port}", compression=None)
        assert write_frame_now(ws, False, b"\x91\x01")
        assert await asyncio.wait_for(received.get(), 5) == b"\x91\x01"
        assert write_frame_now(ws, True, b'[{"type":"event"}]')
        assert await asyncio.wait_for(received.get(), 5) == '[{"type":"event"}]'
        ws.pause_writing()  # what the transport calls over its high-water mark
        assert not write_frame_now(ws, False, b"held")
        ws.resume_writing()
        await ws.send(b"after")  # the refused frame was never written: the next one is what arrives
        assert await asyncio.wait_for(received.get(), 5) == b"after"
        await ws.close()
        assert not write_frame_now(ws, False, b"late")
