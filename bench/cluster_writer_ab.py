"""One PostgreSQL coordinator with its group commits on the loop against the same in a writer process, interleaved.

    python bench/cluster_writer_ab.py --rounds 4 --plans 10000 --samples 500

Each round measures SQLite (the ratio's base), then one PostgreSQL coordinator with ``FLEETWIRE_PG_WRITER=loop`` and
with ``process`` (coordinator/io/stores/pg_writer.py), the two in alternating order, with bench/cluster_throughput.py's
``measure`` (a fresh database each, one PostgreSQL server for all). One JSON line per measurement: the load average
before it, plans/s, the p50 of ``--samples`` sequential round trips, the coordinator's CPU a plan (its own process)
and its writer child's (SQLite's or PostgreSQL's), the PostgreSQL server's. docs/PERFORMANCE.md §C29e.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
from typing import Any

import cluster_throughput as ct


async def run(ns: argparse.Namespace) -> None:
    modes = ["loop", "process"]
    with ct.postgres_server() as server:
        for r in range(ns.rounds):
            for mode in ["sqlite", *(modes if r % 2 == 0 else modes[::-1])]:
                os.environ["FLEETWIRE_PG_WRITER"] = mode
                load = os.getloadavg()[0]
                pg = mode != "sqlite"
                res: dict[str, Any] = await ct.measure(server.new_database() if pg else "sqlite", 1, ns,
                                                       server if pg else None)  # fmt: skip
                print(json.dumps({"round": r + 1, "store": f"pg-{mode}" if pg else "sqlite", "load": round(load, 2),
                                  "plans_per_s": res.get("plans_per_s"), "p50_ms": res.get("latency", {}).get("p50_ms"),
                                  "coordinator_us": res.get("coordinator_cpu_us_per_plan"),
                                  "child_us": res.get("writer_child_cpu_us_per_plan"),
                                  "postgres_us": res.get("postgres_cpu_us_per_plan"), "failed": res.get("failed"),
                                  "error": res.get("error")}), flush=True)  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--plans", type=int, default=10_000)
    parser.add_argument("--samples", type=int, default=500)
    parser.add_argument("--warmup", type=int, default=100)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--max-concurrency", type=int, default=1000)
    parser.add_argument("--chunk", type=int, default=5000)
    parser.add_argument("--timeout", type=float, default=120.0)
    parser.add_argument("--profile", metavar="DIR", help="py-spy the coordinators (bench/profile_top.py reads them)")
    asyncio.run(run(parser.parse_args()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
