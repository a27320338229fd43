"""Restart: a coordinator holding N open plans is killed (SIGKILL) and started again on its store.

Real processes on 127.0.0.1: a coordinator on a SQLite store, W workers (``--workers``), and this
process as the client. Each worker runs one long ``sleep`` plan (a lease the restart must give
back to it) and has a free slot; the other plans wait in the queue for a tag no worker has, so
the coordinator holds ``--plans`` open plans in all (default 200,000). Then the coordinator is
killed with SIGKILL and started again on the same port and store, and the benchmark reports,
from the kill:

* ``port_open_s``: ``GET /healthz`` first answers 200 (the port opens before the store loads);
* ``ready_s``: ``GET /readyz`` first answers 200 (every stored plan loaded);
* ``first_completion_s``: a new ``echo`` plan, submitted by a client that connected as soon as
  it could (its handshake waits for the load), has succeeded;
* ``last_worker_back_s``: every worker is connected again (``fleetwire_workers_connected``);
* ``rss_before_mb`` / ``rss_after_mb``: the coordinator's resident memory with the same open
  plans, before the kill and once every worker is back (the goal: within 10 %).

    python bench/restart.py                       # 200,000 open plans
    python bench/restart.py --plans 20000 --json  # smaller
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import time
from typing import Any

import _harness as h

from fleetwire import Client
from fleetwire.errors import FleetwireConnectionError

COORDINATOR_FLAGS = ("--heartbeat-interval", "2", "--heartbeat-timeout", "30")
PARKED_TAG = "parked-no-worker-has-this"


async def http_get(port: int, path: str, timeout_s: float = 2.0) -> tuple[int, str]:
    """``GET path`` on the coordinator's port: (status, body); (0, why) when it does not answer."""
    try:
        async with asyncio.timeout(timeout_s):
            reader, writer = await asyncio.open_connection(h.HOST, port)
            try:
                writer.write(f"GET {path} HTTP/1.1\r\nHost: {h.HOST}\r\nConnection: close\r\n\r\n".encode())
                await writer.drain()
                data = await reader.read()
            finally:
                writer.close()
                with contextlib.suppress(OSError):
                    await writer.wait_closed()
    except (OSError, TimeoutError) as exc:
        return 0, str(exc)
    head, _, body = data.partition(b"\r\n\r\n")
    try:
        status = int(head.split(b" ", 2)[1])
    except (IndexError, ValueError):
        return 0, head.decode(errors="replace")
    return status, body.decode(errors="replace")


async def until(probe: Any, t0: float, deadline: float, period_s: float = 0.01) -> float:
    """Seconds from ``t0`` until ``await probe()`` is true (polled every ``period_s``)."""
    while time.monotonic() < deadline:
        if await probe():
            return time.monotonic() - t0
        await asyncio.sleep(period_s)
    raise TimeoutError("the restarted coordinator did not get there before the deadline")


def metric(text: str, name: str) -> float | None:
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return None


async def workers_connected(port: int) -> float:
    status, body = await http_get(port, "/metrics")
    return (metric(body, "fleetwire_workers_connected") or 0.0) if status == 200 else 0.0


async def submit_open_plans(url: str, plans: int, workers: int) -> None:
    """One long sleep per worker (a running lease), the rest queued for a tag no worker has."""
    async with Client(url, token="") as client:
        running = await client.submit_many("sleep", [{"seconds": 3600}] * workers, max_attempts=10)
        chunk = 5000
        left = plans - workers
        while left > 0:
            count = min(chunk, left)
            await client.submit_many("echo", [{"n": i} for i in range(count)], tags=[PARKED_TAG])
            left -= count
        for plan in running:  # every worker holds its lease before the kill
            async with asyncio.timeout(60):
                async for event in plan.events():
                    if event.kind == "running":
                        break


async def first_completion(url: str, t0: float) -> float:
    """Seconds from ``t0`` until a new echo plan succeeded (the client connects as soon as it can)."""
    while True:  # until the new process listens: its handshake then waits for the load
        try:
            client = Client(url, token="", reconnect_base_s=0.05, reconnect_cap_s=0.2, reconnect_give_up_s=600,
                            open_timeout_s=60)  # fmt: skip
            await client.__aenter__()
            break
        except FleetwireConnectionError:
            await asyncio.sleep(0.01)
    try:
        plan = await client.submit("echo", {"hello": 1})
        await plan.result()
    finally:
        await client.__aexit__(None, None, None)
    return time.monotonic() - t0


async def measure(plans: int, workers: int, settle_s: float, deadline_s: float) -> dict[str, Any]:
    async with h.fleet("sqlite") as fleet:
        await fleet.start_coordinator(*COORDINATOR_FLAGS)
        for i in range(workers):
            await fleet.start_worker(f"restart-{i + 1}", "--max-concurrency", "2", max_concurrency=2)
        await fleet.wait_workers()
        t_submit = time.monotonic()
        await submit_open_plans(fleet.url, plans, workers)
        submit_s = time.monotonic() - t_submit
        gc.collect()
        await asyncio.sleep(settle_s)
        assert fleet.coordinator is not None
        rss_before = h.rss_bytes(fleet.coordinator.pid)
        fleet.coordinator.kill()
        t0 = time.monotonic()
        await fleet.coordinator.proc.wait()
        deadline = t0 + deadline_s
        port = fleet.port
        proc = await h.spawn("coordinator", *_coordinator_argv(fleet))
        fleet.coordinator = proc
        completion = asyncio.create_task(first_completion(fleet.url, t0))

        async def healthy() -> bool:
            return (await http_get(port, "/healthz", 0.5))[0] == 200

        async def ready() -> bool:
            return (await http_get(port, "/readyz", 0.5))[0] == 200

        async def all_back() -> bool:
            return await workers_connected(port) >= workers

        port_open_s = await until(healthy, t0, deadline, 0.005)
        status, body = await http_get(port, "/readyz")
        loading_seen = status == 503 and "loading the store" in body
        ready_s = await until(ready, t0, deadline)
        rss_ready = h.rss_bytes(proc.pid)
        last_worker_s = await until(all_back, t0, deadline, 0.05)
        first_completion_s = await completion
        await asyncio.sleep(settle_s)
        rss_after = h.rss_bytes(proc.pid)
    return {
        "bench": "restart",
        "open_plans": plans,
        "workers": workers,
        "submit_s": round(submit_s, 2),
        "port_open_s": round(port_open_s, 3),
        "readyz_503_loading_seen": loading_seen,
        "ready_s": round(ready_s, 3),
        "first_completion_s": round(first_completion_s, 3),
        "last_worker_back_s": round(last_worker_s, 3),
        "rss_before_mb": round(rss_before / 2**20, 1),
        "rss_at_ready_mb": round(rss_ready / 2**20, 1),
        "rss_after_mb": round(rss_after / 2**20, 1),
        "rss_change_pct": round(100 * (rss_after - rss_before) / rss_before, 1) if rss_before else None,
        "machine": h.machine(),
    }


def _coordinator_argv(fleet: h.Fleet) -> list[str]:
    """The command line the fleet started its coordinator with, on the same port and store."""
    import sys

    args = ["coordinator", "--host", h.HOST, "--port", str(fleet.port), "--insecure", "--log-level", "warning",
            "--store", "sqlite", "--data-dir", fleet.tmp.name, *COORDINATOR_FLAGS]
    for flag, value in h.BENCH_LIMITS.items():
        if h.coordinator_has_flag(flag):
            args += [flag, value]
    return [sys.executable, "-m", "fleetwire", *args]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--plans", type=int, default=200_000, help="open plans held at the kill (default 200000)")
    parser.add_argument("--workers", type=int, default=4, help="worker processes (default 4)")
    parser.add_argument("--settle", type=float, default=2.0, help="seconds before each RSS reading (default 2)")
    parser.add_argument("--deadline", type=float, default=600.0, help="seconds for the restart (default 600)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    ns = parser.parse_args(argv)
    if ns.plans <= ns.workers:
        parser.error("--plans must be more than --workers")
    r = h.run_loop(measure(ns.plans, ns.workers, ns.settle, ns.deadline))
    h.emit(r, ns.json, [
        f"fleetwire restart: {r['open_plans']} open plans, {r['workers']} workers (submitted in {r['submit_s']} s)",
        f"  from the kill -9: port open {r['port_open_s']} s (/readyz 503 'loading the store' seen: "
        f"{r['readyz_503_loading_seen']}), /readyz 200 {r['ready_s']} s",
        f"  first completion {r['first_completion_s']} s, last worker back {r['last_worker_back_s']} s",
        f"  RSS before {r['rss_before_mb']} MB, after {r['rss_after_mb']} MB ({r['rss_change_pct']:+} %; "
        f"{r['rss_at_ready_mb']} MB when /readyz turned 200)",
    ])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
