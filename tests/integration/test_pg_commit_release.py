"""The PostgreSQL committer sends the next gathered group before it releases the one that just committed
(coordinator/io/stores/pg_commit.py, "Pipelined"), so the database does not wait while the loop hands a group's
frames out; payloads still come out in order and only once their own group has committed. A real PostgreSQL
server (tests/pg.py; skipped without one)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import pytest

from coordinator.io.stores.pg_commit import PipelinedCommitter
from coordinator.io.stores.postgres import PgStore
from coordinator.records import Record
from tests.integration.test_pg_store import CLUSTER, hold
from tests.unit.test_store import created

pytestmark = pytest.mark.timeout(60)


class CountedPgStore(PgStore):
    """A PgStore that counts the group commits begun and those returned."""

    begun = 0
    returned = 0

    async def write_async(self, records: Sequence[Record]) -> None:
        self.begun += 1
        await super().write_async(records)
        self.returned += 1


@pytest.fixture
def pg(pg_dsn: str) -> Iterator[CountedPgStore]:
    store = CountedPgStore(pg_dsn, CLUSTER)
    hold(store)
    yield store
    store.close()


async def test_the_next_group_is_sent_before_the_last_ones_payloads_are_released(pg: CountedPgStore,
                                                                                pg_dsn: str) -> None:  # fmt: skip
    """Three batches gathered at once (a group each): each payload is released after its own commit returned and
    while the next group's commit is already under way; the last one, with nothing gathered behind it, at once."""
    seen: list[tuple[Any, int, int]] = []
    committer = PipelinedCommitter(pg, lambda p: seen.append((p, pg.begun, pg.returned)), lambda exc: None,
                                   max_group_records=1)  # fmt: skip
    committer.start()
    for n in range(1, 4):
        committer.submit([created(f"p{n}", n)], n)
    await committer.close()
    assert seen == [(1, 2, 1), (2, 3, 2), (3, 3, 3)]
    assert committer.transactions == 3
    check = PgStore(pg_dsn, CLUSTER)
    try:
        assert [p.created.plan_id for p in check.load()] == ["p1", "p2", "p3"]
    finally:
        check.close()
