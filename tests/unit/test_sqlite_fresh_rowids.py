"""The rowids a group gives its new plans (coordinator/io/stores/sqlite_commit.py ``write_grouped``).

A group whose creations are all new and that forgets nothing numbers them in one step; a group with a creation of
a plan already stored, or a ``PlanForgotten``, goes plan by plan. Both must give the same rows: a second creation
keeps the first, a forgotten plan created again gets a new row.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path

from coordinator.io.stores.sqlite import SQLiteStore
from coordinator.io.stores.store import DB_FILE
from coordinator.records import PlanCreated, PlanForgotten, PlanStatus, Record
from protocol.messages import Submit


def _created(plan_id: str, order: int, owner: str = "alice") -> PlanCreated:
    return PlanCreated(plan_id, owner, order, Submit(req_id=order, op="echo", args={"n": order}, plan_id=plan_id))


def _plan(plan_id: str, order: int, owner: str = "alice") -> list[Record]:
    return [_created(plan_id, order, owner), PlanStatus(plan_id, "queued", next_seq=1)]


def _rows(path: Path) -> list[tuple[int, str, str, int]]:
    db = sqlite3.connect(path)
    try:
        return db.execute("SELECT rowid, id, owner, ord FROM plans ORDER BY rowid").fetchall()
    finally:
        db.close()


def test_new_creations_are_numbered_in_order_after_the_stored_ones(tmp_path: Path) -> None:
    """All-new groups number their plans from the next rowid, in creation order, group after group."""
    path = tmp_path / DB_FILE
    store = SQLiteStore(path)
    store.write([*_plan("a", 1), *_plan("b", 2)])
    store.write([*_plan("c", 3), *_plan("d", 4), *_plan("e", 5)])
    store.close()
    assert _rows(path) == [(1, "a", "alice", 1), (2, "b", "alice", 2), (3, "c", "alice", 3), (4, "d", "alice", 4),
                           (5, "e", "alice", 5)]  # fmt: skip


def test_a_second_creation_keeps_the_first_and_a_forgotten_plan_comes_back_new(tmp_path: Path) -> None:
    """A creation of a stored plan beside new ones changes nothing of it and the new ones take the next rowids; a
    plan forgotten and created again in one group gets a new row and the next rowid."""
    path = tmp_path / DB_FILE
    store = SQLiteStore(path)
    store.write([*_plan("a", 1), *_plan("b", 2)])
    store.write([*_plan("a", 9, owner="mallory"), *_plan("c", 3)])
    store.write([PlanForgotten("b"), *_plan("b", 7, owner="bob"), *_plan("d", 4)])
    store.close()
    assert _rows(path) == [(1, "a", "alice", 1), (3, "c", "alice", 3), (4, "b", "bob", 7), (5, "d", "alice", 4)]
    again = SQLiteStore(path)
    try:
        assert {p.created.plan_id: p.created.owner for p in again.load()} == {"a": "alice", "c": "alice",
                                                                               "b": "bob", "d": "alice"}  # fmt: skip
    finally:
        again.close()
