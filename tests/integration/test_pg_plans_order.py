"""fleetwire_plans' column order (schema version 6): what a plan's updates never change comes first, so a HOT
update's WAL record does not carry the plan's spec again; a version 5 database is copied into that order at open
and keeps every plan, its table options, grants and indexes (a real PostgreSQL server: tests/pg.py)."""

from __future__ import annotations

from typing import Any

from coordinator.io.stores.pg_schema import SCHEMA_VERSION
from coordinator.io.stores.postgres import PgStore, ensure_indexes
from coordinator.records import PlanCreated, PlanStatus
from coordinator.shards import ClusterConfig
from protocol.messages import Submit
from tests.integration.test_pg_store import hold
from tests.unit.test_store import created, event

CLUSTER = ClusterConfig(shards=4, lease_ttl_s=2.0, lease_renew_s=0.2)
V6_ORDER = ["key", "shard", "ord", "spec_crc", "id", "owner", "name", "spec",
            "state", "nevents", "status_crc", "events_crc", "status", "events"]  # fmt: skip
# The table as versions 1-5 created it (version 4 added name at its end).
V5_TABLE = """CREATE TABLE fleetwire_plans (
    key bigint PRIMARY KEY, shard int NOT NULL, id text NOT NULL, owner text NOT NULL, ord bigint NOT NULL,
    state text NOT NULL, spec bytea NOT NULL, status bytea, events bytea, nevents int NOT NULL DEFAULT 0,
    spec_crc bigint NOT NULL, status_crc bigint, events_crc bigint, name text)"""


def _columns(store: PgStore) -> list[str]:
    return [r[0] for r in store.execute(lambda c: c.fetch(
        "SELECT attname FROM pg_attribute WHERE attrelid = 'fleetwire_plans'::regclass AND attnum > 0 "
        "AND NOT attisdropped ORDER BY attnum"))]  # fmt: skip


def _rows(store: PgStore) -> list[tuple[Any, ...]]:
    return [tuple(r) for r in store.execute(lambda c: c.fetch(
        f"SELECT {', '.join(sorted(V6_ORDER))} FROM fleetwire_plans ORDER BY key"))]  # fmt: skip


def _update_wal(store: PgStore, spec_bytes: int) -> int:
    """The bytes (full-page images left out) of the heap update record of a plan's status change, the plan's
    spec carrying ``spec_bytes`` of arguments (pg_walinspect over the commit's WAL)."""
    plan = f"p{spec_bytes}"
    store.write([created(plan, args=b"x" * spec_bytes), PlanStatus(plan, "queued", next_seq=1)])
    start = store.execute(lambda c: c.fetchval("SELECT pg_current_wal_insert_lsn()::text"))
    store.write([PlanStatus(plan, "leased", attempt=1, worker_id="w1", next_seq=1)])
    return int(store.execute(lambda c: c.fetchval(
        "SELECT max(record_length - fpi_length) FROM pg_get_wal_records_info($1::text::pg_lsn, "
        "pg_current_wal_flush_lsn()) WHERE resource_manager = 'Heap' AND record_type IN ('HOT_UPDATE', 'UPDATE')",
        start)))  # fmt: skip


def test_a_plans_update_does_not_log_its_spec_again(pg_dsn: str) -> None:
    """A status change of a plan whose spec is 1,500 bytes longer logs as many bytes as one with a short spec
    (versions 1-5 logged the spec in every update: ``state`` came before it and ``status`` after)."""
    store = hold(PgStore(pg_dsn, CLUSTER))
    try:
        assert _columns(store) == V6_ORDER
        store.execute(lambda c: c.execute("CREATE EXTENSION IF NOT EXISTS pg_walinspect"))
        short, long = _update_wal(store, 10), _update_wal(store, 1500)
        assert 0 < long - short < 64, (short, long)
    finally:
        store.close()


def test_a_version_5_database_is_copied_into_the_new_order_and_keeps_everything(pg_dsn: str) -> None:
    """A v5 fleetwire_plans (the old column order) becomes v6 at open: every plan comes back as it was (same
    stored bytes, the same plans loaded), with the table's fillfactor, another role's grants, its valid indexes
    (an operator's own too) and its primary key; an index it lacked is left for ensure_indexes, built online."""
    store = hold(PgStore(pg_dsn, CLUSTER))
    named = PlanCreated("k-0001", "bob", 3, Submit(req_id=1, op="echo", plan_id="p1"))  # bob's "p1": name kept
    store.write([created("p1", 1, args={"a": 1}), event("p1", 1, "hello"), PlanStatus("p1", "queued", next_seq=2),
                 created("p2", 2), named, PlanStatus("k-0001", "queued", next_seq=1)])  # fmt: skip
    store.write([event("p1", 2), PlanStatus("p1", "running", attempt=1, worker_id="w1", next_seq=3)])
    before_rows, before = _rows(store), [(p.created, p.status, p.events) for p in store.load()]
    store.execute(lambda c: c.execute(
        "ALTER TABLE fleetwire_plans RENAME TO plans_now; ALTER INDEX fleetwire_plans_pkey RENAME TO plans_now_pkey; "
        "DROP INDEX fleetwire_plans_by_id, fleetwire_plans_by_shard, fleetwire_plans_by_name; "
        f"{V5_TABLE}; ALTER TABLE fleetwire_plans SET (fillfactor = 70); "
        "INSERT INTO fleetwire_plans SELECT key, shard, id, owner, ord, state, spec, status, events, nevents, "
        "spec_crc, status_crc, events_crc, name FROM plans_now; DROP TABLE plans_now; "
        "CREATE INDEX fleetwire_plans_by_id ON fleetwire_plans (id); "
        "CREATE INDEX fleetwire_plans_by_shard ON fleetwire_plans (shard, key); "
        "CREATE INDEX operators_by_state ON fleetwire_plans (state); "
        "DO $$ BEGIN CREATE ROLE fw_reader; EXCEPTION WHEN duplicate_object THEN NULL; END $$; "
        "GRANT SELECT ON fleetwire_plans TO fw_reader; "
        "UPDATE fleetwire_meta SET value = '5' WHERE key = 'schema_version'"))  # fmt: skip
    assert _columns(store)[:6] == ["key", "shard", "id", "owner", "ord", "state"]  # the old order, as v5 made it
    store.close()
    store = hold(PgStore(pg_dsn, CLUSTER))
    try:
        assert store.execute(lambda c: c.fetchval(
            "SELECT value FROM fleetwire_meta WHERE key = 'schema_version'")) == str(SCHEMA_VERSION) == "6"  # fmt: skip
        assert _columns(store) == V6_ORDER
        assert _reltuples(store) == 3  # a copied table with rows is analyzed at once
        assert _rows(store) == before_rows
        assert [(p.created, p.status, p.events) for p in store.load()] == before
        options = "SELECT reloptions FROM pg_class WHERE relname = 'fleetwire_plans'"
        assert store.execute(lambda c: c.fetchval(options)) == ["fillfactor=70"]
        assert store.execute(lambda c: c.fetchval(
            "SELECT has_table_privilege('fw_reader', 'fleetwire_plans', 'SELECT')")) is True  # fmt: skip
        indexes = store.execute(lambda c: c.fetch(
            "SELECT indexrelid::regclass::text, indisprimary, indisvalid FROM pg_index "
            "WHERE indrelid = 'fleetwire_plans'::regclass ORDER BY 1"))  # fmt: skip
        assert [tuple(r) for r in indexes] == [
            ("fleetwire_plans_by_id", False, True), ("fleetwire_plans_by_shard", False, True),
            ("fleetwire_plans_pkey", True, True), ("operators_by_state", False, True)]  # fmt: skip
        assert store.execute(ensure_indexes) == ["fleetwire_plans_by_name"]
        store.write([event("p1", 3), PlanStatus("p1", "succeeded", attempt=1, worker_id="w1", next_seq=4)])
        assert [p.status.state for p in store.load() if p.status is not None] == ["succeeded", "queued"]
    finally:
        store.close()


def test_a_group_updating_every_plan_of_its_pages_keeps_every_update_hot(pg_dsn: str) -> None:
    """Plans inserted together, then all updated by one group (each row growing by its status and first events, as
    a worker's frame does): every update stays on its page (HOT: no index entry, no row on another page). With
    fillfactor 50 the versions one statement makes did not fit in the half left free (some updates went elsewhere)."""
    store = hold(PgStore(pg_dsn, CLUSTER))
    try:
        store.execute(lambda c: c.execute("CREATE EXTENSION IF NOT EXISTS pg_walinspect"))
        plans = [f"p{i:03}" for i in range(60)]
        store.write([r for p in plans for r in (created(p, args={"n": p, "pad": "x" * 100}),
                                                PlanStatus(p, "queued", next_seq=1))])  # fmt: skip
        start = store.execute(lambda c: c.fetchval("SELECT pg_current_wal_insert_lsn()::text"))
        running = [PlanStatus(p, "running", attempt=1, worker_id="w" * 40, next_seq=3) for p in plans]
        store.write([r for p, s in zip(plans, running, strict=True) for r in (event(p, 1, "y" * 120),
                                                                              event(p, 2, "z" * 60), s)])  # fmt: skip
        kinds = dict(store.execute(lambda c: c.fetch(
            "SELECT record_type, count(*) FROM pg_get_wal_records_info($1::text::pg_lsn, pg_current_wal_flush_lsn()) "
            "WHERE resource_manager = 'Heap' AND record_type LIKE '%UPDATE%' GROUP BY 1", start)))  # fmt: skip
        assert kinds == {"HOT_UPDATE": len(plans)}, kinds
    finally:
        store.close()


def _reltuples(store: PgStore) -> float:
    return float(store.execute(lambda c: c.fetchval(
        "SELECT reltuples FROM pg_class WHERE oid = 'fleetwire_plans'::regclass")))  # fmt: skip


def test_a_new_database_leaves_its_empty_plans_table_unanalyzed_for_the_planner(pg_dsn: str) -> None:
    """A new database passes through version 6's copy too: analyzed empty (reltuples 0, not -1: never analyzed),
    the planner takes the table for truly empty and the store's prepared statements settle on generic plans that
    scan it whole, so a lone commit grew with the table (bench/cluster_throughput.py: 1.6 -> 3.5 ms p50 at 10,000
    plans). A copied table that holds rows is analyzed at once (the test above's upgrade)."""
    store = hold(PgStore(pg_dsn, CLUSTER))
    try:
        assert _reltuples(store) == -1
    finally:
        store.close()
