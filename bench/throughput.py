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
import gc
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


def _thread_seconds(pid: int) -> dict[str, float]:
    """CPU seconds each thread of a process has used so far: its main thread (the event loop) as ``loop``, the
    others by their id (CPython 3.11 gives a thread no OS name)."""
    try:
        tids = [int(tid) for tid in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        return {}
    return {"loop" if tid == pid else f"thread {tid}": h.cpu_seconds(pid, tid) for tid in tids}


def _sched_ns(pid: int, tid: int | None = None) -> tuple[int, int]:
    """A thread's (the process's main thread by default) nanoseconds on a CPU and waiting for one so far
    (``/proc/PID/task/TID/schedstat``); (0, 0) once it is gone."""
    try:
        with open(f"/proc/{pid}/task/{tid or pid}/schedstat") as fh:
            fields = fh.read().split()
        return int(fields[0]), int(fields[1])
    except (OSError, ValueError, IndexError):
        return 0, 0


def _machine_ticks() -> tuple[int, int]:
    """All CPU ticks of the machine so far and the idle ones (idle + iowait), from /proc/stat."""
    with open("/proc/stat") as fh:
        fields = [int(x) for x in fh.readline().split()[1:]]
    return sum(fields[:8]), fields[3] + fields[4]


class _Timeline:
    """``--timeline``: each process's CPU (``/proc/PID/schedstat``: nanoseconds, not 10 ms ticks) sampled every
    ``step_s`` in a thread of this process, written as one line a step: which process ran when, and who waited."""

    def __init__(self, pids: dict[str, int], step_s: float = 0.02) -> None:
        import threading

        self.pids, self.step_s = pids, step_s
        self.rows: list[tuple[float, dict[str, float]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    @staticmethod
    def _ns(pid: int) -> int:
        try:
            with open(f"/proc/{pid}/schedstat") as fh:
                return int(fh.read().split()[0])
        except (OSError, ValueError, IndexError):
            return 0

    def _run(self) -> None:
        last = {name: self._ns(pid) for name, pid in self.pids.items()}
        t0 = time.perf_counter()
        while not self._stop.wait(self.step_s):
            now = {name: self._ns(pid) for name, pid in self.pids.items()}
            self.rows.append((time.perf_counter() - t0, {n: (now[n] - last[n]) / 1e9 for n in now}))
            last = now

    def write(self, path: str) -> None:
        self._stop.set()
        self._thread.join()
        names = list(self.pids)
        with open(path, "w") as fh:
            fh.write("t_s " + " ".join(n.replace(" ", "_") for n in names) + "  (share of a core in the step)\n")
            prev = 0.0
            for t, cpu in self.rows:
                step = max(t - prev, 1e-9)
                prev = t
                fh.write(f"{t:.3f} " + " ".join(f"{cpu[n] / step:.2f}" for n in names) + "\n")


async def measure(
    plans: int, workers: int, max_concurrency: int, store: str, chunk: int, profile: str | None,
    deadline_s: float = 300.0, timeline: str | None = None, collect_after_warmup: bool = False,
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
            if collect_after_warmup:
                # The client's start-up garbage (imports: the OpenTelemetry SDK's at a traced level) collected
                # before the window, at every level alike, so no level's window holds a start-up collection.
                gc.collect()
            await _add_helpers(pids)
            for name, pid in {**pids, "client": os.getpid()}.items():
                profiler.attach(name, pid)
            cpu0 = {name: h.cpu_seconds(pid) for name, pid in pids.items()}
            threads0 = _thread_seconds(f.coordinator.pid)
            sched0 = _sched_ns(f.coordinator.pid)
            ticks0 = _machine_ticks()
            sampler = _Timeline({**pids, "client": os.getpid()}) if timeline else None
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
            sched1 = _sched_ns(f.coordinator.pid)
            cpu = {name: round(h.cpu_seconds(pid) - cpu0[name], 3) for name, pid in pids.items()}
            cpu["client"] = round(time.process_time() - self0, 3)
            ticks1 = _machine_ticks()
            if sampler is not None and timeline is not None:
                sampler.write(timeline)
            threads = {name: round(s - threads0.get(name, 0.0), 3)
                       for name, s in _thread_seconds(f.coordinator.pid).items()}
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
        "coordinator_threads_us_per_plan": {name: round(s / plans * 1e6, 1) for name, s in threads.items() if s},
        # The whole machine's idle share in the window (every process, this bench's or not): near 0 is CPU-bound.
        "machine_idle": round((ticks1[1] - ticks0[1]) / max(1, ticks1[0] - ticks0[0]), 3),
        # The event loop's thread over the window: on a CPU, runnable but waiting for one (the machine is busy), and
        # the rest asleep, with nothing to do (waiting for commits, for peers): the last is what the loop idles.
        "loop_share": {"on_cpu": round((sched1[0] - sched0[0]) / 1e9 / elapsed, 3),
                       "waiting_for_cpu": round((sched1[1] - sched0[1]) / 1e9 / elapsed, 3),
                       "asleep": round(1 - (sched1[0] - sched0[0] + sched1[1] - sched0[1]) / 1e9 / elapsed, 3)},
        "machine": h.machine(),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--plans", type=int, default=20_000, help="plans to run (default 20000)")
    parser.add_argument("--workers", type=int, default=2, help="worker processes (default 2)")
    parser.add_argument("--max-concurrency", type=int, default=1000, help="plans each worker runs at once")
    parser.add_argument("--chunk", type=int, default=5000, help="plans per submit_many call (default 5000)")
    parser.add_argument("--timeline", metavar="FILE",
                        help="write each process's CPU share every 20 ms of the window to FILE (where who waited)")
    parser.add_argument("--collect-after-warmup", action="store_true",
                        help="one full garbage collection in the client after the warm-up plan, before the window "
                             "(bench/compare.py --tracing passes it at every level: docs/PERFORMANCE.md §T32o)")
    h.common_args(parser)
    ns = parser.parse_args(argv)
    h.configure(ns)
    result = h.run_loop(measure(ns.plans, ns.workers, ns.max_concurrency, ns.store, ns.chunk, ns.profile,
                                   timeline=ns.timeline, collect_after_warmup=ns.collect_after_warmup))
    h.emit(result, ns.json, [
        f"fleetwire throughput: {result['plans']} echo plans, {result['workers']} workers, "
        f"store {result['store_used']}",
        f"  {result['plans_per_s']:,.0f} plans/s ({result['elapsed_s']} s; all accepted after "
        f"{result['all_accepted_s']} s; {result['failed']} failed)",
        "  CPU µs per plan: " + ", ".join(f"{k} {v}" for k, v in result["cpu_us_per_plan"].items()),
        "  coordinator threads, CPU µs per plan: "
        + ", ".join(f"{k} {v}" for k, v in result["coordinator_threads_us_per_plan"].items()),
        f"  machine idle in the window: {result['machine_idle']:.1%} (all processes, {os.cpu_count()} CPUs)",
        "  the event loop's thread in the window: " + ", ".join(
            f"{k.replace('_', ' ')} {v:.1%}" for k, v in result["loop_share"].items()),
    ])
    return 0 if result["failed"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
