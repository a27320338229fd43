"""Lone PostgreSQL commits, the busy-poll off and on in alternate blocks of one run (issue #29, §C29l).

``python bench/pg_lone_commit.py --commits 2000 --spin-us 1000``: one tests/pg.py server, one PgStore on a uvloop
loop, bench/store_bench.py's plan steps written one a commit through ``PgStore.write_async`` (the committer's path);
blocks of ``--block`` commits alternate the store's lone-commit spin window between 0 and ``--spin-us``, so both modes
see the same server, table sizes and minutes. Prints, for each mode: the commit's p50 and p90 (wall), this
process's CPU a commit, the server's CPU a commit (all its processes, in clock ticks), the writer backend's alone
(its ``/proc/PID/schedstat``, ns: the statement, its commit and the socket's side; a server on this host only) and
the spin's counts (spins, hits, misses, busy, contended).
``--dsn`` uses a running server instead; ``--shm`` puts the server's files on /dev/shm.

``python bench/pg_lone_commit.py --against /tmp/wt/coordinator/io/stores/pg_schema.py --shm``: the modes are that
file's commit statements (``commit_statement``, e.g. a worktree's of an older commit) and this tree's, the spin off in
both: the same client code, server and minutes, only the statements differ (docs/PERFORMANCE.md §C29o).

``--group N`` (with ``--against``): each commit is a group of a busy committer instead of one step (bench/
cluster_throughput.py ``_grouped``'s shape: the submit of N new plans, the lease of the N before them, the start of the
N before those and the end of the N before those, so N plans' 4 steps a group), ``--commits`` groups a mode; the
figures are then a plan's: the writer backend's CPU and the WAL the server wrote (``pg_current_wal_lsn`` around each
block; full-page images after a checkpoint included), the server's side of grouped commits (docs/PERFORMANCE.md
§C29p). Every run also prints the blocks that went into a new 16 MiB WAL segment apart from the others (a block's
wall time and writer backend CPU): a fresh server creates each segment, filled with zeros, in the commit that needs it,
where one in service reuses the segments a checkpoint freed.

``python bench/pg_lone_commit.py --callgrind``: the client's instructions a lone commit (callgrind, the spin off,
``PYTHONHASHSEED=0``): this script's process writing 400 plans' 4 steps less one writing 100 plans', after the same
200 warm-up commits, divided by 1,200 (docs/PERFORMANCE.md §C29j's "Later" and §C29l). From a compiled copy: run it
with ``PYTHONPATH`` set to the copy, from the copy.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib.util
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import cluster_throughput as ct
import store_bench

from coordinator.io.stores import postgres
from tests.pg import postgres_server
from wireio.spin import Spin


def _args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--commits", type=int, default=2000, help="lone commits in each mode")
    parser.add_argument("--block", type=int, default=100, help="commits a block; the modes alternate by block")
    parser.add_argument("--spin-us", type=float, default=1000.0, help="the 'on' mode's window")
    parser.add_argument("--dsn", default=None, help="a database to use instead of a tests/pg.py server")
    parser.add_argument("--ignore-contention", action="store_true",
                        help="the spin does not back off when the thread was switched out (the mechanism alone, on a "
                             "shared host)")  # fmt: skip
    parser.add_argument("--against", default=None, metavar="PG_SCHEMA_PY",
                        help="alternate that file's commit statements with this tree's (module docstring)")  # fmt: skip
    parser.add_argument("--group", type=int, default=0, metavar="N",
                        help="commits of N plans' steps each, a plan's figures (module docstring)")  # fmt: skip
    parser.add_argument("--callgrind", action="store_true", help="instructions a lone commit (module docstring)")
    parser.add_argument("--cg-plans", type=int, default=0, help=argparse.SUPPRESS)  # a --callgrind child's plans
    parser.add_argument("--shm", action="store_true",
                        help="the server's files on /dev/shm (its fdatasync free: the client's side and the wake-ups "
                             "alone); default the temporary directory's disk")  # fmt: skip
    return parser.parse_args()


def _modes(args: argparse.Namespace) -> list[tuple[str, float, Any]]:
    """Each mode's label, spin window and commit statements: the spin off and on, or (``--against``) that file's
    statements and this tree's, the spin off in both."""
    if args.against is None:
        return [(f"spin {w * 1e6:6.0f} us", w, None) for w in (0.0, args.spin_us / 1e6)]
    spec = importlib.util.spec_from_file_location("against_pg_schema", args.against)
    assert spec is not None and spec.loader is not None, args.against
    other = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(other)
    return [(f"{args.against}'s statements", 0.0, other.commit_statement),
            ("this tree's statements", 0.0, postgres.commit_statement)]  # fmt: skip


def _groups(groups: int, n: int) -> list[list[Any]]:
    """``groups`` commits of a busy committer, ``n`` plans' 4 steps in each (cluster_throughput ``_grouped``'s shape;
    the first 3 fill the pipeline)."""
    blocks = [[store_bench.plan_steps(50_000_000 + b * n + i) for i in range(n)] for b in range(groups)]
    out = []
    for k in range(groups):
        group: list[Any] = []
        for step in range(4):
            if 0 <= k - step < groups:
                for plan in blocks[k - step]:
                    group += plan[step]
        out.append(group)
    return out


async def _run(db: Any, server: Any, args: argparse.Namespace, dsn: str) -> dict[str, dict[str, Any]]:
    await db.open_async()
    warm = 20 if args.group else 200  # commits before the blocks
    if args.group:
        steps = _groups(2 * args.commits + warm, args.group)
    else:
        plans = (2 * args.commits) // 4 + 60
        steps = [s for n in range(plans) for s in store_bench.plan_steps(40_000_000 + n)]
    modes = _modes(args)
    import asyncpg  # type: ignore[import-untyped]

    lsn_conn = await asyncpg.connect(dsn)  # the WAL's position around each block (not the writer's connection)

    async def lsn() -> int:
        return int(await lsn_conn.fetchval("SELECT pg_current_wal_lsn() - '0/0'::pg_lsn"))

    for k, s in enumerate(steps[:warm]):  # warm: the statements prepared (each mode's), their generic plans made
        if modes[(k // 4) % 2][2] is not None:
            postgres.commit_statement = modes[(k // 4) % 2][2]
        await db.write_async(s)
    gc.collect()
    gc.freeze()
    out: dict[str, dict[str, Any]] = {m[0]: {"times": [], "cpu": 0.0, "pg": 0.0, "backend": 0, "wal": 0}
                                    for m in modes}  # fmt: skip
    backend = _backend_cpu_ns(db._awriter.get_server_pid())
    if args.ignore_contention:
        db.lone_spin = Spin(switched=lambda: 0)
    spin = db.lone_spin
    counts = {m[0]: [0, 0, 0, 0, 0] for m in modes}
    segments: list[tuple[bool, float, int]] = []  # each block's (into a new WAL segment, wall s, backend ns)
    i = warm
    for block in range(2 * args.commits // args.block):
        mode, spin.window_s, statements = modes[block % 2]
        if statements is not None:
            postgres.commit_statement = statements  # what PgStore._commit calls
        before = (spin.spins, spin.hits, spin.misses, spin.busy, spin.contended)
        res = out[mode]
        w0 = await lsn()
        c0, pg0, b0 = time.process_time(), ct._pg_cpu(server), backend()
        for s in steps[i : i + args.block]:
            t = time.perf_counter()
            await db.write_async(s)
            res["times"].append(time.perf_counter() - t)
        res["cpu"] += time.process_time() - c0
        res["pg"] += ct._pg_cpu(server) - pg0
        res["backend"] += backend() - b0
        w1 = await lsn()
        res["wal"] += w1 - w0
        # (a block that went into a new 16 MiB WAL segment, which a fresh server creates and fills with zeros first)
        segments.append((w1 >> 24 != w0 >> 24, sum(res["times"][-args.block :]), backend() - b0))
        i += args.block
        after = (spin.spins, spin.hits, spin.misses, spin.busy, spin.contended)
        counts[mode] = [c + (a - b) for c, a, b in zip(counts[mode], after, before, strict=True)]
    for mode, res in out.items():
        res["counts"] = counts[mode]
    out["segments"] = {"blocks": segments}
    await lsn_conn.close()
    await db.close_async()
    return out


def _backend_cpu_ns(pid: int) -> Any:
    """A reader of the backend ``pid``'s CPU so far, in ns (its schedstat; 0 when it is not on this host)."""
    path = Path(f"/proc/{pid}/schedstat")
    if not path.exists():
        return lambda: 0
    return lambda: int(path.read_text().split()[0])


async def _cg_child(db: Any, plans: int) -> None:
    """A --callgrind child: 200 warm-up commits, then ``plans`` plans' 4 steps, one a commit."""
    await db.open_async()
    steps = [s for n in range(50 + plans) for s in store_bench.plan_steps(30_000_000 + n)]
    for s in steps[:200]:
        await db.write_async(s)
    gc.freeze()
    for s in steps[200 : 200 + 4 * plans]:
        await db.write_async(s)
    await db.close_async()


def callgrind() -> float:
    """Instructions a lone commit, client side: 400 plans' commits less 100 plans', over 1,200 (module docstring)."""
    counts = {}
    with postgres_server(parent="/dev/shm") as server, tempfile.TemporaryDirectory() as tmp:
        for plans in (100, 400):
            env = {**os.environ, "PYTHONHASHSEED": "0", "FLEETWIRE_PG_SPIN_US": "0"}
            cmd = ["valgrind", "--tool=callgrind", f"--callgrind-out-file={tmp}/cg.out", sys.executable, __file__,
                   "--cg-plans", str(plans), "--dsn", server.new_database()]  # fmt: skip
            out = subprocess.run(cmd, capture_output=True, text=True, check=False, env=env).stderr
            found = re.search(r"Collected : (\d+)", out)
            if found is None:
                raise SystemExit(f"callgrind gave no count: {out[-2000:]}")
            counts[plans] = int(found.group(1))
    return (counts[400] - counts[100]) / 1200


def main() -> None:
    args = _args()
    if args.callgrind:
        print(f"{Path.cwd()}: {callgrind():,.0f} instructions a lone commit (client side, callgrind)")
        return
    if args.cg_plans:
        import uvloop

        db = ct._open(args.dsn, Path("."))
        try:
            uvloop.run(_cg_child(db, args.cg_plans))
        finally:
            db.close()
        return
    with contextlib.ExitStack() as stack:
        server = None
        dsn = args.dsn
        if dsn is None:
            server = stack.enter_context(postgres_server(parent="/dev/shm" if args.shm else None))
            dsn = server.new_database()
        db = ct._open(dsn, Path("."))
        import uvloop

        try:
            out = uvloop.run(_run(db, server, args, dsn))
        finally:
            db.close()
    load = os.getloadavg()
    where = "/dev/shm" if args.shm else "disk"
    what = f"groups of {args.group} plans' steps" if args.group else "lone commits"
    print(f"{Path.cwd()}: {args.commits} {what} a mode, blocks of {args.block}, {where}, load {load[0]:.2f}")
    segments = out.pop("segments")["blocks"]
    for mode, res in out.items():
        times = sorted(res["times"])
        n = len(times)
        if args.group:  # a plan's figures: N plans' 4 steps a group
            plans = n * args.group
            print(f"  {mode}: commit p50 {times[n // 2] * 1e3:.3f} ms, a plan: writer backend"
                  f" {res['backend'] / plans / 1e3:.2f} us, server CPU {res['pg'] / plans * 1e6:.1f} us,"
                  f" client CPU {res['cpu'] / plans * 1e6:.1f} us, WAL {res['wal'] / plans:.0f} bytes")  # fmt: skip
            continue
        spins, hits, misses, busy, contended = res["counts"]
        print(f"  {mode}: p50 {times[n // 2] * 1e3:.3f} ms, p90 {times[int(n * 0.9)] * 1e3:.3f} ms,"
              f" client CPU {res['cpu'] / n * 1e6:.0f} us, server CPU {res['pg'] / n * 1e6:.0f} us"
              f" (writer backend {res['backend'] / n / 1e3:.1f}) a commit;"
              f" spins {spins} hits {hits} misses {misses} busy {busy} contended {contended}")  # fmt: skip
    for new in (False, True):
        blocks = [b for b in segments if b[0] == new]
        if blocks:
            print(f"  blocks {'into a new' if new else 'within one'} WAL segment: {len(blocks)}, a block's wall"
                  f" {sum(b[1] for b in blocks) / len(blocks) * 1e3:.1f} ms, writer backend"
                  f" {sum(b[2] for b in blocks) / len(blocks) / 1e6:.2f} ms")  # fmt: skip


if __name__ == "__main__":
    main()
