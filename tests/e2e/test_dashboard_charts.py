"""The dashboard's charts, plan detail panel, drain buttons and true counts, in a real headless Chromium.

A coordinator and a worker run as real processes; plans come from the SDK over a real socket; the
page is driven through Playwright with Debian's Chromium (never a downloaded browser). Screenshots
go to the test's temp dir and are copied to /tmp/dashboard_shots/ for a person to look at.
"""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from fleetwire.client import Client
from tests.e2e.browser import browser_page
from tests.e2e.conftest import ADMIN_TOKEN, CLIENT_TOKEN, Cluster

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(150)]

SHOTS = Path("/tmp/dashboard_shots")

# A chart line drew data when its path has points at two different heights (a flat line is all zeros).
NOT_FLAT = """sel => {
  const path = document.querySelector(sel);
  if (!path) return false;
  const ys = [...(path.getAttribute("d") || "").matchAll(/[ML][\\d.]+,([\\d.]+)/g)].map(m => Number(m[1]));
  return ys.length > 0 && Math.min(...ys) < Math.max(...ys);
}"""
NON_EMPTY = """sel => {
  const p = document.querySelector(sel);
  return !!p && (p.getAttribute("d") || "").length > 0;
}"""


@pytest.fixture
async def page() -> AsyncIterator[Any]:
    """A page in headless Chromium, driven by Playwright through the system browser."""
    async with browser_page(1600, 1200) as page:
        yield page


async def _shot(page: Any, tmp_path: Path, name: str, **kwargs: Any) -> Path:
    path = tmp_path / name
    await page.screenshot(path=str(path), **kwargs)
    await asyncio.to_thread(SHOTS.mkdir, exist_ok=True)
    await asyncio.to_thread(shutil.copy, path, SHOTS / name)
    print(f"screenshot: {path} (copy: {SHOTS / name})")
    return path


async def test_dashboard_charts_detail_panel_drain_and_true_counts(cluster: Cluster, page: Any, tmp_path: Path) -> None:
    """Charts draw from live plans; a plan's detail opens beside the list and follows it live; cancel
    works from the panel; drain/undrain work from the workers table; the queue depth is the true count
    past the page's 100 rows and the state counts keep a fixed order; the page says "disconnected" rather
    than "No workers registered" before it has a session."""
    await cluster.coordinator()
    await cluster.worker("w1", "--tags", "dash", "--carbon-zone", "FR", "--max-concurrency", "4")
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    await page.goto(cluster.url.replace("ws://", "http://", 1) + "/")
    await page.wait_for_selector('#no-workers[data-state="disconnected"]', timeout=15_000)
    assert await page.text_content("#no-workers") == "disconnected"  # not "No workers registered."

    await page.fill("#token", ADMIN_TOKEN)
    await page.click("#login")
    await page.wait_for_selector('#conn-status[data-state="connected"]', timeout=15_000)
    await page.wait_for_selector('#workers tr[data-worker-id="w1"]', timeout=15_000)
    assert await page.is_hidden("#no-workers")

    async with Client(url=cluster.url, token=CLIENT_TOKEN) as client:
        # Plans run: the rate, latency and in-flight charts draw them.
        plans = await client.submit_many("echo", [{"i": i} for i in range(20)], tags=["dash"])
        await asyncio.gather(*(p.result() for p in plans))
        busy = [await client.submit("sleep", {"seconds": 3}, tags=["dash"]) for _ in range(3)]
        await page.wait_for_function(NOT_FLAT, arg='#chart-rate path[data-series="succeeded"]', timeout=20_000)
        await page.wait_for_function(NON_EMPTY, arg='#chart-latency path[data-series="p50"]', timeout=10_000)
        await page.wait_for_function(NON_EMPTY, arg='#chart-latency path[data-series="p99"]', timeout=10_000)
        await page.wait_for_function(NOT_FLAT, arg='#chart-inflight path[data-series="w1"]', timeout=15_000)
        await page.wait_for_function(NOT_FLAT, arg='#chart-load path[data-series="w1"]', timeout=10_000)
        await page.wait_for_function(NON_EMPTY, arg='#chart-queue path[data-series="queued"]', timeout=10_000)
        await page.wait_for_function(NON_EMPTY, arg='#chart-energy path[data-series="Wh/min"]', timeout=10_000)
        await asyncio.gather(*(p.result() for p in busy))

        # A running plan's detail opens beside the list and its events arrive while it is open.
        long = await client.submit("sleep", {"seconds": 60}, tags=["dash"])
        row = page.locator(f'#plans tr[data-plan-id="{long.id}"]')
        await row.wait_for(timeout=10_000)
        await page.wait_for_selector(f'#plans tr[data-plan-id="{long.id}"][data-state="running"]', timeout=10_000)
        await row.click()
        await page.wait_for_selector(f'#detail[data-plan-id="{long.id}"][data-state="running"]', timeout=5_000)
        await page.wait_for_selector('#events tr[data-kind="running"]', timeout=5_000)
        opened_at = await page.eval_on_selector_all(
            "#events tbody tr", "rows => Math.max(...rows.map(r => +r.dataset.seq))")
        # progress comes about once a second: one newer than any shown at open is live
        await page.wait_for_function(
            "seq => [...document.querySelectorAll('#events tbody tr')].some(r => +r.dataset.seq > seq"
            " && r.dataset.kind === 'progress')", arg=opened_at, timeout=10_000)
        await page.wait_for_selector('#detail-fields dd[data-field="owner"]:text-is("client")', timeout=5_000)
        assert await page.text_content('#detail-fields dd[data-field="worker"]') == "w1"
        assert "w1" in await page.text_content('#detail-attempts tr[data-attempt="1"]')
        panel = await page.locator("#detail").bounding_box()
        table = await page.locator("#plans").bounding_box()
        assert panel["x"] > table["x"] + table["width"] - 1, (panel, table)  # beside the list, not below it
        assert panel["y"] < table["y"] + table["height"], (panel, table)
        await _shot(page, tmp_path, "dashboard_running_detail.png", full_page=True)

        # Cancel from the panel: the plan ends cancelled and the panel says so.
        await page.click("#detail-cancel")
        await page.wait_for_selector('#events tr[data-kind="cancelled"]', timeout=10_000)
        await page.wait_for_selector(f'#plans tr[data-plan-id="{long.id}"][data-state="cancelled"]', timeout=5_000)
        await page.wait_for_selector('#detail[data-state="cancelled"]', timeout=5_000)
        await page.wait_for_selector('#detail-fields dd[data-field="error"]:has-text("cancelled")', timeout=5_000)
        assert await page.is_hidden("#detail-cancel")
        with pytest.raises(Exception, match="cancel"):
            await long.result()

        # Drain and undrain from the workers table (the page holds the admin token).
        await page.click('#workers tr[data-worker-id="w1"] button[data-action="drain"]')
        await page.wait_for_selector('#workers tr[data-worker-id="w1"] .state-draining', timeout=10_000)
        await page.click('#workers tr[data-worker-id="w1"] button[data-action="undrain"]')
        await page.wait_for_selector('#workers tr[data-worker-id="w1"] button[data-action="drain"]', timeout=10_000)
        assert await page.locator('#workers tr[data-worker-id="w1"] .state-draining').count() == 0

        # 205 plans wait (no worker runs "train"): the depth says 205 though the list holds one page.
        await client.submit_many("train", [{"i": i} for i in range(205)])
        await page.wait_for_selector('#queue-depth[data-depth="205"]', timeout=15_000)
        await page.click("#plans tbody tr:first-child")  # a queued plan's detail says why it waits
        await page.wait_for_selector('#detail-fields dd[data-field="waiting"]', timeout=10_000)
        await page.wait_for_function(NOT_FLAT, arg='#chart-queue path[data-series="queued"]', timeout=10_000)
        assert "205 waiting; the first 100 shown" in await page.text_content("#queue-depth")  # one page (100 rows)
        assert await page.locator("#queue li").count() == 100
        # Fixed order, every refresh: queued first, then the rest in lifecycle order.
        for _ in range(2):
            await page.wait_for_function(
                "() => document.querySelector('#plan-counts').textContent"
                " === 'plans: 205 queued, 23 succeeded, 1 cancelled'", timeout=10_000)
            await page.evaluate("refreshPlans()")
        await _shot(page, tmp_path, "dashboard_queue_and_charts.png", full_page=True)
        await _shot(page, tmp_path, "dashboard_viewport.png")
    assert not errors, errors
