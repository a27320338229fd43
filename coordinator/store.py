"""Where the coordinator keeps plans across restarts: the ``Store`` interface and its two backends.

A store applies batches of records (``coordinator/records.py``) and gives every plan back on
start. It is the only part of the coordinator that touches a disk; the core never calls it
(the server does, through ``coordinator/commit.py``, off the event loop).

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

Tables (``PRAGMA user_version`` = 2; a version 1 file is migrated on open)::

    plans(id PRIMARY KEY, owner, ord, state, spec BLOB, status BLOB)   -- spec: the submit;
    events(plan, seq, body BLOB, PRIMARY KEY (plan, seq))              -- status: PlanStatus;
                                                                       -- plan: the plans rowid
"""

from __future__ import annotations

import contextlib
import fcntl
import operator
import os
import sqlite3
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

import msgspec
import structlog

from coordinator.records import PlanCreated, PlanStatus, Record, StoredPlan
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
SCHEMA_VERSION = 2


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
        return [StoredPlan(p.created, p.status, sorted(p.events, key=lambda e: e.seq)) for p in plans]

    def write(self, records: Sequence[Record]) -> None:
        self.writes += 1
        plans = self._plans
        for record in records:
            if isinstance(record, PlanCreated):
                plans.setdefault(record.plan_id, StoredPlan(record, None, []))
            elif isinstance(record, Event):
                stored = plans.get(record.plan_id)
                if stored is not None:
                    stored.events = [e for e in stored.events if e.seq != record.seq] + [record]
            else:
                stored = plans.get(record.plan_id)
                if stored is not None:
                    stored.status = record

    def close(self) -> None:
        # Closing keeps the records: a new server given this store restarts from them.
        self.closed = True


# --------------------------------------------------------------------------- sqlite

_SCHEMA = """
CREATE TABLE IF NOT EXISTS plans (
    id TEXT PRIMARY KEY,
    owner TEXT NOT NULL,
    ord INTEGER NOT NULL,
    state TEXT NOT NULL,
    spec BLOB NOT NULL,
    status BLOB
);
CREATE TABLE IF NOT EXISTS events (
    plan INTEGER NOT NULL,
    seq INTEGER NOT NULL,
    body BLOB NOT NULL,
    PRIMARY KEY (plan, seq)
) WITHOUT ROWID;
"""

# Version 1 keyed events by the plan's id: ids are random, so every group of events landed on
# B-tree pages all over the table (twice the writer's CPU). Version 2 keys them by the plan's
# rowid, which grows with submit order: new events append near the end of the table.
_MIGRATE_V1 = """
CREATE TABLE events_v2 (
    plan INTEGER NOT NULL,
    seq INTEGER NOT NULL,
    body BLOB NOT NULL,
    PRIMARY KEY (plan, seq)
) WITHOUT ROWID;
INSERT INTO events_v2 (plan, seq, body) SELECT plans.rowid, events.seq, events.body
    FROM events JOIN plans ON plans.id = events.plan_id;
DROP TABLE events;
ALTER TABLE events_v2 RENAME TO events;
"""


# OR REPLACE / the upsert keep what one row per record in order did: a plan id is created once
# (a re-created one keeps its first spec), a later row of the same key wins.
_INSERT_PLANS = (
    "INSERT INTO plans (rowid, id, owner, ord, state, spec, status) VALUES {values} ON CONFLICT(id) DO UPDATE SET "
    "state = CASE WHEN excluded.status IS NULL THEN plans.state ELSE excluded.state END, "
    "status = coalesce(excluded.status, plans.status)"
)
_INSERT_EVENTS = "INSERT OR REPLACE INTO events (plan, seq, body) VALUES {values}"
_UPDATE_FROM = (
    "UPDATE plans SET state = v.column2, status = v.column3 FROM (VALUES {values}) AS v WHERE plans.rowid = v.column1"
)
_UPDATE_ONE = "UPDATE plans SET state = ?2, status = ?3 WHERE rowid = ?1"
_first = operator.itemgetter(0)
_first_two = operator.itemgetter(0, 1)
_CHUNK = 128  # rows per statement: 7 x 128 parameters stays under SQLite's old 999 limit


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
            if version not in (0, 1, SCHEMA_VERSION):
                raise StoreError(
                    f"{path} has schema version {version}; this coordinator reads versions 1 and {SCHEMA_VERSION}"
                )
            if version == 1:
                # executescript commits first; the migration is one transaction with the version.
                self._db.executescript(f"BEGIN IMMEDIATE; {_MIGRATE_V1} PRAGMA user_version={SCHEMA_VERSION}; COMMIT;")
            self._db.executescript(_SCHEMA)
            self._db.execute(f"PRAGMA user_version={SCHEMA_VERSION}")
            # The events key: every plan's rowid (plans are never deleted).
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
        decode_event = msgspec.msgpack.Decoder(Event).decode
        plans: dict[int, StoredPlan] = {}
        try:
            for rowid, spec, status in self._db.execute("SELECT rowid, spec, status FROM plans ORDER BY ord"):
                created = decode_submit(spec)
                plans[rowid] = StoredPlan(created, decode_status(status) if status else None, [])
            for plan, body in self._db.execute("SELECT plan, body FROM events ORDER BY plan, seq"):
                stored = plans.get(plan)
                if stored is not None:
                    stored.events.append(decode_event(body))
        except (sqlite3.Error, msgspec.DecodeError) as exc:
            raise StoreError(f"cannot read the store {self.path}: {exc}") from exc
        return list(plans.values())

    def _encode(self, record: Record) -> bytes:
        try:
            return self._encoder.encode(record)
        except (TypeError, ValueError, OverflowError) as exc:
            # A payload msgpack cannot hold (e.g. a map with null keys that came in as JSON-ish
            # data) must not stop the coordinator: keep the record, with the payload as text.
            log.error("record payload cannot be stored; storing it as text", plan_id=record.plan_id, error=str(exc))
            return self._encoder.encode(_as_text(record))

    def write(self, records: Sequence[Record]) -> None:
        encode = self._encode
        created: dict[str, PlanCreated] = {}
        events: list[tuple[Any, ...]] = []
        latest: dict[str, PlanStatus] = {}  # a status is a whole snapshot: the group's last one per plan is enough
        event_records: list[Event] = []
        for record in records:
            if isinstance(record, Event):
                event_records.append(record)
            elif isinstance(record, PlanStatus):
                latest[record.plan_id] = record
            else:
                created.setdefault(record.plan_id, record)
        # A plan created in this group is inserted with its latest status: one row, not an INSERT
        # and an UPDATE. The others get their status by one UPDATE ... FROM (VALUES ...).
        new_rows: list[tuple[Any, ...]] = []
        rowids = self._rowids
        fresh: dict[str, int] = {}  # rowids of plans new in this group
        for plan_id, record in created.items():
            status = latest.pop(plan_id, None)
            rowid = rowids.get(plan_id)
            if rowid is None:
                rowid = fresh[plan_id] = self._next_rowid + len(fresh)
            new_rows.append((rowid, plan_id, record.owner, record.order,
                             status.state if status is not None else "queued",
                             encode(record), encode(status) if status is not None else None))  # fmt: skip
        for event in event_records:
            # An event of a plan never created is dropped: load() would never return it.
            plan = fresh.get(event.plan_id) or rowids.get(event.plan_id)
            if plan is not None:
                events.append((plan, event.seq, encode(event)))
        statuses = [(rowids[plan_id], status.state, encode(status)) for plan_id, status in latest.items()
                    if plan_id in rowids]  # a status of a plan never created matches no row: skipped  # fmt: skip
        # Key order: plan ids are random, so rows in arrival order touch B-tree pages at random;
        # sorted, each page is visited once per group (the sort is stable: a later event of the
        # same (plan, seq) still wins).
        new_rows.sort(key=_first)
        events.sort(key=_first_two)
        statuses.sort(key=_first)
        db = self._db
        try:
            db.execute("BEGIN IMMEDIATE")
            try:
                # Multi-row statements: sqlite3 releases the GIL around every step, and under a busy
                # event loop each hand-back can wait a switch interval; one step per chunk of rows
                # instead of one per row keeps the writer from convoying with the loop.
                self._run_chunked(_INSERT_PLANS, "(?, ?, ?, ?, ?, ?, ?)", new_rows)
                self._run_chunked(_INSERT_EVENTS, "(?, ?, ?)", events)
                self._run_chunked(self._update_status, "(?, ?, ?)", statuses)
                db.execute("COMMIT")
            except BaseException:
                with contextlib.suppress(sqlite3.Error):
                    db.execute("ROLLBACK")
                raise
        except sqlite3.Error as exc:
            raise StoreError(f"cannot write the store {self.path}: {exc}") from exc
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


def _as_text(record: Record) -> Record:
    """``record`` with its free-form payloads (args, data, result, error detail) replaced by their repr."""
    def text(value: Any) -> str:
        return f"<not storable: {value!r:.200}>"

    if isinstance(record, Event):
        return msgspec.structs.replace(record, data=text(record.data))
    if isinstance(record, PlanStatus):
        error = record.error
        if error is not None and error.detail is not None:
            error = msgspec.structs.replace(error, detail=text(error.detail))
        return msgspec.structs.replace(record, result=text(record.result) if record.result is not None else None,
                                       error=error, history=[])  # fmt: skip
    return msgspec.structs.replace(record, submit=msgspec.structs.replace(record.submit, args=text(record.submit.args)))
