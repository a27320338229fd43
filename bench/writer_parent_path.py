"""The SQLite writer process's parent side on the event loop: callgrind instructions per group.

What the coordinator's loop does for one group sent to the writer process and answered
(coordinator/io/stores/writer_process.py served on the loop: ``send`` encodes and writes the
request, the pipe's reader reads the reply, applies its keys and answers the group), one group
of one plan's four records at a time, each awaited. callgrind counts the parent only (the child
is not traced); the difference of a run of 600 groups and one of 100, divided by 500, cancels
the start-up. Machine load hardly moves the figure (it needs valgrind).

    python bench/writer_parent_path.py                      # this tree
    python bench/writer_parent_path.py --compare /tmp/wt    # and another tree, side by side
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._harness import callgrind_total

SMALL, LARGE = 100, 600


def _groups(count: int) -> None:
    """``count`` groups through a writer process, one at a time (the run callgrind counts)."""
    from coordinator.io.stores.sqlite import SQLiteStore
    from coordinator.records import PlanCreated, PlanStatus, Record
    from protocol.messages import Event, Submit

    async def main(store: SQLiteStore) -> None:
        answered = asyncio.Event()
        store.serve_on(asyncio.get_running_loop(), answered.set)
        for n in range(count):
            plan_id = f"plan-{n:08d}"
            records: list[Record] = [
                PlanCreated(plan_id, "bench", n, Submit(req_id=n, op="echo", args=n, plan_id=plan_id)),
                Event(plan_id=plan_id, kind="queued", data={}, seq=1),
                Event(plan_id=plan_id, kind="leased", data={"worker_id": "w1"}, seq=2, attempt=1),
                PlanStatus(plan_id, "leased", 1, "w1", next_seq=3),
            ]
            answered.clear()
            store.send(records, lambda error: None if error is None else sys.exit(f"failed: {error}"))
            await answered.wait()
        store.leave_loop()

    with tempfile.TemporaryDirectory() as tmp:
        store = SQLiteStore(Path(tmp) / "bench.sqlite3")
        store.hand_writes_to_process()
        writer = store._child
        assert writer is not None
        writer.wait_ready()
        try:
            asyncio.run(main(store))
        finally:
            store.close()


def per_group(tree: str) -> float:
    """Instructions per group of the parent's path, in ``tree``."""
    script = str(Path(tree) / "bench" / "writer_parent_path.py")
    with tempfile.TemporaryDirectory() as tmp:
        small = callgrind_total(tree, [script, "--groups", str(SMALL)], f"{tmp}/small.out")
        large = callgrind_total(tree, [script, "--groups", str(LARGE)], f"{tmp}/large.out")
    return (large - small) / (LARGE - SMALL)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--compare", metavar="TREE", help="another tree (a worktree of an older commit)")
    parser.add_argument("--groups", type=int, help=argparse.SUPPRESS)  # one counted run
    args = parser.parse_args()
    if args.groups is not None:
        _groups(args.groups)
        return
    here = str(Path(__file__).resolve().parent.parent)
    figures = [("this tree", here)] + ([("--compare", args.compare)] if args.compare else [])
    for name, tree in figures:
        print(f"{name:>10}: {per_group(tree):,.0f} instructions a group (the parent's path, callgrind)", flush=True)


if __name__ == "__main__":
    main()
