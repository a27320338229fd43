"""The dashboard's queue, filter and pages, in a real headless Chromium: a coordinator, a worker, plans from the SDK.

Issue #25 part 9: the queue listed ids without their wait reason and they could not be clicked; the
plan list had no filter and no pages.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest

from fleetwire.client import Client
from tests.e2e.browser import browser_page
from tests.e2e.conftest import ADMIN_TOKEN, CLIENT_TOKEN, Cluster

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]

ROW_IDS = "rows => rows.map(r => r.dataset.planId)"
REASON = "no connected worker handles op 'train'"


@pytest.fixture
async def page() -> AsyncIterator[Any]:
    """A page in headless Chromium, driven by Playwright through the system browser."""
    async with browser_page(1400, 1000) as page:
        yield page


async def test_queue_reasons_and_links_filters_and_pages(cluster: Cluster, page: Any) -> None:
    """Each queued plan shown says why it waits (also those off the listed page) and its id opens its detail;
    the list is filtered by op, part of the id and state, paged older/newer, and a #plan= link opens a plan."""
    await cluster.coordinator()
    await cluster.worker("w1")
    async with Client(url=cluster.url, token=CLIENT_TOKEN) as client:
        for i in range(30):
            await client.submit("train", {"i": i}, plan_id=f"train-{i:02}")  # no worker runs it: queued
        echoes = [await client.submit("echo", {"i": i}, plan_id=f"echo-{i:02}") for i in range(40)]
        await asyncio.gather(*(p.result() for p in echoes))
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    http_url = cluster.url.replace("ws://", "http://", 1)
    await page.goto(http_url + "/")
    await page.fill("#token", ADMIN_TOKEN)
    await page.click("#login")
    await page.wait_for_selector('#conn-status[data-state="connected"]', timeout=15_000)
    await page.select_option("#page-size", "25")
    await page.wait_for_selector('#queue-depth[data-depth="30"]', timeout=10_000)
    await page.wait_for_function("() => document.querySelectorAll('#queue li').length === 25"
                                 " && document.querySelectorAll('#plans tbody tr').length === 25", timeout=10_000)
    assert "30 waiting; the first 25 shown" in await page.text_content("#queue-depth")
    # The page's 25 rows are echo plans: the train plans' reasons come with the queue (list_plans' waiting).
    shown = await page.eval_on_selector_all("#plans tbody tr", ROW_IDS)
    assert all(i.startswith("echo-") for i in shown), shown
    reasons = await page.eval_on_selector_all("#queue li .reason", "spans => spans.map(s => s.textContent)")
    assert reasons == [REASON] * 25, reasons

    # A queued plan's id is a link to its detail.
    await page.click('#queue li[data-plan-id="train-02"] a')
    await page.wait_for_selector('#detail[data-plan-id="train-02"][data-state="queued"]', timeout=10_000)
    await page.wait_for_selector(f'#detail-fields dd[data-field="waiting"]:text-is("{REASON}")', timeout=10_000)
    assert page.url.endswith("#plan=train-02")

    # Filtered by op, two pages of 25 + 15, newest first.
    await page.fill("#filter-op", "echo")
    await page.wait_for_selector('#page-info[data-total="40"]', timeout=10_000)
    first = await page.eval_on_selector_all("#plans tbody tr", ROW_IDS)
    assert first == [f"echo-{i:02}" for i in range(39, 14, -1)], first
    await page.click("#page-older")
    await page.wait_for_selector('#page-info[data-page="2"]', timeout=10_000)
    await page.wait_for_function("() => document.querySelectorAll('#plans tbody tr').length === 15", timeout=10_000)
    assert await page.eval_on_selector_all("#plans tbody tr", ROW_IDS) == [f"echo-{i:02}" for i in range(14, -1, -1)]
    assert await page.is_disabled("#page-older")
    await page.click("#page-newer")
    await page.wait_for_selector('#page-info[data-page="1"]', timeout=10_000)
    await page.wait_for_function("() => document.querySelectorAll('#plans tbody tr').length === 25", timeout=10_000)
    # A part of the id, and a state.
    await page.fill("#filter-op", "")
    await page.fill("#filter-id", "train-1")
    await page.wait_for_selector('#page-info[data-total="10"]', timeout=10_000)
    assert await page.eval_on_selector_all("#plans tbody tr", ROW_IDS) == [f"train-{i}" for i in range(19, 9, -1)]
    await page.fill("#filter-id", "")
    await page.select_option("#filter-state", "succeeded")
    await page.wait_for_selector('#page-info[data-total="40"]', timeout=10_000)
    await page.select_option("#filter-state", "unfinished")
    await page.wait_for_selector('#page-info[data-total="30"]', timeout=10_000)
    assert "30 matching plans" in await page.text_content("#page-info")

    # A link to a plan opens its detail on load.
    await page.goto(http_url + "/#plan=echo-05")
    await page.wait_for_selector('#detail[data-plan-id="echo-05"][data-state="succeeded"]', timeout=15_000)
    await page.wait_for_selector('#plan-result[data-state="succeeded"]:not([hidden])', timeout=10_000)
    assert not errors, errors
