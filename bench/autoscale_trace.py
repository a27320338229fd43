"""The autoscaler's trace under a burst: workers over time, queue depth, time to drain back down.

Starts ``fleetwire up --autoscale MIN..MAX`` (the ``local`` provider: real ``fleetwire worker``
processes), submits a burst of ``sleep`` plans with the admin token, and samples ``list_workers``
and ``list_plans`` every ``--sample`` seconds until every plan finished and the fleet is back at
MIN workers. Prints one line per sample and a summary::

    python bench/autoscale_trace.py                      # 1..4 workers, 24 plans of 1 s
    python bench/autoscale_trace.py --max 8 --plans 64 --seconds 2 --json
    python bench/autoscale_trace.py --max 2 --target 2 --plans 4 --seconds 3   # a busy worker drained

The delays are short on purpose (upscale 0 s, downscale 2 s, cooldown 1 s); a production
coordinator keeps the defaults (30 s, 600 s, 60 s). tests/e2e/test_autoscale.py runs the same
:func:`trace` with a small burst.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import signal
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from fleetwire.client import Client  # noqa: E402


@dataclass
class Sample:
    """One instant: seconds since the burst, workers by state, plans queued and running."""

    t_s: float
    alive: int
    draining: int
    queued: int
    running: int
    workers: list[str]


@dataclass
class Trace:
    """What :func:`trace` saw."""

    samples: list[Sample] = field(default_factory=list)
    peak_workers: int = 0
    time_to_peak_s: float = 0.0
    burst_done_s: float = 0.0  # every plan finished
    back_down_s: float = 0.0  # the fleet back at MIN workers, none draining
    seen: list[str] = field(default_factory=list)  # every worker id that ever registered
    attempts: list[int] = field(default_factory=list)  # each plan's last attempt (1: never requeued)


async def _start_up(lo: int, hi: int, target: float, extra: list[str]) -> tuple[asyncio.subprocess.Process, str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLEETWIRE_")}
    env["PYTHONUNBUFFERED"] = "1"
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "fleetwire", "up", "--port", "0", "--autoscale", f"{lo}..{hi}",
        "--autoscale-target", str(target), "--autoscale-upscale-delay", "0", "--autoscale-downscale-delay", "2",
        "--autoscale-cooldown", "1", "--autoscale-drain-deadline", "30", "--max-concurrency", "1",
        "--log-level", "warning", *extra,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL, env=env, cwd=ROOT,
    )
    assert proc.stdout is not None
    url = admin = ""
    while not (url and admin):
        line = (await asyncio.wait_for(proc.stdout.readline(), 60)).decode()
        if not line:
            raise RuntimeError(f"fleetwire up exited with status {await proc.wait()} before it was up")
        if m := re.search(r"export FLEETWIRE_URL=(\S+)", line):
            url = m.group(1)
        if m := re.search(r"export FLEETWIRE_ADMIN_TOKEN=(\S+)", line):
            admin = m.group(1)
    return proc, url, admin


async def _sample(client: Client, t0: float) -> Sample:
    workers = (await client.workers()).workers
    plans = await client.plans(limit=1)
    alive = sorted(w.id for w in workers if w.alive and not w.draining)
    return Sample(
        t_s=round(time.monotonic() - t0, 2), alive=len(alive), draining=sum(w.draining for w in workers),
        queued=plans.counts.get("queued", 0), running=plans.counts.get("running", 0) + plans.counts.get("leased", 0),
        workers=alive,
    )


async def trace(lo: int = 1, hi: int = 4, plans: int = 24, seconds: float = 1.0, every_s: float = 0.25,
                timeout_s: float = 120.0, target: float = 1.0, extra: list[str] | None = None) -> Trace:
    """Run ``up --autoscale lo..hi``, submit the burst, sample until back at ``lo``; the coordinator is stopped."""
    proc, url, admin = await _start_up(lo, hi, target, extra or [])
    out = Trace()
    try:
        async with Client(url, token=admin) as client:
            deadline = time.monotonic() + timeout_s
            while (await _sample(client, time.monotonic())).alive < lo:  # the provider starts MIN workers
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the first {lo} workers did not register")
                await asyncio.sleep(every_s)
            t0 = time.monotonic()
            submitted = await client.submit_many("sleep", [{"seconds": seconds}] * plans)
            waits = [asyncio.ensure_future(p.result()) for p in submitted]
            seen: set[str] = set()
            while True:
                s = await _sample(client, t0)
                out.samples.append(s)
                seen.update(s.workers)
                if s.alive > out.peak_workers:
                    out.peak_workers, out.time_to_peak_s = s.alive, s.t_s
                if not out.burst_done_s and all(w.done() for w in waits):
                    out.burst_done_s = s.t_s
                if out.burst_done_s and s.alive == lo and s.draining == 0:
                    out.back_down_s = s.t_s
                    break
                if time.monotonic() > deadline:
                    raise TimeoutError(f"not back at {lo} workers after {timeout_s:g} s: {s}")
                await asyncio.sleep(every_s)
            for w in waits:
                await w
            out.seen = sorted(seen)
            out.attempts = [(await client.get_plan(p.id)).attempt for p in submitted]
    finally:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGINT)
        try:
            await asyncio.wait_for(proc.wait(), 30)
        except TimeoutError:
            proc.kill()
            await proc.wait()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--min", type=int, default=1)
    p.add_argument("--max", type=int, default=4)
    p.add_argument("--plans", type=int, default=24)
    p.add_argument("--seconds", type=float, default=1.0, help="each sleep plan's length")
    p.add_argument("--sample", type=float, default=0.25, help="seconds between samples")
    p.add_argument("--target", type=float, default=1.0, help="--autoscale-target: ongoing plans per worker")
    p.add_argument("--json", action="store_true", help="print the trace as one JSON object")
    ns = p.parse_args()
    result = asyncio.run(trace(ns.min, ns.max, ns.plans, ns.seconds, ns.sample, target=ns.target))
    if ns.json:
        print(json.dumps(asdict(result)))
        return
    print(f"{'t (s)':>7} {'alive':>5} {'drain':>5} {'queued':>6} {'running':>7}  workers")
    last: tuple[Any, ...] = ()
    for s in result.samples:
        row = (s.alive, s.draining, s.queued, s.running)
        if row != last:  # only the changes
            print(f"{s.t_s:7.2f} {s.alive:5d} {s.draining:5d} {s.queued:6d} {s.running:7d}  {' '.join(s.workers)}")
            last = row
    print(f"burst of {ns.plans} x {ns.seconds:g} s plans on up --autoscale {ns.min}..{ns.max}: peak "
          f"{result.peak_workers} workers at {result.time_to_peak_s:.2f} s; all done at {result.burst_done_s:.2f} s; "
          f"back to {ns.min} at {result.back_down_s:.2f} s (drain back down took "
          f"{result.back_down_s - result.burst_done_s:.2f} s); workers seen: {', '.join(result.seen)}; "
          f"plans requeued: {sum(a > 1 for a in result.attempts)}")


if __name__ == "__main__":
    main()
