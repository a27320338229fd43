"""The worker agent's reconnect follows the cluster (issue #25 part 3), over loopback sockets.

A coordinator that answers 503 with ``Retry-After`` (a cluster coordinator while its database is
away) is dialled again after that wait, not after a backoff that grew with every answer; the
client SDK's side of the same backoff is tests/unit/test_reconnect_backoff.py. The agent tells the
backoff what each try came to: a registration, a ``moved``, a refusal (an HTTP one, a session
closed before ``welcome``), or nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import socket

import pytest
from websockets.asyncio.server import ServerConnection, serve
from websockets.datastructures import Headers
from websockets.exceptions import ConnectionClosed
from websockets.http11 import Request, Response

import protocol
from protocol import ENCODING_SUBPROTOCOL, Codec
from tests.unit.test_reconnect_backoff import RecordingBackoff
from tests.waiting import until
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


async def test_the_agent_tells_the_backoff_registered_moved_refused_and_unanswered(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A 503 without Retry-After and a hello closed 1013 are refusals (each a doubling); a ``moved`` to a
    dead owner is a moved (dialled at once), that owner unanswered; a session that registered and
    then closed was served. Before, all but the unanswered one were the same answer (n back to 0)."""
    RecordingBackoff.made = []
    monkeypatch.setattr("worker_agent.agent.ReconnectBackoff", RecordingBackoff)
    with socket.socket() as s:  # a port nobody listens on: the dead owner
        s.bind(("127.0.0.1", 0))
        dead = s.getsockname()[1]
    upgrades = 0
    codec = Codec("msgpack", protocol.messages.FromWorker, "worker")

    def process_request(connection: ServerConnection, request: Request) -> Response | None:
        nonlocal upgrades
        upgrades += 1
        if upgrades == 1:
            return Response(503, "Service Unavailable", Headers([("Content-Length", "0")]), b"")
        return None

    async def session(ws: ServerConnection) -> None:
        with contextlib.suppress(ConnectionClosed):
            async for frame in ws:
                msg = codec.decode(frame)[0]
                if not isinstance(msg, protocol.Hello):
                    continue  # a registered session's heartbeats
                if upgrades == 2:
                    await ws.close(1013, "shard 0 has no owner yet; try again")
                elif upgrades == 3:
                    await ws.send(codec.encode([protocol.messages.Moved(url=f"ws://127.0.0.1:{dead}")]))
                    await ws.close(4307, "shard 0 is served elsewhere")
                else:
                    welcome = protocol.Welcome(worker_id=msg.worker_id, heartbeat_interval_s=5, heartbeat_timeout_s=15)
                    await ws.send(codec.encode([welcome]))
                    if upgrades == 4:
                        await ws.close(1012, "restarting")

    async with serve(session, "127.0.0.1", 0, process_request=process_request, compression=None,
                     subprotocols=[ENCODING_SUBPROTOCOL["msgpack"]]) as server:  # type: ignore[list-item]  # fmt: skip
        port = next(iter(server.sockets)).getsockname()[1]
        agent = Agent(f"ws://127.0.0.1:{port}", worker_id="told", reconnect_base_s=0.01, reconnect_cap_s=0.1)
        run = asyncio.create_task(agent.run())
        try:
            await until(lambda: upgrades >= 5 and agent.registered.is_set(), timeout_s=10)
        finally:
            agent.stop()
            await asyncio.wait_for(run, 10)
    assert RecordingBackoff.made[0].said == ["refused 0", "refused 0", "moved", "unanswered", "served"]
