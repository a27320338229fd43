"""The stores on real SQLite files in tmp_path, and group commit through the writer thread."""

from __future__ import annotations

import asyncio
import sqlite3
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from coordinator.io.stores import sqlite_commit
from coordinator.io.stores.commit import GroupCommitter
from coordinator.io.stores.schema import SCHEMA_VERSION
from coordinator.io.stores.sqlite import SQLiteStore
from coordinator.io.stores.store import DB_FILE, MemoryStore, StoreError, open_store
from coordinator.records import PlanCreated, PlanStatus, Record, StoredPlan
from protocol.messages import Done, ErrorInfo, Event, Submit, Subscribe
from tests.unit.test_durability_core import Durable, running_plan


def created(plan_id: str, order: int = 1, args: Any = None) -> PlanCreated:
    return PlanCreated(plan_id, "alice", order, Submit(req_id=1, op="echo", args=args, plan_id=plan_id))


def event(plan_id: str, seq: int, data: Any = None) -> Event:
    return Event(plan_id=plan_id, kind="log", data=data, seq=seq, attempt=1)


@pytest.fixture
def db(tmp_path: Path) -> Iterator[SQLiteStore]:
    store = SQLiteStore(tmp_path / DB_FILE)
    yield store
    store.close()


def test_sqlite_round_trip_across_reopen(tmp_path: Path) -> None:
    """Plans, events and the latest status written in batches come back, in submit order, after a reopen."""
    path = tmp_path / DB_FILE
    store = SQLiteStore(path)
    store.write([created("b", 2, args=b"\x00bytes"), event("b", 1), PlanStatus("b", "queued", next_seq=2)])
    store.write([created("a", 1, args={"k": [1, 2.5, None]}), event("a", 1, {"x": 1})])
    status = PlanStatus("b", "failed", attempt=2, worker_id="w1", next_seq=9,
                        error=ErrorInfo("handler_error", "boom", {"n": 1}), history=[{"attempt": 1}])  # fmt: skip
    store.write([event("b", 2, "two"), status])
    store.close()
    again = SQLiteStore(path)
    plans = again.load()
    again.close()
    assert [p.created.plan_id for p in plans] == ["a", "b"]
    a, b = plans
    assert a.created.submit.args == {"k": [1, 2.5, None]} and a.status is None
    assert b.created.submit.args == b"\x00bytes"
    assert b.status == status and [(e.seq, e.data) for e in b.events] == [(1, None), (2, "two")]


def test_sqlite_uses_wal_and_full_sync(db: SQLiteStore) -> None:
    """The database runs in WAL mode with synchronous=FULL (a commit survives a power cut)."""
    conn = sqlite3.connect(db.path)
    assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    conn.close()
    assert db._db.execute("PRAGMA synchronous").fetchone()[0] == 2  # FULL


def test_a_failed_write_applies_nothing(db: SQLiteStore) -> None:
    """A batch that fails halfway (here: a trigger refusing its events row) leaves no trace and raises StoreError."""
    # Events 1 and 99 make one run past the inline bound: the plan row is written, then the run's row fails.
    trigger = "CREATE TRIGGER refuse BEFORE INSERT ON events BEGIN SELECT RAISE(ABORT, 'no'); END"
    db._db.execute(trigger)
    with pytest.raises(StoreError, match="cannot write the store"):
        db.write([created("p"), event("p", 1), event("p", 99)])
    assert db.load() == []
    db.write([created("p"), event("p", 1)])
    assert [e.seq for e in db.load()[0].events] == [1]


def test_a_plan_id_is_created_once(db: SQLiteStore) -> None:
    """Creating an existing plan id again keeps the first record (the id is the idempotency key)."""
    db.write([created("p", args="first")])
    db.write([created("p", args="second")])
    assert db.load()[0].created.submit.args == "first"


def test_second_coordinator_on_the_same_file_is_refused(db: SQLiteStore) -> None:
    """A database already open by a coordinator cannot be opened by another: the error says so."""
    with pytest.raises(StoreError, match="another coordinator"):
        SQLiteStore(db.path)


def test_unknown_schema_version_is_refused(tmp_path: Path) -> None:
    """A file with a schema this coordinator does not know is not touched."""
    path = tmp_path / "x.sqlite3"
    conn = sqlite3.connect(path)
    conn.execute("PRAGMA user_version=7")
    conn.close()
    with pytest.raises(StoreError, match="schema version 7"):
        SQLiteStore(path)


def test_a_version_1_file_is_migrated_with_its_events(tmp_path: Path) -> None:
    """A schema-1 file (events keyed by plan id) opens as version 3 with every plan, status and event intact."""
    import msgspec

    path = tmp_path / DB_FILE
    encode = msgspec.msgpack.encode
    conn = sqlite3.connect(path)
    conn.executescript(
        "CREATE TABLE plans (id TEXT PRIMARY KEY, owner TEXT NOT NULL, ord INTEGER NOT NULL, state TEXT NOT NULL,"
        " spec BLOB NOT NULL, status BLOB);"
        "CREATE TABLE events (plan_id TEXT NOT NULL, seq INTEGER NOT NULL, body BLOB NOT NULL,"
        " PRIMARY KEY (plan_id, seq)) WITHOUT ROWID; PRAGMA user_version=1;"
    )
    status = PlanStatus("b", "running", attempt=1, worker_id="w", next_seq=3)
    conn.execute("INSERT INTO plans VALUES ('b', 'alice', 2, 'running', ?, ?)",
                 (encode(created("b", 2)), encode(status)))
    conn.execute("INSERT INTO plans VALUES ('a', 'alice', 1, 'queued', ?, NULL)", (encode(created("a", 1)),))
    for plan_id, seq in [("b", 2), ("a", 1), ("b", 1)]:
        conn.execute("INSERT INTO events VALUES (?, ?, ?)", (plan_id, seq, encode(event(plan_id, seq, seq))))
    conn.commit()
    conn.close()
    store = SQLiteStore(path)
    store.write([event("a", 2, "new"), PlanStatus("a", "queued", next_seq=3)])
    plans = store.load()
    assert store._db.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
    store.close()
    a, b = plans
    assert a.created.plan_id == "a" and [(e.seq, e.data) for e in a.events] == [(1, 1), (2, "new")]
    assert b.status == status and [(e.seq, e.data) for e in b.events] == [(1, 1), (2, 2)]


def test_a_version_2_file_is_migrated_with_its_events(tmp_path: Path) -> None:
    """A schema-2 file (one events row per event) opens as version 3; old and new events come back in seq order."""
    import msgspec

    path = tmp_path / DB_FILE
    encode = msgspec.msgpack.encode
    conn = sqlite3.connect(path)
    conn.executescript(
        "CREATE TABLE plans (id TEXT PRIMARY KEY, owner TEXT NOT NULL, ord INTEGER NOT NULL, state TEXT NOT NULL,"
        " spec BLOB NOT NULL, status BLOB);"
        "CREATE TABLE events (plan INTEGER NOT NULL, seq INTEGER NOT NULL, body BLOB NOT NULL,"
        " PRIMARY KEY (plan, seq)) WITHOUT ROWID; PRAGMA user_version=2;"
    )
    status = PlanStatus("b", "succeeded", attempt=1, worker_id="w", next_seq=3, result=b"\x00\xff")
    conn.execute("INSERT INTO plans VALUES ('a', 'alice', 1, 'queued', ?, NULL)", (encode(created("a", 1)),))
    conn.execute("INSERT INTO plans VALUES ('b', 'alice', 2, 'succeeded', ?, ?)",
                 (encode(created("b", 2)), encode(status)))  # fmt: skip
    old = {"a": [event("a", 1, "one")], "b": [event("b", 1, {"k": None}), event("b", 2, b"\x00")]}
    for rowid, plan_id in [(1, "a"), (2, "b")]:
        for e in old[plan_id]:
            conn.execute("INSERT INTO events VALUES (?, ?, ?)", (rowid, e.seq, encode(e)))
    conn.commit()
    conn.close()
    store = SQLiteStore(path)
    assert store._db.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
    store.write([event("a", 2, "new"), PlanStatus("a", "leased", attempt=1, worker_id="w", next_seq=3)])
    store.close()
    again = SQLiteStore(path)
    a, b = again.load()
    again.close()
    assert [encode(e) for e in a.events] == [encode(e) for e in [*old["a"], event("a", 2, "new")]]
    assert a.status == PlanStatus("a", "leased", attempt=1, worker_id="w", next_seq=3)
    assert [encode(e) for e in b.events] == [encode(e) for e in old["b"]] and b.status == status


def test_an_ordinary_lifecycle_is_one_row_and_replays_byte_identical(db: SQLiteStore) -> None:
    """A plan's lifecycle over four groups is held in its own row (no events row) and comes back byte for byte."""
    import msgspec

    steps = [
        [created("p"), event("p", 1, {}), PlanStatus("p", "queued", next_seq=2)],
        [event("p", 2, {"worker_id": "w", "attempt": 1}), PlanStatus("p", "leased", 1, "w", next_seq=3)],
        [event("p", 3, {"worker_id": "w", "attempt": 1}), event("p", 4, {"result": [1, "x"], "attempt": 1}),
         PlanStatus("p", "succeeded", 1, "w", next_seq=5, result=[1, "x"])],
    ]  # fmt: skip
    for batch in steps:
        db.write(batch)  # type: ignore[arg-type]
    (plan,) = db.load()
    assert db._db.execute("SELECT count(*) FROM events").fetchone()[0] == 0
    written = [r for batch in steps for r in batch if isinstance(r, Event)]
    assert [msgspec.msgpack.encode(e) for e in plan.events] == [msgspec.msgpack.encode(e) for e in written]
    assert plan.status == steps[-1][-1]


def test_a_long_stream_spills_to_event_rows_in_order(db: SQLiteStore) -> None:
    """Events past the inline bound, or too large for it, are rows of runs; all come back in seq order."""
    db.write([created("p"), event("p", 1), event("p", 2, "x" * 600), PlanStatus("p", "running", next_seq=3)])
    db.write([event("p", 3, "small"), PlanStatus("p", "running", next_seq=4)])
    for first in range(4, 60, 7):
        db.write([event("p", seq, seq) for seq in range(first, first + 7)])
    (plan,) = db.load()
    assert [e.seq for e in plan.events] == list(range(1, 60))
    assert plan.events[1].data == "x" * 600 and plan.events[2].data == "small" and plan.events[-1].data == 59
    # In the row: seq 3 and the run 4-10; seqs 1-2 (600 bytes) and every run reaching past 15 are rows.
    assert db._db.execute("SELECT nevents FROM plans").fetchone()[0] == 8
    assert db._db.execute("SELECT count(*) FROM events").fetchone()[0] == 1 + 7


def test_later_records_of_one_group_win(db: SQLiteStore) -> None:
    """In one write the last event of a (plan, seq) and the last status of a plan are what is kept."""
    db.write([created("p"), event("p", 1, "a"), event("p", 1, "b"), PlanStatus("p", "queued", next_seq=2),
              PlanStatus("p", "running", attempt=1, next_seq=2)])  # fmt: skip
    db.write([created("p", args="again"), PlanStatus("p", "succeeded", attempt=1, next_seq=3)])
    (plan,) = db.load()
    assert [(e.seq, e.data) for e in plan.events] == [(1, "b")]
    assert plan.status == PlanStatus("p", "succeeded", attempt=1, next_seq=3) and plan.created.submit.args is None


def test_one_row_per_step_when_sqlite_is_older_than_3_33(db: SQLiteStore) -> None:
    """Without multi-row UPDATE ... FROM (SQLite < 3.33) the same batches give the same plans back."""
    db._multi_row = False
    db._update_status = sqlite_commit.UPDATE_ONE
    db.write([created("p"), event("p", 1), PlanStatus("p", "queued", next_seq=2)])
    db.write([event("p", 2, "x"), event("p", 2, "y"), PlanStatus("p", "running", attempt=1, next_seq=3)])
    (plan,) = db.load()
    assert plan.status == PlanStatus("p", "running", attempt=1, next_seq=3)
    assert [(e.seq, e.data) for e in plan.events] == [(1, None), (2, "y")]


def test_a_group_updating_one_plan_runs_the_one_row_update_not_a_join(db: SQLiteStore) -> None:
    """One plan's update is the plain ``WHERE rowid`` statement (a lone commit's); two plans' the multi-row one."""
    db.write([created("p"), created("q"), PlanStatus("p", "queued", next_seq=1), PlanStatus("q", "queued", next_seq=1)])
    statements: list[str] = []
    db._db.set_trace_callback(statements.append)
    db.write([event("p", 1, "a"), PlanStatus("p", "running", attempt=1, next_seq=2)])
    updates = [s for s in statements if s.startswith("UPDATE plans")]
    assert len(updates) == 1 and "FROM (VALUES" not in updates[0] and "WHERE rowid" in updates[0]
    statements.clear()
    db.write([event("p", 2, "b"), PlanStatus("p", "succeeded", attempt=1, next_seq=3),
              PlanStatus("q", "running", attempt=1, next_seq=1)])  # fmt: skip
    assert [s for s in statements if s.startswith("UPDATE plans") and "FROM (VALUES" in s]
    db._db.set_trace_callback(None)
    plans = {plan.created.plan_id: plan for plan in db.load()}
    assert plans["p"].status == PlanStatus("p", "succeeded", attempt=1, next_seq=3)
    assert [(e.seq, e.data) for e in plans["p"].events] == [(1, "a"), (2, "b")]
    assert plans["q"].status == PlanStatus("q", "running", attempt=1, next_seq=1)


def test_payload_msgpack_cannot_hold_is_stored_as_text(db: SQLiteStore) -> None:
    """An event whose data msgpack cannot encode (a JSON peer's 2**70) is kept, with its data as text."""
    db.write([created("p"), event("p", 1, {"n": 2**70})])
    data = db.load()[0].events[0].data
    assert data == f"<not storable: {{'n': {2**70}}}>"


def test_status_result_msgpack_cannot_hold_is_stored_as_text(db: SQLiteStore) -> None:
    """A status whose result msgpack cannot encode is kept, with the result as text, next to a storable run."""
    db.write([created("p"), event("p", 1, "ok"), PlanStatus("p", "succeeded", attempt=1, next_seq=2, result=2**70)])
    (plan,) = db.load()
    assert plan.status is not None and plan.status.result == f"<not storable: {2**70}>"
    assert [(e.seq, e.data) for e in plan.events] == [(1, "ok")]


def test_a_run_out_of_seq_order_is_stored_in_order_last_of_each_seq(db: SQLiteStore) -> None:
    """One group's events of a plan written out of seq order, one seq twice: stored in order, the later kept."""
    db.write([created("p"), event("p", 3, "c"), event("p", 1, "a"), event("p", 2, "b"), event("p", 1, "a2"),
              PlanStatus("p", "running", attempt=1, next_seq=4)])  # fmt: skip
    db.write([event("p", 4, "d"), event("p", 5, "e"), event("p", 6, "f"), PlanStatus("p", "running", next_seq=7)])
    (plan,) = db.load()
    assert [(e.seq, e.data) for e in plan.events] == [(1, "a2"), (2, "b"), (3, "c"), (4, "d"), (5, "e"), (6, "f")]


def test_a_run_of_two_events_reversed_or_of_one_seq_is_stored_in_order_the_later_kept(db: SQLiteStore) -> None:
    """A group's two events of a plan, seq 2 before seq 1 (then one seq twice): stored in seq order, the later kept."""
    db.write([created("p"), event("p", 2, "b"), event("p", 1, "a"), PlanStatus("p", "running", next_seq=3)])
    db.write([event("p", 3, "c"), event("p", 3, "c2"), PlanStatus("p", "running", next_seq=4)])
    (plan,) = db.load()
    assert [(e.seq, e.data) for e in plan.events] == [(1, "a"), (2, "b"), (3, "c2")]


def test_blobs_and_nulls_are_bound_through_identity_adapters_found_in_the_registry() -> None:
    """The store registers sqlite3 adapters for bytes and None that return their argument: no failed lookup."""
    blob = b"\x92\x01\xc0"
    to_blob = sqlite3.adapters.get((bytes, sqlite3.PrepareProtocol))
    to_null = sqlite3.adapters.get((type(None), sqlite3.PrepareProtocol))
    assert to_blob is not None and to_null is not None
    assert to_blob(blob) is blob and to_null(None) is None
    conn = sqlite3.connect(":memory:")
    try:
        row = conn.execute("SELECT ?, typeof(?), ?, typeof(?)", (blob, blob, None, None)).fetchone()
        assert row == (blob, "blob", None, "null")
    finally:
        conn.close()


def test_open_store_specs(tmp_path: Path) -> None:
    """--store memory | sqlite (in the data dir) | sqlite:PATH; anything else is refused with the choices."""
    assert isinstance(open_store("memory"), MemoryStore)
    store = open_store("sqlite", tmp_path / "d")
    assert isinstance(store, SQLiteStore) and store.path == tmp_path / "d" / DB_FILE
    store.close()
    store = open_store(f"sqlite:{tmp_path / 'e.db'}")
    assert store.description == f"sqlite:{tmp_path / 'e.db'}"
    store.close()
    with pytest.raises(StoreError, match=r"'sqlite'.*'memory'"):
        open_store("postgres://x")


def test_core_restarts_from_a_sqlite_file(tmp_path: Path) -> None:
    """The core's own records, written to SQLite, restore a running plan after a restart on a new store."""
    store = SQLiteStore(tmp_path / DB_FILE)
    h = Durable()
    h.store = store  # type: ignore[assignment]
    _, _, plan_id = running_plan(h, args={"n": 1})
    store.close()
    h.store = SQLiteStore(tmp_path / DB_FILE)  # type: ignore[assignment]
    h.restart(now=100.0)
    plan = h.core.plans[plan_id]
    assert (plan.state, plan.attempt, plan.worker_id, plan.args) == ("running", 1, "w1", {"n": 1})
    assert h.core.registry.get("w1").leases == {plan_id}
    h.store.close()


def test_replay_after_a_restart_from_sqlite_is_byte_identical(tmp_path: Path) -> None:
    """Every event a watcher saw live (lifecycle, worker output, a long stream) replays byte for byte from the file."""
    import msgspec

    store = SQLiteStore(tmp_path / DB_FILE)
    h = Durable()
    h.store = store  # type: ignore[assignment]
    _, w, plan_id = running_plan(h, args={"blob": b"\x00\xff", "n": [1, 2.5, None]})
    c = h.client()  # a watcher: seqs 1-3 replayed from memory, then everything live
    h.send(c, Subscribe(req_id=2, plan_ids=[plan_id]))
    for seq in range(2, 40):  # past the inline bound: runs in the events table too
        h.send(w, Event(plan_id=plan_id, attempt=1, kind="log", data={"i": seq, "b": b"\x01" * seq}, seq=seq))
    h.send(w, Done(plan_id=plan_id, attempt=1, outcome="succeeded", result={"ok": True}, seq=40))
    live = h.events(c, plan_id)
    store.close()
    h.store = SQLiteStore(tmp_path / DB_FILE)  # type: ignore[assignment]
    h.restart(now=100.0)
    c2 = h.client()
    h.send(c2, Subscribe(req_id=3, plan_ids=[plan_id], from_seq=0))
    replayed = h.events(c2, plan_id)
    h.store.close()
    assert len(live) > 40 and [e.seq for e in live] == list(range(1, len(live) + 1))
    assert [msgspec.msgpack.encode(e) for e in replayed] == [msgspec.msgpack.encode(e) for e in live]


# ---------------------------------------------------------------- group commit


async def test_group_commit_releases_in_order_after_the_commit(db: SQLiteStore) -> None:
    """Payloads come out in submit order, each only once its batch is in the file; after() waits its turn."""
    released: list[Any] = []
    seen_in_file: list[int] = []

    def release(payload: Any) -> None:
        released.append(payload)
        if isinstance(payload, int):
            check = sqlite3.connect(db.path)
            seen_in_file.append(check.execute("SELECT COUNT(*) FROM plans").fetchone()[0])
            check.close()

    committer: GroupCommitter[Any] = GroupCommitter(db, release, lambda exc: None)
    committer.start()
    for n in range(1, 101):
        committer.submit([created(f"p{n}", n)], n)
        if n == 50:
            committer.after("after-50")
    await committer.close()
    assert released == [*range(1, 51), "after-50", *range(51, 101)]
    assert all(count >= n for n, count in zip(range(1, 101), seen_in_file, strict=True))
    assert committer.transactions < committer.batches == 100  # many batches per fsync


async def test_group_commit_failure_is_reported_and_nothing_more_is_released(db: SQLiteStore) -> None:
    """A failed write calls on_failure once and releases neither its payload nor later ones."""
    failures: list[BaseException] = []
    released: list[Any] = []
    committer: GroupCommitter[Any] = GroupCommitter(db, released.append, failures.append)
    committer.start()
    trigger = "CREATE TRIGGER refuse BEFORE INSERT ON plans WHEN NEW.id = 'bad' BEGIN SELECT RAISE(ABORT, 'x'); END"
    db._db.execute(trigger)
    committer.submit([created("bad")], "bad")
    await committer.close()
    committer.submit([created("later")], "later")
    committer.after("after")
    assert released == [] and len(failures) == 1 and isinstance(failures[0], StoreError)


async def test_memory_store_commits_synchronously() -> None:
    """With the memory store a payload is released in the call that submits it."""
    store = MemoryStore()
    released: list[Any] = []
    committer: GroupCommitter[Any] = GroupCommitter(store, released.append, lambda exc: None)
    committer.start()
    committer.submit([created("p")], "p")
    assert released == ["p"] and [s.created.plan_id for s in store.load()] == ["p"]


def test_memory_store_keeps_records_across_servers() -> None:
    """A MemoryStore given back after close() still holds every plan (in-process restarts)."""
    store = MemoryStore()
    records: list[Record] = [created("p"), event("p", 1), PlanStatus("p", "queued", next_seq=2)]
    store.write(records)
    store.close()
    assert store.load() == [StoredPlan(records[0], records[2], [records[1]])]  # type: ignore[arg-type, list-item]
    assert not store.closed


async def test_backlog_bound_holds_readers_until_the_writer_catches_up(db: SQLiteStore, tmp_path: Path) -> None:
    """Past max_backlog_bytes the committer says so, and drained() returns only once commits bring it under half."""
    released: list[Any] = []
    committer: GroupCommitter[Any] = GroupCommitter(db, released.append, lambda exc: None, max_backlog_bytes=1000)
    committer.start()
    blocker = sqlite3.connect(tmp_path / DB_FILE, isolation_level=None)
    blocker.execute("BEGIN IMMEDIATE")  # another writer holds the database: the store's writer waits
    for n in range(1, 4):
        committer.submit([created(f"p{n}", n)], n, size=400)
    assert committer.over and committer.backlog_bytes == 1200
    waiter = asyncio.create_task(committer.drained())
    await asyncio.sleep(0)
    assert not waiter.done() and released == []
    blocker.execute("ROLLBACK")
    await asyncio.wait_for(waiter, 10)
    assert committer.backlog_bytes <= 500 and committer.held_back == 1 and not committer.over
    await committer.close()
    blocker.close()
    assert released == [1, 2, 3] and committer.backlog_bytes == 0
