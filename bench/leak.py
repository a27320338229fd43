"""Memory per plan: RSS slopes of a coordinator and its workers under a steady load of plans with data.

A real coordinator and ``--workers`` worker processes (each with a data endpoint) on 127.0.0.1;
this process is the client. For ``--minutes`` it submits ``--rate`` plans a minute, evenly
paced, each with an input of ``--input-bytes`` and an output of ``--output-bytes`` (the default
4 KiB + 3 KiB is about 7 KB a plan run), waits for its result and fetches its output, as a
client of a long-lived fleet does. Every ``--sample`` seconds it reads the RSS of every process;
after a warm-up (``--warmup`` minutes, default a fifth of the run, at most 2) it fits a line to
each process's samples and prints the slope in MiB per minute, the growth per plan, and the RSS
at each tenth of the run (a leak climbs to the end; an allocator warming up levels off). The
target is at most 0.1 MiB/min for each process over the default 10 minutes.

The coordinator keeps finished plans by design (``--plan-retention``, 24 h by default): that is
growth per plan until the retention is reached, not a leak. So it runs with a retention of half
the warm-up unless ``--plan-retention`` says otherwise (``86400``: its default, to see what a
retained plan costs: the line ``coordinator holds`` prints the RSS per plan held beside the bytes
its retention counts each one as).

    python bench/leak.py                       # 10 minutes, 150 plans/min, 1 worker
    python bench/leak.py --minutes 0.5         # the smoke
    python bench/leak.py --relay --workers 2   # inputs and outputs through the coordinator
    python bench/leak.py --minutes 3 --rate 600 --trace   # and what grew in each worker (tracemalloc)

At the end of the warm-up and at the end of the run, each worker is sent a ``leak_snapshot`` plan
that runs in the worker's own process: the second one reports what the cycle collector found
unreachable (objects a plan left in a reference cycle wait for the daemon's rarely run oldest
collection: fleetwire/cli/serve.py ``DAEMON_GC_THRESHOLDS``), the object types whose live count grew
(objgraph-style: a plan-keyed map that never shrinks shows as a type whose count grows by about
the number of plans), the C heap by kind of mapping, and with ``--trace`` (tracemalloc in the
workers: slower, and its bookkeeping is in their RSS, so read the slopes of a run without it) the
allocation sites that grew most.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import ctypes
import ctypes.util
import gc
import os
import sys
import tempfile
import time
from typing import Any

import _harness as h

from fleetwire import Client

MIB = 1 << 20

# ---------------------------------------------------------------------------- handlers (run in the workers)


async def copy(ctx: Any, args: Any) -> dict[str, int]:
    """Read input ``data`` whole; leave output ``out`` of ``args["out_bytes"]`` bytes made from it."""
    data = ctx.inputs["data"].read()
    size = int(args["out_bytes"])
    out = (data * (size // max(1, len(data)) + 1))[:size]
    ctx.output("out", out)
    return {"in": len(data), "out": len(out)}


_LAST: dict[str, Any] = {}


def snapshot(ctx: Any, args: Any) -> dict[str, Any]:
    """In the worker: the allocation sites and live object types that grew since the previous call."""
    import tracemalloc

    report_garbage = _garbage()
    counts = collections.Counter(type(o).__qualname__ for o in gc.get_objects())
    malloc = {**_mallinfo(), **_smaps(), "py_blocks": sys.getallocatedblocks()}
    if args.get("trim"):  # how much of the RSS is freed heap the C allocator kept
        _libc().malloc_trim(0)
        malloc["rss_after_trim"] = sum(v for k, v in _smaps().items() if k.startswith("rss_"))
        malloc["rss_before_trim"] = sum(v for k, v in malloc.items() if k.startswith("rss_") and "trim" not in k)
    report: dict[str, Any] = {"tracing": tracemalloc.is_tracing(), "malloc": malloc,
                              "malloc_before": _LAST.get("malloc", {}), "garbage": report_garbage}
    _LAST["malloc"] = malloc
    snap = tracemalloc.take_snapshot() if tracemalloc.is_tracing() else None
    before = _LAST.get("counts")
    if before is not None:
        grew = counts - before
        report["types_grown"] = grew.most_common(int(args.get("top", 15)))
    if snap is not None and "snap" in _LAST:
        ignore = (tracemalloc.Filter(False, tracemalloc.__file__),)
        previous = tracemalloc.Snapshot.load(_LAST["snap"]).filter_traces(ignore)
        stats = snap.filter_traces(ignore).compare_to(previous, "traceback")
        report["sites_grown"] = [
            {"kib": round(s.size_diff / 1024, 1), "count": s.count_diff,
             "where": [f"{f.filename.rsplit('/', 2)[-2]}/{f.filename.rsplit('/', 1)[-1]}:{f.lineno}"
                       for f in list(s.traceback)[-int(args.get("depth", 4)):]]}
            for s in stats[: int(args.get("top", 15))] if s.size_diff > 0
        ]
    _LAST["counts"] = counts
    if snap is not None:  # kept on disk: held here, its traces would count as live objects next time
        path = os.path.join(tempfile.gettempdir(), f"fleetwire-leak-{os.getpid()}.snapshot")
        snap.dump(path)
        _LAST["snap"] = path
    return report


def _garbage(top: int = 12) -> dict[str, Any]:
    """Collect every generation, counting what was unreachable (reference cycles the collector had not
    freed yet): the objects by type, and the most common cycles' types."""
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        found = gc.collect()
        garbage = list(gc.garbage)
        gc.garbage.clear()
    finally:
        gc.set_debug(0)
    by_type = collections.Counter(type(o).__qualname__ for o in garbage)
    del garbage
    gc.collect()  # now freed for real
    return {"objects": found, "by_type": by_type.most_common(top)}


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]


def _libc() -> Any:
    if "libc" not in _LAST:
        _LAST["libc"] = ctypes.CDLL(ctypes.util.find_library("c") or None)
    return _LAST["libc"]


def _mallinfo() -> dict[str, int]:
    """glibc's heap: bytes in use (``uordblks``), free in the heap (``fordblks``), mmapped; {} elsewhere."""
    try:
        mallinfo2 = _libc().mallinfo2
        mallinfo2.restype = _MallInfo2
        info = mallinfo2()
    except (OSError, AttributeError):
        return {}
    return {"in_use": info.uordblks, "free": info.fordblks, "mmapped": info.hblkhd, "arena": info.arena}


def _smaps() -> dict[str, Any]:
    """Resident bytes of this process by kind of mapping (the C heap, anonymous maps, files, stacks), and
    each anonymous mapping's (``maps``: start address -> [size, resident bytes])."""
    rss: dict[str, Any] = collections.Counter()
    maps: dict[str, list[int]] = {}
    kind = start = ""
    try:
        with open("/proc/self/smaps") as fh:
            for line in fh:
                head = line.split()
                if not head:
                    continue
                if "-" in head[0] and len(head) >= 5 and not head[0].endswith(":"):
                    name = head[5] if len(head) > 5 else ""
                    kind = ("rss_heap" if name == "[heap]" else "rss_stack" if name.startswith("[stack")
                            else "rss_anon" if not name else "rss_other" if name.startswith("[") else "rss_files")
                    lo, hi = (int(x, 16) for x in head[0].split("-"))
                    start = head[0].split("-")[0]
                    if kind in ("rss_anon", "rss_heap"):
                        maps[start] = [hi - lo, 0]
                elif head[0] == "Rss:":
                    rss[kind] += int(head[1]) * 1024
                    if start in maps and kind in ("rss_anon", "rss_heap"):
                        maps[start][1] = int(head[1]) * 1024
    except OSError:
        return {}
    return {**rss, "maps": maps}


# ---------------------------------------------------------------------------- measuring


async def coordinator_plans(url: str) -> dict[str, float]:
    """The coordinator's own count of the plans it holds and of their retained bytes (its /metrics)."""
    import httpx

    http = url.replace("ws://", "http://", 1).rstrip("/") + "/metrics"
    try:
        async with httpx.AsyncClient(timeout=10) as client:
            text = (await client.get(http)).text
    except httpx.HTTPError:
        return {}
    figures: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("fleetwire_plans{"):
            figures["plans"] = figures.get("plans", 0.0) + float(line.rsplit(" ", 1)[1])
        elif line.startswith("fleetwire_plans_retained_bytes "):
            figures["retained_bytes"] = float(line.rsplit(" ", 1)[1])
    return figures


def _tenths(series: list[tuple[float, int]]) -> list[tuple[float, int]]:
    """The samples nearest each tenth of the run (11 points: start, 10 %, ..., end)."""
    if not series:
        return []
    end = series[-1][0]
    return [min(series, key=lambda s: abs(s[0] - end * i / 10)) for i in range(11)]


def slope_mib_per_min(samples: list[tuple[float, int]]) -> float:
    """Least-squares slope of (seconds, bytes) samples, in MiB per minute (NaN with fewer than 2)."""
    if len(samples) < 2:
        return float("nan")
    n = len(samples)
    mean_t = sum(t for t, _ in samples) / n
    mean_r = sum(r for _, r in samples) / n
    var = sum((t - mean_t) ** 2 for t, _ in samples)
    if var == 0:
        return float("nan")
    cov = sum((t - mean_t) * (r - mean_r) for t, r in samples)
    return cov / var * 60 / MIB


async def measure(ns: argparse.Namespace) -> dict[str, Any]:
    duration_s = ns.minutes * 60
    warmup_s = (ns.warmup if ns.warmup is not None else min(2.0, ns.minutes / 5)) * 60
    sample_s = ns.sample if ns.sample is not None else max(0.25, min(5.0, duration_s / 120))
    payload = os.urandom(ns.input_bytes)
    extra_env = dict(item.split("=", 1) for item in ns.worker_env)
    if ns.trace:
        extra_env["PYTHONTRACEMALLOC"] = "10"
    env = h.bench_env(**extra_env)
    async with h.fleet(ns.store) as f:
        retention_s = ns.plan_retention if ns.plan_retention is not None else max(5.0, warmup_s / 2)
        await f.start_coordinator("--plan-retention", f"{retention_s:g}")
        for i in range(ns.workers):
            name = f"leak-{i + 1}"
            f.workers.append(await h.spawn(
                name, sys.executable, "-m", "fleetwire", "worker", "--url", f.url, "--id", name,
                "--tags", name, "--max-concurrency", "8", "--log-level", "warning",
                "--data-listen", "127.0.0.1:0", "--spool-dir", os.path.join(f.tmp.name, name),
                "--handler", "leak_copy=leak:copy", "--handler", "leak_snapshot=leak:snapshot", env=env,
            ))
        await f.wait_workers()
        assert f.coordinator is not None
        pids = {"coordinator": f.coordinator.pid, **{w.name: w.pid for w in f.workers}, "client": os.getpid()}
        samples: dict[str, list[tuple[float, int]]] = {name: [] for name in pids}
        counts = {"done": 0, "failed": 0, "warm": 0}
        failures: list[str] = []
        async with Client(f.url) as client:

            async def one(i: int) -> None:
                try:
                    plan = await client.submit(
                        "leak_copy", {"out_bytes": ns.output_bytes}, inputs={"data": payload}, outputs=["out"],
                        relay=ns.relay,
                    )
                    await plan.result()
                    out = await plan.output("out")
                    if len(out) != ns.output_bytes:
                        raise RuntimeError(f"output of {len(out)} bytes, not {ns.output_bytes}")
                    counts["done"] += 1
                except Exception as exc:  # counted and shown: a leak bench must not stop at one failure
                    counts["failed"] += 1
                    if len(failures) < 5:
                        failures.append(f"plan {i}: {type(exc).__name__}: {exc}")

            async def snapshots() -> list[dict[str, Any]]:
                plans = [await client.submit("leak_snapshot", {"top": 15, "trim": ns.trim}, tags=[w.name])
                         for w in f.workers]
                return [await p.result() for p in plans]

            t0 = time.monotonic()
            tasks: set[asyncio.Task[None]] = set()
            interval = 60.0 / ns.rate
            next_plan = next_sample = t0
            i = 0
            warm = False
            traced: dict[str, Any] = {}
            held: dict[str, dict[str, float]] = {}
            while (now := time.monotonic()) < t0 + duration_s:
                if not warm and now - t0 >= warmup_s:
                    warm = True
                    counts["warm"] = counts["done"]
                    await snapshots()
                    held["warm"] = {"rss": h.rss_bytes(f.coordinator.pid), **await coordinator_plans(f.url)}
                if now >= next_sample:
                    for name, pid in pids.items():
                        samples[name].append((now - t0, h.rss_bytes(pid)))
                    next_sample += sample_s
                if now >= next_plan and len(tasks) < ns.in_flight:
                    task = asyncio.create_task(one(i))
                    tasks.add(task)
                    task.add_done_callback(tasks.discard)
                    i += 1
                    next_plan += interval
                    continue
                await asyncio.sleep(max(0.0, min(next_plan, next_sample) - time.monotonic()))
            if tasks:
                await asyncio.wait(tasks, timeout=30)
            for w, report in zip(f.workers, await snapshots(), strict=True):
                traced[w.name] = report
            held["end"] = {"rss": h.rss_bytes(f.coordinator.pid), **await coordinator_plans(f.url)}
        store_used = f.store_used
    measured = duration_s - warmup_s
    plans_measured = counts["done"] - counts["warm"]
    procs = {}
    for name, series in samples.items():
        after = [(t, r) for t, r in series if t >= warmup_s]
        slope = slope_mib_per_min(after)
        procs[name] = {
            "rss_start_mib": round(series[0][1] / MIB, 1) if series else None,
            "rss_end_mib": round(series[-1][1] / MIB, 1) if series else None,
            "slope_mib_per_min": round(slope, 3),
            "bytes_per_plan": round(slope * MIB * measured / 60 / plans_measured) if plans_measured else None,
            "rss_by_tenth_mib": [round(r / MIB, 1) for _, r in _tenths(series)],
        }
    return {
        "bench": "leak", "minutes": ns.minutes, "warmup_minutes": round(warmup_s / 60, 2),
        "rate_per_min": ns.rate, "workers": ns.workers, "relay": ns.relay,
        "input_bytes": ns.input_bytes, "output_bytes": ns.output_bytes,
        "plans_done": counts["done"], "plans_failed": counts["failed"], "failures": failures,
        "store_used": store_used, "target_mib_per_min": 0.1, "processes": procs,
        "traced": traced, "plan_retention_s": retention_s,
        "coordinator_plans": _held(held, plans_measured), "machine": h.machine(),
    }


def _held(held: dict[str, dict[str, float]], plans_measured: int) -> dict[str, Any]:
    """The coordinator's plans (by its /metrics) at the end of the warm-up and of the run, and, when it came to
    hold most of the plans run in between (a retention longer than the run), the RSS grown per plan beside what
    its retention counts each one as."""
    warm, end = held.get("warm", {}), held.get("end", {})
    if "plans" not in warm or "plans" not in end:
        return {}
    figures: dict[str, Any] = {"warm": warm, "end": end}
    more = end["plans"] - warm["plans"]
    if more > 0 and more >= plans_measured / 2:
        figures["rss_bytes_per_plan_held"] = round((end["rss"] - warm["rss"]) / more)
        figures["retained_bytes_per_plan_held"] = round((end.get("retained_bytes", 0) - warm.get("retained_bytes", 0))
                                                        / more)
    return figures


def _lines(result: dict[str, Any]) -> list[str]:
    lines = [
        f"fleetwire leak: {result['minutes']} min at {result['rate_per_min']} plans/min, "
        f"{result['input_bytes']} B in + {result['output_bytes']} B out a plan"
        f"{' (relayed)' if result['relay'] else ''}, {result['workers']} worker(s), store {result['store_used']}",
        f"  plans: {result['plans_done']} succeeded, {result['plans_failed']} failed; "
        f"slopes fitted after {result['warmup_minutes']} min of warm-up "
        f"(target <= {result['target_mib_per_min']} MiB/min)",
    ]
    lines += [f"  ! {failure}" for failure in result["failures"]]
    for name, p in result["processes"].items():
        verdict = "ok" if p["slope_mib_per_min"] <= result["target_mib_per_min"] else "OVER"
        lines.append(
            f"  {name:<12} RSS {p['rss_start_mib']} -> {p['rss_end_mib']} MiB   "
            f"slope {p['slope_mib_per_min']:+.3f} MiB/min ({p['bytes_per_plan']} B/plan)  {verdict}"
        )
        lines.append(f"  {'':<12} RSS at each tenth of the run: {' '.join(map(str, p['rss_by_tenth_mib']))}")
    held = result.get("coordinator_plans") or {}
    if held:
        lines.append(
            f"  coordinator holds {held['warm']['plans']:.0f} -> {held['end']['plans']:.0f} plans "
            f"(--plan-retention {result['plan_retention_s']:g})"
            + (f"; its RSS grew {held['rss_bytes_per_plan_held']} B per plan it came to hold, its retention counts "
               f"{held['retained_bytes_per_plan_held']} B each" if "rss_bytes_per_plan_held" in held else ""))
    for worker, report in result.get("traced", {}).items():
        before, after = report.get("malloc_before") or {}, report.get("malloc") or {}
        if before and after:
            lines.append(f"  {worker}: memory over the fit: " + ", ".join(
                f"{k} {before[k] / MIB:.1f} -> {after[k] / MIB:.1f} MiB"
                for k in ("in_use", "free", "rss_heap", "rss_anon", "rss_files") if k in before and k in after)
                + f"; Python blocks {before['py_blocks']} -> {after['py_blocks']}"
                + (f"; malloc_trim: RSS {after['rss_before_trim'] / MIB:.1f} -> {after['rss_after_trim'] / MIB:.1f} MiB"
                   if "rss_after_trim" in after else ""))
        maps0, maps1 = before.get("maps", {}), after.get("maps", {})
        grown = sorted(((rss - maps0.get(start, [0, 0])[1], size, start) for start, (size, rss) in maps1.items()),
                       reverse=True)[:8]
        lines.append(f"  {worker}: anonymous mappings grown most: " + ", ".join(
            f"{start} ({size / MIB:.1f} MiB) +{delta / 1024:.0f} KiB" for delta, size, start in grown if delta > 0))
        garbage = report.get("garbage") or {}
        lines.append(f"  {worker}: cyclic garbage the collector found at the end: {garbage.get('objects')} objects, "
                     f"by type {garbage.get('by_type')}")
        lines.append(f"  {worker}: live objects grown by type: {report.get('types_grown')}")
        for site in report.get("sites_grown", []):
            lines.append(f"    +{site['kib']} KiB in {site['count']} blocks at {' <- '.join(reversed(site['where']))}")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=10.0, help="how long plans run (default 10; 0.5: a smoke)")
    parser.add_argument("--rate", type=float, default=150.0, help="plans per minute (default 150)")
    parser.add_argument("--workers", type=int, default=1, help="worker processes (default 1)")
    parser.add_argument("--input-bytes", type=int, default=4096, help="each plan's input (default 4096)")
    parser.add_argument("--output-bytes", type=int, default=3072, help="each plan's output (default 3072)")
    parser.add_argument("--in-flight", type=int, default=64, help="most plans unfinished at once (default 64)")
    parser.add_argument("--warmup", type=float, help="minutes left out of the fit (default: a fifth, at most 2)")
    parser.add_argument("--sample", type=float, help="seconds between RSS samples (default: run / 120, 0.25-5)")
    parser.add_argument("--relay", action="store_true", help="inputs and outputs through the coordinator")
    parser.add_argument("--trace", action="store_true", help="tracemalloc in the workers; print what grew")
    parser.add_argument("--plan-retention", type=float, metavar="S",
                        help="the coordinator's --plan-retention (default: half the warm-up, so the finished plans it "
                             "keeps by design stop growing before the fit; 86400: its own default)"),
    parser.add_argument("--trim", action="store_true",
                        help="at each snapshot, malloc_trim(0) in the workers (the fit then spans a trim)")
    parser.add_argument("--worker-env", action="append", default=[], metavar="NAME=VALUE",
                        help="an environment variable for the workers, e.g. FLEETWIRE_MALLOC_TOP_PAD=0 (repeatable)")
    h.common_args(parser)
    ns = parser.parse_args(argv)
    h.configure(ns)
    if ns.minutes <= 0 or ns.rate <= 0:
        parser.error("--minutes and --rate must be > 0")
    result = h.run_loop(measure(ns))
    h.emit(result, ns.json, _lines(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
