"""The worker agent's reconnect follows the cluster (issue #25 part 3), over loopback sockets.

A coordinator that answers 503 with ``Retry-After`` (a cluster coordinator while its database is
away) is dialled again after that wait, not after a backoff that grew with every answer; the
client SDK's side of the same backoff is tests/unit/test_reconnect_backoff.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools

import pytest
from websockets.asyncio.server import ServerConnection, serve
from websockets.datastructures import Headers
from websockets.exceptions import ConnectionClosed
from websockets.http11 import Request, Response

import protocol
from protocol import ENCODING_SUBPROTOCOL, Codec
from worker_agent import Agent

pytestmark = pytest.mark.timeout(30)


async def test_the_agent_dials_again_at_the_retry_after_of_each_503() -> None:
    """Eight 503s with Retry-After 0.1 s, then a welcome: registered ~1 s later (before: the backoff grew each time,
    ~25 s expected with base 0.2 s and cap 30 s)."""
    refusals = 8
    upgrades: list[float] = []
    loop = asyncio.get_running_loop()
    codec = Codec("msgpack", protocol.messages.FromWorker, "worker")

    def process_request(connection: ServerConnection, request: Request) -> Response | None:
        upgrades.append(loop.time())
        if len(upgrades) <= refusals:
            body = b"the cluster's database is away; retry after the Retry-After seconds\n"
            headers = Headers([("Retry-After", "0.1"), ("Content-Length", str(len(body)))])
            return Response(503, "Service Unavailable", headers, body)
        return None

    async def session(ws: ServerConnection) -> None:
        with contextlib.suppress(ConnectionClosed):
            async for frame in ws:
                for msg in codec.decode(frame):
                    if isinstance(msg, protocol.Hello):
                        welcome = protocol.Welcome(worker_id=msg.worker_id, heartbeat_interval_s=5,
                                                   heartbeat_timeout_s=15)  # fmt: skip
                        await ws.send(codec.encode([welcome]))

    async with serve(session, "127.0.0.1", 0, process_request=process_request, compression=None,
                     subprotocols=[ENCODING_SUBPROTOCOL["msgpack"]]) as server:  # type: ignore[list-item]  # fmt: skip
        port = next(iter(server.sockets)).getsockname()[1]
        agent = Agent(f"ws://127.0.0.1:{port}", worker_id="follows", reconnect_base_s=0.2, reconnect_cap_s=30.0)
        run = asyncio.create_task(agent.run())
        try:
            started = loop.time()
            await asyncio.wait_for(agent.registered.wait(), 10)
            took = loop.time() - started
        finally:
            agent.stop()
            await asyncio.wait_for(run, 10)
    gaps = [b - a for a, b in itertools.pairwise(upgrades[: refusals + 1])]
    assert all(0.09 <= gap <= 0.5 for gap in gaps), gaps
    assert took < 4.0, took
