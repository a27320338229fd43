"""The many-shard fence (pg_schema.py FENCE with ``ok``): a group that writes two shards never takes the one-shard
form, and a takeover of ONE of its shards, committed while the group waits on that lease row's lock, fences the
whole group: nothing of it is written on either shard (a real PostgreSQL server: tests/pg.py; skipped without
one). A lone group (one row a part) across two shards takes the many-shard fence with the lone row parts."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from coordinator.io.cluster.leases import ShardFenced
from coordinator.io.stores import pg_schema
from coordinator.io.stores.postgres import PgStore
from coordinator.records import PlanCreated, PlanForgotten, PlanStatus
from coordinator.shards import pool_shard
from protocol.messages import Requirements, Submit
from tests.integration.test_pg_store import CLUSTER
from tests.unit.test_store import created
from tests.waiting import until_async


def _in_pool(plan_id: str, order: int, pool: str) -> PlanCreated:
    submit = Submit(req_id=1, op="echo", plan_id=plan_id, requirements=Requirements(tags=[f"pool:{pool}"]))
    return PlanCreated(plan_id, "alice", order, submit)


async def _connect(dsn: str) -> Any:
    import asyncpg  # type: ignore[import-untyped]

    return await asyncpg.connect(dsn)


@pytest.fixture
def store(held_store: PgStore) -> PgStore:
    return held_store  # (tests/integration/conftest.py)


@pytest.mark.parametrize("stolen", ["lower", "higher"])
@pytest.mark.parametrize("kind", ["lone", "group"])
async def test_a_takeover_of_one_of_a_groups_two_shards_fences_the_whole_group(
    store: PgStore, pg_dsn: str, monkeypatch: pytest.MonkeyPatch, kind: str, stolen: str
) -> None:
    """Two plans on two shards; another owner takes ONE of those shards over in a transaction left open while the
    group commits: the commit waits on that lease row, then fails with ShardFenced naming that shard, and no row
    of either shard changed (the other shard's lease still this store's)."""
    pools = {pool_shard(f"pool{i}", CLUSTER.shards): f"pool{i}" for i in range(40)}
    (low, pool_a), (high, pool_b) = sorted(pools.items())[:2]
    a, b = "a", "b"
    await store.write_async([_in_pool(a, 1, pool_a), _in_pool(b, 2, pool_b)])
    thief = await _connect(pg_dsn)
    watch = await _connect(pg_dsn)
    rows = "SELECT key, shard, state, status, nevents FROM fleetwire_plans ORDER BY key"
    try:
        before = await watch.fetch(rows)
        assert sorted(r["shard"] for r in before) == [low, high], before
        forms: list[tuple[bool, ...]] = []
        statement = pg_schema.commit_statement

        def seen(*parts: bool) -> str:
            forms.append(parts[-2:])
            return statement(*parts)

        monkeypatch.setattr("coordinator.io.stores.postgres.commit_statement", seen)
        takeover = thief.transaction()
        await takeover.start()
        victim = low if stolen == "lower" else high
        await thief.execute("UPDATE shard_leases SET owner = 'thief', epoch = epoch + 1 WHERE shard = $1", victim)
        if kind == "lone":  # one updated row, one deleted plan: a lone group over two shards
            late: list[Any] = [PlanStatus(a, "running", attempt=1, next_seq=1), PlanForgotten(b)]
        else:
            late = [PlanStatus(p, "running", attempt=1, next_seq=1) for p in (a, b)] + [created("late", 99)]
        write = asyncio.ensure_future(store.write_async(late))
        waiting = "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND pid <> pg_backend_pid()"
        await until_async(lambda: watch.fetchval(waiting))  # the commit waits on the stolen lease row
        assert not write.done()
        await takeover.commit()
        with pytest.raises(ShardFenced, match=rf"shard\(s\) \[{victim}\] is no longer"):
            await asyncio.wait_for(write, 10)
        assert forms == [(kind == "lone", False)]  # the many-shard form, lone rows or arrays
        assert await watch.fetch(rows) == before
        assert await watch.fetchval("SELECT count(*) FROM fleetwire_events") == 0
        kept = await watch.fetchval("SELECT owner FROM shard_leases WHERE shard = $1", high + low - victim)
        assert kept == store.owner
    finally:
        await thief.close()
        await watch.close()
