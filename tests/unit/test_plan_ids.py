"""Plan ids are scoped per principal (issue #24 part 6; docs/SEMANTICS.md §Plan ids), in the core with a fake clock.

Two principals may submit the same plan id: each one's requests reach its own plan, neither sees
the other's, and an id another principal holds answers exactly as an id nobody uses (no existence
oracle). The second plan gets a key of the core's making (coordinator/plans.py ``PlanNames``):
workers, the store and admin sessions know it by that key; its owner by the id it submitted.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec

from coordinator.io.stores.sqlite import SQLiteStore
from coordinator.records import PlanCreated
from protocol import errors
from protocol.messages import (
    Accept,
    Accepted,
    Assign,
    Cancel,
    DataCredit,
    DataEnd,
    DataOpen,
    DataTicket,
    Done,
    Error,
    Event,
    GetPlan,
    InputSpec,
    ListPlans,
    PlanReply,
    Plans,
    Resync,
    Submit,
    Subscribe,
    Subscribed,
    Unsubscribe,
)
from tests.unit.test_core import Harness, kinds, only
from tests.unit.test_durability_core import Durable

DIGEST = "sha256:" + "0" * 64


def admin(h: Harness, principal: str = "root") -> int:
    """An admin client session."""
    conn = 900 + len(h.core.sessions)
    h.core.open_session(conn, "client", h.now, principal=principal, admin=True)
    return conn


def anonymous(msgs: list[Any], *ids: str) -> list[Any]:
    """The messages as builtins with every ``req_id`` zeroed and each of ``ids`` written as ``ID``: two answers
    that differ only in the id asked about (and its request number) come out equal."""
    out = []
    for msg in msgs:
        text = msgspec.json.encode(msg).decode()
        for plan_id in ids:
            text = text.replace(plan_id, "ID")
        data = msgspec.json.decode(text)
        data.pop("req_id", None)
        out.append((type(msg).__name__, data))
    return out


def two_jobs(h: Harness) -> tuple[int, int, str]:
    """alice's ``job`` first, then bob's ``job``; returns both sessions and the key of bob's."""
    alice, bob = h.client("alice"), h.client("bob")
    assert h.submit(alice, plan_id="job") == "job"
    assert h.submit(bob, plan_id="job", args="bobs") == "job"
    key = next(p.id for p in h.core.plans.values() if p.owner == "bob")
    h.take(alice), h.take(bob)
    return alice, bob, key


def test_a_taken_id_is_answered_as_an_unused_one() -> None:
    """A submit, get_plan, cancel, subscribe and data_ticket naming another principal's id get exactly the
    frames (codes, words, fields) an id nobody uses gets."""
    h = Harness()
    alice, mallory = h.client("alice"), h.client("mallory")
    h.submit(alice, plan_id="secret-job", args={"secret": "s3"})
    h.take(alice)
    answers: dict[str, list[Any]] = {}
    for plan_id in ("secret-job", "unused-job"):
        said: list[Any] = []
        for msg in (GetPlan(req_id=1, plan_id=plan_id), Cancel(plan_id=plan_id, req_id=2),
                    Subscribe(req_id=3, plan_ids=[plan_id]), DataTicket(req_id=4, plan_id=plan_id),
                    DataOpen(plan_id=plan_id, attempt=1, name="x")):
            h.send(mallory, msg)
            said += h.take(mallory)
        answers[plan_id] = anonymous(said, plan_id)
    assert answers["secret-job"] == answers["unused-job"]
    assert [m[1].get("code") for m in answers["unused-job"]] == [errors.PLAN_NOT_FOUND] * 5
    for plan_id in ("secret-job", "unused-job"):  # mallory's own plan with that id, either way
        h.send(mallory, Submit(req_id=5, op="echo", plan_id=plan_id, subscribe=True))
        answers[plan_id] = anonymous(h.take(mallory), plan_id)
    assert answers["secret-job"] == answers["unused-job"]
    assert [m[0] for m in answers["unused-job"]] == ["Accepted", "Event", "Event"]
    assert h.core.plans["secret-job"].owner == "alice" and h.core.plans["secret-job"].args == {"secret": "s3"}
    assert not h.take(alice)


def test_two_principals_use_one_id_each_reaching_their_own_plan() -> None:
    """alice and bob both have a ``job``: get_plan, cancel, events and listings of each are its own, by that id."""
    h = Harness()
    w = h.worker("w1")
    alice, bob, key = two_jobs(h)
    assert key != "job" and h.core.plans[key].name == "job"
    assert only(h.take(w), Assign).plan_id == "job"  # alice's: the worker runs one plan at a time
    h.send(bob, GetPlan(req_id=1, plan_id="job"))
    mine = only(h.take(bob), PlanReply).plan
    assert (mine.id, mine.owner, mine.name) == ("job", "bob", None)
    h.send(bob, Cancel(plan_id="job", req_id=2))
    cancelled = h.take(bob)
    assert only(cancelled, PlanReply).plan.state == "cancelled"
    assert [(e.plan_id, e.kind) for e in cancelled if isinstance(e, Event)] == [("job", "cancelled")]
    assert h.state(key) == "cancelled" and h.state("job") == "leased"  # alice's runs on
    h.send(alice, ListPlans(req_id=3))
    assert [(p.id, p.state) for p in only(h.take(alice), Plans).plans] == [("job", "leased")]
    h.send(bob, ListPlans(req_id=4, id_contains="job"))
    listing = only(h.take(bob), Plans)
    assert [(p.id, p.state) for p in listing.plans] == [("job", "cancelled")] and listing.total == 1
    h.send(bob, ListPlans(req_id=5, id_contains=key))  # his plan's key is no id of his: it matches nothing
    assert only(h.take(bob), Plans).plans == []


def test_a_retried_submit_is_a_duplicate_of_the_callers_own_plan() -> None:
    """bob's submit of ``job`` again is the retry of his own (duplicate, his stream), not a look at alice's."""
    h = Harness()
    alice, bob, _ = two_jobs(h)
    h.send(bob, Submit(req_id=7, op="echo", plan_id="job", subscribe=True))
    msgs = h.take(bob)
    assert only(msgs, Accepted) == Accepted(req_id=7, plan_id="job", state="queued", duplicate=True)
    assert {e.plan_id for e in msgs if isinstance(e, Event)} == {"job"} and len(h.core.plans) == 2
    h.send(alice, Submit(req_id=8, op="echo", plan_id="job"))
    assert only(h.take(alice), Accepted).duplicate and len(h.core.plans) == 2
    h.send(bob, ListPlans(req_id=9))  # both queued (no worker): his queue names his plan as he does
    listing = only(h.take(bob), Plans)
    assert listing.queue == ["job"] and list(listing.waiting) == ["job"]


def test_the_key_is_not_an_id_its_owner_may_use() -> None:
    """bob knows his plan as ``job`` only: its key answers plan_not_found, and submitting the key makes another plan."""
    h = Harness()
    _, bob, key = two_jobs(h)
    h.send(bob, GetPlan(req_id=1, plan_id=key))
    assert only(h.take(bob), Error).message == f"no plan with id {key!r}"
    assert h.submit(bob, plan_id=key) == key
    assert len(h.core.plans) == 3 and len({p.id for p in h.core.plans.values()}) == 3
    other = h.core.names.keys["bob", key]  # the key is held (by the plan named job): a key of its own
    assert other not in (key, "job") and h.core.plans[other].name == key and h.core.plans[key].name == "job"
    h.send(bob, GetPlan(req_id=2, plan_id=key))
    assert only(h.take(bob), PlanReply).plan.id == key


def test_events_reach_the_owner_by_name_and_admins_by_key() -> None:
    """The worker runs bob's plan under its key; bob's stream says ``job``, an admin following all says the key."""
    h = Harness()
    root = admin(h)
    h.send(root, Subscribe(req_id=1, all=True))
    _, bob, key = two_jobs(h)
    h.send(bob, Subscribe(req_id=2, plan_ids=["job"]))
    assert only(h.take(bob), Subscribed).plan_ids == ["job"]
    h.take(root)
    w = h.worker("w1", max_concurrency=2)
    assigns = {m.plan_id for m in h.take(w) if isinstance(m, Assign)}
    assert assigns == {"job", key}
    h.send(w, Accept(plan_id=key, attempt=1))
    h.send(w, Event(plan_id=key, attempt=1, kind="progress", data=1))
    h.send(w, Done(plan_id=key, attempt=1, outcome="succeeded", result=42))
    assert [(e.plan_id, e.kind) for e in h.take(bob) if isinstance(e, Event)] == [
        ("job", "leased"), ("job", "running"), ("job", "progress"), ("job", "succeeded")]
    assert {e.plan_id for e in h.take(root) if isinstance(e, Event) and e.kind == "progress"} == {key}
    h.send(root, GetPlan(req_id=3, plan_id=key))
    seen = only(h.take(root), PlanReply).plan
    assert (seen.id, seen.owner, seen.name, seen.result) == (key, "bob", "job", 42)
    h.send(root, GetPlan(req_id=4, plan_id="job"))  # an admin names plans by key: alice's
    assert only(h.take(root), PlanReply).plan.owner == "alice"
    h.send(root, ListPlans(req_id=5))
    assert {(p.id, p.name) for p in only(h.take(root), Plans).plans} == {("job", None), (key, "job")}


def test_a_replay_and_its_resync_name_the_plan_as_the_subscriber_knows_it() -> None:
    """A late subscribe by bob replays his plan's stream under ``job``, its resync too; an admin's under the key."""
    h = Harness(max_events_per_plan=2)
    _, bob, key = two_jobs(h)
    w = h.worker("w1", max_concurrency=2)
    h.take(w)
    h.send(w, Accept(plan_id=key, attempt=1))
    for i in range(4):
        h.send(w, Event(plan_id=key, attempt=1, kind="progress", data=i))
    h.send(bob, Subscribe(req_id=1, plan_ids=["job"], from_seq=0))
    replayed = [m for m in h.take(bob) if isinstance(m, Event | Resync)]
    assert replayed and {m.plan_id for m in replayed} == {"job"}
    assert only(replayed, Resync).plan.id == "job"
    root = admin(h)
    h.send(root, Subscribe(req_id=2, plan_ids=[key], from_seq=0))
    assert {m.plan_id for m in h.take(root) if isinstance(m, Event | Resync)} == {key}
    h.send(bob, Unsubscribe(req_id=3, plan_ids=["job"]))
    h.send(w, Event(plan_id=key, attempt=1, kind="progress", data=9))
    assert not [m for m in h.take(bob) if isinstance(m, Event)]


def test_data_grants_name_the_plan_and_add_its_key_and_the_relay_maps_the_name() -> None:
    """bob's data_ticket and data_ready name ``job`` with the key for the worker; his relayed open reaches the
    worker under the key and the worker's credit comes back to him under ``job``."""
    h = Harness()
    h.core.data.rotate("k1", b"m" * 32, 0.0)
    w = h.worker("w1", max_concurrency=2)
    alice, bob = h.client("alice"), h.client("bob")
    inputs = [InputSpec(name="x", size=8, digest=DIGEST)]
    h.submit(alice, plan_id="job", inputs=inputs, subscribe=True)
    h.submit(bob, plan_id="job", inputs=inputs, subscribe=True)
    key = next(p.id for p in h.core.plans.values() if p.owner == "bob")
    ready = next(e for e in h.take(bob) if isinstance(e, Event) and e.kind == "data_ready")
    assert (ready.plan_id, ready.data["key"]) == ("job", key)
    assert "key" not in next(e for e in h.take(alice) if isinstance(e, Event) and e.kind == "data_ready").data
    h.send(bob, DataTicket(req_id=1, plan_id="job", direction="put"))
    grant = h.take(bob)[0]
    assert (grant.plan_id, grant.key) == ("job", key)
    h.take(w)
    h.send(w, Accept(plan_id=key, attempt=1))
    h.send(bob, DataOpen(plan_id="job", attempt=1, name="x", ticket="t"))
    opened = only(h.take(w), DataOpen)
    assert opened.plan_id == key
    h.send(w, DataCredit(plan_id=key, attempt=1, name="x", offset=0, size=8))
    assert only(h.take(bob), DataCredit).plan_id == "job"
    h.send(bob, Cancel(plan_id="job", req_id=2))  # its upload ends at once, as any cancelled plan's
    ended = only(h.take(bob), DataEnd)
    assert (ended.plan_id, only(h.take(w), DataEnd).plan_id) == ("job", key) and not h.core.relay.streams


def test_names_come_back_after_a_restart_from_sqlite(tmp_path: Path) -> None:
    """The SQLite store keeps bob's plan under its key and the name in its submit: after a restart each of alice
    and bob still reaches their own ``job``, and bob's retry is still his duplicate."""
    h = Durable(store=SQLiteStore(tmp_path / "s.db"))  # type: ignore[arg-type]  # the same Store interface
    _, _, key = two_jobs(h)
    created = [r for r in h.records if isinstance(r, PlanCreated)]
    assert [(r.plan_id, r.owner, r.submit.plan_id) for r in created] == [("job", "alice", "job"), (key, "bob", "job")]
    h.store.close()  # type: ignore[attr-defined]
    h.store = SQLiteStore(tmp_path / "s.db")  # type: ignore[assignment]
    h.restart(1.0)
    assert h.core.names.keys == {("bob", "job"): key}
    alice, bob = h.client("alice"), h.client("bob")
    for conn, owner in ((alice, "alice"), (bob, "bob")):
        h.send(conn, GetPlan(req_id=1, plan_id="job"))
        assert only(h.take(conn), PlanReply).plan.owner == owner
    h.send(bob, Submit(req_id=2, op="echo", plan_id="job"))
    assert only(h.take(bob), Accepted).duplicate and len(h.core.plans) == 2
    h.store.close()  # type: ignore[attr-defined]


def test_a_forgotten_plans_name_is_free_again() -> None:
    """Once bob's finished ``job`` is forgotten at retention its alias goes too; his next ``job`` is a new plan."""
    h = Harness(plan_retention_s=10.0)
    _, bob, key = two_jobs(h)
    h.send(bob, Cancel(plan_id="job", req_id=1))
    h.tick(100.0)
    assert key not in h.core.plans and h.core.names.keys == {}
    h.send(bob, Submit(req_id=2, op="echo", plan_id="job"))
    accepted = only(h.take(bob), Accepted)
    assert (accepted.plan_id, accepted.duplicate) == ("job", False)
    assert kinds([e for e in h.core.plans[h.core.names.keys["bob", "job"]].events]) == ["queued", "waiting"]


def test_an_admins_submit_of_a_taken_id_is_its_own_plan_answered_by_key() -> None:
    """An admin submitting alice's id gets a plan of its own (not alice's as a duplicate), named by its key."""
    h = Harness()
    alice = h.client("alice")
    h.submit(alice, plan_id="job")
    root = admin(h)
    h.send(root, Submit(req_id=1, op="echo", plan_id="job"))
    accepted = only(h.take(root), Accepted)
    assert accepted.plan_id != "job" and not accepted.duplicate
    assert h.core.plans[accepted.plan_id].owner == "root" and h.core.plans["job"].owner == "alice"
    h.send(root, Submit(req_id=2, op="echo", plan_id="job"))
    assert only(h.take(root), Accepted) == Accepted(req_id=2, plan_id=accepted.plan_id, state="queued",
                                                    duplicate=True)
