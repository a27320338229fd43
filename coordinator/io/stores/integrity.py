"""How the SQLite store notices damage: its errors, the generation side file, the file watch and salvage.

Damage is never served silently (docs/OPERATIONS.md §Store integrity, backup and restore):

* every stored blob carries a checksum (``coordinator/io/stores/schema.py``), verified on load;
* ``PRAGMA quick_check`` runs at every open;
* :class:`GenerationMarker`: the number of committed groups, kept in the database *and* in a
  side file written after each commit. A database found behind its side file lost commits
  that were acknowledged (a truncated or deleted ``-wal``, an old copy put back). A database
  that holds commits but whose side file is missing, empty or unreadable is refused the same
  way (:func:`marker_problem`): without it nothing shows which commits were acknowledged, and a
  ``-wal`` cut with the side file gone would otherwise start silently, acknowledged plans lost
  and finished ones queued again. The side file is made durable (with its directory entry)
  when it is created, so a power cut cannot leave it missing next to a database with commits;
* :class:`FileWatch`: the committer stats the ``-wal`` and ``-shm`` files after a commit (at
  most every 10 ms, coordinator/io/stores/commit.py); one deleted or replaced under a running
  coordinator stops it (what it would acknowledge next could be lost at the next restart);
* :func:`readable_rows`: what can still be read from a damaged file, row by row, for
  ``--accept-store-loss``.

A damaged store raises :class:`StoreDamaged`, whose message is one line: the file, what is
wrong and what to do. The CLI prints it and exits :data:`EXIT_STORE_DAMAGED`.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import sqlite3
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Final, Protocol

import structlog

__all__ = [
    "EXIT_STORE_DAMAGED",
    "RECOVERY_HINT",
    "FileWatch",
    "GenerationMarker",
    "StoreDamaged",
    "StoreError",
    "StoreUnreachable",
    "iter_chunks",
    "marker_problem",
    "quick_check",
    "readable_rows",
    "report_accepted_losses",
    "set_aside",
    "sidecar_paths",
    "write_generation",
]

log = structlog.get_logger(__name__)

EXIT_STORE_DAMAGED: Final = 3
"""Exit status of ``fleetwire coordinator`` and ``fleetwire store check`` for a damaged store."""

RECOVERY_HINT: Final = (
    "restore a backup with `fleetwire store restore BACKUP`, or start from what is readable with "
    "--accept-store-loss (docs/OPERATIONS.md, Store integrity)"
)


class StoreError(ValueError):
    """A store cannot be opened or written; the message says what to do.

    A ``ValueError`` like the other configuration problems the CLI reports before it serves.
    """


class StoreUnreachable(StoreError):
    """The store's database cannot be reached now (refused, no answer, a login it cannot make yet).

    Not a configuration error that a restart cannot mend: a cluster coordinator that meets it at
    start waits for the database and retries (coordinator/io/cluster/host.py) rather than exit.
    """


class StoreDamaged(StoreError):
    """The store's files hold damage: the message names the file, what is wrong and what to do.

    Attributes:
        path: the database file.
        problem: what is wrong, without the advice.
    """

    def __init__(self, path: Path, problem: str) -> None:
        super().__init__(f"the store {path} is damaged: {problem}; {RECOVERY_HINT}")
        self.path = path
        self.problem = problem


class _Losses(Protocol):
    """``StoreAbilities`` as read here (abilities.py reaches this module through cluster/leases.py: no import back)."""

    @property
    def losses(self) -> Sequence[str]: ...


class _WithAbilities(Protocol):
    @property
    def abilities(self) -> _Losses: ...


def report_accepted_losses(store: _WithAbilities) -> int:
    """Log every loss ``--accept-store-loss`` accepted in ``store`` (one critical line each); their count.

    The server puts the count in ``fleetwire_store_loss_accepted_total``. The losses are the
    store's ``abilities.losses`` (coordinator/io/stores/abilities.py), read after its load.
    """
    losses = store.abilities.losses
    for line in losses:
        log.critical("store damage accepted (--accept-store-loss): starting without what was lost", loss=line)
    return len(losses)


def sidecar_paths(path: Path) -> tuple[Path, Path]:
    """The ``-wal`` and ``-shm`` files SQLite keeps next to database ``path``."""
    return path.with_name(path.name + "-wal"), path.with_name(path.name + "-shm")


def quick_check(db: sqlite3.Connection) -> str | None:
    """None when ``PRAGMA quick_check`` passes, else its first findings (one line)."""
    found = [row[0] for row in db.execute("PRAGMA quick_check(5)")]
    if found == ["ok"]:
        return None
    return "SQLite quick_check: " + "; ".join(str(f) for f in found)


class GenerationMarker:
    """The side file ``<db>.generation``: the last committed group's number, written after each commit.

    Outside the WAL on purpose: what damages or drops the WAL leaves this file ahead of the
    database. Written in place (a fixed-width line) after every commit, so a
    ``kill -9``, a deleted or truncated ``-wal`` or an old copy put back is always caught: the
    write is in the kernel's page cache before the commit's replies go out. It is fdatasync'ed
    at most every ``sync_interval_s``: a second fsync per commit cost ~0.25 ms on every
    round trip (two commits each: +0.5 ms p50 in bench/compare.py). Only a power cut can then
    leave the marker up to that long (and one fdatasync) behind, which hides (never invents)
    the loss of commits made in that last interval.

    That periodic fdatasync runs in a thread of its own (started at the first one due), not in
    the committing thread: an ``msync`` waits for the disk, and on the event loop (commit.py's
    inline commits) it stalled the loop 0.3-4 ms once a second on a shared disk, and counted in
    the inline commits' average that sends commits to the writer thread. A failed sync is raised
    by the next :meth:`write`.

    Args:
        path: the database file; the marker is ``<path>.generation``.
        sync_interval_s: the longest time between two fdatasyncs; 0: after every write, in
            the caller's thread.
    """

    WIDTH: Final = 20
    _LINE: Final = b"%020d\n"  # WIDTH digits and a newline: one bytes formatting per commit, no f-string

    def __init__(self, path: Path, *, sync_interval_s: float = 1.0) -> None:
        self.path = path.with_name(path.name + ".generation")
        self.sync_interval_s = sync_interval_s
        self.syncs = 0  # background fdatasyncs done
        self._synced_at = -float("inf")
        self._dirty = False
        self._due = threading.Event()  # a sync is due (set by write, taken by the syncer thread)
        self._stopping = False
        self._syncer: threading.Thread | None = None
        self._sync_error: OSError | None = None
        self._fd: int | None = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        self.was_missing = os.fstat(self._fd).st_size == 0  # created now (or found empty): nothing recorded
        if os.fstat(self._fd).st_size < self.WIDTH + 1:
            os.ftruncate(self._fd, self.WIDTH + 1)
        # Written through a shared mapping: the bytes are in the page cache at once (what a kill -9
        # leaves), with no system call per commit. A pwrite per commit updated the file's mtime
        # each time, which put its inode in every journal commit of the WAL's fsync: +0.17 ms p50.
        self._map: mmap.mmap | None = mmap.mmap(self._fd, self.WIDTH + 1)

    def read(self) -> int | None:
        """The generation recorded, or None when the file is new, empty or unreadable."""
        assert self._map is not None
        text = self._map[:].decode("ascii", errors="replace").strip("\x00 \n")
        return int(text) if text.isdigit() else None

    def write(self, generation: int) -> None:
        """Record ``generation`` (the database's, just committed).

        Raises:
            OSError: the last background fdatasync of the file failed.
        """
        assert self._map is not None
        if self._sync_error is not None:
            raise self._sync_error
        self._map[:] = self._LINE % generation
        self._dirty = True
        if not self.sync_interval_s:
            self._map.flush()  # msync
            self._dirty = False
            return
        now = time.monotonic()
        if now - self._synced_at >= self.sync_interval_s:
            self._synced_at = now
            if self._syncer is None:
                self._syncer = threading.Thread(target=self._sync_forever, name="fleetwire-marker-sync", daemon=True)
                self._syncer.start()
            self._due.set()

    def make_durable(self) -> None:
        """Write the file and its directory entry to disk now (after its first :meth:`write`).

        Once, when the file is created: a power cut must never leave a database with commits next
        to no side file, which :func:`marker_problem` refuses.
        """
        assert self._map is not None and self._fd is not None
        self._map.flush()
        os.fsync(self._fd)
        dir_fd = os.open(self.path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
        self.was_missing = False

    def _sync_forever(self) -> None:
        """The syncer thread: one fdatasync of the marker per :meth:`write` that found one due."""
        fd = self._fd
        assert fd is not None
        while True:
            self._due.wait()
            self._due.clear()
            if self._stopping:
                return
            try:
                os.fdatasync(fd)  # writes the mapping's dirty page back too (MAP_SHARED); releases the GIL
            except OSError as exc:
                self._sync_error = exc
                return
            self.syncs += 1

    def close(self) -> None:
        if self._syncer is not None:
            self._stopping = True
            self._due.set()
            self._syncer.join()
            self._syncer = None
        if self._map is not None:
            if self._dirty:
                with contextlib.suppress(OSError):
                    self._map.flush()
            self._map.close()
            self._map = None
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def marker_problem(generation: int, acknowledged: int | None, marker_name: str) -> str | None:
    """What is wrong with a database of ``generation`` commits whose side file says ``acknowledged``; None: sound.

    Behind its side file: acknowledged commits are gone. With commits but no readable side file
    (``acknowledged`` None: missing, empty or garbled): nothing shows which commits were
    acknowledged, and the usual cause, the side file deleted along with a cut ``-wal``, loses
    them as surely (issue #25 part 4). A database ahead of its side file is sound: the file is
    synced at most every second, so a power cut can leave it behind, never ahead.
    """
    if acknowledged is None:
        if generation <= 0:
            return None  # a new or freshly migrated store: no commit was ever acknowledged
        return (
            f"it holds {generation} commits but its generation file {marker_name} is missing or empty, so "
            "nothing shows which commits were acknowledged (deleted, perhaps with a cut -wal, or the database "
            "was copied without it)"
        )
    if acknowledged > generation:
        return (
            f"it holds {generation} commits but {marker_name} says {acknowledged} were acknowledged "
            "(its -wal lost its tail or was deleted, or an older copy was put back)"
        )
    return None


def write_generation(path: Path, generation: int) -> None:
    """Set the generation side file of database ``path`` (restore: the restored file's own)."""
    marker = GenerationMarker(path, sync_interval_s=0)
    try:
        marker.write(generation)
    finally:
        marker.close()


class FileWatch:
    """The identity (device, inode) of the ``-wal`` and ``-shm`` files of a database open for writing.

    :meth:`problem` is one ``os.stat`` per file, called on the event loop after a commit, and one
    ``os.fstat`` of the ``-wal`` it saw, which it holds open (read-only): a ``-wal`` deleted and
    then created anew at its name (by another connection's open, e.g. the store's writer process
    starting after the deletion) is still reported as deleted, its old inode's link count 0. Only
    the ``-wal``: closing a descriptor drops every POSIX lock of this process on that file, and
    SQLite locks the ``-shm`` (never the ``-wal``). :meth:`close` closes it.

    :meth:`problem` arms what the open did not find yet, on whichever thread checks (the loop's
    committer, a writer that failed), while :meth:`close` may run on another: the ``-wal``'s
    descriptor is opened outside :attr:`_lock` and kept under it only while the watch is open
    and holds none, else closed at once. Before, a close between the open and the assignment
    found no descriptor and the arm then kept one for ever (as did an arm after the close, or
    two arms at once).
    """

    def __init__(self, path: Path) -> None:
        self.paths = sidecar_paths(path)
        self._ids: list[tuple[int, int] | None] = [None, None]
        self._wal_fd: int | None = None
        self._lock = threading.Lock()
        self._closed = False

    def arm(self) -> None:
        """Remember the files as they are now (after a commit, when SQLite has created both); closed: nothing."""
        for i, p in enumerate(self.paths):
            if self._ids[i] is None and not self._closed:
                with contextlib.suppress(FileNotFoundError):
                    if i == 0:  # the -wal: held open, its link count read by problem()
                        fd = os.open(p, os.O_RDONLY | os.O_CLOEXEC)
                        st = os.fstat(fd)
                        with self._lock:
                            kept = not self._closed and self._wal_fd is None
                            if kept:
                                self._wal_fd = fd
                                self._ids[0] = (st.st_dev, st.st_ino)
                        if not kept:
                            os.close(fd)  # closed meanwhile, or another arm kept its own
                    else:
                        st = os.stat(p)
                        self._ids[i] = (st.st_dev, st.st_ino)

    def problem(self) -> str | None:
        """None while both files are the ones :meth:`arm` saw, else what happened to which."""
        with self._lock:  # not a descriptor that close() closed meanwhile (or its number reused)
            gone = self._wal_fd is not None and os.fstat(self._wal_fd).st_nlink == 0
        if gone:
            return f"{self.paths[0]} was deleted while the coordinator was running"
        for p, ident in zip(self.paths, self._ids, strict=True):
            if ident is None:
                self.arm()  # SQLite creates them at the first commit at the latest
                continue
            try:
                st = os.stat(p)
            except FileNotFoundError:
                return f"{p} was deleted while the coordinator was running"
            if (st.st_dev, st.st_ino) != ident and p == self.paths[0]:
                # The -wal held open still has a name (not deleted: checked above): moved away, another file at its.
                return f"{p} was replaced while the coordinator was running"
            if (st.st_dev, st.st_ino) != ident:
                # Not a file copied over it (that keeps the inode): this one was unlinked, and the file at its
                # name is new. For the -shm that is SQLite's own doing: a connection of another process (the
                # store's writer process, an sqlite3 shell) that opens the database without one makes it anew.
                return (
                    f"{p} was deleted while the coordinator was running, and a new file was made at its name "
                    "(a connection of another process that opens the database makes a missing -shm or -wal anew)"
                )
        return None

    def close(self) -> None:
        """Close the ``-wal`` held open (after the store's connection: see the class docstring); no arm after it."""
        with self._lock:
            self._closed = True
            fd, self._wal_fd = self._wal_fd, None
        if fd is not None:
            os.close(fd)


def set_aside(path: Path, label: str) -> Path:
    """Rename database ``path`` and its ``-wal``/``-shm`` to ``<path>.<label>-<time>[-wal|-shm]``; the new name."""
    stamp = time.strftime("%Y%m%dT%H%M%S")
    aside = path.with_name(f"{path.name}.{label}-{stamp}")
    n = 1
    while aside.exists():
        n += 1
        aside = path.with_name(f"{path.name}.{label}-{stamp}.{n}")
    for suffix in ("", "-wal", "-shm"):
        with contextlib.suppress(FileNotFoundError):
            os.rename(path.with_name(path.name + suffix), aside.with_name(aside.name + suffix))
    return aside


# ---------------------------------------------------------------------------- salvage

_PLAN_COLUMNS: Final = "rowid, id, ord, state, spec, status, events, nevents, spec_crc, status_crc, events_crc"
_EVENT_COLUMNS: Final = "plan, seq, body, crc"
_RANGE: Final = 256


def readable_rows(path: Path) -> tuple[list[tuple[Any, ...]], list[tuple[Any, ...]], int]:
    """Every plans row and events row that can still be read from a damaged version-4 file.

    Opens the file read-only (its ``-wal`` included). A table whose scan fails is read again
    by ranges of keys, and a range that fails row by row, so one bad page costs the rows on it,
    not the rest. Checksums are not verified here (the store's reader does that).

    Returns:
        (plans rows as ``_PLAN_COLUMNS``, events rows as ``_EVENT_COLUMNS``, ranges or rows that
        could not be read).
    """
    try:
        db = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    except sqlite3.Error:
        return [], [], 1
    try:
        try:
            db.execute("SELECT count(*) FROM sqlite_master").fetchone()
        except sqlite3.Error:
            return [], [], 1  # not even its schema can be read: nothing to salvage
        plans, bad = _scan(db, "plans", "rowid", _PLAN_COLUMNS)
        events, bad_events = _scan(db, "events", "plan", _EVENT_COLUMNS)
        return plans, events, bad + bad_events
    finally:
        db.close()


def _scan(db: sqlite3.Connection, table: str, key: str, columns: str) -> tuple[list[tuple[Any, ...]], int]:
    rows: list[tuple[Any, ...]] = []
    try:
        for row in db.execute(f"SELECT {columns} FROM {table} ORDER BY {key}"):
            rows.append(row)
        return rows, 0
    except sqlite3.Error:
        pass
    # The scan stopped at a bad page: read what lies beyond it by key ranges.
    try:
        top = int(db.execute(f"SELECT max({key}) FROM {table}").fetchone()[0] or 0)
    except sqlite3.Error:
        top = (int(rows[-1][0]) if rows else 0) + 16 * _RANGE  # the table's right edge is unreadable too
    start = int(rows[-1][0]) + 1 if rows and key == "rowid" else int(rows[-1][0]) if rows else 0
    if key == "plan" and rows:
        rows = [r for r in rows if r[0] != start]  # that plan's rows are read again whole
    bad = 0
    for low in range(start, top + 1, _RANGE):
        got, failed = _read_range(db, table, key, columns, low, low + _RANGE - 1)
        rows.extend(got)
        bad += failed
    return rows, max(bad, 1)


def _read_range(db: sqlite3.Connection, table: str, key: str, columns: str, low: int, high: int
                ) -> tuple[list[tuple[Any, ...]], int]:  # fmt: skip
    sql = f"SELECT {columns} FROM {table} WHERE {key} BETWEEN ? AND ? ORDER BY {key}"
    try:
        return db.execute(sql, (low, high)).fetchall(), 0
    except sqlite3.Error:
        pass
    got: list[tuple[Any, ...]] = []
    bad = 0
    for one in range(low, high + 1):
        try:
            got.extend(db.execute(sql, (one, one)).fetchall())
        except sqlite3.Error:
            bad += 1
    return got, bad


def iter_chunks(items: list[Any], size: int) -> Iterator[list[Any]]:
    """``items`` in lists of at most ``size``."""
    for i in range(0, len(items), size):
        yield items[i:i + size]
