"""A listener's stop is bounded (coordinator/io/frontdoor/gate.py ``Gatekeeper.wait_closed``), over loopback sockets.

``websockets``' own ``Server.wait_closed`` waits for every connection handler with no bound: a
session that waits on something other than its connection (a database that does not answer)
held a coordinator's stop, and a cluster host's, for as long as it waited.
"""

from __future__ import annotations

import asyncio

import pytest
from websockets.asyncio.client import connect
from websockets.asyncio.server import ServerConnection
from websockets.exceptions import ConnectionClosed

from coordinator.io.frontdoor.gate import Gatekeeper
from coordinator.limits import Limits

pytestmark = pytest.mark.timeout(60)


async def test_a_session_still_waiting_after_the_close_is_cancelled_within_the_bound() -> None:
    """A handler that waits on something else than its connection: cancelled after the handshake and close
    timeouts; the wait for the handlers returns and counts it."""
    gate = Gatekeeper(None, Limits(handshake_timeout_s=0.4, close_timeout_s=0.4), max_frame_bytes=1 << 20)
    entered, cancelled = asyncio.Event(), asyncio.Event()

    async def handler(ws: ServerConnection) -> None:
        entered.set()
        try:
            await asyncio.Event().wait()  # never set: a read from a database that does not answer
        except asyncio.CancelledError:
            cancelled.set()
            raise

    server = await gate.serve(handler, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    async with connect(f"ws://127.0.0.1:{port}/") as ws:
        await asyncio.wait_for(entered.wait(), 10)
        server.close()
        gate.close()
        waiting = asyncio.ensure_future(gate.wait_closed(server))
        done, _ = await asyncio.wait([waiting], timeout=10)
        if not done:  # the bug: let the handler go, so that nothing is left running
            waiting.cancel()
            for task in server.handler_tasks:
                task.cancel()
        assert done, "the stop still waited for a session that ignored the close"
        assert waiting.result() == 1 and cancelled.is_set()
        with pytest.raises(ConnectionClosed):
            await asyncio.wait_for(ws.recv(), 10)
    assert ws.close_code == 1001  # the session itself was closed as a stop closes it


async def test_sessions_that_end_on_the_close_are_waited_for_and_none_cancelled() -> None:
    """Handlers that end when their connection closes: the wait returns once they have, with none cancelled."""
    gate = Gatekeeper(None, Limits(), max_frame_bytes=1 << 20)
    opened = asyncio.Semaphore(0)

    async def handler(ws: ServerConnection) -> None:
        opened.release()
        await ws.wait_closed()

    server = await gate.serve(handler, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    clients = [await connect(f"ws://127.0.0.1:{port}/") for _ in range(3)]
    for _ in clients:
        await asyncio.wait_for(opened.acquire(), 10)
    server.close()
    assert await asyncio.wait_for(gate.wait_closed(server), 30) == 0
    assert not server.handler_tasks
    for ws in clients:
        await ws.close()
