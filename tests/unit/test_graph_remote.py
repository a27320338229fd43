"""References across shards in the core (coordinator/graphs/remote.py, coordinator/plan_graphs.py), with a fake clock:
the driver tells a shard's core the row of an upstream of another shard; the consumer waits on it, is placed with a pull
from the holder's endpoint when it succeeds, fails at once when it fails, and finds it again after a restart."""

from __future__ import annotations

from typing import Any

import pytest

from coordinator.graphs.remote import RemotePlan, remote_key, remote_row
from coordinator.placement.placer import PlacementConfig
from coordinator.worker_sessions.leases import FREE_TICKET_RETRIES
from protocol import errors
from protocol.messages import Assign, Cancel, ErrorInfo, OutputRef, OutputSpec, Requirements, Submit
from tests.unit.test_core import Harness
from tests.unit.test_graph_core import DIGEST, assign_of, durable, error_of, finish, fleet, ref

__all__ = ["durable"]  # the fixture, used by the restart test

SHARED = ("cluster", b"c" * 32)
ROW = 41


def seen(state: str = "running", **kw: Any) -> RemotePlan:
    """What the driver reads of producer ``a`` of shard 3 (alice's; its key there ``a``, row ``ROW``)."""
    return RemotePlan(remote_key(ROW), "alice", "a", shard=3, key="a", state=state, **kw)


def succeeded() -> RemotePlan:
    return seen("succeeded", attempt=2, worker_id="wa", produced=(OutputSpec("y", 1000, DIGEST),),
                data_url="http://10.0.0.9:7000")


def shard_core(h: Harness) -> Harness:
    h.core.data.shared = SHARED
    h.core.data.rotate("k1", b"s" * 32, h.now)
    return h


def test_a_consumer_of_a_remote_upstream_waits_then_pulls_from_the_holders_endpoint_with_the_shared_key() -> None:
    """B on output y of plan a of another shard: accepted and held ("plan a has not produced 'y' yet") while a runs
    there; once the driver tells a succeeded, B is placed here with a pull naming a's key, attempt and worker there,
    that worker's data endpoint and a ticket signed with the cluster's shared key (kid ``cluster``)."""
    h = shard_core(Harness(placement=PlacementConfig(cluster=True)))
    conns = fleet(h, "w1")
    client = h.client("alice")
    msg = Submit(req_id=1, op="echo", plan_id="b", inputs=[ref("a")])
    assert h.core.graphs.unknown_upstreams(msg, "alice", False) == ["a"]  # the driver looks it up
    h.core.graphs.remote_seen(seen(), h.now)
    assert h.core.graphs.unknown_upstreams(msg, "alice", False) == []
    assert h.core.graphs.unknown_upstreams(msg, "bob", False) == ["a"]  # alice's name, not bob's
    b = h.submit(client, plan_id="b", inputs=[ref("a")])
    assert h.core.plans[b].waiting_reason == "plan a has not produced 'y' yet" and h.state(b) == "queued"
    assert h.core.plans[b].inputs[0].ref == OutputRef(remote_key(ROW), "y")  # stored by its key here
    after = h.submit(client, plan_id="after-a", after=["a"], requirements=Requirements(tags=["none-has-it"]))
    assert h.core.plans[after].after == [remote_key(ROW)]
    assert h.core.plans[after].waiting_reason == "plan a has not succeeded yet"
    assert not [m for m in h.take(conns["w1"]) if isinstance(m, Assign)]
    h.core.graphs.remote_seen(succeeded(), h.now)
    h._pump()
    assign = assign_of(h, conns["w1"])
    assert assign.plan_id == b and assign.inputs[0].size == 1000
    [pull] = assign.pulls
    assert (pull.plan_id, pull.attempt, pull.output, pull.worker_id, pull.url) == (
        "a", 2, "y", "wa", "http://10.0.0.9:7000")
    assert pull.ticket.startswith("fw1.cluster.")
    assert h.core.plans[after].waiting_reason != "plan a has not succeeded yet"  # ready: queued for a worker
    assert after not in h.core.graphs.graph.held
    assert {key.kid for key in h.core.data.worker_keys("w1")} == {"k1", "cluster"}  # workers verify with it too


def test_a_failed_remote_upstream_fails_its_consumers_here_at_once_naming_it() -> None:
    """a fails in its shard: B (on its output) and C (after B) fail upstream_failed in the same step, B's error naming
    a and its cause; a remote upstream of another principal is refused at submit."""
    h = shard_core(Harness(placement=PlacementConfig(cluster=True)))
    client = h.client("alice")
    h.core.graphs.remote_seen(seen(), h.now)
    b = h.submit(client, plan_id="b", inputs=[ref("a")])
    c = h.submit(client, plan_id="c", after=["b"])
    h.core.graphs.remote_seen(seen("failed", error=ErrorInfo(errors.HANDLER_ERROR, "boom")), h.now)
    h._pump()
    assert h.state(b) == "failed" and h.state(c) == "failed"
    error = h.core.plans[b].error
    assert error is not None and error.code == errors.UPSTREAM_FAILED
    assert error.message == "plan a, whose output 'y' it uses, failed (handler_error: boom)"
    assert error.detail == {"upstream": "a", "root": "a"}
    bob = h.client("bob")
    h.core.graphs.remote_seen(RemotePlan(remote_key(42), "carol", "theirs", shard=1, key="theirs"), h.now)
    h.core.graphs.remotes._names[("bob", "theirs")] = remote_key(42)  # as if the driver had been fooled
    h.send(bob, Submit(req_id=9, op="echo", plan_id="d", inputs=[ref("theirs")]))
    assert "of principal 'carol'" in error_of(h, bob).message


def test_a_cross_shard_pull_refused_for_its_key_is_placed_again_free_then_fails_ticket_refused() -> None:
    """B's worker reports the holder refused the shared-key ticket (ticket_refused: it had not learned the key yet):
    B is queued again with a fresh ticket, no attempt charged, FREE_TICKET_RETRIES times (max_attempts 1, no
    retries); the next refusal fails it with that code and the holder's reason, not output_lost ("cannot be made
    again"); a's output is never counted lost."""
    h = shard_core(Harness(placement=PlacementConfig(cluster=True)))
    conns = fleet(h, "w1")
    client = h.client("alice")
    h.core.graphs.remote_seen(succeeded(), h.now)
    b = h.submit(client, plan_id="b", inputs=[ref("a")], max_attempts=1)
    refused = ErrorInfo(errors.TICKET_REFUSED, "worker w0 refused the ticket to fetch it (401: unknown ticket key "
                        "'c1')", {"plan_id": "a", "output": "y"})  # fmt: skip
    for attempt in range(1, FREE_TICKET_RETRIES + 1):
        assign = assign_of(h, conns["w1"])
        assert assign.attempt == attempt and assign.pulls[0].ticket.startswith("fw1.cluster.")
        finish(h, conns["w1"], b, attempt, outcome="failed", error=refused)
        assert h.core.plans[b].error is None
    plan = h.core.plans[b]
    assert plan.attempt - plan.free_attempts == 1  # not one charged against max_attempts
    assert [e["reason"].split(":")[0] for e in plan.history] == [errors.TICKET_REFUSED] * FREE_TICKET_RETRIES
    assign = assign_of(h, conns["w1"])
    finish(h, conns["w1"], b, assign.attempt, outcome="failed", error=refused)
    assert plan.state == "failed" and plan.error is not None and plan.error.code == errors.TICKET_REFUSED
    assert "unknown ticket key 'c1'" in plan.error.message
    assert h.core.state.counters["outputs_lost"] == 0


def test_a_remote_output_the_consumers_worker_could_not_fetch_fails_it_output_lost_without_a_rebuild() -> None:
    """B's worker reports a's output gone (output_lost naming a's key there): B fails output_lost, saying outputs are
    not made again across shards; no rebuild plan is made."""
    h = shard_core(Harness(placement=PlacementConfig(cluster=True)))
    conns = fleet(h, "w1")
    client = h.client("alice")
    h.core.graphs.remote_seen(succeeded(), h.now)
    b = h.submit(client, plan_id="b", inputs=[ref("a")])
    assign = assign_of(h, conns["w1"])
    lost = ErrorInfo(errors.OUTPUT_LOST, "gone", {"plan_id": "a", "output": "y"})
    finish(h, conns["w1"], b, assign.attempt, outcome="failed", error=lost)
    plan = h.core.plans[b]
    assert plan.state == "failed" and plan.error is not None and plan.error.code == errors.OUTPUT_LOST
    assert "not made again across shards" in plan.error.message, plan.error.message
    assert len(h.core.plans) == 1


def test_a_shard_forgets_a_remote_upstream_no_consumer_needs_any_longer() -> None:
    """When retention forgets the last consumer of a remote upstream, the core forgets that upstream too."""
    h = shard_core(Harness(placement=PlacementConfig(cluster=True)))
    client = h.client("alice")
    h.core.graphs.remote_seen(seen(), h.now)
    b = h.submit(client, plan_id="b", inputs=[ref("a")])
    h.send(client, Cancel(req_id=3, plan_id=b))
    h.core.graphs.forget(b)
    assert not h.core.graphs.remotes


@pytest.mark.parametrize("kind", ["memory", "sqlite"])
def test_after_a_restart_the_remote_upstream_is_known_again_from_the_stored_consumer(kind: str, durable: Any) -> None:
    """A new owner of the shard restores B, whose reference names the remote upstream's row: B waits on it (not
    doomed as unknown), the driver finds it in the stored plans, and once told a succeeded B is placed."""
    h = durable(kind, placement=PlacementConfig(cluster=True))
    shard_core(h)
    client = h.client("alice")
    h.core.graphs.remote_seen(seen(), h.now)
    b = h.submit(client, plan_id="b", inputs=[ref("a")])
    h.restart(50.0)
    shard_core(h)
    graphs = h.core.graphs
    assert h.state(b) == "queued" and b in graphs.graph.held
    assert [remote_row(plan.id) for plan in graphs.remotes.unfinished()] == [ROW]  # the driver reads this row
    w1 = h.worker("w1")
    h.take(w1)
    graphs.remote_seen(succeeded(), h.now)
    h._pump()
    assert assign_of(h, w1).pulls[0].worker_id == "wa"
    finish(h, w1, b, outputs={})
    assert h.state(b) == "succeeded"
