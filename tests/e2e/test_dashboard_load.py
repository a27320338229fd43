"""The dashboard under load, in a real headless Chromium: ~500 plans/s, and the page's main thread stays responsive.

A coordinator and a worker run as real processes; the SDK submits echo plans at about 500 a second
for a few seconds while the page (logged in with an admin token: it receives every plan's events)
is watched by a probe in the page itself: the longest gap between two animation frames and the
time spent in long tasks the browser reports (PerformanceObserver ``longtask``), and by the CPU time of
the page's main thread (the DevTools protocol's ``ThreadTime``). Issue #25 part 9: the page froze 4-10 s
at ~100 plans/s. The figures are printed; the bounds are on what a loaded 2-core machine does not change:
the main thread's CPU time a plan, not the wall-clock time of its tasks (bench/dashboard_render.py
measures those with care, old page beside new).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest

from fleetwire.client import Client
from tests.e2e.browser import browser_page
from tests.e2e.conftest import ADMIN_TOKEN, CLIENT_TOKEN, Cluster

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180), pytest.mark.solo]  # its figures measure the machine

RATE = 500  # plans per second, asked for
SECONDS = 4
# Loose: a 2-core CI box shared by a coordinator, a worker, the SDK and Chromium. The page before this
# fix spent more time in long tasks than the run lasted at 500 plans/s (5.4-10 s of 5 s, 65 % of this
# test's longer run), this one 0-13 % on a loaded machine (bench/dashboard_render.py).
MAX_FRAME_GAP_MS = 1000
# The main thread's CPU time a plan while the plans stream and until the page has drawn them (ThreadTime).
# Long tasks are wall-clock time: at load 10-17 the page waits for a core inside its tasks, and their share of
# the run (bounded at 40 % before) reached 42-66 % for this page (failed 10 of 20 runs alone at load 13-17),
# within reach of the old page's 61 %. Its CPU time does not grow so: this page 0.39-0.52 ms a plan (20 runs,
# load 8-13), the old page (9d93a80's files) 1.85-1.95 ms at load 15 (3.7-3.9 s of CPU for 2,000 plans).
MAX_MAIN_THREAD_CPU_MS_PER_PLAN = 1.0

# Installed in the page: the longest gap between animation frames and the longest task, while it runs.
PROBE = """() => {
  const probe = { maxGapMs: 0, longestTaskMs: 0, longTaskMs: 0, longTasks: 0, frames: 0, running: true,
                  since: performance.now() };
  let last = performance.now();
  const tick = (t) => {
    probe.maxGapMs = Math.max(probe.maxGapMs, t - last);
    last = t;
    probe.frames += 1;
    if (probe.running) requestAnimationFrame(tick);
  };
  requestAnimationFrame(tick);
  probe.observer = new PerformanceObserver((list) => {
    for (const e of list.getEntries()) {
      probe.longTasks += 1;
      probe.longTaskMs += e.duration;
      probe.longestTaskMs = Math.max(probe.longestTaskMs, e.duration);
    }
  });
  probe.observer.observe({ type: "longtask" });
  window.__probe = probe;
}"""
READ_PROBE = """() => {
  const p = window.__probe;
  p.running = false;
  p.observer.disconnect();
  return { ranMs: performance.now() - p.since, maxGapMs: p.maxGapMs, longestTaskMs: p.longestTaskMs,
           longTaskMs: p.longTaskMs, longTasks: p.longTasks,
           frames: p.frames, renders: typeof state.renders === "number" ? state.renders : -1,
           rows: document.querySelectorAll('#plans tbody tr').length,
           queueItems: document.querySelectorAll('#queue li').length };
}"""


@pytest.fixture
async def page() -> AsyncIterator[Any]:
    """A page in headless Chromium, driven by Playwright through the system browser."""
    async with browser_page(1400, 1000) as page:
        yield page


async def submit_at(client: Client, rate: int, seconds: float) -> tuple[list[Any], float]:
    """Echo plans at about ``rate`` a second for ``seconds``, in batches every 50 ms; (plans, the rate reached)."""
    batch = max(1, rate // 20)
    plans: list[Any] = []
    start = time.monotonic()
    for i in range(int(seconds * 20)):
        plans += await client.submit_many("echo", [{"i": i, "j": j} for j in range(batch)])
        ahead = start + (i + 1) / 20 - time.monotonic()
        if ahead > 0:
            await asyncio.sleep(ahead)  # pacing the submitter, not waiting for state
    return plans, len(plans) / (time.monotonic() - start)


async def main_thread_cpu_s(devtools: Any) -> float:
    """The CPU time the page's main thread has used (seconds; Performance.getMetrics' ThreadTime)."""
    metrics = (await devtools.send("Performance.getMetrics"))["metrics"]
    return float(next(m["value"] for m in metrics if m["name"] == "ThreadTime"))


async def test_the_page_stays_responsive_at_500_plans_a_second(cluster: Cluster, page: Any) -> None:
    """At ~500 plans/s for 4 s the page's frames never stop for long and its main thread spends little CPU a plan
    (printed: the longest frame gap and task), it shows one page of rows, and once the plans end its counts are
    the coordinator's."""
    await cluster.coordinator()
    await cluster.worker("w1", "--max-concurrency", "64")
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    await page.goto(cluster.url.replace("ws://", "http://", 1) + "/")
    await page.fill("#token", ADMIN_TOKEN)
    await page.click("#login")
    await page.wait_for_selector('#conn-status[data-state="connected"]', timeout=15_000)
    await page.wait_for_selector('#workers tr[data-worker-id="w1"]', timeout=15_000)
    devtools = await page.context.new_cdp_session(page)
    await devtools.send("Performance.enable")
    cpu_before_s = await main_thread_cpu_s(devtools)
    await page.evaluate(PROBE)
    async with Client(url=cluster.url, token=CLIENT_TOKEN) as client:
        plans, rate = await submit_at(client, RATE, SECONDS)
        await asyncio.wait_for(asyncio.gather(*(p.result() for p in plans)), 60)
    figures = await page.evaluate(READ_PROBE)  # answered once the main thread has handled the events before it
    cpu_ms_per_plan = (await main_thread_cpu_s(devtools) - cpu_before_s) * 1000 / len(plans)
    print(
        f"dashboard at {rate:.0f} plans/s for {SECONDS} s ({len(plans)} plans): longest frame gap "
        f"{figures['maxGapMs']:.0f} ms, longest task {figures['longestTaskMs']:.0f} ms, "
        f"{figures['longTasks']} long tasks ({figures['longTaskMs']:.0f} ms in all, of {figures['ranMs']:.0f} ms), "
        f"{figures['frames']} frames, {figures['renders']} redraws, main thread CPU {cpu_ms_per_plan:.2f} ms a plan"
    )
    assert figures["maxGapMs"] < MAX_FRAME_GAP_MS, figures
    assert cpu_ms_per_plan < MAX_MAIN_THREAD_CPU_MS_PER_PLAN, (cpu_ms_per_plan, figures)
    assert figures["rows"] <= 100 and figures["queueItems"] <= 100, figures
    assert figures["renders"] < figures["frames"], figures  # redraws are batched, never one per event
    # The counts come back to the coordinator's: every plan succeeded (a listing refreshes them).
    await page.evaluate("refreshPlans()")
    await page.wait_for_function(
        "n => document.querySelector('#plan-counts').textContent === `plans: ${n} succeeded`",
        arg=len(plans),
        timeout=15_000,
    )
    assert not errors, errors
