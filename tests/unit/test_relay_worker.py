"""The worker's side of the relay (worker_agent/relay.py) on a real spool: tickets, offsets, digests, credit."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from protocol.messages import DataChunk, DataCredit, DataEnd, DataKey, DataOpen
from protocol.relay import CLOSED as RETRYABLE_CLOSED
from protocol.relay import GONE, MAX_CHUNK_BYTES, REFUSED, UNAUTHORIZED, VIOLATION
from protocol.tickets import FileClaim, TicketClaims, sign, worker_key
from tests.integration.data_helpers import digest
from worker_agent.relay import RelayEndpoint
from worker_agent.spool import Spool

MASTER = b"m" * 32


def ticket(name: str, size: int, digest: str, *, direction: str = "put", plan: str = "p1",
           key: bytes = MASTER) -> str:
    claims = TicketClaims(plan, 1, "w1", direction, {name: FileClaim(size, digest)}, time.time() + 60)  # type: ignore[arg-type]
    return sign(claims, "k1", worker_key(key, "w1"))



def relay_endpoint(tmp_path: Path) -> Any:
    """Worker w1's relay endpoint on a real spool under ``tmp_path``, keyed by :data:`MASTER`; what it sends
    collects in its ``sent`` list."""
    sent: list[Any] = []
    endpoint = RelayEndpoint(Spool(tmp_path / "spool", memory_bytes=1024), worker_id="w1", send=sent.append)
    endpoint.set_keys([DataKey(kid="k1", key=worker_key(MASTER, "w1"))])
    endpoint.sent = sent  # type: ignore[attr-defined]
    return endpoint


@pytest.fixture
async def relay(tmp_path: Path) -> Any:
    return relay_endpoint(tmp_path)


def chunk(offset: int, data: bytes) -> DataChunk:
    return DataChunk(plan_id="p1", attempt=1, name="x", offset=offset, data=data)


async def test_upload_is_written_acked_and_verified(relay: Any) -> None:
    """Chunks are written in order, each acked with a credit; the last byte verifies the digest."""
    data = b"a" * (MAX_CHUNK_BYTES + 10)
    relay.on_message(DataOpen(plan_id="p1", attempt=1, name="x", ticket=ticket("x", len(data), digest(data)),
                              credit=4 * MAX_CHUNK_BYTES))
    first = relay.sent.pop()
    assert isinstance(first, DataCredit) and (first.offset, first.size) == (0, len(data))
    relay.on_message(chunk(0, data[:MAX_CHUNK_BYTES]))
    await relay.drained()  # a file-backed input's chunks are written and hashed off the loop
    assert relay.sent.pop().offset == MAX_CHUNK_BYTES
    relay.on_message(chunk(MAX_CHUNK_BYTES, data[MAX_CHUNK_BYTES:]))
    await relay.drained()
    end = relay.sent.pop()
    assert isinstance(end, DataEnd) and end.code == "" and end.offset == len(data)
    entry = relay.spool.input("p1", 1, "x")
    assert entry.state == "verified" and entry.via == "relay"


@pytest.mark.parametrize(("kwargs", "code"), [({"key": b"f" * 32}, UNAUTHORIZED), ({"plan": "p2"}, REFUSED),
                                               ({"direction": "get"}, REFUSED)])
async def test_bad_tickets_are_refused(relay: Any, kwargs: dict[str, Any], code: str) -> None:
    """A forged ticket is unauthorized (401 on the direct path); a foreign one forbidden (403); nothing declared."""
    relay.on_message(DataOpen(plan_id="p1", attempt=1, name="x", ticket=ticket("x", 3, digest(b"abc"), **kwargs)))
    end = relay.sent.pop()
    assert isinstance(end, DataEnd) and end.code == code
    assert relay.spool.input("p1", 1, "x") is None


async def test_digest_mismatch_fails_the_input_naming_it(relay: Any) -> None:
    """Bytes that do not match the declared digest: the stream is closed to be opened again from offset 0 (damage
    in transit) twice, then data_end(input_mismatch) naming the input."""
    for retry in (1, 2):
        relay.on_message(DataOpen(plan_id="p1", attempt=1, name="x", ticket=ticket("x", 3, digest(b"abc")),
                                  stream=retry))
        assert relay.sent.pop().offset == 0  # the credit: from 0
        relay.on_message(DataChunk(plan_id="p1", attempt=1, name="x", offset=0, data=b"abd", stream=retry))
        again = relay.sent.pop()
        assert again.code == RETRYABLE_CLOSED and again.offset == 0 and f"retry {retry} of 2" in again.message
        assert again.stream == retry  # the open's id, as on every end
    relay.on_message(DataOpen(plan_id="p1", attempt=1, name="x", ticket=ticket("x", 3, digest(b"abc"))))
    relay.sent.clear()
    relay.on_message(chunk(0, b"abd"))
    end = relay.sent.pop()
    assert end.code == "input_mismatch" and "'x'" in end.message


async def test_chunk_out_of_order_or_past_the_size_is_refused(relay: Any) -> None:
    """A chunk not at the acknowledged offset, or past the declared size, ends the stream; nothing is written."""
    relay.on_message(DataOpen(plan_id="p1", attempt=1, name="x", ticket=ticket("x", 3, digest(b"abc"))))
    relay.sent.clear()
    relay.on_message(chunk(1, b"b"))
    assert relay.sent.pop().code == VIOLATION
    relay.on_message(DataOpen(plan_id="p1", attempt=1, name="x", ticket=ticket("x", 3, digest(b"abc"))))
    relay.sent.clear()
    relay.on_message(chunk(0, b"abcd"))
    assert relay.sent.pop().code == VIOLATION
    assert relay.spool.input("p1", 1, "x").received == 0


async def test_download_respects_the_credit(relay: Any) -> None:
    """An output goes out in chunks up to the credit, more as credits come, the last one marked."""
    data = bytes(range(256)) * (3 * MAX_CHUNK_BYTES // 256)
    relay.spool.add_output("p1", 1, "out", data)
    relay.on_message(DataOpen(plan_id="p1", attempt=1, name="out", direction="get",
                              ticket=ticket("out", -1, "", direction="get"), credit=2 * MAX_CHUNK_BYTES))
    assert [m.offset for m in relay.sent] == [0, MAX_CHUNK_BYTES]
    relay.on_message(DataCredit(plan_id="p1", attempt=1, name="out", direction="get", offset=MAX_CHUNK_BYTES))
    last = relay.sent[-1]
    assert len(relay.sent) == 3 and last.last and last.size == len(data)
    assert b"".join(m.data for m in relay.sent) == data


async def test_missing_output_is_gone(relay: Any) -> None:
    """A get of an output the worker does not hold ends output_gone, naming the output and the worker."""
    relay.on_message(DataOpen(plan_id="p1", attempt=1, name="out", direction="get",
                              ticket=ticket("out", -1, "", direction="get"), stream=5))
    end = relay.sent.pop()
    assert (end.code, end.stream) == (GONE, 5) and "no output 'out' on worker w1" in end.message


async def test_a_whole_get_ends_the_outputs_stay_but_a_workers_pull_keeps_it(relay: Any) -> None:
    """A client's whole relayed get leaves the output a short grace (as a whole HTTP download); a get with pull set
    (another worker fetching it as an input) leaves its retention as it was."""
    relay.spool.add_output("p1", 1, "out", b"abc")
    kept = relay.spool.output("p1", 1, "out").expires_at
    relay.on_message(DataOpen(plan_id="p1", attempt=1, name="out", direction="get",
                              ticket=ticket("out", -1, "", direction="get"), credit=MAX_CHUNK_BYTES, pull=True))
    assert relay.sent[-1].last and relay.spool.output("p1", 1, "out").expires_at == kept
    relay.on_message(DataOpen(plan_id="p1", attempt=1, name="out", direction="get",
                              ticket=ticket("out", -1, "", direction="get"), credit=MAX_CHUNK_BYTES))
    assert relay.sent[-1].last and relay.spool.output("p1", 1, "out").expires_at < kept
