"""The dashboard's GPU health, in a real headless Chromium: a quarantined device's row says why (issue #32).

An in-process coordinator and a worker agent whose fake NVML (worker_agent/gpu_health.py ``FakeNvml``)
injects a fatal XID: the workers table shows the device quarantined with its reason, and the
healthy device's temperature.
"""

from __future__ import annotations

import asyncio

import pytest

from coordinator.io.frontdoor.server import CoordinatorServer, ServerSettings
from tests.e2e.browser import browser_page
from tests.waiting import until
from worker_agent import Agent
from worker_agent.gpu_health import FakeNvml

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]


async def test_the_workers_table_shows_a_quarantined_device_and_why() -> None:
    """XID 79 on device 0: its cell in the worker's row reads "quarantined: fatal XID 79 (GPU has fallen off the
    bus)"; device 1 shows its temperature."""
    coordinator = CoordinatorServer(ServerSettings(port=0, store="memory", worker_tokens=("w-token",),
                                                   admin_tokens=("a-token",)))  # fmt: skip
    await coordinator.start()
    nvml = FakeNvml(2)
    nvml.set(1, temperature_c=67.0)
    agent = Agent(coordinator.url, "w-token", worker_id="w1", gpus="0:80GB:H100,1:80GB:H100",
                  gpu_health_interval_s=0.05, health_source=nvml)  # fmt: skip
    task = asyncio.create_task(agent.run())
    try:
        await asyncio.wait_for(agent.registered.wait(), 10)
        nvml.inject_xid(0, 79)
        await until(lambda: coordinator.core.registry.get("w1").gpu_blocked == (0,), timeout_s=10)
        async with browser_page(1400, 900) as page:
            errors: list[str] = []
            page.on("pageerror", lambda exc: errors.append(str(exc)))
            await page.goto(coordinator.url.replace("ws://", "http://", 1) + "/")
            await page.fill("#token", "a-token")
            await page.click("#login")
            await page.wait_for_selector('#conn-status[data-state="connected"]', timeout=15_000)
            row = '#workers tr[data-worker-id="w1"]'
            await page.wait_for_selector(f'{row}:has-text("quarantined: fatal XID 79 (GPU has fallen off the bus)")',
                                         timeout=15_000)  # fmt: skip
            assert "67 °C" in (await page.text_content(row) or "")
            assert not errors, errors
    finally:
        agent.stop()
        await asyncio.wait_for(task, 10)
        await coordinator.stop()
