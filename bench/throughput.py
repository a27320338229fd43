"""Throughput: N no-op plans end to end through a real coordinator and real workers.

The client (this process) submits every plan with ``Client.submit_many`` (a few frames for
thousands of plans), the coordinator places them on the workers, the workers run the
built-in ``echo`` op, and the client waits for every plan's terminal event. The figure is
plans per second from the first submit to the last terminal event; the CPU seconds each
process used in that window say where the time went.

    python bench/throughput.py                      # 20,000 plans, 2 workers
    python bench/throughput.py --plans 300 --json   # the smoke size
    python bench/throughput.py --profile /tmp/prof  # py-spy flame graphs of each process
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from typing import Any

import _harness as h
import psutil

from fleetwire import Client


async def _add_helpers(pids: dict[str, int]) -> None:
    """Add the processes' helper processes (a tracer's span exporter: wireio/span_export.py), the client's too,
    once their start-up (the exporter's imports) is over: their CPU counts, their start-up does not."""
    known = set(pids.values())  # the client's children are the daemons themselves, and its exporter
    for name, pid in [*pids.items(), ("client", os.getpid())]:
        for i, child in enumerate(c for c in psutil.Process(pid).children() if c.pid not in known):
            pids[f"{name} exporter" if "wireio.span_export" in child.cmdline() else f"{name} child {i}"] = child.pid
    helpers = [pid for name, pid in pids.items() if " " in name]
    last: list[float] = []
    for _ in range(100):  # up to 20 s: quiet once no 10 ms tick was added in 200 ms
        now = [h.cpu_seconds(pid) for pid in helpers]
        if now == last:
            break
        last = now
        await asyncio.sleep(0.2)


async def measure(
    plans: int, workers: int, max_concurrency: int, store: str, chunk: int, profile: str | None,
    deadline_s: float = 300.0,
) -> dict[str, Any]:
    profiler = h.Profiler(profile)
    async with h.fleet(store) as f:
        await f.start_coordinator()
        for i in range(workers):
            await f.start_worker(f"bench-{i + 1}", max_concurrency=max_concurrency)
        await f.wait_workers()
        assert f.coordinator is not None
        pids = {"coordinator": f.coordinator.pid, **{w.name: w.pid for w in f.workers}}
        async with Client(f.url) as client:
            # One warm-up plan so connection set-up and imports are not timed.
            await (await client.submit("echo", args=0)).result()
            await _add_helpers(pids)
            for name, pid in {**pids, "client": os.getpid()}.items():
                profiler.attach(name, pid)
            cpu0 = {name: h.cpu_seconds(pid) for name, pid in pids.items()}
            self0 = time.process_time()
            t0 = time.perf_counter()
            submitted = []
            for start in range(0, plans, chunk):
                submitted += await client.submit_many("echo", range(start, min(plans, start + chunk)))
            t_accepted = time.perf_counter()
            failed = 0
            try:
                async with asyncio.timeout(deadline_s):
                    for plan in submitted:
                        try:
                            await plan.result()
                        except Exception:
                            failed += 1
            except TimeoutError:
                raise SystemExit(f"throughput: not every plan ended within {deadline_s} s; coordinator log tail:\n"
                                 + "\n".join(f.coordinator.lines[-20:])) from None
            elapsed = time.perf_counter() - t0
            cpu = {name: round(h.cpu_seconds(pid) - cpu0[name], 3) for name, pid in pids.items()}
            cpu["client"] = round(time.process_time() - self0, 3)
        profiler.finish()
        store_used = f.store_used
        limits = f.limits_lifted
    return {
        "bench": "throughput",
        "system": "fleetwire",
        "plans": plans,
        "workers": workers,
        "max_concurrency": max_concurrency,
        "submit_chunk": chunk,
        "store_asked": store,
        "store_used": store_used,
        "limits_lifted": limits,
        "failed": failed,
        "elapsed_s": round(elapsed, 4),
        "all_accepted_s": round(t_accepted - t0, 4),
        "plans_per_s": round(plans / elapsed, 1),
        "cpu_s": cpu,
        "cpu_us_per_plan": {name: round(s / plans * 1e6, 1) for name, s in cpu.items()},
        "machine": h.machine(),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--plans", type=int, default=20_000, help="plans to run (default 20000)")
    parser.add_argument("--workers", type=int, default=2, help="worker processes (default 2)")
    parser.add_argument("--max-concurrency", type=int, default=1000, help="plans each worker runs at once")
    parser.add_argument("--chunk", type=int, default=5000, help="plans per submit_many call (default 5000)")
    h.common_args(parser)
    ns = parser.parse_args(argv)
    h.configure(ns)
    result = h.run_loop(measure(ns.plans, ns.workers, ns.max_concurrency, ns.store, ns.chunk, ns.profile))
    h.emit(result, ns.json, [
        f"fleetwire throughput: {result['plans']} echo plans, {result['workers']} workers, "
        f"store {result['store_used']}",
        f"  {result['plans_per_s']:,.0f} plans/s ({result['elapsed_s']} s; all accepted after "
        f"{result['all_accepted_s']} s; {result['failed']} failed)",
        "  CPU µs per plan: " + ", ".join(f"{k} {v}" for k, v in result["cpu_us_per_plan"].items()),
    ])
    return 0 if result["failed"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
