"""A big group the committer takes with nothing in flight is split (coordinator/io/stores/pg_commit.py, "Split when
nothing is in flight"; PgStore.encode_ahead(split=True), PgStore._send_split): its first third of plans encoded and
sent, the rest encoded while that statement is in flight, both in one transaction: the same stored plans as one
statement, all or nothing, and the next group encoded ahead only once the rest is. A real PostgreSQL server
(tests/pg.py; skipped without one)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from coordinator.io.stores.integrity import StoreError
from coordinator.io.stores.pg_commit import AHEAD_MIN_RECORDS, PipelinedCommitter
from coordinator.io.stores.pg_rows import RowGroup
from coordinator.io.stores.postgres import PgStore
from coordinator.records import PlanForgotten, PlanStatus, Record
from tests.integration.test_pg_store import CLUSTER, hold
from tests.pg import PostgresServer
from tests.unit.test_store import created, event

pytestmark = pytest.mark.timeout(120)


class SplitPgStore(PgStore):
    """A PgStore that splits groups of over 40 plans and logs each encoding and statement: ``("encode", statements
    begun, one in flight)``, ``("statement", its number)``; ``fail_at``: that statement fails once it has run;
    ``encode_fails``: an encoding with a statement in flight raises."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.split_min_plans = 40
        self.log: list[tuple[str, int, bool] | tuple[str, int]] = []
        self.statements = 0
        self.in_flight = False
        self.fail_at = 0
        self.encode_fails = False
        self.sending = asyncio.Event()  # set at the first statement

    def encode_rows(self, group: RowGroup, fresh_keys: list[int], stored: dict[int, int]) -> list[int]:
        self.log.append(("encode", self.statements, self.in_flight))
        if self.encode_fails and self.in_flight:
            raise ValueError("a bug in the encoding")
        return super().encode_rows(group, fresh_keys, stored)

    async def _commit(self, conn: Any, *args: Any) -> None:
        self.statements += 1
        self.log.append(("statement", self.statements))
        self.in_flight = True
        self.sending.set()
        try:
            await super()._commit(conn, *args)
        finally:
            self.in_flight = False
        if self.statements == self.fail_at:
            raise OSError("the connection broke after the statement ran")


def groups() -> list[list[Record]]:
    """Groups of 150 and 190 plans: inline and spilled runs, chains continued, plans ended, forgotten and one
    forgotten plan created again."""
    plans = [f"p{n}" for n in range(150)]
    return [
        [r for n, p in enumerate(plans) for r in (created(p, n), event(p, 1, p if n % 7 else "y" * 600))],
        [*(r for p in plans for r in (PlanStatus(p, "running", attempt=1, next_seq=3), event(p, 2, "r"),
                                      event(p, 3, "s"))),
         *(PlanForgotten(p) for p in plans[140:]), created("p145", 500, args="again"), event("p145", 1, "again")],
        [*(r for p in plans[:130] for r in (event(p, 4, "t"), PlanStatus(p, "succeeded", next_seq=5))),
         *(created(f"q{n}", 600 + n) for n in range(60))],
    ]  # fmt: skip


def stored(dsn: str) -> dict[str, Any]:
    check = PgStore(dsn, CLUSTER)
    try:
        return {p.created.plan_id: p for p in check.load()}
    finally:
        check.close()


async def seeded(store: SplitPgStore) -> SplitPgStore:
    """The store's writer open and a first write in turn (it takes a block of new keys and a reserve)."""
    await store.open_async()
    await store.write_async([created("seed", 0)])
    store.log.clear()
    store.statements = 0
    return store


async def test_a_split_group_stores_what_one_statement_stores(postgres: PostgresServer, pg_dsn: str) -> None:
    """The same groups encoded ahead whole and split: the same plans read back (every checksum verified); a split
    group's first part is encoded before its statement, the rest while that statement is in flight."""
    dsns = [pg_dsn, postgres.new_database()]
    whole = await seeded(hold(SplitPgStore(dsns[0], CLUSTER)))
    split = await seeded(hold(SplitPgStore(dsns[1], CLUSTER)))
    try:
        for store, splitting in ((whole, False), (split, True)):
            for group in groups():
                assert store.encode_ahead(group, splitting) and store.splitting is splitting
                await store.write_async(group)
                assert not store.splitting
            await store.close_async()
    finally:
        whole.close()
        split.close()
    assert whole.statements == 3 and split.statements == 6
    assert split.writes == whole.writes == 4 and split.records == whole.records
    assert split.log == [entry for n in (0, 2, 4) for entry in (("encode", n, False), ("statement", n + 1),
                                                                ("encode", n + 1, True), ("statement", n + 2))]
    one, two = stored(dsns[0]), stored(dsns[1])
    assert one == two and len(one) == 1 + 150 - 10 + 1 + 60
    assert [e.data for e in two["p145"].events] == ["again"] and two["p7"].events[0].data == "y" * 600
    assert two["p3"].status is not None and two["p3"].status.state == "succeeded"


async def test_a_failed_second_statement_leaves_nothing_of_the_group(pg_dsn: str) -> None:
    """The second statement of a split group fails after running: the write fails and nothing of the group, its
    first part included, is in the database."""
    store = await seeded(hold(SplitPgStore(pg_dsn, CLUSTER)))
    try:
        store.fail_at = 2
        group = groups()[0]
        assert store.encode_ahead(group, True)
        with pytest.raises(StoreError, match="connection broke"):
            await store.write_async(group)
        assert not store.splitting
        await store.close_async()
    finally:
        store.close()
    assert set(stored(pg_dsn)) == {"seed"}


async def test_an_encoding_that_fails_with_a_statement_in_flight_waits_for_it_and_rolls_back(pg_dsn: str) -> None:
    """The rest's encoding raises while the first part's statement is in flight: that statement ends first, the
    transaction rolls back (nothing of the group stored), the error is the write's, and the connection still
    commits the next group; the store no longer says it is splitting."""
    store = await seeded(hold(SplitPgStore(pg_dsn, CLUSTER)))
    try:
        store.encode_fails = True
        group = groups()[0]
        assert store.encode_ahead(group, True)
        with pytest.raises(ValueError, match="a bug"):
            await store.write_async(group)
        assert not store.splitting
        store.encode_fails = False
        await store.write_async([created("after", 1_000), event("after", 1, "x")])
        await store.close_async()
    finally:
        store.close()
    assert set(stored(pg_dsn)) == {"seed", "after"}


def big(prefix: str, order: int) -> list[Record]:
    """One batch of more than half a group's records (encoded ahead when gathered behind a group in flight)."""
    return [created(f"{prefix}{n}", order + n) for n in range(AHEAD_MIN_RECORDS + 952)]


async def test_the_committer_splits_a_group_taken_with_nothing_in_flight(pg_dsn: str) -> None:
    """A big batch taken with nothing in flight goes split; a big batch submitted meanwhile is encoded ahead only
    once the rest's statement is on its way, and goes whole; payloads come out in order, each once committed."""
    store = await seeded(hold(SplitPgStore(pg_dsn, CLUSTER)))
    released: list[Any] = []
    committer = PipelinedCommitter(store, released.append, lambda exc: None)
    try:
        committer.start()
        committer.submit(big("a", 0), "a")
        await asyncio.wait_for(store.sending.wait(), 30)  # "a" taken, its first part's statement on its way
        committer.submit(big("b", 10_000), "b")
        await committer.close()
    finally:
        store.close()
    assert store.log == [("encode", 0, False), ("statement", 1), ("encode", 1, True), ("statement", 2),
                         ("encode", 2, True), ("statement", 3)]  # fmt: skip
    assert released == ["a", "b"] and committer.transactions == 2 and committer.ahead == 2
    assert len(stored(pg_dsn)) == 1 + 2 * len(big("a", 0))
