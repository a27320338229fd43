"""The client's side of a sequential round trip: callgrind instructions of the client process a round trip.

``bench/latency.py``'s loop (``submit("echo")`` then ``await plan.result()``, one plan at a time, uvloop) through a
real coordinator and worker, with only the client's process under callgrind (the harness's other processes run
untraced: valgrind does not follow children). The figure is the difference of two runs of different sizes over
their difference, so start-up, the fleet's start and the warm-up cancel out: the client's instructions a round
trip, its frame's read and decode, the result's delivery and the caller's wake-up, the next submit's building,
encoding and write, and the loop's turns between them (issue #29, docs/PERFORMANCE.md §D29d).

    python bench/client_turn.py                          # this tree
    python bench/client_turn.py --compare /tmp/wt_old    # and other trees (their fleetwire), same sitting
    python bench/client_turn.py --profile                # cProfile of the client over the round trips

The coordinator and the worker are this checkout's in both trees' runs: only the client's package moves with
``--compare`` (``PYTHONPATH``), and only the client is counted.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import _harness as h

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


async def round_trips(count: int, warmup: int, store: str, profile: bool) -> float:
    from fleetwire import Client

    async with h.fleet(store) as f:
        await f.start_coordinator()
        await f.start_worker("bench-1", max_concurrency=4)
        await f.wait_workers()
        async with Client(f.url) as client:
            for i in range(warmup):
                await (await client.submit("echo", args=i)).result()
            prof = None
            if profile:
                import cProfile

                prof = cProfile.Profile()
                prof.enable()
            t0 = time.process_time()
            for i in range(count):
                plan = await client.submit("echo", args=i)
                await plan.result()
            spent = time.process_time() - t0
            if prof is not None:
                import pstats

                prof.disable()
                table = pstats.Stats(prof).stats  # type: ignore[attr-defined]
                rows = sorted(table.items(), key=lambda kv: -kv[1][2])
                calls = sum(v[1] for v in table.values())
                print(f"{calls / count:.1f} calls a round trip; by own time (own us, cumulative us, calls a trip):")
                for (path, line, name), (_cc, nc, tt, ct, _callers) in rows[:40]:
                    where = "/".join(path.split("/")[-2:])
                    print(f"{tt * 1e6 / count:7.2f} {ct * 1e6 / count:7.2f} {nc / count:6.2f}  {name} ({where}:{line})")
    return spent


def per_trip(tree: str, small: int, large: int, store: str) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        counts = []
        for n in (small, large):
            argv = [os.path.join(HERE, "client_turn.py"), "--child", "--trips", str(n), "--store", store]
            counts.append(h.callgrind_total(tree, argv, os.path.join(tmp, f"cg.{n}")))
    return (counts[1] - counts[0]) / (large - small)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trips", type=int, default=1000, help="round trips of the larger run (default 1000)")
    parser.add_argument("--warmup", type=int, default=100, help="untimed round trips first (default 100)")
    parser.add_argument("--store", choices=("memory", "sqlite"), default="memory", help="default memory")
    parser.add_argument(
        "--compare",
        metavar="PATH",
        nargs="+",
        default=[],
        help="also measure the client package of the tree(s) at PATH",
    )
    parser.add_argument("--only-compare", action="store_true", help="measure the --compare trees, not this one")
    parser.add_argument("--rounds", type=int, default=1, help="measurements of each tree, alternated (default 1)")
    parser.add_argument("--profile", action="store_true", help="cProfile of the client over --trips round trips")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ns = parser.parse_args(argv)
    if ns.child or ns.profile:
        spent = h.run_loop(round_trips(ns.trips, ns.warmup, ns.store, ns.profile))
        if not ns.child:
            print(f"client CPU {spent / ns.trips * 1e6:.1f} us a round trip (profiled)")
        return 0
    trees = [] if ns.only_compare else [ROOT]
    trees += [os.path.abspath(path) for path in ns.compare]
    results: dict[str, list[int]] = {tree: [] for tree in trees}
    for _ in range(ns.rounds):
        for tree in trees:
            results[tree].append(round(per_trip(tree, ns.trips // 4, ns.trips, ns.store)))
    print(json.dumps({"bench": "client_turn", "store": ns.store, "instructions_a_round_trip": results}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
