"""The SDK's submit path (fleetwire/submits.py), driven over a sans-I/O ClientSession: no socket, no Client."""

from __future__ import annotations

import asyncio
import os
from typing import Any

import pytest

from fleetwire import submits
from fleetwire.errors import FleetwireConnectionError, RequestError
from fleetwire.plan import Plan
from fleetwire.session import ClientSession
from fleetwire.stream import PlanStream
from protocol import errors as codes
from protocol.codec import Codec
from protocol.messages import Accepted, Error, FromClient, Requirements

COORDINATOR = Codec("msgpack", FromClient, "client")  # decodes what the session sends


def plan_of(own: bool, reply: Accepted, /) -> Plan:
    """The SDK's plan for an accepted submit, as ``Client`` makes it (no cancel hook: never cancelled here)."""
    return Plan(PlanStream(reply.plan_id, state=reply.state), None)  # type: ignore[arg-type]


def batch(session: ClientSession, items: list[Any], ids: list[str | None], limit: int = 1 << 20) -> list[Any]:
    return submits.batch(session, "echo", items, ids, requirements=Requirements(tags=["cpu"]), priority=2,
                         timeout_s=None, max_attempts=3, max_inline_bytes=limit)  # fmt: skip


def test_a_batch_gives_every_submit_a_plan_id_and_says_which_the_sdk_made() -> None:
    """Each item is one subscribed submit with the caller's id or a new one; ``own`` marks the new ones."""
    session = ClientSession("msgpack")
    requests = batch(session, [1, 2], ["mine", None])
    msgs = [COORDINATOR.decode(bytes(r.raw))[0] for r in requests]
    assert [(r.req_id, r.own) for r in requests] == [(1, False), (2, True)]
    assert msgs[0].plan_id == "mine" and msgs[1].plan_id and msgs[1].plan_id != "mine"
    assert all(m.subscribe and m.op == "echo" and m.requirements.tags == ["cpu"] for m in msgs)


def test_an_empty_plan_id_is_no_id_and_the_one_the_sdk_makes_for_it_is_its_own() -> None:
    """A caller's "" gets an SDK-made id, marked ``own`` as for None: its duplicate is this client's re-sent submit."""
    session = ClientSession("msgpack")
    requests = batch(session, [1, 2, 3], ["", None, "mine"])
    ids = [COORDINATOR.decode(bytes(r.raw))[0].plan_id for r in requests]
    assert [r.own for r in requests] == [True, True, False]
    assert len(ids[0]) == 16 and ids[0] != ids[1] and ids[2] == "mine"


def test_a_batch_reads_the_randomness_of_its_new_plan_ids_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """The SDK's ids of a batch come from one os.urandom read: 16 hex digits each, all distinct ("" is no id)."""
    reads: list[int] = []
    urandom = os.urandom

    def counted(size: int) -> bytes:
        reads.append(size)
        return urandom(size)

    monkeypatch.setattr(os, "urandom", counted)
    session = ClientSession("msgpack")
    requests = batch(session, list(range(1000)), [None] * 998 + ["mine", ""])
    ids = [COORDINATOR.decode(bytes(r.raw))[0].plan_id for r in requests]
    assert reads == [8 * 999]
    assert ids[998] == "mine" and len(set(ids)) == 1000
    assert all(len(i) == 16 and int(i, 16) >= 0 for i in ids[:998] + ids[999:])


def test_an_oversize_item_refuses_the_whole_batch_before_anything_is_sent() -> None:
    """An item encoded over max_inline_bytes raises ValueError naming it; the session has nothing to send."""
    session = ClientSession("msgpack")
    with pytest.raises(ValueError, match=r"args\[1\] is \d+ bytes encoded, over max_inline_bytes \(200\)"):
        batch(session, [b"x", b"y" * 300], [None, None], limit=200)
    assert session.next_frame() is None


def test_reserved_input_and_output_names_are_refused() -> None:
    """``__args__`` as an input or ``__result__`` as an output name is a ValueError; other names pass."""
    with pytest.raises(ValueError, match=r"\['__args__', '__result__'\] are reserved"):
        submits.check_names(["__args__", "a"], ["__result__"])
    submits.check_names(["a"], ["b"])


async def test_every_reply_is_waited_for_and_the_first_refusal_comes_back_with_the_accepted() -> None:
    """Three submits: the accepted plans come back in order with the first refusal, and no request stays pending."""
    session = ClientSession("msgpack")
    requests = batch(session, [1, 2, 3], ["a", None, "c"])
    made: list[tuple[str, bool]] = []

    def accepted(own: bool, reply: Accepted, /) -> Plan:
        made.append((reply.plan_id, own))
        return plan_of(own, reply)

    woken = asyncio.Event()
    waiting = asyncio.ensure_future(submits.await_accepted(session, requests, accepted, woken.set))
    await woken.wait()
    refusal = Error(code=codes.INVALID_ARGUMENT, message="no", req_id=2)
    for reply in (Accepted(req_id=3, plan_id="c", state="queued"), refusal,
                  Accepted(req_id=1, plan_id="a", state="queued")):  # fmt: skip
        session.receive(reply)
    plans, refused = await waiting
    assert [p.id for p in plans] == ["a", "c"]
    assert made == [("c", False), ("a", False)]
    assert isinstance(refused, RequestError) and refused.code == codes.INVALID_ARGUMENT
    assert session.pending_requests == 0


async def test_a_caller_that_gives_up_leaves_no_request_pending() -> None:
    """Cancelled after one reply of three: the answered request was let go by the session, the others here."""
    session = ClientSession("msgpack")
    requests = batch(session, [1, 2, 3], ["a", "b", "c"])

    woken = asyncio.Event()
    waiting = asyncio.ensure_future(submits.await_accepted(session, requests, plan_of, woken.set))
    await woken.wait()
    session.receive(Accepted(req_id=1, plan_id="a", state="queued"))
    assert session.pending_requests == 2
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    assert session.pending_requests == 0


async def test_a_session_that_ends_mid_batch_fails_the_caller_and_leaves_no_request_pending() -> None:
    """The session ends after one reply of three: the caller gets its error, no request stays pending."""
    session = ClientSession("msgpack")
    requests = batch(session, [1, 2, 3], ["a", "b", "c"])

    woken = asyncio.Event()
    waiting = asyncio.ensure_future(submits.await_accepted(session, requests, plan_of, woken.set))
    await woken.wait()
    session.receive(Accepted(req_id=2, plan_id="b", state="queued"))
    session.end(FleetwireConnectionError("gone"))
    with pytest.raises(FleetwireConnectionError, match="gone"):
        await waiting
    assert session.pending_requests == 0


async def test_a_batch_with_ids_out_of_order_puts_each_plan_in_its_place() -> None:
    """Requests whose req_ids are not consecutive still come back in the order given, refusals left out."""
    session = ClientSession("msgpack")
    first = batch(session, [1, 2], ["a", "b"])
    second = batch(session, [3], ["c"])
    requests = [second[0], first[1], first[0]]

    woken = asyncio.Event()
    waiting = asyncio.ensure_future(submits.await_accepted(session, requests, plan_of, woken.set))
    await woken.wait()
    for reply in (Accepted(req_id=1, plan_id="a", state="queued"), Accepted(req_id=3, plan_id="c", state="queued"),
                  Error(code=codes.INVALID_ARGUMENT, message="no", req_id=2)):  # fmt: skip
        session.receive(reply)
    plans, refused = await waiting
    assert [p.id for p in plans] == ["c", "a"]
    assert isinstance(refused, RequestError) and refused.req_id == 2
