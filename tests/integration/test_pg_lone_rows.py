"""A lone commit's rows (one row a part: the round trip's p50) go as scalar parameters (pg_schema.py
``commit_statement``'s ``lone``), read where the part reads its row's columns (no array unnested): every kind of row
part, NULLs among the values, comes back as written (a real PostgreSQL server: tests/pg.py; skipped without one)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from coordinator.io.stores.pg_schema import commit_statement
from coordinator.io.stores.postgres import WRITER_SETTINGS, PgStore
from coordinator.records import PlanForgotten, PlanStatus
from tests.integration.test_pg_store import CLUSTER, hold
from tests.unit.test_store import created, event


def test_one_plan_groups_send_scalar_parameters_and_read_back_as_written(
    pg_dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each group below touches one plan: its commit statement's parameters are values, not arrays (but a
    delete's keys; the fence's one shard and epoch too), and the plans load back with every column in its place
    (a NULL state or status keeps the stored one)."""
    sent: list[tuple[str, tuple[Any, ...]]] = []
    fetch_held = PgStore._fetch_held  # every commit statement goes through it (§C29l: a prepared statement's own)

    async def recorded(self: PgStore, conn: Any, query: str, args: list[Any]) -> Any:
        sent.append((query, tuple(args)))
        return await fetch_held(self, conn, query, args)

    monkeypatch.setattr(PgStore, "_fetch_held", recorded)
    store = hold(PgStore(pg_dsn, CLUSTER))
    try:
        store.write([created("a", 1, args={"x": 1})])  # insert alone
        store.write([created("b", 2, args=[2]), PlanStatus("b", "queued")])
        store.write([event("a", 1, "first")])  # an inline event alone: a changed row, no status
        store.write([PlanStatus("a", "running", attempt=1, worker_id="w", next_seq=2)])
        store.write([event("a", seq, "y" * 200) for seq in range(2, 12)])  # past the inline limit: a run
        store.write([PlanStatus("b", "running", attempt=1, worker_id="v", next_seq=1)])
        store.write([PlanForgotten("b")])
        store.write([created("b", 3, args="again")])  # forgotten and created again: a new key
        store.close()
        again = PgStore(pg_dsn, CLUSTER)
        plans = again.load()
        again.close()
    finally:
        store.close()
    assert len(sent) == 8 and all(any(f"{part} AS" in q for q, _ in sent) for part in ("created", "changed", "runs"))
    for query, args in sent:
        doomed = 1 if "gone_plans" in query else 0
        assert [isinstance(v, list) for v in args] == [False] * 3 + [True] * doomed + [False] * (len(args) - 3 - doomed)
    assert [(p.created.plan_id, p.created.submit.args) for p in plans] == [("a", {"x": 1}), ("b", "again")]
    a, b = plans
    assert a.status is not None and (a.status.state, a.status.worker_id, a.status.next_seq) == ("running", "w", 2)
    assert [(e.seq, e.data) for e in a.events] == [(1, "first"), *((s, "y" * 200) for s in range(2, 12))]
    assert b.status is None and b.events == []


def test_a_lone_updates_generic_plan_reaches_plans_by_key_whatever_the_table_held(pg_dsn: str) -> None:
    """The lone form's update, its generic plan made on an empty table, still reaches plans through the primary key
    once the table is full (as the array form's: test_pg_store.py), by its key parameter: no array unnested (a
    ProjectSet, a Subquery Scan and a Nested Loop the backend set up at every execution; docs/PERFORMANCE.md §C29o)."""
    import asyncpg  # type: ignore[import-untyped]

    hold(PgStore(pg_dsn, CLUSTER)).close()  # the schema
    update = commit_statement(False, False, True, False, lone=True)
    args = "ARRAY[0], ARRAY[1::bigint], 'o', {k}, 0, 1, NULL, 'succeeded', '\\x00', NULL"

    async def plan_after_filling() -> str:
        conn = await asyncpg.connect(pg_dsn, server_settings=WRITER_SETTINGS)
        try:
            await conn.execute(f"PREPARE commit_update AS {update}")
            await conn.execute(f"EXECUTE commit_update({args.format(k=1)})")  # the generic plan is made now: no rows
            await conn.execute(
                "INSERT INTO fleetwire_plans (key, shard, id, owner, ord, state, spec, spec_crc) "
                "SELECT g, 0, 'p' || g, 'o', g, 'queued', '\\x00', 0 FROM generate_series(1, 20000) g")  # fmt: skip
            rows = await conn.fetch(f"EXPLAIN EXECUTE commit_update({args.format(k=7)})")
            return "\n".join(r[0] for r in rows)
        finally:
            await conn.close()

    plan = asyncio.run(plan_after_filling())
    assert "$" in plan, plan  # the generic plan (parameters unbound), not one made for these values
    assert "Index Scan using fleetwire_plans_pkey on fleetwire_plans" in plan, plan
    assert "Seq Scan on fleetwire_plans" not in plan, plan
    assert "ProjectSet" not in plan and "Subquery Scan" not in plan and "Index Cond: (key = $4)" in plan, plan


def test_an_inline_run_whose_chain_memory_lacks_is_chained_after_the_stored_checksum(pg_dsn: str) -> None:
    """A plan's inline events whose running checksum the store does not hold in memory (the database's alone) are
    chained after the one the database holds, read before the commit: the plan loads back whole, not damaged."""
    store = hold(PgStore(pg_dsn, CLUSTER))
    try:
        store.write([created("a", 1), event("a", 1, "first")])
        assert store._events_crc.pop("a")  # as a plan whose chain only the database holds
        store.write([event("a", 2, "second")])
        store.write([event("a", 3, "third")])  # chained in memory again
        store.close()
        again = PgStore(pg_dsn, CLUSTER)
        plans = again.load()
        again.close()
    finally:
        store.close()
    assert [(e.seq, e.data) for e in plans[0].events] == [(1, "first"), (2, "second"), (3, "third")]
