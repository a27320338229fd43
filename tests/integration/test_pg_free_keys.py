"""The PostgreSQL store's reserve of new plan keys (coordinator/io/stores/postgres.py ``_take_keys``, ``encode_ahead``):
keys handed out lowest first, each once, and a group's keys taken off the reserve in place, not by copying the
~16,000 keys left at each group (docs/PERFORMANCE.md §C29j: ~80 µs of a lone commit's CPU). A real PostgreSQL
server (tests/pg.py; skipped without one)."""

from __future__ import annotations

import pytest

from coordinator.io.stores.postgres import PgStore
from coordinator.records import Record
from tests.integration.test_pg_store import CLUSTER, hold
from tests.unit.test_store import created, event

pytestmark = pytest.mark.timeout(120)


async def test_new_keys_go_lowest_first_once_each_taken_off_the_reserve_in_place(pg_dsn: str) -> None:
    """Lone groups (written in turn) and a group encoded ahead take the reserve's lowest keys, ascending, none twice;
    the reserve stays one list that only shrinks by the keys taken (no copy of the rest a group)."""
    store = hold(PgStore(pg_dsn, CLUSTER))
    try:
        await store.open_async()
        await store.write_async([created("p0"), event("p0", 1)])  # the first group fetches the blocks
        reserve = store._free_keys
        left = len(reserve)
        assert left >= 16 * 1024
        for n in range(1, 4):
            await store.write_async([created(f"p{n}"), event(f"p{n}", 1)])
            assert store._free_keys is reserve and len(reserve) == left - n
        ahead: list[Record] = [created(f"q{n}", n) for n in range(5)]
        assert store.encode_ahead(ahead)
        assert store._free_keys is reserve and len(reserve) == left - 3 - 5
        await store.write_async(ahead)
        keys = [store._keys[p] for p in [*(f"p{n}" for n in range(4)), *(f"q{n}" for n in range(5))]]
        assert keys == sorted(keys) and len(set(keys)) == 9
        assert keys[1:] == list(range(keys[1], keys[1] + 8))  # the reserve's lowest, in order
        assert min(reserve) > keys[-1] and len(set(reserve)) == len(reserve)
        await store.close_async()
    finally:
        store.close()
    check = PgStore(pg_dsn, CLUSTER)
    try:
        assert {p.created.plan_id for p in check.load()} == {*(f"p{n}" for n in range(4)), *(f"q{n}" for n in range(5))}
    finally:
        check.close()
