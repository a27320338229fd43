"""A lone commit's rows (one plan a group: the round trip's p50) go as 1-D array parameters (pg_rows.py ``grid``),
read by the same statement's ``p[i:i]`` slices as a grid's columns: every kind of row part, NULLs among the values,
comes back as written (a real PostgreSQL server: tests/pg.py; skipped without one)."""

from __future__ import annotations

from typing import Any

import pytest

from coordinator.io.stores import postgres
from coordinator.io.stores.postgres import PgStore
from coordinator.records import PlanForgotten, PlanStatus
from tests.integration.test_pg_store import CLUSTER, hold
from tests.unit.test_store import created, event


def test_one_plan_groups_send_flat_arrays_and_read_back_as_written(
    pg_dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each group below touches one plan: its insert, update and spilled run's arrays hold values, not one-value
    lists, and the plans load back with every column in its place (a NULL state or status keeps the stored one)."""
    sent: list[list[Any]] = []

    def recorded(columns: list[list[Any]]) -> list[Any]:
        shaped = grid(columns)
        sent.append(shaped)
        return shaped

    grid = postgres.grid
    monkeypatch.setattr(postgres, "grid", recorded)
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
    assert sent and all(not isinstance(v, list) for shaped in sent for v in shaped), sent
    assert [(p.created.plan_id, p.created.submit.args) for p in plans] == [("a", {"x": 1}), ("b", "again")]
    a, b = plans
    assert a.status is not None and (a.status.state, a.status.worker_id, a.status.next_seq) == ("running", "w", 2)
    assert [(e.seq, e.data) for e in a.events] == [(1, "first"), *((s, "y" * 200) for s in range(2, 12))]
    assert b.status is None and b.events == []
