"""The PostgreSQL committer encodes the next big group while the one before is in flight
(coordinator/io/stores/pg_commit.py, "Encoded ahead"; PgStore.encode_ahead): the same statement arguments as
encoding it after that commit, nothing of it released when the one before fails, and a group that needs the
database first is encoded in turn. A real PostgreSQL server (tests/pg.py; skipped without one)."""

from __future__ import annotations

import asyncio
import copy
from collections.abc import Sequence
from typing import Any

import pytest

from coordinator.io.cluster.leases import ShardFenced
from coordinator.io.stores.pg_commit import AHEAD_MIN_RECORDS, PipelinedCommitter
from coordinator.io.stores.postgres import PgStore
from coordinator.records import PlanForgotten, PlanStatus, Record
from tests.integration.test_pg_store import CLUSTER, hold, steal
from tests.pg import PostgresServer
from tests.unit.test_store import created, event

pytestmark = pytest.mark.timeout(120)


class RecordedPgStore(PgStore):
    """A PgStore that keeps each group commit's statement inputs, and when each encode_ahead ran."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.sent: list[Any] = []
        self.begun = self.returned = 0
        self.encoded_at: list[tuple[int, int, bool]] = []  # (commits begun, returned, ahead) at each encode_ahead
        self.during: list[Sequence[Record]] = []  # batches the test submits while the commit numbered `at` is in flight
        self.at = 0
        self.committer: PipelinedCommitter[Any] | None = None

    async def _commit(self, conn: Any, shards: list[int], epochs: list[int], doomed: list[int],
                      *rows: list[list[Any]]) -> None:  # fmt: skip
        self.sent.append(copy.deepcopy((shards, epochs, doomed, rows)))
        await super()._commit(conn, shards, epochs, doomed, *rows)

    def encode_ahead(self, records: Sequence[Record], split: bool = False) -> bool:
        ahead = super().encode_ahead(records, split)
        self.encoded_at.append((self.begun, self.returned, ahead))
        return ahead

    async def write_async(self, records: Sequence[Record]) -> None:
        self.begun += 1
        if self.begun == self.at and self.committer is not None:
            for n, batch in enumerate(self.during, 2):
                self.committer.submit(batch, n)
        await super().write_async(records)
        self.returned += 1


def groups() -> list[list[Record]]:
    """Group commits touching every piece of state the encoding reads: keys, shards, chained checksums, forgotten
    plans (a forgotten id created again), terminal plans (their chain dropped), inline and spilled runs."""
    plans = [f"p{n}" for n in range(200)]
    return [
        [r for n, p in enumerate(plans) for r in (created(p, n), event(p, 1, p))],  # a plan's chain starts in memory
        [*(r for p in plans for r in (PlanStatus(p, "running", attempt=1, next_seq=3), event(p, 2, p))),
         *(r for n in range(50) for r in (created(f"q{n}", 300 + n), event(f"q{n}", 1, "y" * 600 if n < 20 else "s")))],
        [*(event(p, 3, "x") for p in plans[:100]), *(PlanStatus(p, "succeeded", next_seq=4) for p in plans[:50]),
         *(PlanForgotten(p) for p in plans[150:160]), created("p150", 400, args="again"), event("p150", 1, "again"),
         *(event(f"q{n}", 2, "v") for n in range(20, 50))],
        [*(event(p, 4, "z") for p in plans[50:100]), event("p150", 2, "more"), created("p155", 401),
         *(event(f"q{n}", 3, "w") for n in range(20, 50)), PlanStatus("p60", "failed", next_seq=5)],
    ]  # fmt: skip


async def test_each_group_encoded_ahead_then_sent_matches_in_turn(postgres: PostgresServer, pg_dsn: str) -> None:
    """Each group encoded ahead while its predecessor's statement is built and sent after it gives the same statement
    arguments and stored plans as the same groups encoded in turn, through real commits."""
    dsns = [pg_dsn, postgres.new_database()]
    in_turn, ahead = (hold(RecordedPgStore(dsn, CLUSTER)) for dsn in dsns)
    try:
        for store in (in_turn, ahead):
            await store.open_async()
            await store.write_async([created("seed", 0)])
        for group in groups():
            await in_turn.write_async(group)
        made = groups()
        assert ahead.encode_ahead(made[0])
        for group, after in zip(made, [*made[1:], None], strict=True):
            sending = asyncio.ensure_future(ahead.write_async(group))
            await asyncio.sleep(0)  # the statement is on its way (its fence and rows were read from the group)
            if after is not None:
                assert ahead.encode_ahead(after)  # while the group before is in flight
            await sending
        assert len(ahead.sent) == len(in_turn.sent) == 5 and ahead.sent == in_turn.sent
    finally:
        for store in (in_turn, ahead):
            await store.close_async()
            store.close()
    stored = []
    for dsn in dsns:
        check = PgStore(dsn, CLUSTER)
        try:
            stored.append(check.load())
        finally:
            check.close()
    assert stored[0] == stored[1] and len(stored[0]) == 1 + 200 - 10 + 2 + 50


async def test_a_group_that_needs_the_database_first_is_not_encoded_ahead(pg_dsn: str) -> None:
    """No free keys, or an inline run whose chained checksum only the database holds: encode_ahead says no and
    changes nothing; the group is then written in turn as before."""
    store = hold(PgStore(pg_dsn, CLUSTER))
    try:
        await store.open_async()
        assert not store.encode_ahead([created("p")])
        assert store._free_keys == [] and store._keys == {}
        await store.write_async([created("p"), event("p", 1, "x" * 600)])  # the run spills
        del store._events_crc["p"]  # a chain only the database holds (the fallback: memory has none for the plan)
        free, keys, chained = list(store._free_keys), dict(store._keys), dict(store._events_crc)
        group: list[Record] = [event("p", 2, "a"), created("r", 2)]
        assert not store.encode_ahead(group)
        assert (store._free_keys, store._keys, store._events_crc) == (free, keys, chained)
        await store.write_async(group)
        await store.close_async()
    finally:
        store.close()
    check = PgStore(pg_dsn, CLUSTER)
    try:
        plans = {p.created.plan_id: p for p in check.load()}
        assert [e.data for e in plans["p"].events] == ["x" * 600, "a"] and set(plans) == {"p", "r"}
    finally:
        check.close()


def big(prefix: str, order: int) -> list[Record]:
    """One batch of more than half a group's records (encoded ahead when gathered behind a group in flight)."""
    return [created(f"{prefix}{n}", order + n) for n in range(AHEAD_MIN_RECORDS + 952)]


async def test_the_committer_encodes_the_next_big_group_while_one_is_in_flight(pg_dsn: str) -> None:
    """Two big batches arriving while a big group's commit is in flight: the first is encoded during that round
    trip, the second during the first's; payloads come out in order, each once its own group committed."""
    store = hold(RecordedPgStore(pg_dsn, CLUSTER))
    released: list[tuple[Any, int, int]] = []
    seed = asyncio.Event()
    committer = PipelinedCommitter(store, lambda p: (released.append((p, store.begun, store.returned)), seed.set()),
                                   lambda exc: None)  # fmt: skip
    store.committer, store.at, store.during = committer, 2, [big("b", 10_000), big("c", 20_000)]
    try:
        committer.start()
        committer.submit([created("seed")], 0)  # encoded in turn: it takes a block of keys (and a reserve)
        await asyncio.wait_for(seed.wait(), 30)
        committer.submit(big("a", 0), 1)  # encoded ahead (keys free): the group after it may be
        await committer.close()
    finally:
        store.close()
    # (commits begun, returned, encoded ahead) at each encode: "b" while "a" is in flight, "c" while "b" is.
    assert store.encoded_at == [(0, 0, False), (1, 1, True), (2, 1, True), (3, 2, True)] and committer.ahead == 3
    assert released == [(0, 1, 1), (1, 3, 2), (2, 4, 3), (3, 4, 4)] and committer.transactions == 4


async def test_a_failed_commit_releases_nothing_of_the_group_encoded_ahead_behind_it(pg_dsn: str) -> None:
    """The group in flight is fenced while the next one was already encoded ahead: on_failure once, the encoded
    group never sent nor released, and the committer stops."""
    store = hold(RecordedPgStore(pg_dsn, CLUSTER))
    store.split_min_plans = 0  # "b" goes whole (a split group's failure: test_pg_split)
    released: list[Any] = []
    failures: list[BaseException] = []
    first = asyncio.Event()
    committer = PipelinedCommitter(store, lambda p: (released.append(p), first.set()), failures.append)
    try:
        committer.start()
        committer.submit(big("a", 0), "a")  # takes a block of keys and a reserve: the next groups are encoded ahead
        await asyncio.wait_for(first.wait(), 30)
        steal(store)
        committer.submit(big("b", 10_000), "b")
        committer.submit(big("c", 20_000), "c")
        await committer.close()
    finally:
        store.close()
    assert released == ["a"] and len(failures) == 1 and isinstance(failures[0], ShardFenced)
    assert store.encoded_at[-1] == (2, 1, True) and store.begun == 2  # "c" encoded during "b"'s flight, never sent
