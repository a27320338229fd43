"""The relay's bookkeeping in the core (coordinator/relay.py): checks, credit, bounded memory, isolation."""

from __future__ import annotations

from typing import Any

import pytest

from protocol.messages import Accept, Assign, DataChunk, DataCredit, DataEnd, DataOpen, InputSpec
from protocol.relay import CLOSED, MAX_CHUNK_BYTES, VIOLATION
from tests.unit.test_core import Harness

DIGEST = "sha256:" + "0" * 64
CHUNK = b"x" * MAX_CHUNK_BYTES
WINDOW = 4 * MAX_CHUNK_BYTES


def placed(h: Harness, worker: str, client: int, size: int = 8 * MAX_CHUNK_BYTES, **kw: Any) -> tuple[int, str]:
    """A worker and a plan with one input ``x`` of ``size`` bytes, leased to it and running."""
    conn = h.worker(worker)
    plan_id = h.submit(client, inputs=[InputSpec(name="x", size=size, digest=DIGEST)], **kw)
    assign = [m for m in h.take(conn) if isinstance(m, Assign)][-1]
    h.send(conn, Accept(plan_id=plan_id, attempt=assign.attempt))
    h.take(client)
    return conn, plan_id


def put_open(h: Harness, client: int, worker: int, plan_id: str, offset: int = 0) -> DataOpen:
    """The client opens the upload of ``x``; the worker answers with its credit at ``offset``."""
    h.send(client, DataOpen(plan_id=plan_id, attempt=1, name="x", ticket="t"))
    opened = only_of(h.take(worker), DataOpen)
    h.send(worker, DataCredit(plan_id=plan_id, attempt=1, name="x", offset=offset, credit=opened.credit,
                              size=8 * MAX_CHUNK_BYTES))
    credit = only_of(h.take(client), DataCredit)
    assert credit.offset == offset and credit.credit == opened.credit
    assert isinstance(opened, DataOpen)
    return opened


def chunk(plan_id: str, offset: int, data: bytes = CHUNK, **kw: Any) -> DataChunk:
    return DataChunk(plan_id=plan_id, attempt=1, name="x", offset=offset, data=data, **kw)


def only_of(msgs: list[Any], cls: type) -> Any:
    found = [m for m in msgs if isinstance(m, cls)]
    assert len(found) == 1, msgs
    return found[0]


@pytest.fixture
def h() -> Harness:
    return Harness(relay_window_bytes=WINDOW)  # four chunks: the tests count them


def test_open_is_passed_to_the_plans_worker_with_the_streams_credit(h: Harness) -> None:
    """A client's data_open reaches the plan's worker with credit = the window; it is held only once the worker
    accepted the ticket (its first credit)."""
    client = h.client()
    worker, plan_id = placed(h, "w1", client)
    h.send(client, DataOpen(plan_id=plan_id, attempt=1, name="x", ticket="fw1.k.c.m"))
    opened = only_of(h.take(worker), DataOpen)
    assert (opened.plan_id, opened.name, opened.ticket, opened.credit) == (plan_id, "x", "fw1.k.c.m", WINDOW)
    assert h.core.relay.reserved == 0 and h.core.relay.in_flight == 0
    h.send(worker, DataCredit(plan_id=plan_id, attempt=1, name="x", offset=0, size=8 * MAX_CHUNK_BYTES))
    assert only_of(h.take(client), DataCredit).credit == WINDOW
    assert h.core.relay.reserved == WINDOW


def test_chunks_pass_within_credit_and_the_credit_is_never_exceeded(h: Harness) -> None:
    """Chunks flow to the worker up to the window; one more before an ack ends the stream, unforwarded."""
    client = h.client()
    worker, plan_id = placed(h, "w1", client)
    put_open(h, client, worker, plan_id)
    for i in range(4):
        h.send(client, chunk(plan_id, i * MAX_CHUNK_BYTES))
        assert h.core.relay.in_flight <= WINDOW
    forwarded = [m for m in h.take(worker) if isinstance(m, DataChunk)]
    assert [m.offset for m in forwarded] == [i * MAX_CHUNK_BYTES for i in range(4)]
    assert forwarded[0].data is not None and len(forwarded[0].data) == MAX_CHUNK_BYTES
    h.send(client, chunk(plan_id, WINDOW))  # a fifth chunk with no credit back
    to_worker = h.take(worker)
    assert not [m for m in to_worker if isinstance(m, DataChunk)]
    ends = [only_of(to_worker, DataEnd), only_of(h.take(client), DataEnd)]
    assert all(end.code == VIOLATION and "credit" in end.message for end in ends)
    assert h.core.relay.streams == {} and h.core.relay.reserved == 0


def test_acks_return_credit_to_the_client(h: Harness) -> None:
    """The worker's data_credit is relayed to the client, and the stream may send that much more."""
    client = h.client()
    worker, plan_id = placed(h, "w1", client)
    put_open(h, client, worker, plan_id)
    for i in range(4):
        h.send(client, chunk(plan_id, i * MAX_CHUNK_BYTES))
    h.send(worker, DataCredit(plan_id=plan_id, attempt=1, name="x", offset=2 * MAX_CHUNK_BYTES))
    assert only_of(h.take(client), DataCredit).offset == 2 * MAX_CHUNK_BYTES
    h.take(worker)
    h.send(client, chunk(plan_id, WINDOW))
    h.send(client, chunk(plan_id, WINDOW + MAX_CHUNK_BYTES))
    assert len([m for m in h.take(worker) if isinstance(m, DataChunk)]) == 2
    assert h.core.relay.in_flight == WINDOW


def test_resumed_upload_starts_where_the_worker_says(h: Harness) -> None:
    """The worker's first credit sets where chunks continue; a chunk from elsewhere is refused."""
    client = h.client()
    worker, plan_id = placed(h, "w1", client)
    put_open(h, client, worker, plan_id, offset=3 * MAX_CHUNK_BYTES)
    h.send(client, chunk(plan_id, 0))
    assert only_of(h.take(client), DataEnd).code == VIOLATION


def test_chunk_over_the_declared_size_is_refused(h: Harness) -> None:
    """Bytes past the input's declared size end the stream; the worker never sees them."""
    client = h.client()
    worker, plan_id = placed(h, "w1", client, size=100)
    h.send(client, DataOpen(plan_id=plan_id, attempt=1, name="x"))
    h.take(worker)
    h.send(worker, DataCredit(plan_id=plan_id, attempt=1, name="x", offset=0, size=100))
    h.take(client)
    h.send(client, chunk(plan_id, 0, b"y" * 101))
    assert not [m for m in h.take(worker) if isinstance(m, DataChunk)]
    end = only_of(h.take(client), DataEnd)
    assert end.code == VIOLATION and "declared size of 100" in end.message


def test_chunk_over_the_chunk_limit_is_refused(h: Harness) -> None:
    """A chunk over 256 KiB ends the stream (the window is counted in chunks no bigger)."""
    client = h.client()
    worker, plan_id = placed(h, "w1", client)
    put_open(h, client, worker, plan_id)
    h.send(client, chunk(plan_id, 0, b"y" * (MAX_CHUNK_BYTES + 1)))
    assert only_of(h.take(client), DataEnd).code == VIOLATION


def test_chunk_before_the_workers_credit_is_refused(h: Harness) -> None:
    """Bytes sent before the worker said where to start are refused."""
    client = h.client()
    worker, plan_id = placed(h, "w1", client)
    h.send(client, DataOpen(plan_id=plan_id, attempt=1, name="x"))
    h.take(worker)
    h.send(client, chunk(plan_id, 0))
    assert not [m for m in h.take(worker) if isinstance(m, DataChunk)]
    assert only_of(h.take(client), DataEnd).code == VIOLATION


def test_foreign_plan_is_refused(h: Harness) -> None:
    """Another principal's plan cannot be opened: answered as a plan that does not exist, its worker untouched."""
    alice = h.client("alice")
    worker, plan_id = placed(h, "w1", alice)
    mallory = h.client("mallory")
    h.send(mallory, DataOpen(plan_id=plan_id, attempt=1, name="x"))
    end = only_of(h.take(mallory), DataEnd)
    assert end.code == "plan_not_found" and end.message == f"plan {plan_id!r} does not exist"
    assert not h.take(worker)
    h.send(mallory, chunk(plan_id, 0))  # nor can it push bytes into alice's stream
    assert only_of(h.take(mallory), DataEnd).code == CLOSED
    assert not h.take(worker)


def test_undeclared_name_and_old_attempt_are_refused(h: Harness) -> None:
    """Only a declared input of the current attempt can be opened."""
    client = h.client()
    worker, plan_id = placed(h, "w1", client)
    h.send(client, DataOpen(plan_id=plan_id, attempt=1, name="y"))
    assert "declared no input 'y'" in only_of(h.take(client), DataEnd).message
    h.send(client, DataOpen(plan_id=plan_id, attempt=2, name="x"))
    assert only_of(h.take(client), DataEnd).code == CLOSED
    assert not h.take(worker)


def test_memory_is_bounded_in_total(h: Harness) -> None:
    """Windows held together stay within max_bytes: a stream with no room waits in line (credit 0, a reason), and
    gets its window when another stream gives one back."""
    h = Harness(relay_max_bytes=2 * WINDOW, relay_window_bytes=WINDOW, relay_principal_bytes=WINDOW,
                relay_session_bytes=WINDOW)
    alice, bob, carol = h.client("alice"), h.client("bob"), h.client("carol")
    w1, p1 = placed(h, "w1", alice)
    w2, p2 = placed(h, "w2", bob)
    w3, p3 = placed(h, "w3", carol)
    put_open(h, alice, w1, p1)
    put_open(h, bob, w2, p2)
    h.send(carol, DataOpen(plan_id=p3, attempt=1, name="x"))
    assert only_of(h.take(w3), DataOpen).credit == WINDOW
    h.send(w3, DataCredit(plan_id=p3, attempt=1, name="x", offset=0, size=8 * MAX_CHUNK_BYTES))
    wait = only_of(h.take(carol), DataCredit)
    assert wait.credit == 0 and "--relay-max-bytes" in wait.wait
    assert h.core.relay.reserved == 2 * WINDOW and h.core.relay.waiting == 1
    h.send(carol, chunk(p3, 0))  # no credit yet: a chunk is refused
    assert only_of(h.take(carol), DataEnd).code == VIOLATION
    h.send(carol, DataOpen(plan_id=p3, attempt=1, name="x"))
    h.send(w3, DataCredit(plan_id=p3, attempt=1, name="x", offset=0, size=8 * MAX_CHUNK_BYTES))
    assert only_of(h.take(carol), DataCredit).wait
    h.close(w1)  # the first worker goes: its client is told, its window goes to the stream in line
    end = only_of(h.take(alice), DataEnd)
    assert (end.plan_id, end.code) == (p1, CLOSED)
    credit = only_of(h.take(carol), DataCredit)
    assert (credit.plan_id, credit.credit, credit.wait) == (p3, WINDOW, "")
    assert h.core.relay.reserved == 2 * WINDOW and h.core.relay.waiting == 0


def test_slow_worker_does_not_stall_another_plans_relay(h: Harness) -> None:
    """A worker that never acks stops its own stream at the window; another plan's stream keeps flowing."""
    client = h.client()
    slow, p_slow = placed(h, "slow", client)
    fast, p_fast = placed(h, "fast", client)
    put_open(h, client, slow, p_slow)
    put_open(h, client, fast, p_fast)
    for i in range(4):
        h.send(client, chunk(p_slow, i * MAX_CHUNK_BYTES))
    offset = 0
    for _ in range(8):  # twice the window, each chunk acked by the fast worker
        h.send(client, chunk(p_fast, offset))
        offset += MAX_CHUNK_BYTES
        h.send(fast, DataCredit(plan_id=p_fast, attempt=1, name="x", offset=offset))
    assert len([m for m in h.take(fast) if isinstance(m, DataChunk)]) == 8
    assert not [m for m in h.take(client) if isinstance(m, DataEnd)]
    assert h.core.relay.streams[(p_slow, 1, "x", "put")].in_flight == WINDOW
    assert h.core.relay.in_flight == WINDOW  # only the slow stream's window is held


def test_output_stream_get(h: Harness) -> None:
    """A get is opened to the worker, its chunks go to the client within credit, the last one ends it."""
    client = h.client()
    worker, plan_id = placed(h, "w1", client, outputs=["out"])
    h.send(client, DataOpen(plan_id=plan_id, attempt=1, name="out", direction="get", offset=0))
    assert only_of(h.take(worker), DataOpen).direction == "get"
    size = 5 * MAX_CHUNK_BYTES
    for i in range(4):
        h.send(worker, DataChunk(plan_id=plan_id, attempt=1, name="out", offset=i * MAX_CHUNK_BYTES, data=CHUNK,
                                 direction="get", size=size))
    assert len([m for m in h.take(client) if isinstance(m, DataChunk)]) == 4
    h.send(client, DataCredit(plan_id=plan_id, attempt=1, name="out", offset=MAX_CHUNK_BYTES, direction="get"))
    assert only_of(h.take(worker), DataCredit).offset == MAX_CHUNK_BYTES
    h.send(worker, DataChunk(plan_id=plan_id, attempt=1, name="out", offset=WINDOW, data=CHUNK, direction="get",
                             size=size, last=True))
    assert only_of(h.take(client), DataChunk).last
    assert h.core.relay.streams == {} and h.core.relay.reserved == 0
    h.send(client, DataChunk(plan_id=plan_id, attempt=1, name="out", offset=0, data=b"z", direction="get"))
    assert only_of(h.take(client), DataEnd).code == CLOSED  # a client cannot push bytes into a get


def test_end_from_either_side_is_passed_on(h: Harness) -> None:
    """A worker's data_end (e.g. the input verified) reaches the client and frees the stream."""
    client = h.client()
    worker, plan_id = placed(h, "w1", client)
    put_open(h, client, worker, plan_id)
    h.send(worker, DataEnd(plan_id=plan_id, attempt=1, name="x", code="input_mismatch", message="digest"))
    assert only_of(h.take(client), DataEnd).code == "input_mismatch"
    assert h.core.relay.reserved == 0
    put_open(h, client, worker, plan_id)
    h.close(client)
    assert only_of(h.take(worker), DataEnd).code == CLOSED
    assert h.core.relay.streams == {}


def test_a_workers_pull_waits_behind_another_stream_of_the_output_and_opens_when_it_ends(h: Harness) -> None:
    """A worker's relayed pull (data_open get from a worker session) reaches the holder; a second worker's pull of
    the same output waits behind it, told so, and is opened as the first one's last chunk passes."""
    client = h.client()
    holder, plan_id = placed(h, "w1", client, outputs=["out"])
    w2, w3 = h.worker("w2"), h.worker("w3")
    h.take(w2), h.take(w3)

    def pull(conn: int, stream: int) -> None:
        h.send(conn, DataOpen(plan_id=plan_id, attempt=1, name="out", direction="get", ticket="t", stream=stream))

    pull(w2, 7)
    assert only_of(h.take(holder), DataOpen).stream == 7
    assert only_of(h.take(w2), DataCredit).credit == WINDOW
    pull(w3, 7)  # the same stream id from another session: no matter, it waits
    wait = only_of(h.take(w3), DataCredit)
    assert wait.credit == 0 and "another relayed fetch of this output" in wait.wait
    assert h.take(holder) == []
    h.send(holder, DataChunk(plan_id=plan_id, attempt=1, name="out", offset=0, data=b"abc", direction="get", size=3,
                             last=True, stream=7))
    assert only_of(h.take(w2), DataChunk).last
    assert only_of(h.take(holder), DataOpen).direction == "get"  # w3's, now
    assert only_of(h.take(w3), DataCredit).credit == WINDOW
    h.send(w3, DataEnd(plan_id=plan_id, attempt=1, name="out", direction="get", code="cancelled", stream=7))
    assert only_of(h.take(holder), DataEnd).code == "cancelled"
    assert h.core.relay.streams == {} and h.core.relay.reserved == 0


def test_a_pull_that_gave_up_or_whose_session_closed_while_waiting_is_never_opened(h: Harness) -> None:
    """A waiting pull whose worker ended it (data_end) or whose session closed is forgotten: the holder never
    gets its open. A worker may not open a put."""
    client = h.client()
    holder, plan_id = placed(h, "w1", client, outputs=["out"])
    w2, w3, w4 = h.worker("w2"), h.worker("w3"), h.worker("w4")
    opened = DataOpen(plan_id=plan_id, attempt=1, name="out", direction="get", ticket="t", stream=1)
    h.send(w2, opened)
    h.send(w3, opened)
    h.send(w4, opened)
    h.take(holder)
    h.send(w3, DataEnd(plan_id=plan_id, attempt=1, name="out", direction="get", code="cancelled", stream=1))
    h.close(w4)
    h.send(w2, DataEnd(plan_id=plan_id, attempt=1, name="out", direction="get", code="cancelled", stream=1))
    assert not [m for m in h.take(holder) if isinstance(m, DataOpen)]
    assert h.core.relay.streams == {}
    h.send(w2, DataOpen(plan_id=plan_id, attempt=1, name="x", ticket="t"))
    assert only_of(h.take(w2), DataEnd).code == "invalid_argument"
