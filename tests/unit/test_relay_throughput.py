"""The relay's throughput mechanics: one credit per quarter window, each chunk encoded once on its way,
no second copy of a client's lone chunk."""

from __future__ import annotations

import asyncio
import hashlib
import tracemalloc
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pytest

from coordinator.io.frontdoor.connection import MAX_OUT_FRAME_BYTES, Session
from fleetwire.data import Grant
from fleetwire.inputs import InputSource
from fleetwire.relay import RelayTransport
from fleetwire.session import ClientSession
from protocol import Codec
from protocol.messages import (
    DataChunk,
    DataCredit,
    DataEnd,
    DataOpen,
    FromClient,
    FromWorker,
    ListWorkers,
    ToClient,
    Workers,
)
from protocol.relay import DEFAULT_WINDOW_BYTES, MAX_CHUNK_BYTES, credit_every
from tests.unit.test_core import Harness
from tests.unit.test_relay_core import only_of, placed
from tests.unit.test_relay_worker import relay_endpoint, ticket
from worker_agent.outbox import encode_frames

CHUNK = b"c" * MAX_CHUNK_BYTES


class CountingCodec(Codec):
    """A codec that adds up how many bytes it encoded."""

    encoded = 0

    def encode(self, msgs: Any) -> bytes:
        frame = super().encode(msgs)
        self.encoded += len(frame)
        return frame


def chunks(count: int, direction: Any = "get") -> list[DataChunk]:
    return [DataChunk(plan_id="p", attempt=1, name="x", offset=i * MAX_CHUNK_BYTES, data=CHUNK, direction=direction)
            for i in range(count)]


def test_credit_every_is_a_quarter_window_and_never_starves_a_sender() -> None:
    """A receiver credits every quarter window; with a window of one chunk (or none known), every chunk."""
    assert credit_every(DEFAULT_WINDOW_BYTES) == DEFAULT_WINDOW_BYTES // 4
    assert credit_every(MAX_CHUNK_BYTES) == 0 and credit_every(0) == 0
    for window in (MAX_CHUNK_BYTES, 2 * MAX_CHUNK_BYTES, 3 * MAX_CHUNK_BYTES, DEFAULT_WINDOW_BYTES):
        # a sender stops with more than window - chunk unacknowledged: the receiver must credit by then
        assert credit_every(window) <= window - MAX_CHUNK_BYTES


@pytest.mark.parametrize("encoding", ["msgpack", "json"])
def test_worker_frames_of_relayed_chunks_encode_each_byte_once(encoding: Any) -> None:
    """Sixteen queued chunks become frames under the limit, in order, without re-encoding halves."""
    codec = CountingCodec(encoding, FromWorker, "worker")
    batch = chunks(16)
    frames = encode_frames(codec, batch, 1 << 20)  # type: ignore[arg-type]
    sizes = [len(frame) for frame, _ in frames]
    assert all(size <= 1 << 20 for size in sizes)
    assert [m for _, msgs in frames for m in msgs] == batch
    decoded = [m for frame, _ in frames for m in codec.decode(frame.decode() if codec.text else frame)]
    assert [m.offset for m in decoded] == [m.offset for m in batch]
    assert codec.encoded == sum(sizes)  # nothing encoded and then thrown away


def test_coordinator_writer_cuts_a_batch_of_chunks_before_encoding() -> None:
    """Once a session carries relayed chunks, a batch of them is cut into frames without encoding it whole."""
    codec = CountingCodec("msgpack", ToClient, "client")
    session = Session(conn_id=1, ws=None, codec=codec)  # type: ignore[arg-type]
    session.msg_bytes = float(MAX_CHUNK_BYTES)  # what the writer measured of its last batch
    batch = chunks(8)
    frames = session._frames(batch)
    assert all(len(frame) <= MAX_OUT_FRAME_BYTES for frame in frames)
    assert [m.offset for frame in frames for m in codec.decode(frame)] == [m.offset for m in batch]
    assert codec.encoded == sum(map(len, frames))


@pytest.mark.parametrize(("window", "credits"), [(16 * MAX_CHUNK_BYTES, 3), (MAX_CHUNK_BYTES, 15)])
async def test_worker_credits_an_upload_once_per_quarter_window(tmp_path: Path, window: int, credits: int) -> None:
    """The worker acknowledges a relayed upload every quarter window (every chunk when the window is one)."""
    endpoint = relay_endpoint(tmp_path)
    sent = endpoint.sent
    data = CHUNK * 16
    digest = f"sha256:{hashlib.sha256(data).hexdigest()}"
    grant = ticket("x", len(data), digest)
    endpoint.on_message(DataOpen(plan_id="p1", attempt=1, name="x", ticket=grant, credit=window))
    assert only_of(sent, DataCredit).offset == 0
    sent.clear()
    for i in range(16):
        endpoint.on_message(DataChunk(plan_id="p1", attempt=1, name="x", offset=i * MAX_CHUNK_BYTES, data=CHUNK))
        if window == MAX_CHUNK_BYTES:  # a one-chunk window: the sender waits for each chunk's credit
            await endpoint.drained()
    await endpoint.drained()
    acked = [m.offset for m in sent if isinstance(m, DataCredit)]
    assert len(acked) == credits and acked == sorted(acked)
    assert all(later - earlier >= credit_every(window) for earlier, later in zip([0, *acked], acked, strict=False))
    end = only_of(sent, DataEnd)
    assert end.code == "" and end.offset == len(data)


def test_coordinator_tells_the_downloading_client_its_window() -> None:
    """A relayed get's open gives the client the stream's window (a data_credit), so it may credit per quarter."""
    h = Harness()
    client = h.client()
    worker, plan_id = placed(h, "w1", client, outputs=["out"])
    h.send(client, DataOpen(plan_id=plan_id, attempt=1, name="out", direction="get", offset=3))
    assert only_of(h.take(worker), DataOpen).credit == DEFAULT_WINDOW_BYTES
    told = only_of(h.take(client), DataCredit)
    assert (told.direction, told.offset, told.credit) == ("get", 3, DEFAULT_WINDOW_BYTES)


class Link:
    def __init__(self) -> None:
        self.posted: list[Any] = []

    def post(self, msg: Any) -> None:
        self.posted.append(msg)


async def test_client_credits_a_download_once_per_quarter_window() -> None:
    """A relayed download is credited every quarter of the window the coordinator gave, and fully received."""
    link = Link()
    relay = RelayTransport(link, stall_timeout_s=5)
    window, count = 8 * MAX_CHUNK_BYTES, 12
    received: list[bytes] = []

    async def fetch() -> None:
        async for data in relay.download(Grant("p", 1, "", "t", "g"), "x"):
            received.append(data)

    task = asyncio.create_task(fetch())
    await asyncio.sleep(0)  # the open is posted
    relay.receive(DataCredit(plan_id="p", attempt=1, name="x", direction="get", offset=0, credit=window))
    for msg in chunks(count):
        msg.last = msg.offset + MAX_CHUNK_BYTES == count * MAX_CHUNK_BYTES
        relay.receive(msg)
        await asyncio.sleep(0)
    await asyncio.wait_for(task, 5)
    assert b"".join(received) == CHUNK * count
    credits = [m.offset for m in link.posted if isinstance(m, DataCredit)]
    assert credits == [2 * MAX_CHUNK_BYTES * i for i in range(1, 6)]  # every quarter window, none after the last


async def test_client_upload_sends_whole_chunks_in_order_within_credit() -> None:
    """An upload (read in blocks) goes out as chunks of at most 256 KiB, in order, never past its credit."""
    link = Link()
    relay = RelayTransport(link, stall_timeout_s=5)
    data = bytes(range(256)) * (9 * MAX_CHUNK_BYTES // 256 + 7)
    source = InputSource("x", len(data), "sha256:" + "0" * 64, data=memoryview(data))
    window = 4 * MAX_CHUNK_BYTES
    task = asyncio.create_task(relay.upload(Grant("p", 1, "", "t"), source))
    await asyncio.sleep(0)
    relay.receive(DataCredit(plan_id="p", attempt=1, name="x", offset=0, credit=window, size=len(data)))
    got, acked = bytearray(), 0
    while len(got) < len(data):
        for _ in range(5):
            await asyncio.sleep(0)
        sent = [m for m in link.posted if isinstance(m, DataChunk)]
        assert sent, "the upload stalled with credit left"
        link.posted.clear()
        for msg in sent:
            assert msg.offset == len(got) and 0 < len(msg.data) <= MAX_CHUNK_BYTES
            got += msg.data
            assert len(got) - acked <= window
            assert msg.last == (len(got) == len(data))
        acked = len(got) - MAX_CHUNK_BYTES if len(got) < len(data) else len(got)  # the receiver lags a chunk
        relay.receive(DataCredit(plan_id="p", attempt=1, name="x", offset=acked, credit=window))
    relay.receive(DataEnd(plan_id="p", attempt=1, name="x", offset=len(data)))
    await asyncio.wait_for(task, 5)
    assert bytes(got) == data


def test_a_lone_posted_chunk_is_its_frame_without_another_copy() -> None:
    """A posted relay chunk alone in the client's outbox goes out as encoded: next_frame allocates no second copy."""
    session = ClientSession("msgpack")
    session.post(DataChunk(plan_id="p", attempt=1, name="x", offset=0, data=b"z" * MAX_CHUNK_BYTES))
    tracemalloc.start()
    try:
        frame = session.next_frame()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < MAX_CHUNK_BYTES // 4
    assert frame is not None and session.next_frame() is None
    (msg,) = Codec("msgpack", FromClient, "client").decode(frame)
    assert isinstance(msg, DataChunk) and msg.data == b"z" * MAX_CHUNK_BYTES


def test_posted_messages_coalesce_with_requests_into_one_frame() -> None:
    """Small posted messages and queued requests still go out as one array frame, in order."""
    session = ClientSession("json")
    session.post(DataCredit(plan_id="p", attempt=1, name="x", direction="get", offset=7))
    ask = ListWorkers(req_id=session.next_req_id())
    session.send_request(ask.req_id, ListWorkers, session.encode(ask), Workers, Future())
    session.post(DataEnd(plan_id="p", attempt=1, name="x", direction="get", code="cancelled"))
    frame = session.next_frame()
    assert frame is not None and session.next_frame() is None
    msgs = Codec("json", FromClient, "client").decode(frame.decode())
    assert [type(m) for m in msgs] == [DataCredit, ListWorkers, DataEnd]
