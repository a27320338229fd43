"""The SDK's client leaves a coordinator that answers keepalive pings and no request (loopback).

A half-alive coordinator (its loop's protocol side stuck behind a websocket layer that still answers pings, or a
proxy that keeps the websocket up with nothing behind it) upgrades, pongs every ping and never answers a request:
the keepalive never gives up on it. The first request on a connection (a resume's resubscriptions, the first call
after a connect) must be answered within the dial's bound (fleetwire/connection.py ``FirstReply``); else the
connection is dropped as silent, its URL goes to the back of the turn, and the session resumes at the next URL.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import pytest
from websockets.asyncio.server import ServerConnection, serve
from websockets.exceptions import ConnectionClosed

from coordinator.io.frontdoor.server import CoordinatorServer, ServerSettings
from fleetwire import Client
from protocol import ENCODING_SUBPROTOCOL
from tests.waiting import until
from worker_agent import Agent, Context

pytestmark = pytest.mark.timeout(60)

SHORT_S = 0.5  # a cluster reconnect's dial bound here


class HalfAlive:
    """A coordinator whose websocket layer upgrades and answers pings (the library's), and whose session reads every
    frame and answers none."""

    def __init__(self) -> None:
        self.upgrades = 0
        self.frames = 0
        self.url = ""

    async def session(self, ws: ServerConnection) -> None:
        self.upgrades += 1
        with contextlib.suppress(ConnectionClosed):
            async for _frame in ws:
                self.frames += 1


@pytest.fixture
async def half_alive() -> AsyncIterator[HalfAlive]:
    coordinator = HalfAlive()
    subprotocols = [ENCODING_SUBPROTOCOL["msgpack"]]
    async with serve(coordinator.session, "127.0.0.1", 0, subprotocols=subprotocols,  # type: ignore[arg-type]
                     compression=None) as server:  # fmt: skip
        coordinator.url = f"ws://127.0.0.1:{next(iter(server.sockets)).getsockname()[1]}"
        yield coordinator


class Gate:
    """A handler that waits for the test to open it."""

    def __init__(self) -> None:
        self.started = asyncio.Event()
        self.open = asyncio.Event()

    async def __call__(self, ctx: Context, args: Any) -> Any:
        self.started.set()
        await self.open.wait()
        return args


@pytest.fixture
async def live() -> AsyncIterator[tuple[str, Gate]]:
    """A coordinator with a worker whose ``gated`` handler waits for the test."""
    server = CoordinatorServer(ServerSettings(port=0, insecure=True))
    await server.start()
    agent = Agent(server.url, None, worker_id="w-half-alive")
    gate = Gate()
    agent.add_handler("gated", gate, isolation="inline")
    run = asyncio.create_task(agent.run())
    try:
        await asyncio.wait_for(agent.registered.wait(), 10)
        yield server.url, gate
    finally:
        agent.stop()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(run, 10)
        await server.stop()


async def test_a_resume_onto_a_half_alive_coordinator_goes_on_at_the_next_url(
    half_alive: HalfAlive, live: tuple[str, Gate], client_dials: list[str]
) -> None:
    """Client([live, half-alive]) with a plan running: after a drop the resume lands on the half-alive URL, whose
    pongs keep the connection up while its resubscription gets no reply; within the dial's bound the client leaves
    it, resumes at the live one, and the plan completes through it. The half-alive URL is then at the back."""
    url, gate = live
    client = Client([url, half_alive.url], token="", reconnect_dial_timeout_s=SHORT_S, ping_interval_s=0.05,
                    ping_timeout_s=5.0, reconnect_base_s=0.01, reconnect_cap_s=0.05,
                    reconnect_give_up_s=20)  # fmt: skip
    async with client:
        plan = await client.submit("gated", {"n": 1})
        await asyncio.wait_for(gate.started.wait(), 10)
        ws = client._ws
        assert ws is not None
        ws.transport.abort()  # the connection drops (a network cut)
        await until(lambda: half_alive.frames > 0, timeout_s=5)  # resumed there: its resubscription went out
        half_ws = client._ws
        assert half_ws is not None and client_dials == [url, half_alive.url]
        await until(lambda: half_ws.latency > 0, timeout_s=5)  # it answers pings: the keepalive holds it up
        gate.open.set()
        assert await asyncio.wait_for(plan.result(), 10) == {"n": 1}
        assert client.url.startswith(url) and client.session.resumed == 2
        ws = client._ws
        assert ws is not None
        ws.transport.abort()  # a second drop: the half-alive URL, at the back now, is not dialled
        await until(lambda: client._ws is not ws and client._ws is not None, timeout_s=8)
        await asyncio.wait_for(client.workers(), 5)
    assert client_dials == [url, half_alive.url, url, url] and half_alive.upgrades == 1


async def test_a_first_connect_to_a_half_alive_coordinator_goes_on_at_the_next_url(
    half_alive: HalfAlive, live: tuple[str, Gate], client_dials: list[str]
) -> None:
    """Client([half-alive, live]): the first connect lands on the half-alive URL; the first call's request gets no
    reply within open_timeout_s (the first dial's bound), so the client resumes at the live URL, sends it again
    there and gets its answer."""
    url, _gate = live
    client = Client([half_alive.url, url], token="", open_timeout_s=SHORT_S, ping_interval_s=0.05,
                    ping_timeout_s=5.0, reconnect_base_s=0.01, reconnect_cap_s=0.05,
                    reconnect_give_up_s=20)  # fmt: skip
    async with client:
        workers = await asyncio.wait_for(client.workers(), 10)
        assert [w.id for w in workers.workers] == ["w-half-alive"]
        assert client.url.startswith(url)
    assert client_dials == [half_alive.url, url] and half_alive.upgrades == 1 and half_alive.frames >= 1
