"""The SDK's client keeps a coordinator whose store commits slower than the first reply's bound (loopback).

Every reply of a core leaves after its step's commit, so behind a slow store (a frozen PostgreSQL, a loaded disk, a
coordinator under valgrind) the first request on a new connection is answered past the bound its dial had
(fleetwire/connection.py ``FirstReply``). The client's first frame on a connection is a probe (an ``unsubscribe`` of
nothing) that the core's port answers ahead of its commit queue (coordinator/io/frontdoor/core_driver.py
``CoreSession``), so the connection is kept: no redial, no request sent again, and the plan completes once the
commits flow. The store here is the memory store written by the committer's writer thread with a gate the test holds
(tests/integration/test_ack_rides.py ``GatedStore``).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import pytest

from coordinator.io.frontdoor.server import CoordinatorServer, ServerSettings
from fleetwire import Client
from tests.integration.test_ack_rides import GatedStore
from tests.integration.test_client_half_alive import Gate
from worker_agent import Agent, Context

pytestmark = pytest.mark.timeout(60)

SHORT_S = 0.5  # the first reply's bound here (open_timeout_s)
HELD_S = 4 * SHORT_S  # how long the commits are held past a connection's first request


@pytest.fixture
async def slow() -> AsyncIterator[tuple[CoordinatorServer, GatedStore, Gate]]:
    """A coordinator on a gated store, with a worker running ``echo`` and a ``gated`` handler the test opens."""
    store = GatedStore()
    server = CoordinatorServer(ServerSettings(port=0, insecure=True), store=store)
    await server.start()
    agent = Agent(server.url, None, worker_id="w-slow-store")
    gate = Gate()
    agent.add_handler("gated", gate, isolation="inline")

    async def echo(ctx: Context, args: Any) -> Any:
        return args

    agent.add_handler("echo", echo, isolation="inline")
    run = asyncio.create_task(agent.run())
    try:
        await asyncio.wait_for(agent.registered.wait(), 10)
        yield server, store, gate
    finally:
        store.gate.set()
        agent.stop()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(run, 10)
        await server.stop()


async def test_a_first_connect_while_commits_are_held_keeps_its_connection(
    slow: tuple[CoordinatorServer, GatedStore, Gate], client_dials: list[str]
) -> None:
    """A client connects and submits while the store's commits are held past the bound: the probe's ok comes ahead
    of the commit queue, so the one connection is kept and the plan completes once the commits flow."""
    server, store, _gate = slow
    store.gate.clear()
    client = Client(server.url, token="", open_timeout_s=SHORT_S, reconnect_base_s=0.01, reconnect_cap_s=0.05,
                    reconnect_give_up_s=30)  # fmt: skip
    async with client:
        submit = asyncio.create_task(client.submit("echo", {"n": 1}))
        assert await asyncio.to_thread(store.entered.wait, 10)  # the submit's step is being committed, held
        await asyncio.sleep(HELD_S)  # past the bound: a deadline the client must not act on, not a state to wait for
        assert not submit.done()
        assert client_dials == [server.url] and client.session.resumed == 0
        store.gate.set()
        plan = await asyncio.wait_for(submit, 10)
        assert await asyncio.wait_for(plan.result(), 10) == {"n": 1}
    assert client_dials == [server.url] and client.session.resumed == 0
    assert len(server.core.state.plans) == 1


async def test_a_resume_while_commits_are_held_keeps_its_connection(
    slow: tuple[CoordinatorServer, GatedStore, Gate], client_dials: list[str]
) -> None:
    """A client with a plan running loses its connection while another client's commit is held past the bound: the
    resume's resubscription is answered only after that commit, but the probe's ok comes at once, so the resumed
    connection is kept (one redial, for the drop) and the plan completes through it once the commits flow."""
    server, store, gate = slow
    client = Client(server.url, token="", open_timeout_s=SHORT_S, reconnect_base_s=0.01, reconnect_cap_s=0.05,
                    reconnect_give_up_s=30)  # fmt: skip
    other = Client(server.url, token="", open_timeout_s=10)
    async with client, other:
        plan = await client.submit("gated", {"n": 2})
        await asyncio.wait_for(gate.started.wait(), 10)
        store.gate.clear()
        held = asyncio.create_task(other.submit("echo", {"n": 3}))  # its commit is held: every reply waits behind it
        assert await asyncio.to_thread(store.entered.wait, 10)
        ws = client._ws
        assert ws is not None
        ws.transport.abort()  # a network cut: the client resumes, its resubscription behind the held commit
        await asyncio.sleep(HELD_S)  # past the bound: a deadline the client must not act on
        assert client_dials == [server.url] * 3 and client.session.resumed == 1  # client, other, the client's resume
        store.gate.set()
        gate.open.set()
        assert await asyncio.wait_for(plan.result(), 10) == {"n": 2}
        await asyncio.wait_for(held, 10)
    assert client_dials == [server.url] * 3 and client.session.resumed == 1
    assert len(server.core.state.plans) == 2
