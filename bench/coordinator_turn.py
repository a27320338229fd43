"""The coordinator's side of a sequential round trip: callgrind instructions of the coordinator a round trip.

``bench/client_turn.py``'s loop (``submit("echo")`` then ``await plan.result()``, one plan at a time) through a real
coordinator and one worker, with only the coordinator run under callgrind (``valgrind python -m fleetwire
coordinator``, and its children: the SQLite store's writer process; the client here and the worker run untraced).
The coordinator's turn: the submit frame's read and decode, the core's step, the store's commit, the assign frame's
encoding and write, the worker's accept/done frames, the result's write to the client, and the loop's turns between
them. As in client_turn.py and worker_turn.py the figure is the difference of two runs of different sizes over their
difference, so start-up, the worker's registration and the warm-up cancel out (issue #29, docs/PERFORMANCE.md §D29g).

    python bench/coordinator_turn.py                                  # this tree, memory store
    python bench/coordinator_turn.py --store sqlite                   # the durable store (its writer child counted)
    python bench/coordinator_turn.py --compare /tmp/wt_old --rounds 2 # and other trees' coordinators, alternated

Only the coordinator moves with ``--compare`` (its tree's ``fleetwire``, run from that tree): the client and the
worker are this checkout's in every run, so every tree meets the same peers.
"""

from __future__ import annotations

import argparse
import asyncio
import glob
import json
import os
import sys
import tempfile

import _harness as h
from client_turn import HERE, ROOT
from worker_turn import VALGRIND, coordinator_args


async def round_trips(tree: str, count: int, warmup: int, store: str, out_prefix: str) -> int:
    """``warmup`` then ``count`` sequential round trips against ``tree``'s coordinator run under callgrind (one
    output file a process, ``out_prefix``.PID); it is stopped (SIGTERM) so that its tracers write their files.
    The coordinator's process id."""
    from fleetwire import Client

    async with h.fleet(store) as f:
        args = coordinator_args(store, f.tmp.name)
        env = h.bench_env(PYTHONPATH=os.pathsep.join((HERE, tree)), PYTHONHASHSEED="0")
        proc = await asyncio.create_subprocess_exec(
            *VALGRIND, "--trace-children=yes", f"--callgrind-out-file={out_prefix}.%p", sys.executable, "-m",
            "fleetwire", *args, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT, env=env, cwd=tree,
        )  # fmt: skip
        traced = f.coordinator = h.Proc("coordinator", proc)
        traced.start_reading()
        f.url = (await traced.wait_for_line(r"listening on (ws://\S+)", timeout_s=300)).group(1)
        await f.start_worker("bench-1", max_concurrency=4)
        await f.wait_workers(timeout_s=300)
        async with Client(f.url) as client:
            for i in range(warmup + count):
                await (await client.submit("echo", args=i)).result()
        await traced.stop(grace_s=120)
        if traced.proc.returncode not in (0, -15):
            raise RuntimeError(f"coordinator exited {traced.proc.returncode}: {traced.lines[-10:]}")
        return traced.pid


def callgrind_counts(tree: str, n: int, warmup: int, store: str, out_prefix: str) -> tuple[int, int]:
    """Instructions of the coordinator's own process and of all its processes (its children's added)."""
    coordinator = h.run_loop(round_trips(tree, n, warmup, store, out_prefix))
    counts: dict[int, int] = {}
    for path in glob.glob(f"{out_prefix}.*"):
        with open(path) as fh:
            counts[int(path.rsplit(".", 1)[1])] = next(
                int(line.split()[1]) for line in fh if line.startswith("summary:")
            )
    return counts[coordinator], sum(counts.values())


def per_trip(tree: str, small: int, large: int, warmup: int, store: str) -> tuple[float, float]:
    with tempfile.TemporaryDirectory() as tmp:
        runs = [callgrind_counts(tree, n, warmup, store, os.path.join(tmp, f"cg{n}")) for n in (small, large)]
    return (runs[1][0] - runs[0][0]) / (large - small), (runs[1][1] - runs[0][1]) / (large - small)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trips", type=int, default=800, help="round trips of the larger run (default 800)")
    parser.add_argument("--warmup", type=int, default=100, help="untimed round trips first (default 100)")
    parser.add_argument("--store", choices=("memory", "sqlite"), default="memory", help="default memory")
    parser.add_argument("--compare", metavar="PATH", nargs="+", default=[], help="also the coordinator of tree(s)")
    parser.add_argument("--only-compare", action="store_true", help="measure the --compare trees, not this one")
    parser.add_argument("--rounds", type=int, default=1, help="measurements of each tree, alternated (default 1)")
    ns = parser.parse_args(argv)
    trees = [] if ns.only_compare else [ROOT]
    trees += [os.path.abspath(path) for path in ns.compare]
    own: dict[str, list[int]] = {tree: [] for tree in trees}
    total: dict[str, list[int]] = {tree: [] for tree in trees}
    for _ in range(ns.rounds):
        for tree in trees:
            main_process, every = per_trip(tree, ns.trips // 4, ns.trips, ns.warmup, ns.store)
            own[tree].append(round(main_process))
            total[tree].append(round(every))
    report = {"bench": "coordinator_turn", "store": ns.store, "instructions_a_round_trip": own}
    if ns.store == "sqlite":
        report["with_children"] = total  # the store's writer process too
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
