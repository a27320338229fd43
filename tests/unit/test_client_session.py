"""The SDK's sans-I/O ClientSession (fleetwire/session.py), driven directly: no loop, no socket."""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any

import pytest

from fleetwire.errors import FleetwireConnectionError, PlanFailed, PlanNotFound, ProtocolError
from fleetwire.session import COALESCE_LIMIT_BYTES, ClientSession
from fleetwire.stream import PlanStream
from protocol import errors as codes
from protocol.codec import Codec
from protocol.messages import (
    Accepted,
    Error,
    Event,
    FromClient,
    GetPlan,
    Ok,
    PlanInfo,
    PlanReply,
    Resync,
    Submit,
    Subscribe,
    Subscribed,
    ToClient,
)

# The coordinator's side of the wire: decodes what the session sends, encodes what it receives.
COORDINATOR = Codec("msgpack", FromClient, role="client")


def frame(*msgs: ToClient) -> bytes:
    """One frame from the coordinator holding ``msgs``."""
    return COORDINATOR.encode(list(msgs))


def sent(session: ClientSession) -> list[Any]:
    """Every message the session has queued, as the coordinator decodes them."""
    msgs: list[Any] = []
    while (data := session.next_frame()) is not None:
        msgs.extend(COORDINATOR.decode(data))
    return msgs


def request(session: ClientSession, msg: Any, expect: type[Any], on_reply: Any = None) -> Future[Any]:
    """Queue ``msg`` as the client does and return the future its reply resolves."""
    waiter: Future[Any] = Future()
    session.send_request(msg.req_id, type(msg), session.encode(msg), expect, waiter, on_reply)
    return waiter


def submit(session: ClientSession, plan_id: str) -> tuple[Submit, Future[Any]]:
    """A submit whose ``accepted`` registers a live stream, as ``Client._on_accepted`` does."""

    def accepted(reply: Accepted) -> PlanStream:
        stream = PlanStream(reply.plan_id, state=reply.state, live=True)
        session.add_stream(stream)
        return stream

    msg = Submit(req_id=session.next_req_id(), op="echo", plan_id=plan_id, subscribe=True)
    return msg, request(session, msg, Accepted, accepted)


def test_replies_resolve_their_requests_by_req_id_in_any_order() -> None:
    """Two requests sent in one frame are resolved by the replies that echo their req_ids, in reply order."""
    session = ClientSession("msgpack")
    first = GetPlan(req_id=session.next_req_id(), plan_id="a")
    second = GetPlan(req_id=session.next_req_id(), plan_id="b")
    waiters = request(session, first, PlanReply), request(session, second, PlanReply)
    assert [m.req_id for m in sent(session)] == [1, 2]
    session.receive_frame(frame(PlanReply(req_id=2, plan=PlanInfo(id="b", op="x", state="queued")),
                                PlanReply(req_id=1, plan=PlanInfo(id="a", op="x", state="running"))))  # fmt: skip
    assert [w.result(0).plan.id for w in waiters] == ["a", "b"]
    assert session.pending_requests == 0


def test_error_reply_fails_the_request_and_a_wrong_reply_type_is_a_protocol_error() -> None:
    """An error reply raises its RequestError subclass with the code; another reply type raises ProtocolError."""
    session = ClientSession("msgpack")
    missing = request(session, GetPlan(req_id=session.next_req_id(), plan_id="nope"), PlanReply)
    odd = request(session, GetPlan(req_id=session.next_req_id(), plan_id="x"), PlanReply)
    session.receive_frame(frame(Error(code=codes.PLAN_NOT_FOUND, message="no", req_id=1, plan_id="nope"), Ok(req_id=2)))
    with pytest.raises(PlanNotFound) as info:
        missing.result(0)
    assert (info.value.code, info.value.plan_id) == (codes.PLAN_NOT_FOUND, "nope")
    with pytest.raises(ProtocolError, match="answered 'get_plan' with 'ok', expected 'plan'"):
        odd.result(0)


def test_accepted_registers_the_stream_before_the_events_of_the_same_frame() -> None:
    """Events right behind ``accepted`` in one frame reach the new stream, in seq order, replays dropped."""
    session = ClientSession("msgpack")
    _, waiter = submit(session, "p1")
    session.receive_frame(frame(
        Accepted(req_id=1, plan_id="p1"),
        Event(plan_id="p1", kind="running", data={"attempt": 1, "worker_id": "w1"}, seq=1),
        Event(plan_id="p1", kind="running", data={"attempt": 1}, seq=1),  # a replay of seq 1
        Event(plan_id="p1", kind="failed", data={"code": "boom", "message": "it broke"}, seq=2),
    ))  # fmt: skip
    stream: PlanStream = waiter.result(0)
    assert [e.seq for e in stream.events] == [1, 2]
    assert (stream.state, stream.attempt, stream.worker_id, stream.done()) == ("failed", 1, "w1", True)
    with pytest.raises(PlanFailed, match="it broke"):
        stream.outcome()
    assert session.streams_of("p1") == []  # a finished stream is dropped


def test_a_stream_takes_events_only_once_its_subscribe_is_answered() -> None:
    """Events for a watched plan that arrive before its ``subscribed`` are not its own and are dropped."""
    session = ClientSession("msgpack")
    stream = PlanStream("p1", from_seq=3)
    session.add_stream(stream)
    request(session, Subscribe(req_id=session.next_req_id(), plan_ids=["p1"], from_seq=3), Subscribed,
            lambda _reply: stream.go_live())  # fmt: skip
    session.receive_frame(frame(Event(plan_id="p1", kind="log", seq=7), Subscribed(req_id=1, plan_ids=["p1"]),
                                Event(plan_id="p1", kind="log", seq=3), Event(plan_id="p1", kind="log", seq=4)))
    assert [e.seq for e in stream.events] == [4]


def test_next_frame_coalesces_queued_requests_up_to_the_size_limit() -> None:
    """Small requests go out in one frame; requests past COALESCE_LIMIT_BYTES start another frame."""
    session = ClientSession("msgpack")
    for _ in range(3):
        request(session, GetPlan(req_id=session.next_req_id(), plan_id="p"), PlanReply)
    assert len(COORDINATOR.decode(session.next_frame() or b"")) == 3
    assert session.next_frame() is None
    big = "x" * (COALESCE_LIMIT_BYTES // 2)
    for _ in range(3):
        request(session, GetPlan(req_id=session.next_req_id(), plan_id=big), PlanReply)
    frames = []
    while (data := session.next_frame()) is not None:
        frames.append(len(COORDINATOR.decode(data)))
    assert frames == [1, 1, 1]


def test_resume_resends_unanswered_requests_then_resubscribes_live_streams_from_last_seq() -> None:
    """After a reconnect the outbox holds the unanswered requests in req_id order, then one subscribe per
    unfinished live stream from its last seq; answered requests and finished streams are left out."""
    session = ClientSession("msgpack")
    submit(session, "p1")
    submit(session, "p2")
    pending = request(session, GetPlan(req_id=session.next_req_id(), plan_id="p9"), PlanReply)
    sent(session)
    session.receive_frame(frame(Accepted(req_id=1, plan_id="p1"), Event(plan_id="p1", kind="log", seq=5)))
    # the connection drops: p2's accepted and the get_plan reply never came
    session.resume()
    resent = sent(session)
    assert [(type(m).__name__, m.req_id) for m in resent] == [("Submit", 2), ("GetPlan", 3), ("Subscribe", 4)]
    assert (resent[1].plan_id, resent[2].plan_ids, resent[2].from_seq) == ("p9", ["p1"], 5)
    assert session.resumed == 1 and not pending.done()


def test_a_plan_forgotten_across_the_reconnect_fails_its_stream() -> None:
    """A resubscribe answered with plan_not_found fails that plan's stream with FleetwireConnectionError."""
    session = ClientSession("msgpack")
    submit(session, "p1")
    session.receive_frame(frame(Accepted(req_id=1, plan_id="p1")))
    (stream,) = session.streams_of("p1")
    session.resume()
    (subscribe,) = sent(session)
    session.receive_frame(frame(Error(code=codes.PLAN_NOT_FOUND, message="?", req_id=subscribe.req_id)))
    assert isinstance(stream.lost, FleetwireConnectionError) and "no longer knows plan 'p1'" in str(stream.lost)
    assert session.streams_of("p1") == [] and session.pending_requests == 0


def test_resync_puts_a_marker_in_the_stream_and_may_end_it() -> None:
    """A resync stands a ``resync`` event in for the lost seqs and ends the plan when its record is terminal."""
    session = ClientSession("msgpack")
    stream = PlanStream("p1", live=True)
    session.add_stream(stream)
    info = PlanInfo(id="p1", op="echo", state="succeeded", result=42, last_seq=9)
    session.receive(Resync(plan_id="p1", first_seq=1, last_seq=9, plan=info))
    (marker,) = stream.events
    assert (marker.kind, marker.seq, marker.data["first_seq"], marker.data["state"]) == ("resync", 9, 1, "succeeded")
    assert (stream.resyncs, stream.outcome()) == (1, 42)


def test_end_fails_every_waiter_and_stream_and_sends_nothing_more() -> None:
    """Ending the session fails pending requests and unfinished streams with the first error, and empties the outbox."""
    session = ClientSession("msgpack")
    _, accepted = submit(session, "p1")
    session.receive_frame(frame(Accepted(req_id=1, plan_id="p1")))
    waiter = request(session, GetPlan(req_id=session.next_req_id(), plan_id="p1"), PlanReply)
    session.end(FleetwireConnectionError("lost"))
    session.end(FleetwireConnectionError("later"))
    with pytest.raises(FleetwireConnectionError, match="lost"):
        waiter.result(0)
    assert str(accepted.result(0).lost) == "lost"
    assert session.next_frame() is None and session.pending_requests == 0
