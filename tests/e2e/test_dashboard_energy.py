"""The dashboard's energy figures and the plans' receipts agree, in a real headless Chromium.

Issue #25 part 9: the energy chart said "no worker reports power" while the receipts summed to ~10 kJ
(the chart read NVML power from the workers' load, which a worker with a power model has not), and
a long plan could show "~0.0 J". The chart now sums the receipts the terminal events carry, the same
figures each row shows.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest

from fleetwire.client import Client
from tests.e2e.browser import browser_page
from tests.e2e.conftest import ADMIN_TOKEN, CLIENT_TOKEN, Cluster
from tests.e2e.test_dashboard_charts import NOT_FLAT

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]


@pytest.fixture
async def page() -> AsyncIterator[Any]:
    """A page in headless Chromium, driven by Playwright through the system browser."""
    async with browser_page(1400, 1000) as page:
        yield page


async def test_the_energy_chart_sums_the_receipts_each_row_shows(cluster: Cluster, page: Any) -> None:
    """On a worker with a power model (no NVML) the chart draws energy, its note's total is the sum of the
    plans' receipts, and a 1.5 s plan's row shows the joules its receipt says (about 1.5 s x 100 W shared)."""
    await cluster.coordinator()
    await cluster.worker("w1", "--power-watts", "100", "--carbon-zone", "FR", "--max-concurrency", "4")
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    await page.goto(cluster.url.replace("ws://", "http://", 1) + "/")
    await page.fill("#token", ADMIN_TOKEN)
    await page.click("#login")
    await page.wait_for_selector('#conn-status[data-state="connected"]', timeout=15_000)
    assert "no receipts yet" in await page.text_content("#energy-note")
    async with Client(url=cluster.url, token=CLIENT_TOKEN) as client:
        slow = [await client.submit("sleep", {"seconds": 1.5}) for _ in range(2)]
        quick = await client.submit_many("echo", [{"i": i} for i in range(8)])
        await asyncio.gather(*(p.result() for p in [*slow, *quick]))
    receipts = [p.receipt for p in [*slow, *quick]]
    assert all(r is not None and r.source == "power_model" for r in receipts), receipts
    joules = sum(r.joules for r in receipts if r is not None)
    await page.wait_for_selector('#energy-note[data-receipts="10"]', timeout=15_000)
    assert float(await page.get_attribute("#energy-note", "data-joules")) == pytest.approx(joules, rel=1e-9)
    assert "receipts of 10 plans" in await page.text_content("#energy-note")
    await page.wait_for_function(NOT_FLAT, arg='#chart-energy path[data-series="Wh/min"]', timeout=10_000)
    receipt = slow[0].receipt
    assert receipt is not None and receipt.joules > 50  # 1.5 s at 100 W, shared with at most 3 others at times
    cell = f'#plans tr[data-plan-id="{slow[0].id}"] td:nth-child(7)'
    await page.wait_for_selector(f'{cell}:has-text("~{receipt.joules:.1f} J")', timeout=10_000)
    assert not errors, errors
