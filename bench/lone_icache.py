"""Instructions and simulated cache misses of one process a lone round trip (issue #29, docs/PERFORMANCE.md §C29i).

``bench/client_turn.py``'s and ``bench/worker_turn.py``'s sequential round trips, with one process (the client, the
worker or the coordinator) run under callgrind with its cache simulation (``--cache-sim=yes``: this VM's L1i of
64 KiB and L1d of 48 KiB a core, an L2 of 4 MiB as the last level), two runs of different sizes differenced, so start-up
and warm-up cancel out. ``I1mr``: instruction fetches that missed the L1i, the code a round trip brings in; on a lone
round trip, where each process's turn starts after the others' turns, they are what compiled code's size costs.

    python bench/lone_icache.py --side coordinator        # this tree (its fleet and its client)
    cd /tmp/copy && python bench/lone_icache.py --side client   # a compiled copy (tools/build_compiled.py)

Prints one JSON object: the counts a round trip (``Ir``, ``I1mr``, ``D1mr`` ...).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

import _harness as h

#: This VM's caches (lscpu): L1i 64 KiB 8-way, L1d 48 KiB 12-way, L2 4 MiB 16-way, 64-byte lines.
CACHES = "--cache-sim=yes --I1=65536,8,64 --D1=49152,12,64 --LL=4194304,16,64"


def counts(path: str) -> dict[str, int]:
    """callgrind's totals of one run, by event."""
    with open(path) as fh:
        lines = fh.read().splitlines()
    events = next(line.split()[1:] for line in lines if line.startswith("events:"))
    totals = next(line.split()[1:] for line in lines if line.startswith("summary:"))
    return dict(zip(events, map(int, totals), strict=True))


def run(side: str, trips: int, out: str) -> dict[str, int]:
    """One run of ``trips`` round trips with ``side`` traced; its totals."""
    os.environ["VALGRIND_OPTS"] = CACHES  # valgrind reads it: the worker's and the coordinator's wrap get it too
    os.environ["PYTHONHASHSEED"] = "0"
    if side == "client":
        argv = [sys.executable, str(h.BENCH / "client_turn.py"), "--child", "--trips", str(trips), "--store", "memory"]
        env = {**os.environ, "PYTHONPATH": str(h.ROOT)}
        subprocess.run(["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}", *argv], env=env,
                       cwd=h.ROOT, capture_output=True, check=True)  # fmt: skip
    else:
        import worker_turn

        worker_turn.callgrind_count(trips, 100, "memory", out, side)
    return counts(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--side", choices=("client", "worker", "coordinator"), default="coordinator")
    parser.add_argument("--trips", type=int, default=400, help="round trips of the larger run (default 400)")
    ns = parser.parse_args(argv)
    small = ns.trips // 4
    with tempfile.TemporaryDirectory() as tmp:
        low, high = (run(ns.side, n, os.path.join(tmp, f"cg.{n}")) for n in (small, ns.trips))
    per = {event: round((high[event] - low[event]) / (ns.trips - small)) for event in low}
    print(json.dumps({"bench": "lone_icache", "tree": str(h.ROOT), "side": ns.side, "a_round_trip": per}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
