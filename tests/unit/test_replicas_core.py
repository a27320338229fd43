"""Replicated outputs in the core (``submit.replicas``; coordinator/graphs/replicas.py, plan_graphs.py): a plan's
success is held until a copy plan put its outputs on another worker; driven with a fake clock, no sockets."""

from __future__ import annotations

from typing import Any

import pytest

from protocol import errors
from protocol.messages import COPY_OP, Assign, Error, Event, Heartbeat, Requirements, Submit, Subscribe
from tests.unit.test_core import Harness
from tests.unit.test_graph_core import assign_of, durable, finish, ref

__all__ = ["durable"]  # the fixture, shared with test_graph_core

OPS = ("echo", COPY_OP)


def events(h: Harness, conn: int, plan_id: str) -> list[Event]:
    return [m for m in h.inbox.get(conn, []) if isinstance(m, Event) and m.plan_id == plan_id]


def replicating(h: Harness) -> tuple[dict[str, int], int]:
    """Plan ``a`` (replicas y=2) ran on w1 and succeeded there; w2 (with the copy op) joined meanwhile."""
    conns = {"w1": h.worker("w1", ops=OPS)}
    client = h.client()
    h.submit(client, plan_id="a", outputs=["y", "log"], replicas={"y": 2})
    assign_of(h, conns["w1"])
    conns["w2"] = h.worker("w2", ops=OPS)
    h.take(conns["w2"])
    finish(h, conns["w1"], "a", outputs={"y": 1000, "log": 5})
    return conns, client


def test_the_success_is_held_until_a_copy_plan_on_another_worker_made_the_copy() -> None:
    """a succeeds on w1: it stays running (its lease gone: a late message of it is stale, saying why) while copy
    plan a.c1 fetches y from w1 to w2 (log wants no copy); a consumer waits meanwhile; when a.c1 succeeds, a ends
    succeeded naming both holders and the consumer goes on."""
    h = Harness()
    conns, client = replicating(h)
    assert h.state("a") == "running" and h.core.plans["a"].replicating
    assert any(e.kind == "replicating" and e.data["copy"] == "a.c1" for e in events(h, client, "a"))
    h.take(conns["w1"])
    h.send(conns["w1"], Event(plan_id="a", attempt=1, seq=0, kind="progress", data={}))  # late: its lease is gone
    [stale] = [m for m in h.take(conns["w1"]) if isinstance(m, Error)]
    assert stale.code == errors.STALE_LEASE and "waits for copies of its outputs" in stale.message
    copy = assign_of(h, conns["w2"])
    assert (copy.plan_id, copy.op, [p.output for p in copy.pulls]) == ("a.c1", COPY_OP, ["y"])
    assert copy.pulls[0].worker_id == "w1" and copy.pulls[0].plan_id == "a"
    b = h.submit(client, plan_id="b", inputs=[ref("a")])
    assert h.state(b) == "queued" and b in h.core.graphs.graph.held
    finish(h, conns["w2"], "a.c1", outputs={"y": 1000})
    assert h.state("a") == "succeeded" and not h.core.plans["a"].replicating
    [done] = [e for e in events(h, client, "a") if e.kind == "succeeded"]
    assert done.data["copies"] == {"y": ["w1", "w2"]} and set(done.data["outputs"]) == {"y", "log"}
    assert h.core.counters["outputs_copied"] == 1
    assert b not in h.core.graphs.graph.held


def test_a_lost_producer_worker_costs_no_rebuild_while_a_copy_lives() -> None:
    """After the copy, w1 is gone for good: a waiting consumer takes y from the copy on w2, and so does one
    submitted after w1 was reaped, at its first placement. Nothing is run again."""
    h = Harness(heartbeat_timeout_s=30.0)
    conns, client = replicating(h)
    assign_of(h, conns["w2"])
    finish(h, conns["w2"], "a.c1", outputs={"y": 1000})
    h.submit(client, plan_id="gate", requirements=Requirements(tags=["later"]))
    b = h.submit(client, plan_id="b", inputs=[ref("a")], after=["gate"])
    h.close(conns["w1"])
    h.now = 99.0
    h.send(conns["w2"], Heartbeat())
    h.tick(100.0)  # w1 is reaped (w2 is not): the outputs made on w1 are gone
    w3 = h.worker("w3", ops=OPS, tags=["later"], max_concurrency=3)
    finish(h, w3, "gate")
    [pull] = next(m for m in h.take(w3) + h.take(conns["w2"]) if isinstance(m, Assign) and m.plan_id == b).pulls
    assert (pull.plan_id, pull.worker_id) == ("a.c1", "w2")
    c = h.submit(client, plan_id="c", inputs=[ref("a")], requirements=Requirements(tags=["later"]))
    [pull] = next(m for m in h.take(w3) if isinstance(m, Assign) and m.plan_id == c).pulls
    assert (pull.plan_id, pull.worker_id) == ("a.c1", "w2")  # at once: w1 is known gone, its copy is not asked
    assert h.core.counters["plans_rebuilt"] == 0 and "a.r1" not in h.core.plans
def test_with_no_other_worker_the_plan_ends_at_once_and_a_copy_nobody_takes_ends_at_the_bound() -> None:
    """Alone on w1, a succeeds at once (nowhere to copy to). With w2 present but unable to take the copy, z waits
    for its copy only up to the bound: then the copy fails timeout and z succeeds with its one holder."""
    h = Harness()
    w1 = h.worker("w1", ops=(*OPS, "make"))
    client = h.client()
    h.submit(client, "make", plan_id="a", outputs=["y"], replicas={"y": 2})
    assign_of(h, w1)
    finish(h, w1, "a", outputs={"y": 10})
    assert h.state("a") == "succeeded" and "a.c1" not in h.core.plans
    w2 = h.worker("w2")  # it lacks the copy op: no copy is placed there
    h.take(w2)
    h.submit(client, "make", plan_id="z", outputs=["y"], replicas={"y": 3})
    assign_of(h, w1)
    finish(h, w1, "z", outputs={"y": 10})
    assert h.state("z") == "running" and h.state("z.c1") == "queued"
    h.tick(h.core.graphs.held_successes["z"].until)
    assert h.state("z.c1") == "failed" and h.core.plans["z.c1"].error.code == errors.TIMEOUT  # type: ignore[union-attr]
    assert h.state("z") == "succeeded"
    [done] = [e for e in events(h, client, "z") if e.kind == "succeeded"]
    assert done.data["copies"] == {"y": ["w1"]}


def test_a_second_copy_goes_where_the_first_is_not_and_a_failed_copy_ends_the_wait() -> None:
    """replicas y=3: a.c1 on w2, then a.c2 avoiding w1 and w2 (on w3); a.c2 failing ends a succeeded with two."""
    h = Harness()
    conns = {"w1": h.worker("w1", ops=OPS)}
    client = h.client()
    h.submit(client, plan_id="a", outputs=["y"], replicas={"y": 3})
    assign_of(h, conns["w1"])
    conns["w2"] = h.worker("w2", ops=OPS)
    h.take(conns["w2"])
    finish(h, conns["w1"], "a", outputs={"y": 10})
    assert assign_of(h, conns["w2"]).plan_id == "a.c1"
    conns["w3"] = h.worker("w3", ops=OPS)
    h.take(conns["w3"])
    finish(h, conns["w2"], "a.c1", outputs={"y": 10})
    assert h.core.plans["a.c2"].avoid == {"w1", "w2"}
    assert assign_of(h, conns["w3"]).plan_id == "a.c2"
    finish(h, conns["w3"], "a.c2", outcome="failed")
    assert h.state("a") == "succeeded"
    [done] = [e for e in events(h, client, "a") if e.kind == "succeeded"]
    assert done.data["copies"] == {"y": ["w1", "w2"]}


def test_replicas_are_checked_at_submit_and_the_copy_op_is_the_coordinators_own() -> None:
    """replicas naming no output, or out of 1..3, is invalid_argument naming it; so is a client's copy-op submit."""
    h = Harness()
    client = h.client()
    for fields, words in (
        ({"outputs": ["y"], "replicas": {"z": 2}}, "replicas names 'z', which is not one of the plan's outputs"),
        ({"outputs": ["y"], "replicas": {"y": 9}}, "replicas['y'] must be 1 to 3"),
        ({"replicas": {"y": 2}}, "replicas names 'y'"),
        ({"op": COPY_OP}, "is the coordinator's own"),
    ):
        h.send(client, Submit(req_id=3, **{"op": "echo", **fields}))  # type: ignore[arg-type]
        [error] = [m for m in h.take(client) if isinstance(m, Error)]
        assert error.code == errors.INVALID_ARGUMENT and words in error.message, error.message


@pytest.mark.parametrize("kind", ["memory", "sqlite"])
def test_a_held_success_survives_a_restart_and_ends_when_its_copy_does(kind: str, durable: Any) -> None:
    """Restarted while a.c1 copies y (stored: a running with its outputs and result, a.c1 leased): a is held again,
    not run again nor queued; a.c1 goes on when w2 comes back and continues it, and its success ends a."""
    h = durable(kind)
    conns, _ = replicating(h)
    assign_of(h, conns["w2"])  # a.c1 is leased to w2
    h.restart(50.0)
    assert h.state("a") == "running" and h.core.plans["a"].replicating and "a" not in h.core.queue
    client = h.client()
    h.send(client, Subscribe(req_id=1, plan_ids=["a"]))
    w2 = h.worker("w2", ops=OPS, running=[("a.c1", 1)])
    h.tick(51.0)
    finish(h, w2, "a.c1", outputs={"y": 1000})
    assert h.state("a") == "succeeded"
    [done] = [e for e in events(h, client, "a") if e.kind == "succeeded"]
    assert done.data["copies"] == {"y": ["w1", "w2"]} and done.data["attempt"] == 1
