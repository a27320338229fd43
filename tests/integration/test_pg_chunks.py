"""A big group encoded in turn goes as one transaction of two statements, its first third of plans and the rest, the
rest encoded while the first is in flight (coordinator/io/stores/postgres.py ``PgStore._send_chunks``): the same
stored plans as one statement, all or nothing. A real PostgreSQL server (tests/pg.py; skipped without one)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest

from coordinator.io.stores.integrity import StoreError
from coordinator.io.stores.postgres import PgStore, _Group
from coordinator.records import PlanForgotten, PlanStatus, Record
from tests.integration.test_pg_store import CLUSTER, hold
from tests.pg import PostgresServer
from tests.unit.test_store import created, event

pytestmark = pytest.mark.timeout(120)


class ChunkedPgStore(PgStore):
    """A PgStore that splits groups of over 40 plans and notes, at each encoding, whether a statement is in flight;
    ``fail_at``: the statement numbered so (from 1) fails once it has run; ``encode_fails``: an encoding of a group
    with a statement in flight raises."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.split_min_plans = 40
        self.statements = 0
        self.in_flight = False
        self.encoded_in_flight: list[bool] = []
        self.fail_at = 0
        self.encode_fails = False

    def _encode_rows(self, group: _Group, fresh_keys: list[int], stored: dict[int, int]) -> list[int]:
        self.encoded_in_flight.append(self.in_flight)
        if self.encode_fails and self.in_flight:
            raise ValueError("a bug in the encoding")
        return super()._encode_rows(group, fresh_keys, stored)

    async def _commit(self, conn: Any, *args: Any) -> None:
        self.statements += 1
        self.in_flight = True
        try:
            await super()._commit(conn, *args)
        finally:
            self.in_flight = False
        if self.statements == self.fail_at:
            raise OSError("the connection broke after the statement ran")


def groups() -> list[list[Record]]:
    """Groups of 150 and 190 plans: inline and spilled runs, chains continued, plans ended, forgotten and
    one forgotten plan created again."""
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


async def write(store: PgStore, batches: Sequence[list[Record]]) -> None:
    await store.open_async()
    try:
        for batch in batches:
            await store.write_async(batch)
    finally:
        await store.close_async()


async def test_a_big_group_in_chunks_stores_what_one_statement_stores(postgres: PostgresServer, pg_dsn: str) -> None:
    """The same groups through one statement each and split in two: the same plans read back (every checksum
    verified); the second part of each is encoded while the first part's statement is in flight."""
    dsns = [pg_dsn, postgres.new_database()]
    whole, chunked = hold(ChunkedPgStore(dsns[0], CLUSTER)), hold(ChunkedPgStore(dsns[1], CLUSTER))
    whole.split_min_plans = 0
    try:
        await write(whole, groups())
        await write(chunked, groups())
    finally:
        whole.close()
        chunked.close()
    assert whole.statements == 3 and chunked.statements == 6
    assert chunked.encoded_in_flight == [False, True] * 3
    assert chunked.writes == whole.writes == 3 and chunked.records == whole.records
    one, many = stored(dsns[0]), stored(dsns[1])
    assert one == many and len(one) == 150 - 10 + 1 + 60
    assert [e.data for e in many["p145"].events] == ["again"] and many["p7"].events[0].data == "y" * 600
    assert many["p3"].status is not None and many["p3"].status.state == "succeeded"


async def test_a_failed_chunk_leaves_nothing_of_its_group(pg_dsn: str) -> None:
    """The second statement of a split group fails after running: the write fails and nothing of the group, its
    first part included, is in the database; the store's keys and chains stay as before the group."""
    store = hold(ChunkedPgStore(pg_dsn, CLUSTER))
    made = groups()
    try:
        await store.open_async()
        await store.write_async(made[0])
        keys, chained = dict(store._keys), dict(store._events_crc)
        store.fail_at = store.statements + 2
        with pytest.raises(StoreError, match="connection broke"):
            await store.write_async(made[1])
        assert (store._keys, store._events_crc) == (keys, chained) and store.writes == 1
        await store.close_async()
    finally:
        store.close()
    plans = stored(pg_dsn)
    assert len(plans) == 150 and all(p.status is None and len(p.events) == 1 for p in plans.values())


async def test_an_encoding_that_fails_with_a_statement_in_flight_waits_for_it_and_rolls_back(pg_dsn: str) -> None:
    """The second part's encoding raises while the first part's statement is in flight: that statement ends first,
    the transaction rolls back (nothing of the group stored), the error is the write's, and the connection still
    commits the next group."""
    store = hold(ChunkedPgStore(pg_dsn, CLUSTER))
    made = groups()
    try:
        await store.open_async()
        store.encode_fails = True
        with pytest.raises(ValueError, match="a bug"):
            await store.write_async(made[0])
        store.encode_fails = False
        await store.write_async([created("after", 1_000), event("after", 1, "x")])
        await store.close_async()
    finally:
        store.close()
    assert set(stored(pg_dsn)) == {"after"}
