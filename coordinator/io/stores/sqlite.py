"""The SQLite store (the default, ``--store sqlite`` or ``sqlite:PATH``): :class:`SQLiteStore`.

One SQLite file in WAL mode with ``synchronous=FULL``, so a committed batch survives a power cut,
not only a crash of the process. One :meth:`~SQLiteStore.write` is one transaction and one fsync
whatever the number of records in it: the committer groups every batch queued while the previous
transaction was being written (group commit, ``coordinator/io/stores/commit.py``), so durability
costs one fsync per group, not one per message. A lock file next to the database keeps a second
coordinator off it. Its abilities beyond the :class:`~coordinator.io.stores.store.Store`
interface (``coordinator/io/stores/abilities.py``): ``stream``, ``try_write``, ``check_files``
and ``losses``.

What every writer runs for one group (its rows, the transaction's statements, the generation)
is :class:`~coordinator.io.stores.sqlite_commit.SQLiteCommit`, a base of :class:`SQLiteStore`
(coordinator/io/stores/sqlite_commit.py); this module opens, checks, loads and watches the file
and hands the writes to a writer process.

Tables (``PRAGMA user_version`` = 6; a version 1 to 5 file is migrated on open; the
definitions and migrations are in ``coordinator/io/stores/schema.py``)::

    plans(id, owner, ord, state, spec BLOB, status BLOB, events BLOB, nevents,
          spec_crc, status_crc, events_crc, gen)                         -- rowid: submit order
    events(plan, seq, body BLOB, crc, PRIMARY KEY (plan, seq))
    store_meta(generation)
    usage(hour, principal, team, totals BLOB, crc)                       -- the usage ledger (UsageRows)

``id`` has no index: the store, the file's only writer, keeps every id's rowid in memory and
creates an id once.
``spec`` is the :class:`PlanCreated`, ``status`` the latest :class:`PlanStatus` (a finished
plan's carries ``ended_at``, its end in Unix time; a field with a default, so files of either
age read both ways, with no schema change). A plan's
durable events are stored in *runs*, the events of one plan in one group: a run of a plan's
first events (seq <= 15, <= 512 bytes) is appended to ``plans.events`` (``nevents`` events,
msgpack, without an array header) in the same row write as the plan's status; any other run
is one ``events`` row (``plan``: the plans rowid, ``seq``: the run's first seq, ``body``: a
msgpack array). An ordinary plan's whole lifecycle is then one row write per group.

A :class:`PlanForgotten` record (a finished plan past ``--plan-retention``) deletes the plan's
row and its events rows in the same transaction as the rest of its group. SQLite reuses the
freed pages: the file stops growing once as many plans are forgotten as are finished, but it
does not shrink (``VACUUM`` it offline, or ``fleetwire store backup`` writes a compact copy).

Integrity (``coordinator/io/stores/integrity.py``): every blob has a CRC-32 checked on load (the
inline events' one runs on: the writer keeps each open plan's last value in memory, ~100
bytes a plan); ``quick_check`` at open; the generation counts committed groups (stamped on the
row of a group that writes one plan row, ``gen``, else in ``store_meta``: ``schema.GENERATION``) and
the side file ``<db>.generation`` repeats it after each commit; the committer stats the
``-wal``/``-shm`` files after a commit (:meth:`SQLiteStore.check_files`, at most every
10 ms). A damaged store raises :class:`StoreDamaged`; opened with ``accept_loss``
(``--accept-store-loss``) the store starts from what is readable instead and lists what it
dropped in :attr:`SQLiteStore.losses`.

Checkpoints: the commits on the event loop (:meth:`SQLiteStore.try_write`) run with SQLite's auto-checkpoint
off, and the writer's (the writer thread's :meth:`~SQLiteStore.write`, the writer process's connection) with it on:
the writer copies the WAL into the file, off the loop, at its first commit past SQLite's bound
(``SQLiteCommit._begin``), and the committer hands it a group at least every ``INLINE_RUN_MAX`` commits.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
import sqlite3
import time
import zlib
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from itertools import repeat
from pathlib import Path
from typing import Any

import msgspec
import structlog

from coordinator.io.stores.abilities import StoreAbilities
from coordinator.io.stores.integrity import (
    FileWatch,
    GenerationMarker,
    StoreDamaged,
    StoreError,
    iter_chunks,
    marker_problem,
    quick_check,
    readable_rows,
    set_aside,
)
from coordinator.io.stores.rows import (
    SELECT_EVENTS,
    SELECT_PLANS,
    decode_plans,
    group_records,
    iter_plans,
)
from coordinator.io.stores.schema import GENERATION, MIGRATIONS, SCHEMA_VERSION, create_schema, migrate
from coordinator.io.stores.sqlite_commit import BUSY_TIMEOUT_MS, UPDATE_FROM, UPDATE_ONE, SQLiteCommit
from coordinator.io.stores.writer_process import WriterProcess
from coordinator.ledger import UsageRow
from coordinator.records import Record, StoredPlan, UsageRows

__all__ = ["SQLiteStore"]

log = structlog.get_logger(__name__)

crc = zlib.crc32

LOCK_WAIT_S = 10.0  # the longest wait for a dead coordinator's writer process to let go of the lock file

_SELECT_USAGE = "SELECT hour, principal, team, totals, crc FROM usage"
_SELECT_PLANS_BY_ROWID = SELECT_PLANS + " ORDER BY rowid"  # a rowid table's own order: no sort
# Whether some plan's row comes before an older plan's (rowids follow the submit order, so never).
_OUT_OF_ORDER = (
    "SELECT EXISTS (SELECT 1 FROM (SELECT ord - lag(ord) OVER (ORDER BY rowid) AS step FROM plans) WHERE step < 0)"
)
# The write-side keys a commit changed (SQLiteStore.keys_message): between the writer process and its parent.
_encode_keys = msgspec.msgpack.Encoder().encode
_decode_keys = msgspec.msgpack.Decoder(tuple[int, int, dict[str, int], dict[str, int], list[str], list[str]]).decode


class SQLiteStore(SQLiteCommit):
    """Plans in one SQLite file (WAL, ``synchronous=FULL``); one transaction per :meth:`write`.

    Args:
        path: the database file; its directory is created when missing.
        accept_loss: a damaged file is not refused: the store starts from what is readable
            (damaged plans are dropped, an unreadable file is set aside and rebuilt from its
            readable rows) and lists what it lost in :attr:`losses`.
        marker_sync_s: the longest time between two fdatasyncs of the generation side file
            (:class:`~coordinator.io.stores.integrity.GenerationMarker`; 0: after every commit).

    Attributes:
        losses: one line per loss accepted at open or load (``accept_loss`` only).

    Raises:
        StoreError: the file cannot be opened, is not a fleetwire database of a known
            version, or another coordinator holds it.
        StoreDamaged: the file is damaged (``accept_loss`` off).
    """

    blocking = True
    generation: int  # groups committed to the file (schema.GENERATION), read at the open

    def __init__(self, path: Path, *, accept_loss: bool = False, marker_sync_s: float = 1.0) -> None:
        self._fields(path, accept_loss, marker_sync_s)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            self._lock(path.with_name(path.name + ".lock"))
            try:
                self._open()
            except StoreDamaged as exc:
                if not accept_loss:
                    raise
                self._rebuild(exc.problem)
        except (OSError, sqlite3.Error) as exc:
            self.close()
            raise StoreError(f"cannot open the store {path}: {exc}") from exc
        except StoreError:
            self.close()
            raise

    def _fields(self, path: Path, accept_loss: bool, marker_sync_s: float) -> None:
        self.path = path
        self.description = f"sqlite:{path}"
        self.closed = False
        self.writes = 0  # transactions committed
        self.records = 0  # records written
        self.accept_loss = accept_loss
        self.losses: list[str] = []
        self._encoder = msgspec.msgpack.Encoder()
        # A creation's or a status's stored bytes (the writer process's: the parent's encoding, as it came).
        self._encode_record: Callable[[Any], Any] = self._encoder.encode
        self._lock_fd: int | None = None
        self._marker: GenerationMarker | None = None
        self._watch = FileWatch(path)
        self._marker_sync_s = marker_sync_s
        # The inline events' running checksum of each open plan (written by the writer thread only).
        self._events_crc: dict[str, int] = {}
        self._rowids: dict[str, int] = {}  # every plan's rowid (read at the open: _open)
        self._child: WriterProcess | None = None  # the writer process, once the writes are handed to it
        self._handed_off = False  # ... and for good: this store writes only its inline commits (try_write)
        # The writer process and its parent both commit: each commit's key changes, for the other side (keys_message).
        self._share_keys = False
        self._loop_connection = True  # its commits without waiting are the event loop's: no checkpoint (_begin)
        self._keys: tuple[dict[str, int], dict[str, int], list[str], set[str]] = ({}, {}, [], set())

    @classmethod
    def writer(
        cls, path: Path, *, marker_sync_s: float = 1.0, encode_record: Callable[[Any], Any] | None = None,
    ) -> SQLiteStore:
        """The writer process's store (coordinator/io/stores/writer_child.py): the file's writes only.

        The parent opened, checked, migrated and loaded the file and holds its lock file; this
        connection reads the write-side keys (every plan's rowid, the generation) and writes.
        ``encode_record``: a creation's or a status's stored bytes (a bytes-like object) instead of its
        msgpack encoding: the child's records come with the parent's encoding, stored as it is.
        """
        self = cls.__new__(cls)
        self._fields(path, False, marker_sync_s)
        self._loop_connection = False  # no loop here: SQLite's checkpoints stay on (SQLiteCommit._begin)
        if encode_record is not None:
            self._encode_record = encode_record
        try:
            self._connect()
            self._read_keys()
            # One row a step: multi-row UPDATE ... FROM (VALUES ...) statements (UPDATE_FROM) spare a writer
            # *thread* its GIL hand-backs (_commit), but cost more SQLite work a row: a process with no other
            # thread spent 166.6k instructions a plan with them, 149.4k without (callgrind, the child's path
            # for bench/store_writer.py's groups). Inserts stay multi-row: cheaper either way.
            self._update_status = UPDATE_ONE
            self._marker = GenerationMarker(path, sync_interval_s=marker_sync_s)
        except (OSError, sqlite3.Error) as exc:
            self.close()
            raise StoreError(f"cannot open the store {path} for writing: {exc}") from exc
        self._share_keys = True
        return self

    def hand_writes_to_process(self) -> None:
        """From now on every write is committed by a writer process (its ``writer_process`` ability).

        After the open and the load (the server calls it before its committer starts): the
        process reads the write-side keys from the file. Both keep them from then on: each reply
        of the child carries its commit's keys (:meth:`apply_keys`, where the replies are read, before
        the commit is reported), and an inline commit here (:meth:`try_write`, only while nothing
        is in flight) sends the child its own (:meth:`keys_message`) before any later group.

        Raises:
            StoreError: the process cannot be started.
        """
        if self._handed_off:
            return
        self._child = WriterProcess(self.path, self.generation, marker_sync_s=self._marker_sync_s,
                                    lock_fd=self._lock_fd, on_keys=self.apply_keys)  # fmt: skip
        self._handed_off = True
        self._share_keys = True

    def keys_message(self) -> bytes:
        """The write-side keys the last commit changed, for the other side of the writer process (msgpack).

        ``[generation, next rowid, {fresh plan: rowid}, {plan: inline events checksum}, [ended plan],
        [forgotten plan]]``; :meth:`apply_keys` applies it as :meth:`_committed` applied it here.
        """
        fresh, chained_now, ended, forgotten = self._keys
        return _encode_keys((self.generation, self._next_rowid, fresh, chained_now, ended, forgotten))

    def apply_keys(self, message: bytes) -> None:
        """The keys of a commit the other side made (:meth:`keys_message`): this side's next commit builds on it.

        Raises:
            msgspec.DecodeError, msgspec.ValidationError: not such a message.
        """
        generation, next_rowid, fresh, chained_now, ended, forgotten = _decode_keys(message)
        rowids, chained = self._rowids, self._events_crc
        if forgotten:
            deque(map(rowids.pop, forgotten, repeat(None)), maxlen=0)  # each pop in C: no Python step a plan
            deque(map(chained.pop, forgotten, repeat(None)), maxlen=0)
        chained.update(chained_now)
        if ended:
            deque(map(chained.pop, ended, repeat(None)), maxlen=0)
        rowids.update(fresh)
        self._next_rowid = next_rowid
        self.generation = generation

    @property
    def writer_pid(self) -> int | None:
        """The writer process's pid while it runs, else None."""
        return self._child.pid if self._child is not None else None

    @property
    def abilities(self) -> StoreAbilities:
        """A restart's load one plan at a time, commits on the loop, the file check and the losses accepted."""
        return StoreAbilities(stream=self.stream, check_files=self.check_files, try_write=self.try_write,
                              losses=self.losses, usage=self.load_usage,
                              writer_process=self.hand_writes_to_process,
                              sender=self if self._child is not None else None)  # fmt: skip

    def load_usage(self) -> list[UsageRow]:
        """The usage ledger's rows (its ``usage`` ability); a row whose checksum fails is left out, and logged."""
        rows: list[UsageRow] = []
        try:
            found = self._db.execute(_SELECT_USAGE).fetchall()
        except sqlite3.Error as exc:
            raise StoreError(f"cannot read the usage ledger of {self.path}: {exc}") from exc
        for hour, principal, team, totals, checksum in found:
            if crc(totals) != checksum:
                log.error("usage ledger row damaged: left out", store=str(self.path), hour=hour, principal=principal)
                continue
            rows.append(UsageRow.of(hour, principal, team, msgspec.msgpack.decode(totals)))
        return rows

    def _connect(self) -> None:
        """The connection, ``synchronous=FULL``. check_same_thread=False: opened here, written by the committer's
        one thread (or the loop), never by two threads at once. isolation_level=None: transactions are explicit."""
        self._db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None,
                                   timeout=BUSY_TIMEOUT_MS / 1000)  # fmt: skip
        self._waits = True  # the connection's busy timeout is BUSY_TIMEOUT_MS (0 while False: try_write)
        self._db.execute("PRAGMA synchronous=FULL")

    def _read_keys(self) -> None:
        """The write-side keys from the file: its generation, every plan's rowid (the events key; a forgotten
        plan's is dropped with its row) and the next one; and the statements this SQLite can run."""
        self.generation = self._db.execute(GENERATION).fetchone()[0]
        self._rowids = dict(self._db.execute("SELECT id, rowid FROM plans"))
        self._next_rowid = max(self._rowids.values(), default=0) + 1
        # UPDATE ... FROM needs SQLite 3.33; an older library writes one row per step.
        self._multi_row = sqlite3.sqlite_version_info >= (3, 33, 0)
        self._update_status = UPDATE_FROM if self._multi_row else UPDATE_ONE

    def _open(self) -> None:
        """Connect, migrate or create the schema, check the file and its generation; read the rowids."""
        path = self.path
        try:
            self._connect()
            self._db.execute("PRAGMA journal_mode=WAL")
            version = self._db.execute("PRAGMA user_version").fetchone()[0]
            if version not in (0, *MIGRATIONS, SCHEMA_VERSION):
                raise StoreError(
                    f"{path} has schema version {version}; this coordinator reads versions 1 to {SCHEMA_VERSION}"
                )
            problem = quick_check(self._db)
            if problem is not None:
                raise StoreDamaged(path, problem)
            if version == 0:
                create_schema(self._db)
            elif version in MIGRATIONS:
                migrate(self._db, version)
            self._read_keys()
        except sqlite3.OperationalError as exc:
            if "malformed" not in str(exc) and "no such" not in str(exc):
                raise  # locked, unreadable, disk I/O: a problem of the machine, not of the file's content
            raise StoreDamaged(path, str(exc)) from exc
        except sqlite3.DatabaseError as exc:  # "file is not a database", "database disk image is malformed"
            raise StoreDamaged(path, str(exc)) from exc
        if self._marker is None:
            self._marker = GenerationMarker(path, sync_interval_s=self._marker_sync_s)
        acknowledged = self._marker.read()
        problem = marker_problem(self.generation, acknowledged, self._marker.path.name)
        if problem is not None:
            if not self.accept_loss:
                raise StoreDamaged(path, problem)
            lost = "are lost" if acknowledged is not None else "may be lost"
            self.losses.append(f"{path}: {problem}; the commits after {self.generation} {lost}")
        self._marker.write(self.generation)
        if self._marker.was_missing:
            self._marker.make_durable()  # never missing next to commits after a power cut
        self._watch.arm()

    def _rebuild(self, problem: str) -> None:
        """``--accept-store-loss`` on a file SQLite cannot use: set it aside, start anew from its readable rows."""
        with contextlib.suppress(sqlite3.Error):
            if getattr(self, "_db", None) is not None:
                self._db.close()
        self._db = None  # type: ignore[assignment]
        plans_rows, event_rows, unreadable = readable_rows(self.path)
        aside = set_aside(self.path, "damaged")
        self._watch.close()
        self._watch = FileWatch(self.path)
        plans, damaged = decode_plans(plans_rows, event_rows)
        if self._marker is None:
            self._marker = GenerationMarker(self.path, sync_interval_s=self._marker_sync_s)
        self._marker.write(0)  # the new file starts its own count
        self._open()
        for chunk in iter_chunks(plans, 1000):
            self.write([r for p in chunk for r in (p.created, *p.events, *([p.status] if p.status else []))])
        self.losses.append(
            f"{self.path}: {problem}; the damaged file is kept as {aside.name}; {len(plans)} plans were read back, "
            f"{len(damaged)} damaged plans and {unreadable} unreadable parts were dropped"
        )
        self.losses.extend(f"{self.path}: {what}" for what in damaged.values())

    def _lock(self, lock_path: Path) -> None:
        """Hold ``lock_path`` (``flock``) for this store's life; refuse when another coordinator holds it.

        The lock file names the coordinator that holds it. When that coordinator is dead, the hold is its
        writer process's (coordinator/io/stores/writer_process.py), which dies with it (``PR_SET_PDEATHSIG``)
        but not in the same instant: a coordinator restarted at once after a ``kill -9`` waits up to
        :data:`LOCK_WAIT_S` for that hold to go, instead of refusing.
        """
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o600)
        deadline = time.monotonic() + LOCK_WAIT_S
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "?"
                if _alive(holder) or time.monotonic() >= deadline:
                    os.close(fd)
                    raise StoreError(
                        f"another coordinator (pid {holder}) is using {self.path}; stop it or give this one "
                        "another --data-dir"
                    ) from None
                time.sleep(0.02)  # a dead coordinator's writer process, dying: its hold goes with it
        os.ftruncate(fd, 0)
        os.write(fd, str(os.getpid()).encode())
        self._lock_fd = fd  # held until close(); the kernel releases it if the process dies

    def load(self) -> list[StoredPlan]:
        # The rowids read at open are read again with the plans, keyed by the plans' own id strings:
        # freed first, so the plans' memory reuses theirs, and each id is one string, not two.
        opened, self._rowids = self._rowids, {}
        try:
            plans, damaged = decode_plans(self._db.execute(SELECT_PLANS), self._db.execute(SELECT_EVENTS),
                                          keep_crc=self._events_crc, keep_rowids=self._rowids)  # fmt: skip
        except sqlite3.Error as exc:
            self._rowids = opened
            if not self.accept_loss:
                raise StoreDamaged(self.path, f"cannot read it: {exc}") from exc
            self._rebuild(f"cannot read it: {exc}")
            return self.load()
        del opened
        if damaged:
            if not self.accept_loss:
                more = f" (and {len(damaged) - 1} more)" if len(damaged) > 1 else ""
                raise StoreDamaged(self.path, next(iter(damaged.values())) + more)
            self.drop_plans(damaged)
        return plans

    def stream(self) -> Iterator[StoredPlan]:
        """Every plan held, in submit order, each handed over as soon as it is decoded (a restart's load).

        The server's restore turns each into the core's plan before the next is read, so the
        decoded store is never in memory whole. Checks as :meth:`load`: the damage found is
        raised (:class:`StoreDamaged`) once every sound plan was given, as :meth:`load` raises
        it. With ``accept_loss``, or a file whose rowids do not follow the submit order (never
        written so by this store), it is :meth:`load`'s list.
        """
        if self.accept_loss or self._db.execute(_OUT_OF_ORDER).fetchone()[0]:
            yield from self.load()
            return
        self._rowids = {}
        damaged: dict[int, str] = {}
        try:
            yield from iter_plans(self._db.execute(_SELECT_PLANS_BY_ROWID), self._db.execute(SELECT_EVENTS), damaged,
                                  keep_crc=self._events_crc, keep_rowids=self._rowids)  # fmt: skip
        except sqlite3.Error as exc:
            raise StoreDamaged(self.path, f"cannot read it: {exc}") from exc
        if damaged:
            more = f" (and {len(damaged) - 1} more)" if len(damaged) > 1 else ""
            raise StoreDamaged(self.path, next(iter(damaged.values())) + more)

    def try_write(self, records: Sequence[Record]) -> bool:
        """:meth:`write` without waiting for the database: False (nothing written) while another connection holds it.

        The committer's commit on the event loop (coordinator/io/stores/commit.py): the loop must not
        wait up to sqlite3's busy timeout (5 s) for, e.g., a checkpoint by ``fleetwire store
        backup``; the writer thread, which may wait, gets the group instead.
        """
        child = self._child
        try:
            if child is not None:
                # Committed here, by this connection (no round trip to the child: two process wake-ups), while the
                # child has nothing in flight; then the child is sent the keys before any later group. A writer
                # process still starting reads the file as it finds it and then applies the keys held for it
                # (applying a commit's keys twice changes nothing), so a lone commit never waits for its start.
                if child.in_flight or not self._write(records, wait=False):
                    return False
                child.send_keys(self.keys_message(), self.generation)
                return True
            return self.write_here(records, wait=False)
        except Exception as exc:
            self._blame_moved_files(exc)
            raise

    def write(self, records: Sequence[Record]) -> None:
        child = self._child
        try:
            if child is not None:
                self._write_in_child(child, records, wait=True)
            else:
                self.write_here(records, wait=True)
        except Exception as exc:
            self._blame_moved_files(exc)
            raise

    def _blame_moved_files(self, exc: BaseException) -> None:
        """Raise :class:`StoreDamaged` (from ``exc``, a failed write) when the ``-wal`` or ``-shm`` is gone or replaced.

        Whichever connection meets the deleted ``-wal`` first fails with its own words: SQLite's "disk I/O error"
        in a writer process that opens the file after the deletion (its ``-shm`` counts frames no ``-wal``
        holds), while this connection commits on into the unlinked file until :meth:`check_files` runs. The
        cause an operator can act on is the deletion: it is named, whichever path found it first.
        """
        if isinstance(exc, StoreDamaged):
            return
        moved = self._watch.problem()
        if moved is not None:
            raise StoreDamaged(self.path, moved) from exc

    def send(self, records: Sequence[Record], done: Callable[[BaseException | None], None]) -> None:
        """A group to the writer process, ``done`` called once it is committed (its ``sender`` ability).

        Raises:
            StoreError: the process is gone, or the writes were never handed to one.
        """
        child = self._child
        if child is None:
            raise StoreError(f"the store {self.path} has no writer process")
        count = len(records)

        def committed(error: BaseException | None) -> None:
            if error is None:
                self._counted(count)
                done(None)
                return
            try:
                self._blame_moved_files(error)
            except StoreDamaged as damaged:
                error = damaged
            done(error)

        try:
            child.send(records, committed)
        except Exception as exc:
            self._blame_moved_files(exc)
            raise

    def drain(self) -> None:
        """Wait until every group :meth:`send` sent has been answered."""
        if self._child is not None:
            self._child.drain()

    def serve_on(self, loop: asyncio.AbstractEventLoop, notify: Callable[[], None]) -> None:
        """:meth:`send` on ``loop``'s thread from now on, each commit reported there (``WriterProcess.serve_on``).

        Raises:
            StoreError: the writes were never handed to a process.
        """
        if self._child is None:
            raise StoreError(f"the store {self.path} has no writer process")
        self._child.serve_on(loop, notify)

    def poll_commits(self) -> None:
        """On the loop (after :meth:`serve_on`): the commits the writer process answered so far, reported now."""
        if self._child is not None:
            self._child.poll()

    def leave_loop(self) -> None:
        """Undo :meth:`serve_on` (on the loop's thread)."""
        if self._child is not None:
            self._child.leave()

    def abandon(self, why: str) -> None:
        """On the loop: the groups out fail now and the writer process is killed (``WriterProcess.abandon``)."""
        if self._child is not None:
            self._child.abandon(why)

    def _write_in_child(self, child: WriterProcess, records: Sequence[Record], *, wait: bool) -> bool:
        if not child.write(records, wait=wait):
            return False
        self._counted(len(records))
        return True

    def _counted(self, count: int) -> None:
        """A group of ``count`` records the writer process committed (its generation came with its keys: apply_keys)."""
        self.writes += 1
        self.records += count

    def write_here(self, records: Sequence[Record], *, wait: bool) -> bool:
        """One group committed by this process's connection (not once the writes were handed to a process)."""
        if self._handed_off:
            raise StoreError(f"the store {self.path} was written by its writer process, which has stopped")
        return self._write(records, wait=wait)

    def _write(self, records: Sequence[Record], *, wait: bool) -> bool:
        """One group: the rows it touches, :meth:`_encode_rows`, :meth:`_commit` (a transaction), :meth:`_committed`."""
        usage: list[UsageRows] = []  # at most one a tick: found by the same pass as the plans' records
        created, latest, runs, forgotten = group_records(records, usage)
        return self.write_grouped(created, latest, runs, forgotten, usage, len(records), wait=wait)

    def check_files(self) -> None:
        """Raise :class:`StoreDamaged` when the ``-wal`` or ``-shm`` was deleted or replaced since the open.

        The committer calls it on the event loop after a commit (at most every 10 ms), before it
        releases the replies: a commit in a file nobody will read again must not be acknowledged.
        """
        moved = self._watch.problem()
        if moved is not None:
            raise StoreDamaged(self.path, moved)

    def close(self) -> None:
        self.closed = True
        child, self._child = getattr(self, "_child", None), None
        if child is not None:
            child.close()  # it closes its connection and the side file, then exits
        db = getattr(self, "_db", None)
        if db is not None:
            with contextlib.suppress(sqlite3.Error):
                db.close()
            self._db = None  # type: ignore[assignment]
        watch = getattr(self, "_watch", None)
        if watch is not None:
            watch.close()  # after the connection (FileWatch)
        if self._marker is not None:
            self._marker.close()
            self._marker = None
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None


def _alive(pid_text: str) -> bool:
    """Whether the process the lock file names still runs (not a number: assumed so)."""
    if not pid_text.isdigit():
        return True
    try:
        os.kill(int(pid_text), 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
