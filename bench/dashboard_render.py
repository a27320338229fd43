"""The dashboard's main thread under a stream of plans: the page of a git revision beside this tree's.

    python bench/dashboard_render.py                        # 100 and 500 plans/s, 5 s each, old = 9d93a80
    python bench/dashboard_render.py --rates 500 --seconds 10 --old HEAD~3

Starts, as real processes on 127.0.0.1, an in-memory coordinator and one echo worker
(``--max-concurrency 64``), and a headless Chromium (Debian's, driven by Playwright) logged in to
the dashboard with an admin token, so the page receives every plan's events. For each page (``old``:
the dashboard files of ``--old``, served in place of this tree's through Playwright's request routing;
``new``: this tree's, as the coordinator serves them) and each rate, the SDK submits echo plans at that
rate for ``--seconds`` and waits for them all, while a probe in the page records the longest gap
between two animation frames, the longest task (PerformanceObserver ``longtask``) and their sum.
A frozen page shows as a long gap: issue #25 part 9 saw 4-10 s at ~100 plans/s.

One row per (page, rate), the old and the new page measured in the same run on the same processes.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from fleetwire import Client  # noqa: E402  (after the path set-up, as the other benches)

ADMIN = "bench-admin-token-0123456789"
CLIENT = "bench-client-token-0123456789"
WORKER = "bench-worker-token-0123456789"
FILES = {"/": "index.html", "/dashboard/app.js": "app.js", "/dashboard/charts.js": "charts.js",
         "/dashboard/style.css": "style.css"}  # fmt: skip
TYPES = {".html": "text/html; charset=utf-8", ".js": "text/javascript; charset=utf-8",
         ".css": "text/css; charset=utf-8"}  # fmt: skip
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  # a page fulfilled by the request routing (the old page) has no address: let it reach 127.0.0.1
                  "--disable-features=LocalNetworkAccessChecks"]  # fmt: skip
PROBE = """() => {
  const probe = { maxGapMs: 0, longestTaskMs: 0, longTaskMs: 0, longTasks: 0, frames: 0, running: true };
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
READ = """() => { const p = window.__probe; p.running = false; p.observer.disconnect();
  return { maxGapMs: p.maxGapMs, longestTaskMs: p.longestTaskMs, longTaskMs: p.longTaskMs, longTasks: p.longTasks,
           frames: p.frames }; }"""


def old_files(rev: str) -> dict[str, tuple[bytes, str]]:
    """The dashboard's files at ``rev`` (URL path -> body, content type)."""
    out = {}
    for path, name in FILES.items():
        body = subprocess.run(["git", "show", f"{rev}:coordinator/io/dashboard/{name}"], cwd=ROOT, check=True,
                              capture_output=True).stdout  # fmt: skip
        out[path] = (body, TYPES[Path(name).suffix])
    return out


async def start(*args: str, env: dict[str, str], ready: str) -> tuple[asyncio.subprocess.Process, str]:
    proc = await asyncio.create_subprocess_exec(sys.executable, "-m", "fleetwire", *args, env=env, cwd=ROOT,
                                                stdout=asyncio.subprocess.PIPE,
                                                stderr=asyncio.subprocess.DEVNULL)  # fmt: skip
    assert proc.stdout is not None
    async with asyncio.timeout(30):
        while line := (await proc.stdout.readline()).decode():
            if m := re.search(ready, line):
                return proc, m.group(0)
    raise RuntimeError(f"{args[0]} exited before printing {ready!r}")


async def submit_at(client: Client, rate: int, seconds: float) -> tuple[int, float]:
    """Echo plans at about ``rate`` a second in batches every 50 ms, then all their results; (plans, rate)."""
    batch = max(1, rate // 20)
    plans: list[Any] = []
    begin = time.monotonic()
    for i in range(int(seconds * 20)):
        plans += await client.submit_many("echo", [{"i": i, "j": j} for j in range(batch)])
        ahead = begin + (i + 1) / 20 - time.monotonic()
        if ahead > 0:
            await asyncio.sleep(ahead)
    rate_reached = len(plans) / (time.monotonic() - begin)
    await asyncio.wait_for(asyncio.gather(*(p.result() for p in plans)), 120)
    return len(plans), rate_reached


async def measure(browser: Any, http_url: str, url: str, files: dict[str, tuple[bytes, str]] | None, rate: int,
                  seconds: float) -> dict[str, Any]:  # fmt: skip
    context = await browser.new_context(viewport={"width": 1400, "height": 1000})
    page = await context.new_page()
    if files is not None:
        async def serve(route: Any) -> None:
            path = re.sub(r"^https?://[^/]+", "", route.request.url).split("?")[0].split("#")[0]
            body, kind = files.get(path, files["/"] if path == "/index.html" else (None, ""))  # type: ignore[arg-type]
            if body is None:
                await route.continue_()
            else:
                await route.fulfill(status=200, body=body, headers={"Content-Type": kind})
        await page.route(re.compile(r".*/(index\.html)?(#.*)?$|.*/dashboard/.*"), serve)
    try:
        await page.goto(http_url + "/")
        await page.fill("#token", ADMIN)
        await page.click("#login")
        await page.wait_for_selector('#conn-status[data-state="connected"]', timeout=15_000)
        await page.wait_for_selector('#workers tr[data-worker-id="w1"]', timeout=15_000)
        await page.evaluate(PROBE)
        async with Client(url=url, token=CLIENT) as client:
            plans, reached = await submit_at(client, rate, seconds)
        figures: dict[str, Any] = await page.evaluate(READ)
        figures.update(plans=plans, rate=reached)
        return figures
    finally:
        await context.close()


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--old", default="9d93a80", help="git revision of the old page (default 9d93a80)")
    parser.add_argument("--rates", default="100,500", help="plans per second, comma-separated (default 100,500)")
    parser.add_argument("--seconds", type=float, default=5.0, help="seconds of submitting per row (default 5)")
    ns = parser.parse_args()
    from playwright.async_api import async_playwright

    chromium = os.environ.get("FLEETWIRE_CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"
    data = tempfile.mkdtemp(prefix="fleetwire-bench-")
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLEETWIRE_")}
    env.update(FLEETWIRE_ADMIN_TOKEN=ADMIN, FLEETWIRE_CLIENT_TOKEN=CLIENT, FLEETWIRE_WORKER_TOKEN=WORKER,
               FLEETWIRE_DATA_DIR=data, PYTHONUNBUFFERED="1")  # fmt: skip
    coordinator, url = await start("coordinator", "--port", "0", "--store", "memory", env=env,
                                   ready=r"ws://[\d.]+:\d+")  # fmt: skip
    worker, _ = await start("worker", "--id", "w1", "--url", url, "--max-concurrency", "64",
                            env={**env, "FLEETWIRE_TOKEN": WORKER}, ready="registered")  # fmt: skip
    http_url = url.replace("ws://", "http://", 1)
    rows = []
    try:
        async with async_playwright() as pw:
            browser = await pw.chromium.launch(executable_path=chromium, headless=True, args=CHROMIUM_FLAGS)
            try:
                for rate in [int(r) for r in ns.rates.split(",")]:
                    for name, files in (("old " + ns.old, old_files(ns.old)), ("new (this tree)", None)):
                        rows.append((name, await measure(browser, http_url, url, files, rate, ns.seconds)))
            finally:
                await browser.close()
    finally:
        for proc in (worker, coordinator):
            proc.terminate()
            await proc.wait()
        shutil.rmtree(data, ignore_errors=True)
    print(f"dashboard main thread while plans stream ({ns.seconds:g} s each; admin page: every plan's events)")
    print(f"{'page':<18} {'plans/s':>8} {'plans':>6} {'max frame gap':>14} {'longest task':>13} "
          f"{'long tasks':>11} {'in long tasks':>14}")
    for name, f in rows:
        print(f"{name:<18} {f['rate']:>8.0f} {f['plans']:>6} {f['maxGapMs']:>11.0f} ms {f['longestTaskMs']:>10.0f} ms "
              f"{f['longTasks']:>11} {f['longTaskMs']:>11.0f} ms")


if __name__ == "__main__":
    asyncio.run(main())
