"""The SQLite store's commit: one group of records as one transaction (``SQLiteCommit``, a base of ``SQLiteStore``).

``SQLiteStore`` (coordinator/io/stores/sqlite.py) opens, checks, loads and watches the file and hands
its writes to a writer process; what every writer runs (the store's own connection, a writer thread,
the writer process's ``SQLiteStore.writer``) is here: a group's records, grouped by plan
(``rows.group_records``), written by :meth:`~SQLiteCommit.write_grouped`: each touched plan's row
encoded with its checksums (``_encode_rows``), the statements of one transaction and the generation
(``_commit``: the one row of a one-row group stamped with it, else ``store_meta``;
``schema.GENERATION``), then the write-side keys (rowids, the inline events' running checksums)
moved on (``_committed``); and :meth:`~SQLiteCommit.drop_plans`, the damaged plans deleted
(``--accept-store-loss``). What it needs of the store is declared on :class:`SQLiteCommit`.
"""

from __future__ import annotations

import contextlib
import itertools
import sqlite3
import zlib
from collections.abc import Callable, Iterable
from itertools import chain
from pathlib import Path
from typing import Any, Final

import msgspec
import structlog

from coordinator.io.stores.integrity import GenerationMarker, StoreError
from coordinator.io.stores.rows import StoredEvent, as_text, not_storable, run_by_seq
from coordinator.records import PlanCreated, PlanStatus, Record, UsageRows
from protocol.messages import TERMINAL_STATES

__all__ = ["BLOB", "BUSY_TIMEOUT_MS", "UPDATE_FROM", "UPDATE_ONE", "WAL_AUTOCHECKPOINT", "SQLiteCommit"]

log = structlog.get_logger("coordinator.io.stores.sqlite")  # the store's log, as before the module was split off

crc = zlib.crc32

# Where a plan's events go. A run (the events of one plan in one group) whose last seq is at
# most _INLINE_MAX_SEQ and whose encoding is at most _INLINE_MAX_BYTES is appended to the plan's
# own row: the whole lifecycle of an ordinary plan (queued ... succeeded) then costs no row of
# its own. Anything else (a long stream, a large payload) is one events row per run, so the
# plan's row, rewritten by every update, stays small (at most 15 runs of 512 bytes).
_INLINE_MAX_SEQ = 15  # also keeps every inline run under 16 events: a one-byte array header
_INLINE_MAX_BYTES = 512

_INSERT_PLANS = (
    "INSERT INTO plans (rowid, id, owner, ord, state, spec, status, events, nevents, spec_crc, status_crc, "
    "events_crc) VALUES {values}"
)
_INSERT_EVENTS = "INSERT OR REPLACE INTO events (plan, seq, body, crc) VALUES {values}"
_DELETE_PLANS = "DELETE FROM plans WHERE rowid IN ({values})"
_DELETE_EVENTS = "DELETE FROM events WHERE plan IN ({values})"  # the key's prefix: a range per plan
# SQLite's || gives text; CAST keeps the bytes (msgpack) as they are: the file is UTF-8 (SQLite's
# default, never changed here), so nothing is converted on the way.
UPDATE_FROM = (
    "UPDATE plans SET state = coalesce(v.column2, state), status = coalesce(v.column3, status), "
    "events = CASE WHEN v.column4 IS NULL THEN events ELSE CAST(coalesce(events, x'') || v.column4 AS BLOB) END, "
    "nevents = nevents + v.column5, status_crc = coalesce(v.column6, status_crc), "
    "events_crc = coalesce(v.column7, events_crc) FROM (VALUES {values}) AS v WHERE plans.rowid = v.column1"
)
UPDATE_ONE = (
    "UPDATE plans SET state = coalesce(?2, state), status = coalesce(?3, status), "
    "events = CASE WHEN ?4 IS NULL THEN events ELSE CAST(coalesce(events, x'') || ?4 AS BLOB) END, "
    "nevents = nevents + ?5, status_crc = coalesce(?6, status_crc), events_crc = coalesce(?7, events_crc) "
    "WHERE rowid = ?1"
)
# A group that writes one plan row stamps it with the group's generation (gen, the last parameter); any other
# group updates store_meta (schema.GENERATION): a lone commit then dirties one page, its row's, not two.
_INSERT_ONE_STAMPED = (
    "INSERT INTO plans (rowid, id, owner, ord, state, spec, status, events, nevents, spec_crc, status_crc, "
    "events_crc, gen) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)"
)
_UPDATE_ONE_STAMPED = UPDATE_ONE.replace(" WHERE rowid = ?1", ", gen = ?8 WHERE rowid = ?1")
_SET_GENERATION = "UPDATE store_meta SET generation = ?"
# The usage ledger (UsageRows records, coordinator/ledger.py): a row replaced whole, or dropped once folded.
_UPSERT_USAGE = "INSERT OR REPLACE INTO usage (hour, principal, team, totals, crc) VALUES (?, ?, ?, ?, ?)"
_DELETE_USAGE = "DELETE FROM usage WHERE hour = ? AND principal = ? AND team = ?"
BUSY_TIMEOUT_MS = 5000  # sqlite3's default: how long a write waits for another connection's lock
_NO_BUSY_WAIT = "PRAGMA busy_timeout = 0"
_BUSY_WAIT = f"PRAGMA busy_timeout = {BUSY_TIMEOUT_MS}"
WAL_AUTOCHECKPOINT = 1000  # SQLite's default: the WAL's frames past which a commit's connection checkpoints it
_NO_AUTOCHECKPOINT = "PRAGMA wal_autocheckpoint = 0"
_AUTOCHECKPOINT = f"PRAGMA wal_autocheckpoint = {WAL_AUTOCHECKPOINT}"
_UNENCODABLE = (TypeError, ValueError, OverflowError)  # what msgspec raises for a payload it cannot hold
# Rows per statement. Multi-row statements need SQLite 3.33 (UPDATE ... FROM), whose limit is
# 32,766 parameters: 12 x 128 is far below it.
_CHUNK = 128
# Each multi-row statement's text by (statement, rows): formatted once, not once per group and chunk.
_STATEMENTS: dict[tuple[str, int], str] = {}

# sqlite3 binds an int, float, str or bytearray parameter as it is, but asks any other (a bytes
# blob, None) for an adapter: with none registered it looks up ``PrepareProtocol.__adapt__``,
# which raises an AttributeError (its message formatted) and clears it, for every blob and NULL
# bound: ~14,000 of the writer's ~144,000 instructions per plan (callgrind, bench/store_writer.py's
# groups). An adapter in the registry is found first; these two return their argument
# (``bytes.__bytes__`` of a bytes object is the object itself: a method call, ~80 ns a blob less
# than calling the type ``bytes``; ``{}.get`` of None is None), in C. Process-wide, as sqlite3's
# registry is, and only where nobody registered one for these types first. The inline runs, the rows' most
# frequent blob, are made a bytearray instead (``_encode_rows``), which sqlite3 binds with no look-up at all.
sqlite3.adapters.setdefault((bytes, sqlite3.PrepareProtocol), bytes.__bytes__)
sqlite3.adapters.setdefault((type(None), sqlite3.PrepareProtocol), {}.get)
BLOB: Final = bytearray()
"""Never changed: ``BLOB + data`` is ``data``'s bytes as a new bytearray, which sqlite3 binds with no adapter look-up
(~1,100 instructions a blob less than a ``bytes`` one), a copy made in ~740 (``bytearray(data)``: ~1,110, its
arguments parsed; callgrind, docs/PERFORMANCE.md §W29d)."""


# One group's rows (_encode_rows): inserts, updates, events-table runs, inline checksums after it, plans ended.
# A plain tuple: a NamedTuple's construction cost 0.3 us of a lone commit's ~8 us of Python (store_writer.py --lone).
_Rows = tuple[list[tuple[Any, ...]], list[tuple[Any, ...]], list[tuple[Any, ...]], dict[str, int], list[str]]


def _usage_rows(records: list[UsageRows]) -> tuple[list[tuple[int, str, str]], list[tuple[Any, ...]]]:
    """The usage ledger's keys to drop and rows to keep, in the order written (a later row of a key wins)."""
    deleted: list[tuple[int, str, str]] = []
    kept: dict[tuple[int, str, str], list[float]] = {}
    for record in records:
        for key in record.deleted:
            key = (key[0], key[1], key[2])
            deleted.append(key)
            kept.pop(key, None)
        for hour, principal, team, values in record.rows:
            kept[hour, principal, team] = values
    rows = []
    for key, values in kept.items():
        blob = msgspec.msgpack.encode(values)
        rows.append((*key, blob, crc(blob)))
    return deleted, rows


class SQLiteCommit:
    """One group of records as one transaction: :meth:`write_grouped` (the module docstring says the steps).

    What it needs of the store (:class:`~coordinator.io.stores.sqlite.SQLiteStore` sets them): the connection,
    the write-side keys, the encoders, the generation and its side file, the counters.
    """

    path: Path
    generation: int
    writes: int
    records: int
    losses: list[str]
    _db: sqlite3.Connection
    _waits: bool
    _loop_connection: bool  # the coordinator's own (its commits without waiting are the event loop's), not the child's
    _multi_row: bool
    _update_status: str
    _rowids: dict[str, int]
    _next_rowid: int
    _events_crc: dict[str, int]
    _encoder: msgspec.msgpack.Encoder
    _encode_record: Callable[[Any], Any]
    _marker: GenerationMarker | None
    _share_keys: bool
    _keys: tuple[dict[str, int], dict[str, int], list[str], set[str]]

    def _begin(self, wait: bool) -> bool:
        """``BEGIN IMMEDIATE``; without ``wait``, False at once when another connection holds the write lock.

        The connection's busy timeout is switched only when the mode changes (:attr:`_waits`): a
        store whose commits all run on the loop (``wait`` off) or all in the writer thread runs no
        ``PRAGMA`` per commit. Two per commit were ~3 µs of a lone commit's ~20 µs of SQLite work
        on a quiet machine, and more on a busy one (bench/store_writer.py --lone).

        With the mode, the coordinator's own connection (:attr:`_loop_connection`) switches SQLite's auto-checkpoint:
        off for the event loop's commits (``wait`` off), on (:data:`WAL_AUTOCHECKPOINT`) for a writer thread's. The
        commit that took the WAL past the bound copied it into the file and fsynced that before it returned: one
        lone commit in ~900 on the loop took 3-20 ms (docs/PERFORMANCE.md §P29). The writer (a thread, or the writer
        process, whose connection keeps the default) checkpoints instead, at its next commit past the bound: the
        committer hands it one group at least every ``INLINE_RUN_MAX`` commits (coordinator/io/stores/commit.py).
        """
        db = self._db
        if wait != self._waits:
            db.execute(_BUSY_WAIT if wait else _NO_BUSY_WAIT)
            if self._loop_connection:
                db.execute(_AUTOCHECKPOINT if wait else _NO_AUTOCHECKPOINT)
            self._waits = wait
        if wait:
            db.execute("BEGIN IMMEDIATE")
            return True
        try:
            db.execute("BEGIN IMMEDIATE")
        except sqlite3.OperationalError as exc:
            if db.in_transaction or ("locked" not in str(exc) and "busy" not in str(exc)):
                raise
            return False
        return True

    def write_grouped(
        self,
        created: dict[str, PlanCreated],
        latest: dict[str, PlanStatus],
        runs: dict[str, list[StoredEvent]],
        forgotten: set[str],
        usage: list[UsageRows],
        count: int,
        *,
        wait: bool,
    ) -> bool:
        """:meth:`_write` of a group already grouped (:func:`group_records`; ``count``: its records).

        The writer process groups what it reads off its pipe itself: a creation or a status comes
        with its encoding, which it stores as it is (coordinator/io/stores/writer_process.py).
        """
        rowids = self._rowids
        fresh: dict[str, int]  # rowids of plans new in this group
        next_rowid = self._next_rowid
        doomed = [(rowids[plan_id],) for plan_id in forgotten if plan_id in rowids] if forgotten else []
        if not forgotten and created.keys().isdisjoint(rowids.keys()):
            # Every creation new (nearly every group): numbered in C, no Python step a plan (the views' test
            # looks each creation up in rowids, the smaller side).
            fresh = dict(zip(created, itertools.count(next_rowid)))
        else:
            fresh = {}
            for plan_id in created:
                # A plan id is created once while kept: a second creation keeps the first.
                if plan_id not in rowids or plan_id in forgotten:
                    fresh[plan_id] = next_rowid + len(fresh)
        # Every plan this group touches, once. The core writes a status with every change, so
        # the statuses name them all; other callers may write events or creations alone.
        touched: Iterable[str] = latest
        # Subset tests of the key views make no set (a difference made two a group: ~0.3k instructions a plan).
        if len(runs) > len(latest) or not (fresh.keys() <= latest.keys() and runs.keys() <= latest.keys()):
            touched = {**fresh, **latest, **runs}
        rows = self._encode_rows(touched, created, latest, runs, forgotten, fresh)
        if not self._commit(doomed, rows, wait, _usage_rows(usage) if usage else None):
            return False  # nothing changed yet: the caller writes the same records later
        self._committed(rows, fresh, forgotten)
        self.writes += 1
        self.records += count
        return True

    def _encode_rows(
        self,
        touched: Iterable[str],
        created: dict[str, PlanCreated],
        latest: dict[str, PlanStatus],
        runs: dict[str, list[StoredEvent]],
        forgotten: set[str],
        fresh: dict[str, int],
    ) -> _Rows:
        """Each touched plan's row insert or update and its spilled run, encoded with their checksums."""
        rowids = self._rowids
        encode, encode_run = self._encode, self._encode_run
        # msgspec's encoder called here, ~3 statuses and runs a plan; _encode/_encode_run (their
        # fallback for a payload msgpack cannot hold) only when it raises: a method call each saved.
        raw_encode = self._encoder.encode
        record_encode = self._encode_record  # the writer process's: the parent's bytes (no encoding, no call back)
        unencodable = _UNENCODABLE
        chained = self._events_crc
        new_rows: list[tuple[Any, ...]] = []
        updates: list[tuple[Any, ...]] = []
        spilled: list[tuple[Any, ...]] = []  # runs that go to the events table
        chained_now: dict[str, int] = {}  # applied once committed, like the rowids
        ended: list[str] = []
        for plan_id in touched:
            rowid = fresh.get(plan_id) if fresh else None  # most groups create no plan: no look-up
            new = rowid is not None
            if rowid is None:
                rowid = None if forgotten and plan_id in forgotten else rowids.get(plan_id)
                if rowid is None:
                    continue  # a record of a plan never created (or deleted): load() would never return it
            inline: bytearray | None
            run = runs.get(plan_id)
            if run is None:
                inline = inline_crc = None
                count = 0
            else:
                size = len(run)
                if size > 1 and (size > 2 or run[0][2] >= run[1][2]):  # two in order (the usual run): as it is
                    run = run_by_seq(run)
                    size = len(run)
                try:
                    body = raw_encode(run)
                except unencodable:
                    body = encode_run(plan_id, run)
                if run[-1][2] <= _INLINE_MAX_SEQ and size < 16 and len(body) <= _INLINE_MAX_BYTES:
                    # Without its one-byte array header, as a bytearray (BLOB): bound with no adapter look-up.
                    inline, count = BLOB + body, size
                    del inline[0]
                    # The checksum of the row's whole events blob runs on from its previous value.
                    previous = 0 if new else chained.get(plan_id)
                    if previous is None:
                        previous = self._stored_events_crc(rowid)
                    inline_crc = crc(inline, previous)
                else:
                    spilled.append((rowid, run[0][2], body, crc(body, rowid & 0xFFFFFFFF)))
                    inline = inline_crc = None
                    count = 0
            status = latest.get(plan_id)
            if status is None:
                state = status_blob = status_crc = None
                if inline_crc is not None:
                    chained_now[plan_id] = inline_crc
            else:
                state = status.state
                try:
                    status_blob = record_encode(status)
                except unencodable:
                    status_blob = encode(status)
                status_crc = crc(status_blob)
                if state in TERMINAL_STATES:
                    # No more inline events: its running checksum is dropped, and not sent to the other side of the
                    # writer process only to be dropped there (keys_message: a third of the checksums a plan).
                    ended.append(plan_id)
                elif inline_crc is not None:
                    chained_now[plan_id] = inline_crc
            if new:
                record = created[plan_id]
                try:
                    spec = record_encode(record)
                except unencodable:
                    spec = encode(record)
                new_rows.append((rowid, plan_id, record.owner, record.order, state or "queued",
                                 spec, status_blob, inline, count, crc(spec), status_crc, inline_crc))  # fmt: skip
            else:
                updates.append((rowid, state, status_blob, inline, count, status_crc, inline_crc))
        # Key order: each B-tree page is visited once per group. Sorted as tuples, no key function: a plan's rowid
        # (first) is in one update and one spilled run a group at most, so no comparison goes past it, and
        # list.sort compares tuples of ints first in C without a key's call and list (~0.3k instructions a plan).
        updates.sort()
        spilled.sort()
        return new_rows, updates, spilled, chained_now, ended

    def _commit(
        self, doomed: list[tuple[int]], rows: _Rows, wait: bool,
        usage: tuple[list[tuple[int, str, str]], list[tuple[Any, ...]]] | None = None,
    ) -> bool:
        """The group's statements as one transaction, then the generation side file; False: the database was held.

        ``usage``: the usage ledger's keys to drop and rows to keep (:func:`_usage_rows`), in the same transaction.
        """
        new_rows, updates, spilled, _, _ = rows
        db = self._db
        try:
            if not self._begin(wait):
                return False
            try:
                # Multi-row statements: sqlite3 releases the GIL around every step, and under a busy
                # event loop each hand-back can wait a switch interval; one step per chunk of rows
                # instead of one per row keeps the writer from convoying with the loop.
                self._run_chunked(_DELETE_PLANS, "?", doomed)  # first: nothing below touches those rows
                self._run_chunked(_DELETE_EVENTS, "?", doomed)
                generation = self.generation + 1
                one_row = len(new_rows) + len(updates) == 1
                if one_row:
                    # Its row carries the generation: store_meta's page stays clean, one WAL frame less (a lone
                    # commit's: docs/PERFORMANCE.md §W29c). A later group that deletes the row records its own.
                    if new_rows:
                        db.execute(_INSERT_ONE_STAMPED, (*new_rows[0], generation))
                    else:
                        db.execute(_UPDATE_ONE_STAMPED, (*updates[0], generation))
                else:
                    self._run_chunked(_INSERT_PLANS, "(?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)", new_rows)
                    if len(updates) == 1:
                        # One step either way: the plain statement costs SQLite less than a join with a VALUES
                        # table (a lone plan's commit on the loop: docs/PERFORMANCE.md §D29c).
                        db.execute(UPDATE_ONE, updates[0])
                    elif self._update_status is UPDATE_ONE:  # the writer process (no other thread), an old SQLite
                        if updates:
                            db.executemany(UPDATE_ONE, updates)
                    else:
                        self._run_chunked(UPDATE_FROM, "(?, ?, ?, ?, ?, ?, ?)", updates)
                self._run_chunked(_INSERT_EVENTS, "(?, ?, ?, ?)", spilled)
                if usage is not None:
                    db.executemany(_DELETE_USAGE, usage[0])
                    db.executemany(_UPSERT_USAGE, usage[1])
                if not one_row:  # many rows (one page more is little among theirs), or none
                    db.execute(_SET_GENERATION, (generation,))
                db.execute("COMMIT")
            except BaseException:
                with contextlib.suppress(sqlite3.Error):
                    db.execute("ROLLBACK")
                raise
        except sqlite3.Error as exc:
            raise StoreError(f"cannot write the store {self.path}: {exc}") from exc
        self.generation += 1
        assert self._marker is not None
        try:
            self._marker.write(self.generation)
        except OSError as exc:
            raise StoreError(f"cannot write the store's generation file {self._marker.path}: {exc}") from exc
        return True

    def _committed(self, rows: _Rows, fresh: dict[str, int], forgotten: set[str]) -> None:
        """The in-memory keys follow a committed group only: a rolled-back one leaves nothing behind."""
        _, _, _, chained_now, ended = rows
        rowids, chained = self._rowids, self._events_crc
        for plan_id in forgotten:
            rowids.pop(plan_id, None)
            chained.pop(plan_id, None)
        if chained_now:
            chained.update(chained_now)
        for plan_id in ended:
            chained.pop(plan_id, None)
        if fresh:
            rowids.update(fresh)
            self._next_rowid += len(fresh)
        if self._share_keys:
            self._keys = (fresh, chained_now, ended, forgotten)

    def _stored_events_crc(self, rowid: int) -> int:
        """The inline events' checksum of a plan the writer has no value for (an ended plan, once more)."""
        row = self._db.execute("SELECT events_crc FROM plans WHERE rowid = ?", (rowid,)).fetchone()
        return int(row[0]) if row is not None and row[0] is not None else 0

    def _run_chunked(self, sql: str, row: str, rows: list[tuple[Any, ...]]) -> None:
        """Run ``sql`` (with ``{values}`` for the VALUES list) over ``rows`` in power-of-two chunks.

        Chunk sizes are powers of two up to :data:`_CHUNK` so only a handful of distinct
        statements exist and every one stays in sqlite3's statement cache.
        """
        if not rows:
            return
        if not self._multi_row:
            self._db.executemany(sql.format(values=row), rows)
            return
        start, total = 0, len(rows)
        statements = _STATEMENTS
        while start < total:
            size = min(_CHUNK, 1 << ((total - start).bit_length() - 1))
            text = statements.get((sql, size))
            if text is None:
                text = statements[sql, size] = sql.format(values=", ".join([row] * size))
            # chain: the rows' values flattened in C (a nested comprehension cost ~0.3 µs a row).
            self._db.execute(text, list(chain(*rows[start:start + size])) if size > 1 else rows[start])
            start += size

    def _encode(self, record: Record) -> bytes:
        try:
            return self._encoder.encode(record)
        except (TypeError, ValueError, OverflowError) as exc:
            # A payload msgpack cannot hold (e.g. a map with null keys that came in as JSON-ish
            # data) must not stop the coordinator: keep the record, with the payload as text.
            log.error("record payload cannot be stored; storing it as text", plan_id=getattr(record, "plan_id", None),
                      error=str(exc))  # fmt: skip
            return self._encoder.encode(as_text(record))

    def _encode_run(self, plan_id: str, run: list[StoredEvent]) -> bytes:
        """A run of events as one msgpack array of ``[kind, data, seq, attempt, ephemeral]`` arrays.

        A stored event leaves out its plan id (the row's) and its field names: a third of the
        bytes, which every later update of the plan's row writes again.
        """
        try:
            return self._encoder.encode(run)
        except (TypeError, ValueError, OverflowError):
            rows = []
            for kind, data, seq, attempt, ephemeral in run:
                try:
                    self._encoder.encode(data)
                    rows.append((kind, data, seq, attempt, ephemeral))
                except (TypeError, ValueError, OverflowError) as exc:
                    # A payload msgpack cannot hold (e.g. a map with null keys that came in as
                    # JSON-ish data) must not stop the coordinator: keep the event, data as text.
                    log.error("event data cannot be stored; storing it as text", plan_id=plan_id, error=str(exc))
                    rows.append((kind, not_storable(data), seq, attempt, ephemeral))
            return self._encoder.encode(rows)

    def drop_plans(self, damaged: dict[int, str]) -> None:
        """Delete the damaged plans (``--accept-store-loss``), so the next start finds a clean file."""
        keys = [(rowid,) for rowid in damaged]
        self._begin(wait=True)
        self._run_chunked(_DELETE_PLANS, "?", keys)
        self._run_chunked(_DELETE_EVENTS, "?", keys)
        self._db.execute(_SET_GENERATION, (self.generation,))  # a dropped row may have held it (schema.GENERATION)
        self._db.execute("COMMIT")
        gone = set(damaged)
        for plan_id in [p for p, rowid in self._rowids.items() if rowid in gone]:
            del self._rowids[plan_id]
            self._events_crc.pop(plan_id, None)
        self.losses.extend(f"{self.path}: {what}; the plan was dropped" for what in damaged.values())
