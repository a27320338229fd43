"""``fleetwire store check | backup | restore``: the SQLite store's offline and online maintenance.

* :func:`check_store`: ``PRAGMA quick_check`` (or the full ``integrity_check``), every record's
  checksum, the generation against its side file, and counts. Read-only: safe while a
  coordinator runs.
* :func:`backup_store`: ``VACUUM INTO`` a new file: a consistent, compact snapshot taken while
  the coordinator keeps writing (a reader in WAL mode never blocks the writer). The copy is
  checked before it is reported good.
* :func:`restore_store`: refuses while a coordinator holds the store's lock; sets the current
  database and its ``-wal``/``-shm`` aside (a stale ``-wal`` next to a restored file would be
  replayed into it), copies the backup in, and sets the generation side file to the backup's.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import sqlite3
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from coordinator.io.stores.integrity import (
    StoreError,
    marker_problem,
    quick_check,
    set_aside,
    sidecar_paths,
    write_generation,
)
from coordinator.io.stores.rows import SELECT_EVENTS, SELECT_PLANS, decode_plans
from coordinator.io.stores.schema import GENERATION, MIGRATIONS, SCHEMA_VERSION

__all__ = ["CheckReport", "backup_store", "check_store", "restore_store"]


@dataclass
class CheckReport:
    """What :func:`check_store` found.

    Attributes:
        path: the database checked.
        problems: one line per damage found; empty: the store is sound.
        notes: facts that are not damage (an older schema version, a missing side file).
        version: the file's schema version.
        generation: commits the database holds (None before version 4).
        acknowledged: commits the side file says were acknowledged (None: no side file).
        plans: sound plans by state.
        event_rows: rows of the events table.
    """

    path: Path
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    version: int = 0
    generation: int | None = None
    acknowledged: int | None = None
    plans: dict[str, int] = field(default_factory=dict)
    event_rows: int = 0

    @property
    def sound(self) -> bool:
        return not self.problems


def _read_marker(path: Path) -> int | None:
    try:
        text = path.with_name(path.name + ".generation").read_text(encoding="ascii", errors="replace").strip()
    except FileNotFoundError:
        return None
    return int(text) if text.isdigit() else None


def check_store(path: Path, *, full: bool = False, marker: bool = True) -> CheckReport:
    """Check the database ``path`` without changing it.

    Args:
        path: the database file.
        full: ``PRAGMA integrity_check`` (reads every page and index) instead of ``quick_check``.
        marker: compare with the generation side file (off for a backup, which has none).
    """
    report = CheckReport(path)
    if not path.is_file():
        report.problems.append(f"{path} does not exist")
        return report
    try:
        db = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    except sqlite3.Error as exc:
        report.problems.append(f"cannot open it: {exc}")
        return report
    try:
        _check(db, report, full=full, marker=marker)
    except sqlite3.Error as exc:
        report.problems.append(f"cannot read it: {exc}")
    finally:
        db.close()
    return report


def _check(db: sqlite3.Connection, report: CheckReport, *, full: bool, marker: bool) -> None:
    path = report.path
    report.version = db.execute("PRAGMA user_version").fetchone()[0]
    if full:
        found = [row[0] for row in db.execute("PRAGMA integrity_check(5)")]
        if found != ["ok"]:
            report.problems.append("SQLite integrity_check: " + "; ".join(map(str, found)))
    else:
        problem = quick_check(db)
        if problem is not None:
            report.problems.append(problem)
    if report.version != SCHEMA_VERSION:
        if report.version in MIGRATIONS:
            checksummed = " (and checksummed)" if report.version < 4 else ""
            report.notes.append(f"schema version {report.version}: migrated{checksummed} at the next start")
            for state, n in db.execute("SELECT state, count(*) FROM plans GROUP BY state"):
                report.plans[str(state)] = n
            if report.version >= 4:  # a count before version 6's row stamps: store_meta's alone
                report.generation = db.execute("SELECT generation FROM store_meta").fetchone()[0]
        else:
            report.problems.append(f"schema version {report.version} is not a fleetwire store this version reads")
        return
    plans, damaged = decode_plans(db.execute(SELECT_PLANS), db.execute(SELECT_EVENTS))
    report.problems.extend(damaged.values())
    report.plans = dict(Counter(p.status.state if p.status is not None else "queued" for p in plans))
    report.event_rows = db.execute("SELECT count(*) FROM events").fetchone()[0]
    report.generation = db.execute(GENERATION).fetchone()[0]
    if marker:
        report.acknowledged = _read_marker(path)
        problem = marker_problem(report.generation, report.acknowledged, path.name + ".generation")
        if problem is not None:  # the coordinator refuses to start on it alike (coordinator/io/stores/sqlite.py)
            report.problems.append(problem)
        elif report.acknowledged is None:
            report.notes.append("no generation side file: nothing to compare the database with")


def backup_store(path: Path, dest: Path) -> CheckReport:
    """Write a consistent copy of database ``path`` to ``dest`` (online) and check the copy.

    Raises:
        StoreError: ``path`` is missing, ``dest`` exists, or the copy cannot be written.
    """
    if not path.is_file():
        raise StoreError(f"no store at {path}: give its --data-dir or --store sqlite:PATH")
    if dest.exists():
        raise StoreError(f"{dest} already exists: give a new file name")
    dest.parent.mkdir(parents=True, exist_ok=True)
    try:
        db = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
        try:
            db.execute("VACUUM INTO ?", (str(dest),))
        finally:
            db.close()
        fd = os.open(dest, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except (OSError, sqlite3.Error) as exc:
        with contextlib.suppress(FileNotFoundError):
            dest.unlink()
        raise StoreError(f"cannot back up {path} to {dest}: {exc}") from exc
    return check_store(dest, marker=False)


def restore_store(src: Path, path: Path) -> tuple[CheckReport, Path | None]:
    """Put backup ``src`` in place of database ``path``; the backup's report and where the old files went.

    Raises:
        StoreError: a coordinator holds the store, or ``src`` is missing or damaged.
    """
    report = check_store(src, marker=False)
    if not report.sound:
        raise StoreError(f"the backup {src} is damaged ({report.problems[0]}); pick another backup")
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path.with_name(path.name + ".lock"), os.O_RDWR | os.O_CREAT, 0o600)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 64).decode(errors="replace").strip() or "?"
            raise StoreError(f"a coordinator (pid {holder}) is using {path}: stop it before restoring") from None
        present = [p for p in (path, *sidecar_paths(path)) if p.exists()]
        aside = set_aside(path, "before-restore") if present else None
        tmp = path.with_name(path.name + ".restoring")
        shutil.copyfile(src, tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
        dir_fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
        write_generation(path, report.generation or 0)
    except OSError as exc:
        raise StoreError(f"cannot restore {src} to {path}: {exc}") from exc
    finally:
        os.close(fd)  # releases the lock
    return report, aside

