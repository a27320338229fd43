"""Each store declares its optional abilities (coordinator/io/stores/abilities.py); users read those, never probe."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from coordinator.io.stores.abilities import StoreAbilities
from coordinator.io.stores.commit import GroupCommitter
from coordinator.io.stores.integrity import StoreDamaged, report_accepted_losses
from coordinator.io.stores.sqlite import SQLiteStore
from coordinator.io.stores.store import DB_FILE, MemoryStore
from coordinator.records import Record, StoredPlan
from tests.unit.test_store import created


@pytest.fixture
def db(tmp_path: Path) -> Iterator[SQLiteStore]:
    store = SQLiteStore(tmp_path / DB_FILE)
    yield store
    store.close()


class Undeclared:
    """A SQLite store that has every optional method but declares none of them."""

    blocking = True
    abilities = StoreAbilities()

    def __init__(self, inner: SQLiteStore) -> None:
        self.inner = inner
        self.description = inner.description
        self.closed = False
        self.try_writes = 0
        self.losses = ["a loss nobody declared"]

    def load(self) -> list[StoredPlan]:
        return self.inner.load()

    def write(self, records: Sequence[Record]) -> None:
        self.inner.write(records)

    def try_write(self, records: Sequence[Record]) -> bool:
        self.try_writes += 1
        return self.inner.try_write(records)

    def check_files(self) -> None:
        raise StoreDamaged(self.inner.path, "a check nobody declared")

    def close(self) -> None:
        self.closed = True


def test_sqlite_declares_stream_try_write_check_files_and_losses(db: SQLiteStore) -> None:
    """The SQLite store declares its streamed load, loop commits, file check and losses; nothing of PostgreSQL's."""
    abilities = db.abilities
    assert abilities.stream is not None and abilities.try_write is not None and abilities.check_files is not None
    assert abilities.losses is db.losses
    assert abilities.away is None and abilities.make_committer is None and abilities.leases is None
    assert abilities.try_write([created("a")]) and [p.created.plan_id for p in abilities.stream()] == ["a"]


def test_the_memory_store_declares_nothing_optional_but_the_usage_ledger() -> None:
    """MemoryStore's abilities are empty but ``usage``: it streams nothing, commits only by write, never loses."""
    store = MemoryStore()
    assert store.abilities == StoreAbilities(usage=store.load_usage)


async def test_the_committer_uses_only_declared_abilities(db: SQLiteStore) -> None:
    """A store's try_write and check_files methods that its abilities do not declare are never called."""
    store = Undeclared(db)
    released: list[int] = []
    failures: list[BaseException] = []
    done = asyncio.Event()

    def release(n: int) -> None:
        released.append(n)
        done.set()

    committer: GroupCommitter[int] = GroupCommitter(store, release, failures.append)
    committer.start()
    try:
        committer.submit([created("a")], 1)
        await asyncio.wait_for(done.wait(), 10)
    finally:
        await committer.close()
    assert released == [1] and failures == [] and store.try_writes == 0
    assert [p.created.plan_id for p in db.load()] == ["a"]


def test_accepted_losses_are_read_from_the_abilities(db: SQLiteStore) -> None:
    """The losses reported are the declared ones: a store's undeclared ``losses`` attribute counts for nothing."""
    db.losses.append("plan p1 was dropped")
    with capture_logs() as logs:
        assert report_accepted_losses(db) == 1
        assert report_accepted_losses(Undeclared(db)) == 0
    assert [entry["loss"] for entry in logs] == ["plan p1 was dropped"]
