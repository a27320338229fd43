"""A referenced input whose holder cannot be dialled comes through the coordinator's relay (worker_agent/pull_relay.py,
coordinator/relay.py ``open_pull``): a real coordinator and two agents in this process, over loopback."""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from coordinator.core import CoreConfig
from coordinator.io.frontdoor.server import CoordinatorServer, ServerSettings
from fleetwire import Client
from tests.integration.data_helpers import CLIENT_TOKEN, WORKER_TOKEN, digest
from worker_agent.agent import Agent
from worker_agent.spool import FETCHED_GRACE_S

pytestmark = pytest.mark.timeout(60)

SIZE = (5 << 20) + 777  # past a window's quarter: the consumer credits as it stores


async def make(ctx: Any, args: Any) -> None:
    ctx.output("y", os.urandom(args["size"]))


async def take(ctx: Any, args: Any) -> str:
    return digest(ctx.inputs["x"].path.read_bytes())


@contextlib.asynccontextmanager
async def fleet(tmp_path: Path, **holder: Any) -> AsyncIterator[tuple[CoordinatorServer, Agent, Agent]]:
    """A coordinator, holder ``w1`` (tag ``first``; ``holder`` options) and consumer ``w2`` (tag ``second``)."""
    server = CoordinatorServer(ServerSettings(
        port=0, worker_tokens=(WORKER_TOKEN,), client_tokens=(CLIENT_TOKEN,),
        core=CoreConfig(heartbeat_interval_s=0.5, heartbeat_timeout_s=3.0), reaper_interval_s=0.1,
    ))  # fmt: skip
    await server.start()
    agents = [
        Agent(server.url, WORKER_TOKEN, worker_id=worker_id, spool_dir=str(tmp_path / worker_id), tags=[tag],
              input_timeout_s=10.0, **options)
        for worker_id, tag, options in (("w1", "first", holder), ("w2", "second", {"data_listen": "127.0.0.1:0"}))
    ]
    for agent in agents:
        agent.add_handler("make", make)
        agent.add_handler("take", take)
    tasks = [asyncio.create_task(agent.run()) for agent in agents]
    try:
        for agent in agents:
            await asyncio.wait_for(agent.registered.wait(), 10)
        yield server, agents[0], agents[1]
    finally:
        for agent in agents:
            agent.stop()
            agent.stop()
        for task in tasks:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(task, 10)
        await server.stop()


def received_via(plan: Any) -> dict[str, str]:
    return {e.data["name"]: e.data["via"] for e in plan._stream.events if e.kind == "input_received"}


@pytest.mark.parametrize("holder", [
    {"data_listen": None},  # no data endpoint: the pull's url is "" (behind NAT)
    {"data_listen": "127.0.0.1:0", "data_advertise": "http://127.0.0.1:9"},  # advertised, but nothing listens there
], ids=["no_endpoint", "dial_fails"])
async def test_a_holder_that_cannot_be_dialled_sends_the_output_through_the_relay(
    tmp_path: Path, holder: dict[str, Any]
) -> None:
    """B on A's output, on another worker than A's, which cannot be dialled: B's worker fetches it through the
    coordinator's relay; B sees the bytes A made, the input says via relay, the holder keeps the output its
    whole retention (a pull, not a client's download), and the relay is empty after."""
    async with fleet(tmp_path, **holder) as (server, w1, w2), Client(server.url, token=CLIENT_TOKEN) as client:
        a = await client.submit("make", args={"size": SIZE}, outputs=["y"], tags=["first"])
        b = await client.submit("take", inputs={"x": a.ref("y")}, tags=["second"])
        result = await asyncio.wait_for(b.result(), 30)
        assert a.worker_id == "w1" and b.worker_id == "w2"
        assert w1.runner.spool is not None
        kept = w1.runner.spool.output(a.id, 1, "y")
        assert kept is not None and kept.expires_at - asyncio.get_running_loop().time() > FETCHED_GRACE_S  # a pull
        assert result == digest(await a.output("y"))
        assert received_via(b) == {"x": "relay"}
        relay = server.core.relay
        assert relay.bytes_out >= 2 * SIZE  # B's pull, then the client's own fetch (w1 has no endpoint it reaches)
        assert w2.pulls.relayed_bytes == SIZE
        assert relay.streams == {} and relay.reserved == 0


async def test_consumers_of_one_output_on_one_worker_take_turns_on_the_relay(tmp_path: Path) -> None:
    """Three consumers of one relayed output on the same worker each get it whole: their fetches take turns
    (one stream of the output at a time) instead of replacing each other's stream."""
    async with fleet(tmp_path, data_listen=None) as (server, _w1, w2), Client(server.url, token=CLIENT_TOKEN) as client:
        a = await client.submit("make", args={"size": SIZE}, outputs=["y"], tags=["first"])
        await asyncio.wait_for(a.result(), 30)
        consumers = [await client.submit("take", inputs={"x": a.ref("y")}, tags=["second"]) for _ in range(3)]
        results = await asyncio.wait_for(asyncio.gather(*(plan.result() for plan in consumers)), 30)
        assert results == [digest(await a.output("y"))] * 3
        assert all(received_via(plan) == {"x": "relay"} for plan in consumers)
        assert w2.pulls.relayed_bytes == 3 * SIZE
        assert server.core.relay.streams == {}
