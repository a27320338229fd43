"""Custom handlers in a process of their own per device set (worker_agent/handler_proc.py), over real sockets."""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator

import pytest

from coordinator.io.frontdoor.server import CoordinatorServer, ServerSettings
from fleetwire import Client
from fleetwire.errors import PlanFailed
from tests import isolated_handlers
from worker_agent import Agent

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
async def fleet() -> AsyncIterator[tuple[CoordinatorServer, Agent]]:
    """A coordinator and a worker declaring two GPUs, whose ops are the isolated handlers (default isolation)."""
    coordinator = CoordinatorServer(ServerSettings(port=0, insecure=True, store="memory"))
    await coordinator.start()
    agent = Agent(coordinator.url, None, worker_id="gpu-w", gpus="0,1", max_concurrency=4, gpu_health_interval_s=0)
    agent.add_handler("visible", isolated_handlers.visible)
    agent.add_handler("refuses", isolated_handlers.refuses)
    agent.add_handler("sleeps", isolated_handlers.sleeps)
    agent.add_handler("inline_visible", isolated_handlers.visible, isolation="inline")
    task = asyncio.create_task(agent.run())
    await asyncio.wait_for(agent.registered.wait(), 10)
    try:
        yield coordinator, agent
    finally:
        agent.stop()
        await asyncio.wait_for(task, 20)
        await coordinator.stop()


async def test_two_plans_holding_one_gpu_each_see_only_their_own(fleet: tuple[CoordinatorServer, Agent]) -> None:
    """Two concurrent 1-GPU plans each see only their device in os.environ, in a process of their own; a third
    plan reuses a child; a plan holding none sees none; the worker's token never reaches them."""
    coordinator, agent = fleet
    async with Client(coordinator.url) as client:
        plans = [await client.submit("visible", args={"hold_s": 0.5}, resources={"gpus": 1}) for _ in range(2)]
        results = [await plan.result() for plan in plans]
        seen = sorted((r["cuda"], r["nvidia"], tuple(r["devices"])) for r in results)
        assert seen == [("0", "0", ("0",)), ("1", "1", ("1",))]
        assert all(r["pid"] != os.getpid() and r["token"] is None for r in results)
        again = await (await client.submit("visible", resources={"gpus": 1})).result()
        assert again["pid"] in {r["pid"] for r in results}  # reused: no new process for a known device set
        none = await (await client.submit("visible")).result()
        assert (none["cuda"], none["nvidia"], none["rocr"]) == ("", "void", "")
        inline = await (await client.submit("inline_visible", resources={"gpus": 1})).result()
        assert inline["pid"] == os.getpid()
    assert agent._handler_processes.started == 3  # device sets "0", "1" and none


async def test_a_handler_error_keeps_its_code_and_a_cancel_stops_the_child(
    fleet: tuple[CoordinatorServer, Agent],
) -> None:
    """A HandlerError raised in the child fails the plan with its code; cancelling a running plan ends its process."""
    coordinator, _ = fleet
    async with Client(coordinator.url) as client:
        plan = await client.submit("refuses", resources={"gpus": 1})
        with pytest.raises(PlanFailed) as caught:
            await plan.result()
        assert caught.value.code == "bad_input" and "refused in its own process" in str(caught.value)
        running = await client.submit("sleeps", resources={"gpus": 1})
        async for event in running.events():
            if event.kind == "running":
                break
        await running.cancel()
        state = (await client.get_plan(running.id)).state
        assert state == "cancelled"
