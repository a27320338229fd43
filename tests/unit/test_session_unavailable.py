"""The SDK session and ``error(unavailable)``: the request stays pending and goes out again after the wait."""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any

from fleetwire.session import UNAVAILABLE_RETRY_S, ClientSession
from protocol import errors as codes
from protocol.messages import Accepted, Error, Submit
from tests.unit.test_client_session import frame, sent


def queue_submit(session: ClientSession, plan_id: str) -> tuple[Submit, Future[Any]]:
    msg = Submit(req_id=session.next_req_id(), op="echo", plan_id=plan_id)
    waiter: Future[Any] = Future()
    session.send_request(msg.req_id, Submit, session.encode(msg), Accepted, waiter)
    return msg, waiter


def test_unavailable_keeps_the_request_and_resend_queues_the_same_submit() -> None:
    """``unavailable`` with retry_after_s: not failed; the driver is told the wait; resend sends it again unchanged."""
    session = ClientSession("msgpack")
    waits: list[tuple[int, float]] = []
    session.retry_later = lambda req_id, delay: waits.append((req_id, delay))
    msg, waiter = queue_submit(session, "p1")
    assert sent(session) == [msg]
    session.receive_frame(frame(Error(code=codes.UNAVAILABLE, message="db away", req_id=msg.req_id,
                                      plan_id="p1", retry_after_s=2.5)))  # fmt: skip
    assert waits == [(msg.req_id, 2.5)] and not waiter.done() and session.pending_requests == 1
    assert sent(session) == []  # nothing goes out before the wait
    assert session.resend(msg.req_id)
    assert sent(session) == [msg]  # the same req_id and plan id: idempotent
    session.receive_frame(frame(Accepted(req_id=msg.req_id, plan_id="p1", state="queued")))
    assert waiter.result().plan_id == "p1"
    assert not session.resend(msg.req_id)  # answered: nothing to send again


def test_unavailable_without_a_hint_waits_the_default_and_without_a_driver_fails() -> None:
    """No retry_after_s: the default wait; a session whose driver does not retry gets the RequestError."""
    session = ClientSession("msgpack")
    waits: list[tuple[int, float]] = []
    session.retry_later = lambda req_id, delay: waits.append((req_id, delay))
    msg, _ = queue_submit(session, "p1")
    session.receive_frame(frame(Error(code=codes.UNAVAILABLE, message="db away", req_id=msg.req_id)))
    assert waits == [(msg.req_id, UNAVAILABLE_RETRY_S)]

    plain = ClientSession("msgpack")
    msg, waiter = queue_submit(plain, "p2")
    plain.receive_frame(frame(Error(code=codes.UNAVAILABLE, message="db away", req_id=msg.req_id)))
    assert waiter.exception() is not None and getattr(waiter.exception(), "code", None) == codes.UNAVAILABLE
