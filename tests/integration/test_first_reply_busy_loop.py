"""A first reply that arrived within its bound, read late by a client loop that was busy past the bound, is in time.

fleetwire/connection.py ``FirstReply``: the bound's timer and the socket's read can land in the same turn of the loop
when it was busy past the bound (a blocking call in the application's code). A text (JSON) frame is counted as an
answer only once the reader task runs, a turn later: the timer must look once more then, else it drops a coordinator
that answered in time. Loopback: an echo server in a thread of its own, so the client's blocked loop does not block it.
"""

from __future__ import annotations

import asyncio
import select
import threading
import time
from collections.abc import Iterator

import pytest
from websockets.asyncio.client import connect
from websockets.asyncio.server import ServerConnection, serve

from fleetwire.connection import FirstReply
from tests.waiting import until
from wireio.frame_sink import FrameSink, SinkConnection

pytestmark = pytest.mark.timeout(60)

BOUND_S = 0.2


@pytest.fixture
def echo_url() -> Iterator[str]:
    """An echo websocket server on its own loop and thread."""
    ready: list[str] = []
    listening = threading.Event()
    stop: list[asyncio.Future[None]] = []
    loop = asyncio.new_event_loop()

    async def echo(ws: ServerConnection) -> None:
        async for frame in ws:
            await ws.send(frame)

    async def run() -> None:
        async with serve(echo, "127.0.0.1", 0) as server:
            stop.append(loop.create_future())
            ready.append(f"ws://127.0.0.1:{next(iter(server.sockets)).getsockname()[1]}")
            listening.set()
            await stop[0]

    thread = threading.Thread(target=loop.run_until_complete, args=(run(),), daemon=True)
    thread.start()
    assert listening.wait(10), "the echo server did not start"
    yield ready[0]
    loop.call_soon_threadsafe(stop[0].set_result, None)
    thread.join(10)
    loop.close()


@pytest.mark.parametrize("text", [True, False], ids=["text", "binary"])
async def test_an_answer_read_late_by_a_busy_loop_is_in_time(echo_url: str, text: bool) -> None:
    async with connect(echo_url, create_connection=SinkConnection) as ws:
        frames: list[object] = []
        sink = FrameSink(frames.append, text=text)
        first = FirstReply(ws, sink, BOUND_S)
        reader = asyncio.create_task(sink.read(ws))
        await asyncio.sleep(0)  # the reader waits on the connection
        first.ask()
        await ws.send("probe" if text else b"probe")
        sent = time.monotonic()
        # The loop is busy (blocked) until the echo is in the socket's buffer and the bound has passed: the next turn
        # reads the echo and runs the bound's timer together.
        readable, _, _ = select.select([ws.transport.get_extra_info("socket")], [], [], 10)
        assert readable, "the echo did not come"
        time.sleep(max(0.0, BOUND_S - (time.monotonic() - sent)) + 0.05)  # noqa: ASYNC251  (busy on purpose)
        await until(lambda: sink.answered)
        for _ in range(3):  # the timer's second look, a turn after the reader's
            await asyncio.sleep(0)
        assert not first.silent, "a coordinator that answered within the bound was dropped as silent"
        assert frames
        reader.cancel()
