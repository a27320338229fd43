"""The usage ledger in cluster mode's PostgreSQL store (coordinator/io/stores/pg_usage.py; tests/pg.py, skipped
without a PostgreSQL server): written with its group under the shard's fence, read back by a shard's new owner as
a restarted SQLite coordinator reads it, schema version 5's migration, and ``get_usage`` across the cluster."""

from __future__ import annotations

import asyncio
import re
import subprocess
import sys
from pathlib import Path

import pytest

from coordinator.io.cluster.leases import ACQUIRE, ShardFenced
from coordinator.io.stores.pg_schema import SCHEMA_VERSION
from coordinator.io.stores.pg_usage import cluster_totals
from coordinator.io.stores.postgres import PgStore
from coordinator.io.stores.sqlite import SQLiteStore
from coordinator.ledger import BUCKET_S, KEEP_HOURS, UsageLedger, UsageRow
from coordinator.records import PlanCreated, UsageRows
from coordinator.shards import ClusterConfig
from fleetwire import Client
from protocol.messages import Requirements, Submit
from tests.integration.test_cluster_plan_ids import ADMIN, TOKENS, serving_host, write_tokens
from tests.integration.test_cluster_view_all import pool_on
from tests.integration.test_cluster_view_all import serving_host as insecure_host
from tests.waiting import until_async

pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).resolve().parents[2]

CLUSTER = ClusterConfig(shards=2, lease_ttl_s=30.0, lease_renew_s=1.0)
NOW = 1_900_000_000.0  # a wall-clock second (the ledger's hours are wall-clock hours)


def owning(dsn: str, owner: str, shard: int) -> PgStore:
    """A shard core's store for ``owner``: the shard's lease taken (expired or free) and the fence armed on it."""
    store = PgStore(dsn, CLUSTER)
    rows = store.execute(lambda c: c.fetch(ACQUIRE, owner, "", 30.0, [shard]))
    assert rows, f"shard {shard} is held by another owner"
    store.owner, store.fence = owner, {r[0]: r[1] for r in rows}
    return store


def expire(store: PgStore, shard: int) -> None:
    """The shard's lease runs out (its owner was killed: no renewal), so another coordinator may take it."""
    store.execute(lambda c: c.execute("UPDATE shard_leases SET expires_at = now() - interval '1 s' WHERE shard = $1",
                                      shard))  # fmt: skip


def created(plan_id: str, shard: int = 0) -> PlanCreated:
    """alice's new plan in a pool of ``shard``."""
    requirements = Requirements(tags=[f"pool:{pool_on(shard)}"])
    submit = Submit(req_id=1, op="echo", plan_id=plan_id, requirements=requirements)
    return PlanCreated(plan_id, "alice", 1, submit)


def ledger_rows() -> tuple[UsageLedger, UsageRows, UsageRows]:
    """A ledger with an hour old enough to fold, its first rows, then the rows after the fold (hour 0, a delete)."""
    ledger = UsageLedger()
    old = NOW - (KEEP_HOURS + 2) * BUCKET_S
    ledger.plan_ended("alice", "ml", "succeeded", old)
    ledger.lease_ended("alice", "ml", 30.0, NOW, 2.0, 1.0)
    ledger.plan_ended("alice", "ml", "failed", NOW)
    ledger.preempted("bob", "web", wall_s=NOW + BUCKET_S)
    rows, deleted = ledger.take_dirty()
    first = UsageRows([(r.hour_s, r.principal, r.team, r.values()) for r in rows], deleted)
    ledger.fold(NOW)
    rows, deleted = ledger.take_dirty()
    folded = UsageRows([(r.hour_s, r.principal, r.team, r.values()) for r in rows], deleted)
    assert folded.deleted and any(r[0] == 0 for r in folded.rows)
    return ledger, first, folded


def state(rows: list[UsageRow]) -> dict[tuple[int, str, str], list[float]]:
    """A ledger's stored rows by key (how two stores' rows are compared)."""
    return {(r.hour_s, r.principal, r.team): r.values() for r in rows}


async def cancelled(client: Client, count: int) -> bool:
    """Whether the cluster's usage (as ``client`` sees it) counts ``count`` cancelled plans."""
    return sum(r.cancelled for r in (await client.usage()).rows) >= count


def test_a_shards_new_owner_reads_the_usage_rows_back_as_a_restarted_sqlite_coordinator(
    pg_dsn: str, tmp_path: Path
) -> None:
    """Owner a writes shard 0's ledger rows with its groups (an hour folded into hour 0 on the way) and dies;
    owner b takes the shard over: its load gives the rows SQLite gives after a restart, and its ledger the same
    totals as a's. Shard 1's rows (another core's) are not shard 0's."""
    ledger, first, folded = ledger_rows()
    a = owning(pg_dsn, "a", 0)
    other = owning(pg_dsn, "c", 1)
    lite = SQLiteStore(tmp_path / "fleet.db")
    try:
        a.write([created("p1"), first])
        a.write([created("p2"), folded])
        other.write([created("q1", 1), UsageRows([(3600, "carol", "ops", [1.0])])])
        lite.write([created("p1"), first])
        lite.write([created("p2"), folded])
        expire(a, 0)
        b = owning(pg_dsn, "b", 0)
        try:
            assert [p.created.plan_id for p in b.load()] == ["p1", "p2"]
            restored = b.load_usage()
            assert restored and state(restored) == state(lite.load_usage())
            assert b.abilities.usage is not None and state(b.abilities.usage()) == state(restored)
            again = UsageLedger()
            again.restore(restored)
            assert again.totals() == ledger.totals() and again.totals("team") == ledger.totals("team")
            assert "carol" not in again.totals()
        finally:
            b.close()
    finally:
        a.close()
        other.close()
        lite.close()


def owning_all(dsn: str, owner: str) -> PgStore:
    """The single-core mode's store (``fleetwire up --store postgresql://...``: one core holding every shard)."""
    store = PgStore(dsn, CLUSTER)
    rows = store.execute(lambda c: c.fetch(ACQUIRE, owner, "", 30.0, list(range(CLUSTER.shards))))
    assert len(rows) == CLUSTER.shards, "a shard is held by another owner"
    store.owner, store.fence = owner, {r[0]: r[1] for r in rows}
    return store


def succeeded_in_cluster(store: PgStore) -> float:
    """alice's succeeded plans as the main port's get_usage sums them: every shard's rows."""
    totals, _ = store.execute(lambda c: cluster_totals(c))
    return totals["alice"].succeeded


def test_a_single_core_after_shard_cores_moves_their_rows_instead_of_counting_them_twice(pg_dsn: str) -> None:
    """Shard 0's and shard 1's cores wrote alice's rows (one core per shard; the same hour in both, and an hour in
    shard 1 only); then one core holds both shards (``fleetwire up`` on the database). It loads both shards' rows
    summed, writes its changed hour (one more plan) and later folds every hour into hour 0: after each write the
    cluster's sum and its own next load say 1 + 2 + 4 + 1 = 8, not the other shard's old rows counted again."""
    hour = int(NOW // BUCKET_S) * BUCKET_S
    s0, s1 = owning(pg_dsn, "a", 0), owning(pg_dsn, "b", 1)
    try:
        s0.write([UsageRows([(hour, "alice", "ml", [1.0])])])
        s1.write([UsageRows([(hour, "alice", "ml", [2.0])]), UsageRows([(hour + BUCKET_S, "alice", "ml", [4.0])])])
        expire(s0, 0)
        expire(s1, 1)
    finally:
        s0.close()
        s1.close()
    single = owning_all(pg_dsn, "s")
    try:
        ledger = UsageLedger()
        ledger.restore(single.load_usage())
        assert ledger.totals()["alice"].succeeded == 7
        ledger.take_dirty()
        ledger.plan_ended("alice", "ml", "succeeded", hour + 10.0)  # the hour shard 1 holds a row of too
        rows, deleted = ledger.take_dirty()
        single.write([UsageRows([(r.hour_s, r.principal, r.team, r.values()) for r in rows], deleted)])
        assert succeeded_in_cluster(single) == 8
        again = UsageLedger()
        again.restore(single.load_usage())
        assert again.totals()["alice"].succeeded == 8
        ledger.fold(NOW + (KEEP_HOURS + 3) * BUCKET_S)  # both hours into hour 0: their keys deleted
        rows, deleted = ledger.take_dirty()
        assert deleted
        single.write([UsageRows([(r.hour_s, r.principal, r.team, r.values()) for r in rows], deleted)])
        assert succeeded_in_cluster(single) == 8
        again = UsageLedger()
        again.restore(single.load_usage())
        assert again.totals()["alice"].succeeded == 8
    finally:
        single.close()


def test_a_stale_epoch_groups_usage_rows_are_not_written(pg_dsn: str) -> None:
    """Owner a's lease expired and b took shard 0 (next epoch): a's group with usage rows is refused whole, and
    the usage table keeps b's rows only; b's own group writes its rows."""
    a = owning(pg_dsn, "a", 0)
    try:
        expire(a, 0)
        b = owning(pg_dsn, "b", 0)
        try:
            with pytest.raises(ShardFenced):
                a.write([created("late"), UsageRows([(3600, "alice", "ml", [5.0])])])
            with pytest.raises(ShardFenced):  # a group of usage rows alone is fenced too
                a.write([UsageRows([(7200, "alice", "ml", [6.0])])])
            assert b.load_usage() == []
            b.write([UsageRows([(3600, "bob", "web", [1.0])])])
            assert state(b.load_usage()) == state([UsageRow.of(3600, "bob", "web", [1.0])])
        finally:
            b.close()
    finally:
        a.close()


def test_a_version_4_database_is_migrated_to_5_with_the_usage_table_and_keeps_its_plans(pg_dsn: str) -> None:
    """A database as the tree before version 5 left it (no fleetwire_usage, schema_version 4) is upgraded in
    place at open: its plans load, the table is there, the version is 5, and usage rows are written and read."""
    old = owning(pg_dsn, "a", 0)
    old.write([created("p1")])
    old.execute(
        lambda c: c.execute(
            "DROP TABLE fleetwire_usage; UPDATE fleetwire_meta SET value = '4' WHERE key = 'schema_version'"
        )
    )
    expire(old, 0)
    old.close()
    store = owning(pg_dsn, "b", 0)
    try:
        assert SCHEMA_VERSION == 6  # version 6 (the plans table's column order) came after
        assert (
            store.execute(lambda c: c.fetchval("SELECT value FROM fleetwire_meta WHERE key = 'schema_version'")) == "6"
        )
        assert [p.created.plan_id for p in store.load()] == ["p1"] and store.load_usage() == []
        assert (
            store.execute(
                lambda c: c.fetchval("SELECT count(*) FROM pg_indexes WHERE indexname = 'fleetwire_usage_by_principal'")
            )
            == 1
        )
        store.write([UsageRows([(3600, "alice", "ml", [1.0, 2.0])])])
        assert [(r.principal, r.totals.succeeded, r.totals.failed) for r in store.load_usage()] == [("alice", 1, 2)]
    finally:
        store.close()


async def test_get_usage_through_the_main_port_sums_every_shards_ledger(pg_dsn: str, tmp_path: Path) -> None:
    """alice cancels a plan on shard 0 and another on shard 1, bob one on shard 1: a view session's get_usage
    (the main port) gives the whole cluster's totals, an admin everyone's, a client its own; a shard core's
    session gives its own shard's (as before)."""
    host = await serving_host(pg_dsn, write_tokens(tmp_path / "tokens.toml"))
    try:
        for name, shard, plan in (("alice", 0, "a0"), ("alice", 1, "a1"), ("bob", 1, "b1")):
            pool = pool_on(shard)
            async with Client(host.url, token=TOKENS[name], pool=pool) as client:
                await client.submit("echo", {}, tags=[f"pool:{pool}"], plan_id=plan)  # no worker: queued
                await client.cancel(plan)

        # The cores write their ledger rows at their next tick (1 s): asked again until all three are there (no event
        # says so from outside the cores).
        async with Client(host.url, token=ADMIN) as admin:  # no pool: a view session
            await until_async(lambda: cancelled(admin, 3), interval_s=0.1)
            everyone = {r.name: r.cancelled for r in (await admin.usage()).rows}
            teams = (await admin.usage(by="team")).rows
        assert everyone == {"alice": 2, "bob": 1} and sum(r.cancelled for r in teams) == 3
        async with Client(host.url, token=TOKENS["alice"]) as alice:
            assert [(r.name, r.cancelled) for r in (await alice.usage()).rows] == [("alice", 2)]
        async with Client(host.url, token=TOKENS["alice"], pool=pool_on(0)) as alice:  # moved to shard 0's core
            assert [(r.name, r.cancelled) for r in (await alice.usage()).rows] == [("alice", 1)]
    finally:
        await host.stop()


async def test_usage_survives_the_owners_kill_and_the_new_owners_cores_answer_it(pg_dsn: str) -> None:
    """A coordinator process serves both shards and is SIGKILLed once its cores wrote their ledger rows; another
    coordinator takes the shards over (after the lease TTL): its shard cores' get_usage gives what the dead one's
    had (one cancelled plan each), and its main port the cluster's sum."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "fleetwire", "coordinator", "--insecure", "--port", "0", "--store", pg_dsn,
        "--shards", "2", "--lease-ttl", "2", "--lease-renew", "0.5", "--log-format", "json",
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        line = (await asyncio.wait_for(proc.stdout.readline(), 30)).decode()
        found = re.search(r"listening on (ws://\S+)", line)
        assert found, line
        url = found.group(1)
        for shard in (0, 1):
            pool = pool_on(shard)
            async with Client(url, pool=pool) as client:
                await client.submit("echo", {}, tags=[f"pool:{pool}"], plan_id=f"p{shard}")  # no worker: queued
                await client.cancel(f"p{shard}")
        async with Client(url) as viewer:  # the cores' next ticks write the rows
            await until_async(lambda: cancelled(viewer, 2), interval_s=0.1)
    finally:
        proc.kill()
        await proc.wait()
    host = await insecure_host(pg_dsn)  # takes the shards once the dead one's leases ran out
    try:
        for shard in (0, 1):
            async with Client(host.url, pool=pool_on(shard)) as client:  # moved to the new owner's core of the shard
                assert [r.cancelled for r in (await client.usage()).rows] == [1]
        async with Client(host.url) as viewer:
            assert [r.cancelled for r in (await viewer.usage()).rows] == [2]
    finally:
        await host.stop()
