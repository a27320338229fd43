"""A cluster reconnect does not sit on a frozen coordinator, over loopback sockets.

A frozen coordinator (SIGSTOP, a hung host) still completes the TCP handshake from its listen
backlog and then answers nothing; here, a socket that listens and never accepts. The client SDK's and
the worker agent's reconnect dial it for ``reconnect_dial_timeout_s`` at most, not their whole open
timeout (10 s), then reach the live coordinator; and the URL that timed out goes to the back of the
turn, so the next reconnect goes to the live one first. The first connect keeps its own timeout.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Iterator
from typing import Any

import pytest
from websockets.asyncio.client import ClientConnection

import fleetwire.client
import worker_agent.agent
from coordinator.io.frontdoor.server import CoordinatorServer, ServerSettings
from fleetwire import Client
from tests.waiting import until
from worker_agent import Agent

pytestmark = pytest.mark.timeout(30)

SHORT_S = 0.3  # the reconnect dial's bound here; the open timeout stays 10 s


@pytest.fixture
def frozen() -> Iterator[str]:
    """``ws://`` of a coordinator that accepts TCP connections (the kernel's backlog) and never answers."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(16)
        yield f"ws://127.0.0.1:{listener.getsockname()[1]}"


async def test_the_client_reconnect_leaves_a_frozen_coordinator_after_the_short_bound(
    frozen: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Client([live, frozen]): the first connect (live) dials with open_timeout_s; after a drop the turn's frozen URL
    is dialled with reconnect_dial_timeout_s, then the live one answers; after a second drop the frozen URL, at the
    back now, is not dialled at all."""
    dials: list[tuple[str, float | None]] = []
    real_dial = fleetwire.client.dial

    async def recording_dial(url: str, **kwargs: Any) -> ClientConnection:
        dials.append((url.split("/v1/")[0], kwargs["open_timeout_s"]))
        return await real_dial(url, **kwargs)

    monkeypatch.setattr(fleetwire.client, "dial", recording_dial)
    server = CoordinatorServer(ServerSettings(port=0, insecure=True))
    await server.start()
    live = server.url
    try:
        client = Client([live, frozen], token="", open_timeout_s=10.0, reconnect_dial_timeout_s=SHORT_S,
                        reconnect_base_s=0.01, reconnect_cap_s=0.05, reconnect_give_up_s=20)  # fmt: skip
        async with client:
            assert dials == [(live, 10.0)]
            for resumes in (1, 2):
                ws = client._ws
                assert ws is not None
                ws.transport.abort()  # the connection drops (a network cut, a coordinator gone)
                await until(lambda n=resumes: client.session.resumed >= n, timeout_s=8)  # type: ignore[misc]
                assert client.url.startswith(live)
                await client.workers()  # the resumed session is served
    finally:
        await server.stop()
    assert dials == [(live, 10.0), (frozen, SHORT_S), (live, SHORT_S), (live, SHORT_S)]


async def test_the_agent_reconnect_leaves_a_frozen_coordinator_after_the_short_bound(
    frozen: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Agent("live,frozen"): the first dial (live) may take handshake_timeout_s; after a drop the frozen URL is
    dialled with reconnect_dial_timeout_s and the agent registers at the live one again; after a second drop the
    frozen URL, at the back now, is not dialled at all."""
    dials: list[tuple[str, float]] = []
    opened: list[ClientConnection] = []
    real_connect = worker_agent.agent.connect

    async def recording_connect(url: str, **kwargs: Any) -> ClientConnection:
        dials.append((url.split("/v1/")[0], kwargs["open_timeout"]))
        ws = await real_connect(url, **kwargs)
        opened.append(ws)
        return ws

    monkeypatch.setattr(worker_agent.agent, "connect", recording_connect)
    server = CoordinatorServer(ServerSettings(port=0, insecure=True))
    await server.start()
    live = server.url
    agent = Agent(f"{live},{frozen}", None, worker_id="w-frozen", handshake_timeout_s=10.0,
                  reconnect_dial_timeout_s=SHORT_S, reconnect_base_s=0.01, reconnect_cap_s=0.05)  # fmt: skip
    run = asyncio.create_task(agent.run())
    try:
        await asyncio.wait_for(agent.registered.wait(), 8)
        for sessions in (2, 3):
            opened[-1].transport.abort()
            await until(lambda n=sessions: len(opened) >= n and agent.registered.is_set(), timeout_s=8)  # type: ignore[misc]
    finally:
        agent.stop()
        await asyncio.wait_for(run, 10)
        await server.stop()
    assert agent.url.startswith(live)
    assert dials == [(live, 10.0), (frozen, SHORT_S), (live, SHORT_S), (live, SHORT_S)]
