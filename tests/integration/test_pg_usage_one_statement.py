"""The usage ledger's rows in the group's one commit statement (pg_schema.py ``commit_statement``'s ``usage_gone`` and
``usage_kept``, pg_usage.py ``USAGE_PARTS``; a real PostgreSQL server: tests/pg.py, skipped without one): a tick's
group is ONE statement like any other, its rows and deletes land as the transaction of before wrote them, in the
one-shard and many-shard fence forms, and a takeover of the ledger's shard fences the whole group."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest

from coordinator.io.cluster.leases import ShardFenced
from coordinator.io.stores import pg_schema
from coordinator.io.stores.postgres import PgStore
from coordinator.records import PlanCreated, UsageRows
from coordinator.shards import pool_shard
from protocol.messages import Requirements, Submit
from tests.integration.test_pg_store import CLUSTER, hold
from tests.pg import PostgresServer, missing_reason, postgres_server, scratch_dir
from tests.waiting import until_async

pytestmark = pytest.mark.timeout(120)

# The statements the window ran, the counter's own reads and reset left out.
_RAN = """SELECT left(ltrim(query), 40) AS head, calls FROM pg_stat_statements
WHERE dbid = (SELECT oid FROM pg_database WHERE datname = current_database()) AND query NOT LIKE '%pg_stat_statements%'
ORDER BY head"""
_USAGE = "SELECT shard, hour, principal, team, totals FROM fleetwire_usage ORDER BY shard, hour, principal"


@pytest.fixture(scope="module")
def counting_server() -> Iterator[PostgresServer]:
    """A server of its own that loads pg_stat_statements (every statement a backend ran, with its calls)."""
    reason = missing_reason()
    if reason is not None:
        pytest.skip(reason)
    settings = {"shared_preload_libraries": "pg_stat_statements"}
    with postgres_server(parent=scratch_dir(), settings=settings) as server:
        yield server


def _in_pool(plan_id: str, order: int, shard: int) -> PlanCreated:
    """alice's new plan in a pool of ``shard``."""
    pool = next(f"pool{i}" for i in range(200) if pool_shard(f"pool{i}", CLUSTER.shards) == shard)
    submit = Submit(req_id=1, op="echo", plan_id=plan_id, requirements=Requirements(tags=[f"pool:{pool}"]))
    return PlanCreated(plan_id, "alice", order, submit)


def _one_shard(store: PgStore, shard: int = 0) -> PgStore:
    """A shard core's store: every lease taken (hold), its fence armed on ``shard`` only."""
    hold(store)
    store.fence = {shard: store.fence[shard]}
    return store


def test_a_ticks_group_is_one_statement(counting_server: PostgresServer) -> None:
    """A group carrying the ledger's rows and deletes runs ONE statement on the server, the commit statement: no
    BEGIN, no COMMIT, no DELETE or upsert of its own (before: 4-5 round trips, each a turn of the server's loop)."""
    store = _one_shard(PgStore(counting_server.new_database(), CLUSTER))
    try:
        tick = UsageRows([(3600, "alice", "ml", [1.0, 2.0]), (7200, "bob", "web", [3.0])], [(0, "carol", "ops")])
        store.write([_in_pool("warm", 1, 0), tick])  # the statements prepared: the counted write runs them only
        store.execute(lambda c: c.execute("CREATE EXTENSION IF NOT EXISTS pg_stat_statements"))
        store.execute(lambda c: c.fetchval("SELECT pg_stat_statements_reset()"))
        store.write([_in_pool("p1", 2, 0), UsageRows([(3600, "alice", "ml", [4.0, 5.0])], [(7200, "bob", "web")])])
        ran = [(r["head"], r["calls"]) for r in store.execute(lambda c: c.fetch(_RAN))]
        assert ran == [("WITH fence AS (SELECT shard FROM shard_l", 1)], ran
        usage = [tuple(r) for r in store.execute(lambda c: c.fetch(_USAGE))]
        assert usage == [(0, 3600, "alice", "ml", [4.0, 5.0])]
    finally:
        store.close()


@pytest.mark.parametrize("plans", [1, 3])
def test_the_many_shard_form_moves_a_keys_rows_to_the_lowest_shard(pg_dsn: str, monkeypatch: Any, plans: int) -> None:
    """One core holding every shard (its fence over 4) writes plans on shard 2 (one: the lone rows' form; three:
    arrays) and the ledger's rows: the group's fence is over shards 0 and 2 (the many-shard form), the rows go to
    shard 0, a written key's rows in the other shards are deleted, a deleted key is deleted everywhere, and a key
    deleted then written again is written."""
    store = hold(PgStore(pg_dsn, CLUSTER))
    forms: list[tuple[bool, ...]] = []
    statement = pg_schema.commit_statement

    def seen(*parts: bool) -> str:
        forms.append(parts[-3:])
        return statement(*parts)

    monkeypatch.setattr("coordinator.io.stores.postgres.commit_statement", seen)
    try:
        seed = "INSERT INTO fleetwire_usage VALUES ($1, $2, $3, $4, $5)"
        rows = [(1, 3600, "alice", "ml", [9.0]), (3, 3600, "alice", "ml", [9.0]), (2, 7200, "bob", "web", [9.0]),
                (0, 7200, "bob", "web", [9.0]), (1, 10800, "carol", "ops", [9.0]),
                (3, 0, "dave", "x", [9.0])]  # fmt: skip
        store.execute(lambda c: c.executemany(seed, rows))
        tick = UsageRows([(3600, "alice", "ml", [1.0, 2.0])], [(7200, "bob", "web"), (10800, "carol", "ops")])
        again = UsageRows([(10800, "carol", "ops", [5.0, 6.0])], [])
        store.write([*(_in_pool(f"p{i}", i, 2) for i in range(plans)), tick, again])
        usage = [tuple(r) for r in store.execute(lambda c: c.fetch(_USAGE))]
        assert usage == [(0, 3600, "alice", "ml", [1.0, 2.0]), (0, 10800, "carol", "ops", [5.0, 6.0]),
                         (3, 0, "dave", "x", [9.0])]  # fmt: skip
        assert forms == [(False, True, True)]  # not one_shard; both usage parts
        assert store.execute(lambda c: c.fetchval("SELECT count(*) FROM fleetwire_plans WHERE shard = 2")) == plans
    finally:
        store.close()


@pytest.fixture
def shard_core(held_store: PgStore) -> PgStore:
    """A store holding every shard on the server's loop (open_async), as a core that holds them all."""
    return held_store  # (tests/integration/conftest.py)


async def test_a_takeover_of_the_ledgers_shard_fences_the_whole_group(shard_core: PgStore, pg_dsn: str) -> None:
    """A group with a plan on shard 2 and the ledger's rows (shard 0's): another owner takes shard 0 over in a
    transaction left open while the group commits; the commit waits on that lease row, then fails with
    ShardFenced naming shard 0, and neither the plan nor any usage row was written; the rows go with the next
    group (still held by the store)."""
    import asyncpg  # type: ignore[import-untyped]

    thief, watch = await asyncpg.connect(pg_dsn), await asyncpg.connect(pg_dsn)
    try:
        takeover = thief.transaction()
        await takeover.start()
        await thief.execute("UPDATE shard_leases SET owner = 'thief', epoch = epoch + 1 WHERE shard = 0")
        group = [_in_pool("p2", 1, 2), UsageRows([(3600, "alice", "ml", [1.0])], [])]
        write = asyncio.ensure_future(shard_core.write_async(group))
        waiting = "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND pid <> pg_backend_pid()"
        await until_async(lambda: watch.fetchval(waiting))  # the commit waits on the ledger shard's lease row
        assert not write.done()
        await takeover.commit()
        with pytest.raises(ShardFenced, match=r"shard\(s\) \[0\] is no longer"):
            await asyncio.wait_for(write, 10)
        assert await watch.fetchval("SELECT count(*) FROM fleetwire_plans") == 0
        assert await watch.fetchval("SELECT count(*) FROM fleetwire_usage") == 0
        assert await watch.fetchval("SELECT owner FROM shard_leases WHERE shard = 2") == shard_core.owner
    finally:
        await thief.close()
        await watch.close()
