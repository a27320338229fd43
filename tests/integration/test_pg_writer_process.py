"""The PostgreSQL store's writer process (coordinator/io/stores/pg_writer.py): groups committed by a child with
its own connection, released in order; a stale epoch refused through it, a lost child failing the store, and the
loop free while the child waits. A real PostgreSQL server (tests/pg.py; skipped without one)."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Iterator
from typing import Any

import pytest

from coordinator.io.cluster.leases import ShardFenced
from coordinator.io.stores.integrity import StoreError
from coordinator.io.stores.pg_writer import ProcessCommitter
from coordinator.io.stores.postgres import PgStore
from tests.integration.test_pg_store import CLUSTER, hold, steal
from tests.unit.test_store import created, event
from tests.waiting import alive, until

pytestmark = pytest.mark.timeout(90)


@pytest.fixture
def pg(pg_dsn: str) -> Iterator[PgStore]:
    store = hold(PgStore(pg_dsn, CLUSTER))
    yield store
    store.close()


def stored(dsn: str) -> list[str]:
    check = hold(PgStore(dsn, CLUSTER), "checker")
    try:
        return [p.created.plan_id for p in check.load()]
    finally:
        check.close()


async def test_groups_commit_in_the_child_and_are_released_in_order(pg: PgStore, pg_dsn: str) -> None:
    """Batches sent at once are committed by the child (its own connection) and released in submit order."""
    released: list[Any] = []
    failures: list[BaseException] = []
    committer: ProcessCommitter[int] = ProcessCommitter(pg, released.append, failures.append)
    committer.start()
    for n in range(1, 6):
        committer.submit([created(f"p{n}", n), event(f"p{n}", 1)], n)
    await until(lambda: len(released) == 5 or failures, 30)
    assert released == [1, 2, 3, 4, 5] and not failures
    assert committer.pid is not None and committer.pid != os.getpid()
    await committer.close()
    assert sorted(stored(pg_dsn)) == ["p1", "p2", "p3", "p4", "p5"]


async def test_a_stale_epoch_is_refused_through_the_child(pg: PgStore, pg_dsn: str) -> None:
    """Another owner took the shard at the next epoch: the child's commit is fenced by the database, the committer
    fails with ShardFenced once, and nothing of that group or after it is released or written."""
    released: list[Any] = []
    failures: list[BaseException] = []
    committer: ProcessCommitter[str] = ProcessCommitter(pg, released.append, failures.append)
    committer.start()
    committer.submit([created("ok")], "ok")
    await until(lambda: released or failures, 30)
    for shard in range(CLUSTER.shards):
        steal(pg, shard)
    committer.submit([created("late", 2)], "late")
    committer.submit([created("later", 3)], "later")
    await until(lambda: failures, 30)
    await committer.close()
    assert released == ["ok"] and len(failures) == 1 and isinstance(failures[0], ShardFenced)
    assert "no longer this coordinator's" in str(failures[0])
    assert stored(pg_dsn) == ["ok"]


async def test_a_cleared_fence_reaches_the_child_before_the_next_group(pg: PgStore, pg_dsn: str) -> None:
    """The lease keeper clears the store's fence (a lost lease): the next group is refused by the child as the
    in-process committer refuses it, ShardFenced, nothing written."""
    released: list[Any] = []
    failures: list[BaseException] = []
    committer: ProcessCommitter[str] = ProcessCommitter(pg, released.append, failures.append)
    committer.start()
    committer.submit([created("ok")], "ok")
    await until(lambda: released or failures, 30)
    pg.fence = {}
    committer.submit([created("late", 2)], "late")
    await until(lambda: failures, 30)
    await committer.close()
    assert released == ["ok"] and isinstance(failures[0], ShardFenced)
    assert stored(pg_dsn) == ["ok"]


async def test_a_child_killed_mid_group_fails_the_store(pg: PgStore, pg_dsn: str) -> None:
    """The child is killed while a group waits for its commit (its lease rows locked, so the statement hangs):
    the committer fails with StoreError naming the lost process, and the group's payload is never released."""
    released: list[Any] = []
    failures: list[BaseException] = []
    committer: ProcessCommitter[str] = ProcessCommitter(pg, released.append, failures.append)
    committer.start()
    committer.submit([created("ok")], "ok")
    await until(lambda: released or failures, 30)
    blocker = await pg._asyncpg.connect(pg_dsn)
    try:
        async with blocker.transaction():
            await blocker.execute("SELECT 1 FROM shard_leases FOR UPDATE")  # the child's fence waits on it
            committer.submit([created("stuck", 2)], "stuck")
            await until(lambda: _waiting_on_lock(pg), 30)
            assert committer.pid is not None
            os.kill(committer.pid, signal.SIGKILL)
            await until(lambda: failures, 30)
    finally:
        await blocker.close()
    await committer.close()
    assert released == ["ok"] and len(failures) == 1 and isinstance(failures[0], StoreError)
    assert "writer process" in str(failures[0]) and "lost" in str(failures[0])


async def test_the_loop_is_not_blocked_while_the_child_waits(pg: PgStore, pg_dsn: str) -> None:
    """While the child's commit waits on the database (a lock held elsewhere), the loop runs on time and the
    payload waits; once the lock goes, the group commits and its payload is released."""
    released: list[Any] = []
    failures: list[BaseException] = []
    committer: ProcessCommitter[str] = ProcessCommitter(pg, released.append, failures.append)
    committer.start()
    committer.submit([created("first")], "first")  # the child is up and answering before the lock is taken
    await until(lambda: released or failures, 30)
    blocker = await pg._asyncpg.connect(pg_dsn)
    try:
        tr = blocker.transaction()
        await tr.start()
        await blocker.execute("SELECT 1 FROM shard_leases FOR UPDATE")
        committer.submit([created("slow", 2)], "slow")
        await until(lambda: _waiting_on_lock(pg), 30)
        late = []
        for _ in range(20):  # the loop's ticks, while the commit waits
            asked = time.monotonic()
            await asyncio.sleep(0.01)
            late.append(time.monotonic() - asked - 0.01)
        assert released == ["first"] and not failures
        assert max(late) < 0.5
        await tr.rollback()
        await until(lambda: released or failures, 30)
    finally:
        await blocker.close()
    assert released == ["first", "slow"] and not failures
    pid = committer.pid
    await committer.close()
    assert pid is not None and not alive(pid)


def _waiting_on_lock(pg: PgStore) -> bool:
    """True once some backend waits on a lock (the child's fence behind the blocker's FOR UPDATE)."""
    rows = pg.execute(lambda c: c.fetch("SELECT 1 FROM pg_stat_activity WHERE wait_event_type = 'Lock'"))
    return bool(rows)
