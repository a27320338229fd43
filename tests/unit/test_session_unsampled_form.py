"""A submit still waiting for its reply is sent again after a reconnect in the form the new connection accepts
(fleetwire/session.py ``resume``, ``unsampled``; docs/PROTOCOL.md §1 ``X-Fleetwire-Accepts``): a ``"0"`` kept from a
connection that accepted it goes as ``"00"`` to one that did not say so, and as it was to one that did."""

from __future__ import annotations

import msgspec
import pytest

from fleetwire import submits
from fleetwire.session import ClientSession
from protocol.codec import Codec
from protocol.messages import Accepted, FromClient, Submit
from protocol.tracecontext import UNSAMPLED

ENCODINGS = ("msgpack", "json")


def _sent(session: ClientSession, codec: Codec) -> list[Submit]:
    frame = session.next_frame()
    assert frame is not None
    data = bytes(frame)
    return [msg for msg in codec.decode(data.decode() if codec.text else data) if isinstance(msg, Submit)]


class _Waiter:
    def done(self) -> bool:
        return False

    def set_result(self, result: object, /) -> None:
        pass

    def set_exception(self, exception: BaseException, /) -> None:
        pass


@pytest.mark.parametrize("encoding", ENCODINGS)
@pytest.mark.parametrize(("accepts", "resent"), [("00", "00"), ("0", "0")])
def test_a_pending_0_submit_is_resent_in_the_new_connections_form(encoding: str, accepts: str, resent: str) -> None:
    """Sent as "0", unanswered, resumed on a connection that says (or does not say) it accepts "0": re-sent in its
    form, the rest of the submit unchanged; a submit with another traceparent whose args hold the bytes is re-sent
    as it was."""
    session = ClientSession(encoding)  # type: ignore[arg-type]
    codec = Codec(encoding, FromClient, "client")  # type: ignore[arg-type]
    session.unsampled = "0"
    tricky = {"traceparent": "0"}  # the bytes a "0" submit holds, in its args
    msgs = [Submit(req_id=i, op="echo", plan_id=f"p{i}", args=[i], traceparent="0") for i in (1, 2)]
    msgs.append(Submit(req_id=3, op="echo", plan_id="p3", args=tricky, traceparent=UNSAMPLED))
    requests = [submits.Request(m.req_id, session.encode(m), False) for m in msgs]
    session.send_requests(requests, Submit, Accepted, _Waiter())
    first = _sent(session, codec)
    assert [m.traceparent for m in first] == ["0", "0", "00"]
    kept = bytes(requests[2].raw)
    session.unsampled = accepts
    session.resume()
    again = _sent(session, codec)
    assert [m.traceparent for m in again] == [resent, resent, "00"]
    assert [_without_traceparent(m) for m in again] == [_without_traceparent(m) for m in first]
    assert bytes(session._pending[3].raw or b"") == kept


def _without_traceparent(msg: Submit) -> Submit:
    return msgspec.structs.replace(msg, traceparent="")
