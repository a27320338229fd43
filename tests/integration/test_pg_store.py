"""The PostgreSQL store and its fenced leases on a real PostgreSQL server (tests/pg.py; skipped without one)."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import msgspec
import pytest

from coordinator.io.cluster.leases import ACQUIRE, ShardFenced
from coordinator.io.frontdoor.server import CoordinatorServer, ServerSettings
from coordinator.io.stores.commit import GroupCommitter
from coordinator.io.stores.pg_commit import PipelinedCommitter
from coordinator.io.stores.pg_schema import INDEXES, PLANS_FILLFACTOR, SCHEMA_VERSION, commit_statement
from coordinator.io.stores.postgres import SERVER_SETTINGS, WRITER_SETTINGS, PgStore, ensure_indexes
from coordinator.io.stores.store import StoreError, open_store
from coordinator.records import PlanCreated, PlanForgotten, PlanStatus
from coordinator.shards import ClusterConfig
from fleetwire import Client
from protocol.messages import ErrorInfo, Event, Submit, Subscribe
from tests.unit.test_durability_core import Durable, running_plan
from tests.unit.test_store import created, event

CLUSTER = ClusterConfig(shards=4, lease_ttl_s=2.0, lease_renew_s=0.2)


def hold(store: PgStore, owner: str = "test-owner") -> PgStore:
    """Take every shard's lease for ``owner`` (as the lease keeper would) and arm the store's fence."""
    rows = store.execute(lambda c: c.fetch(ACQUIRE, owner, "", 30.0, list(range(store.cluster.shards))))
    store.owner = owner
    store.fence = {r[0]: r[1] for r in rows}
    return store


def steal(store: PgStore, shard: int = 0) -> None:
    """Another coordinator takes the shard over (new owner, next epoch), as after an expiry."""
    store.execute(lambda c: c.execute(
        "UPDATE shard_leases SET owner = 'thief', epoch = epoch + 1, expires_at = now() + interval '1 minute' "
        "WHERE shard = $1", shard))  # fmt: skip


@pytest.fixture
def pg(pg_dsn: str) -> Iterator[PgStore]:
    store = hold(PgStore(pg_dsn, CLUSTER))
    yield store
    store.close()


def test_the_store_declares_losses_away_its_committer_and_shard_leases(pg: PgStore) -> None:
    """PgStore's abilities: its losses, a database that can be away, its own committer, its shard leases."""
    abilities = pg.abilities
    assert abilities.losses is pg.losses and abilities.away is not None and abilities.away() is None
    assert abilities.make_committer is not None and abilities.leases is pg
    assert abilities.stream is None and abilities.try_write is None and abilities.check_files is None


def test_the_store_plans_every_statement_for_its_own_parameters(pg: PgStore) -> None:
    """The lease connection runs with plan_cache_mode force_custom_plan: no generic plan made on an empty table."""

    async def show() -> str:
        return str(await pg.call(lambda conn: conn.fetchval("SHOW plan_cache_mode")))

    assert SERVER_SETTINGS["plan_cache_mode"] == "force_custom_plan"
    assert asyncio.run(show()) == "force_custom_plan"


def test_the_writers_generic_plan_reaches_plans_by_key_whatever_the_table_held(pg: PgStore, pg_dsn: str) -> None:
    """A commit's generic plan made on an empty table still updates plans through the primary key once it is full."""
    import asyncpg  # type: ignore[import-untyped]

    update = commit_statement(False, False, True, False)
    # key, nevents, status_crc, events_crc; state; status, events (pg_schema.py _PARTS: a row per column)
    args = "ARRAY[0], ARRAY[1::bigint], 'o', ARRAY[[{k}], [0], [1], [NULL]]::bigint[], ARRAY['succeeded'], " \
           "ARRAY[['\\x00'], [NULL]]::bytea[]"

    async def plan_after_filling() -> str:
        conn = await asyncpg.connect(pg_dsn, server_settings=WRITER_SETTINGS)
        try:
            await conn.execute(f"PREPARE commit_update AS {update}")
            await conn.execute(f"EXECUTE commit_update({args.format(k=1)})")  # the generic plan is made now: no rows
            await conn.execute(
                "INSERT INTO fleetwire_plans (key, shard, id, owner, ord, state, spec, spec_crc) "
                "SELECT g, 0, 'p' || g, 'o', g, 'queued', '\\x00', 0 FROM generate_series(1, 20000) g")
            rows = await conn.fetch(f"EXPLAIN EXECUTE commit_update({args.format(k=7)})")
            return "\n".join(r[0] for r in rows)
        finally:
            await conn.close()

    plan = asyncio.run(plan_after_filling())
    assert "$" in plan, plan  # the generic plan (parameters unbound), not one made for these values
    assert "Index Scan using fleetwire_plans_pkey on fleetwire_plans" in plan, plan
    assert "Seq Scan on fleetwire_plans" not in plan, plan


def test_round_trip_across_reopen(pg_dsn: str) -> None:
    """Plans, events and the latest status written in batches come back, in submit order, in a new store."""
    store = hold(PgStore(pg_dsn, CLUSTER))
    store.write([created("b", 2, args=b"\x00bytes"), event("b", 1), PlanStatus("b", "queued", next_seq=2)])
    store.write([created("a", 1, args={"k": [1, 2.5, None]}), event("a", 1, {"x": 1})])
    status = PlanStatus("b", "failed", attempt=2, worker_id="w1", next_seq=9,
                        error=ErrorInfo("handler_error", "boom", {"n": 1}), history=[{"attempt": 1}])  # fmt: skip
    store.write([event("b", 2, "two"), status])
    store.close()
    again = PgStore(pg_dsn, CLUSTER)
    plans = again.load()
    again.close()
    assert [p.created.plan_id for p in plans] == ["a", "b"]
    a, b = plans
    assert a.created.submit.args == {"k": [1, 2.5, None]} and a.status is None
    assert b.created.submit.args == b"\x00bytes"
    assert b.status == status and [(e.seq, e.data) for e in b.events] == [(1, None), (2, "two")]


def test_a_group_commit_hands_asyncpg_few_array_elements_to_check(pg: PgStore, monkeypatch: pytest.MonkeyPatch) -> None:
    """Columns go folded into ~sqrt(n)-wide rows: asyncpg checks ~sqrt(n) elements a column, not n (~51 a plan)."""
    import abc

    steps: list[list[Any]] = [[], [], [], []]
    for n in range(200):
        pid = f"p{n}"
        steps[0] += [created(pid, n), event(pid, 1), PlanStatus(pid, "queued", next_seq=2)]
        steps[1] += [event(pid, 2), PlanStatus(pid, "leased", attempt=1, worker_id="w1", next_seq=3)]
        steps[2] += [event(pid, 3), PlanStatus(pid, "running", attempt=1, worker_id="w1", next_seq=4)]
        big = [event(pid, 5, "x" * 600)] if n % 20 == 0 else []  # ten spilled runs: events rows (10 = 3 x 4 - 2)
        steps[3] += [event(pid, 4, {"n": n}), *big, PlanStatus(pid, "succeeded", attempt=1, worker_id="w1",
                                                               next_seq=5, result={"n": n})]  # fmt: skip
    checks = 0
    check = abc.ABCMeta.__instancecheck__

    def counted(cls: abc.ABCMeta, instance: Any) -> bool:
        nonlocal checks
        checks += 1
        return check(cls, instance)

    monkeypatch.setattr(abc.ABCMeta, "__instancecheck__", counted)
    for group in steps:
        pg.write(group)
    monkeypatch.undo()
    assert checks / 200 < 8, checks / 200  # collections.abc checks a plan, over its four group commits
    plans = pg.load()
    assert len(plans) == 200 and plans[7].status is not None and plans[7].status.result == {"n": 7}
    assert [e.seq for e in plans[7].events] == [1, 2, 3, 4]
    assert [e.seq for e in plans[20].events] == [1, 2, 3, 4, 5] and plans[20].events[4].data == "x" * 600
    assert pg.execute(lambda c: c.fetchval("SELECT count(*) FROM fleetwire_events")) == 10


def test_long_streams_spill_and_later_records_win(pg: PgStore) -> None:
    """Runs past the inline bound become event rows; the last record of a seq/status in a group is kept."""
    pg.write([created("p"), event("p", 1), event("p", 2, "x" * 600), PlanStatus("p", "running", next_seq=3)])
    pg.write([event("p", 3, "a"), event("p", 3, "b"), PlanStatus("p", "running", next_seq=4)])
    for first in range(4, 60, 7):
        pg.write([event("p", seq, seq) for seq in range(first, first + 7)])
    pg.write([created("p", args="again"), PlanStatus("p", "succeeded", attempt=1, next_seq=60)])
    (plan,) = pg.load()
    assert [e.seq for e in plan.events] == list(range(1, 60))
    assert plan.events[1].data == "x" * 600 and plan.events[2].data == "b" and plan.events[-1].data == 59
    assert plan.created.submit.args is None and plan.status == PlanStatus("p", "succeeded", attempt=1, next_seq=60)


def test_forgotten_plans_are_deleted_and_their_id_is_new_again(pg: PgStore) -> None:
    """A PlanForgotten deletes the plan and its event rows; a later creation of the id is a new plan."""
    pg.write([created("p", args="old"), *[event("p", s) for s in range(1, 30)], PlanStatus("p", "succeeded")])
    pg.write([PlanForgotten("p"), created("p", 5, args="new")])
    (plan,) = pg.load()
    assert plan.created.submit.args == "new" and plan.events == []
    count = pg.execute(lambda c: c.fetchval("SELECT count(*) FROM fleetwire_events"))
    assert count == 0


def test_payload_msgpack_cannot_hold_is_stored_as_text(pg: PgStore) -> None:
    """An event whose data msgpack cannot encode (a JSON peer's 2**70) is kept, with its data as text."""
    pg.write([created("p"), event("p", 1, {"n": 2**70})])
    assert pg.load()[0].events[0].data == f"<not storable: {{'n': {2**70}}}>"


def test_a_submit_and_a_status_msgpack_cannot_hold_are_stored_as_text(pg: PgStore) -> None:
    """A submit's args or a status's result msgpack cannot encode (2**70) is kept, as text, in a new and an old row."""
    pg.write([created("p", args={"n": 2**70}), PlanStatus("p", "queued", next_seq=1)])
    pg.write([PlanStatus("p", "succeeded", attempt=1, next_seq=1, result=[2**70])])
    (plan,) = pg.load()
    assert plan.created.submit.args == f"<not storable: {{'n': {2**70}}}>"
    assert plan.status is not None and plan.status.state == "succeeded"
    assert plan.status.result == f"<not storable: [{2**70}]>"


def test_a_damaged_blob_is_named_and_refused(pg: PgStore) -> None:
    """A status that fails its CRC-32 stops the load with the plan's name (as the SQLite store does)."""
    pg.write([created("p"), PlanStatus("p", "queued", next_seq=2)])
    pg.execute(lambda c: c.execute("UPDATE fleetwire_plans SET status_crc = status_crc + 1"))
    with pytest.raises(StoreError, match=r"damaged: plan 'p': its status fails its checksum"):
        pg.load()


def test_core_restart_and_byte_identical_replay_from_postgres(pg_dsn: str) -> None:
    """The core's own records restore a running plan from PostgreSQL; every event replays byte for byte."""
    store = hold(PgStore(pg_dsn, CLUSTER))
    h = Durable()
    h.store = store  # type: ignore[assignment]
    _, w, plan_id = running_plan(h, args={"blob": b"\x00\xff"})
    c = h.client()
    h.send(c, Subscribe(req_id=2, plan_ids=[plan_id]))
    for seq in range(2, 40):
        h.send(w, Event(plan_id=plan_id, attempt=1, kind="log", data={"i": seq}, seq=seq))
    live = h.events(c, plan_id)
    store.close()
    h.store = hold(PgStore(pg_dsn, CLUSTER))  # type: ignore[assignment]
    h.restart(now=100.0)
    assert h.core.plans[plan_id].state == "running" and h.core.plans[plan_id].worker_id == "w1"
    c2 = h.client()
    h.send(c2, Subscribe(req_id=3, plan_ids=[plan_id], from_seq=0))
    replayed = h.events(c2, plan_id)
    h.store.close()
    assert len(live) > 30
    assert [msgspec.msgpack.encode(e) for e in replayed] == [msgspec.msgpack.encode(e) for e in live]


def test_a_write_after_the_lease_was_taken_is_fenced_and_applies_nothing(pg: PgStore) -> None:
    """Another owner at a new epoch: the group commit fails with ShardFenced and writes no row."""
    pg.write([created("kept")])
    steal(pg)
    with pytest.raises(ShardFenced, match=r"shard\(s\) \[0\].*no longer this coordinator's"):
        pg.write([created("late"), PlanStatus("late", "queued")])
    assert [p.created.plan_id for p in pg.load()] == ["kept"]


def test_a_fenced_group_of_every_kind_of_row_applies_none_of_them(pg: PgStore) -> None:
    """One statement per group: a fenced delete + insert + update + event rows changes no row at all."""
    pg.write([created("gone", 1), created("open", 2), PlanStatus("open", "queued", next_seq=2)])
    before = pg.execute(lambda c: c.fetch("SELECT key, state, status, nevents FROM fleetwire_plans ORDER BY key"))
    steal(pg)
    with pytest.raises(ShardFenced):
        pg.write([PlanForgotten("gone"), created("new", 3), PlanStatus("open", "running", attempt=1, next_seq=30),
                  *[event("open", seq, "x" * 100) for seq in range(2, 30)]])  # fmt: skip
    after = pg.execute(lambda c: c.fetch("SELECT key, state, status, nevents FROM fleetwire_plans ORDER BY key"))
    assert after == before
    assert pg.execute(lambda c: c.fetchval("SELECT count(*) FROM fleetwire_events")) == 0


def test_a_write_after_the_lease_expired_is_fenced(pg: PgStore) -> None:
    """An expired lease (nobody took it yet) fences too: the database clock judges, not the writer."""
    pg.execute(lambda c: c.execute("UPDATE shard_leases SET expires_at = now() - interval '1 second'"))
    with pytest.raises(ShardFenced):
        pg.write([created("p")])


def test_a_store_without_a_fence_refuses_every_write(pg_dsn: str) -> None:
    """A store whose coordinator holds no lease never writes."""
    store = PgStore(pg_dsn, CLUSTER)
    with pytest.raises(ShardFenced, match="does not hold"):
        store.write([created("p")])
    store.close()


def test_acquire_bumps_the_epoch_only_on_a_change_of_owner(pg_dsn: str) -> None:
    """The same owner renews at its epoch; a takeover after expiry gets epoch + 1; a live lease is not taken."""
    store = hold(PgStore(pg_dsn, CLUSTER), "a")
    assert set(store.fence.values()) == {1}
    assert hold(store, "a").fence == {s: 1 for s in range(4)}
    assert hold(store, "b").fence == {}  # a's leases are live
    store.execute(lambda c: c.execute("UPDATE shard_leases SET expires_at = now() - interval '1 second'"))
    assert hold(store, "b").fence == {s: 2 for s in range(4)}
    store.close()


def test_schema_checks_refuse_another_cluster_a_shard_count_and_a_newer_version(pg_dsn: str) -> None:
    """Another --cluster-name, another --shards, or a schema from a newer fleetwire: refused, naming both sides."""
    PgStore(pg_dsn, CLUSTER).close()
    with pytest.raises(StoreError, match=r"belongs to cluster 'fleetwire', not 'other'"):
        PgStore(pg_dsn, ClusterConfig(name="other", shards=4))
    with pytest.raises(StoreError, match=r"has 4 shard slots, not 16"):
        PgStore(pg_dsn, ClusterConfig())
    store = PgStore(pg_dsn, CLUSTER)
    store.execute(lambda c: c.execute("UPDATE fleetwire_meta SET value = '99' WHERE key = 'schema_version'"))
    store.close()
    with pytest.raises(StoreError, match=rf"schema version 99; this coordinator knows versions up to {SCHEMA_VERSION}"):
        PgStore(pg_dsn, CLUSTER)


def test_a_version_1_schema_is_migrated_on_open_with_the_coordinators_table(pg_dsn: str) -> None:
    """A version 1 database (no coordinators table) gets it and version 2 at open; its plans stay."""
    store = hold(PgStore(pg_dsn, CLUSTER))
    store.write([created("p1")])
    store.execute(lambda c: c.execute(
        "DROP TABLE fleetwire_coordinators; UPDATE fleetwire_meta SET value = '1' WHERE key = 'schema_version'"))
    store.close()
    store = hold(PgStore(pg_dsn, CLUSTER))
    try:
        assert [p.created.plan_id for p in store.load()] == ["p1"]
        assert store.execute(lambda c: c.fetchval(
            "SELECT value FROM fleetwire_meta WHERE key = 'schema_version'")) == str(SCHEMA_VERSION) == "6"
        assert store.execute(lambda c: c.fetchval("SELECT count(*) FROM fleetwire_coordinators")) == 0
    finally:
        store.close()


def test_the_plans_table_leaves_room_for_hot_updates_and_keeps_an_operators_fillfactor(pg_dsn: str) -> None:
    """fleetwire_plans has fillfactor 50 when created, gets it at open when it has none, keeps an operator's own."""

    def options(store: PgStore) -> Any:
        return store.execute(lambda c: c.fetchval("SELECT reloptions FROM pg_class WHERE relname = 'fleetwire_plans'"))

    store = PgStore(pg_dsn, CLUSTER)
    assert options(store) == [f"fillfactor={PLANS_FILLFACTOR}"] == ["fillfactor=35"]
    store.execute(lambda c: c.execute("ALTER TABLE fleetwire_plans RESET (fillfactor)"))  # as before this version
    store.close()
    store = PgStore(pg_dsn, CLUSTER)
    assert options(store) == ["fillfactor=35"]
    store.execute(lambda c: c.execute("ALTER TABLE fleetwire_plans SET (fillfactor = 80)"))
    store.close()
    store = PgStore(pg_dsn, CLUSTER)
    assert options(store) == ["fillfactor=80"]
    store.close()


def test_a_user_who_does_not_own_the_plans_table_still_opens_the_store(pg_dsn: str) -> None:
    """Setting the fillfactor needs the table's owner: another user's open leaves it unset and goes on."""
    store = PgStore(pg_dsn, CLUSTER)
    store.execute(lambda c: c.execute(
        "ALTER TABLE fleetwire_plans RESET (fillfactor);"
        "DO $$ BEGIN CREATE ROLE fw_writer LOGIN; EXCEPTION WHEN duplicate_object THEN NULL; END $$;"
        "GRANT CREATE, USAGE ON SCHEMA public TO fw_writer; GRANT ALL ON ALL TABLES IN SCHEMA public TO fw_writer;"
        "GRANT ALL ON ALL SEQUENCES IN SCHEMA public TO fw_writer"))  # fmt: skip
    store.close()
    writer = hold(PgStore(pg_dsn.replace("postgres@", "fw_writer@", 1), CLUSTER))
    try:
        writer.write([created("p1")])
        assert [p.created.plan_id for p in writer.load()] == ["p1"]
        assert writer.execute(lambda c: c.fetchval(
            "SELECT reloptions FROM pg_class WHERE relname = 'fleetwire_plans'")) is None  # fmt: skip
    finally:
        writer.close()


def test_a_version_3_schema_gets_the_name_column_and_its_plans_keep_their_ids(pg_dsn: str) -> None:
    """A v3 database (no ``name`` column: every plan's key was its owner's id) becomes v4 at open without a row
    rewritten (its rows' name stays NULL: "the id"); a plan written after it whose key is not its owner's id
    keeps that id in ``name`` (issue #24 part 6), and both come back as they were written."""
    store = hold(PgStore(pg_dsn, CLUSTER))
    store.write([created("old")])
    store.execute(lambda c: c.execute(
        "DROP INDEX fleetwire_plans_by_name; ALTER TABLE fleetwire_plans DROP COLUMN name; "
        "UPDATE fleetwire_meta SET value = '3' WHERE key = 'schema_version'"))  # fmt: skip
    store.close()
    store = hold(PgStore(pg_dsn, CLUSTER))
    try:
        assert store.execute(ensure_indexes) == ["fleetwire_plans_by_name"]
        aliased = PlanCreated("k-0001", "bob", 2, Submit(req_id=1, op="echo", plan_id="old"))  # bob's "old"
        store.write([aliased])
        rows = store.execute(lambda c: c.fetch("SELECT id, owner, name FROM fleetwire_plans ORDER BY key"))
        assert [tuple(r) for r in rows] == [("old", "alice", None), ("k-0001", "bob", "old")]
        plans = store.load()
        assert [(p.created.plan_id, p.created.submit.plan_id) for p in plans] == [("old", "old"), ("k-0001", "old")]
    finally:
        store.close()


def _tables_and_indexes(store: PgStore) -> set[str]:
    """The names of the tables and indexes of the store's schema."""
    rows = store.execute(lambda c: c.fetch("SELECT tablename FROM pg_tables WHERE schemaname = current_schema() UNION "
                                           "SELECT indexname FROM pg_indexes WHERE schemaname = current_schema()"))
    return {r[0] for r in rows}


def test_a_version_2_schema_is_migrated_to_4_with_the_views_tables_and_its_indexes(pg_dsn: str) -> None:
    """A v2 database (no views' tables, indexes, name column or partitions row) becomes v4 at open; the indexes
    are built online."""
    fresh = PgStore(pg_dsn, CLUSTER)
    assert {"fleetwire_shard_workers", "fleetwire_views", *INDEXES} <= _tables_and_indexes(fresh)
    hold(fresh).write([created("p1")])
    fresh.execute(lambda c: c.execute(
        "DROP TABLE fleetwire_shard_workers, fleetwire_views; "
        "DROP INDEX fleetwire_plans_by_id, fleetwire_plans_by_shard, fleetwire_plans_by_name; "
        "ALTER TABLE fleetwire_plans DROP COLUMN name; "
        "DELETE FROM fleetwire_meta WHERE key = 'pool_partitions'; "
        "UPDATE fleetwire_meta SET value = '2' WHERE key = 'schema_version'"))  # fmt: skip
    fresh.close()
    partitioned = ClusterConfig(shards=4, lease_ttl_s=2.0, lease_renew_s=0.2, partitions=(("gpu", 2),))
    store = hold(PgStore(pg_dsn, partitioned))
    try:
        assert [p.created.plan_id for p in store.load()] == ["p1"]
        meta = dict(store.execute(lambda c: c.fetch("SELECT key, value FROM fleetwire_meta")))
        assert meta["schema_version"] == str(SCHEMA_VERSION) == "6" and meta["pool_partitions"] == "gpu=2"
        found = _tables_and_indexes(store)
        assert {"fleetwire_shard_workers", "fleetwire_views"} <= found and not set(INDEXES) & found
        assert store.execute(ensure_indexes) == list(INDEXES)  # concurrently, outside the migration's transaction
        assert store.execute(ensure_indexes) == []  # there and valid: nothing to build
        store.execute(lambda c: c.execute("UPDATE pg_index SET indisvalid = false WHERE indexrelid = "
                                          "'fleetwire_plans_by_shard'::regclass"))  # as an interrupted build leaves it
        assert store.execute(ensure_indexes) == ["fleetwire_plans_by_shard"]  # dropped and built again
        assert set(INDEXES) <= _tables_and_indexes(store)
    finally:
        store.close()
    with pytest.raises(StoreError, match=r"--pool-partitions gpu=2, not \(none\): every coordinator"):
        PgStore(pg_dsn, CLUSTER)


def test_a_newer_schema_is_refused_naming_both_versions(pg_dsn: str) -> None:
    """A database of schema version 7 (a newer fleetwire's) is refused: 'version 7 ... up to 6'; nothing changes."""
    store = PgStore(pg_dsn, CLUSTER)
    store.execute(lambda c: c.execute("UPDATE fleetwire_meta SET value = '7' WHERE key = 'schema_version'"))
    store.close()
    with pytest.raises(StoreError, match=r"has fleetwire schema version 7; this coordinator knows versions up to 6: "):
        PgStore(pg_dsn, CLUSTER)


def test_pool_partitions_are_kept_and_another_value_is_refused(pg_dsn: str) -> None:
    """--pool-partitions is stored at creation; a coordinator given other partitions (or none) is refused."""
    mine = ClusterConfig(shards=4, partitions=(("gpu", 2), ("llm", 3)))
    PgStore(pg_dsn, mine).close()
    PgStore(pg_dsn, ClusterConfig(shards=4, partitions=(("llm", 3), ("gpu", 2)))).close()  # same, in another order
    with pytest.raises(StoreError, match=r"splits pools as --pool-partitions gpu=2,llm=3, not gpu=4: every coord"):
        PgStore(pg_dsn, ClusterConfig(shards=4, partitions=(("gpu", 4),)))
    with pytest.raises(StoreError, match=r"--pool-partitions gpu=2,llm=3, not \(none\)"):
        PgStore(pg_dsn, ClusterConfig(shards=4))


def test_a_coordinator_with_other_pool_partitions_exits_2_with_one_line(pg_dsn: str) -> None:
    """`fleetwire coordinator --pool-partitions` unlike the cluster's: one line naming both values, exit 2."""
    PgStore(pg_dsn, ClusterConfig(shards=4, partitions=(("gpu", 2),))).close()
    done = subprocess.run([sys.executable, "-m", "fleetwire", "coordinator", "--store", pg_dsn, "--shards", "4",
                           "--pool-partitions", "gpu=3", "--port", "0", "--insecure"],
                          capture_output=True, text=True, timeout=60, check=False)  # fmt: skip
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1, (done.returncode, done.stderr)
    assert "--pool-partitions gpu=2, not gpu=3" in lines[0] and lines[0].startswith("fleetwire: error: "), lines


def test_a_dsn_that_cannot_connect_or_log_in_is_one_line_naming_the_host(pg_dsn: str) -> None:
    """Connection refused, an unknown role and an unknown database: one line with host:port and the cause."""
    base = pg_dsn.rsplit("/", 1)[0]
    host = base.split("@")[1]
    with pytest.raises(StoreError, match=r"^cannot connect to PostgreSQL at 127.0.0.1:1: connection refused"):
        open_store("postgresql://postgres@127.0.0.1:1/x")
    with pytest.raises(StoreError, match=rf"^cannot connect to PostgreSQL at {host}: role \"nobody\" does not exist"):
        open_store(base.replace("postgres@", "nobody@") + "/x")
    with pytest.raises(StoreError, match=r"database \"nope\" does not exist$"):
        open_store(base + "/nope")


async def test_group_commit_through_postgres_releases_in_order(pg: PgStore) -> None:
    """The committer's writer thread groups batches into PostgreSQL transactions; payloads come out in order."""
    released: list[Any] = []
    committer: GroupCommitter[Any] = GroupCommitter(pg, released.append, lambda exc: None)
    committer.start()
    for n in range(1, 201):
        committer.submit([created(f"p{n}", n)], n)
    await committer.close()
    assert released == list(range(1, 201)) and committer.transactions < 200
    assert len(pg.load()) == 200


async def test_pipelined_committer_groups_on_the_loop_and_releases_in_order(pg: PgStore, pg_dsn: str) -> None:
    """The store's own committer commits on this loop: batches gathered while one is in flight, payloads in order."""
    released: list[Any] = []
    first = asyncio.Event()
    committer = pg.make_committer(lambda p: (released.append(p), first.set()), lambda exc: None)
    assert isinstance(committer, PipelinedCommitter)
    committer.start()
    committer.submit([created("p1", 1)], 1)
    await asyncio.wait_for(first.wait(), 10)  # the writer connection is open on this loop
    for n in range(2, 201):
        committer.submit([created(f"p{n}", n)], n)
        await asyncio.sleep(0)  # the task sends a group; the next batches gather while it is in flight
    committer.after("last")
    await committer.close()
    assert released == [*range(1, 201), "last"] and 1 < committer.transactions < 200
    with pytest.raises(StoreError, match="async committer"):
        pg.write([created("sync")])  # the threaded writer connection was handed over (two connections per store)
    check = PgStore(pg_dsn, CLUSTER)
    try:
        assert len(check.load()) == 200
    finally:
        check.close()


async def test_pipelined_committer_bounds_a_group_in_whole_batches(pg: PgStore, pg_dsn: str) -> None:
    """Batches gathered past max_group_records wait for the next group; a batch is never split; all in order."""
    released: list[Any] = []
    first = asyncio.Event()
    committer = PipelinedCommitter(pg, lambda p: (released.append(p), first.set()), lambda exc: None,
                                   max_group_records=4)  # fmt: skip
    committer.start()
    committer.submit([created("p0", 0)], 0)
    await asyncio.wait_for(first.wait(), 10)  # the writer connection is open; nothing in flight
    before = committer.transactions
    # Gathered in one loop turn: 3 + 3 records exceed 4, so each goes alone; 6 in one batch is not split.
    for n in (1, 2):
        committer.submit([created(f"p{n}", n), event(f"p{n}", 1), PlanStatus(f"p{n}", "queued", next_seq=2)], n)
    committer.submit([created(f"q{n}", 10 + n) for n in range(6)], 3)
    committer.submit([created("p4", 20)], 4)  # 1 record: rides with nothing (the 6 before it are over 4)
    await committer.close()
    assert released == [0, 1, 2, 3, 4] and committer.transactions - before == 4
    check = PgStore(pg_dsn, CLUSTER)
    try:
        assert len(check.load()) == 10
    finally:
        check.close()


async def test_pipelined_committer_a_fenced_group_releases_nothing_after_it(pg: PgStore) -> None:
    """A stolen lease: the group in flight is fenced, on_failure gets ShardFenced once, no payload comes out."""
    released: list[Any] = []
    failures: list[BaseException] = []
    first = asyncio.Event()
    committer = pg.make_committer(lambda p: (released.append(p), first.set()), failures.append)
    committer.start()
    committer.submit([created("ok")], "ok")
    await asyncio.wait_for(first.wait(), 10)
    steal(pg)
    committer.submit([created("late", 2)], "late")
    committer.submit([created("later", 3)], "later")
    await committer.close()
    assert released == ["ok"] and len(failures) == 1 and isinstance(failures[0], ShardFenced)
    committer.submit([created("after", 4)], "after")  # refused silently: the core is stopping
    assert released == ["ok"]


# ---------------------------------------------------------------- a coordinator on PostgreSQL


def settings(dsn: str) -> ServerSettings:
    return ServerSettings(port=0, insecure=True, store=dsn, cluster=CLUSTER)


async def test_a_coordinator_whose_lease_was_stolen_cannot_commit_and_stops(pg_dsn: str) -> None:
    """Lease row given to another owner/epoch: the next submit's commit is fenced, never answered, fail-stop."""
    server = CoordinatorServer(settings(pg_dsn))
    await server.start()
    assert server.readiness_problem() is None
    try:
        async with Client(server.url, reconnect_give_up_s=0.5) as client:
            await client.submit("echo", {"n": 1}, plan_id="before")
            assert server.fatal is not None
            assert isinstance(server.store, PgStore)
            steal(server.store)
            with pytest.raises(Exception):  # noqa: B017 - never accepted: the connection goes with the server
                await asyncio.wait_for(client.submit("echo", {"n": 2}, plan_id="after"), 5)
            fatal = await asyncio.wait_for(asyncio.shield(server.fatal), 10)
    finally:
        await server.stop()
    assert isinstance(fatal, ShardFenced)
    check = PgStore(pg_dsn, CLUSTER)
    assert [p.created.plan_id for p in check.load()] == ["before"]
    check.close()


async def test_a_standby_takes_over_when_the_owner_releases(pg_dsn: str) -> None:
    """A second coordinator waits (readyz: standby), then takes over at once when the owner stops (release)."""
    owner = CoordinatorServer(settings(pg_dsn))
    await owner.start()
    async with Client(owner.url) as client:
        await client.submit("echo", {"n": 1}, plan_id="queued-1")
    standby = CoordinatorServer(settings(pg_dsn))
    await standby.start()
    try:
        assert standby.readiness_problem() is not None and "standby" in (standby.readiness_problem() or "")
        await owner.stop()  # flush, release: expires_at = now()
        await asyncio.wait_for(standby.loaded.wait(), 10)
        assert standby.readiness_problem() is None and "queued-1" in standby.core.plans
        assert standby.cluster is not None and set(standby.store.fence.values()) == {2}  # type: ignore[attr-defined]
        async with Client(standby.url) as client:
            accepted = await client.submit("echo", {"n": 2}, plan_id="after-takeover")
            assert accepted.id == "after-takeover"
    finally:
        await standby.stop()
