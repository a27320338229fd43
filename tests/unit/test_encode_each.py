"""ClientSession.encode_each (a batch's submits, fleetwire/session.py): each request's bytes as it encodes alone,
made in groups that share one buffer, and no large buffer kept alive by one request."""

from __future__ import annotations

import msgspec
import pytest

from fleetwire import session as session_module
from fleetwire.session import ClientSession
from protocol.codec import Codec
from protocol.messages import FromClient, Requirements, Submit

ENCODINGS = ["msgpack", "json"]


def submits(count: int, args: object = None, traceparent: str = "00") -> list[Submit]:
    requirements = Requirements(tags=["cpu"])
    return [Submit(req_id=i, op="echo", args=i if args is None else args, plan_id=f"p{i}", subscribe=True,
                   requirements=requirements, traceparent=traceparent) for i in range(1, count + 1)]  # fmt: skip


@pytest.mark.parametrize("encoding", ENCODINGS)
def test_each_request_is_the_bytes_it_encodes_to_alone(encoding: str) -> None:
    """Across groups (150 requests, groups of 64) every raw equals the request's own encoding, and decodes to it."""
    session = ClientSession(encoding)  # type: ignore[arg-type]
    msgs = submits(150)
    raws = session.encode_each(msgs)
    assert [bytes(raw) for raw in raws] == [bytes(session.encode(msg)) for msg in msgs]
    coordinator = Codec(encoding, FromClient, "client")  # type: ignore[arg-type]
    frames = [bytes(raw).decode() if encoding == "json" else bytes(raw) for raw in raws]  # JSON frames are text
    assert [coordinator.decode(frame)[0] for frame in frames] == msgs
    assert session.encode_each([]) == []


@pytest.mark.parametrize("encoding", ENCODINGS)
def test_a_large_group_gives_each_request_its_own_buffer(encoding: str) -> None:
    """A group encoded over _SHARED_BYTES is copied apart: a request the session keeps (until its plan ends) does
    not keep its group's buffer alive; smaller groups are views of theirs."""
    session = ClientSession(encoding)  # type: ignore[arg-type]
    large = submits(3, args="x" * session_module._SHARED_BYTES)
    small = submits(3)
    large_raws, small_raws = session.encode_each(large), session.encode_each(small)
    assert [bytes(raw) for raw in large_raws] == [bytes(session.encode(msg)) for msg in large]
    assert all(raw.copy() is raw for raw in large_raws)  # its own bytes: copy() has nothing to copy
    assert all(raw.copy() is not raw for raw in small_raws)  # a view of the group's buffer


def test_an_unencodable_request_fails_the_whole_call() -> None:
    """One item the encoding cannot carry raises, as encoding it alone would: nothing is returned."""
    session = ClientSession("msgpack")
    msgs = submits(70)
    msgs[66] = msgspec.structs.replace(msgs[66], args=object())
    with pytest.raises(TypeError):
        session.encode_each(msgs)
