"""The SQLite store's writer alone: CPU per plan of ``SQLiteStore.write`` on realistic groups.

The records of N plans as the coordinator's core emits them for a no-op plan that waited in
the queue (a ``PlanCreated``; the events ``queued``, ``waiting``, ``leased``, ``running``,
``succeeded``; a status per step: 10 records per plan), spread over groups the way a busy
coordinator's group commit sees them: a plan is created in one group, leased in the next,
and runs and ends in the one after. Each group is one ``write`` (one transaction and fsync)
into a fresh file. Reports the writer's CPU (``time.thread_time``) and wall time per plan,
the time to ``load`` the file back, and the file's size per plan; the best of ``--repeat``.
The garbage collector runs with the coordinator daemon's thresholds.

    python bench/store_writer.py                  # 20,000 plans, groups of 900 new plans
    python bench/store_writer.py --plans 2000 --json

To compare two versions of the store, run it from each tree (``cd TREE && python
bench/store_writer.py``): it imports the store of the tree it is in.
"""

from __future__ import annotations

import argparse
import gc
import json
import sqlite3
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from coordinator.io.store import SQLiteStore
from coordinator.records import PlanCreated, PlanStatus, Record
from fleetwire.cli import DAEMON_GC_THRESHOLDS
from protocol.messages import Event, Submit

WAITING = "all matching workers are at capacity"


def plan_steps(n: int, plan_id: str) -> list[list[Record]]:
    """The three groups' records of one plan: submit (queued, waiting), lease, run and end."""
    worker = f"w{n % 2}"
    data = {"worker_id": worker, "attempt": 1}
    submit = Submit(req_id=n, op="echo", args={"n": n}, plan_id=plan_id)
    return [
        [PlanCreated(plan_id, "bench", n, submit), Event(plan_id=plan_id, kind="queued", data={}, seq=1),
         Event(plan_id=plan_id, kind="waiting", data={"reason": WAITING}, seq=2),
         PlanStatus(plan_id, "queued", next_seq=3, waiting_reason=WAITING)],
        [Event(plan_id=plan_id, kind="leased", data=data, seq=3, attempt=1),
         PlanStatus(plan_id, "leased", 1, worker, next_seq=4)],
        [Event(plan_id=plan_id, kind="running", data=data, seq=4, attempt=1),
         PlanStatus(plan_id, "running", 1, worker, next_seq=5, worker_seq=(1, 2 * n)),
         Event(plan_id=plan_id, kind="succeeded", data={"result": {"n": n}, **data}, seq=5, attempt=1),
         PlanStatus(plan_id, "succeeded", 1, worker, next_seq=6, result={"n": n}, worker_seq=(1, 2 * n + 1))],
    ]  # fmt: skip


def groups_of(plans: int, per_group: int) -> list[list[Record]]:
    """Every plan's steps, plan ``i``'s first step in group ``i // per_group``, the next ones after."""
    groups: list[list[Record]] = [[] for _ in range(plans // per_group + 3)]
    for n in range(plans):
        for offset, step in enumerate(plan_steps(n, uuid.uuid4().hex)):
            groups[n // per_group + offset].extend(step)
    return [g for g in groups if g]


def measure(plans: int, per_group: int, repeat: int) -> dict[str, Any]:
    groups = groups_of(plans, per_group)
    gc.freeze()
    gc.set_threshold(*DAEMON_GC_THRESHOLDS)
    best: dict[str, float] = {}
    for _ in range(repeat):
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "bench.sqlite3"
            store = SQLiteStore(path)
            cpu0, wall0 = time.thread_time(), time.perf_counter()
            for group in groups:
                store.write(group)
            cpu, wall = time.thread_time() - cpu0, time.perf_counter() - wall0
            store.close()
            conn = sqlite3.connect(path)
            conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
            conn.close()
            size = path.stat().st_size
            store = SQLiteStore(path)
            load0 = time.perf_counter()
            loaded = store.load()
            load = time.perf_counter() - load0
            store.close()
        if len(loaded) != plans or any(len(p.events) != 5 for p in loaded):
            raise SystemExit("the store did not give every plan back with its 5 events")
        run = {"writer_cpu_us_per_plan": cpu / plans * 1e6, "writer_wall_us_per_plan": wall / plans * 1e6,
               "load_us_per_plan": load / plans * 1e6, "file_bytes_per_plan": size / plans}  # fmt: skip
        best = {k: min(v, best.get(k, v)) for k, v in run.items()}
    return {"bench": "store_writer", "plans": plans, "groups": len(groups),
            "records_per_plan": sum(map(len, groups)) / plans, **{k: round(v, 2) for k, v in best.items()}}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--plans", type=int, default=20_000, help="plans to write (default 20000)")
    parser.add_argument("--group", type=int, default=900, help="new plans per group (default 900)")
    parser.add_argument("--repeat", type=int, default=3, help="runs; the best is reported (default 3)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    result = measure(args.plans, args.group, args.repeat)
    if args.json:
        print(json.dumps(result, sort_keys=True))
    else:
        print(f"fleetwire store writer: {args.plans} plans, {result['groups']} groups, "
              f"{result['records_per_plan']:.0f} records per plan")  # fmt: skip
        print(f"  writer CPU {result['writer_cpu_us_per_plan']:.1f} µs per plan "
              f"(wall {result['writer_wall_us_per_plan']:.1f}); load {result['load_us_per_plan']:.1f} µs per plan; "
              f"file {result['file_bytes_per_plan']:.0f} bytes per plan")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
