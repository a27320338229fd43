"""The event loop's lag while the SQLite writer process dies: the most a 5 ms timer ran late (docs/PERFORMANCE.md §R29).

A committer sends every group to the writer process (``inline_max_records=0``, reply timeout 0.3 s), four
plans are committed, then the child meets its end while a group is submitted every 2 ms, until the store
fails. Four ends:

* ``kill``: SIGKILL;
* ``stop``: SIGSTOP (the reply timeout finds it stuck; its SIGKILL ends it at once);
* ``stop-unkillable``: SIGSTOP, and its SIGKILL has no effect (``Popen.kill`` made a no-op: a child in
  uninterruptible sleep, a disk that does not answer, ends only when the disk does);
* ``linger``: the child closes its pipes and exits 3 s later (its own program replaced by a shim).

Prints each end's lag, the seconds until the store failed, and the error. Wall-clock figures: run old and
new trees in the same minute (``cd TREE && python bench/writer_fatal_lag.py``) and give the load average.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from coordinator.io.stores.sqlite import SQLiteStore
from coordinator.io.stores.store import DB_FILE
from tests.integration.test_store_writer_process import plan, ready_child, released, started
from tests.integration.test_writer_fatal_paths import hand_writes_to_lingering_child
from tests.waiting import LagProbe

ENDS = ("kill", "stop", "stop-unkillable", "linger")


def _open(path: Path, end: str) -> SQLiteStore:
    store = SQLiteStore(path)
    if end != "linger":
        store.hand_writes_to_process()
        return store
    with pytest.MonkeyPatch.context() as patched:
        hand_writes_to_lingering_child(store, patched)
    return store


async def one(end: str) -> str:
    with tempfile.TemporaryDirectory() as tmp:
        store = _open(Path(tmp) / DB_FILE, end)
        seen, committer = started(store, inline_max_records=0)
        child = ready_child(store)
        child.reply_timeout_s = 0.3
        for n in range(1, 5):
            committer.submit(plan(f"p{n}", n), n)
        await released(seen, 4)
        lag = LagProbe()
        if end == "stop-unkillable":
            child.process.kill = lambda: None  # type: ignore[method-assign]
        signals = {"kill": signal.SIGKILL, "linger": signal.SIGUSR1}
        os.kill(child.pid, signals.get(end, signal.SIGSTOP))
        began = time.monotonic()
        n = 5
        while not seen.failed.is_set():
            committer.submit(plan(f"p{n}", n), n)
            n += 1
            await asyncio.sleep(0.002)
        failed_s = time.monotonic() - began
        await asyncio.sleep(0.1)
        worst_s = lag.stop()
        await committer.close()
        if end == "stop-unkillable":
            os.kill(child.pid, signal.SIGKILL)
        await asyncio.to_thread(store.close)
        return f"{end:>16}: lag {worst_s * 1000:7.1f} ms, failed after {failed_s:.2f} s: {seen.errors[0]}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("ends", nargs="*", metavar="END", help=f"of {', '.join(ENDS)} (default: all)")
    ends = parser.parse_args().ends or ENDS
    if set(ends) - set(ENDS):
        parser.error(f"unknown end: {', '.join(sorted(set(ends) - set(ENDS)))}")
    for end in ends:
        print(asyncio.run(one(end)), flush=True)


if __name__ == "__main__":
    main()
