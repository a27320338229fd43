"""The usage ledger survives a restart (issue #27): UsageRows records, kept by the SQLite and memory stores."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from coordinator import Coordinator, CoreConfig
from coordinator.io.stores.schema import SCHEMA_VERSION
from coordinator.io.stores.sqlite import SQLiteStore
from coordinator.io.stores.store import MemoryStore
from coordinator.ledger import BUCKET_S, UsageRow
from coordinator.records import UsageRows
from coordinator.teams import Member, Team, TeamBook
from protocol.messages import ErrorInfo
from tests.unit.test_sharing import Fleet

WALL = 1_800_000_000.0  # Unix time at the fake clock's 0


def run_some_plans() -> tuple[Fleet, list[UsageRows]]:
    """Alice (team ml) runs a plan 4 s, bob (team web) one that fails; the tick's UsageRows are taken."""
    f = Fleet(slots=2, teams=TeamBook([Team("ml"), Team("web")], {"alice": Member("ml"), "bob": Member("web")}))
    core = f.h.core
    core.set_wall_offset(WALL)
    a, b = f.submit("alice"), f.submit("bob")
    f.at(0.0)
    f.at(4.0)
    f.finish(a)
    f.finish(b, "failed", error=ErrorInfo("handler_error", "boom"))
    core.tick(5.0)
    records = [r for r in core.take_effects().records if isinstance(r, UsageRows)]
    return f, records


def totals(core: Coordinator) -> dict[str, tuple[int, int, float]]:
    return {name: (t.succeeded, t.failed, t.slot_s) for name, t in core.sharing.ledger.totals("principal").items()}


def test_the_tick_sends_the_changed_rows_once() -> None:
    """The tick's effects carry one UsageRows with the rows changed since the last; the next tick, none."""
    f, records = run_some_plans()
    [record] = records
    assert {(principal, team) for _, principal, team, _ in record.rows} == {("alice", "ml"), ("bob", "web")}
    core = f.h.core
    core.tick(6.0)
    assert not [r for r in core.take_effects().records if isinstance(r, UsageRows)]


@pytest.mark.parametrize("kind", ["sqlite", "memory"])
def test_a_restarted_coordinator_has_the_same_ledger(kind: str, tmp_path: Path) -> None:
    """Rows written to a store and read back by a new core give the same totals by principal."""
    f, records = run_some_plans()
    store = SQLiteStore(tmp_path / "c.sqlite3") if kind == "sqlite" else MemoryStore()
    store.write(records)
    store.close()
    if kind == "sqlite":
        store = SQLiteStore(tmp_path / "c.sqlite3")
    usage = store.abilities.usage
    assert usage is not None
    fresh = Coordinator(CoreConfig(), new_id=lambda: "x")
    fresh.restore_usage(usage())
    assert totals(fresh) == totals(f.h.core) == {"alice": (1, 0, 4.0), "bob": (0, 1, 4.0)}
    store.close()


def test_folded_hours_are_deleted_from_the_store(tmp_path: Path) -> None:
    """A row folded into hour 0 is dropped from the store and hour 0's row written instead."""
    store = SQLiteStore(tmp_path / "c.sqlite3")
    hour = int(WALL // BUCKET_S) * BUCKET_S
    store.write([UsageRows([(hour, "alice", "ml", [1, 0, 0, 2.0])])])
    store.write([UsageRows([(0, "alice", "ml", [1, 0, 0, 2.0])], deleted=[(hour, "alice", "ml")])])
    rows = store.load_usage()
    assert [(r.hour_s, r.principal, r.totals.succeeded, r.totals.slot_s) for r in rows] == [(0, "alice", 1, 2.0)]
    store.close()


def test_a_version_4_file_gains_the_usage_table(tmp_path: Path) -> None:
    """A store file of schema version 4 (before the ledger) is migrated and keeps usage from then on."""
    path = tmp_path / "c.sqlite3"
    SQLiteStore(path).close()
    db = sqlite3.connect(path)
    db.executescript("DROP TABLE usage; ALTER TABLE plans DROP COLUMN gen; PRAGMA user_version = 4;")
    db.close()
    store = SQLiteStore(path)
    assert store._db.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
    store.write([UsageRows([(3600, "bob", "web", [0, 1])])])
    assert store.load_usage() == [UsageRow.of(3600, "bob", "web", [0, 1])]
    store.close()
