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


async def _quarantine_while_running(on_quarantine: str) -> tuple[list[str], list[dict[str, Any]], tuple[int, int]]:
    """A 1-GPU plan runs on device 0 when XID 79 quarantines it; its result, its preempted events, its attempt and
    free attempts."""
    coordinator = CoordinatorServer(ServerSettings(port=0, store="memory", insecure=True))
    await coordinator.start()
    nvml = FakeNvml(2)
    agent = Agent(coordinator.url, None, worker_id="w1", gpus="0:80GB:H100,1:80GB:H100", gpu_health_interval_s=0.02,
                  health_source=nvml, on_quarantine=on_quarantine, preemption_grace_s=0.0)  # fmt: skip
    gate = asyncio.Event()
    started: list[list[str]] = []

    @agent.handler("hold")
    async def hold(ctx: Context, args: Any) -> list[str]:
        started.append(ctx.devices)
        await gate.wait()
        return ctx.devices

    task = asyncio.create_task(agent.run())
    try:
        await asyncio.wait_for(agent.registered.wait(), 10)
        registry = coordinator.core.registry
        async with Client(coordinator.url) as client:
            plan = await client.submit("hold", resources={"gpus": 1})
            await until(lambda: started == [["0"]])
            nvml.inject_xid(0, 79)
            await until(lambda: registry.get("w1").gpu_blocked == (0,), timeout_s=10)
            if on_quarantine == "requeue":
                await until(lambda: len(started) == 2, timeout_s=10)
            gate.set()
            result = await plan.result()
            preempted = [e.data async for e in plan.events() if e.kind == "preempted"]
            record = coordinator.core.plans[plan.id]
            return result, preempted, (record.attempt, record.free_attempts)
    finally:
        agent.stop()
        await asyncio.wait_for(task, 10)
        await coordinator.stop()


async def test_a_quarantine_lets_running_plans_finish_by_default() -> None:
    """on_quarantine "finish" (the default): a plan running on a device that gets quarantined runs on and succeeds
    there, in its first attempt."""
    result, preempted, attempt = await _quarantine_while_running("finish")
    assert (result, preempted, attempt) == (["0"], [], (1, 0))


async def test_on_quarantine_requeue_moves_a_running_plan_to_a_healthy_device() -> None:
    """on_quarantine "requeue": XID 79 on the device a running plan holds preempts it, naming the device and the
    fault; it is queued again without charging an attempt and succeeds on the other device."""
    result, preempted, attempt = await _quarantine_while_running("requeue")
    assert result == ["1"]
    assert len(preempted) == 1 and "device 0 quarantined: fatal XID 79" in preempted[0]["reason"]
    assert attempt == (2, 1)  # the preempted attempt is not charged
