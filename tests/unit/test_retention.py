"""Retention of finished plans (coordinator/retention.py, docs/SEMANTICS.md §Durability, Retention):
the core with a fake clock, and the stores deleting a forgotten plan (SQLite on a real file)."""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Any

import pytest

from coordinator.core import CoreConfig
from coordinator.io.server import ServerSettings
from coordinator.io.store import DB_FILE, MemoryStore, SQLiteStore
from coordinator.records import PlanForgotten, PlanStatus
from protocol import errors
from protocol.messages import (
    Accepted,
    Assign,
    Cancel,
    Done,
    Error,
    GetPlan,
    ListPlans,
    PlanReply,
    Plans,
    Subscribe,
)
from tests.unit.test_durability_core import Durable, running_plan
from tests.unit.test_store import created, event

S = 100.0  # the retention these tests run with


def finished_plan(h: Durable, at: float, plan_id: str = "job-1") -> tuple[int, str]:
    """A client (returned) and a plan that a worker runs and finishes ``succeeded`` at time ``at``."""
    h.now = at
    c, w, pid = running_plan(h, plan_id=plan_id)
    h.send(w, Done(plan_id=pid, attempt=1, outcome="succeeded", result=7, seq=2))
    assert h.state(pid) == "succeeded"
    return c, pid


def get_plan(h: Durable, c: int, plan_id: str) -> Any:
    h.send(c, GetPlan(req_id=99, plan_id=plan_id))
    (reply,) = [m for m in h.take(c) if isinstance(m, PlanReply | Error)]
    return reply


def test_finished_plan_is_kept_for_the_retention_then_is_not_found() -> None:
    """A plan finished at t answers get_plan at t+S-1; after t+S it is gone: plan_not_found everywhere."""
    h = Durable(plan_retention_s=S)
    c, pid = finished_plan(h, at=10.0)
    h.tick(10.0 + S - 1)
    assert isinstance(get_plan(h, c, pid), PlanReply) and pid in h.core.plans
    h.tick(10.0 + S + 1)
    reply = get_plan(h, c, pid)
    assert isinstance(reply, Error) and reply.code == errors.PLAN_NOT_FOUND and reply.plan_id == pid
    h.send(c, Subscribe(req_id=5, plan_ids=[pid]))
    h.send(c, Cancel(req_id=6, plan_id=pid))
    assert [m.code for m in h.take(c) if isinstance(m, Error)] == [errors.PLAN_NOT_FOUND] * 2
    h.send(c, ListPlans(req_id=7))
    (listed,) = [m for m in h.take(c) if isinstance(m, Plans)]
    assert listed.plans == [] and listed.total == 0
    assert h.core.counters["plans_forgotten"] == 1 and len(h.core.retention) == 0
    assert h.core.subscriptions.followers(pid) == ()  # the submit's subscription went with it
    assert PlanForgotten(pid) in h.records and h.store.load() == []


def test_unfinished_plans_are_never_forgotten() -> None:
    """A queued plan stays however long it waits, and so does a cancelled plan whose worker holds its lease."""
    h = Durable(plan_retention_s=S, heartbeat_timeout_s=1e6)
    c, w, running = running_plan(h, plan_id="run-1")
    queued = h.submit(c, op="nobody-runs-this", plan_id="wait-1")
    h.send(c, Cancel(req_id=3, plan_id=running))  # ends the plan; the slot stays claimed until done
    assert h.state(running) == "cancelled"
    h.tick(2 * S)
    assert h.state(queued) == "queued" and h.state(running) == "cancelled"  # its lease still held
    cancel = [m for m in h.take(w) if isinstance(m, Cancel)]
    h.send(w, Done(plan_id=running, attempt=cancel[0].attempt, outcome="cancelled", seq=2))  # at 2S
    h.tick(3 * S - 1)
    assert running in h.core.plans  # looked at again one retention after the lease was seen held
    h.tick(3 * S + 1)
    assert running not in h.core.plans and h.state(queued) == "queued"
    h.tick(100 * S)
    assert h.state(queued) == "queued" and h.core.counters["plans_forgotten"] == 1


def test_resubmit_of_a_forgotten_id_is_a_new_plan() -> None:
    """The same plan_id is a duplicate within the retention and a new plan (seq from 1) after it."""
    h = Durable(plan_retention_s=S)
    c, pid = finished_plan(h, at=0.0)
    h.take(c)
    h.submit(c, plan_id=pid)
    assert [m.duplicate for m in h.take(c) if isinstance(m, Accepted)] == [True]
    h.tick(S + 1)
    w = h.worker("w2")
    h.submit(c, plan_id=pid)
    msgs = h.take(c)
    assert [m.duplicate for m in msgs if isinstance(m, Accepted)] == [False]
    plan = h.core.plans[pid]
    assert plan.state == "leased" and plan.attempt == 1 and plan.events[0].seq == 1
    assert only_assign(h.take(w)).plan_id == pid
    # In the store: the forget, then the new creation; a restart gives back the new plan only.
    (stored,) = h.store.load()
    assert stored.status is not None and stored.status.state == "leased" and stored.events[0].kind == "queued"


def only_assign(msgs: list[Any]) -> Assign:
    (assign,) = [m for m in msgs if isinstance(m, Assign)]
    return assign


def test_zero_retention_keeps_every_plan() -> None:
    """--plan-retention 0: a finished plan is never forgotten and nothing is tracked for it."""
    h = Durable(plan_retention_s=0.0)
    c, pid = finished_plan(h, at=0.0)
    h.tick(1e9)
    assert isinstance(get_plan(h, c, pid), PlanReply)
    assert len(h.core.retention) == 0 and h.core.counters["plans_forgotten"] == 0


def test_a_restored_finished_plan_counts_as_ended_at_the_restore() -> None:
    """After a restart a plan that had finished is kept one whole retention from the restore time."""
    h = Durable(plan_retention_s=S)
    _, pid = finished_plan(h, at=0.0)
    h.restart(now=S - 10)  # it would have gone at S + 1 without the restart
    h.tick(2 * S - 11)
    assert pid in h.core.plans
    h.tick(2 * S - 9)
    assert pid not in h.core.plans and h.store.load() == []


def test_a_sweep_forgets_at_most_its_budget_and_the_rest_next_tick() -> None:
    """Many plans expiring at once are forgotten a bounded number per tick, oldest first, none lost."""
    h = Durable(plan_retention_s=S)
    ids = [finished_plan(h, at=float(i), plan_id=f"job-{i}")[1] for i in range(5)]
    h.core.retention.max_per_sweep = 2
    h.tick(10 * S)
    assert [pid for pid in ids if pid not in h.core.plans] == ids[:2]
    h.tick(10 * S + 1)
    h.tick(10 * S + 2)
    assert not any(pid in h.core.plans for pid in ids) and h.core.counters["plans_forgotten"] == 5


def test_negative_plan_retention_is_refused() -> None:
    """ServerSettings.check names --plan-retention when it is negative (or NaN)."""
    for bad in (-1.0, float("nan")):
        with pytest.raises(ValueError, match="--plan-retention must be >= 0"):
            ServerSettings(insecure=True, core=CoreConfig(plan_retention_s=bad)).check()


def test_cli_flag_reaches_the_server_settings() -> None:
    """`fleetwire coordinator --plan-retention 60` sets ServerSettings.plan_retention_s; the default is 24 h."""
    from fleetwire.cli import _server_settings, build_parser

    parser = build_parser()
    ns = parser.parse_args(["coordinator", "--insecure", "--plan-retention", "60"])
    assert _server_settings(ns, (), ()).core.plan_retention_s == 60.0
    assert _server_settings(parser.parse_args(["coordinator", "--insecure"]), (), ()).core.plan_retention_s == 86400.0


# ---------------------------------------------------------------- stores


def test_sqlite_forget_deletes_the_plan_row_and_its_event_rows(tmp_path: Path) -> None:
    """After a PlanForgotten write the plan is not loaded back from the file and its events rows are gone."""
    path = tmp_path / DB_FILE
    store = SQLiteStore(path)
    for order, pid in enumerate(("a", "b"), 1):
        store.write([created(pid, order), event(pid, 1, "x" * 600), PlanStatus(pid, "running", next_seq=2)])
        store.write([event(pid, seq, seq) for seq in range(2, 40)] + [PlanStatus(pid, "succeeded", next_seq=40)])
    rowid_a = store._rowids["a"]
    assert store._db.execute("SELECT count(*) FROM events WHERE plan = ?", (rowid_a,)).fetchone()[0] > 0
    store.write([PlanForgotten("a")])
    store.close()
    again = SQLiteStore(path)
    plans = again.load()
    again.close()
    assert [p.created.plan_id for p in plans] == ["b"] and [e.seq for e in plans[0].events] == list(range(1, 40))
    conn = sqlite3.connect(path)
    assert conn.execute("SELECT count(*) FROM events WHERE plan = ?", (rowid_a,)).fetchone()[0] == 0
    assert conn.execute("SELECT id FROM plans").fetchall() == [("b",)]
    conn.close()


def test_sqlite_forget_then_create_of_the_same_id_in_one_group(tmp_path: Path) -> None:
    """Records apply in order: a forget then a creation of the same id, in one write, leaves only the new plan."""
    store = SQLiteStore(tmp_path / DB_FILE)
    store.write([created("a", 1, args="old"), event("a", 1, "old"), PlanStatus("a", "succeeded", next_seq=2)])
    store.write([event("a", 9, "late"), PlanForgotten("a"), created("a", 2, args="new"), event("a", 1, "new"),
                 PlanStatus("a", "queued", next_seq=2)])  # fmt: skip
    store.write([created("a", 3, args="again")])  # known again: a second creation keeps the first
    (plan,) = store.load()
    store.close()
    assert plan.created.submit.args == "new" and [(e.seq, e.data) for e in plan.events] == [(1, "new")]


def test_memory_store_forgets_a_plan() -> None:
    """MemoryStore.write drops a forgotten plan; a later creation of its id is a new plan."""
    store = MemoryStore()
    store.write([created("a", 1, args="old"), event("a", 1), PlanStatus("a", "succeeded", next_seq=2)])
    store.write([PlanForgotten("a")])
    assert store.load() == []
    store.write([created("a", 2, args="new")])
    (plan,) = store.load()
    assert plan.created.submit.args == "new" and plan.events == [] and plan.status is None
