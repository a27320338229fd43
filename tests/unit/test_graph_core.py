"""Plan graphs in the core (coordinator/plan_graphs.py), driven with a fake clock: references resolved and refused at
submit, held plans, the assign's pulls and locality, failure at once, cancel with dependants, lost outputs rebuilt."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from coordinator.placement.placer import PlacementConfig
from protocol import errors
from protocol.messages import (
    Accept,
    Assign,
    Cancel,
    DataEnd,
    DataGrant,
    DataOpen,
    DataTicket,
    Done,
    Error,
    ErrorInfo,
    Event,
    InputSpec,
    OutputRef,
    OutputSpec,
    PlanReply,
    Requirements,
    Submit,
)
from protocol.relay import CLOSED, GONE
from tests.unit.test_core import Harness

DIGEST = "blake3:" + "1" * 64
MIB = 1 << 20


def assign_of(h: Harness, conn: int) -> Assign:
    found = [m for m in h.take(conn) if isinstance(m, Assign)]
    assert len(found) == 1, found
    return found[0]


def finish(h: Harness, conn: int, plan_id: str, attempt: int = 1, *, outcome: str = "succeeded",
           outputs: dict[str, int] | None = None, error: ErrorInfo | None = None) -> None:
    """The worker on ``conn`` runs the attempt and reports its end, with outputs of the sizes given."""
    h.send(conn, Accept(plan_id=plan_id, attempt=attempt))
    made = [OutputSpec(name, size, DIGEST) for name, size in (outputs or {}).items()]
    h.send(conn, Done(plan_id=plan_id, attempt=attempt, outcome=outcome, outputs=made,  # type: ignore[arg-type]
                      error=error or (ErrorInfo(errors.HANDLER_ERROR, "boom") if outcome == "failed" else None)))


def ref(plan_id: str, output: str = "y", name: str = "x") -> InputSpec:
    return InputSpec(name, ref=OutputRef(plan_id, output))


def error_of(h: Harness, conn: int) -> Error:
    found = [m for m in h.take(conn) if isinstance(m, Error)]
    assert len(found) == 1, found
    return found[0]


def fleet(h: Harness, *workers: str, concurrency: int = 1) -> dict[str, int]:
    conns = {w: h.worker(w, max_concurrency=concurrency) for w in workers}
    for conn in conns.values():
        h.take(conn)
    return conns


def test_b_waits_for_as_output_then_runs_on_as_worker_with_the_bytes_local() -> None:
    """B on A's 64 MiB output waits ("plan a has not produced 'y' yet"), then goes to A's worker, its input
    filled in from A's output and fetched from that worker's own spool (no ticket, nothing over the network)."""
    h = Harness()
    conns = fleet(h, "w1", "w2")
    client = h.client()
    a = h.submit(client, plan_id="a", outputs=["y"])
    b = h.submit(client, plan_id="b", inputs=[ref("a")])
    assert h.core.plans[b].waiting_reason == "plan a has not produced 'y' yet" and h.state(b) == "queued"
    where = "w1" if any(isinstance(m, Assign) for m in h.inbox.get(conns["w1"], [])) else "w2"
    assign = assign_of(h, conns[where])
    finish(h, conns[where], a, assign.attempt, outputs={"y": 64 * MIB})
    b_assign = assign_of(h, conns[where])
    assert b_assign.plan_id == b
    assert b_assign.inputs == [InputSpec("x", 64 * MIB, DIGEST, OutputRef("a", "y"))]
    [pull] = b_assign.pulls
    assert (pull.name, pull.plan_id, pull.attempt, pull.output, pull.worker_id, pull.ticket) == (
        "x", "a", 1, "y", where, "")


def test_a_pull_from_another_worker_carries_a_ticket_signed_for_the_holder() -> None:
    """When B cannot run on A's worker (it lacks B's tag), B's worker gets a get ticket for A's output on A's worker."""
    h = Harness()
    holder = h.worker("w1")
    other = h.worker("w2", tags=["big"])
    for conn in (holder, other):
        h.take(conn)
    h.core.data.rotate("k1", b"s" * 32, h.now)
    client = h.client()
    a = h.submit(client, plan_id="a", outputs=["y"])
    finish(h, holder, a, outputs={"y": 10})
    h.take(other)
    h.submit(client, plan_id="b", inputs=[ref("a")], requirements=Requirements(tags=["big"]))
    [pull] = assign_of(h, other).pulls
    assert pull.worker_id == "w1" and pull.ticket.startswith("fw1.k1.")


def test_references_to_unknown_or_other_principals_plans_are_refused_naming_the_input() -> None:
    """A reference to a plan this principal has not submitted (another's among them), or to itself, is refused
    invalid_argument naming the input; after naming an unknown plan is refused too."""
    h = Harness()
    alice, bob = h.client("alice"), h.client("bob")
    h.submit(bob, plan_id="theirs", outputs=["y"])
    h.take(bob)
    for msg, words in (
        ({"plan_id": "b", "inputs": [ref("theirs")]}, "input 'x' refers to plan theirs, which this principal"),
        ({"plan_id": "b", "inputs": [ref("b")]}, "input 'x' refers to the plan itself"),
        ({"plan_id": "c", "after": ["ghost"]}, "after names plan ghost"),
    ):
        h.take(alice)
        h.send(alice, Submit(req_id=7, op="echo", **msg))  # type: ignore[arg-type]
        error = error_of(h, alice)
        assert error.code == errors.INVALID_ARGUMENT and words in error.message, error.message
    assert "b" not in h.core.plans and "c" not in h.core.plans


def test_a_shards_core_refuses_an_upstream_no_shard_holds_saying_so() -> None:
    """In cluster mode (a shard's core) a reference or after naming a plan neither this core nor (as its driver
    found) any other shard holds is refused saying that no shard of the cluster holds it."""
    h = Harness(placement=PlacementConfig(cluster=True))
    alice = h.client("alice")
    for msg, words in (
        ({"plan_id": "b", "inputs": [ref("elsewhere")]}, "input 'x' refers to plan elsewhere"),
        ({"plan_id": "c", "after": ["elsewhere"]}, "after names plan elsewhere"),
    ):
        h.send(alice, Submit(req_id=7, op="echo", **msg))  # type: ignore[arg-type]
        error = error_of(h, alice)
        assert error.code == errors.INVALID_ARGUMENT and words in error.message, error.message
        assert "has not submitted in any shard of this cluster" in error.message, error.message
    alone = Harness()
    client = alone.client("alice")
    alone.send(client, Submit(req_id=7, op="echo", plan_id="b", inputs=[ref("elsewhere")]))
    assert "shard" not in error_of(alone, client).message  # one coordinator alone: no word of shards


def test_a_failed_upstream_fails_the_chain_at_once_naming_each_upstream() -> None:
    """A fails: B (on A's output) and C (after B) fail upstream_failed in the same step, without running."""
    h = Harness()
    conns = fleet(h, "w1")
    client = h.client()
    a = h.submit(client, plan_id="a", outputs=["y"])
    h.submit(client, plan_id="b", inputs=[ref("a")])
    h.submit(client, plan_id="c", after=["b"])
    assign_of(h, conns["w1"])
    finish(h, conns["w1"], a, outcome="failed")
    b, c = h.core.plans["b"], h.core.plans["c"]
    assert (b.state, c.state) == ("failed", "failed") and b.attempt == c.attempt == 0
    assert b.error is not None and b.error.code == errors.UPSTREAM_FAILED
    assert b.error.message == "plan a, whose output 'y' it uses, failed (handler_error: boom)"
    assert c.error is not None and c.error.detail == {"upstream": "b", "root": "a"}
    failed = [e for e in h.events(client) if isinstance(e, Event) and e.kind == "failed"]
    assert [e.plan_id for e in failed] == ["a", "b", "c"]


def test_cancel_with_dependants_cancels_them_and_without_it_they_fail() -> None:
    """cancel(with_dependants) cancels B and C too; a plain cancel of D fails E upstream_failed ("was cancelled")."""
    h = Harness()
    client = h.client()
    for name in ("a", "d"):
        h.submit(client, plan_id=name, outputs=["y"])  # no worker: they stay queued
    h.submit(client, plan_id="b", inputs=[ref("a")])
    h.submit(client, plan_id="c", after=["b"])
    h.submit(client, plan_id="e", inputs=[ref("d")])
    h.send(client, Cancel(plan_id="a", req_id=90, with_dependants=True))
    assert [h.state(k) for k in ("a", "b", "c")] == ["cancelled"] * 3
    reply = [m for m in h.take(client) if isinstance(m, PlanReply)][-1]
    assert reply.plan.state == "cancelled"
    h.send(client, Cancel(plan_id="d", req_id=91))
    e = h.core.plans["e"]
    assert e.state == "failed" and e.error is not None and "was cancelled" not in e.error.message
    assert e.error.code == errors.UPSTREAM_FAILED and "cancelled" in e.error.message


def test_a_busy_holder_is_waited_for_within_the_bound_then_the_plan_goes_elsewhere() -> None:
    """B's 256 MiB are on w1, busy: B waits for w1 (saying so) though w2 is free; past the bound it goes to w2."""
    h = Harness()
    conns = fleet(h, "w1")
    client = h.client()
    a = h.submit(client, plan_id="a", outputs=["y"])
    assign_of(h, conns["w1"])
    h.submit(client, plan_id="busy")  # takes w1's slot once a ends
    finish(h, conns["w1"], a, outputs={"y": 256 * MIB})
    assert assign_of(h, conns["w1"]).plan_id == "busy"
    conns["w2"] = h.worker("w2")
    h.take(conns["w2"])
    b = h.submit(client, plan_id="b", inputs=[ref("a")])
    assert h.state(b) == "queued" and not h.take(conns["w2"])
    reason = h.core.plans[b].waiting_reason or ""
    assert reason.startswith("waiting for worker w1, which holds 256.0 MiB of its inputs")
    bound = h.core.graphs.waits[b][1]
    h.tick(bound - 0.01)
    assert h.state(b) == "queued"
    h.tick(bound)
    assert assign_of(h, conns["w2"]).plan_id == b


def test_a_lost_output_is_rebuilt_once_and_the_consumer_resumes_on_the_rebuild() -> None:
    """The holder is reaped before B runs: A is made again by a.r1 (A stays succeeded), B waits for it, then
    takes a.r1's output; a reported missing output makes it again too, never twice at once."""
    h = Harness(heartbeat_timeout_s=30.0)
    conns = fleet(h, "w1")
    client = h.client()
    a = h.submit(client, plan_id="a", outputs=["y"])
    assign_of(h, conns["w1"])
    h.submit(client, plan_id="gate")  # keeps w1 busy so b does not go there at once
    finish(h, conns["w1"], a, outputs={"y": 10})
    b = h.submit(client, plan_id="b", inputs=[ref("a")], after=["gate"])
    h.close(conns["w1"])
    h.tick(100.0)  # w1 is reaped: its outputs are gone
    assert "a.r1" in h.core.plans and h.core.plans["a"].state == "succeeded"
    assert h.core.counters["plans_rebuilt"] == 1
    conns["w2"] = h.worker("w2", max_concurrency=2)
    assert sorted(m.plan_id for m in h.take(conns["w2"]) if isinstance(m, Assign)) == ["a.r1", "gate"]
    assert h.core.plans[b].waiting_reason == "plan a's output 'y' was lost; plan a.r1 is making it again"
    finish(h, conns["w2"], "a.r1", outputs={"y": 10})
    assert h.core.plans[b].waiting_reason == "plan gate has not succeeded yet"
    finish(h, conns["w2"], "gate", 2)  # its first attempt was lost with w1
    b_assign = assign_of(h, conns["w2"])
    assert b_assign.plan_id == b and b_assign.pulls[0].plan_id == "a.r1" and b_assign.pulls[0].worker_id == "w2"
    assert h.core.counters["plans_rebuilt"] == 1


def test_a_consumer_submitted_after_its_producers_worker_was_reaped_gets_a_rebuild_at_once() -> None:
    """A's worker was reaped before B was submitted (no plan needed A then): B's admission finds A's copy gone
    with its worker and has it made again at once, instead of being placed on a fetch from nowhere."""
    h = Harness(heartbeat_timeout_s=30.0)
    conns = fleet(h, "w1")
    client = h.client()
    a = h.submit(client, plan_id="a", outputs=["y"])
    assign_of(h, conns["w1"])
    finish(h, conns["w1"], a, outputs={"y": 10})
    h.close(conns["w1"])
    h.tick(100.0)
    w2 = h.worker("w2")
    b = h.submit(client, plan_id="b", inputs=[ref("a")])
    assert h.core.counters["plans_rebuilt"] == 1 and b in h.core.graphs.graph.held
    assert assign_of(h, w2).plan_id == "a.r1"


def test_a_consumer_whose_input_was_missing_is_queued_again_free_and_the_output_made_again() -> None:
    """B's worker reports output_lost (a 404 from the holder): B is queued again without charging an attempt,
    A is made again (a.r1), and B then runs on the rebuild's output."""
    h = Harness()
    conns = fleet(h, "w1")
    client = h.client()
    a = h.submit(client, plan_id="a", outputs=["y"])
    assign_of(h, conns["w1"])
    finish(h, conns["w1"], a, outputs={"y": 10})
    b = h.submit(client, plan_id="b", inputs=[ref("a")], max_attempts=1)
    assert assign_of(h, conns["w1"]).plan_id == b
    lost = ErrorInfo(errors.OUTPUT_LOST, "gone", {"input": "x", "plan_id": "a", "attempt": 1, "output": "y"})
    finish(h, conns["w1"], b, outcome="failed", error=lost)
    assert h.state(b) == "queued" and h.core.plans[b].free_attempts == 1
    assert assign_of(h, conns["w1"]).plan_id == "a.r1"
    finish(h, conns["w1"], "a.r1", outputs={"y": 10})
    again = assign_of(h, conns["w1"])
    assert again.plan_id == b and again.attempt == 2 and again.pulls[0].plan_id == "a.r1"


@pytest.mark.parametrize("deterministic", [False])
def test_a_lost_output_of_a_nondeterministic_producer_fails_its_consumer_output_lost(deterministic: bool) -> None:
    """A producer submitted deterministic=false is not run again: the waiting consumer fails output_lost."""
    h = Harness()
    conns = fleet(h, "w1")
    client = h.client()
    a = h.submit(client, plan_id="a", outputs=["y"], deterministic=deterministic)
    assign_of(h, conns["w1"])
    finish(h, conns["w1"], a, outputs={"y": 10})
    b = h.submit(client, plan_id="b", inputs=[ref("a")], max_attempts=1)
    assign_of(h, conns["w1"])
    lost = ErrorInfo(errors.OUTPUT_LOST, "gone", {"input": "x", "plan_id": "a", "attempt": 1, "output": "y"})
    finish(h, conns["w1"], b, outcome="failed", error=lost)
    plan: Any = h.core.plans[b]
    assert plan.state == "failed" and plan.error.code == errors.OUTPUT_LOST
    assert "deterministic=false" in plan.error.message and "a.r1" not in h.core.plans


def test_a_consumer_of_a_rebuild_doomed_at_its_admit_fails_and_is_not_held_forever() -> None:
    """A's output (deterministic=false) and C's (made from A's) are lost with their worker: C's rebuild c.r1 is
    doomed at its admit (A's output cannot be made again), and D, waiting for C's output, fails with the rebuild
    named, instead of staying held with a stale reason (E, needing A, fails once). Found from the graph's property
    test (tests/unit/test_graphs.py DOOMED_IN_A_REBUILDS_ADMIT): PlanGraphs.ended never told the graph of a rebuild
    doomed in the step that made it."""
    h = Harness(heartbeat_timeout_s=30.0)
    conns = fleet(h, "w1")
    client = h.client()
    a = h.submit(client, plan_id="a", outputs=["y"], deterministic=False)
    assign_of(h, conns["w1"])
    finish(h, conns["w1"], a, outputs={"y": 10})
    c = h.submit(client, plan_id="c", inputs=[ref("a")], outputs=["y"])
    assign_of(h, conns["w1"])
    finish(h, conns["w1"], c, outputs={"y": 10})
    h.submit(client, plan_id="gate")  # keeps w1 busy: the consumers wait for it
    assign_of(h, conns["w1"])
    e = h.submit(client, plan_id="e", inputs=[ref("a")], after=["gate"])
    d = h.submit(client, plan_id="d", inputs=[ref("c")], after=["gate"])
    h.take(client)
    h.close(conns["w1"])
    h.tick(100.0)  # w1 is reaped: a's and c's outputs are gone
    plans: Any = h.core.plans
    assert plans["c.r1"].state == "failed" and plans[e].state == "failed"
    assert plans[d].state == "failed" and "its rebuild, plan c.r1" in plans[d].error.message
    assert not h.core.graphs.graph.held
    ends = [(m.plan_id, m.kind) for m in h.take(client) if isinstance(m, Event) and m.kind == "failed"]
    assert sorted(ends) == [(d, "failed"), (e, "failed")]


@pytest.fixture
def durable(tmp_path: Path) -> Iterator[Callable[..., Any]]:
    """Makes Durable harnesses on a MemoryStore, or on a SQLite file reopened by each restart (as a new process
    would); their SQLite stores are closed at the end."""
    from coordinator.io.stores.sqlite import SQLiteStore
    from coordinator.io.stores.store import DB_FILE
    from tests.unit.test_durability_core import Durable

    made: list[Any] = []

    def make(kind: str, **config: Any) -> Any:
        h = Durable(**config)
        made.append(h)
        if kind == "sqlite":
            h.store = SQLiteStore(tmp_path / DB_FILE)
            restart = h.restart

            def reopened(now: float) -> None:
                h.store.close()
                h.store = SQLiteStore(tmp_path / DB_FILE)
                restart(now)

            h.restart = reopened
        return h

    yield make
    for h in made:
        if isinstance(h.store, SQLiteStore):
            h.store.close()


@pytest.mark.parametrize("kind", ["memory", "sqlite"])
def test_the_graph_survives_a_restart_held_plans_wait_for_the_same_reasons(kind: str, durable: Any) -> None:
    """After a restart from the store, B still waits (same reason) and A's outputs are known: once the gate ends, B
    is placed with A's output filled in and a pull from A's worker."""
    h = durable(kind)
    conns = fleet(h, "w1")
    client = h.client()
    a = h.submit(client, plan_id="a", outputs=["y"])
    h.submit(client, plan_id="gate")
    assign_of(h, conns["w1"])
    finish(h, conns["w1"], a, outputs={"y": 10})
    h.submit(client, plan_id="b", inputs=[ref("a")], after=["gate"])
    assert h.core.plans["b"].waiting_reason == "plan gate has not succeeded yet"
    h.restart(50.0)
    assert h.core.plans["b"].waiting_reason == "plan gate has not succeeded yet" and "b" in h.core.graphs.graph.held
    assert h.core.plans["a"].produced == [OutputSpec("y", 10, DIGEST)]
    w1 = h.worker("w1")
    gate = assign_of(h, w1)
    finish(h, w1, gate.plan_id, gate.attempt)
    b = assign_of(h, w1)
    assert b.plan_id == "b" and b.inputs[0].size == 10 and b.pulls[0].plan_id == "a"


@pytest.mark.parametrize("kind", ["memory", "sqlite"])
def test_a_rebuild_under_way_survives_a_restart_and_is_not_doubled(kind: str, durable: Any) -> None:
    """A restart while a.r1 makes A's lost output again: a.r1 is queued again (no a.r2), B still waits for it,
    and then runs on a.r1's output (the rebuild's link to A is in its stored creation)."""
    h = durable(kind, heartbeat_timeout_s=30.0)
    conns = fleet(h, "w1")
    client = h.client()
    a = h.submit(client, plan_id="a", outputs=["y"])
    assign_of(h, conns["w1"])
    finish(h, conns["w1"], a, outputs={"y": 10})
    h.submit(client, plan_id="gate")  # w1's slot, so b waits on it as well as on a's output
    assign_of(h, conns["w1"])
    h.submit(client, plan_id="b", inputs=[ref("a")], after=["gate"])
    h.close(conns["w1"])
    h.tick(100.0)  # w1 is reaped: a.r1 is made, queued with no worker to take it
    assert h.core.plans["a.r1"].state == "queued"
    h.restart(150.0)
    assert h.core.plans["a.r1"].rebuild_of == "a" and h.core.counters["plans_rebuilt"] == 0
    w2 = h.worker("w2", max_concurrency=2)
    assert sorted(m.plan_id for m in h.take(w2) if isinstance(m, Assign)) == ["a.r1", "gate"]
    finish(h, w2, "gate", 2)
    assert h.core.plans["b"].waiting_reason == "plan a's output 'y' was lost; plan a.r1 is making it again"
    finish(h, w2, "a.r1", outputs={"y": 10})
    b = assign_of(h, w2)
    assert b.plan_id == "b" and b.pulls[0].plan_id == "a.r1" and b.pulls[0].worker_id == "w2"
    assert sorted(k for k in h.core.plans if k.startswith("a.r")) == ["a.r1"]


def test_after_a_restart_without_the_holder_the_consumer_finds_the_loss_by_its_fetch_and_it_is_rebuilt(
    durable: Any,
) -> None:
    """Lost marks are not stored: after a restart that A's worker never comes back from, B goes to w2 with a pull
    from w1; w2's output_lost costs B no attempt, a.r1 makes A's output again, and B runs on it."""
    h = durable("sqlite")
    conns = fleet(h, "w1")
    client = h.client()
    a = h.submit(client, plan_id="a", outputs=["y"])
    assign_of(h, conns["w1"])
    finish(h, conns["w1"], a, outputs={"y": 10})
    h.submit(client, plan_id="gate", requirements=Requirements(tags=["later"]))
    h.submit(client, plan_id="b", inputs=[ref("a")], after=["gate"], max_attempts=1)
    h.restart(50.0)
    w2 = h.worker("w2", tags=["later"])
    gate = assign_of(h, w2)
    finish(h, w2, gate.plan_id, gate.attempt)
    b = assign_of(h, w2)
    assert b.plan_id == "b" and b.pulls[0].worker_id == "w1" and b.pulls[0].url == ""
    lost = ErrorInfo(errors.OUTPUT_LOST, "no endpoint", {"input": "x", "plan_id": "a", "attempt": 1, "output": "y"})
    finish(h, w2, "b", b.attempt, outcome="failed", error=lost)
    assert h.state("b") == "queued" and assign_of(h, w2).plan_id == "a.r1"
    finish(h, w2, "a.r1", outputs={"y": 10})
    again = assign_of(h, w2)
    assert again.plan_id == "b" and again.pulls[0].plan_id == "a.r1" and h.core.plans["a"].state == "succeeded"


def grant_of(h: Harness, conn: int) -> DataGrant:
    found = [m for m in h.take(conn) if isinstance(m, DataGrant | Error)]
    assert len(found) == 1 and isinstance(found[0], DataGrant), found
    return found[0]


def test_a_clients_fetch_of_a_lost_output_gets_it_rebuilt_then_a_grant_to_the_rebuild() -> None:
    """A's worker is reaped: a client's data_ticket for A's output 'y' makes a.r1 and answers rebuilding=a.r1 (no
    ticket); asked again meanwhile, no second rebuild; once a.r1 succeeded, the grant is to a.r1 on its worker."""
    h = Harness(heartbeat_timeout_s=30.0)
    conns = fleet(h, "w1")
    h.core.data.rotate("k1", b"s" * 32, h.now)
    client = h.client()
    a = h.submit(client, plan_id="a", outputs=["y"])
    finish(h, conns["w1"], assign_of(h, conns["w1"]).plan_id, outputs={"y": 10})
    h.send(client, DataTicket(req_id=5, plan_id=a, output="y"))
    assert grant_of(h, client).worker_id == "w1"  # the holder is there: no rebuild
    h.close(conns["w1"])
    h.tick(100.0)  # w1 is reaped: a has no dependants, its loss is found by the next fetch
    assert "a.r1" not in h.core.plans
    for req_id in (6, 7):
        h.send(client, DataTicket(req_id=req_id, plan_id=a, output="y"))
        grant = grant_of(h, client)
        assert (grant.req_id, grant.rebuilding, grant.ticket, grant.plan_id) == (req_id, "a.r1", "", "a")
    assert sorted(k for k in h.core.plans if k.startswith("a.r")) == ["a.r1"] and h.state(a) == "succeeded"
    w2 = h.worker("w2")
    finish(h, w2, assign_of(h, w2).plan_id, outputs={"y": 10})
    h.send(client, DataTicket(req_id=8, plan_id=a, output="y"))
    grant = grant_of(h, client)
    assert (grant.plan_id, grant.worker_id, grant.rebuilding, grant.files) == ("a.r1", "w2", "", {"y": [10, DIGEST]})
    assert grant.ticket.startswith("fw1.k1.")


def test_a_copy_a_client_could_not_fetch_is_made_again_and_one_without_lineage_is_output_lost() -> None:
    """A client that got a 404 from A's live worker names it (data_ticket.lost=a): a.r1 makes 'y' again. A producer
    submitted deterministic=false is not run again: the fetch is answered output_lost, saying why."""
    h = Harness()
    conns = fleet(h, "w1", concurrency=2)
    h.core.data.rotate("k1", b"s" * 32, h.now)
    client = h.client()
    a = h.submit(client, plan_id="a", outputs=["y"])
    c = h.submit(client, plan_id="c", outputs=["y"], deterministic=False)
    for assign in [m for m in h.take(conns["w1"]) if isinstance(m, Assign)]:
        finish(h, conns["w1"], assign.plan_id, outputs={"y": 10})
    h.send(client, DataTicket(req_id=5, plan_id=a, output="y", lost=a))
    assert grant_of(h, client).rebuilding == "a.r1" and h.core.counters["outputs_lost"] == 1
    h.send(client, DataTicket(req_id=6, plan_id=c, output="y", lost=c))
    error = error_of(h, client)
    assert (error.code, error.req_id) == (errors.OUTPUT_LOST, 6)
    assert "output 'y' of plan c is lost and cannot be made again: it was submitted with deterministic=false" in (
        error.message)
    assert "c.r1" not in h.core.plans


def test_in_the_first_heartbeat_timeout_after_a_restart_a_holder_not_back_yet_is_not_taken_as_gone(
    durable: Any,
) -> None:
    """After a restart, A's worker has not reconnected yet: a fetch is granted to it (no rebuild), and a client's
    report that it is gone is answered unavailable, until one heartbeat timeout has passed since the restart; then
    A's output is made again."""
    h = durable("sqlite", heartbeat_timeout_s=30.0)
    conns = fleet(h, "w1")
    client = h.client()
    a = h.submit(client, plan_id="a", outputs=["y"])
    finish(h, conns["w1"], assign_of(h, conns["w1"]).plan_id, outputs={"y": 10})
    h.restart(50.0)
    h.core.data.rotate("k1", b"s" * 32, h.now)
    client = h.client()
    h.send(client, DataTicket(req_id=5, plan_id=a, output="y"))
    assert grant_of(h, client).worker_id == "w1" and "a.r1" not in h.core.plans
    h.send(client, DataTicket(req_id=6, plan_id=a, output="y", lost=a))
    error = error_of(h, client)
    assert error.code == errors.UNAVAILABLE and "worker w1, which holds output 'y' of plan a, has not come back" in (
        error.message) and "a.r1" not in h.core.plans
    h.now = 81.0
    h.send(client, DataTicket(req_id=6, plan_id=a, output="y"))
    assert grant_of(h, client).rebuilding == "a.r1"


def test_a_relayed_fetch_from_a_worker_gone_for_good_ends_output_gone_at_once() -> None:
    """An output's relayed get while its worker is disconnected ends relay_closed (it may come back: the client opens
    it again); once the worker is reaped it ends output_gone, which the client does not retry."""
    h = Harness(heartbeat_timeout_s=30.0)
    conns = fleet(h, "w1")
    client = h.client()
    a = h.submit(client, plan_id="a", outputs=["y"])
    finish(h, conns["w1"], assign_of(h, conns["w1"]).plan_id, outputs={"y": 10})
    h.close(conns["w1"])
    h.take(client)
    h.send(client, DataOpen(plan_id=a, attempt=1, name="y", direction="get"))
    assert [m.code for m in h.take(client) if isinstance(m, DataEnd)] == [CLOSED]
    h.tick(100.0)
    h.send(client, DataOpen(plan_id=a, attempt=1, name="y", direction="get"))
    [end] = [m for m in h.take(client) if isinstance(m, DataEnd)]
    assert end.code == GONE and end.message == "worker w1 of plan 'a' is gone, and its outputs with it"


def test_a_relayed_fetch_in_the_first_heartbeat_timeout_after_a_restart_waits_for_the_holder(durable: Any) -> None:
    """After a restart the output's worker is not back yet: a relayed get ends relay_closed (the client opens it
    again; tests/integration/test_data_retries.py's download across a restart failed output_gone when its re-open
    came before the worker's reconnect), as the tickets' answer waits; past one heartbeat timeout, output_gone."""
    h = durable("sqlite", heartbeat_timeout_s=30.0)
    conns = fleet(h, "w1")
    client = h.client()
    a = h.submit(client, plan_id="a", outputs=["y"])
    finish(h, conns["w1"], assign_of(h, conns["w1"]).plan_id, outputs={"y": 10})
    h.restart(50.0)
    client = h.client()
    h.send(client, DataOpen(plan_id=a, attempt=1, name="y", direction="get"))
    [end] = [m for m in h.take(client) if isinstance(m, DataEnd)]
    assert end.code == CLOSED and "has not come back since the coordinator restarted" in end.message
    h.now = 81.0
    h.send(client, DataOpen(plan_id=a, attempt=1, name="y", direction="get"))
    [end] = [m for m in h.take(client) if isinstance(m, DataEnd)]
    assert end.code == GONE, end.message
