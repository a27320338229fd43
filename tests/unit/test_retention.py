"""Retention of finished plans (coordinator/retention.py, docs/SEMANTICS.md §Durability, Retention):
the core with a fake clock, and the stores deleting a forgotten plan (SQLite on a real file)."""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Any

import msgspec
import pytest

from coordinator.core import Coordinator, CoreConfig
from coordinator.io.frontdoor.server import ServerSettings
from coordinator.io.stores.sqlite import SQLiteStore
from coordinator.io.stores.store import DB_FILE, MemoryStore
from coordinator.plans import PLAN_OVERHEAD_BYTES, event_bytes
from coordinator.records import PlanForgotten, PlanStatus
from coordinator.retention import DEFAULT_RETENTION_BYTES
from protocol import errors
from protocol.messages import (
    Accept,
    Accepted,
    Assign,
    Cancel,
    Done,
    Error,
    Event,
    GetPlan,
    ListPlans,
    PlanReply,
    Plans,
    Resync,
    Subscribe,
)
from tests.unit.test_durability_core import Durable, only, running_plan
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
    """--plan-retention 0 and --plan-retention-bytes 0: a finished plan is never forgotten, nothing is tracked."""
    h = Durable(plan_retention_s=0.0, plan_retention_bytes=0)
    c, pid = finished_plan(h, at=0.0)
    h.tick(1e9)
    assert isinstance(get_plan(h, c, pid), PlanReply)
    assert len(h.core.retention) == 0 and h.core.counters["plans_forgotten"] == 0


HOUR = 3600.0


def restart_at(h: Durable, now: float, wall: float) -> None:
    """A new process whose monotonic clock reads ``now`` while the wall clock reads ``wall``."""
    h.now = now
    h.core = Coordinator(CoreConfig(**h.config), new_id=lambda: "unused")
    h.core.set_wall_offset(wall - now)
    h.core.restore(h.store.load(), now)
    h.inbox.clear()
    h._pump()


def test_retention_runs_from_the_stored_end_time_across_a_restart() -> None:
    """A plan that ended 23 h before a restart is forgotten 1 h after it (24 h retention), on a new clock."""
    h = Durable(plan_retention_s=24 * HOUR)
    wall0 = 1_800_000_000.0  # Unix time of the first process's now = 0
    h.core.set_wall_offset(wall0)
    _, pid = finished_plan(h, at=5.0)
    (status,) = [r for r in h.records if isinstance(r, PlanStatus) and r.state == "succeeded"]
    assert status.ended_at == wall0 + 5.0
    # The new process's monotonic clock starts near 0 again, 23 h of wall time later.
    restart_at(h, now=1.0, wall=wall0 + 5.0 + 23 * HOUR)
    h.tick(1.0 + HOUR - 2)
    assert pid in h.core.plans
    h.tick(1.0 + HOUR + 2)
    assert pid not in h.core.plans and h.store.load() == []
    assert h.core.counters["plans_forgotten.time"] == 1


def test_retention_survives_restarts_more_often_than_the_window() -> None:
    """Restarting every half retention does not keep a finished plan: it goes one retention after its end."""
    h = Durable(plan_retention_s=S)
    h.core.set_wall_offset(1000.0)
    _, pid = finished_plan(h, at=0.0)  # ended at wall 1000
    restart_at(h, now=0.0, wall=1000.0 + S / 2)
    h.tick(S / 2 - 1)
    restart_at(h, now=0.0, wall=1000.0 + S - 1)
    assert pid in h.core.plans
    h.tick(2.0)  # wall 1000 + S + 1
    assert pid not in h.core.plans


def test_a_plan_stored_without_an_end_time_ends_at_the_restore_and_gets_one() -> None:
    """A finished plan from an older store (no ended_at) counts as ended at the restore, which is written back."""
    h = Durable(plan_retention_s=S)
    _, pid = finished_plan(h, at=0.0)
    stored = h.store._plans[pid]
    assert stored.status is not None
    stored.status = msgspec.structs.replace(stored.status, ended_at=None)  # as an older coordinator wrote it
    h.records.clear()
    restart_at(h, now=0.0, wall=500.0)
    assert [r.ended_at for r in h.records if isinstance(r, PlanStatus)] == [500.0]
    restart_at(h, now=0.0, wall=500.0 + S - 1)
    assert pid in h.core.plans
    h.tick(2.0)
    assert pid not in h.core.plans


def test_a_finished_plan_drops_its_ephemeral_events_and_a_replay_resyncs_them() -> None:
    """At its end a plan keeps only durable events (held bytes drop); a late subscriber gets a resync for the rest."""
    h = Durable()
    c, w, pid = running_plan(h)
    for seq in range(2, 52):
        h.send(w, Event(plan_id=pid, attempt=1, kind="token", data="t" * 200, ephemeral=True, seq=seq))
    plan = h.core.plans[pid]
    held_running = plan.held_bytes
    assert held_running > 50 * 200
    h.send(w, Done(plan_id=pid, attempt=1, outcome="succeeded", result=7, seq=52))
    assert not any(e.ephemeral for e in plan.events)
    assert plan.held_bytes < held_running - 50 * 200
    assert plan.retained_bytes() == PLAN_OVERHEAD_BYTES + event_bytes(None) + event_bytes(7) + plan.held_bytes
    h.take(c)
    h.send(c, Subscribe(req_id=5, plan_ids=[pid], from_seq=0))
    replay = [m for m in h.take(c) if isinstance(m, Event | Resync)]
    kinds = [m.kind if isinstance(m, Event) else ("resync", m.first_seq, m.last_seq) for m in replay]
    tokens = [e.seq for e in replay if isinstance(e, Event) and e.kind == "token"]
    assert tokens == [] and ("resync", 4, 53) in kinds and kinds[-1] == "succeeded", kinds


def test_memory_held_per_finished_plan_drops() -> None:
    """A finished plan's retained bytes are its payloads and durable events, not its token stream."""
    h = Durable(max_events_per_plan=10_000)
    _, w, pid = running_plan(h)
    for seq in range(2, 1002):
        h.send(w, Event(plan_id=pid, attempt=1, kind="token", data="tok", ephemeral=True, seq=seq))
    plan = h.core.plans[pid]
    before = plan.held_bytes
    h.send(w, Done(plan_id=pid, attempt=1, outcome="succeeded", result="ok", seq=1002))
    assert len(plan.events) <= 5 and plan.held_bytes * 20 < before
    assert h.core.retention.retained_bytes == plan.retained_bytes() < 2 * PLAN_OVERHEAD_BYTES


def test_finished_plans_past_the_byte_bound_are_forgotten_oldest_first() -> None:
    """--plan-retention-bytes: the oldest finished plans go until the rest fit, whatever their age; counted as bytes."""
    h = Durable(plan_retention_s=1e9, plan_retention_bytes=3 * PLAN_OVERHEAD_BYTES + 3 * 2000)
    c = h.client()
    w = h.worker("w1")
    ids = []
    for i in range(5):
        h.now = float(i)
        pid = h.submit(c, plan_id=f"job-{i}", args="a" * 1500)
        assign = only(h.take(w), Assign)
        h.send(w, Accept(plan_id=pid, attempt=assign.attempt, seq=2 * i + 1))
        h.send(w, Done(plan_id=pid, attempt=1, outcome="succeeded", result=None, seq=2 * i + 2))
        ids.append(pid)
    assert h.core.retention.retained_bytes > h.core.retention.max_bytes
    h.tick(10.0)
    kept = [pid for pid in ids if pid in h.core.plans]
    assert kept == ids[-3:] or kept == ids[-2:], kept
    assert h.core.retention.retained_bytes <= h.core.retention.max_bytes
    assert h.core.counters["plans_forgotten.bytes"] == 5 - len(kept) and h.core.counters["plans_forgotten.time"] == 0
    assert {s.created.plan_id for s in h.store.load()} == set(kept)


def test_the_byte_bound_alone_applies_with_zero_time_retention() -> None:
    """--plan-retention 0 keeps plans by time, but --plan-retention-bytes still bounds them."""
    h = Durable(plan_retention_s=0.0, plan_retention_bytes=1)
    _, pid = finished_plan(h, at=0.0)
    h.tick(1.0)
    assert pid not in h.core.plans and h.core.counters["plans_forgotten.bytes"] == 1


def test_negative_plan_retention_bytes_is_refused() -> None:
    """ServerSettings.check names --plan-retention-bytes when it is negative."""
    with pytest.raises(ValueError, match="--plan-retention-bytes must be >= 0"):
        ServerSettings(insecure=True, core=CoreConfig(plan_retention_bytes=-1)).check()


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
    from fleetwire.cli.main import build_parser
    from fleetwire.cli.serve import server_settings

    parser = build_parser()
    ns = parser.parse_args(["coordinator", "--insecure", "--plan-retention", "60"])
    assert server_settings(ns, (), ()).core.plan_retention_s == 60.0
    assert server_settings(parser.parse_args(["coordinator", "--insecure"]), (), ()).core.plan_retention_s == 86400.0
    ns = parser.parse_args(["coordinator", "--insecure", "--plan-retention-bytes", "1000"])
    assert server_settings(ns, (), ()).core.plan_retention_bytes == 1000
    default = server_settings(parser.parse_args(["coordinator", "--insecure"]), (), ())
    assert default.core.plan_retention_bytes == DEFAULT_RETENTION_BYTES == 1 << 30


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
