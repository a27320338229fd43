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
``synchronous_commit=on``), one fresh database per column, and stopped at the end. Before each column the
server's WAL segments ahead are recycled (tests/pg.py ``recycle_wal``), as a server in service has them: a fresh one
zero-fills each new 16 MiB segment inside the window (``--cold-wal`` keeps that, docs/PERFORMANCE.md §C29p). The 2- and
3-coordinator columns need multi-shard ownership: where a coordinator of that run comes up as a
standby (this build serves every shard from one coordinator), the column says "not yet" and why.

Before each column's window, ``--warmup`` plans go one at a time (submit, then its result), untimed, in both
columns: they open the connections and run the coordinator's first plans, but as groups of one plan, so a
PostgreSQL column's first grouped statements still come inside the window. The window's length does not favour
SQLite: at ``--plans`` 10,000, 30,000 and 60,000 the ratio does not rise, and the PostgreSQL coordinator's CPU a
plan grows with the window more than SQLite's (docs/PERFORMANCE.md §C29u).

With ``--rounds N`` the SQLite and one-PostgreSQL columns run N times, alternating, each after a
sample of the disk's fsync p50 (bench/compare.py's floor); the table shows their medians and a
line per round its ratios, so a disk whose latency moved between two columns is seen, not
mistaken for the store's cost.

    python bench/cluster_throughput.py                       # 20,000 plans, 1,000 round trips
    python bench/cluster_throughput.py --plans 2000 --samples 200 --json
    python bench/cluster_throughput.py --plans 10000 --samples 500 --rounds 3
    python bench/cluster_throughput.py --plans 10000 --samples 500 --one   # SQLite and one PostgreSQL coordinator
    python bench/cluster_throughput.py --commit-callgrind   # the commit path, callgrind instructions per plan
    python bench/cluster_throughput.py --one --plans 3000 --samples 20 --loop-callgrind DIR \
        --coordinator-args "--lease-ttl 60 --lease-renew 20"   # each coordinator's window under callgrind

``--commit-callgrind``: the PostgreSQL store's commit path on the coordinator's side (``write_async``
of the store alone's groups: grouping, encoding, asyncpg's parameters and the round trip's client
half), in this process, against a PostgreSQL server started here: callgrind runs it for 600 and
2,400 plans and once more for each without the writes (making the records), and reports the
difference of the differences per plan (a plan is 4 steps), so start-up and the records' making
cancel out. Machine load hardly moves the figure (it needs valgrind). Run it from each tree to
compare two versions: it imports the store of the tree it is in.

``--loop-callgrind DIR``: the whole coordinator process of each column (its core, store, sockets and
collector) under callgrind, its instrumentation on only over the throughput window
(``callgrind_control``), one ``DIR/coordinator-<pid>.out.1`` each: divide by ``--plans`` for its
instructions a plan, ``callgrind_annotate`` two files to see what one store's loop does that the other's
does not. The coordinator runs ~50x slower, so its groups are bigger than in a timed run, and a
PostgreSQL coordinator needs leases longer than the window (``--coordinator-args``), else it loses its shards.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import logging
import math
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import _harness as h
import compare
import psutil
import store_bench
import structlog

from fleetwire import Client

sys.path.insert(0, str(h.ROOT))  # tests/pg.py starts the PostgreSQL server (shared with the test suite)
from coordinator.io.cluster.leases import ACQUIRE
from coordinator.io.stores.postgres import PgStore
from coordinator.io.stores.sqlite import SQLiteStore
from coordinator.shards import ClusterConfig
from tests.pg import PostgresServer, missing_reason, postgres_server

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


def _children_cpu(pids: list[int]) -> float:
    """CPU seconds so far of the live children of ``pids`` (a SQLite or PostgreSQL coordinator's writer process)."""
    total = 0.0
    for pid in pids:
        with contextlib.suppress(psutil.Error):
            for child in psutil.Process(pid).children(recursive=True):
                with contextlib.suppress(psutil.Error):
                    t = child.cpu_times()
                    total += t.user + t.system
    return total


async def _children_settled(pids: list[int], timeout_s: float = 60.0) -> None:
    """Wait until the children of ``pids`` (the PostgreSQL writer children, started with a shard's first commit:
    coordinator/io/stores/pg_writer.py) use no CPU for 0.3 s: their start (imports, connections) is not measured."""
    deadline, last, still = time.monotonic() + timeout_s, -1.0, 0
    while time.monotonic() < deadline and still < 6:
        now = _children_cpu(pids)
        still = still + 1 if now == last else 0
        last = now
        await asyncio.sleep(0.05)


def _pg_pids(server: PostgresServer | None) -> list[int]:
    """The postmaster (first) and every process it started (backends, WAL writer, checkpointer...)."""
    if server is None:
        return []
    try:
        postmaster = int((server.data / "postmaster.pid").read_text().split()[0])
        proc = psutil.Process(postmaster)
        return [postmaster, *(c.pid for c in proc.children(recursive=True))]
    except (OSError, ValueError, IndexError, psutil.Error):
        return []


def _pg_cpu(server: PostgresServer | None) -> float:
    """CPU seconds of the PostgreSQL server so far: its live processes, and those that ended (the postmaster's
    reaped children), read at the time of the call.

    Summing a list of pids taken once undercounted: a backend that ended in the window (the
    coordinators open and close connections) took its CPU with it, and the figure went negative.
    """
    pids = _pg_pids(server)
    if not pids:
        return 0.0
    total = _cpu(pids)
    with contextlib.suppress(psutil.Error):
        t = psutil.Process(pids[0]).cpu_times()
        total += t.children_user + t.children_system
    return total


def _pg_by_process(server: PostgresServer | None) -> dict[str, float]:
    """CPU seconds so far of each live PostgreSQL process, by its title (``postgres: walwriter``, a backend's
    ``postgres: USER DB HOST(PORT) STATE`` with its state left out), so the window's CPU shows which one works."""
    out: dict[str, float] = {}
    for pid in _pg_pids(server)[1:]:
        with contextlib.suppress(psutil.Error):
            proc = psutil.Process(pid)
            words = " ".join(proc.cmdline()).split()
            ends = [i for i, w in enumerate(words) if w.endswith(")")]  # a backend's HOST(PORT): its state after it
            title = " ".join(words[: ends[0] + 1] if ends else words)
            t = proc.cpu_times()
            out[f"{title} [{pid}]"] = t.user + t.system
    return out


async def _wal_mark(store: str) -> str | None:
    """The WAL position now (PostgreSQL only; None for SQLite)."""
    if not store.startswith("postgresql"):
        return None
    import asyncpg  # type: ignore[import-untyped]

    conn = await asyncpg.connect(store)
    try:
        return str(await conn.fetchval("SELECT pg_current_wal_insert_lsn()::text"))
    finally:
        await conn.close()


# The whole server's WAL and checkpoint counters (PostgreSQL 15; the times need track_wal_io_timing, on in this bench).
_WAL_COUNTERS = """SELECT w.wal_records, w.wal_fpi, w.wal_bytes::float8 AS wal_bytes, w.wal_buffers_full, w.wal_write,
w.wal_sync, w.wal_write_time, w.wal_sync_time, b.checkpoints_timed + b.checkpoints_req AS checkpoints,
b.buffers_checkpoint FROM pg_stat_wal w, pg_stat_bgwriter b"""
# What the coordinator's backends are doing, sampled: idle (waiting for the coordinator), active on a CPU or waiting
# for one (no wait event), or waiting on an event (WALWrite, WALSync: a commit's flush; LWLock...).
_ACTIVITY = """SELECT state, coalesce(wait_event_type || ':' || wait_event, 'none') || ' ' || left(ltrim(query), 12)
AS wait FROM pg_stat_activity
WHERE backend_type = 'client backend' AND pid <> pg_backend_pid() AND datname = current_database()"""
BENCH_PG_SETTINGS = {"track_wal_io_timing": "on"}  # measurement only: pg_stat_wal's write and sync times
PGSTAT_IDLE_S = 10.5  # PostgreSQL 15's PGSTAT_IDLE_INTERVAL (10 s), and a margin
# --statements: pg_stat_statements over the window, the coordinator's database only, the bench's own reads left out.
_STATEMENTS = """SELECT left(regexp_replace(ltrim(query), '\\s+', ' ', 'g'), 40) AS head, sum(calls)::bigint AS calls
FROM pg_stat_statements WHERE dbid = (SELECT oid FROM pg_database WHERE datname = current_database())
AND query NOT LIKE '%pg_stat_%' GROUP BY 1 ORDER BY 2 DESC"""


async def _statements_reset(store: str) -> None:
    """pg_stat_statements' counters zeroed (the extension created in the column's database first)."""
    import asyncpg

    conn = await asyncpg.connect(store)
    try:
        await conn.execute("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
        await conn.execute("SELECT pg_stat_statements_reset()")
    finally:
        await conn.close()


async def _statements(store: str, plans: int, elapsed: float) -> dict[str, Any]:
    """The statements the window ran, by their first 40 characters: calls, calls a plan and a second."""
    import asyncpg

    conn = await asyncpg.connect(store)
    try:
        rows = await conn.fetch(_STATEMENTS)
    finally:
        await conn.close()
    return {r["head"]: [r["calls"], round(r["calls"] / plans, 4), round(r["calls"] / elapsed, 1)] for r in rows}


async def _wal_counters(store: str) -> dict[str, float] | None:
    """pg_stat_wal's and the checkpoints' counters now (PostgreSQL only). A backend sends its own at the end of a
    transaction at most once a second, and an idle one 10 s after its last: ``--wal-timing`` reads them 10.5 s after
    each edge of the window (a 1.2 s wait missed the warm-up's or the window's last second in half the runs)."""
    if not store.startswith("postgresql"):
        return None
    import asyncpg

    conn = await asyncpg.connect(store)
    try:
        return {k: float(v) for k, v in (await conn.fetchrow(_WAL_COUNTERS)).items()}
    finally:
        await conn.close()


def _schedstat(server: PostgresServer | None) -> dict[str, tuple[int, int]]:
    """Each live PostgreSQL process's (ns on a CPU, ns runnable waiting for one) so far (/proc/PID/schedstat),
    by its title as in :func:`_pg_by_process`."""
    out: dict[str, tuple[int, int]] = {}
    for pid in _pg_pids(server)[1:]:
        with contextlib.suppress(psutil.Error, OSError, ValueError):
            words = " ".join(psutil.Process(pid).cmdline()).split()
            ends = [i for i, w in enumerate(words) if w.endswith(")")]
            title = " ".join(words[: ends[0] + 1] if ends else words)
            run, wait = Path(f"/proc/{pid}/schedstat").read_text().split()[:2]
            out[f"{title} [{pid}]"] = (int(run), int(wait))
    return out


def _threads_schedstat(pids: list[int]) -> tuple[int, int]:
    """ns on a CPU and runnable waiting for one so far, over every thread of ``pids`` (/proc/PID/task/*/schedstat)."""
    run = wait = 0
    for pid in pids:
        for task in Path(f"/proc/{pid}/task").glob("*/schedstat"):
            with contextlib.suppress(OSError, ValueError):
                r, q = task.read_text().split()[:2]
                run, wait = run + int(r), wait + int(q)
    return run, wait


class _Sampler:
    """pg_stat_activity of the coordinator's backends every ``interval`` s over the window: the share of samples in
    which some backend was in each state (``all idle``: none active, no commit on the server's side)."""

    def __init__(self, store: str, checkpoint_at: float | None = None, interval: float = 0.02) -> None:
        self.store, self.interval, self.checkpoint_at = store, interval, checkpoint_at
        self.counts: dict[str, int] = {}
        self.samples = 0
        self._task: asyncio.Task[None] | None = None

    async def _run(self) -> None:
        import asyncpg

        conn = await asyncpg.connect(self.store)
        if self.checkpoint_at is not None:  # --checkpoint-at: the window's first changes to each page after it are
            asyncio.get_running_loop().create_task(self._checkpoint(self.checkpoint_at))  # full-page images
        try:
            while True:  # a sample counts each state once, however many backends are in it
                keys = {f"{r['state']} {r['wait']}" for r in await conn.fetch(_ACTIVITY) if r["state"] != "idle"}
                for key in keys or {"all idle"}:
                    self.counts[key] = self.counts.get(key, 0) + 1
                self.samples += 1
                await asyncio.sleep(self.interval)
        finally:
            await conn.close()

    async def _checkpoint(self, after: float) -> None:
        import asyncpg

        await asyncio.sleep(after)
        conn = await asyncpg.connect(self.store)
        try:
            await conn.execute("CHECKPOINT")
        finally:
            await conn.close()

    def start(self) -> None:
        if self.store.startswith("postgresql"):
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> dict[str, Any] | None:
        if self._task is None:
            return None
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        n = max(self.samples, 1)
        return {
            "samples": self.samples,
            **{k: round(v / n, 3) for k, v in sorted(self.counts.items(), key=lambda kv: -kv[1])},
        }


def _commit_time(
    w0: dict[str, float] | None,
    w1: dict[str, float] | None,
    s0: dict[str, tuple[int, int]],
    s1: dict[str, tuple[int, int]],
    elapsed: float,
    plans: int,
) -> dict[str, Any] | None:
    """Where the window's server time went: the backends', WAL writer's and checkpointer's ms on a CPU and waiting for
    one, and with ``--wal-timing`` pg_stat_wal's deltas (full-page images' share of the WAL at 8 KiB each: an upper
    bound, the images are written without their pages' holes, pg_walinspect's fpi bytes in the WAL lines; write and
    sync ms, which count the lease connection's commits over the 21 s too) and the checkpoints."""
    if not s0:
        return None
    out: dict[str, Any] = {"window_ms": round(elapsed * 1e3, 1)}
    if w0 is not None and w1 is not None:
        d = {k: w1[k] - w0[k] for k in w0}
        out |= {
            "wal_records_per_plan": round(d["wal_records"] / plans, 2),
            "wal_bytes_per_plan": round(d["wal_bytes"] / plans, 1),
            "wal_fpi": int(d["wal_fpi"]),
            "fpi_share_of_wal": round(d["wal_fpi"] * 8192 / d["wal_bytes"], 3) if d["wal_bytes"] else None,
            "wal_buffers_full": int(d["wal_buffers_full"]),
            "wal_writes": int(d["wal_write"]),
            "wal_syncs": int(d["wal_sync"]),
            "wal_write_ms": round(d["wal_write_time"], 1),
            "wal_sync_ms": round(d["wal_sync_time"], 1),
            "checkpoints": int(d["checkpoints"]),
            "buffers_checkpoint": int(d["buffers_checkpoint"]),
        }
    for label, match in (("backends", "127.0.0.1("), ("walwriter", "walwriter"), ("checkpointer", "checkpointer")):
        run = wait = 0
        for key, (r1, q1) in s1.items():
            if match in key:
                r0, q0 = s0.get(key, (0, 0))
                run, wait = run + r1 - r0, wait + q1 - q0
        out[f"{label}_cpu_ms"], out[f"{label}_cpu_wait_ms"] = round(run / 1e6, 1), round(wait / 1e6, 1)
    return out


# The window's WAL by kind (pg_walinspect, PostgreSQL 15): heap UPDATE/HOT_UPDATE, INSERT, index inserts, full pages.
_WAL_STATS = """SELECT "resource_manager/record_type" AS kind, count, record_size, fpi_size, combined_size
FROM pg_get_wal_stats($1::text::pg_lsn, pg_current_wal_flush_lsn(), true) WHERE count > 0
ORDER BY combined_size DESC"""
_ROW_BYTES = """SELECT avg(pg_column_size(p.*)) AS row, avg(pg_column_size(spec)) AS spec,
avg(pg_column_size(status)) AS status, avg(pg_column_size(events)) AS events,
pg_relation_size('fleetwire_plans') / greatest(count(*), 1) AS table_per_row,
pg_indexes_size('fleetwire_plans') / greatest(count(*), 1) AS indexes_per_row FROM fleetwire_plans p"""


async def _wal_window(store: str, start: str | None, plans: int) -> dict[str, Any] | None:
    """WAL bytes a plan over the window from ``start`` (the whole server's), split by record kind, the share of
    heap updates that were HOT (from the same records), and a stored plan row's average sizes."""
    if start is None:
        return None
    import asyncpg

    conn = await asyncpg.connect(store)
    try:
        total = await conn.fetchval("SELECT pg_current_wal_insert_lsn() - $1::text::pg_lsn", start)
        out: dict[str, Any] = {"wal_bytes_per_plan": round(float(total) / plans, 1)}
        try:
            await conn.execute("CREATE EXTENSION IF NOT EXISTS pg_walinspect")
            rows = await conn.fetch(_WAL_STATS, start)
        except asyncpg.PostgresError as exc:  # no pg_walinspect (PostgreSQL < 15, or not installed)
            out["by_kind"] = f"pg_walinspect: {exc}"[:200]
        else:
            count = {r["kind"]: r["count"] for r in rows}
            hot = count.get("Heap/HOT_UPDATE", 0)
            updates = hot + count.get("Heap/UPDATE", 0) + count.get("Heap/UPDATE+INIT", 0)
            out["hot_update_share"] = round(hot / updates, 3) if updates else None
            out["by_kind"] = {r["kind"]: {"records_per_plan": round(r["count"] / plans, 2),
                                          "bytes_per_plan": round(r["combined_size"] / plans, 1),
                                          "fpi_bytes_per_plan": round(r["fpi_size"] / plans, 1)}
                              for r in rows[:8]}  # fmt: skip
        sizes = await conn.fetchrow(_ROW_BYTES)
        out["row_bytes"] = {k: round(float(v or 0), 1) for k, v in sizes.items()}
        return out
    finally:
        await conn.close()


def _open(store: str, directory: Path) -> Any:
    """A store to write into: a fresh SQLite file, or a PostgreSQL store holding every shard's lease."""
    if store == "sqlite":
        return SQLiteStore(directory / f"alone-{time.monotonic_ns()}.sqlite3")
    pg = PgStore(store, ClusterConfig())
    rows = pg.execute(lambda c: c.fetch(ACQUIRE, "bench", "", 600.0, list(range(pg.cluster.shards))))
    pg.owner, pg.fence = "bench", {r[0]: r[1] for r in rows}
    return pg


def commit_path(blocks: int, writes: bool) -> None:
    """A --commit-callgrind run: ``blocks`` blocks' groups through ``PgStore.write_async`` ($FW_BENCH_DSN)."""
    from fleetwire.cli.serve import DAEMON_GC_THRESHOLDS

    async def run() -> None:
        db = await asyncio.to_thread(_open, os.environ["FW_BENCH_DSN"], Path("."))
        groups = _grouped(blocks * GROUP_BLOCK)
        if os.environ.get("FLEETWIRE_PG_WRITER") == "process":  # the loop's side only: the child is another process
            await _through_child(db, groups if writes else [])
            await asyncio.to_thread(db.close)
            return
        await db.open_async()
        gc.freeze()
        gc.set_threshold(*DAEMON_GC_THRESHOLDS)
        if writes:
            for group in groups:
                await db.write_async(group)
        await db.close_async()
        await asyncio.to_thread(db.close)

    asyncio.run(run())


async def _through_child(db: PgStore, groups: list[list[Any]]) -> None:
    """``groups`` committed through the store's writer child (coordinator/io/stores/pg_writer.py), all sent at once
    once the committer is ready (each a big group: none inline)."""
    from coordinator.io.stores.pg_writer import ProcessCommitter
    from fleetwire.cli.serve import DAEMON_GC_THRESHOLDS

    loop = asyncio.get_running_loop()
    done: asyncio.Future[None] = loop.create_future()
    left = [len(groups)]

    def release(_: None) -> None:
        left[0] -= 1
        if not left[0] and not done.done():
            done.set_result(None)

    def failed(exc: BaseException) -> None:
        if not done.done():
            done.set_exception(exc)

    committer: ProcessCommitter[None] = ProcessCommitter(db, release, failed)
    committer.start()
    while not committer.ready and committer.failed is None:  # noqa: ASYNC110  (no event to wait on: its start only)
        await asyncio.sleep(0.01)
    gc.freeze()
    gc.set_threshold(*DAEMON_GC_THRESHOLDS)
    for group in groups:
        committer.submit(group, None)
    if groups:
        await done
    await committer.close()


def commit_callgrind() -> float:
    """Callgrind instructions per plan of the commit path: 2,400 plans against 600, less the records' making."""
    import shutil

    if shutil.which("valgrind") is None or (why := missing_reason()) is not None:
        raise SystemExit(f"--commit-callgrind needs valgrind and PostgreSQL: {why or 'valgrind is not installed'}")
    counts = {}
    with postgres_server() as server, tempfile.TemporaryDirectory() as tmp:
        for blocks in (2, 8):
            for writes in (True, False):
                env = {**h.bench_env(), "FW_BENCH_DSN": server.new_database(), "PYTHONHASHSEED": "0"}
                cmd = ["valgrind", "--tool=callgrind", f"--callgrind-out-file={tmp}/cg.out", sys.executable,
                       __file__, "--commit-path", str(blocks), *([] if writes else ["--no-writes"])]  # fmt: skip
                run = subprocess.run(cmd, capture_output=True, text=True, check=False, env=env, cwd=h.ROOT)
                out = run.stderr
                found = re.search(r"Collected : (\d+)", out)
                if found is None or run.returncode:  # a run that failed part way counts less: no figure
                    raise SystemExit(f"callgrind gave no count (exit {run.returncode}): {out[-500:]}")
                counts[blocks, writes] = int(found.group(1))
                print(f"  {blocks * GROUP_BLOCK} plans, {'with' if writes else 'without'} the writes: "
                      f"{counts[blocks, writes]:,} instructions", file=sys.stderr)
    path_ir = (counts[8, True] - counts[2, True]) - (counts[8, False] - counts[2, False])
    return path_ir / (6 * GROUP_BLOCK)


GROUP_BLOCK = 300  # plans per step in store_alone's grouped part: a group holds 4 blocks' steps (~2,700 records)


def _grouped(plans: int) -> list[list[Any]]:
    """``plans`` plans' steps (bench/store_bench.py) as the groups of a busy committer: group k holds step 1 of
    block k, step 2 of block k-1, step 3 of block k-2 and step 4 of block k-3 (blocks of :data:`GROUP_BLOCK`)."""
    blocks = max(1, plans // GROUP_BLOCK)
    first = 10_000_000  # ids of their own: the sequential part's plans are there already
    steps = [[store_bench.plan_steps(first + b * GROUP_BLOCK + i) for i in range(GROUP_BLOCK)] for b in range(blocks)]
    groups = []
    for k in range(blocks + 3):
        group: list[Any] = []
        for step in range(4):
            if 0 <= k - step < blocks:
                for plan in steps[k - step]:
                    group += plan[step]
        groups.append(group)
    return groups


async def store_alone(store: str, ns: argparse.Namespace, directory: Path,
                      server: PostgresServer | None = None) -> dict[str, Any]:  # fmt: skip
    """The store on its own, in this process: sequential commits of one plan step each, as its committer makes them;
    then the groups of a busy committer (:func:`_grouped`), whose CPU per plan (this process's, and the PostgreSQL
    server's) does not depend on the machine's load the way a wall-clock figure does.

    SQLite: ``write`` from a thread (the committer's writer thread). PostgreSQL: ``write_async`` on
    this loop (its committer, coordinator/io/stores/pg_commit.py, commits on the server's loop).
    """
    try:
        db = await asyncio.to_thread(_open, store, directory)
        steps = [store_bench.plan_steps(n) for n in range(ns.store_plans)]
        grouped = _grouped(ns.store_plans * 5)
        grouped_plans = max(1, (ns.store_plans * 5) // GROUP_BLOCK) * GROUP_BLOCK
        times: list[float] = []
        if isinstance(db, PgStore):
            await db.open_async()
            clock = time.perf_counter
            cpu0 = time.process_time()
            for plan in steps:
                for batch in plan:
                    t0 = clock()
                    await db.write_async(batch)
                    times.append(clock() - t0)
            cpu = time.process_time() - cpu0
            cpu0, pg0 = time.process_time(), _pg_cpu(server)
            for group in grouped:
                await db.write_async(group)
            grouped_cpu, grouped_pg = time.process_time() - cpu0, _pg_cpu(server) - pg0
            await db.close_async()
            await asyncio.to_thread(db.close)
            return {"commit": h.summary_ms(times), "sequential_cpu_us_per_plan": round(cpu / len(steps) * 1e6, 1),
                    "grouped_cpu_us_per_plan": round(grouped_cpu / grouped_plans * 1e6, 1),
                    "grouped_server_cpu_us_per_plan": round(grouped_pg / grouped_plans * 1e6, 1) if server else None}

        def sequential() -> tuple[float, float]:  # in a thread, as the committer's writer thread calls write()
            clock = time.perf_counter
            cpu0 = time.process_time()
            for plan in steps:
                for batch in plan:
                    t0 = clock()
                    db.write(batch)
                    times.append(clock() - t0)
            cpu1 = time.process_time()
            for group in grouped:
                db.write(group)
            return cpu1 - cpu0, time.process_time() - cpu1

        cpu, grouped_cpu = await asyncio.to_thread(sequential)
        await asyncio.to_thread(db.close)
        return {"commit": h.summary_ms(times), "sequential_cpu_us_per_plan": round(cpu / len(steps) * 1e6, 1),
                "grouped_cpu_us_per_plan": round(grouped_cpu / grouped_plans * 1e6, 1),
                "grouped_server_cpu_us_per_plan": None}
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {exc}"[:300]}


def _topology(url: str) -> list[dict[str, Any]] | None:
    """A cluster coordinator's ``/v1/topology`` rows (None: this build has no such route)."""
    http = url.replace("ws://", "http://", 1) + "/v1/topology"
    try:
        with urllib.request.urlopen(http, timeout=5) as answer:
            rows: list[dict[str, Any]] = json.loads(answer.read())["topology"]
            return rows
    except urllib.error.HTTPError as exc:
        if exc.code == 404:
            return None
        raise


async def _settled(urls: list[str], timeout_s: float = 60.0) -> list[dict[str, Any]] | None:
    """The topology once every shard is served, each of ``urls``' coordinators owns some, and it held for 1 s."""
    deadline = time.monotonic() + timeout_s
    last: dict[int, str] = {}
    since = time.monotonic()
    while True:
        rows = await asyncio.to_thread(_topology, urls[0])
        if rows is None:
            return None
        owners = {r["shard"]: r["owner"] for r in rows if r["url"] and r["live"]}
        settled = len(owners) == len(rows) and len(set(owners.values())) == len(urls)
        if owners != last:
            last, since = owners, time.monotonic()
        elif settled and time.monotonic() - since >= 1.0:
            return rows
        if time.monotonic() > deadline:
            counts = {o: list(owners.values()).count(o) for o in set(owners.values())}
            raise TimeoutError(f"the shards did not settle over {len(urls)} coordinators in {timeout_s:.0f} s: "
                               f"{counts}")
        await asyncio.sleep(0.2)


def _spies(directory: str | None, pids: list[int], label: str, perf: bool = False) -> list[subprocess.Popen[bytes]]:
    """``--profile DIR``: py-spy on each coordinator over the throughput window (``DIR/<store>-<n>c-<i>.txt``);
    with ``--perf``, ``perf record -g`` instead (``.perf``: a compiled build's functions are C, which py-spy
    does not name; read with ``perf report -i FILE --no-children``)."""
    if not directory:
        return []
    Path(directory).mkdir(parents=True, exist_ok=True)
    spies = []
    for i, pid in enumerate(pids):
        out = Path(directory) / f"{label}-{len(pids)}c-{i}.{'perf' if perf else 'txt'}"
        command = ["py-spy", "record", "--pid", str(pid), "--rate", "500", "--format", "raw", "--nonblocking",
                   "--output", str(out)]  # fmt: skip
        if perf:
            command = ["perf", "record", "-F", "999", "-g", "-p", str(pid), "-o", str(out)]
        spies.append(subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    return spies


def _callgrind_coordinators(directory: str) -> None:
    """``--loop-callgrind DIR``: every coordinator started from now on runs under callgrind with its
    instrumentation off (``DIR/coordinator-<pid>.out``); :func:`_callgrind_toggle` turns it on over the
    throughput window, so the file holds that window's instructions and nothing of start-up or the round trips."""
    Path(directory).mkdir(parents=True, exist_ok=True)
    out = str(Path(directory).resolve() / "coordinator-%p.out")
    spawn = h.spawn

    async def wrapped(name: str, *argv: str, env: dict[str, str] | None = None) -> h.Proc:
        if name == "coordinator":
            argv = ("valgrind", "--tool=callgrind", "--instr-atstart=no", f"--callgrind-out-file={out}", *argv)
        return await spawn(name, *argv, env=env)

    h.spawn = wrapped  # type: ignore[assignment]  # Fleet.start_coordinator reads the module's spawn


def _callgrind_toggle(pids: list[int], on: bool) -> None:
    """Callgrind's instrumentation of each coordinator on (the window's start) or off and dumped (its end)."""
    for pid in pids:
        subprocess.run(["callgrind_control", "-i", "on" if on else "off", str(pid)], capture_output=True, check=True)
        if not on:
            subprocess.run(["callgrind_control", "-d", str(pid)], capture_output=True, check=True)


def _pools(rows: list[dict[str, Any]], n: int) -> list[str]:
    """``n`` pool names whose shards are owned by ``n`` different coordinators (cluster mode)."""
    from coordinator.shards import pool_shard

    owner_of = {r["shard"]: r["owner"] for r in rows}
    pools: dict[str, str] = {}  # owner -> pool
    for i in range(10_000):
        name = f"bench{i}"
        pools.setdefault(owner_of[pool_shard(name, len(rows))], name)
        if len(pools) == n:
            return sorted(pools.values())
    raise RuntimeError(f"no {n} pools over {n} owners")


async def measure(
    store: str, coordinators: int, ns: argparse.Namespace, server: PostgresServer | None = None
) -> dict[str, Any]:
    """One column: start ``coordinators`` on ``store`` and the workers, then time throughput and latency.

    SQLite: ``--workers`` workers of the default pool, as bench/throughput.py. PostgreSQL: one
    pool per coordinator (a pool whose shard it owns; the client names it, so the main port moves
    it to that shard's core), ``--workers`` workers per pool and one client per pool submitting
    at once; the round trips go to the first pool.
    """
    fleets = [h.Fleet(store) for _ in range(coordinators)]
    try:
        for f in fleets:
            await f.start_coordinator()
        urls = [f.url for f in fleets]
        pools: list[str | None] = [None]
        if store.startswith("postgresql"):
            rows = await _settled(urls)
            if rows is None:
                if coordinators > 1:
                    return {"not_yet": "this build has no /v1/topology (multi-shard ownership, issue #12 phase 2b)"}
            else:  # a named pool: a client naming none is a view session of the main port (cluster/sessions.py)
                pools = list(_pools(rows, coordinators))
        main = fleets[0]
        main.url = ",".join(urls)  # one URL, or the cluster's list (workers take --url a,b,c)
        for pool in pools:
            for i in range(ns.workers):
                extra = ("--pool", pool) if pool else ()
                await main.start_worker(f"bench-{pool or 'default'}-{i + 1}", *extra,
                                        max_concurrency=ns.max_concurrency)  # fmt: skip
        await main.wait_workers()
        coordinator_pids = [f.coordinator.pid for f in fleets if f.coordinator is not None]
        pg_pids = _pg_pids(server)
        worker_pids = [w.pid for f in fleets for w in f.workers]
        target: Any = urls[0] if len(urls) == 1 else urls
        async with contextlib.AsyncExitStack() as stack:
            clients = [await stack.enter_async_context(Client(target, pool=pool or "")) for pool in pools]
            for client, pool in zip(clients, pools, strict=True):
                for i in range(ns.warmup):
                    await (await client.submit("echo", args=i, tags=[f"pool:{pool}"] if pool else None)).result()
            if os.environ.get("FLEETWIRE_PG_WRITER") == "process" and store.startswith("postgresql"):
                await _children_settled(coordinator_pids)
            per_client = ns.plans // len(clients)
            plans = per_client * len(clients)
            wal0 = await _wal_mark(store)
            wal_timing = ns.wal_timing and store.startswith("postgresql")
            if wal_timing:  # an idle backend sends its pending counters 10 s after its last transaction
                await asyncio.sleep(PGSTAT_IDLE_S)
            counters0 = await _wal_counters(store) if wal_timing else None
            statements = getattr(ns, "statements", False) and store.startswith("postgresql")
            if statements:
                await _statements_reset(store)
            sched0, sampler = _schedstat(server), _Sampler(store, ns.checkpoint_at)
            sampler.start()
            cpu0, pg0, kids0 = _cpu(coordinator_pids), _pg_cpu(server), _children_cpu(coordinator_pids)
            workers0, client0, by0 = _cpu(worker_pids), time.process_time(), _pg_by_process(server)
            groups = {"coordinators": coordinator_pids, "workers": worker_pids, "client": [os.getpid()]}
            waits0 = {k: _threads_schedstat(v) for k, v in groups.items()}
            spies = _spies(ns.profile, coordinator_pids, "sqlite" if store.startswith("sqlite") else "pg", ns.perf)
            if ns.loop_callgrind:
                _callgrind_toggle(coordinator_pids, True)
            t0 = time.perf_counter()

            async def run(client: Client, pool: str | None) -> int:
                submitted = []
                tags = [f"pool:{pool}"] if pool else None
                for start in range(0, per_client, ns.chunk):
                    submitted += await client.submit_many("echo", range(start, min(per_client, start + ns.chunk)),
                                                          tags=tags)  # fmt: skip
                failed = 0
                for plan in submitted:
                    try:
                        await plan.result()
                    except Exception:
                        failed += 1
                return failed

            async with asyncio.timeout(ns.timeout):
                failed = sum(await asyncio.gather(*(run(c, p) for c, p in zip(clients, pools, strict=True))))
            elapsed = time.perf_counter() - t0
            sched1, activity = _schedstat(server), await sampler.stop()
            if wal_timing:
                await asyncio.sleep(PGSTAT_IDLE_S)
            counters1 = await _wal_counters(store) if wal_timing else None
            commit_time = _commit_time(counters0, counters1, sched0, sched1, elapsed, plans)
            if ns.loop_callgrind:
                _callgrind_toggle(coordinator_pids, False)
            cpu, pg_cpu = _cpu(coordinator_pids) - cpu0, _pg_cpu(server) - pg0
            kids = _children_cpu(coordinator_pids) - kids0
            workers_cpu, client_cpu = _cpu(worker_pids) - workers0, time.process_time() - client0
            waits = {k: [round((b - a) / 1e6, 1) for a, b in zip(waits0[k], _threads_schedstat(v), strict=True)]
                     for k, v in groups.items()}  # fmt: skip
            by_process = {k: round((v - by0.get(k, 0.0)) / plans * 1e6, 1) for k, v in _pg_by_process(server).items()}
            wal = await _wal_window(store, wal0, plans)
            ran = await _statements(store, plans, elapsed) if statements else None
            for spy in spies:
                spy.send_signal(signal.SIGINT)
                await asyncio.to_thread(spy.wait, 30)
            times: list[float] = []
            clock = time.perf_counter
            for i in range(ns.samples):
                t1 = clock()
                tags = [f"pool:{pools[0]}"] if pools[0] else None
                await (await clients[0].submit("echo", args=i, tags=tags)).result()
                times.append(clock() - t1)
        return {
            "coordinators": coordinators,
            "pools": [p or "default" for p in pools],
            "workers": ns.workers * len(pools),
            "store_used": main.store_used,
            "plans": plans,
            "failed": failed,
            "elapsed_s": round(elapsed, 3),
            "plans_per_s": round(plans / elapsed, 1),
            "latency": h.summary_ms(times),
            "coordinator_cpu_us_per_plan": round(cpu / plans * 1e6, 1),
            "writer_child_cpu_us_per_plan": round(kids / plans * 1e6, 1),  # not in the figure above
            # Which process the window waits on: each one's CPU a plan, and the coordinators' busy share of it
            # (CPU seconds over the window's seconds, per coordinator: near 1, its loop is the bottleneck).
            "workers_cpu_us_per_plan": round(workers_cpu / plans * 1e6, 1),
            "client_cpu_us_per_plan": round(client_cpu / plans * 1e6, 1),
            # Each process group's ms on a CPU and runnable waiting for one over the window (schedstat, every thread).
            "cpu_and_wait_ms": waits,
            "coordinator_busy": round(cpu / elapsed / len(coordinator_pids), 3),
            "postgres_cpu_us_per_plan_by_process": {k: v for k, v in by_process.items() if v} or None,
            "postgres_cpu_us_per_plan": round(pg_cpu / plans * 1e6, 1) if pg_pids else None,
            "wal": wal,  # PostgreSQL: WAL bytes a plan over the throughput window, by record kind
            "commit_time": commit_time,  # PostgreSQL: pg_stat_wal's deltas, the backends' schedstat, checkpoints
            "activity": activity,  # PostgreSQL: the coordinator's backends' states and wait events, sampled
            "statements": ran,  # --statements: statement -> [calls, a plan, a second] over the window
        }
    except Exception as exc:  # the column says what failed; the others still run
        tail = next((f.coordinator.lines[-3:] for f in fleets if f.coordinator is not None), [])
        return {"error": f"{type(exc).__name__}: {exc}"[:300], "log_tail": tail}
    finally:
        for f in reversed(fleets):
            await f.stop()


def _disk_p50_ms(directory: str, samples: int) -> float:
    """The p50 of one commit-sized write + fdatasync in ``directory`` now (bench/compare.py's floor, in place)."""
    return round(h.percentile(compare.fsync_samples(directory, samples)["in_place"], 50) * 1e3, 3)


def _median_column(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One column from several rounds of it: the medians of its figures (a failed round: that failure)."""
    failed = next((r for r in runs if "error" in r or "not_yet" in r), None)
    if failed is not None or len(runs) == 1:
        return failed or runs[0]
    out = dict(runs[0])
    for key in ("plans_per_s", "coordinator_cpu_us_per_plan", "postgres_cpu_us_per_plan", "elapsed_s"):
        values = [r[key] for r in runs if r.get(key) is not None]
        out[key] = round(statistics.median(values), 1) if values else None
    out["latency"] = {k: round(statistics.median(r["latency"][k] for r in runs), 3) for k in runs[0]["latency"]}
    return out


def _pg_settings(ns: argparse.Namespace) -> dict[str, str]:
    """The bench's server settings: track_wal_io_timing, then --pg-settings' NAME=VALUE words."""
    extra = dict(word.split("=", 1) for word in ns.pg_settings.split())
    if getattr(ns, "statements", False):  # a Namespace made by hand (tests) has none
        extra.setdefault("shared_preload_libraries", "pg_stat_statements")
    return {**BENCH_PG_SETTINGS, **extra}


async def collect(ns: argparse.Namespace) -> dict[str, Any]:
    results: dict[str, Any] = {"machine": h.machine(), "plans": ns.plans, "samples": ns.samples, "rounds": ns.rounds}
    why = missing_reason()
    if ns.one:
        results["alone_sqlite"] = results["alone_pg"] = {"error": "not run (--one)"}
    else:
        with tempfile.TemporaryDirectory(prefix="fleetwire-cluster-bench-") as tmp:
            results["alone_sqlite"] = await store_alone("sqlite", ns, Path(tmp))
            if why is None:
                with postgres_server(settings=_pg_settings(ns)) as server:
                    results["alone_pg"] = await store_alone(server.new_database(), ns, Path(tmp), server)
            else:
                results["alone_pg"] = {"error": why}
    # SQLite and one PostgreSQL coordinator alternate, round after round, each with the disk's
    # fsync p50 sampled just before it: on a shared machine the disk's latency moves by 10x
    # within minutes (0.1 to 7 ms), and a p50 of two commits follows it.
    disk = tempfile.gettempdir()
    rounds: list[dict[str, Any]] = []
    if why is not None:
        for _ in range(ns.rounds):
            rounds.append({"sqlite": await measure("sqlite", 1, ns), "sqlite_disk_ms": _disk_p50_ms(disk, 100)})
        results["sqlite"] = _median_column([r["sqlite"] for r in rounds])
        results["per_round"] = rounds
        for n in (1, 2, 3):
            results[f"pg{n}"] = {"error": why}
        return results
    with postgres_server(settings=_pg_settings(ns)) as server:
        results["pg_settings"] = server.settings
        for _ in range(ns.rounds):
            one: dict[str, Any] = {"sqlite_disk_ms": _disk_p50_ms(disk, 100)}
            one["sqlite"] = await measure("sqlite", 1, ns)
            one["pg1_disk_ms"] = _disk_p50_ms(disk, 100)
            one["pg1"] = await measure(_database(server, ns, one), 1, ns, server)
            rounds.append(one)
        results["sqlite"] = _median_column([r["sqlite"] for r in rounds])
        results["pg1"] = _median_column([r["pg1"] for r in rounds])
        results["per_round"] = rounds
        for n in (2, 3):
            results[f"pg{n}"] = (await measure(_database(server, ns, results), n, ns, server) if not ns.one
                                 else {"not_yet": "not run (--one)"})
    return results


def _database(server: PostgresServer, ns: argparse.Namespace, into: dict[str, Any]) -> str:
    """A fresh database for a column; unless ``--cold-wal``, the server's WAL segments ahead recycled first
    (tests/pg.py ``recycle_wal``: a server in service has them; a fresh one zero-fills a new 16 MiB segment inside
    the window, 0.05-0.19 s of a 2-5 s window, docs/PERFORMANCE.md §C29p). ``into["wal_segments_ahead"]``: how many."""
    dsn = server.new_database()
    if not ns.cold_wal:
        into["wal_segments_ahead"] = server.recycle_wal()
    return dsn


def per_round(results: dict[str, Any]) -> list[str]:
    """One line per round: the PostgreSQL / SQLite ratios of that round, and the disk's fsync p50 before each."""
    rounds = results.get("per_round") or []
    if len(rounds) < 2 or "pg1" not in rounds[0]:
        return []
    lines = ["", f"per round (SQLite, then one PostgreSQL coordinator; the columns above are the medians of "
             f"{len(rounds)}):", "| round | throughput x SQLite | p50 x SQLite | CPU x SQLite | fsync p50 before "
             "SQLite / PostgreSQL |", "|---|---|---|---|---|"]
    for i, r in enumerate(rounds, 1):
        a, b = r["sqlite"], r["pg1"]
        if "error" in a or "error" in b:
            lines.append(f"| {i} | failed: {a.get('error') or b.get('error')} | - | - | - |")
            continue
        lines.append(f"| {i} | {_ratio(b['plans_per_s'], a['plans_per_s'])} | "
                     f"{_ratio(b['latency']['p50_ms'], a['latency']['p50_ms'])} | "
                     f"{_ratio(b['coordinator_cpu_us_per_plan'], a['coordinator_cpu_us_per_plan'])} | "
                     f"{r['sqlite_disk_ms']:.3f} / {r['pg1_disk_ms']:.3f} ms |")
    return lines


def _cell(r: dict[str, Any], what: str) -> tuple[str, float | None]:
    if "not_yet" in r:
        return ("not yet: " + r["not_yet"] if what == "rate" else "not yet"), None
    if "error" in r:
        return ("failed: " + r["error"] if what == "rate" else "failed"), None
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
    lines = [f"| {results['plans']:,} no-op plans | " + " | ".join(heads) + " |",
             "|---" * (len(cols) + 1) + "|"]
    values: dict[str, dict[str, float | None]] = {}
    for what, label in (("rate", "throughput"), ("p50", "submit -> result p50"),
                        ("cpu", "coordinator CPU per plan"), ("pg", "PostgreSQL server CPU per plan")):
        cells = [_cell(results[c], what) for c in cols]
        values[what] = {c: v for c, (_, v) in zip(cols, cells, strict=True)}
        lines.append(f"| {label} | " + " | ".join(text for text, _ in cells) + " |")
        if what == "rate":
            lines.append("| workers (pools) | " + " | ".join(
                f"{results[c]['workers']} ({', '.join(results[c]['pools'])})" if "workers" in results[c] else "-"
                for c in cols) + " |")
        if what != "pg":
            base = values[what]["sqlite"]
            lines.append("| ratio to SQLite | - | " + " | ".join(_ratio(values[what][c], base) for c in cols[1:])
                         + " |")
    def split(r: dict[str, Any]) -> str:  # where a plan's CPU went: which process the window waits on
        if "coordinator_busy" not in r:
            return "-"
        child = f" + child {r['writer_child_cpu_us_per_plan']:.0f}" if r["writer_child_cpu_us_per_plan"] else ""
        return (
            f"busy {r['coordinator_busy']:.2f}{child}, workers {r['workers_cpu_us_per_plan']:.0f}, "
            f"client {r['client_cpu_us_per_plan']:.0f} µs"
        )

    lines.append("| coordinator's busy share; other CPU a plan | " + " | ".join(split(results[c]) for c in cols) + " |")
    lines += ["", "the store alone, in this process (bench/store_bench.py's 4 steps per plan; CPU of the process):",
              "| | SQLite | PostgreSQL | ratio |", "|---|---|---|---|"]
    a, b = results["alone_sqlite"], results["alone_pg"]
    if "error" in a or "error" in b:
        lines.append(f"| failed | {a.get('error', '-')} | {b.get('error', '-')} | - |")
    else:
        for label, get in (("one commit (sequential), p50 ms", lambda r: r["commit"]["p50_ms"]),
                           ("one commit (sequential), p99 ms", lambda r: r["commit"]["p99_ms"]),
                           ("sequential, CPU µs per plan (4 commits)", lambda r: r["sequential_cpu_us_per_plan"]),
                           (f"grouped ({GROUP_BLOCK}-plan blocks, ~{GROUP_BLOCK * 9} records a group), CPU µs per plan",
                            lambda r: r.get("grouped_cpu_us_per_plan"))):  # fmt: skip
            lines.append(f"| {label} | {get(a):,} | {get(b):,} | {_ratio(get(b), get(a))} |")
        server_cpu = b.get("grouped_server_cpu_us_per_plan")
        if server_cpu is not None:
            lines.append(f"| grouped, PostgreSQL server's CPU µs per plan | - | {server_cpu:,} | - |")
    rate, p50, cpu = values["rate"], values["p50"], values["cpu"]
    verdict = {
        f"PostgreSQL 1 coordinator throughput >= {TARGETS['rate_x_sqlite']}x SQLite":
            _ok(rate["pg1"], rate["sqlite"], lambda x: x >= TARGETS["rate_x_sqlite"]),
        f"PostgreSQL 1 coordinator p50 <= {TARGETS['p50_x_sqlite']}x SQLite":
            _ok(p50["pg1"], p50["sqlite"], lambda x: x <= TARGETS["p50_x_sqlite"]),
        f"coordinator CPU per plan on PostgreSQL <= {TARGETS['cpu_x_sqlite']}x SQLite":
            _ok(cpu["pg1"], cpu["sqlite"], lambda x: x <= TARGETS["cpu_x_sqlite"]),
    }
    lines += per_round(results)
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


def wal_lines(wal: dict[str, Any] | None) -> list[str]:
    """One PostgreSQL coordinator's WAL over its throughput window: bytes a plan, by record kind, HOT updates."""
    if not wal:
        return []
    head = f"one PostgreSQL coordinator's WAL: {wal['wal_bytes_per_plan']:,} bytes a plan, "
    lines = ["", f"{head}{wal.get('hot_update_share')} of its heap updates HOT; a row's bytes: {wal.get('row_bytes')}"]
    kinds = wal.get("by_kind")
    if isinstance(kinds, dict):
        lines += [f"  {k}: {v['records_per_plan']} records, {v['bytes_per_plan']:,} bytes a plan "
                  f"({v['fpi_bytes_per_plan']:,} in full-page images)" for k, v in kinds.items()]  # fmt: skip
    elif kinds:
        lines.append(f"  {kinds}")
    return lines


def commit_lines(pg1: dict[str, Any], settings: dict[str, str] | None) -> list[str]:
    """One PostgreSQL coordinator's window on the server's side: WAL counters, CPU and CPU wait, wait events."""
    t, act = pg1.get("commit_time"), pg1.get("activity")
    if not t:
        return []
    wal = (
        f"{t['wal_records_per_plan']} WAL records and {t['wal_bytes_per_plan']:,} bytes a plan, {t['wal_fpi']:,} full "
        f"pages (<= {t['fpi_share_of_wal']} of the WAL), {t['checkpoints']} checkpoints; WAL write "
        f"{t['wal_write_ms']:,} ms ({t['wal_writes']:,}), sync {t['wal_sync_ms']:,} ms ({t['wal_syncs']:,}), "
        f"buffers full {t['wal_buffers_full']}"
        if "wal_fpi" in t
        else "pg_stat_wal with --wal-timing"
    )
    return [
        "",
        f"the server over the window ({settings}): {t['window_ms']:,} ms, {wal}",
        f"  backends on a CPU {t['backends_cpu_ms']:,} ms, waiting for one {t['backends_cpu_wait_ms']:,} ms; "
        f"walwriter {t['walwriter_cpu_ms']} + {t['walwriter_cpu_wait_ms']} ms; "
        f"checkpointer {t['checkpointer_cpu_ms']} + {t['checkpointer_cpu_wait_ms']} ms",
        f"  the backends sampled: {act}",
        f"  the others' ms on a CPU and waiting for one: {pg1.get('cpu_and_wait_ms')}",
        *(f"  statement [calls, a plan, a second]: {k}: {v}" for k, v in (pg1.get("statements") or {}).items()),
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--plans", type=int, default=20_000, help="plans for the throughput run (default 20000)")
    parser.add_argument("--rounds", type=int, default=1,
                        help="rounds of the SQLite and one-PostgreSQL columns, alternating; medians shown (default 1)")
    parser.add_argument("--store-plans", type=int, default=1000,
                        help="plans written one commit at a time in the store-alone part (default 1000)")
    parser.add_argument("--samples", type=int, default=1000, help="sequential round trips (default 1000)")
    parser.add_argument("--warmup", type=int, default=100,
                        help="untimed plans before each column's window, both columns: sequential submit -> result "
                             "round trips of each client, so groups of one plan (default 100)")  # fmt: skip
    parser.add_argument("--workers", type=int, default=2, help="worker processes (default 2)")
    parser.add_argument("--max-concurrency", type=int, default=1000, help="plans each worker runs at once")
    parser.add_argument("--chunk", type=int, default=5000, help="plans per submit_many call (default 5000)")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds a throughput run may take")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    parser.add_argument("--profile", metavar="DIR", help="py-spy the coordinators over each throughput window "
                        "(raw files in DIR; read them with bench/profile_top.py)")
    parser.add_argument("--perf", action="store_true", help="with --profile: perf record -g, not py-spy")
    parser.add_argument("--one", action="store_true", help="only the SQLite and one-PostgreSQL columns: no store-alone "
                        "part, no 2- and 3-coordinator columns (an interleaved A/B's rounds)")
    parser.add_argument("--loop-callgrind", metavar="DIR", help="the coordinators under callgrind, counting only over "
                        "the throughput window (DIR/coordinator-<pid>.out*; callgrind_annotate them; slow: ~50x)")
    parser.add_argument("--wal-timing", action="store_true", help="pg_stat_wal's counters over each PostgreSQL "
                        "window (its WAL write and sync ms, full pages): waits 10.5 s before and after it")
    parser.add_argument("--checkpoint-at", type=float, metavar="S", help="a CHECKPOINT S seconds into each "
                        "PostgreSQL window (as a timed one would land): full-page images follow it")
    parser.add_argument("--pg-settings", default="", metavar="SETTINGS",
                        help="more PostgreSQL server settings, NAME=VALUE words (e.g. 'wal_compression=lz4')")
    parser.add_argument("--cold-wal", action="store_true",
                        help="no WAL segments recycled ahead before each PostgreSQL column (a fresh server's: each "
                             "new 16 MiB segment is zero-filled inside the window)")
    parser.add_argument("--statements", action="store_true",
                        help="pg_stat_statements over each PostgreSQL window (the server loads it): each statement's "
                        "calls, a plan and a second (BEGINs, commit statements, the usage ledger's)")
    parser.add_argument("--coordinator-args", default="", metavar="ARGS", help="more coordinator flags (one string)")
    parser.add_argument("--commit-callgrind", action="store_true",
                        help="the PostgreSQL commit path in callgrind instructions a plan (needs valgrind), then exit")
    parser.add_argument("--pg-writer", choices=("loop", "process"), default=None,
                        help="the PostgreSQL coordinators' group commits on the loop or in a writer process, lone "
                        "ones inline (FLEETWIRE_PG_WRITER; default: as the environment says)")  # fmt: skip
    parser.add_argument("--commit-path", type=int, metavar="BLOCKS", help=argparse.SUPPRESS)  # --commit-callgrind
    parser.add_argument("--no-writes", action="store_true", help=argparse.SUPPRESS)
    ns = parser.parse_args(argv)
    if ns.commit_path is not None:
        commit_path(ns.commit_path, not ns.no_writes)
        return 0
    if ns.pg_writer is not None:  # the coordinators' and --commit-callgrind's children inherit it (h.bench_env)
        os.environ["FLEETWIRE_PG_WRITER"] = ns.pg_writer
    if ns.commit_callgrind:
        print(f"PostgreSQL commit path: {commit_callgrind():,.0f} instructions a plan (4 steps, groups of "
              f"~{GROUP_BLOCK * 9:,} records; callgrind)")
        return 0
    h.configure(ns)
    if ns.loop_callgrind:
        _callgrind_coordinators(ns.loop_callgrind)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwind: the processes and PostgreSQL are stopped
    # Quiet: the SDK's expected `moved` reconnects and the in-process store's info lines are not results.
    logging.getLogger("fleetwire").setLevel(logging.ERROR)
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    results = h.run_loop(collect(ns))
    lines, verdict = report(results)
    results["verdict"] = verdict
    m = results["machine"]
    h.emit(results, ns.json, [
        f"machine: {m.get('cpus')} CPUs ({m.get('cpu', '?')}), Python {m.get('python')}; everything on 127.0.0.1, "
        f"PostgreSQL with fsync=on, synchronous_commit=on",
        *lines, "", "targets (issue #12):", *(f"  {k}: {v}" for k, v in verdict.items()),
        *wal_lines(results.get("pg1", {}).get("wal")),
        *commit_lines(results.get("pg1", {}), results.get("pg_settings")),
    ])
    return 0


if __name__ == "__main__":
    sys.exit(main())
