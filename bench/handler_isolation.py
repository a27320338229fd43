"""What running a custom handler in a process of its own costs per plan (worker_agent/handler_proc.py).

    python bench/handler_isolation.py --plans 200

Runs a trivial handler (tests/isolated_handlers.py ``visible``) through ``run_handler`` the way the
worker's runner does, for a plan holding device "0": in the worker's process (``inline``), in a
child reused for the device set (``process``, the default for plans holding devices), and in a new
child every time (what a plan pays when its device set has no idle child: its first plan, or after
a cancel). Prints the median and p90 per plan of each, side by side, measured in this run.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests import isolated_handlers
from worker_agent.handler_proc import HandlerProcesses, isolate
from worker_agent.handlers import Context, run_handler


def _ctx() -> Context:
    ctx = Context(plan_id="p", attempt=1, worker_id="w", args={}, sink=lambda kind, data, ephemeral: None)
    ctx.devices, ctx.cuda_visible_devices = ["0"], "0"
    return ctx


async def _measure(plans: int) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {"inline": [], "process (reused child)": [], "process (new child)": []}
    inline = isolate(isolated_handlers.visible, "inline", HandlerProcesses())
    reused_pool = HandlerProcesses()
    reused = isolate(isolated_handlers.visible, "process", reused_pool)
    for name, fn in (("inline", inline), ("process (reused child)", reused)):
        for _ in range(plans):
            t0 = time.perf_counter()
            done = await run_handler(fn, _ctx(), {})
            out[name].append(time.perf_counter() - t0)
            assert done.outcome == "succeeded", done
    await reused_pool.close()
    for _ in range(max(10, plans // 10)):
        fresh = HandlerProcesses(max_idle=0)  # no child kept: each plan starts one
        fn = isolate(isolated_handlers.visible, "process", fresh)
        t0 = time.perf_counter()
        done = await run_handler(fn, _ctx(), {})
        out["process (new child)"].append(time.perf_counter() - t0)
        assert done.outcome == "succeeded", done
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--plans", type=int, default=200, help="plans per mode (new child: a tenth, at least 10)")
    ns = parser.parse_args()
    results = asyncio.run(_measure(ns.plans))
    print(f"{'mode':<24} {'plans':>6} {'median':>10} {'p90':>10}")
    for name, samples in results.items():
        p90 = statistics.quantiles(samples, n=10)[-1]
        print(f"{name:<24} {len(samples):>6} {statistics.median(samples) * 1e3:>8.3f}ms {p90 * 1e3:>8.3f}ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
