"""GPU health end to end over real sockets: a fake NVML's XID quarantines a device, an operator releases it."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from coordinator.io.frontdoor.server import CoordinatorServer, ServerSettings
from fleetwire import Client
from tests.waiting import until
from worker_agent import Agent
from worker_agent.gpu_health import FakeNvml
from worker_agent.handlers import Context

pytestmark = pytest.mark.timeout(60)


async def test_an_xid_quarantines_a_device_and_a_release_puts_it_back_in_service() -> None:
    """XID 79 on device 0: the worker's load says quarantined (with the reason), a 1-GPU plan runs on device 1
    and the next waits; `release_device` ends the quarantine and the waiting plan runs on device 0."""
    coordinator = CoordinatorServer(ServerSettings(port=0, store="memory", worker_tokens=("w-token",),
                                                   admin_tokens=("a-token",)))  # fmt: skip
    await coordinator.start()
    nvml = FakeNvml(2)
    agent = Agent(coordinator.url, "w-token", worker_id="w1", gpus="0:80GB:H100,1:80GB:H100", max_concurrency=4,
                  gpu_health_interval_s=0.02, health_source=nvml)  # fmt: skip
    gate = asyncio.Event()

    @agent.handler("hold")
    async def hold(ctx: Context, args: Any) -> list[str]:
        await gate.wait()
        return ctx.devices

    task = asyncio.create_task(agent.run())
    try:
        await asyncio.wait_for(agent.registered.wait(), 10)
        registry = coordinator.core.registry
        await until(lambda: registry.get("w1").load is not None and len(registry.get("w1").load.devices) == 2)
        nvml.inject_xid(0, 79)
        await until(lambda: registry.get("w1").gpu_blocked == (0,), timeout_s=10)
        async with Client(coordinator.url, token="a-token") as client:
            row = (await client.workers()).workers[0]
            assert row.load is not None
            assert (row.load.devices[0].state, row.load.devices[0].reason) == (
                "quarantined", "fatal XID 79 (GPU has fallen off the bus)")  # fmt: skip
            first = await client.submit("hold", resources={"gpus": 1})
            second = await client.submit("hold", resources={"gpus": 1})
            await until(lambda: coordinator.core.plans[second.id].waiting_reason is not None)
            assert coordinator.core.plans[second.id].state == "queued"
            await client.release_device("w1", 0)
            await until(lambda: coordinator.core.plans[second.id].state == "running", timeout_s=10)
            gate.set()
            assert await first.result() == ["1"]
            assert await second.result() == ["0"]
            assert agent.health is not None and agent.health.rules.state(0) == ("ok", "")
    finally:
        agent.stop()
        await asyncio.wait_for(task, 10)
        await coordinator.stop()
