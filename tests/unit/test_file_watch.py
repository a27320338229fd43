"""The store's FileWatch (coordinator/io/stores/integrity.py): no descriptor outlives close(), and what it reports.

``problem()`` arms what the open did not find yet, on whichever thread checks (the loop's committer,
the writer thread whose write failed), while ``close()`` may run on another. The arm's window (the
``-wal`` opened, its descriptor not yet kept) is taken here deterministically: ``os.fstat`` closes
the watch as the arm reaches it. A ``-shm`` deleted under a running store is made anew by the next
connection of another process (the store's writer process): the report says so, not "replaced".
"""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from coordinator.io.stores.integrity import FileWatch


def open_descriptors_of(path: Path) -> list[int]:
    """This process's descriptors open on ``path``."""
    found = []
    for name in os.listdir("/proc/self/fd"):
        with_target = f"/proc/self/fd/{name}"
        try:
            if os.readlink(with_target) == str(path):
                found.append(int(name))
        except OSError:
            continue
    return found


def sidecars(tmp_path: Path) -> tuple[Path, Path, Path]:
    db = tmp_path / "fleetwire.db"
    wal, shm = tmp_path / "fleetwire.db-wal", tmp_path / "fleetwire.db-shm"
    for p in (db, wal, shm):
        p.write_bytes(b"")
    return db, wal, shm


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="reads /proc/self/fd")
def test_a_close_while_the_watch_arms_leaves_no_descriptor(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """close() lands after the arm opened the -wal and before it kept the descriptor: the arm closes it.

    Before, close() found no descriptor yet, and the arm then kept the one it had opened: the -wal
    stayed open after the store closed (one descriptor leaked per store)."""
    db, wal, _shm = sidecars(tmp_path)
    watch = FileWatch(db)
    real_fstat = os.fstat

    def fstat_as_the_store_closes(fd: int) -> os.stat_result:
        if os.readlink(f"/proc/self/fd/{fd}") == str(wal):
            watch.close()  # the other thread's close, in the window
        return real_fstat(fd)

    monkeypatch.setattr(os, "fstat", fstat_as_the_store_closes)
    assert watch.problem() is None  # arms the -wal (the open did not find it)
    monkeypatch.undo()
    assert open_descriptors_of(wal) == []


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="reads /proc/self/fd")
def test_a_check_after_close_opens_nothing(tmp_path: Path) -> None:
    """A commit's check that runs after the store closed does not arm (open) the -wal any more."""
    db = tmp_path / "fleetwire.db"
    db.write_bytes(b"")
    watch = FileWatch(db)
    watch.close()
    wal = tmp_path / "fleetwire.db-wal"
    wal.write_bytes(b"")  # SQLite made it after the open: the next check would arm it
    assert watch.problem() is None
    assert open_descriptors_of(wal) == []


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="reads /proc/self/fd")
def test_two_arms_at_once_keep_one_descriptor(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two threads arm at once (the second inside the first's window): one descriptor is kept, and close() closes it."""
    db, wal, _shm = sidecars(tmp_path)
    watch = FileWatch(db)
    real_fstat = os.fstat
    nested = []

    def fstat_with_another_arm(fd: int) -> os.stat_result:
        if not nested and os.readlink(f"/proc/self/fd/{fd}") == str(wal):
            nested.append(fd)
            watch.arm()
        return real_fstat(fd)

    monkeypatch.setattr(os, "fstat", fstat_with_another_arm)
    watch.arm()
    monkeypatch.undo()
    assert len(open_descriptors_of(wal)) == 1
    watch.close()
    assert open_descriptors_of(wal) == []


def test_a_shm_made_anew_by_another_process_is_reported_as_deleted(tmp_path: Path) -> None:
    """The -shm deleted under an open store, then a connection of another process opens the database: SQLite
    makes a new -shm at its name. The report names the deletion and who made the new file (before: "was
    replaced while the coordinator was running", as if somebody had put another file there)."""
    db = tmp_path / "fleetwire.db"
    conn = sqlite3.connect(db)
    try:
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("CREATE TABLE t (x)")
        conn.execute("INSERT INTO t VALUES (1)")
        conn.commit()
        watch = FileWatch(db)
        watch.arm()
        shm = tmp_path / "fleetwire.db-shm"
        before = shm.stat().st_ino
        shm.unlink()
        assert watch.problem() == f"{shm} was deleted while the coordinator was running"
        reader = f"import sqlite3; sqlite3.connect({str(db)!r}).execute('SELECT count(*) FROM t').fetchone()"
        subprocess.run([sys.executable, "-c", reader], check=True, timeout=60)
        assert shm.stat().st_ino != before  # SQLite's own: the other process's connection made it
        problem = watch.problem()
        assert problem is not None and problem.startswith(f"{shm} was deleted while the coordinator was running")
        assert "a new file was made at its name" in problem and "replaced" not in problem
        watch.close()
    finally:
        conn.close()
