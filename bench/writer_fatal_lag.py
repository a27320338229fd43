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
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from coordinator.io.stores.sqlite import SQLiteStore
from coordinator.io.stores.store import DB_FILE
from tests.integration.test_store_writer_process import plan, ready_child, released, started

ENDS = ("kill", "stop", "stop-unkillable", "linger")
LINGERING_CHILD = textwrap.dedent("""
    import os, runpy, signal, time
    def close_and_linger(signum, frame):
        os.closerange(0, 2)
        os.closerange(3, 4096)
        time.sleep(3)
        os._exit(0)
    signal.signal(signal.SIGUSR1, close_and_linger)
    runpy.run_module("coordinator.io.stores.writer_child", run_name="__main__", alter_sys=True)
""")


class Lag:
    """A 5 ms timer on the running loop: the most it ran late."""

    def __init__(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.worst_s, self.on = 0.0, True
        self.due = self.loop.time() + 0.005
        self.loop.call_at(self.due, self.tick)

    def tick(self) -> None:
        self.worst_s = max(self.worst_s, self.loop.time() - self.due)
        if self.on:
            self.due = self.loop.time() + 0.005
            self.loop.call_at(self.due, self.tick)


def _open(path: Path, end: str) -> SQLiteStore:
    store = SQLiteStore(path)
    if end != "linger":
        store.hand_writes_to_process()
        return store
    popen = subprocess.Popen

    def lingering(args: list[str], **options: Any) -> subprocess.Popen[bytes]:
        return popen([args[0], "-c", LINGERING_CHILD, *args[3:]], **options)

    subprocess.Popen = lingering  # type: ignore[assignment,misc]
    try:
        store.hand_writes_to_process()
    finally:
        subprocess.Popen = popen  # type: ignore[assignment,misc]
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
        lag = Lag()
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
        lag.on = False
        await committer.close()
        if end == "stop-unkillable":
            os.kill(child.pid, signal.SIGKILL)
        await asyncio.to_thread(store.close)
        return f"{end:>16}: lag {lag.worst_s * 1000:7.1f} ms, failed after {failed_s:.2f} s: {seen.errors[0]}"


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
