"""The dashboard in a real headless Chromium: a coordinator and a worker, a plan submitted from the page."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import pytest

from tests.e2e.browser import browser_page
from tests.e2e.conftest import ROOT, Cluster

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]

ARTIFACTS = ROOT / "test-artifacts"
ADMIN_TOKEN = "e2e-admin-secret"
@pytest.fixture
async def page() -> AsyncIterator[Any]:
    """A page in headless Chromium, driven by Playwright through the system browser."""
    async with browser_page(1400, 1000) as page:
        yield page


async def test_dashboard_shows_a_plan_submitted_from_the_page(cluster: Cluster, page: Any) -> None:
    """Logged in through its form with an admin token (never in the URL) the page lists the worker; a plan
    it submits appears, runs and ends succeeded with its events streamed live, a client's plan shows up
    too, and a plan nobody can run sits in the queue with its reason."""
    await cluster.coordinator("--admin-token", ADMIN_TOKEN)
    await cluster.worker("w1", "--tags", "dash", "--carbon-zone", "FR", "--uj-per-token", "900")
    http_url = cluster.url.replace("ws://", "http://", 1)
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))

    await page.goto(f"{http_url}/")
    await page.wait_for_selector("#token-form:not([hidden])", timeout=15_000)  # no token yet: the login form
    assert "log in" in await page.text_content("#token-error")
    await page.fill("#token", ADMIN_TOKEN)
    await page.click("#login")
    await page.wait_for_selector('#conn-status[data-state="connected"]', timeout=15_000)
    assert ADMIN_TOKEN not in page.url
    assert await page.evaluate('sessionStorage.getItem("fleetwire-token")') == ADMIN_TOKEN
    await page.wait_for_selector('#workers tr[data-worker-id="w1"]', timeout=15_000)
    assert "1 workers" in await page.text_content("#summary")
    assert "alive" in await page.text_content('#workers tr[data-worker-id="w1"]')
    row = await page.text_content('#workers tr[data-worker-id="w1"]')
    assert "dash" in row and "900 µJ/token" in row and "56 g/kWh (FR)" in row, row

    await page.fill("#op", "sleep")
    await page.fill("#args", '{"seconds": 1}')
    await page.fill("#tags", "dash")
    await page.click("#submit-button")
    row = page.locator("#plans tbody tr").first
    await row.wait_for(timeout=10_000)
    plan_id = await row.get_attribute("data-plan-id")
    assert plan_id
    # It appears first live (queued/leased/running), then finishes, without a reload.
    await page.wait_for_selector(f'#plans tr[data-plan-id="{plan_id}"][data-state="running"]', timeout=10_000)
    await page.wait_for_selector(f'#plans tr[data-plan-id="{plan_id}"][data-state="succeeded"]', timeout=15_000)
    await page.wait_for_selector('#events tr[data-kind="succeeded"]', timeout=5_000)
    kinds = await page.eval_on_selector_all("#events tbody tr", "rows => rows.map(r => r.dataset.kind)")
    assert kinds[0] == "queued" and kinds[-1] == "succeeded", kinds
    assert "running" in kinds
    assert "w1" in await page.text_content(f'#plans tr[data-plan-id="{plan_id}"]')
    # Listings carry no result bodies: the selected plan's result is fetched on demand (get_plan).
    await page.wait_for_selector('#plan-result[data-state="succeeded"]:not([hidden])', timeout=5_000)

    # A plan submitted elsewhere, by a client, appears live too: the page holds an admin token.
    other = await cluster.run("submit", "echo", "--args", '"from the cli"', "--json")
    assert await other.wait() == 0
    other_id = json.loads(other.lines[0])["plan_id"]
    await page.wait_for_selector(f'#plans tr[data-plan-id="{other_id}"][data-state="succeeded"]', timeout=10_000)
    # Its op is not in its events: the page learns it from the list_plans it sends on an unknown plan.
    await page.wait_for_selector(f'#plans tr[data-plan-id="{other_id}"] td:nth-child(2):text-is("echo")',
                                 timeout=10_000)

    # A plan no worker can run waits in the queue, and the page says why.
    await page.fill("#op", "train")
    await page.fill("#tags", "")
    await page.click("#submit-button")
    queued = page.locator("#queue li").first
    await queued.wait_for(timeout=10_000)
    await page.wait_for_selector("#queue li .reason", timeout=10_000)
    assert "no connected worker handles op 'train'" in await queued.text_content()
    await page.wait_for_selector('#plan-counts:has-text("1 queued, 2 succeeded")', timeout=10_000)

    ARTIFACTS.mkdir(exist_ok=True)
    await page.screenshot(path=str(ARTIFACTS / "dashboard.png"), full_page=True)

    # A reload keeps the session (sessionStorage); logging out forgets the token.
    await page.reload()
    await page.wait_for_selector('#conn-status[data-state="connected"]', timeout=15_000)
    await page.click("#logout")
    await page.wait_for_selector("#token-form:not([hidden])", timeout=5_000)
    assert await page.evaluate('sessionStorage.getItem("fleetwire-token")') is None
    assert not errors, errors


async def test_dashboard_without_a_valid_token_asks_for_one(cluster: Cluster, page: Any) -> None:
    """A wrong token typed into the form fails the handshake and the page shows the form again with a message."""
    await cluster.coordinator()
    http_url = cluster.url.replace("ws://", "http://", 1)
    await page.goto(f"{http_url}/")
    await page.wait_for_selector("#token-form:not([hidden])", timeout=15_000)
    await page.fill("#token", "wrong")
    await page.click("#login")
    await page.wait_for_selector('#token-error:has-text("check the token")', timeout=15_000)
    assert await page.get_attribute("#conn-status", "data-state") == "disconnected"


async def test_a_token_in_the_link_is_ignored_and_removed_from_the_address(cluster: Cluster, page: Any) -> None:
    """/#token=<a valid token>: the page never uses it (no websocket opens, nothing stored), removes it from the
    address bar and its history entry, and asks to log in with the form, which then works."""
    await cluster.coordinator("--admin-token", ADMIN_TOKEN)
    http_url = cluster.url.replace("ws://", "http://", 1)
    sockets: list[str] = []
    page.on("websocket", lambda ws: sockets.append(ws.url))
    await page.goto(f"{http_url}/healthz")  # the entry before, to go back to
    await page.goto(f"{http_url}/#token={ADMIN_TOKEN}")
    await page.wait_for_selector('#token-error:has-text("the token in the link was ignored")', timeout=15_000)
    assert "log in with the form" in await page.text_content("#token-error")
    assert page.url == f"{http_url}/"
    assert await page.evaluate('sessionStorage.getItem("fleetwire-token")') is None
    assert await page.get_attribute("#conn-status", "data-state") == "disconnected"
    assert sockets == []
    # The link's history entry was replaced, not kept: back and forward never show the token again.
    await page.go_back()
    assert page.url == f"{http_url}/healthz"
    await page.go_forward()
    assert page.url == f"{http_url}/"
    await page.wait_for_selector("#token-form:not([hidden])", timeout=15_000)
    await page.fill("#token", ADMIN_TOKEN)
    await page.click("#login")
    await page.wait_for_selector('#conn-status[data-state="connected"]', timeout=15_000)
    assert ADMIN_TOKEN not in page.url
    opened = len(sockets)
    # Such a link pasted into the open tab (a fragment change, no reload): removed and refused too.
    await page.evaluate("location.hash = '#token=another'")
    await page.wait_for_selector('#token-error:has-text("the token in the link was ignored")', timeout=5_000)
    assert page.url == f"{http_url}/" and len(sockets) == opened
