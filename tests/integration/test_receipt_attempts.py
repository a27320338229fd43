"""A plan's receipt on a worker with a power model when its next attempt starts on the same worker
before the last one ended (issue #25 part 9: "a 25 s plan on a worker with a power model can show
~0.0 J"). A real coordinator, a real worker agent (no NVML: the estimated path) and the SDK, over
loopback websockets."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from coordinator.io.frontdoor.server import CoordinatorServer, ServerSettings
from fleetwire import Client
from worker_agent import Agent
from worker_agent.telemetry import Telemetry

pytestmark = pytest.mark.timeout(30)

WORKER_TOKEN = "worker-token-0123456789"
ADMIN_TOKEN = "admin-token-0123456789"
POWER_W = 100.0


async def slow_to_stop(ctx: Any, args: Any) -> int:
    """Runs ``args["seconds"]``; cancelled, it takes a second to clean up (as a subprocess given its kill grace)."""
    try:
        await asyncio.sleep(args["seconds"])
    except asyncio.CancelledError:
        await asyncio.sleep(1.0)
        raise
    return int(ctx.attempt)


async def test_an_attempt_started_while_the_last_one_still_ends_gets_its_own_energy() -> None:
    """Attempt 1 taken back (drain with deadline 0) and attempt 2 given to the same worker at once:
    attempt 2's receipt holds its share of the power model over its run, not ~0 J (attempt 1 ending
    took the start the meter had noted for attempt 2: both were keyed by the plan id)."""
    server = CoordinatorServer(ServerSettings(port=0, worker_tokens=(WORKER_TOKEN,), admin_tokens=(ADMIN_TOKEN,),
                                              store="memory"))  # fmt: skip
    await server.start()
    agent = Agent(server.url, WORKER_TOKEN, worker_id="w1", telemetry=Telemetry(power_w=POWER_W))
    agent.add_handler("slow_to_stop", slow_to_stop)
    task = asyncio.create_task(agent.run())
    try:
        await asyncio.wait_for(agent.registered.wait(), 10)
        async with Client(server.url, token=ADMIN_TOKEN) as client:
            plan = await client.submit("slow_to_stop", {"seconds": 2.0})
            async for event in plan.events():
                if event.kind == "running":
                    break
            await client.drain("w1", deadline_s=0)  # attempt 1 is taken back: cancelled on the worker
            await client.undrain("w1")  # attempt 2 comes to w1 while attempt 1 still cleans up
            assert await asyncio.wait_for(plan.result(), 15) == 2
        receipt = plan.receipt
        assert receipt is not None and receipt.source == "power_model", receipt
        # At most two attempts ran at once on w1: attempt 2 took at least half the power over its run.
        assert receipt.joules >= POWER_W * receipt.run_s / 2 > 0, receipt
        assert receipt.run_s >= 1.9, receipt
    finally:
        agent.stop()
        await asyncio.wait_for(task, 10)
        await server.stop()
