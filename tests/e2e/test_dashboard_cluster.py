"""The dashboard on a cluster coordinator's main port, in a real headless Chromium (PostgreSQL, two coordinators).

The page is opened on coordinator a; the plans it submits belong to a shard b owns. Issue #25 part 9:
the submit form did nothing and said nothing there (the main port answered ``moved`` and closed the
page's socket). Its listing is read from the rows, filtered there (op, owner, part of the id, state)
and paged by ``next_cursor``.
"""

from __future__ import annotations

import base64
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
from websockets.asyncio.client import connect
from websockets.typing import Subprotocol

from fleetwire import Client
from tests.e2e.browser import browser_page
from tests.e2e.conftest import ADMIN_TOKEN, CLIENT_TOKEN, Cluster
from tests.e2e.test_cluster import pool_on
from tests.e2e.test_cluster_sessions import two_coordinators

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(150)]


@pytest.fixture
async def page() -> AsyncIterator[Any]:
    """A page in headless Chromium, driven by Playwright through the system browser."""
    async with browser_page(1400, 1000) as page:
        yield page


async def listing(url: str, token: str, **request: Any) -> dict[str, Any]:
    """One ``list_plans`` on a main port's JSON session (the dashboard's way in); its answer."""
    bearer = "fleetwire.bearer." + base64.urlsafe_b64encode(token.encode()).decode().rstrip("=")
    async with connect(url + "/v1/client", subprotocols=[Subprotocol("fleetwire.v1.json"), Subprotocol(bearer)]) as ws:
        await ws.send(json.dumps({"type": "list_plans", "req_id": 1, **request}))
        reply = json.loads(await ws.recv())
    return reply[0] if isinstance(reply, list) else reply  # type: ignore[no-any-return]


async def test_the_page_on_a_non_owner_submits_and_filters_plans_of_another_shard(
    cluster: Cluster, pg_dsn: str, page: Any
) -> None:
    """On a's main port the submit form works for a plan of b's shard (forwarded; its events follow), and
    the plan list is filtered and paged by the view's SQL read: op, owner, part of the id, state."""
    _, a_url, _, b_url, b_shards = await two_coordinators(cluster, pg_dsn)
    pool = pool_on(b_shards[0])
    await cluster.worker("w-b", "--url", f"{a_url},{b_url}", "--pool", pool, "--reconnect-base", "0.05")
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    await page.goto(a_url.replace("ws://", "http://", 1) + "/")
    await page.fill("#token", ADMIN_TOKEN)
    await page.click("#login")
    await page.wait_for_selector('#conn-status[data-state="connected"]', timeout=15_000)
    await page.fill("#op", "echo")
    await page.fill("#args", '{"from": "the page"}')
    await page.fill("#tags", f"pool:{pool}")
    await page.click("#submit-button")
    # The form's plan runs on b's shard; the page (on a) shows it end with its events and result.
    await page.wait_for_selector('#events tr[data-kind="succeeded"]', timeout=30_000)
    await page.wait_for_selector('#detail[data-state="succeeded"]', timeout=10_000)
    assert await page.text_content("#submit-error") == ""
    plan_id = await page.get_attribute("#detail", "data-plan-id")
    assert plan_id
    await page.wait_for_selector('#plan-result[data-state="succeeded"]:not([hidden])', timeout=10_000)
    assert "the page" in await page.text_content("#plan-result")
    await page.wait_for_selector(f'#plans tr[data-plan-id="{plan_id}"][data-state="succeeded"]', timeout=15_000)
    assert await page.get_attribute("#conn-status", "data-state") == "connected"  # never moved, never closed

    # The view's listing, narrowed in SQL: 12 plans of two ops and two principals.
    async with Client([a_url, b_url], token=CLIENT_TOKEN, pool=pool) as client:
        for i in range(5):
            await client.submit("train", {"i": i}, tags=[f"pool:{pool}"], plan_id=f"train-{i}")  # no worker: queued
        for i in range(6):
            plan = await client.submit("echo", {"i": i}, tags=[f"pool:{pool}"], plan_id=f"echo-{i}")
            await plan.result()
    reply = await listing(a_url, ADMIN_TOKEN, op="train", limit=2)
    assert [p["id"] for p in reply["plans"]] == ["train-4", "train-3"] and reply["total"] == 5, reply
    older = await listing(a_url, ADMIN_TOKEN, op="train", limit=10, cursor=reply["next_cursor"])
    assert [p["id"] for p in older["plans"]] == ["train-2", "train-1", "train-0"] and not older.get("next_cursor")
    reply = await listing(a_url, ADMIN_TOKEN, id_contains="cho-", states=["succeeded"])
    assert {p["id"] for p in reply["plans"]} == {f"echo-{i}" for i in range(6)} and reply["total"] == 6, reply
    reply = await listing(a_url, ADMIN_TOKEN, owner="admin")  # the page's own plan: the admin principal's
    assert [p["id"] for p in reply["plans"]] == [plan_id] and reply["total"] == 1, reply
    reply = await listing(a_url, CLIENT_TOKEN, owner="admin")
    assert reply["type"] == "error" and reply["code"] == "forbidden", reply

    # The page's queue: the order lives in each shard's core, which the page says rather than list nothing.
    await page.evaluate("refreshPlans()")
    await page.wait_for_selector('#queue-depth:has-text("5 waiting; the order is each shard")', timeout=10_000)
    # The page's filter: only the train plans, newest first.
    await page.select_option("#filter-state", "queued")
    await page.select_option("#page-size", "25")
    await page.fill("#filter-op", "train")
    await page.wait_for_selector('#page-info[data-total="5"]', timeout=10_000)
    ids = await page.eval_on_selector_all("#plans tbody tr", "rows => rows.map(r => r.dataset.planId)")
    assert ids == [f"train-{i}" for i in range(4, -1, -1)], ids
    await page.fill("#filter-id", "train-3")
    await page.wait_for_selector('#page-info[data-total="1"]', timeout=10_000)
    assert await page.eval_on_selector_all("#plans tbody tr", "rows => rows.map(r => r.dataset.planId)") == ["train-3"]
    assert not errors, errors
