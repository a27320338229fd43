"""The PostgreSQL store's writer process (coordinator/io/stores/pg_writer.py): groups committed by a child with
its own connection, released in order; a stale epoch refused through it, a lost child failing the store, and the
loop free while the child waits; a lone batch committed inline when the child is idle, never overtaking a group at
the child nor overtaken by one, and the write-side keys kept alike on both sides. A real PostgreSQL server
(tests/pg.py; skipped without one)."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Iterator
from typing import Any

import msgspec
import pytest

from coordinator.io.cluster.leases import ShardFenced
from coordinator.io.stores.integrity import StoreError
from coordinator.io.stores.pg_writer import ProcessCommitter
from coordinator.io.stores.postgres import PgStore
from coordinator.records import PlanStatus
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
    committer: ProcessCommitter[int] = ProcessCommitter(pg, released.append, failures.append, inline_max_records=0)
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
    committer: ProcessCommitter[str] = ProcessCommitter(pg, released.append, failures.append, inline_max_records=0)
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
    committer: ProcessCommitter[str] = ProcessCommitter(pg, released.append, failures.append, inline_max_records=0)
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
    committer: ProcessCommitter[str] = ProcessCommitter(pg, released.append, failures.append, inline_max_records=0)
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
    committer: ProcessCommitter[str] = ProcessCommitter(pg, released.append, failures.append, inline_max_records=0)
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
        await until(lambda: len(released) == 2 or failures, 30)
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


def loaded(dsn: str) -> dict[str, Any]:
    """Each stored plan's (state, event seqs), read by a store of its own (which checks every chained checksum)."""
    check = hold(PgStore(dsn, CLUSTER), "checker")
    try:
        return {p.created.plan_id: (p.status.state if p.status else None, [e.seq for e in p.events])
                for p in check.load()}  # fmt: skip
    finally:
        check.close()


def many(prefix: str, n: int = 40) -> list[Any]:
    """A batch bigger than INLINE_MAX_RECORDS: it goes to the child."""
    return [created(f"{prefix}{i}", i) for i in range(n)]


async def test_a_lone_batch_commits_inline_and_the_keys_follow_both_ways(pg: PgStore, pg_dsn: str) -> None:
    """With the child idle a lone batch commits on the loop's connection (no child reply); a plan the child created
    is updated inline (its key came back with the child's reply) and one created inline is updated by the child (its
    key went to the child), inline events chained across both sides: every row reads back, checksums whole."""
    released: list[Any] = []
    failures: list[BaseException] = []
    committer: ProcessCommitter[str] = ProcessCommitter(pg, released.append, failures.append)
    committer.start()
    await until(lambda: committer.ready or failures, 30)  # before: every batch goes to the child
    committer.submit([created("solo"), event("solo", 1)], "solo")  # idle child: inline
    await until(lambda: released or failures, 30)
    assert committer.inline == 1 and committer.transactions == 0
    committer.submit([*many("c"), PlanStatus("solo", "running", attempt=1, worker_id="w", next_seq=3),
                      event("solo", 2)], "big")  # fmt: skip
    await until(lambda: len(released) == 2 or failures, 30)
    assert committer.transactions == 1
    committer.submit([PlanStatus("c3", "running", attempt=1, worker_id="w", next_seq=2), event("c3", 1)], "c3")
    await until(lambda: len(released) == 3 or failures, 30)
    committer.submit([PlanStatus("solo", "succeeded", attempt=1, worker_id="w", next_seq=4), event("solo", 3)], "end")
    await until(lambda: len(released) == 4 or failures, 30)
    assert committer.inline == 3 and committer.transactions == 1 and not failures
    await committer.close()
    assert released == ["solo", "big", "c3", "end"]
    rows = loaded(pg_dsn)
    assert rows["solo"] == ("succeeded", [1, 2, 3]) and rows["c3"] == ("running", [1]) and len(rows) == 41


async def test_an_inline_commit_never_overtakes_a_group_at_the_child(pg: PgStore, pg_dsn: str) -> None:
    """A group waits at the child (its plan's row locked elsewhere): a lone batch submitted meanwhile goes behind it
    to the child, not inline on the loop's free connection, and nothing is released until the group commits."""
    released: list[Any] = []
    failures: list[BaseException] = []
    committer: ProcessCommitter[str] = ProcessCommitter(pg, released.append, failures.append)
    committer.start()
    await until(lambda: committer.ready or failures, 30)  # before: every batch goes to the child
    committer.submit([created("x")], "x")
    await until(lambda: released or failures, 30)
    blocker = await pg._asyncpg.connect(pg_dsn)
    try:
        tr = blocker.transaction()
        await tr.start()
        await blocker.execute("SELECT 1 FROM fleetwire_plans WHERE id = 'x' FOR UPDATE")
        committer.submit([*many("m"), PlanStatus("x", "running", attempt=1, worker_id="w", next_seq=1)], "group")
        await until(lambda: _waiting_on_lock(pg), 30)
        committer.submit([created("y", 99)], "lone")
        assert len(committer._sent) == 2 and not committer._held  # behind the group, at the child
        for _ in range(3):  # the loop's turns in which an inline commit would start
            await asyncio.sleep(0)
        assert released == ["x"] and committer.inline == 1
        await tr.rollback()
        await until(lambda: len(released) == 3 or failures, 30)
    finally:
        await blocker.close()
    assert released == ["x", "group", "lone"] and not failures and committer.inline == 1
    await committer.close()
    assert loaded(pg_dsn)["x"] == ("running", [])


async def test_a_group_waits_behind_an_inline_commit_in_flight(pg: PgStore, pg_dsn: str) -> None:
    """An inline commit waits on the database (its plan's row locked elsewhere): a big batch submitted meanwhile is
    not sent to the child until the inline commit returned, then it is, and both are released in order."""
    released: list[Any] = []
    failures: list[BaseException] = []
    committer: ProcessCommitter[str] = ProcessCommitter(pg, released.append, failures.append)
    committer.start()
    await until(lambda: committer.ready or failures, 30)  # before: every batch goes to the child
    committer.submit([created("z")], "z")
    await until(lambda: released or failures, 30)
    blocker = await pg._asyncpg.connect(pg_dsn)
    try:
        tr = blocker.transaction()
        await tr.start()
        await blocker.execute("SELECT 1 FROM fleetwire_plans WHERE id = 'z' FOR UPDATE")
        committer.submit([PlanStatus("z", "running", attempt=1, worker_id="w", next_seq=1)], "lone")
        await until(lambda: _waiting_on_lock(pg), 30)
        committer.submit(many("n"), "group")
        assert not committer._sent and len(committer._held) == 1  # behind the inline commit
        await tr.rollback()
        await until(lambda: len(released) == 3 or failures, 30)
    finally:
        await blocker.close()
    assert released == ["z", "lone", "group"] and not failures
    assert committer.inline == 2 and committer.transactions == 1
    await committer.close()
    assert loaded(pg_dsn)["z"] == ("running", []) and len(loaded(pg_dsn)) == 41


async def test_no_child_until_a_batch_and_a_lone_one_never_waits_for_its_start(pg: PgStore, pg_dsn: str) -> None:
    """A started committer has no child until a batch is submitted (a cluster host has one a shard: 16 children at
    once held a loaded host's registrations past a minute); a lone batch submitted before the store's own connection
    is open waits for that connection and commits inline, not through the child; the child, started with it, gets
    the inline commit's keys with its setup and commits the next group and a later update of that plan."""
    released: list[Any] = []
    failures: list[BaseException] = []
    committer: ProcessCommitter[str] = ProcessCommitter(pg, released.append, failures.append)
    committer.start()
    await asyncio.sleep(0)
    assert committer.pid is None
    committer.submit([created("early"), event("early", 1)], "early")  # before the store's connection is open
    assert committer.pid is not None and not committer.ready
    await until(lambda: released or failures, 30)
    assert released == ["early"] and not failures
    assert committer.inline == 1 and committer.transactions == 0
    committer.submit([*many("g"), PlanStatus("early", "running", attempt=1, worker_id="w", next_seq=2),
                      event("early", 2)], "group")  # fmt: skip
    await until(lambda: len(released) == 2 or failures, 30)
    assert released == ["early", "group"] and not failures and committer.transactions == 1
    await committer.close()
    assert loaded(pg_dsn)["early"] == ("running", [1, 2])


def test_the_compact_deltas_leave_the_keys_as_the_groups_left_them() -> None:
    """deltas_of's compact form (arrays of keys, shards and checksums), applied by apply_deltas, leaves the keys
    pg_rows.py's apply_committed leaves: new plans, forgotten ones, moved and ended checksums, in order."""
    from coordinator.io.stores.pg_rows import PgRows, RowGroup
    from coordinator.io.stores.pg_writer import apply_deltas, deltas_of

    class Keys(PgRows):  # PgRows's own keys (compiled: an interpreted subclass, as PgStore)
        def __init__(self) -> None:
            self._keys = {"old": 1, "gone": 2}
            self._shards = {"old": 0, "gone": 5}
            self._events_crc = {"old": 7, "gone": 8}

        @property
        def write_keys(self) -> tuple[dict[str, int], dict[str, int], dict[str, int]]:
            return self._keys, self._shards, self._events_crc

    def group(fresh: dict[str, int], shards: dict[str, int], forgotten: set[str], chained: dict[str, int],
              ended: list[str]) -> RowGroup:  # fmt: skip
        g = RowGroup((), {}, {}, {}, forgotten)
        g.fresh, g.fresh_shards, g.rows = fresh, shards, ([], [], [], chained, set(), ended)
        return g

    groups = [
        group({"a": 10, "b": 2**40}, {"a": 3, "b": 15}, {"gone"}, {"old": 4_294_967_295, "a": 0}, []),
        group({}, {}, set(), {"b": 9}, ["old", "a"]),
        group({"gone": 11}, {"gone": 1}, set(), {}, []),
    ]
    expected, got = Keys(), Keys()
    for g in groups:
        PgRows.apply_committed(expected, g)
    apply_deltas(got, msgspec.msgpack.encode(deltas_of(groups)))
    assert got.write_keys == expected.write_keys
    assert got.write_keys == ({"old": 1, "a": 10, "b": 2**40, "gone": 11}, {"old": 0, "a": 3, "b": 15, "gone": 1},
                              {"b": 9})  # fmt: skip
