"""A plan's first inline events after a group that gave it none (created without events, or its first run
spilled) chain from 0 in memory, as the database's NULL ``events_crc`` says: no look-up of that checksum in
the database, one round trip per plan in turn (coordinator/io/stores/pg_rows.py ``_new_rows``, postgres.py ``load``).
A real PostgreSQL server (tests/pg.py; skipped without one)."""

from __future__ import annotations

from typing import Any

import pytest

from coordinator.io.stores.postgres import PgStore
from coordinator.records import PlanStatus, Record
from tests.integration.test_pg_store import CLUSTER, hold
from tests.unit.test_store import created, event

pytestmark = pytest.mark.timeout(120)


class CountedPgStore(PgStore):
    """A PgStore that counts its look-ups of a plan's chained checksum in the database."""

    lookups = 0

    async def _stored_events_crc(self, conn: Any, key: int) -> int:
        self.lookups += 1
        return await super()._stored_events_crc(conn, key)


def reloaded(dsn: str) -> dict[str, list[Any]]:
    """Each stored plan's event data, read back (every checksum verified) by a store of its own."""
    check = PgStore(dsn, CLUSTER)
    try:
        return {p.created.plan_id: [e.data for e in p.events] for p in check.load()}
    finally:
        check.close()


async def test_the_first_inline_events_of_a_plan_created_without_any_need_no_lookup(pg_dsn: str) -> None:
    """Plans created without events (or with a spilled first run), then given inline events: the group is encoded
    ahead (nothing to read first), no checksum is looked up, and every plan reads back sound."""
    store = hold(CountedPgStore(pg_dsn, CLUSTER))
    try:
        await store.open_async()
        plans = [f"p{n}" for n in range(50)]
        await store.write_async([*(created(p, n) for n, p in enumerate(plans)), created("s", 99),
                                 event("s", 1, "x" * 600)])  # fmt: skip
        group: list[Record] = [*(event(p, 1, p) for p in plans), event("s", 2, "a")]
        assert store.encode_ahead(group)
        await store.write_async(group)
        await store.write_async([*(event(p, 2, "b") for p in plans[:10]), PlanStatus("p0", "succeeded", next_seq=3)])
        assert store.lookups == 0
        await store.close_async()
    finally:
        store.close()
    stored = reloaded(pg_dsn)
    assert stored["s"] == ["x" * 600, "a"] and stored["p1"] == ["p1", "b"] and stored["p20"] == ["p20"]


async def test_after_a_restart_a_plan_without_inline_events_needs_no_lookup(pg_dsn: str) -> None:
    """A store that loaded a plan with no inline events yet (not ended) chains its first inline run from 0 without
    asking the database; the plan reads back sound."""
    first = hold(PgStore(pg_dsn, CLUSTER))
    try:
        first.write([created("p", 1), created("q", 2), event("q", 1, "y" * 600)])
    finally:
        first.close()
    store = hold(CountedPgStore(pg_dsn, CLUSTER))
    try:
        store.load()
        await store.open_async()
        group: list[Record] = [event("p", 1, "a"), event("q", 2, "b")]
        assert store.encode_ahead(group)
        await store.write_async(group)
        assert store.lookups == 0
        await store.close_async()
    finally:
        store.close()
    assert reloaded(pg_dsn) == {"p": ["a"], "q": ["y" * 600, "b"]}
