"""What a durable round trip costs the coordinator, split: the store's commits, the sync, the rest.

Runs bench/latency.py (sequential submit -> result, real processes) several ways, alternating,
with a probe in the coordinator (bench/store_split_site/sitecustomize.py) that times every
commit (``SQLiteStore._write``: CPU of the committing thread, kernel time included, and wall):

* ``memory``: the memory store (no durability), the baseline;
* ``sqlite-nosync``: the SQLite store with ``PRAGMA synchronous=OFF`` (a measurement only: the
  same statements, no wait for the disk);
* ``sqlite``: the SQLite store (WAL, ``synchronous=FULL``), every commit in the coordinator
  (``--store-writer thread``, where the probe times it; the shipped default is ``sqlite-process``);
* with ``--modes``, also ``sqlite-inline`` (every lone commit on the event loop),
  ``sqlite-thread`` (every commit through the writer thread), ``sqlite-process``
  (``--store-writer process``: the busy groups sent by the loop to the writer process and
  committed there, which the probe does not time, and the coordinator's CPU leaves out the child's;
  a lone commit on the loop is still the coordinator's and timed: commits/trip is their share)
  and ``sqlite-process-thread`` (the same, every commit sent to the writer process: none timed).

For each: p50/p99, the coordinator's CPU per round trip (``/proc``), the store's share of it
(its commits), the rest, commits per round trip and their wall. Then the durable - memory
difference, split:

* the store's commits without the sync (SQLite's statements and the store's Python);
* the WAL sync in the committing thread (``sqlite`` - ``sqlite-nosync`` commit CPU: the kernel's
  write and flush);
* outside the store, from committing at all (``sqlite-nosync`` rest - ``memory`` rest: the
  deferred commit, the releases, the file checks, any hand-over to the writer thread);
* outside the store, from waiting for the disk (``sqlite`` rest - ``sqlite-nosync`` rest).

    python bench/store_split.py                       # 2,000 round trips each way, 2 rounds
    python bench/store_split.py --samples 1000 --rounds 1 --modes memory,sqlite-nosync,sqlite,sqlite-thread
    python bench/store_split.py --commit inline      # every SQLite commit on the loop: no cool-down, no hand-over
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import _harness as h

MODES: dict[str, tuple[str, dict[str, str]]] = {
    "memory": ("memory", {}),
    "sqlite-nosync": ("sqlite", {"FW_STORE_SPLIT_SYNC": "OFF"}),
    "sqlite": ("sqlite", {}),
    "sqlite-inline": ("sqlite", {"FW_STORE_SPLIT_COMMIT": "inline"}),
    "sqlite-thread": ("sqlite", {"FW_STORE_SPLIT_COMMIT": "thread"}),
    # --store-writer process: the commits in the writer process; the probe times each round trip to it.
    "sqlite-process": ("sqlite", {"FW_STORE_SPLIT_WRITER": "process"}),
    "sqlite-process-thread": ("sqlite", {"FW_STORE_SPLIT_WRITER": "process", "FW_STORE_SPLIT_COMMIT": "thread"}),
}
SITE = Path(__file__).resolve().parent / "store_split_site"


def one(mode: str, samples: int, warmup: int, commit: str = "adaptive") -> dict[str, Any]:
    """One bench/latency.py run in ``mode``: its figures and the probe's sums, per round trip.

    ``commit``: ``inline`` or ``thread`` forces that path for every SQLite mode (``adaptive``: as shipped).
    """
    store, extra = MODES[mode]
    if store == "sqlite" and commit != "adaptive" and "FW_STORE_SPLIT_COMMIT" not in extra:
        extra = {**extra, "FW_STORE_SPLIT_COMMIT": commit}
    # The probe times the coordinator's commits: every SQLite mode but the process ones commits in the coordinator
    # (``--store-writer thread``), whatever the coordinator's default.
    writer_mode = extra.get("FW_STORE_SPLIT_WRITER", "thread")
    writer = ["--coordinator-args", f"--store-writer {writer_mode}"] if store == "sqlite" else []
    with tempfile.TemporaryDirectory(prefix="fw-split-") as tmp:
        out = Path(tmp) / "probe.json"
        env = {**os.environ, **extra, "FW_STORE_SPLIT_OUT": str(out),
               "PYTHONPATH": os.pathsep.join(p for p in (str(SITE), os.environ.get("PYTHONPATH", "")) if p)}
        proc = subprocess.run([sys.executable, str(h.BENCH / "latency.py"), "--samples", str(samples), "--warmup",
                               str(warmup), "--store", store, "--json",
                               *writer], capture_output=True, text=True, env=env, cwd=h.ROOT, check=False)  # fmt: skip
        lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
        if proc.returncode != 0 or not lines:
            raise SystemExit(f"{mode}: bench/latency.py failed: {proc.stderr.strip()[-400:]}")
        result = json.loads(lines[-1])
        probe = json.loads(out.read_text()) if out.exists() else {}
    trips = samples + warmup  # the probe counts the warm-up's commits too
    commits = sum(s["commits"] for s in probe.values())
    store_cpu = sum(s["cpu_s"] for s in probe.values()) / trips * 1e6
    coordinator = result["cpu_us_per_plan"]["coordinator"]
    return {
        "p50_ms": result["p50_ms"],
        "p99_ms": result["p99_ms"],
        "coordinator_cpu_us": coordinator,
        "store_cpu_us": round(store_cpu, 1),
        "rest_cpu_us": round(coordinator - store_cpu, 1),
        "commits_per_trip": round(commits / trips, 2),
        "commit_wall_us": round(sum(s["wall_s"] for s in probe.values()) / commits * 1e6, 1) if commits else 0.0,
        "on_loop": round(probe.get("loop", {}).get("commits", 0) / commits, 2) if commits else 0.0,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=2000, help="timed round trips per run (default 2000)")
    parser.add_argument("--warmup", type=int, default=200, help="untimed round trips first (default 200)")
    parser.add_argument("--rounds", type=int, default=2, help="runs of every mode, alternating; medians reported")
    parser.add_argument("--modes", default="memory,sqlite-nosync,sqlite", help=f"of {', '.join(MODES)}")
    parser.add_argument("--commit", choices=("adaptive", "inline", "thread"), default="adaptive",
                        help="the commit path of every SQLite mode: as shipped (adaptive: on the loop while the "
                             "writer is idle and commits are fast), always on the loop, or always the writer thread")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    ns = parser.parse_args(argv)
    modes = ns.modes.split(",")
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        parser.error(f"unknown mode(s) {', '.join(unknown)}: use {', '.join(MODES)}")
    runs: dict[str, list[dict[str, Any]]] = {m: [] for m in modes}
    for _ in range(ns.rounds):
        for mode in modes:
            runs[mode].append(one(mode, ns.samples, ns.warmup, ns.commit))
    table = {m: {k: round(statistics.median(r[k] for r in rs), 3) for k in rs[0]} for m, rs in runs.items()}
    split: dict[str, float] = {}
    if {"memory", "sqlite-nosync", "sqlite"} <= set(table):
        mem, off, full = table["memory"], table["sqlite-nosync"], table["sqlite"]
        split = {
            "durable_minus_memory_cpu_us": round(full["coordinator_cpu_us"] - mem["coordinator_cpu_us"], 1),
            "commits_without_sync_us": off["store_cpu_us"],
            "wal_sync_in_committing_thread_us": round(full["store_cpu_us"] - off["store_cpu_us"], 1),
            "outside_store_committing_us": round(off["rest_cpu_us"] - mem["rest_cpu_us"], 1),
            "outside_store_waiting_for_disk_us": round(full["rest_cpu_us"] - off["rest_cpu_us"], 1),
        }
    if ns.json:
        print(json.dumps({"bench": "store_split", "samples": ns.samples, "rounds": ns.rounds, "commit": ns.commit,
                          "modes": table,
                          "split": split, "runs": runs, "machine": h.machine()}, sort_keys=True))  # fmt: skip
        return 0
    print(f"durable round trip, coordinator CPU per round trip (µs); medians of {ns.rounds} alternating runs of "
          f"{ns.samples} sequential round trips each; commit path {ns.commit}; {h.machine().get('cpus')} CPUs")
    print("| mode | p50 ms | p99 ms | coordinator CPU | in commits | rest | commits/trip | commit wall µs | on loop |")
    print("|---|---|---|---|---|---|---|---|---|")
    for mode, t in table.items():
        print(f"| {mode} | {t['p50_ms']:.3f} | {t['p99_ms']:.3f} | {t['coordinator_cpu_us']:.0f} | "
              f"{t['store_cpu_us']:.0f} | {t['rest_cpu_us']:.0f} | {t['commits_per_trip']:.2f} | "
              f"{t['commit_wall_us']:.0f} | {t['on_loop']:.0%} |")
    if split:
        print(f"\ndurable - memory: {split['durable_minus_memory_cpu_us']:.0f} µs of coordinator CPU per round trip =")
        print(f"  {split['commits_without_sync_us']:.0f}  the commits without the sync "
              "(SQLite statements, store Python)")
        print(f"  {split['wal_sync_in_committing_thread_us']:.0f}  the WAL sync in the committing thread "
              "(kernel write + flush)")
        print(f"  {split['outside_store_committing_us']:.0f}  outside the store, from committing at all "
              "(deferred commit, releases, file checks, hand-overs)")
        print(f"  {split['outside_store_waiting_for_disk_us']:.0f}  outside the store, from waiting for the disk "
              "(the loop sleeps in fdatasync and wakes cold)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
