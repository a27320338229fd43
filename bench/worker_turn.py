"""The worker's side of a sequential round trip: callgrind instructions of the worker process a round trip.

``bench/client_turn.py``'s loop (``submit("echo")`` then ``await plan.result()``, one plan at a time) through a real
coordinator and one worker, with only the worker's process run under callgrind (``valgrind python -m fleetwire
worker``; the client here and the coordinator run untraced). The worker's turn: the assign frame's read and decode,
the plan's start and the handler's run, the done/result frame's encoding and write, and the loop's turns between
them. As in client_turn.py the figure is the difference of two runs of different sizes over their difference, so
the worker's start-up, registration and the warm-up cancel out (issue #29, docs/PERFORMANCE.md §D29e).

    python bench/worker_turn.py                  # instructions a round trip of the worker (this tree)
    python bench/worker_turn.py --profile        # cProfile of the worker, the two runs' difference
    python bench/worker_turn.py --profile --per-trip --by-cumulative   # only the rows of the round trip
    python bench/worker_turn.py --side coordinator   # the coordinator's instructions a round trip instead

With ``--side coordinator`` the coordinator runs many times slower under callgrind, so what waits on its clock (the
ack timer, coordinator/io/frontdoor/core_driver.py) fires relatively sooner than in an untraced run; its count moves
~+-10,000 of ~600,000 from run to run.
"""

from __future__ import annotations

import argparse
import json
import os
import pstats
import sys
import tempfile

import _harness as h
from client_turn import ROOT

VALGRIND = ("valgrind", "--tool=callgrind")


async def round_trips(count: int, warmup: int, store: str, wrap: list[str], side: str = "worker") -> None:
    """``warmup`` then ``count`` sequential round trips against a worker started as ``wrap`` + ``-m fleetwire
    worker ...`` (``side`` "coordinator": the coordinator started so, the worker as it is); that process is stopped
    (SIGTERM) so that its tracer writes its file."""
    from fleetwire import Client

    async with h.fleet(store) as f:
        if side == "coordinator":
            traced = f.coordinator = await h.spawn(
                "coordinator", *wrap, "-m", "fleetwire", *coordinator_args(store, f.tmp.name)
            )
            f.url = (await traced.wait_for_line(r"listening on (ws://\S+)", timeout_s=300)).group(1)
        else:
            await f.start_coordinator()
        worker_wrap = wrap if side == "worker" else [sys.executable]
        worker = await h.spawn(
            "bench-1",
            *worker_wrap,
            "-m",
            "fleetwire",
            "worker",
            "--url",
            f.url,
            "--id",
            "bench-1",
            "--max-concurrency",
            "4",
            "--log-level",
            "warning",
        )
        f.workers.append(worker)
        await f.wait_workers(timeout_s=300)
        async with Client(f.url) as client:
            for i in range(warmup + count):
                await (await client.submit("echo", args=i)).result()
        traced = worker if side == "worker" else f.coordinator
        assert traced is not None
        await traced.stop(grace_s=120)
        if traced.proc.returncode not in (0, -15):
            raise RuntimeError(f"{side} exited {traced.proc.returncode}: {traced.lines[-10:]}")


def coordinator_args(store: str, data_dir: str) -> list[str]:
    """``Fleet.start_coordinator``'s arguments (bench/_harness.py): its store in a temporary folder, limits lifted."""
    args = ["coordinator", "--host", h.HOST, "--port", "0", "--insecure", "--log-level", "warning", "--store", store]
    if store == "sqlite":
        args += ["--data-dir", data_dir]
    for flag, value in h.BENCH_LIMITS.items():
        if h.coordinator_has_flag(flag):
            args += [flag, value]
    return args


def callgrind_count(n: int, warmup: int, store: str, out_file: str, side: str = "worker") -> int:
    wrap = [*VALGRIND, f"--callgrind-out-file={out_file}", sys.executable]
    h.run_loop(round_trips(n, warmup, store, wrap, side))
    with open(out_file) as fh:
        return next(int(line.split()[1]) for line in fh if line.startswith("summary:"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trips", type=int, default=800, help="round trips of the larger run (default 800)")
    parser.add_argument("--warmup", type=int, default=100, help="untimed round trips first (default 100)")
    parser.add_argument("--store", choices=("memory", "sqlite"), default="memory", help="default memory")
    parser.add_argument("--profile", action="store_true", help="cProfile of the worker, differenced as the count")
    parser.add_argument(
        "--side",
        choices=("worker", "coordinator"),
        default="worker",
        help="the process traced (default the worker; the coordinator: its side of the same trips)",
    )
    parser.add_argument("--top", type=int, default=40, help="rows of --profile's table (default 40)")
    parser.add_argument(
        "--per-trip",
        action="store_true",
        help="--profile: only rows called at least once a round trip (no start-up, import noise)",
    )
    parser.add_argument("--by-cumulative", action="store_true", help="--profile: sort by cumulative time")
    ns = parser.parse_args(argv)
    os.environ["PYTHONHASHSEED"] = "0"
    with tempfile.TemporaryDirectory() as tmp:
        small = ns.trips // 4
        if ns.profile:
            stats = []
            for n in (small, ns.trips):
                out = os.path.join(tmp, f"prof.{n}")
                wrap = [sys.executable, "-m", "cProfile", "-o", out]
                h.run_loop(round_trips(n, ns.warmup, ns.store, wrap, ns.side))
                stats.append(pstats.Stats(out).stats)  # type: ignore[attr-defined]
            trips = ns.trips - small
            rows = []
            for key, (_cc, nc, tt, ct, _callers) in stats[1].items():
                _cc0, nc0, tt0, ct0, _c0 = stats[0].get(key, (0, 0, 0.0, 0.0, {}))
                rows.append((key, (nc - nc0) / trips, (tt - tt0) * 1e6 / trips, (ct - ct0) * 1e6 / trips))
            calls = sum(row[1] for row in rows)
            if ns.per_trip:
                rows = [row for row in rows if row[1] >= 0.5]
            rows.sort(key=lambda row: -row[3] if ns.by_cumulative else -row[2])
            print(f"{ns.side}, {small} against {ns.trips} round trips, differenced: {calls:.1f} calls a round trip")
            print("by own time (own us, cumulative us, calls a round trip):")
            for (path, line, name), nc, tt, ct in rows[: ns.top]:
                where = "/".join(path.split("/")[-2:])
                print(f"{tt:7.2f} {ct:7.2f} {nc:6.2f}  {name} ({where}:{line})")
            return 0
        counts = [
            callgrind_count(n, ns.warmup, ns.store, os.path.join(tmp, f"cg.{n}"), ns.side) for n in (small, ns.trips)
        ]
    per = (counts[1] - counts[0]) / (ns.trips - small)
    print(
        json.dumps(
            {
                "bench": "worker_turn",
                "tree": ROOT,
                "side": ns.side,
                "store": ns.store,
                "instructions_a_round_trip": round(per),
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
