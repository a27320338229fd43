"""A lone commit's wait and its statement (issue #29, docs/PERFORMANCE.md §C29l): the store polls for a lone commit's
reply awake (its own busy-poll, wireio/spin.py's rules), and runs each commit statement through a prepared statement
of its own, prepared again when the server forgot it (``DISCARD ALL``) or a table's shape changed (a real PostgreSQL
server: tests/pg.py; skipped without one)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from coordinator.io.stores import postgres
from coordinator.io.stores.postgres import PgStore
from coordinator.records import PlanStatus
from tests.integration.test_pg_store import CLUSTER, hold
from tests.unit.test_store import created, event


async def _on_writer(store: PgStore, make: Callable[[Any], Awaitable[Any]]) -> Any:
    """``make(the writer connection)`` on the writer's own loop (the threaded writer: ``PgStore.write``'s)."""
    return await make(store._writer)


def _writer_run(store: PgStore, make: Callable[[Any], Awaitable[Any]]) -> Any:
    return store._run(_on_writer(store, make))


def test_a_lone_commit_spins_for_its_reply_and_a_group_does_not(pg_dsn: str) -> None:
    """A one-plan group's commit arms the store's spin (and the reply, within a window longer than any commit here,
    ends it as a hit); a group of many plans' rows goes without."""
    store = hold(PgStore(pg_dsn, CLUSTER))
    try:
        store.lone_spin.window_s = 5.0
        store.write([created("a", 1)])
        spin = store.lone_spin
        assert (spin.spins, spin.hits + spin.busy + spin.contended, spin.misses) == (1, 1, 0)
        assert not spin.spinning
        store.write([created(f"m{i}", 10 + i) for i in range(5)])
        assert spin.spins == 1
    finally:
        store.close()


def test_the_lone_spin_window_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """FLEETWIRE_PG_SPIN_US sets the window in µs; 0 turns it off; unset is the default; not a number: off, said."""
    monkeypatch.setenv(postgres.LONE_SPIN_ENV, "250")
    assert postgres.lone_spin_from_env() == pytest.approx(250e-6)
    monkeypatch.setenv(postgres.LONE_SPIN_ENV, "0")
    assert postgres.lone_spin_from_env() == 0.0
    monkeypatch.delenv(postgres.LONE_SPIN_ENV)
    assert postgres.lone_spin_from_env() == postgres.LONE_SPIN_S
    monkeypatch.setenv(postgres.LONE_SPIN_ENV, "fast")
    with pytest.warns(UserWarning, match="not a number"):
        assert postgres.lone_spin_from_env() == 0.0


def test_a_commit_statement_is_prepared_once_and_run_as_prepared(pg_dsn: str) -> None:
    """The second commit of the same statement text reuses the store's prepared statement: the server holds it
    once, and no other statement of that text was prepared for it."""
    store = hold(PgStore(pg_dsn, CLUSTER))
    try:
        store.write([created("a", 1)])
        store.write([created("b", 2)])
        store.write([created("c", 3)])
        assert len(store._prepared) == 1
        (sql,) = store._prepared
        count = _writer_run(store, lambda c: c.fetchval(
            "SELECT count(*) FROM pg_prepared_statements WHERE statement = $1", sql))  # fmt: skip
        assert count == 1
    finally:
        store.close()


def test_a_commit_after_discard_all_prepares_again_and_commits(pg_dsn: str) -> None:
    """``DISCARD ALL`` on the writer connection (a pooler's reset) drops every prepared statement: the next commit
    of the same statement prepares it again and commits; nothing is lost or doubled."""
    store = hold(PgStore(pg_dsn, CLUSTER))
    try:
        store.write([created("a", 1)])
        _writer_run(store, lambda c: c.execute("DISCARD ALL"))  # the writer's settings too: reset to the server's
        store.write([created("b", 2)])
        store.write([PlanStatus("b", "queued")])
        _writer_run(store, lambda c: c.execute("DEALLOCATE ALL"))
        store.write([PlanStatus("b", "running", attempt=1, worker_id="w", next_seq=1)])
        store.write([event("b", 1, "x")])
        store.close()
        again = PgStore(pg_dsn, CLUSTER)
        plans = again.load()
        again.close()
    finally:
        store.close()
    assert [p.created.plan_id for p in plans] == ["a", "b"]
    b = plans[1]
    assert b.status is not None and (b.status.state, b.status.worker_id) == ("running", "w")
    assert [(e.seq, e.data) for e in b.events] == [(1, "x")]


def test_a_commit_after_a_tables_shape_changed_commits(pg_dsn: str) -> None:
    """A column added to the plans table (another version's migration) after the statements were prepared: the next
    commits still commit and read back."""
    store = hold(PgStore(pg_dsn, CLUSTER))
    try:
        store.write([created("a", 1)])
        store.write([PlanStatus("a", "queued")])
        store.execute(lambda c: c.execute("ALTER TABLE fleetwire_plans ADD COLUMN later_version int"))
        store.write([created("b", 2)])
        store.write([PlanStatus("a", "running", attempt=1, worker_id="w", next_seq=1)])
        store.close()
        again = PgStore(pg_dsn, CLUSTER)
        plans = again.load()
        again.close()
    finally:
        store.close()
    assert [p.created.plan_id for p in plans] == ["a", "b"]
    assert plans[0].status is not None and plans[0].status.state == "running"


def test_statements_without_the_protocols_state_run_as_prepared_statements(pg_dsn: str) -> None:
    """Where asyncpg's statement state cannot be read (another asyncpg), the store's prepared statements run through
    PreparedStatement instead, and commit the same."""
    store = hold(PgStore(pg_dsn, CLUSTER))
    try:
        store.write([created("a", 1)])
        store._prepared = {sql: (stmt, None) for sql, (stmt, _) in store._prepared.items()}
        store._protocol = None  # as PgStore reads it from a connection without one
        store.write([created("b", 2)])
        store.write([PlanStatus("b", "queued")])
        assert all(state is None for _, state in store._prepared.values()) and len(store._prepared) == 2
        store.close()
        again = PgStore(pg_dsn, CLUSTER)
        plans = again.load()
        again.close()
    finally:
        store.close()
    assert [p.created.plan_id for p in plans] == ["a", "b"]
    assert plans[1].status is not None and plans[1].status.state == "queued"
