"""Recovery from clients and workers after a store loss, in the core with a fake clock
(docs/SEMANTICS.md §Recovery from clients and workers).

A store loss is made by restarting the core from a store that holds only the first records of the
run (a lost tail): what the clients and workers still hold is what brings the plans back.
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any

from structlog.testing import capture_logs

from coordinator.io.stores.store import MemoryStore
from fleetwire.session import ClientSession
from fleetwire.stream import PlanStream
from protocol import Codec
from protocol.messages import (
    Accept,
    Accepted,
    Assign,
    Done,
    Event,
    FromClient,
    Resync,
    Submit,
    Subscribe,
    Subscribed,
    Welcome,
)
from tests.unit.test_core import kinds, only
from tests.unit.test_durability_core import Durable, running_plan


def lose_tail(h: Durable, keep: int, now: float) -> None:
    """Restart the core from a store holding only the first ``keep`` records (the rest lost with the tail)."""
    store = MemoryStore()
    store.write(h.records[:keep])
    h.store, h.records = store, list(h.records[:keep])
    h.restart(now)


def test_a_recovered_submit_is_a_new_plan_counted_and_logged() -> None:
    """``submit(recovered=True)`` of an id the coordinator lost creates the plan, logs a warning and counts it;
    a plain submit and a recovered duplicate are not counted."""
    h = Durable()
    c = h.client()
    h.submit(c, plan_id="plain")
    with capture_logs() as logs:
        h.submit(c, plan_id="lost-1", recovered=True)
    assert h.state("lost-1") == "queued" and h.core.plans["lost-1"].owner == "alice"
    assert any(e["event"].startswith("plan recovered from its client") and e["plan_id"] == "lost-1" for e in logs)
    h.submit(c, plan_id="lost-1", recovered=True)  # its retry: a duplicate, counted once
    assert h.core.counters["plans_recovered_from_client"] == 1


def test_a_recovered_submit_of_another_principals_plan_id_is_a_plan_of_its_own() -> None:
    """Resubmitting an id another principal's plan holds makes the resubmitter's own plan (ids are scoped per
    principal); the other's plan is untouched."""
    h = Durable()
    h.submit(h.client("alice"), plan_id="p1")
    bob = h.client("bob")
    h.send(bob, Submit(req_id=5, op="echo", plan_id="p1", recovered=True))
    assert only(h.take(bob), Accepted).plan_id == "p1"
    assert h.core.plans["p1"].owner == "alice" and h.core.counters["plans_recovered_from_client"] == 1
    assert h.core.plans[h.core.names.keys["bob", "p1"]].owner == "bob"


def test_a_lease_lost_with_the_tail_is_leased_back_and_its_result_accepted_once() -> None:
    """The store lost the lease (the plan is queued at attempt 0 again): the worker that holds attempt 1 and
    its done is continued, no second assign goes out, and its done is the plan's one result (counted)."""
    h = Durable()
    c = h.client()
    plan_id = h.submit(c)
    keep = len(h.records)  # the plan and its queued event: everything after is lost
    w = h.worker("w1")
    only(h.take(w), Assign)
    h.send(w, Accept(plan_id=plan_id, attempt=1, seq=1))
    lose_tail(h, keep, now=100.0)
    assert h.state(plan_id) == "queued" and h.core.plans[plan_id].attempt == 0
    w = h.worker("w1", running=[(plan_id, 1)])  # its done unsent (or kept after the ack)
    msgs = h.take(w)
    assert only(msgs, Welcome).continue_plans == [plan_id] and not [m for m in msgs if isinstance(m, Assign)]
    plan = h.core.plans[plan_id]
    assert (plan.state, plan.attempt, plan.worker_id) == ("leased", 1, "w1")
    assert plan.events[-1].kind == "leased" and plan.events[-1].data["recovered"] is True
    h.send(w, Done(plan_id=plan_id, attempt=1, outcome="succeeded", result=42, seq=2))
    assert h.state(plan_id) == "succeeded" and plan.result == 42
    assert kinds(plan.events).count("succeeded") == 1
    assert h.core.counters["results_recovered_from_worker"] == 1


def test_a_plan_lost_whole_and_resubmitted_by_its_client_takes_its_worker_result() -> None:
    """The plan's creation was in the lost tail: its client resubmits it (recovered), then the worker that ran
    attempt 1 reconnects with the done; the result is accepted without running the plan again."""
    h = Durable()
    c = h.client()
    plan_id = h.submit(c, plan_id="p1", args={"n": 1})
    w = h.worker("w1")
    only(h.take(w), Assign)
    lose_tail(h, 0, now=100.0)
    assert plan_id not in h.core.plans
    c = h.client()
    h.submit(c, plan_id="p1", args={"n": 1}, recovered=True)
    w = h.worker("w1", running=[("p1", 1)])
    assert only(h.take(w), Welcome).continue_plans == ["p1"]
    h.send(w, Done(plan_id="p1", attempt=1, outcome="succeeded", result="r", seq=3))
    assert h.state("p1") == "succeeded" and h.core.plans["p1"].attempt == 1
    counters = h.core.counters
    assert (counters["plans_recovered_from_client"], counters["results_recovered_from_worker"]) == (1, 1)


def test_a_worker_reaped_and_back_with_its_old_attempt_is_still_abandoned() -> None:
    """Recovery is only for attempts the coordinator never handed out as far as it knows: a lease it took back
    (the reaper, at the same attempt) is abandoned as before and nothing is counted."""
    h = Durable(heartbeat_timeout_s=5.0)
    _, _, plan_id = running_plan(h)
    h.worker("w2", ops=("other",))  # alive, so the requeued plan stays queued
    h.tick(6.0)
    assert h.state(plan_id) == "queued" and h.core.plans[plan_id].attempt == 1
    w = h.worker("w1", ops=("other",), running=[(plan_id, 1)])
    assert only(h.take(w), Welcome).abandon_plans == [plan_id]
    assert h.state(plan_id) == "queued" and h.core.counters["results_recovered_from_worker"] == 0


def _subscribe_from(h: Durable, plan_id: str, from_seq: int) -> list[Any]:
    c = h.client()
    h.send(c, Subscribe(req_id=7, plan_ids=[plan_id], from_seq=from_seq))
    return h.take(c)


def test_a_subscriber_past_the_stream_is_told_where_it_ends_and_its_numbering_stays() -> None:
    """A client that saw seq 5 of a plan the store holds only to seq 1 (a lost tail): ``subscribed.last_seqs``
    says the stream ends at 1, nothing is replayed, and the plan's next event is seq 2 as ever."""
    h = Durable()
    plan_id = h.submit(h.client())
    end = h.core.plans[plan_id].next_seq - 1
    msgs = _subscribe_from(h, plan_id, 5)
    assert only(msgs, Subscribed).last_seqs == {plan_id: end}
    assert not [m for m in msgs if isinstance(m, Event | Resync)]
    h.worker("w1")
    assert h.core.plans[plan_id].events[-1].seq == end + 1  # leased


def test_a_subscriber_past_the_stream_of_an_ended_plan_changes_nothing_and_get_plan_tells_the_outcome() -> None:
    """The plan ended here with a seq the subscriber already passed: no resync, no new seq; the record is as
    it was (its outcome, its last seq), for the subscriber's ``get_plan``."""
    h = Durable()
    _, w, plan_id = running_plan(h)
    h.send(w, Done(plan_id=plan_id, attempt=1, outcome="succeeded", result=9, seq=2))
    plan = h.core.plans[plan_id]
    last, held = plan.next_seq - 1, list(plan.events)
    msgs = _subscribe_from(h, plan_id, last + 3)
    assert only(msgs, Subscribed).last_seqs == {plan_id: last} and not [m for m in msgs if isinstance(m, Resync)]
    assert (plan.next_seq - 1, plan.events, plan.info().result) == (last, held, 9)


def test_an_sdk_session_past_a_lost_tail_goes_on_from_the_store_and_ends_with_the_result() -> None:
    """The SDK's session saw a running plan to its log events; the store kept only the plan's creation. After the
    restart its resubscription is told the stream ends earlier: a ``rewound`` marker, the plan's numbering left
    as it was, and the events of the recovered lease, numbered on from the store's, end the stream with the result."""
    h = Durable()
    session, coordinator = ClientSession("msgpack"), Codec("msgpack", FromClient, role="client")
    conn = h.client()

    def exchange() -> None:
        while (data := session.next_frame()) is not None:
            for msg in coordinator.decode(data):
                h.send(conn, msg)
        if msgs := h.take(conn):
            session.receive_frame(coordinator.encode(msgs))

    def live(reply: Accepted) -> PlanStream:
        stream = PlanStream(reply.plan_id, state=reply.state, live=True)
        session.add_stream(stream)
        return stream

    waiter: Future[PlanStream] = Future()
    submit = Submit(req_id=session.next_req_id(), op="echo", plan_id="p1")
    session.send_request(submit.req_id, Submit, session.encode(submit), Accepted, waiter, live)
    exchange()
    keep = len(h.records)  # the plan and its first events: everything after is lost
    w = h.worker("w1")
    only(h.take(w), Assign)
    h.send(w, Accept(plan_id="p1", attempt=1, seq=1))
    for seq in (2, 3):
        h.send(w, Event(plan_id="p1", attempt=1, kind="log", data=seq, seq=seq))
    exchange()
    stream = waiter.result(0)
    seen = stream.last_seq
    lose_tail(h, keep, now=100.0)
    end = h.core.plans["p1"].next_seq - 1
    assert end < seen
    conn = h.client()
    session.resume()
    exchange()  # the resubscription: rewound; its get_plan goes next
    exchange()
    assert [e.kind for e in stream.events][-2:] == ["log", "rewound"] and stream.last_seq == end
    assert h.core.plans["p1"].next_seq - 1 == end and not stream.done()
    w = h.worker("w1", running=[("p1", 1)])
    h.send(w, Done(plan_id="p1", attempt=1, outcome="succeeded", result=42, seq=4))
    exchange()
    assert stream.outcome() == 42 and [e.kind for e in stream.events][-2:] == ["leased", "succeeded"]
