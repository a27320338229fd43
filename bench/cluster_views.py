"""Cluster mode's cross-shard views: a watch on a non-owner (doorbell path) vs on the owner, in one run.

Starts a PostgreSQL server (tests/pg.py), 2 coordinators (their shards settled over both) and one
worker of a pool whose shard coordinator B owns; this process is the client. It measures:

* **submit -> result p50/p99, owner**: sequential ``submit`` + ``result()`` on B's core (the
  client names the pool, so it is moved there);
* **submit -> terminal event p50/p99, watched on A**: the same plans, each also watched by a
  view session on A's main port (``Client(url_a)``, no pool): ``subscribe`` right after
  ``accepted``, then the time until A sent the terminal event, read from the rows after B's
  doorbell (docs/CLUSTER.md §Cross-shard views);
* **doorbell NOTIFYs**: a LISTEN connection counts the notifications during a burst of
  ``--plans`` plans (``submit_many``), against the plans and their events: at most one per group
  commit, so far fewer than events.

    python bench/cluster_views.py                  # 300 round trips, a burst of 5,000 plans
    python bench/cluster_views.py --samples 100 --plans 2000 --json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import _harness as h
from cluster_throughput import _pools, _settled

from coordinator.io.cluster.doorbell import CHANNEL
from coordinator.shards import pool_shard
from fleetwire import Client
from tests.pg import missing_reason, postgres_server


def _get(url: str) -> bytes:
    with urllib.request.urlopen(url.replace("ws://", "http://", 1), timeout=5) as answer:
        return bytes(answer.read())


async def measure(dsn: str, ns: argparse.Namespace) -> dict[str, Any]:
    import asyncpg  # type: ignore[import-untyped]

    fleets = [h.Fleet(dsn) for _ in range(2)]
    try:
        for f in fleets:
            await f.start_coordinator()
        urls = [f.url for f in fleets]
        rows = await _settled(urls)
        assert rows is not None, "this build has no /v1/topology"
        pool = _pools(rows, 2)[0]
        owner = {r["shard"]: r["owner"] for r in rows}[pool_shard(pool, len(rows))]
        ids = [json.loads(await asyncio.to_thread(_get, u + "/v1/topology"))["coordinator"] for u in urls]
        non_owner = urls[ids.index(next(i for i in ids if i != owner))]
        main = fleets[0]
        main.url = ",".join(urls)
        await main.start_worker("views-1", "--pool", pool, max_concurrency=1000)
        await main.wait_workers()
        tags = [f"pool:{pool}"]
        owner_ms: list[float] = []
        watched_ms: list[float] = []
        async with Client(urls, pool=pool) as client, Client(non_owner) as viewer:
            for i in range(20):  # warm up both paths
                plan = await client.submit("echo", args=i, tags=tags)
                await (await viewer.watch(plan.id)).result()
            for i in range(ns.samples):
                t0 = time.perf_counter()
                plan = await client.submit("echo", args=i, tags=tags)
                watch = asyncio.ensure_future(viewer.watch(plan.id))
                await plan.result()
                owner_ms.append(time.perf_counter() - t0)
                await (await watch).result()
                watched_ms.append(time.perf_counter() - t0)
            heard = 0

            def count(*_: Any) -> None:
                nonlocal heard
                heard += 1

            listener = await asyncpg.connect(dsn)
            await listener.add_listener(CHANNEL, count)
            try:
                t0 = time.perf_counter()
                plans = await client.submit_many("echo", range(ns.plans), tags=tags)
                for plan in plans:
                    await plan.result()
                elapsed = time.perf_counter() - t0
                info = await client.get_plan(plans[-1].id)
                events_per_plan = info.last_seq
                await asyncio.sleep(0.2)  # the last notifications of the burst
            finally:
                await listener.close()
        return {
            "pool": pool,
            "owner": h.summary_ms(owner_ms),
            "watched_on_non_owner": h.summary_ms(watched_ms),
            "burst_plans": ns.plans,
            "burst_s": round(elapsed, 3),
            "events_per_plan": events_per_plan,
            "notifies": heard,
            "notifies_per_plan": round(heard / ns.plans, 4),
            "notifies_per_event": round(heard / max(1, ns.plans * events_per_plan), 4),
            "doorbell_warnings": [line for f in fleets if f.coordinator is not None
                                  for line in f.coordinator.lines if "doorbell" in line][-5:],
        }
    finally:
        for f in reversed(fleets):
            await f.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=300, help="sequential round trips (default 300)")
    parser.add_argument("--plans", type=int, default=5000, help="plans of the doorbell burst (default 5000)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    ns = parser.parse_args(argv)
    why = missing_reason()
    if why is not None:
        print(f"cluster_views: skipped: {why}")
        return 0

    async def run() -> dict[str, Any]:
        with postgres_server() as server:
            return await measure(server.new_database(), ns)

    r = h.run_loop(run())
    o, w = r["owner"], r["watched_on_non_owner"]
    lines = [
        f"machine: {h.machine()}",
        "| | p50 ms | p99 ms |",
        "|---|---|---|",
        f"| submit -> result, on the owner | {o['p50_ms']} | {o['p99_ms']} |",
        f"| submit -> terminal event, watched on a non-owner | {w['p50_ms']} | {w['p99_ms']} |",
        f"| ratio | {w['p50_ms'] / o['p50_ms']:.2f}x | {w['p99_ms'] / o['p99_ms']:.2f}x |",
        f"doorbell: {r['notifies']} NOTIFYs for a burst of {r['burst_plans']} plans ({r['events_per_plan']} events "
        f"each) in {r['burst_s']} s: {r['notifies_per_plan']} per plan, {r['notifies_per_event']} per event",
    ]
    h.emit(r, ns.json, lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
