"""Cluster mode's cost: SQLite single node vs PostgreSQL with 1, 2 and 3 coordinators, in one run.

For each column the benchmark starts real processes on 127.0.0.1 (bench/_harness.py): the
coordinator(s), 2 worker agents, and this process as the client. It then measures, as
bench/throughput.py and bench/latency.py do:

* **no-op plans/s**: N ``echo`` plans submitted with ``submit_many``, from the first submit to
  the last terminal event;
* **submit -> result p50/p99**: sequential ``submit`` + ``result()`` round trips;
* **coordinator CPU µs per plan** over the throughput window (user + system of every coordinator
  process, read with psutil before and after), and the PostgreSQL server's (every process of
  the postmaster's tree), so the many-host figure can be computed honestly on a small machine.

The PostgreSQL server is started here (tests/pg.py: initdb + pg_ctl in a temp dir, ``fsync=on``,
``synchronous_commit=on``), one fresh database per column, and stopped at the end. The 2- and
3-coordinator columns need multi-shard ownership: where a coordinator of that run comes up as a
standby (this build serves every shard from one coordinator), the column says "not yet" and why.

    python bench/cluster_throughput.py                       # 20,000 plans, 1,000 round trips
    python bench/cluster_throughput.py --plans 2000 --samples 200 --json
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import os
import sys
import time
from typing import Any

import _harness as h
import psutil

from fleetwire import Client

sys.path.insert(0, str(h.ROOT))  # tests/pg.py starts the PostgreSQL server (shared with the test suite)
from tests.pg import PostgresServer, missing_reason, postgres_server  # noqa: E402

TARGETS = {"rate_x_sqlite": 0.8, "p50_x_sqlite": 1.5, "cpu_x_sqlite": 1.2}
SIZING = {"coordinators": 8, "workers": 100_000, "plans_per_s": 150_000}
WORKER_CPU_US_PER_S = 7.3e4 / 10_000  # docs/PERFORMANCE.md: 10,000 idle worker sessions take 7.3 % of a core


def _cpu(pids: list[int]) -> float:
    """User + system CPU seconds of ``pids`` so far (a vanished process counts 0)."""
    total = 0.0
    for pid in pids:
        with contextlib.suppress(psutil.Error):
            t = psutil.Process(pid).cpu_times()
            total += t.user + t.system
    return total


def _pg_pids(server: PostgresServer | None) -> list[int]:
    """The postmaster and every process it started (backends, WAL writer, checkpointer...)."""
    if server is None:
        return []
    try:
        postmaster = int((server.data / "postmaster.pid").read_text().split()[0])
        proc = psutil.Process(postmaster)
        return [postmaster, *(c.pid for c in proc.children(recursive=True))]
    except (OSError, ValueError, IndexError, psutil.Error):
        return []


async def measure(
    store: str, coordinators: int, ns: argparse.Namespace, server: PostgresServer | None = None
) -> dict[str, Any]:
    """One column: start ``coordinators`` on ``store``, 2 workers, then time throughput and latency."""
    fleets = [h.Fleet(store) for _ in range(coordinators)]
    try:
        for f in fleets:
            await f.start_coordinator()
        if store.startswith("postgresql"):
            for i, f in enumerate(fleets):
                assert f.coordinator is not None
                m = await f.coordinator.wait_for_line(r"serving cluster|is a standby", 60)
                if m.group(0) == "is a standby":
                    return {"not_yet": f"coordinator {i + 1} of {coordinators} came up as a standby: this build "
                                       "serves every shard from one coordinator (multi-shard ownership, issue "
                                       "#12 phase 2b, is not in the tree)"}
        urls = [f.url for f in fleets]
        main = fleets[0]
        main.url = ",".join(urls)  # one URL, or the cluster's list (workers take --url a,b,c)
        for i in range(ns.workers):
            await main.start_worker(f"bench-{i + 1}", max_concurrency=ns.max_concurrency)
        await main.wait_workers()
        coordinator_pids = [f.coordinator.pid for f in fleets if f.coordinator is not None]
        pg_pids = _pg_pids(server)
        async with Client(urls[0] if len(urls) == 1 else urls) as client:  # type: ignore[arg-type]
            for i in range(ns.warmup):
                await (await client.submit("echo", args=i)).result()
            cpu0, pg0 = _cpu(coordinator_pids), _cpu(pg_pids)
            t0 = time.perf_counter()
            submitted = []
            for start in range(0, ns.plans, ns.chunk):
                submitted += await client.submit_many("echo", range(start, min(ns.plans, start + ns.chunk)))
            failed = 0
            async with asyncio.timeout(ns.timeout):
                for plan in submitted:
                    try:
                        await plan.result()
                    except Exception:
                        failed += 1
            elapsed = time.perf_counter() - t0
            cpu, pg_cpu = _cpu(coordinator_pids) - cpu0, _cpu(pg_pids) - pg0
            times: list[float] = []
            clock = time.perf_counter
            for i in range(ns.samples):
                t1 = clock()
                await (await client.submit("echo", args=i)).result()
                times.append(clock() - t1)
        return {
            "coordinators": coordinators,
            "store_used": main.store_used,
            "plans": ns.plans,
            "failed": failed,
            "elapsed_s": round(elapsed, 3),
            "plans_per_s": round(ns.plans / elapsed, 1),
            "latency": h.summary_ms(times),
            "coordinator_cpu_us_per_plan": round(cpu / ns.plans * 1e6, 1),
            "postgres_cpu_us_per_plan": round(pg_cpu / ns.plans * 1e6, 1) if pg_pids else None,
        }
    except Exception as exc:  # the column says what failed; the others still run
        tail = next((f.coordinator.lines[-3:] for f in fleets if f.coordinator is not None), [])
        return {"error": f"{type(exc).__name__}: {exc}"[:300], "log_tail": tail}
    finally:
        for f in reversed(fleets):
            await f.stop()


async def collect(ns: argparse.Namespace) -> dict[str, Any]:
    results: dict[str, Any] = {"machine": h.machine(), "plans": ns.plans, "samples": ns.samples}
    results["sqlite"] = await measure("sqlite", 1, ns)
    why = missing_reason()
    if why is not None:
        for n in (1, 2, 3):
            results[f"pg{n}"] = {"error": why}
        return results
    with postgres_server() as server:
        for n in (1, 2, 3):
            results[f"pg{n}"] = await measure(server.new_database(), n, ns, server)
    return results


def _cell(r: dict[str, Any], what: str) -> tuple[str, float | None]:
    if "not_yet" in r:
        return "not yet: " + r["not_yet"], None
    if "error" in r:
        return "failed: " + r["error"], None
    if what == "rate":
        return f"{r['plans_per_s']:,.0f} plans/s", r["plans_per_s"]
    if what == "p50":
        lat = r["latency"]
        return f"{lat['p50_ms']:.3f} ms (p99 {lat['p99_ms']:.3f})", lat["p50_ms"]
    if what == "cpu":
        return f"{r['coordinator_cpu_us_per_plan']:.1f} µs", r["coordinator_cpu_us_per_plan"]
    value = r.get("postgres_cpu_us_per_plan")
    return ("-", None) if value is None else (f"{value:.1f} µs", value)


def _ratio(value: float | None, base: float | None) -> str:
    return "-" if value is None or base is None or base <= 0 else f"{value / base:.2f}x"


def report(results: dict[str, Any]) -> tuple[list[str], dict[str, str]]:
    cols = ["sqlite", "pg1", "pg2", "pg3"]
    heads = ["SQLite, 1 coordinator", "PostgreSQL, 1 coordinator", "PostgreSQL, 2 coordinators",
             "PostgreSQL, 3 coordinators"]
    lines = [f"| {results['plans']:,} no-op plans, 2 workers | " + " | ".join(heads) + " |",
             "|---" * (len(cols) + 1) + "|"]
    values: dict[str, dict[str, float | None]] = {}
    for what, label in (("rate", "throughput"), ("p50", "submit -> result p50"),
                        ("cpu", "coordinator CPU per plan"), ("pg", "PostgreSQL server CPU per plan")):
        cells = [_cell(results[c], what) for c in cols]
        values[what] = {c: v for c, (_, v) in zip(cols, cells, strict=True)}
        lines.append(f"| {label} | " + " | ".join(text for text, _ in cells) + " |")
        if what != "pg":
            base = values[what]["sqlite"]
            lines.append(f"| ratio to SQLite | - | " + " | ".join(_ratio(values[what][c], base) for c in cols[1:])
                         + " |")
    rate, p50, cpu = values["rate"], values["p50"], values["cpu"]
    verdict = {
        f"PostgreSQL 1 coordinator throughput >= {TARGETS['rate_x_sqlite']}x SQLite":
            _ok(rate["pg1"], rate["sqlite"], lambda x: x >= TARGETS["rate_x_sqlite"]),
        f"PostgreSQL 1 coordinator p50 <= {TARGETS['p50_x_sqlite']}x SQLite":
            _ok(p50["pg1"], p50["sqlite"], lambda x: x <= TARGETS["p50_x_sqlite"]),
        f"coordinator CPU per plan on PostgreSQL <= {TARGETS['cpu_x_sqlite']}x SQLite":
            _ok(cpu["pg1"], cpu["sqlite"], lambda x: x <= TARGETS["cpu_x_sqlite"]),
    }
    lines += ["", *sizing(cpu["pg1"], values["pg"]["pg1"])]
    return lines, verdict


def _ok(value: float | None, base: float | None, test: Any) -> str:
    if value is None or base is None or base <= 0:
        return "not measured"
    ratio = value / base
    return f"{'reached' if test(ratio) else 'NOT reached'} ({ratio:.2f}x)"


def sizing(cpu_us: float | None, pg_us: float | None) -> list[str]:
    """The arithmetic of "8 coordinators carry 100,000 workers and >= 150,000 plans/s"."""
    if cpu_us is None:
        return ["sizing: not computed (no PostgreSQL coordinator CPU figure in this run)"]
    n, workers, rate = SIZING["coordinators"], SIZING["workers"], SIZING["plans_per_s"]
    per_rate, per_workers = rate / n, workers / n
    plan_cores = per_rate * cpu_us / 1e6
    worker_cores = per_workers * WORKER_CPU_US_PER_S / 1e6
    lines = [
        f"sizing, from the measured PostgreSQL coordinator CPU per plan ({cpu_us:.1f} µs):",
        f"  {rate:,} plans/s / {n} coordinators = {per_rate:,.0f} plans/s each x {cpu_us:.1f} µs = "
        f"{plan_cores:.2f} cores of plan work per coordinator",
        f"  {workers:,} workers / {n} = {per_workers:,.0f} worker sessions each x {WORKER_CPU_US_PER_S:.1f} µs/s "
        f"(10,000 idle sessions = 7.3 % of a core, docs/PERFORMANCE.md) = {worker_cores:.2f} cores",
        f"  = {plan_cores + worker_cores:.2f} cores per coordinator; the event loop is one thread, so this needs "
        f"<= 1 core: {'fits' if plan_cores + worker_cores <= 1 else 'does NOT fit'} "
        f"({math.ceil(rate * cpu_us / 1e6 / max(1e-9, 1 - worker_cores)):d} coordinators would, at 1 core each)",
    ]
    if pg_us is not None:
        lines.append(f"  PostgreSQL: {rate:,} plans/s x {pg_us:.1f} µs = {rate * pg_us / 1e6:.1f} cores of server CPU "
                     "(measured on loopback with this run's group sizes; a real host has more cores and disks)")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--plans", type=int, default=20_000, help="plans for the throughput run (default 20000)")
    parser.add_argument("--samples", type=int, default=1000, help="sequential round trips (default 1000)")
    parser.add_argument("--warmup", type=int, default=100, help="untimed plans first (default 100)")
    parser.add_argument("--workers", type=int, default=2, help="worker processes (default 2)")
    parser.add_argument("--max-concurrency", type=int, default=1000, help="plans each worker runs at once")
    parser.add_argument("--chunk", type=int, default=5000, help="plans per submit_many call (default 5000)")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds the throughput run may take")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    parser.add_argument("--coordinator-args", default="", metavar="ARGS", help="more coordinator flags (one string)")
    ns = parser.parse_args(argv)
    h.configure(ns)
    results = h.run_loop(collect(ns))
    lines, verdict = report(results)
    results["verdict"] = verdict
    m = results["machine"]
    h.emit(results, ns.json, [
        f"machine: {m.get('cpus')} CPUs ({m.get('cpu', '?')}), Python {m.get('python')}; everything on 127.0.0.1, "
        f"PostgreSQL with fsync=on, synchronous_commit=on",
        *lines, "", "targets (issue #12):", *(f"  {k}: {v}" for k, v in verdict.items()),
    ])
    return 0


if __name__ == "__main__":
    sys.exit(main())
