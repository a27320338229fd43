"""wireio/frame_sink.py as the worker agent reads with it: frames dispatched in the connection's ``process_event``."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from websockets.asyncio.client import connect
from websockets.asyncio.server import ServerConnection, serve

from tests.waiting import until
from wireio.frame_sink import FrameSink, SinkConnection


class _Codec:
    text = False

    def decode(self, frame: bytes | str) -> list[Any]:
        return [frame]


async def _read(frames: list[bytes | str], dispatch: Any) -> FrameSink:
    async def handler(ws: ServerConnection) -> None:
        await ws.recv()  # the client's reader is attached: every frame from here on is read while it is
        for frame in frames:
            await ws.send(frame)
        await ws.close()

    async with serve(handler, "127.0.0.1", 0) as server:
        port = server.sockets[0].getsockname()[1]
        async with connect(f"ws://127.0.0.1:{port}", create_connection=SinkConnection) as ws:
            codec = _Codec()
            sink = FrameSink(dispatch, codec.decode, text=codec.text)  # as worker_agent/agent.py builds it
            reading = asyncio.ensure_future(sink.read(ws))
            await until(lambda: ws.frame_sink is sink or reading.done())
            await ws.send(b"go")
            await asyncio.wait_for(reading, 10)
    return sink


async def test_binary_frames_are_dispatched_as_read_and_a_text_frame_hands_the_rest_to_the_library_in_order() -> None:
    got: list[bytes | str] = []
    frames: list[bytes | str] = [b"a", b"b", b"c", "text", b"d", b"e"]
    sink = await _read(frames, got.append)
    assert got == frames
    assert sink.frames == 3  # those before the text: the rest went through the library's queue, behind them


async def test_a_dispatch_that_raises_ends_the_reading_with_its_exception_and_dispatches_nothing_more() -> None:
    got: list[bytes | str] = []

    def dispatch(msg: bytes | str) -> None:
        got.append(msg)
        if msg == b"boom":
            raise RuntimeError("dispatch failed")

    with pytest.raises(RuntimeError, match="dispatch failed"):
        await _read([b"a", b"boom", b"after"], dispatch)
    assert got == [b"a", b"boom"]
