"""Where the coordinator keeps plans across restarts: the ``Store`` interface and its two backends.

A store applies batches of records (``coordinator/records.py``) and gives every plan back on
start. It is the only part of the coordinator that touches a disk; the core never calls it
(the server does, through ``coordinator/io/commit.py``, off the event loop).

* :class:`SQLiteStore` (the default, ``--store sqlite`` or ``sqlite:PATH``): one SQLite file in
  WAL mode with ``synchronous=FULL``, so a committed batch survives a power cut, not only a
  crash of the process. One :meth:`~Store.write` is one transaction and one fsync whatever
  the number of records in it: the committer groups every batch queued while the previous
  transaction was being written (group commit), so durability costs one fsync per group, not
  one per message. A lock file next to the database keeps a second coordinator off it.
* :class:`MemoryStore` (``--store memory``): records kept in this process only. A restart of
  the process loses everything; a new ``CoordinatorServer`` given the same ``MemoryStore``
  object gets every plan back (tests use that).

Another backend implements the three methods of :class:`Store` and sets ``blocking``.

Tables (``PRAGMA user_version`` = 3; a version 1 or 2 file is migrated on open)::

    plans(id, owner, ord, state, spec BLOB, status BLOB, events BLOB, nevents)  -- rowid: submit order
    events(plan, seq, body BLOB, PRIMARY KEY (plan, seq))

``id`` has no index: the store, the file's only writer, keeps every id's rowid in memory and
creates an id once.
``spec`` is the :class:`PlanCreated`, ``status`` the latest :class:`PlanStatus`. A plan's
durable events are stored in *runs*, the events of one plan in one group: a run of a plan's
first events (seq <= 15, <= 512 bytes) is appended to ``plans.events`` (``nevents`` events,
msgpack, without an array header) in the same row write as the plan's status; any other run
is one ``events`` row (``plan``: the plans rowid, ``seq``: the run's first seq, ``body``: a
msgpack array). An ordinary plan's whole lifecycle is then one row write per group.

A :class:`PlanForgotten` record (a finished plan past ``--plan-retention``) deletes the plan's
row and its events rows in the same transaction as the rest of its group; the schema is the
same, so the file keeps version 3. SQLite reuses the freed pages: the file stops growing once
as many plans are forgotten as are finished, but it does not shrink (``VACUUM`` it offline).
"""

from __future__ import annotations

import contextlib
import fcntl
import itertools
import operator
import os
import sqlite3
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, Protocol

import msgspec
import structlog

from coordinator.records import PlanCreated, PlanForgotten, PlanStatus, Record, StoredPlan
from protocol.messages import Event

__all__ = [
    "DB_FILE",
    "MemoryStore",
    "SQLiteStore",
    "Store",
    "StoreError",
    "default_data_dir",
    "open_store",
]

log = structlog.get_logger(__name__)

DB_FILE = "coordinator.sqlite3"
SCHEMA_VERSION = 3


class StoreError(ValueError):
    """A store cannot be opened or written; the message says what to do.

    A ``ValueError`` like the other configuration problems the CLI reports before it serves.
    """


class Store(Protocol):
    """What the coordinator needs from a store.

    Attributes:
        description: for logs and the startup line, e.g. ``sqlite:/var/lib/fleetwire/coordinator.sqlite3``.
        blocking: ``write`` does disk I/O: the server calls it from a writer thread.
        closed: ``close`` was called (``/readyz`` reports it).
    """

    description: str
    blocking: bool
    closed: bool

    def load(self) -> list[StoredPlan]:
        """Every plan held, in submit order."""
        ...

    def write(self, records: Sequence[Record]) -> None:
        """Apply ``records`` atomically; on return they are durable.

        Raises:
            StoreError: nothing of the batch was applied.
        """
        ...

    def close(self) -> None:
        """Release the store; a second call does nothing."""
        ...


def default_data_dir() -> Path:
    """``$FLEETWIRE_DATA_DIR``, else ``$XDG_STATE_HOME/fleetwire``, else ``~/.local/state/fleetwire``."""
    explicit = os.environ.get("FLEETWIRE_DATA_DIR")
    if explicit:
        return Path(explicit)
    state_home = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(state_home) / "fleetwire"


def open_store(spec: str, data_dir: str | Path | None = None) -> Store:
    """The store a ``--store`` value names.

    Args:
        spec: ``memory``, ``sqlite`` (the file ``coordinator.sqlite3`` in ``data_dir``) or
            ``sqlite:PATH``.
        data_dir: where ``sqlite`` keeps its file; default :func:`default_data_dir`.

    Raises:
        StoreError: an unknown spec, or the database cannot be opened.
    """
    if spec == "memory":
        return MemoryStore()
    if spec == "sqlite":
        return SQLiteStore((Path(data_dir) if data_dir is not None else default_data_dir()) / DB_FILE)
    if spec.startswith("sqlite:") and len(spec) > len("sqlite:"):
        return SQLiteStore(Path(spec[len("sqlite:"):]))
    raise StoreError(f"unknown store {spec!r}: use 'sqlite' (the default), 'sqlite:PATH' or 'memory'")


# --------------------------------------------------------------------------- memory


class MemoryStore:
    """Records kept in this process: survives a server restart in-process, not a process restart."""

    description = "memory"
    blocking = False

    def __init__(self) -> None:
        self._plans: dict[str, StoredPlan] = {}
        self.writes = 0  # batches applied
        self.closed = False

    def load(self) -> list[StoredPlan]:
        self.closed = False  # a server starting on this store opens it again
        plans = sorted(self._plans.values(), key=lambda p: p.created.order)
        return [StoredPlan(p.created, p.status, _by_seq(p.events)) for p in plans]

    def write(self, records: Sequence[Record]) -> None:
        self.writes += 1
        plans = self._plans
        for record in records:
            if isinstance(record, PlanCreated):
                plans.setdefault(record.plan_id, StoredPlan(record, None, []))
            elif isinstance(record, PlanForgotten):
                plans.pop(record.plan_id, None)
            elif isinstance(record, Event):
                stored = plans.get(record.plan_id)
                if stored is not None:  # a seq written twice is resolved by load(): O(1) per event
                    stored.events.append(record)
            else:
                stored = plans.get(record.plan_id)
                if stored is not None:
                    stored.status = record

    def close(self) -> None:
        # Closing keeps the records: a new server given this store restarts from them.
        self.closed = True


# --------------------------------------------------------------------------- sqlite

# A table's definition as of the version that introduced it: the current schema and the
# migrations that reach it share these (a later version adds its own, never edits these).
_PLANS_V3 = """(
    id TEXT NOT NULL,
    owner TEXT NOT NULL,
    ord INTEGER NOT NULL,
    state TEXT NOT NULL,
    spec BLOB NOT NULL,
    status BLOB,
    events BLOB,
    nevents INTEGER NOT NULL DEFAULT 0
)"""
_EVENTS_V2 = """(
    plan INTEGER NOT NULL,
    seq INTEGER NOT NULL,
    body BLOB NOT NULL,
    PRIMARY KEY (plan, seq)
) WITHOUT ROWID"""

_SCHEMA = f"""
CREATE TABLE IF NOT EXISTS plans {_PLANS_V3};
CREATE TABLE IF NOT EXISTS events {_EVENTS_V2};
"""

# Version 1 keyed events by the plan's id: ids are random, so every group of events landed on
# B-tree pages all over the table (twice the writer's CPU). Version 2 keys them by the plan's
# rowid, which grows with submit order: new events append near the end of the table.
_MIGRATE_V1 = f"""
CREATE TABLE events_v2 {_EVENTS_V2};
INSERT INTO events_v2 (plan, seq, body) SELECT plans.rowid, events.seq, events.body
    FROM events JOIN plans ON plans.id = events.plan_id;
DROP TABLE events;
ALTER TABLE events_v2 RENAME TO events;
"""

# Version 2 wrote one events row per event (~5 per plan, plus the plan's row twice or more).
# Version 3 writes one row per plan per group: a plan's first events are appended to its own
# row, in the same statement as its status; an events row holds a run of events (a msgpack
# array), so a version 2 row becomes a run of one (0x91: array of one element).
#
# Version 3 also drops the unique index on plans.id: ids are random, so each group of new plans
# dirtied index pages all over the file (the whole index, in a busy run), and every dirty page
# is written to the WAL at the commit. The store keeps every id's rowid in memory and is the
# file's only writer (the lock file): it makes sure an id is created once. New plans now append
# at the end of the table, and the plans in flight, which a group updates, sit next to each other.
_MIGRATE_V2 = f"""
CREATE TABLE plans_v3 {_PLANS_V3};
INSERT INTO plans_v3 (rowid, id, owner, ord, state, spec, status)
    SELECT rowid, id, owner, ord, state, spec, status FROM plans;
DROP TABLE plans;
ALTER TABLE plans_v3 RENAME TO plans;
UPDATE events SET body = CAST(x'91' || body AS BLOB);
"""
MIGRATIONS = {1: _MIGRATE_V1, 2: _MIGRATE_V2}  # from version N to N + 1

# Where a plan's events go. A run (the events of one plan in one group) whose last seq is at
# most _INLINE_MAX_SEQ and whose encoding is at most _INLINE_MAX_BYTES is appended to the plan's
# own row: the whole lifecycle of an ordinary plan (queued ... succeeded) then costs no row of
# its own. Anything else (a long stream, a large payload) is one events row per run, so the
# plan's row, rewritten by every update, stays small (at most 15 runs of 512 bytes).
_INLINE_MAX_SEQ = 15  # also keeps every inline run under 16 events: a one-byte array header
_INLINE_MAX_BYTES = 512

_INSERT_PLANS = "INSERT INTO plans (rowid, id, owner, ord, state, spec, status, events, nevents) VALUES {values}"
_INSERT_EVENTS = "INSERT OR REPLACE INTO events (plan, seq, body) VALUES {values}"
_DELETE_PLANS = "DELETE FROM plans WHERE rowid IN ({values})"
_DELETE_EVENTS = "DELETE FROM events WHERE plan IN ({values})"  # the key's prefix: a range per plan
# SQLite's || gives text; CAST keeps the bytes (msgpack) as they are: the file is UTF-8 (SQLite's
# default, never changed here), so nothing is converted on the way.
_UPDATE_FROM = (
    "UPDATE plans SET state = coalesce(v.column2, state), status = coalesce(v.column3, status), "
    "events = CASE WHEN v.column4 IS NULL THEN events ELSE CAST(coalesce(events, x'') || v.column4 AS BLOB) END, "
    "nevents = nevents + v.column5 FROM (VALUES {values}) AS v WHERE plans.rowid = v.column1"
)
_UPDATE_ONE = (
    "UPDATE plans SET state = coalesce(?2, state), status = coalesce(?3, status), "
    "events = CASE WHEN ?4 IS NULL THEN events ELSE CAST(coalesce(events, x'') || ?4 AS BLOB) END, "
    "nevents = nevents + ?5 WHERE rowid = ?1"
)
_first = operator.itemgetter(0)
_first_two = operator.itemgetter(0, 1)
_seq = operator.attrgetter("seq")
_third = operator.itemgetter(2)
# Rows per statement. Multi-row statements need SQLite 3.33 (UPDATE ... FROM), whose limit is
# 32,766 parameters: 9 x 128 is far below it.
_CHUNK = 128


class SQLiteStore:
    """Plans in one SQLite file (WAL, ``synchronous=FULL``); one transaction per :meth:`write`.

    Args:
        path: the database file; its directory is created when missing.

    Raises:
        StoreError: the file cannot be opened, is not a fleetwire database of a known
            version, or another coordinator holds it.
    """

    blocking = True

    def __init__(self, path: Path) -> None:
        self.path = path
        self.description = f"sqlite:{path}"
        self.closed = False
        self.writes = 0  # transactions committed
        self.records = 0  # records written
        self._encoder = msgspec.msgpack.Encoder()
        self._lock_fd: int | None = None
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            self._lock(path.with_name(path.name + ".lock"))
            # check_same_thread=False: opened here, written by the committer's one thread, never
            # by two threads at once. isolation_level=None: transactions are explicit.
            self._db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=FULL")
            version = self._db.execute("PRAGMA user_version").fetchone()[0]
            if version not in (0, *MIGRATIONS, SCHEMA_VERSION):
                raise StoreError(
                    f"{path} has schema version {version}; this coordinator reads versions 1 to {SCHEMA_VERSION}"
                )
            if version in MIGRATIONS:
                # executescript commits first; the migration is one transaction with the version.
                steps = " ".join(MIGRATIONS[v] for v in range(version, SCHEMA_VERSION))
                self._db.executescript(f"BEGIN IMMEDIATE; {steps} PRAGMA user_version={SCHEMA_VERSION}; COMMIT;")
            self._db.executescript(_SCHEMA)
            self._db.execute(f"PRAGMA user_version={SCHEMA_VERSION}")
            # The events key: every plan's rowid (a forgotten plan's is dropped with its row).
            self._rowids: dict[str, int] = dict(self._db.execute("SELECT id, rowid FROM plans"))
            self._next_rowid = max(self._rowids.values(), default=0) + 1
            # UPDATE ... FROM needs SQLite 3.33; an older library writes one row per step.
            self._multi_row = sqlite3.sqlite_version_info >= (3, 33, 0)
            self._update_status = _UPDATE_FROM if self._multi_row else _UPDATE_ONE
        except (OSError, sqlite3.Error) as exc:
            self.close()
            raise StoreError(f"cannot open the store {path}: {exc}") from exc
        except StoreError:
            self.close()
            raise

    def _lock(self, lock_path: Path) -> None:
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 64).decode(errors="replace").strip() or "?"
            os.close(fd)
            raise StoreError(
                f"another coordinator (pid {holder}) is using {self.path}; stop it or give this one "
                "another --data-dir"
            ) from None
        os.ftruncate(fd, 0)
        os.write(fd, str(os.getpid()).encode())
        self._lock_fd = fd  # held until close(); the kernel releases it if the process dies

    def load(self) -> list[StoredPlan]:
        decode_submit = msgspec.msgpack.Decoder(PlanCreated).decode
        decode_status = msgspec.msgpack.Decoder(PlanStatus).decode
        # A version 2 events row (migrated to a run of one) holds a whole Event.
        decode_events = msgspec.msgpack.Decoder(list[_StoredEvent | Event]).decode
        plans: dict[int, StoredPlan] = {}
        try:
            rows = self._db.execute("SELECT rowid, id, spec, status, events, nevents FROM plans ORDER BY ord")
            for rowid, plan_id, spec, status, inline, count in rows:
                events = _events(plan_id, decode_events(_array_header(count) + inline)) if inline else []
                created = decode_submit(spec)
                plans[rowid] = StoredPlan(created, decode_status(status) if status else None, events)
            runs: set[int] = set()
            for plan, body in self._db.execute("SELECT plan, body FROM events ORDER BY plan, seq"):
                stored = plans.get(plan)
                if stored is not None:
                    stored.events.extend(_events(stored.created.plan_id, decode_events(body)))
                    runs.add(plan)
        except (sqlite3.Error, msgspec.DecodeError) as exc:
            raise StoreError(f"cannot read the store {self.path}: {exc}") from exc
        # A plan with events rows: its inline runs and its rows interleave by seq. The core never
        # writes a seq twice (next_seq is in every status); were one written again in two groups,
        # one inline and one in a row, the row's would be kept.
        for plan in runs:
            stored = plans[plan]
            stored.events = _by_seq(stored.events)
        return list(plans.values())

    def _encode(self, record: Record) -> bytes:
        try:
            return self._encoder.encode(record)
        except (TypeError, ValueError, OverflowError) as exc:
            # A payload msgpack cannot hold (e.g. a map with null keys that came in as JSON-ish
            # data) must not stop the coordinator: keep the record, with the payload as text.
            log.error("record payload cannot be stored; storing it as text", plan_id=record.plan_id, error=str(exc))
            return self._encoder.encode(_as_text(record))

    def _encode_run(self, plan_id: str, run: list[_StoredEvent]) -> bytes:
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
                    rows.append((kind, _text(data), seq, attempt, ephemeral))
            return self._encoder.encode(rows)

    def write(self, records: Sequence[Record]) -> None:
        created: dict[str, PlanCreated] = {}
        latest: dict[str, PlanStatus] = {}  # a status is a whole snapshot: the group's last one per plan is enough
        runs: dict[str, list[_StoredEvent]] = {}  # each plan's events in this group, in the order written
        forgotten: set[str] = set()  # plans deleted by this group (a later creation of the id is a new plan)
        for record in records:
            kind = type(record)
            if kind is Event:
                event: Event = record  # type: ignore[assignment]
                item = (event.kind, event.data, event.seq, event.attempt, event.ephemeral)
                run = runs.get(event.plan_id)
                if run is None:
                    runs[event.plan_id] = [item]
                else:
                    run.append(item)
            elif kind is PlanStatus:
                latest[record.plan_id] = record  # type: ignore[assignment]
            elif kind is PlanForgotten:
                # Records are applied in order: what this group wrote of the plan so far goes too.
                gone = record.plan_id
                created.pop(gone, None)
                latest.pop(gone, None)
                runs.pop(gone, None)
                forgotten.add(gone)
            else:
                created.setdefault(record.plan_id, record)  # type: ignore[arg-type]
        rowids = self._rowids
        fresh: dict[str, int] = {}  # rowids of plans new in this group
        next_rowid = self._next_rowid
        doomed = [(rowids[plan_id],) for plan_id in forgotten if plan_id in rowids]
        for plan_id in created:
            # A plan id is created once while kept: a second creation keeps the first.
            if plan_id not in rowids or plan_id in forgotten:
                fresh[plan_id] = next_rowid + len(fresh)
        # Every plan this group touches, once. The core writes a status with every change, so
        # the statuses name them all; other callers may write events or creations alone.
        touched: Iterable[str] = latest
        if len(runs) > len(latest) or fresh.keys() - latest.keys() or runs.keys() - latest.keys():
            touched = {**fresh, **latest, **runs}
        encode, encode_run = self._encode, self._encode_run
        new_rows: list[tuple[Any, ...]] = []
        updates: list[tuple[Any, ...]] = []
        spilled: list[tuple[Any, ...]] = []  # runs that go to the events table
        for plan_id in touched:
            rowid = fresh.get(plan_id) or (None if plan_id in forgotten else rowids.get(plan_id))
            if rowid is None:
                continue  # a record of a plan never created (or deleted): load() would never return it
            inline: bytes | None = None
            count = 0
            run = runs.get(plan_id)
            if run is not None:
                if len(run) > 1:
                    run = _run_by_seq(run)
                body = encode_run(plan_id, run)
                last = run[-1][2]
                if last <= _INLINE_MAX_SEQ and len(run) < 16 and len(body) <= _INLINE_MAX_BYTES:
                    inline, count = body[1:], len(run)  # without its one-byte array header
                else:
                    spilled.append((rowid, run[0][2], body))
            status = latest.get(plan_id)
            if status is None:
                state = status_blob = None
            else:
                state, status_blob = status.state, encode(status)
            if plan_id in fresh:
                record = created[plan_id]
                new_rows.append((rowid, plan_id, record.owner, record.order, state or "queued",
                                 encode(record), status_blob, inline, count))  # fmt: skip
            else:
                updates.append((rowid, state, status_blob, inline, count))
        # Key order: each B-tree page is visited once per group.
        updates.sort(key=_first)
        spilled.sort(key=_first_two)
        db = self._db
        try:
            db.execute("BEGIN IMMEDIATE")
            try:
                # Multi-row statements: sqlite3 releases the GIL around every step, and under a busy
                # event loop each hand-back can wait a switch interval; one step per chunk of rows
                # instead of one per row keeps the writer from convoying with the loop.
                self._run_chunked(_DELETE_PLANS, "?", doomed)  # first: nothing below touches those rows
                self._run_chunked(_DELETE_EVENTS, "?", doomed)
                self._run_chunked(_INSERT_PLANS, "(?, ?, ?, ?, ?, ?, ?, ?, ?)", new_rows)
                self._run_chunked(self._update_status, "(?, ?, ?, ?, ?)", updates)
                self._run_chunked(_INSERT_EVENTS, "(?, ?, ?)", spilled)
                db.execute("COMMIT")
            except BaseException:
                with contextlib.suppress(sqlite3.Error):
                    db.execute("ROLLBACK")
                raise
        except sqlite3.Error as exc:
            raise StoreError(f"cannot write the store {self.path}: {exc}") from exc
        for plan_id in forgotten:  # only once committed, like the new rowids below
            rowids.pop(plan_id, None)
        if fresh:  # only once committed: a rolled-back group leaves no rowid behind
            rowids.update(fresh)
            self._next_rowid += len(fresh)
        self.writes += 1
        self.records += len(records)

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
        while start < total:
            size = min(_CHUNK, 1 << ((total - start).bit_length() - 1))
            params = [value for r in rows[start:start + size] for value in r]
            self._db.execute(sql.format(values=", ".join([row] * size)), params)
            start += size

    def close(self) -> None:
        self.closed = True
        db = getattr(self, "_db", None)
        if db is not None:
            with contextlib.suppress(sqlite3.Error):
                db.close()
            self._db = None  # type: ignore[assignment]
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None


_StoredEvent = tuple[str, Any, int, int, bool]  # kind, data, seq, attempt, ephemeral


def _events(plan_id: str, stored: list[_StoredEvent | Event]) -> list[Event]:
    """The events of plan ``plan_id`` from their stored form."""
    return [Event(plan_id=plan_id, kind=e[0], data=e[1], seq=e[2], attempt=e[3], ephemeral=e[4])
            if type(e) is tuple else e for e in stored]  # type: ignore[misc]  # fmt: skip


def _by_seq(events: list[Event]) -> list[Event]:
    """``events`` in seq order, the last of each seq kept (``events`` itself when already so)."""
    if all(a.seq < b.seq for a, b in itertools.pairwise(events)):
        return events
    return sorted({e.seq: e for e in events}.values(), key=_seq)


def _run_by_seq(run: list[_StoredEvent]) -> list[_StoredEvent]:
    """A run of stored events in seq order, the last of each seq kept."""
    if len(run) == 2 and run[0][2] < run[1][2]:  # the usual case, without a generator
        return run
    if all(a[2] < b[2] for a, b in itertools.pairwise(run)):
        return run
    return sorted({e[2]: e for e in run}.values(), key=_third)


def _array_header(count: int) -> bytes:
    """The msgpack header of an array of ``count`` elements."""
    if count < 16:
        return bytes((0x90 | count,))
    if count < 1 << 16:
        return b"\xdc" + count.to_bytes(2, "big")
    return b"\xdd" + count.to_bytes(4, "big")


def _text(value: Any) -> str:
    """What is stored in place of a payload msgpack cannot hold."""
    return f"<not storable: {value!r:.200}>"


def _as_text(record: Record) -> Record:
    """``record`` with its free-form payloads (args, data, result, error detail) replaced by their repr."""
    text = _text

    if isinstance(record, Event):
        return msgspec.structs.replace(record, data=text(record.data))
    if isinstance(record, PlanStatus):
        error = record.error
        if error is not None and error.detail is not None:
            error = msgspec.structs.replace(error, detail=text(error.detail))
        return msgspec.structs.replace(record, result=text(record.result) if record.result is not None else None,
                                       error=error, history=[])  # fmt: skip
    if isinstance(record, PlanForgotten):
        return record  # an id only: always storable
    return msgspec.structs.replace(record, submit=msgspec.structs.replace(record.submit, args=text(record.submit.args)))
