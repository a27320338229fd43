"""The one-shard fence of a lone commit (pg_schema.py ``_ONE_SHARD_FENCE``): the lease row read by its key and locked
FOR SHARE, no join and no count, and the same guarantee as the array form's: a takeover committed while the commit
waits on the row's lock fences it, and nothing of it is written (a real PostgreSQL server: tests/pg.py; skipped
without one)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from coordinator.io.cluster.leases import ShardFenced
from coordinator.io.stores.pg_schema import commit_statement
from coordinator.io.stores.postgres import WRITER_SETTINGS, PgStore
from coordinator.records import PlanStatus
from tests.integration.test_pg_store import CLUSTER, hold
from tests.unit.test_store import created
from tests.waiting import until_async


async def _connect(dsn: str, **kwargs: Any) -> Any:
    import asyncpg  # type: ignore[import-untyped]

    return await asyncpg.connect(dsn, **kwargs)


def test_a_one_shard_lone_commits_plan_locks_the_lease_row_by_its_key_without_a_join_or_a_count(pg_dsn: str) -> None:
    """The writer's generic plan of a one-shard lone update: the lease row through its primary key under LockRows,
    the plan's row through its own; no Values Scan and Nested Loop (a join with the shard's VALUES) and no
    Aggregate (the fence's count, the answer's array_agg): nodes the backend set up at every execution."""
    hold(PgStore(pg_dsn, CLUSTER)).close()  # the schema
    update = commit_statement(False, False, True, False, lone=True, one_shard=True)
    args = "0, 1, 'o', 7, 0, 1, NULL, 'succeeded', '\\x00', NULL"

    async def plan() -> str:
        conn = await _connect(pg_dsn, server_settings=WRITER_SETTINGS)
        try:
            await conn.execute(f"PREPARE commit_update AS {update}")
            rows = await conn.fetch(f"EXPLAIN EXECUTE commit_update({args})")
            return "\n".join(r[0] for r in rows)
        finally:
            await conn.close()

    text = asyncio.run(plan())
    assert "$" in text, text  # the generic plan
    assert "LockRows" in text and "Index Scan using shard_leases_pkey on shard_leases" in text, text
    assert "Index Scan using fleetwire_plans_pkey on fleetwire_plans" in text, text
    for node in ("Values Scan", "Nested Loop", "Aggregate", "Seq Scan"):
        assert node not in text, (node, text)


@pytest.fixture
def store(held_store: PgStore) -> PgStore:
    return held_store  # (tests/integration/conftest.py)


@pytest.mark.parametrize("kind", ["insert", "update"])
async def test_a_takeover_committed_while_a_lone_commit_waits_on_the_lease_row_fences_it(
    store: PgStore, pg_dsn: str, kind: str
) -> None:
    """Another owner's UPDATE of every lease row, open while a lone commit runs: the commit waits on the row's lock;
    once the takeover commits, the commit finds the new owner and epoch, fails with ShardFenced and writes nothing."""
    await store.write_async([created("p", 1)])
    thief = await _connect(pg_dsn)
    watch = await _connect(pg_dsn)
    rows = "SELECT id, state, status, nevents FROM fleetwire_plans ORDER BY id"
    try:
        before = await watch.fetch(rows)
        takeover = thief.transaction()
        await takeover.start()
        await thief.execute("UPDATE shard_leases SET owner = 'thief', epoch = epoch + 1")
        late = [created("late", 2)] if kind == "insert" else [PlanStatus("p", "running", attempt=1, next_seq=1)]
        write = asyncio.ensure_future(store.write_async(late))
        waiting = "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND pid <> pg_backend_pid()"
        await until_async(lambda: watch.fetchval(waiting))  # the commit waits on the lease row the takeover holds
        assert not write.done()
        await takeover.commit()
        with pytest.raises(ShardFenced, match="no longer this coordinator's"):
            await asyncio.wait_for(write, 10)
        assert await watch.fetch(rows) == before and len(before) == 1
    finally:
        await thief.close()
        await watch.close()
