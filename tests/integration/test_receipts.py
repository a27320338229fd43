"""Energy and carbon receipts end to end in one process: a real coordinator, a real worker agent (no NVML:
the estimated path) and the SDK, over loopback websockets."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest

from coordinator.io.frontdoor.server import CoordinatorServer, ServerSettings
from fleetwire import Client, PlanFailed, SyncClient
from worker_agent import Agent
from worker_agent.carbon import CarbonIntensity
from worker_agent.energy import EnergyMeter
from worker_agent.telemetry import Telemetry

pytestmark = pytest.mark.timeout(30)

WORKER_TOKEN = "worker-token-0123456789"
CLIENT_TOKEN = "client-token-0123456789"


def generate(ctx: Any, args: Any) -> str:
    """Reports 500 generated tokens."""
    ctx.report_tokens(500)
    return "ok"


def broken(ctx: Any, args: Any) -> None:
    raise RuntimeError("no")


async def test_plan_receipt_through_the_sdk_on_a_worker_without_nvml() -> None:
    """Every finished plan (succeeded or failed) has plan.receipt: the worker's power-model estimate,
    gCO2e at its zone, and, once the worker reported µJ/token, placement's projection for the hinted tokens."""
    server = CoordinatorServer(ServerSettings(port=0, worker_tokens=(WORKER_TOKEN,), client_tokens=(CLIENT_TOKEN,),
                                              store="memory"))  # fmt: skip
    await server.start()
    telemetry = Telemetry(meter=EnergyMeter(configured_uj_per_token=2_000.0), carbon=CarbonIntensity("DE"),
                          power_w=50.0)  # fmt: skip
    agent = Agent(server.url, WORKER_TOKEN, worker_id="w1", telemetry=telemetry)
    agent.add_handler("generate", generate)
    agent.add_handler("broken", broken)
    task = asyncio.create_task(agent.run())
    try:
        await asyncio.wait_for(agent.registered.wait(), 10)
        async with Client(server.url, token=CLIENT_TOKEN) as client:
            hints = {"prompt_tokens": 100, "max_output_tokens": 400}
            first = await client.submit("generate", hints=hints)
            assert first.receipt is None  # not ended yet
            assert await asyncio.wait_for(first.result(), 10) == "ok"
            # The agent's first heartbeat (µJ/token, zone) left before this plan's done: the next is projected.
            second = await client.submit("generate", hints=hints)
            await asyncio.wait_for(second.result(), 10)
            failed = await client.submit("broken")
            with pytest.raises(PlanFailed):
                await asyncio.wait_for(failed.result(), 10)
            stored = await client.get_plan(second.id)
        for plan in (first, second, failed):
            r = plan.receipt
            assert r is not None, plan.id
            assert r.estimated and r.source == "power_model" and r.joules >= 0 and r.run_s >= 0
            assert r.intensity_g_per_kwh == 381.0  # DE in the built-in table
            assert r.co2e_g == pytest.approx(r.joules / 3.6e6 * 381.0, rel=1e-3, abs=1e-9)
        assert first.receipt is not None and first.receipt.tokens == 500
        assert second.receipt is not None and second.receipt.projected_joules == pytest.approx(0.8)  # 2000 µJ x 400 out
        assert second.receipt.projected_co2e_g == pytest.approx(0.8 / 3.6e6 * 381.0)
        assert stored.receipt == second.receipt
        assert sum(server.core.footprint.joules.values()) == pytest.approx(
            sum(p.receipt.joules for p in (first, second, failed) if p.receipt is not None))
    finally:
        agent.stop()
        await asyncio.wait_for(task, 10)
        await server.stop()


def test_sync_plan_has_the_receipt_too() -> None:
    """SyncPlan.receipt is the plan's receipt once it ended."""
    loop = asyncio.new_event_loop()
    ready = threading.Event()
    urls: list[str] = []

    async def serve(stop: asyncio.Event) -> None:
        server = CoordinatorServer(ServerSettings(port=0, worker_tokens=(WORKER_TOKEN,),
                                                  client_tokens=(CLIENT_TOKEN,), store="memory"))  # fmt: skip
        await server.start()
        agent = Agent(server.url, WORKER_TOKEN, worker_id="w1", telemetry=Telemetry(power_w=10.0))
        agent.add_handler("generate", generate)
        task = asyncio.create_task(agent.run())
        try:
            await asyncio.wait_for(agent.registered.wait(), 10)
            urls.append(server.url)
            ready.set()
            await stop.wait()
        finally:
            ready.set()
            agent.stop()
            await asyncio.wait_for(task, 10)
            await server.stop()

    stop = asyncio.Event()
    thread = threading.Thread(target=loop.run_until_complete, args=(serve(stop),))
    thread.start()
    try:
        assert ready.wait(15) and urls, "the coordinator and worker started"
        with SyncClient(urls[0], token=CLIENT_TOKEN) as client:
            plan = client.submit("generate")
            assert plan.result(timeout=10) == "ok"
            assert plan.receipt is not None and plan.receipt.source == "power_model" and plan.receipt.estimated
    finally:
        loop.call_soon_threadsafe(stop.set)
        thread.join(20)
        loop.close()
