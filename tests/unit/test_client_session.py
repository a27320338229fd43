"""The SDK's sans-I/O ClientSession (fleetwire/session.py), driven directly: no loop, no socket."""

from __future__ import annotations

import asyncio
import gc
import weakref
from concurrent.futures import Future
from typing import Any, cast

import msgspec
import pytest

from fleetwire.errors import FleetwireConnectionError, PlanFailed, PlanNotFound, ProtocolError
from fleetwire.plan import Plan
from fleetwire.session import COALESCE_LIMIT_BYTES, RECOVERED_REASON, ClientSession
from fleetwire.stream import REWOUND_REASON, PlanStream
from protocol import errors as codes
from protocol.codec import Codec, Encoding
from protocol.messages import (
    Accepted,
    Error,
    Event,
    FromClient,
    GetPlan,
    Ok,
    PlanInfo,
    PlanReply,
    Requirements,
    Resync,
    RoutingHints,
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


def test_a_watched_plan_forgotten_across_the_reconnect_fails_its_stream() -> None:
    """A resubscribe of a plan this session did not submit, answered plan_not_found, fails its stream."""
    session = ClientSession("msgpack")
    stream = PlanStream("p1", live=True)
    session.add_stream(stream)
    session.resume()
    (subscribe,) = sent(session)
    session.receive_frame(frame(Error(code=codes.PLAN_NOT_FOUND, message="?", req_id=subscribe.req_id)))
    assert isinstance(stream.lost, FleetwireConnectionError) and "no longer knows plan 'p1'" in str(stream.lost)
    assert session.streams_of("p1") == [] and session.pending_requests == 0


def sent_as(session: ClientSession, encoding: Encoding) -> list[Any]:
    """Every message the session has queued, decoded by a coordinator speaking ``encoding``."""
    coordinator = Codec(encoding, FromClient, role="client")
    msgs: list[Any] = []
    while (data := session.next_frame()) is not None:
        msgs.extend(coordinator.decode(data.decode() if encoding == "json" else data))
    return msgs


def _lost_across_a_reconnect(session: ClientSession, msg: Submit, encoding: Encoding = "msgpack") -> PlanStream:
    """``msg`` accepted, a few events, then a reconnect whose resubscription finds the plan unknown."""
    waiter = request(session, msg, Accepted, lambda reply: _live(session, reply))
    sent_as(session, encoding)
    for reply in (Accepted(req_id=msg.req_id, plan_id=msg.plan_id or ""),
                  Event(plan_id=msg.plan_id or "", kind="queued", seq=1),
                  Event(plan_id=msg.plan_id or "", kind="leased", seq=2)):  # fmt: skip
        session.receive(reply)
    assert waiter.done()
    (stream,) = session.streams_of(msg.plan_id or "")
    session.resume()
    (subscribe,) = sent_as(session, encoding)
    assert (subscribe.plan_ids, subscribe.from_seq) == ([msg.plan_id], 2)
    session.receive(Error(code=codes.PLAN_NOT_FOUND, message="?", req_id=subscribe.req_id))
    return stream


def _live(session: ClientSession, reply: Accepted) -> PlanStream:
    stream = PlanStream(reply.plan_id, state=reply.state, live=True)
    session.add_stream(stream)
    return stream


def test_an_accepted_plan_the_coordinator_lost_is_resubmitted_with_its_id_and_spec(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """plan_not_found on the resubscription of a plan this session submitted: the same submit (every field)
    goes again marked recovered, a warning is logged, and nothing fails."""
    session = ClientSession("msgpack")
    msg = Submit(req_id=session.next_req_id(), op="shell", args={"cmd": "x", "b": b"\x00"}, plan_id="p1",
                 priority=7, timeout_s=3.5, max_attempts=5, retries=2,
                 requirements=Requirements(tags=["gpu"], model="m"), hints=RoutingHints(session_key="k"))  # fmt: skip
    assert session.held_specs == 0
    with caplog.at_level("WARNING", logger="fleetwire.client"):
        stream = _lost_across_a_reconnect(session, msg)
    (again,) = sent(session)
    assert isinstance(again, Submit) and again.recovered and again.req_id != msg.req_id
    assert msgspec.structs.replace(again, req_id=msg.req_id, recovered=False) == msg
    assert "no longer knows plan 'p1'" in caplog.text and "resubmitting" in caplog.text
    assert stream.lost is None and session.recovered == 0  # until its accepted


@pytest.mark.parametrize("duplicate", [False, True])
def test_a_resubmitted_plan_restarts_its_stream_after_a_recovered_event_and_ends_with_its_result(
    duplicate: bool,
) -> None:
    """The resubmission's accepted (new, or a duplicate when another session resubmitted it first) puts a
    ``recovered`` event in the stream, whose new events from seq 1 are taken; the plan ends with its result."""
    session = ClientSession("json")
    msg = Submit(req_id=session.next_req_id(), op="echo", args={"b": "x"}, plan_id="p1")
    stream = _lost_across_a_reconnect(session, msg, "json")
    plan = Plan(stream, cast(Any, None))
    (again,) = sent_as(session, "json")
    assert again.recovered and again.args == {"b": "x"}
    for reply in (Accepted(req_id=again.req_id, plan_id="p1", duplicate=duplicate),
                  Event(plan_id="p1", kind="queued", seq=1),
                  Event(plan_id="p1", kind="succeeded", data={"result": 42}, seq=2)):  # fmt: skip
        session.receive(reply)
    assert [(e.kind, e.seq) for e in stream.events] == [
        ("queued", 1), ("leased", 2), ("recovered", 0), ("queued", 1), ("succeeded", 2)
    ]
    assert stream.events[2].data == {"reason": RECOVERED_REASON, "last_seq": 2}
    assert plan.recovered and session.recovered == 1 and stream.outcome() == 42
    assert session.held_specs == 0 and session.streams_of("p1") == []


def test_a_refused_resubmission_fails_the_stream_saying_why() -> None:
    """A resubmission the coordinator refuses (the id taken by another client) fails the plan, naming both."""
    session = ClientSession("msgpack")
    stream = _lost_across_a_reconnect(session, Submit(req_id=session.next_req_id(), op="echo", plan_id="p1"))
    (again,) = sent(session)
    session.receive_frame(frame(Error(code=codes.INVALID_ARGUMENT, message="plan id 'p1' is already used",
                                      req_id=again.req_id)))  # fmt: skip
    assert isinstance(stream.lost, FleetwireConnectionError)
    assert "lost plan 'p1'" in str(stream.lost) and "already used" in str(stream.lost)
    assert session.streams_of("p1") == [] and session.held_specs == 0


def test_the_session_keeps_a_submit_only_until_its_plan_ends() -> None:
    """The spec of an accepted plan is held while it runs and dropped at its terminal event (or the session's end)."""
    session = ClientSession("msgpack")
    submit(session, "p1")
    submit(session, "p2")
    sent(session)
    session.receive_frame(frame(Accepted(req_id=1, plan_id="p1"), Accepted(req_id=2, plan_id="p2")))
    assert session.held_specs == 2
    session.receive_frame(frame(Event(plan_id="p1", kind="succeeded", data={"result": 1}, seq=1)))
    assert session.held_specs == 1
    session.end(FleetwireConnectionError("closed"))
    assert session.held_specs == 0


def test_a_plan_handle_and_its_stream_make_no_reference_cycle() -> None:
    """A dropped Plan handle is freed at once with the collector off: its stream holds no reference back to it."""
    session = ClientSession("msgpack")
    _, waiter = submit(session, "p1")
    session.receive_frame(frame(Accepted(req_id=1, plan_id="p1")))
    stream: PlanStream = waiter.result(0)
    plan = Plan(stream, cast(Any, None))
    handle = weakref.ref(plan)
    gc.disable()
    try:
        del plan
        assert handle() is None
    finally:
        gc.enable()
    session.receive_frame(frame(Event(plan_id="p1", kind="succeeded", data={"result": 1}, seq=1)))
    assert stream.done() and stream.outcome() == 1


def test_every_waiter_of_a_plan_wakes_at_each_change() -> None:
    """Several waiters (result and events iterators) wake on the stream's changes and see the outcome."""
    session = ClientSession("msgpack")
    _, waiter = submit(session, "p1")
    session.receive_frame(frame(Accepted(req_id=1, plan_id="p1")))
    plan = Plan(waiter.result(0), cast(Any, None))

    async def scenario() -> tuple[Any, list[str], list[str]]:
        async def kinds() -> list[str]:
            return [event.kind async for event in plan.events()]

        waiting = asyncio.gather(plan.result(), kinds(), kinds())
        await asyncio.sleep(0)
        session.receive_frame(frame(Event(plan_id="p1", kind="running", data={"attempt": 1}, seq=1)))
        await asyncio.sleep(0)
        session.receive_frame(frame(Event(plan_id="p1", kind="succeeded", data={"result": 7}, seq=2)))
        result, first, second = await asyncio.wait_for(waiting, 5)
        return result, first, second

    assert asyncio.run(scenario()) == (7, ["running", "succeeded"], ["running", "succeeded"])


def test_a_cancelled_waiter_of_a_plan_leaves_the_others_waiting_and_a_lone_result_makes_one_future() -> None:
    """Waiters share the stream's waker but not its future: one result() cancelled, another result() and an events
    iterator still wake at the next change; a lone result() waits on one future of its own (plan.py ``_Changed``)."""
    session = ClientSession("msgpack")
    _, waiter = submit(session, "p1")
    session.receive_frame(frame(Accepted(req_id=1, plan_id="p1")))
    stream: PlanStream = waiter.result(0)
    plan = Plan(stream, cast(Any, None))

    async def scenario() -> tuple[Any, list[str], bool]:
        async def kinds() -> list[str]:
            return [event.kind async for event in plan.events()]

        gone = asyncio.ensure_future(plan.result())
        await asyncio.sleep(0)
        assert [len(stream.waker._futures)] == [1]  # type: ignore[union-attr]
        waiting = asyncio.gather(plan.result(), kinds())
        await asyncio.sleep(0)
        gone.cancel()
        await asyncio.sleep(0)
        session.receive_frame(frame(Event(plan_id="p1", kind="succeeded", data={"result": 3}, seq=1)))
        result, seen = await asyncio.wait_for(waiting, 5)
        return result, seen, gone.cancelled()

    assert asyncio.run(scenario()) == (3, ["succeeded"], True)


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


def _resubscribed(session: ClientSession) -> tuple[PlanStream, Subscribe]:
    """A submitted plan seen to seq 5, then a reconnect: its resubscription (from 5) as sent."""
    _, waiter = submit(session, "p1")
    session.receive_frame(frame(Accepted(req_id=1, plan_id="p1"), Event(plan_id="p1", kind="leased", seq=5)))
    sent(session)
    session.resume()
    (subscribe,) = sent(session)
    assert (subscribe.plan_ids, subscribe.from_seq) == (["p1"], 5)
    return waiter.result(0), subscribe


def test_a_stream_the_coordinator_holds_only_to_an_earlier_seq_goes_on_from_there() -> None:
    """subscribed.last_seqs behind the stream (a store loss took its tail): a ``rewound`` marker, then the
    coordinator's next events, numbered again from there, are taken; a get_plan asks whether it ended."""
    session = ClientSession("msgpack")
    stream, subscribe = _resubscribed(session)
    session.receive_frame(frame(Subscribed(req_id=subscribe.req_id, plan_ids=["p1"], last_seqs={"p1": 2}),
                                Event(plan_id="p1", kind="leased", seq=3)))  # fmt: skip
    assert [(e.kind, e.seq) for e in stream.events] == [("leased", 5), ("rewound", 2), ("leased", 3)]
    assert stream.events[1].data == {"reason": REWOUND_REASON, "last_seq": 5} and stream.rewound == 1
    (ask,) = sent(session)
    assert isinstance(ask, GetPlan) and ask.plan_id == "p1"
    session.receive(PlanReply(req_id=ask.req_id, plan=PlanInfo(id="p1", op="echo", state="running", last_seq=3)))
    assert not stream.done()
    session.receive(Event(plan_id="p1", kind="succeeded", data={"result": 8}, seq=4))
    assert stream.outcome() == 8 and session.held_specs == 0


def test_a_rewound_stream_whose_plan_already_ended_ends_from_its_record() -> None:
    """Behind and already ended on the coordinator (its terminal event is never sent again): the record that
    the get_plan brings ends the stream with the plan's result."""
    session = ClientSession("msgpack")
    stream, subscribe = _resubscribed(session)
    session.receive(Subscribed(req_id=subscribe.req_id, plan_ids=["p1"], last_seqs={"p1": 3}))
    (ask,) = sent(session)
    session.receive(PlanReply(req_id=ask.req_id, plan=PlanInfo(id="p1", op="echo", state="succeeded", result=4,
                                                               last_seq=3)))  # fmt: skip
    assert stream.outcome() == 4 and session.streams_of("p1") == [] and session.held_specs == 0


def test_a_resubscription_the_coordinator_is_level_with_or_ahead_of_changes_nothing() -> None:
    """last_seqs at or past the stream's seq (the usual resume), or absent (an older coordinator, a view
    session): no marker, no get_plan."""
    for last_seqs in ({"p1": 5}, {"p1": 9}, {}):
        session = ClientSession("msgpack")
        stream, subscribe = _resubscribed(session)
        session.receive(Subscribed(req_id=subscribe.req_id, plan_ids=["p1"], last_seqs=last_seqs))
        assert [e.kind for e in stream.events] == ["leased"] and sent(session) == []


def test_two_streams_of_one_plan_each_get_its_events_and_go_when_done() -> None:
    """A plan watched twice: both streams take its events; one removed, the other goes on; an end drops it."""
    session = ClientSession("msgpack")
    first, second, third = (PlanStream("p1", live=True) for _ in range(3))
    for stream in (first, second, third):
        session.add_stream(stream)
    session.receive_frame(frame(Event(plan_id="p1", kind="log", seq=1)))
    session.remove_stream(first)
    assert session.streams_of("p1") == [second, third]
    session.receive_frame(frame(Event(plan_id="p1", kind="log", seq=2)))
    session.remove_stream(third)
    assert session.streams_of("p1") == [second]
    session.receive_frame(frame(Event(plan_id="p1", kind="succeeded", data={"result": 5}, seq=3)))
    assert [e.seq for e in first.events] == [1] and [e.seq for e in third.events] == [1, 2]
    assert [e.seq for e in second.events] == [1, 2, 3] and second.outcome() == 5
    assert session.streams_of("p1") == [] and "0 plans" in repr(session)


def test_a_streams_state_follows_its_lifecycle_events_however_late_it_is_read() -> None:
    """State, attempt and worker id are those of the latest lifecycle event, read mid-way or only at the end;
    a marker that sets the state (recovered) after unread events wins over them, as it came later."""
    def lifecycle(stream: PlanStream, *events: Event) -> None:
        for event in events:
            stream.feed(event)

    placed = [{"worker_id": f"w{n}", "attempt": n} for n in (1, 2)]
    early = [Event(plan_id="p1", kind="queued", data={}, seq=1),
             Event(plan_id="p1", kind="leased", data=placed[0], seq=2, attempt=1),
             Event(plan_id="p1", kind="progress", data={"attempt": 9, "worker_id": "x"}, seq=3, attempt=1),
             Event(plan_id="p1", kind="requeued", data={"reason": "worker lost"}, seq=4)]
    late = [Event(plan_id="p1", kind="leased", data=placed[1], seq=5, attempt=2),
            Event(plan_id="p1", kind="running", data=placed[1], seq=6, attempt=2)]
    read_mid, read_end = PlanStream("p1", live=True), PlanStream("p1", live=True)
    lifecycle(read_mid, *early)
    assert (read_mid.state, read_mid.attempt, read_mid.worker_id) == ("queued", 1, "w1")
    lifecycle(read_mid, *late)
    lifecycle(read_end, *early, *late)
    for stream in (read_mid, read_end):
        assert (stream.state, stream.attempt, stream.worker_id) == ("running", 2, "w2")
    recovered = PlanStream("p1", live=True)
    lifecycle(recovered, *early, *late)
    recovered.recover(RECOVERED_REASON)  # nobody read the state before: the running events must not win
    assert (recovered.state, recovered.attempt, recovered.worker_id) == ("queued", 2, "w2")
    lifecycle(recovered, Event(plan_id="p1", kind="succeeded", data={"result": 3, **placed[0]}, seq=1))
    assert (recovered.state, recovered.attempt, recovered.outcome()) == ("succeeded", 1, 3)


def test_a_frames_events_are_taken_in_seq_order_replays_dropped_and_unnumbered_ones_kept() -> None:
    """Through receive_frame: a replayed seq is dropped, a seq-0 (ephemeral) event is kept without moving
    last_seq, an ended plan takes nothing more, and a waiting reader is woken once per change."""
    session = ClientSession("msgpack")
    stream = PlanStream("p1", live=True)
    session.add_stream(stream)
    woken: list[int] = []
    stream.on_change = lambda: woken.append(stream.last_seq)
    session.receive_frame(frame(Event(plan_id="p1", kind="queued", data={}, seq=1),
                                Event(plan_id="p1", kind="token", data="a", seq=0, ephemeral=True),
                                Event(plan_id="p1", kind="queued", data={}, seq=1),
                                Event(plan_id="p1", kind="log", seq=2),
                                Event(plan_id="p1", kind="succeeded", data={"result": 1}, seq=3),
                                Event(plan_id="p1", kind="log", seq=4)))  # fmt: skip
    assert [(e.kind, e.seq) for e in stream.events] == [("queued", 1), ("token", 0), ("log", 2), ("succeeded", 3)]
    assert woken == [1, 1, 2, 3] and stream.outcome() == 1 and session.streams_of("p1") == []
