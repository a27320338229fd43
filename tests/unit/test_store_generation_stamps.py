"""The SQLite store's generation stamped on the row of a group that writes one plan row (schema 6, schema.GENERATION).

Such a group leaves ``store_meta`` alone, so a lone plan's commit writes one WAL frame, not two;
the count of committed groups must still come back from the file after a crash, a deletion of the row with the
highest stamp, a dropped damaged plan or a migration, and a commit lost with the ``-wal`` must still be found.
"""

from __future__ import annotations

import shutil
import sqlite3
from pathlib import Path

import pytest

from coordinator.io.stores.integrity import StoreDamaged
from coordinator.io.stores.schema import SCHEMA_VERSION
from coordinator.io.stores.sqlite import SQLiteStore
from coordinator.io.stores.store import DB_FILE
from coordinator.records import PlanCreated, PlanForgotten, PlanStatus, Record, UsageRows
from protocol.messages import Event, Submit

WAL_FRAME = 24 + 4096  # a frame's header and a page of SQLite's default size


def created(plan_id: str, order: int) -> list[Record]:
    submit = Submit(req_id=order, op="echo", args=order, plan_id=plan_id)
    return [PlanCreated(plan_id, "alice", order, submit), Event(plan_id=plan_id, kind="queued", data={}, seq=1),
            PlanStatus(plan_id, "queued", next_seq=2)]  # fmt: skip


def step(plan_id: str, seq: int, state: str = "running") -> list[Record]:
    return [Event(plan_id=plan_id, kind="log", data=seq, seq=seq, attempt=1),
            PlanStatus(plan_id, state, 1, "w", next_seq=seq + 1)]  # fmt: skip


def meta_generation(store: SQLiteStore) -> int:
    return int(store._db.execute("SELECT generation FROM store_meta").fetchone()[0])


def crash_copy(store: SQLiteStore, dest: Path) -> Path:
    """The files as a kill -9 leaves them (database, -wal, generation file), copied while the store is open."""
    dest.mkdir()
    for suffix in ("", "-wal", ".generation"):
        shutil.copyfile(store.path.with_name(store.path.name + suffix), dest / (DB_FILE + suffix))
    return dest / DB_FILE


def test_a_commit_that_updates_one_plan_writes_one_wal_frame_and_leaves_store_meta_alone(tmp_path: Path) -> None:
    """Ten one-plan updates append ten WAL frames (the row's page), not twenty; store_meta keeps its number."""
    store = SQLiteStore(tmp_path / DB_FILE)
    store._db.execute("PRAGMA wal_autocheckpoint=0")
    assert store.try_write(created("a", 1))
    meta = meta_generation(store)
    wal = store.path.with_name(store.path.name + "-wal")
    before, generation = wal.stat().st_size, store.generation
    for seq in range(2, 12):
        assert store.try_write(step("a", seq))
    assert (wal.stat().st_size - before) // WAL_FRAME == 10
    assert store.generation == generation + 10 and meta_generation(store) == meta
    assert store._db.execute("SELECT gen FROM plans").fetchone()[0] == store.generation
    store.close()


def test_a_group_of_many_rows_records_its_generation_in_store_meta_and_stamps_none(tmp_path: Path) -> None:
    """Two plans created in one group, then both updated in one: store_meta holds the count, no row a stamp."""
    store = SQLiteStore(tmp_path / DB_FILE)
    store.write([*created("a", 1), *created("b", 2)])
    store.write([*step("a", 2), *step("b", 2)])
    assert meta_generation(store) == store.generation
    assert store._db.execute("SELECT max(gen) FROM plans").fetchone()[0] == 0
    store.close()


def test_after_a_crash_every_plan_and_the_count_come_back_from_the_stamps(tmp_path: Path) -> None:
    """A kill -9 after commits that only stamped rows: the start finds every plan, the count the marker holds."""
    store = SQLiteStore(tmp_path / "live" / DB_FILE)
    for i in range(5):
        store.write(created(f"p{i}", i + 1))
    for i in range(5):
        store.write(step(f"p{i}", 2, "succeeded"))
    copy = crash_copy(store, tmp_path / "crash")
    committed = store.generation
    store.close()
    again = SQLiteStore(copy)
    try:
        assert again.generation == committed and again.losses == []
        plans = again.load()
        assert [(p.created.plan_id, p.status and p.status.state) for p in plans] == [
            (f"p{i}", "succeeded") for i in range(5)
        ]
    finally:
        again.close()


def test_the_last_stamped_commit_cut_from_the_wal_is_found_behind_the_marker(tmp_path: Path) -> None:
    """The -wal's last frame (the last commit: one stamped row) lost after a crash: the start refuses, naming it."""
    store = SQLiteStore(tmp_path / "live" / DB_FILE)
    store.write(created("a", 1))
    for seq in range(2, 6):
        store.write(step("a", seq))
    copy = crash_copy(store, tmp_path / "crash")
    committed = store.generation
    store.close()
    wal = copy.with_name(copy.name + "-wal")
    with open(wal, "r+b") as f:
        f.truncate(wal.stat().st_size - WAL_FRAME)
    with pytest.raises(StoreDamaged, match=rf"holds {committed - 1} commits but .* says {committed} were acknowledged"):
        SQLiteStore(copy)


@pytest.mark.parametrize("last", ["forgotten", "forgotten and an update", "usage"])
def test_a_group_that_deletes_the_highest_stamp_or_writes_no_row_keeps_the_count(tmp_path: Path, last: str) -> None:
    """Forgetting the plan written last (alone: store_meta; with another plan's update: its stamp), or a group of
    usage rows alone (store_meta): a reopen finds the count."""
    path = tmp_path / DB_FILE
    store = SQLiteStore(path)
    store.write(created("old", 1))
    store.write(created("new", 2))
    store.write(step("new", 2, "succeeded"))  # "new" holds the highest stamp
    if last == "forgotten":
        store.write([PlanForgotten("new")])
    elif last == "usage":
        store.write([UsageRows([(3600, "alice", "web", [1.0])])])
    else:
        store.write([PlanForgotten("new"), *step("old", 2)])
    committed = store.generation
    assert (meta_generation(store) == committed) is (last != "forgotten and an update")
    store.close()
    again = SQLiteStore(path)
    assert again.generation == committed and again.losses == []
    assert [p.created.plan_id for p in again.load()] == (["old", "new"] if last == "usage" else ["old"])
    again.close()


def test_a_dropped_damaged_plan_that_held_the_highest_stamp_leaves_a_clean_start(tmp_path: Path) -> None:
    """--accept-store-loss drops the plan written last: the count stays (store_meta), the next start is clean."""
    path = tmp_path / DB_FILE
    store = SQLiteStore(path)
    store.write(created("old", 1))
    store.write([*created("new", 2), PlanStatus("new", "succeeded", 1, "w", next_seq=2, result="RESULT-new")])
    committed = store.generation
    store.close()  # checkpointed: the rows are in the main file
    data = bytearray(path.read_bytes())
    at = data.find(b"RESULT-new")
    data[at + 2] ^= 0x20
    path.write_bytes(bytes(data))
    accepting = SQLiteStore(path, accept_loss=True)
    assert [p.created.plan_id for p in accepting.load()] == ["old"] and len(accepting.losses) == 1
    accepting.close()
    again = SQLiteStore(path)
    assert again.generation == committed and again.losses == []
    again.close()


def test_a_version_5_file_keeps_its_count_and_stamps_from_then_on(tmp_path: Path) -> None:
    """A version 5 file (the count in store_meta, no stamps) is migrated with its count; later commits build on it."""
    path = tmp_path / DB_FILE
    store = SQLiteStore(path)
    store.write(created("a", 1))
    store.write(step("a", 2))
    committed = store.generation
    store.close()
    db = sqlite3.connect(path)
    db.executescript(f"ALTER TABLE plans DROP COLUMN gen; UPDATE store_meta SET generation = {committed};"
                     " PRAGMA user_version = 5;")  # fmt: skip
    db.close()
    old = SQLiteStore(path)
    assert old._db.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
    assert old.generation == committed and old.losses == []
    assert old.try_write(step("a", 3))
    assert meta_generation(old) == committed  # the stamp holds the new count
    old.close()
    again = SQLiteStore(path)
    assert again.generation == committed + 1 and again.losses == []
    again.close()
