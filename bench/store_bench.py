"""What durability costs: the SQLite store alone, then end to end against the memory store.

Part 1 (the store alone, in this process): N plans' records as the core emits them, four steps
per plan (submit, lease, accept, done: a PlanCreated or an event, plus the plan's status), written
two ways into a fresh SQLite file (WAL, synchronous=FULL):

* ``fsync per step``: one transaction per step, what a store without group commit would do;
* ``group commit``: through ``GroupCommitter``, the coordinator's writer thread, with every step
  submitted as fast as a busy coordinator would; each transaction takes every batch that queued
  up during the previous fsync.

Part 2 (end to end, real processes): ``bench/throughput.py`` with ``--store memory`` and
``--store sqlite`` in the same run: plans/s of no-op plans through a coordinator and workers.

    python bench/store_bench.py                    # 20,000 plans in part 1, 5,000 in part 2
    python bench/store_bench.py --plans 2000 --e2e-plans 1000 --json
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import _harness as h
import throughput

sys.path.insert(0, str(h.ROOT))

from coordinator.io.stores.commit import GroupCommitter
from coordinator.io.stores.sqlite import SQLiteStore
from coordinator.records import PlanCreated, PlanStatus, Record
from protocol.messages import Event, Submit


def plan_steps(n: int) -> list[list[Record]]:
    """The four batches of records one plan produces, as the core's journal would."""
    pid = f"plan-{n:08d}"
    submit = Submit(req_id=n, op="echo", args={"n": n}, plan_id=pid)
    ev = [Event(plan_id=pid, kind=k, data={"worker_id": "w1", "attempt": 1}, seq=s, attempt=1)
          for s, k in enumerate(("queued", "leased", "running", "succeeded"), start=1)]  # fmt: skip
    return [
        [PlanCreated(pid, "bench", n, submit), ev[0], PlanStatus(pid, "queued", next_seq=2)],
        [ev[1], PlanStatus(pid, "leased", attempt=1, worker_id="w1", next_seq=3)],
        [ev[2], PlanStatus(pid, "running", attempt=1, worker_id="w1", next_seq=4)],
        [ev[3], PlanStatus(pid, "succeeded", attempt=1, worker_id="w1", next_seq=5, result={"n": n})],
    ]


def fsync_per_step(plans: int, directory: Path) -> dict[str, Any]:
    store = SQLiteStore(directory / "per-step.sqlite3")
    steps = [batch for n in range(plans) for batch in plan_steps(n)]
    t0 = time.perf_counter()
    for batch in steps:
        store.write(batch)
    elapsed = time.perf_counter() - t0
    store.close()
    return {"plans_per_s": round(plans / elapsed, 1), "transactions": len(steps), "elapsed_s": round(elapsed, 3)}


async def group_commit(plans: int, directory: Path, store: Any = None) -> dict[str, Any]:
    """Group-commit ``plans`` plans' steps into ``store`` (default: a fresh SQLite file in ``directory``)."""
    store = store if store is not None else SQLiteStore(directory / "group.sqlite3")
    released = 0
    done = asyncio.Event()
    total = plans * 4

    def release(_: Any) -> None:
        nonlocal released
        released += 1
        if released == total:
            done.set()

    committer: GroupCommitter[Any] = GroupCommitter(store, release, lambda exc: print(f"store failed: {exc}"))
    committer.start()
    steps = [plan_steps(n) for n in range(plans)]
    t0 = time.perf_counter()
    # Step k of every plan is submitted in one loop turn per 500 plans, as many concurrent plans would.
    for k in range(4):
        for start in range(0, plans, 500):
            for n in range(start, min(plans, start + 500)):
                committer.submit(steps[n][k], None)
            await asyncio.sleep(0)
    await asyncio.wait_for(done.wait(), 600)
    elapsed = time.perf_counter() - t0
    await committer.close()
    store.close()
    return {
        "plans_per_s": round(plans / elapsed, 1),
        "transactions": committer.transactions,
        "batches_per_transaction": round(committer.batches / max(1, committer.transactions), 1),
        "elapsed_s": round(elapsed, 3),
    }


async def main_async(ns: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="fleetwire-store-bench-") as tmp:
        per_step = fsync_per_step(min(ns.plans, ns.per_step_plans), Path(tmp))
        grouped = await group_commit(ns.plans, Path(tmp))
    e2e: dict[str, Any] = {}
    if ns.e2e_plans > 0:
        for store in ("memory", "sqlite"):
            r = await throughput.measure(ns.e2e_plans, 2, 1000, store, 5000, None)
            e2e[store] = {"plans_per_s": r["plans_per_s"], "store_used": r["store_used"], "failed": r["failed"],
                          "coordinator_cpu_us_per_plan": r["cpu_us_per_plan"].get("coordinator")}  # fmt: skip
    return {
        "bench": "store",
        "plans": ns.plans,
        "fsync_per_step": per_step,
        "group_commit": grouped,
        "end_to_end": e2e,
        "machine": h.machine(),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--plans", type=int, default=20_000, help="plans written in part 1 (default 20000)")
    parser.add_argument("--per-step-plans", type=int, default=2_000,
                        help="at most this many plans for the slow fsync-per-step case (default 2000)")
    parser.add_argument("--e2e-plans", type=int, default=5_000, help="plans per store in part 2; 0 skips it")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    ns = parser.parse_args(argv)
    result = h.run_loop(main_async(ns))
    per, grp = result["fsync_per_step"], result["group_commit"]
    lines = [
        f"fleetwire store: SQLite (WAL, synchronous=FULL), 4 steps per plan, {result['plans']} plans",
        f"  fsync per step : {per['plans_per_s']:>10,.0f} plans/s  ({per['transactions']} transactions)",
        f"  group commit   : {grp['plans_per_s']:>10,.0f} plans/s  ({grp['transactions']} transactions, "
        f"{grp['batches_per_transaction']} batches each)",
    ]
    for store, r in result["end_to_end"].items():
        lines.append(f"  end to end, {store:<6}: {r['plans_per_s']:>8,.0f} plans/s (store used: {r['store_used']}, "
                     f"failed {r['failed']})")
    h.emit(result, ns.json, lines)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
