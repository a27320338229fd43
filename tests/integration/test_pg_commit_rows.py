"""How a group commit's statement reads its rows back from the array parameters (pg_schema.py ``_rows``): in step,
row by row (a ProjectSet), not first copied whole into a tuplestore (a Function Scan); the same rows either way
(a real PostgreSQL server: tests/pg.py; skipped without one)."""

from __future__ import annotations

import asyncio
import re

import pytest

from coordinator.io.stores.pg_schema import commit_statement
from coordinator.io.stores.postgres import WRITER_SETTINGS, PgStore
from coordinator.records import PlanStatus
from tests.integration.test_pg_store import CLUSTER, hold
from tests.unit.test_store import created, event

SHAPES = {  # (doomed, created, changed, runs): a statement with each kind of row part
    "created": (False, True, False, False),
    "changed": (False, False, True, False),
    "runs": (False, False, False, True),
    "all": (True, True, True, True),
}


@pytest.mark.parametrize("shape", list(SHAPES))
def test_a_groups_rows_stream_from_their_arrays_without_a_tuplestore(pg_dsn: str, shape: str) -> None:
    """The writer connection's generic plan of each commit statement unnests its rows in a ProjectSet: no Function
    Scan (which copies every row of the group into a tuplestore before the first is inserted or updated)."""
    import asyncpg  # type: ignore[import-untyped]

    hold(PgStore(pg_dsn, CLUSTER)).close()  # the schema
    sql = commit_statement(*SHAPES[shape])
    params = max(int(p) for p in re.findall(r"\$(\d+)", sql))

    async def plan() -> str:
        conn = await asyncpg.connect(pg_dsn, server_settings=WRITER_SETTINGS)
        try:
            await conn.execute(f"PREPARE commit_rows AS {sql}")
            rows = await conn.fetch(f"EXPLAIN EXECUTE commit_rows({', '.join(['NULL'] * params)})")
            return "\n".join(r[0] for r in rows)
        finally:
            await conn.close()

    text = asyncio.run(plan())
    assert "Function Scan on v" not in text, text
    assert text.count("ProjectSet") == (3 if shape == "all" else 1), text


def test_grouped_rows_padded_to_a_grid_come_back_as_written(pg_dsn: str) -> None:
    """Groups whose columns are folded into a grid with NULL padding (7 and 11 plans: rows of 3 and 4) insert, update
    and spill exactly their own plans: no padding row, none left out, every column in its place."""
    store = hold(PgStore(pg_dsn, CLUSTER))
    try:
        ids = [f"g{i:02}" for i in range(11)]
        store.write([r for n, p in enumerate(ids[:7]) for r in (created(p, n + 1, args=n), event(p, 1, n),
                                                              PlanStatus(p, "queued", next_seq=2))])  # fmt: skip
        store.write([r for n, p in enumerate(ids[7:], 7) for r in (created(p, n + 1, args=n),
                                                                 PlanStatus(p, "queued", next_seq=1))])  # fmt: skip
        spilled = [event(ids[0], seq, "x" * 200) for seq in range(2, 20)]  # past the inline limit: fleetwire_events
        store.write([*spilled, *(PlanStatus(p, "running", attempt=1, worker_id="w", next_seq=2) for p in ids[1:]),
                     *(event(p, 2, f"two-{p}") for p in ids[1:])])  # fmt: skip
        store.close()
        again = PgStore(pg_dsn, CLUSTER)
        plans = again.load()
        again.close()
    finally:
        store.close()
    assert [p.created.plan_id for p in plans] == ids
    assert [p.created.submit.args for p in plans] == list(range(11))
    assert [p.status.state if p.status else None for p in plans] == ["queued"] + ["running"] * 10
    assert [(e.seq, e.data) for e in plans[0].events] == [(1, 0), *((s, "x" * 200) for s in range(2, 20))]
    assert [(e.seq, e.data) for e in plans[3].events] == [(1, 3), (2, f"two-{ids[3]}")]
    assert [(e.seq, e.data) for e in plans[8].events] == [(2, f"two-{ids[8]}")]
