"""bench/store_split.py's probe inside the coordinator it starts (imported at interpreter start-up).

Only in a ``python -m fleetwire coordinator`` process, and only with ``FW_STORE_SPLIT_OUT`` set
(bench/store_split.py sets it; ``_harness.bench_env`` passes it on, it drops only ``FLEETWIRE_*``):

* every ``SQLiteStore._write`` (one commit) is timed: ``time.thread_time`` (the committing
  thread's user + kernel CPU, the WAL's ``fdatasync`` included) and wall, by thread (the event
  loop's inline commits, the writer thread's);
* ``FW_STORE_SPLIT_SYNC=OFF``: the store runs with ``PRAGMA synchronous=OFF`` (no WAL sync: what a
  commit costs without waiting for the disk; never durable: a measurement only);
* ``FW_STORE_SPLIT_COMMIT=inline|thread``: every lone commit on the loop (no slow-disk cool-down),
  or every commit through the writer thread (``inline_max_records=0``);
* with ``--store-writer process``, the commits on the loop are still ``_write`` (the coordinator's
  own connection); a waiting round trip to the writer process (``_write_in_child``) is timed too,
  a group sent to it is not;
* at exit, the sums go to ``FW_STORE_SPLIT_OUT`` as JSON.
"""

from __future__ import annotations

import os
import sys

_OUT = os.environ.get("FW_STORE_SPLIT_OUT")
if _OUT and "fleetwire" in sys.orig_argv and "coordinator" in sys.orig_argv:
    import atexit
    import json
    import threading
    import time
    from typing import Any

    from coordinator.io.stores import commit as _commit
    from coordinator.io.stores import sqlite as _sqlite

    _sums: dict[str, dict[str, float]] = {}
    _write = _sqlite.SQLiteStore._write
    _write_in_child = _sqlite.SQLiteStore._write_in_child
    _open = _sqlite.SQLiteStore._open
    _init = _commit.GroupCommitter.__init__

    def _timed_write(self: Any, records: Any, *, wait: bool, write: Any = _write) -> bool:
        cpu0, wall0 = time.thread_time(), time.perf_counter()
        done = write(self, records, wait=wait)
        cpu, wall = time.thread_time() - cpu0, time.perf_counter() - wall0
        where = "loop" if threading.current_thread() is threading.main_thread() else "thread"
        s = _sums.setdefault(where, {"commits": 0, "records": 0, "cpu_s": 0.0, "wall_s": 0.0})
        s["commits"] += 1
        s["records"] += len(records)
        s["cpu_s"] += cpu
        s["wall_s"] += wall
        return done

    def _timed_write_in_child(self: Any, child: Any, records: Any, *, wait: bool) -> bool:
        return _timed_write(self, records, wait=wait, write=lambda s, r, wait: _write_in_child(s, child, r, wait=wait))

    def _open_unsynced(self: Any) -> None:
        _open(self)
        self._db.execute("PRAGMA synchronous=OFF")

    def _init_mode(self: Any, *args: Any, **kwargs: Any) -> None:
        mode = os.environ.get("FW_STORE_SPLIT_COMMIT")
        if mode == "inline":
            kwargs["inline_slow_s"] = float("inf")
        elif mode == "thread":
            kwargs["inline_max_records"] = 0
        _init(self, *args, **kwargs)

    def _dump() -> None:
        with open(str(_OUT), "w") as fh:
            json.dump(_sums, fh)

    _sqlite.SQLiteStore._write = _timed_write  # type: ignore[method-assign]
    _sqlite.SQLiteStore._write_in_child = _timed_write_in_child  # type: ignore[method-assign]
    if os.environ.get("FW_STORE_SPLIT_SYNC") == "OFF":
        _sqlite.SQLiteStore._open = _open_unsynced  # type: ignore[method-assign]
    _commit.GroupCommitter.__init__ = _init_mode  # type: ignore[method-assign]
    atexit.register(_dump)
