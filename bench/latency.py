"""Latency: sequential submit → result through a real coordinator and a real worker.

One plan at a time: ``submit("echo")`` then ``await plan.result()``, N times, timed each
from the call to ``submit`` until the result is in the client's hands. Reports p50, p90,
p99 and the mean in milliseconds, and each process's CPU µs a plan over the timed plans: the
coordinator's and the workers' (from /proc, 10 ms ticks), the client's (this process, all its
threads: ``client``; its event loop's thread alone: ``client_loop``).

    python bench/latency.py                       # 2,000 samples after 200 warm-up plans
    python bench/latency.py --samples 200 --json  # the smoke size
    python bench/latency.py --spin-us 0           # without the lone round trip's busy-poll (wireio/spin.py)

``--spin-us``: every process's spin window (the coordinator's and workers' ``--spin-us``, this client's
``wireio.spin.SPIN``); the client's spin counts are in the result (``client_spin``).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

import _harness as h

from fleetwire import Client
from wireio.spin import SPIN


async def measure(samples: int, warmup: int, workers: int, store: str, profile: str | None,
                  spin_us: float | None = None) -> dict[str, Any]:
    profiler = h.Profiler(profile)
    spin = () if spin_us is None else ("--spin-us", f"{spin_us:g}")
    if spin_us is not None:
        SPIN.window_s = max(spin_us, 0.0) / 1e6
    async with h.fleet(store) as f:
        await f.start_coordinator(*spin)
        for i in range(workers):
            await f.start_worker(f"bench-{i + 1}", *spin, max_concurrency=4)
        await f.wait_workers()
        assert f.coordinator is not None
        pids = {"coordinator": f.coordinator.pid, **{w.name: w.pid for w in f.workers}}
        async with Client(f.url) as client:
            for i in range(warmup):
                await (await client.submit("echo", args=i)).result()
            for name, pid in {**pids, "client": os.getpid()}.items():
                profiler.attach(name, pid)
            cpu0 = {name: h.cpu_seconds(pid) for name, pid in pids.items()}
            client0, loop0 = time.process_time(), time.thread_time()  # the client: all its threads, its loop's
            times: list[float] = []
            clock = time.perf_counter
            for i in range(samples):
                t0 = clock()
                plan = await client.submit("echo", args=i)
                await plan.result()
                times.append(clock() - t0)
            client_cpu, loop_cpu = time.process_time() - client0, time.thread_time() - loop0
            cpu = {name: round((h.cpu_seconds(pid) - cpu0[name]) / samples * 1e6, 1) for name, pid in pids.items()}
            cpu["client"] = round(client_cpu / samples * 1e6, 1)
            cpu["client_loop"] = round(loop_cpu / samples * 1e6, 1)
        profiler.finish()
        store_used = f.store_used
        limits = f.limits_lifted
    return {
        "bench": "latency",
        "system": "fleetwire",
        "samples": samples,
        "workers": workers,
        "store_asked": store,
        "store_used": store_used,
        "limits_lifted": limits,
        **h.summary_ms(times),
        "cpu_us_per_plan": cpu,
        "spin_us": SPIN.window_s * 1e6,
        "client_spin": {k: getattr(SPIN, k) for k in ("spins", "hits", "misses", "busy", "contended", "polls")},
        "machine": h.machine(),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=2000, help="timed plans (default 2000)")
    parser.add_argument("--warmup", type=int, default=200, help="untimed plans first (default 200)")
    parser.add_argument("--workers", type=int, default=2, help="worker processes (default 2)")
    parser.add_argument("--spin-us", type=float, default=None, metavar="US",
                        help="every process's busy-poll window after a send (wireio/spin.py; 0: off; default: theirs)")
    h.common_args(parser)
    ns = parser.parse_args(argv)
    h.configure(ns)
    result = h.run_loop(measure(ns.samples, ns.warmup, ns.workers, ns.store, ns.profile, ns.spin_us))
    h.emit(result, ns.json, [
        f"fleetwire latency: {result['samples']} sequential echo plans, store {result['store_used']}",
        f"  p50 {result['p50_ms']} ms, p90 {result['p90_ms']} ms, p99 {result['p99_ms']} ms, "
        f"mean {result['mean_ms']} ms, max {result['max_ms']} ms",
        "  CPU µs per plan: " + ", ".join(f"{k} {v}" for k, v in result["cpu_us_per_plan"].items()),
    ])
    return 0


if __name__ == "__main__":
    sys.exit(main())
