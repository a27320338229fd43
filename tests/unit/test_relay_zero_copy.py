"""Relayed chunks through the coordinator without copies (protocol/chunkview.py); the worker's side off its loop
and within a bounded read-ahead."""

from __future__ import annotations

import asyncio
import hashlib
from pathlib import Path
from typing import Any

import msgspec
import pytest

from coordinator.io.frontdoor.connection import Session
from fleetwire.data import Grant
from fleetwire.relay import RelayTransport
from fleetwire.session import ClientSession
from protocol import Codec
from protocol.chunkview import DataChunkView, compact, own_frame, with_chunk_views
from protocol.messages import (
    DataChunk,
    DataCredit,
    DataEnd,
    DataOpen,
    FromClient,
    FromWorker,
    ToClient,
    ToWorker,
)
from protocol.relay import MAX_CHUNK_BYTES
from tests.unit.test_core import Harness
from tests.unit.test_relay_core import placed, put_open
from tests.unit.test_relay_worker import relay_endpoint, ticket
from worker_agent.outbox import encode_frames
from worker_agent.relay import READ_AHEAD_BYTES

CHUNK = bytes(range(256)) * (MAX_CHUNK_BYTES // 256)


class CountingCodec(Codec):
    """A codec that counts the frames it encoded."""

    encoded = 0

    def encode(self, msgs: Any) -> bytes:
        self.encoded += 1
        return super().encode(msgs)


def chunk(offset: int = 0, data: bytes = CHUNK, **fields: Any) -> DataChunk:
    return DataChunk(plan_id="p1", attempt=1, name="x", offset=offset, data=data, **fields)


def test_a_msgpack_chunk_decodes_as_a_view_into_its_frame() -> None:
    """A client's chunk decodes (msgpack) as a DataChunk whose data views the frame: no copy of the bytes."""
    frame = Codec("msgpack", FromClient, "client").encode([chunk()])
    (msg,) = Codec("msgpack", with_chunk_views(FromClient), "client").decode(frame)
    assert isinstance(msg, DataChunk) and type(msg) is DataChunkView
    assert type(msg.data) is memoryview and msg.data.obj is frame and msg.data == CHUNK
    assert own_frame(msg) is frame


def test_a_lone_relayed_chunk_is_sent_on_as_the_frame_it_came_in() -> None:
    """The coordinator's writer sends a chunk that came alone in its frame as that frame: nothing encoded."""
    frame = Codec("msgpack", FromClient, "client").encode([chunk(last=True)])
    (msg,) = Codec("msgpack", with_chunk_views(FromClient), "client").decode(frame)
    codec = CountingCodec("msgpack", ToWorker, "worker")
    session = Session(conn_id=1, ws=None, codec=codec)  # type: ignore[arg-type]
    assert session._frames([msg]) == [frame] and session._frames([msg])[0] is frame
    session.msg_bytes = float(MAX_CHUNK_BYTES)  # a session that carries chunks cuts a batch of them first
    assert [f is frame for f in session._frames([msg, msg])] == [True, True]
    assert codec.encoded == 0
    (back,) = Codec("msgpack", ToWorker, "worker").decode(frame)  # the worker reads what the client wrote
    assert (back.offset, back.data, back.last) == (msg.offset, CHUNK, True)


def test_a_workers_chunks_go_one_per_frame_and_pass_the_coordinator_unencoded() -> None:
    """The worker frames each relayed chunk alone, so the coordinator sends each frame on as it came."""
    batch = [chunk(i * MAX_CHUNK_BYTES, direction="get") for i in range(4)]
    frames = encode_frames(Codec("msgpack", FromWorker, "worker"), batch, 1 << 20)  # type: ignore[arg-type]
    assert [msgs for _, msgs in frames] == [[m] for m in batch]
    decoder = Codec("msgpack", with_chunk_views(FromWorker), "worker")
    codec = CountingCodec("msgpack", ToClient, "client")
    session = Session(conn_id=1, ws=None, codec=codec)  # type: ignore[arg-type]
    for frame, _ in frames:
        (msg,) = decoder.decode(frame)
        assert session._frames([msg])[0] is frame
    assert codec.encoded == 0


@pytest.mark.parametrize("case", ["shared frame", "json receiver", "bulky fields", "built here", "wide int",
                                  "duplicate key"])
def test_chunks_not_alone_or_not_canonical_are_encoded_again(case: str) -> None:
    """A chunk that shared its frame, goes to JSON, is not encoded as the relay would, or was built here: encoded."""
    decoder = Codec("msgpack", with_chunk_views(FromClient), "client")
    encoding: Any = "json" if case == "json receiver" else "msgpack"
    if case == "shared frame":
        msgs = decoder.decode(Codec("msgpack", FromClient, "client").encode([chunk(), DataCredit(
            plan_id="p1", attempt=1, name="x", direction="get", offset=0)]))
        msg = msgs[0]
    elif case == "bulky fields":
        raw = msgspec.msgpack.encode({**msgspec.structs.asdict(chunk()), "type": "data_chunk", "junk": "j" * 4096})
        (msg,) = decoder.decode(raw)
    elif case == "wide int":  # the attempt as an int32: the same value, other bytes
        canonical = Codec("msgpack", FromClient, "client").encode([chunk()])
        (msg,) = decoder.decode(canonical.replace(b"\xa7attempt\x01", b"\xa7attempt\xd2\x00\x00\x00\x01", 1))
    elif case == "duplicate key":  # a second plan_id after the data: decoders might differ on which counts
        canonical = Codec("msgpack", FromClient, "client").encode([chunk()])
        (msg,) = decoder.decode(bytes([canonical[0] + 1]) + canonical[1:] + b"\xa7plan_id\xa2p1")
    elif case == "built here":
        msg = DataChunkView(plan_id="p1", attempt=1, name="x", offset=0, data=memoryview(b"\x85" + CHUNK))
    else:
        (msg,) = decoder.decode(Codec("msgpack", FromClient, "client").encode([chunk()]))
    codec = CountingCodec(encoding, ToWorker, "worker")
    session = Session(conn_id=1, ws=None, codec=codec)  # type: ignore[arg-type]
    (frame,) = session._frames([msg])
    assert codec.encoded == 1
    (back,) = Codec(encoding, ToWorker, "worker").decode(frame.decode() if codec.text else frame)
    assert isinstance(back, DataChunk) and bytes(back.data) == bytes(msg.data) and back.offset == msg.offset
    assert not hasattr(back, "junk")


@pytest.fixture
async def endpoint(tmp_path: Path) -> Any:
    return relay_endpoint(tmp_path)


def open_upload(relay: Any, data: bytes, window: int) -> None:
    digest = f"sha256:{hashlib.sha256(data).hexdigest()}"
    relay.on_message(DataOpen(plan_id="p1", attempt=1, name="x", ticket=ticket("x", len(data), digest), credit=window))


async def test_worker_stores_relayed_chunks_off_its_reader_and_credits_after(endpoint: Any) -> None:
    """A file-backed input's chunk is queued by the reader and written and hashed in threads; its credit follows."""
    data = CHUNK * 3
    open_upload(endpoint, data, MAX_CHUNK_BYTES)  # a one-chunk window: a credit per chunk
    entry = endpoint.spool.input("p1", 1, "x")
    endpoint.sent.clear()
    endpoint.on_message(chunk(0))
    assert entry.received == 0 and endpoint.sent == [] and entry.busy  # not stored yet: not credited
    await endpoint.drained()
    assert entry.received == MAX_CHUNK_BYTES and [m.offset for m in endpoint.sent] == [MAX_CHUNK_BYTES]
    assert not entry.busy
    endpoint.on_message(chunk(MAX_CHUNK_BYTES))
    endpoint.on_message(chunk(2 * MAX_CHUNK_BYTES))
    await endpoint.drained()
    end = endpoint.sent[-1]
    assert isinstance(end, DataEnd) and end.code == "" and entry.state == "verified" and entry.via == "relay"
    assert entry.path.read_bytes() == data


async def test_a_relayed_upload_closed_while_storing_resumes_from_what_was_stored(endpoint: Any) -> None:
    """An upload ended with chunks still queued keeps what was stored, drops the rest, and resumes from there."""
    data = CHUNK * 8
    open_upload(endpoint, data, 8 * MAX_CHUNK_BYTES)
    entry = endpoint.spool.input("p1", 1, "x")
    for i in range(6):
        endpoint.on_message(chunk(i * MAX_CHUNK_BYTES))
    endpoint.on_message(DataEnd(plan_id="p1", attempt=1, name="x", code="cancelled"))
    await endpoint.drained()
    assert not entry.busy and entry.state == "receiving" and entry.received % MAX_CHUNK_BYTES == 0
    assert entry.received < len(data)
    endpoint.sent.clear()
    open_upload(endpoint, data, 8 * MAX_CHUNK_BYTES)
    (first,) = endpoint.sent
    assert isinstance(first, DataCredit) and first.offset == entry.received
    for offset in range(entry.received, len(data), MAX_CHUNK_BYTES):
        endpoint.on_message(chunk(offset))
    await endpoint.drained()
    assert endpoint.sent[-1].code == "" and entry.state == "verified"
    assert entry.path.read_bytes() == data


async def test_a_chunk_past_the_queued_offset_is_a_violation(endpoint: Any) -> None:
    """While chunks wait to be stored, the next must start where the queued ones end; a gap ends the stream."""
    open_upload(endpoint, CHUNK * 4, 4 * MAX_CHUNK_BYTES)
    endpoint.sent.clear()
    endpoint.on_message(chunk(0))
    endpoint.on_message(chunk(2 * MAX_CHUNK_BYTES))  # skips a chunk
    await endpoint.drained()
    ends = [m for m in endpoint.sent if isinstance(m, DataEnd)]
    assert [end.code for end in ends] == ["relay_violation"]
    assert "continues at 262144" in ends[0].message
    assert not endpoint.spool.input("p1", 1, "x").busy


async def test_an_output_is_read_ahead_a_little_at_a_time_within_its_window(endpoint: Any) -> None:
    """A wide window is not read whole into the send queue: READ_AHEAD_BYTES, then more as the writer sends."""
    data = CHUNK * (2 * READ_AHEAD_BYTES // MAX_CHUNK_BYTES + 2)
    endpoint.spool.add_output("p1", 1, "out", data)
    endpoint.on_message(DataOpen(plan_id="p1", attempt=1, name="out", direction="get", credit=64 << 20,
                                 ticket=ticket("out", -1, "", direction="get")))
    assert sum(len(m.data) for m in endpoint.sent) == READ_AHEAD_BYTES
    endpoint.resume()  # the agent's writer sent them
    assert sum(len(m.data) for m in endpoint.sent) == 2 * READ_AHEAD_BYTES
    endpoint.resume()
    assert b"".join(m.data for m in endpoint.sent) == data and endpoint.sent[-1].last
    endpoint.resume()  # nothing more: the stream ended with its last chunk
    assert b"".join(m.data for m in endpoint.sent) == data


async def test_an_attempt_dropped_while_its_chunks_are_stored_leaves_no_file(endpoint: Any) -> None:
    """The attempt ends while relayed chunks are written: the stream ends relay_closed and no file is left behind."""
    open_upload(endpoint, CHUNK * 4, 4 * MAX_CHUNK_BYTES)
    entry = endpoint.spool.input("p1", 1, "x")
    endpoint.sent.clear()
    endpoint.on_message(chunk(0))
    endpoint.on_message(chunk(MAX_CHUNK_BYTES))
    endpoint.spool.drop_inputs("p1", 1)
    await endpoint.drained()
    assert [m.code for m in endpoint.sent if isinstance(m, DataEnd)] == ["relay_closed"]
    assert not entry.path.exists() and not entry.busy


class Link:
    """The client session side of a RelayTransport: what it posts."""

    def __init__(self) -> None:
        self.posted: list[Any] = []
        self.opened = asyncio.Event()

    def post(self, msg: Any) -> None:
        self.posted.append(msg)
        if isinstance(msg, DataOpen):
            self.opened.set()


@pytest.mark.parametrize("to_file", [True, False])
async def test_a_relayed_download_writes_the_frames_views_and_yields_bytes(tmp_path: Path, to_file: bool) -> None:
    """The client decodes chunks as views: fetch_to writes them uncopied; download() still yields bytes."""
    session = ClientSession("msgpack")
    frames = [Codec("msgpack", ToClient, "client").encode([chunk(i * MAX_CHUNK_BYTES, direction="get",
                                                                 last=i == 2, size=3 * MAX_CHUNK_BYTES)])
              for i in range(3)]
    msgs = [session._codec.decode(frame)[0] for frame in frames]
    assert all(type(m.data) is memoryview for m in msgs)
    link = Link()
    relay = RelayTransport(link, stall_timeout_s=5)
    grant = Grant("p1", 1, "", "t", "g")
    received: list[Any] = []

    async def fetch() -> None:
        if to_file:
            await relay.fetch_to(grant, "x", tmp_path / "out")
            return
        async for data in relay.download(grant, "x"):
            received.append(data)

    task = asyncio.create_task(fetch())
    await asyncio.wait_for(link.opened.wait(), 5)
    for msg in msgs:
        relay.receive(msg)
    await asyncio.wait_for(task, 5)
    if to_file:
        assert (tmp_path / "out").read_bytes() == CHUNK * 3
    else:
        assert [type(data) for data in received] == [bytes] * 3 and b"".join(received) == CHUNK * 3


def test_a_chunk_sharing_a_bulky_frame_is_held_as_its_own_bytes() -> None:
    """A chunk whose frame carries other bulk is copied out, so a window of chunks never holds frames' worth more."""
    bulky = Codec("msgpack", FromClient, "client").encode([chunk(), DataEnd(plan_id="p2", attempt=1, name="y",
                                                                            message="m" * 600_000)])
    lone = Codec("msgpack", FromClient, "client").encode([chunk()])
    decoder = Codec("msgpack", with_chunk_views(FromClient), "client")
    held = compact(decoder.decode(bulky)[0])
    assert type(held.data) is bytes and held.data == CHUNK and held.offset == 0
    (alone,) = decoder.decode(lone)
    assert compact(alone) is alone  # its frame is the chunk: kept as the view


def test_the_relay_passes_a_lone_chunk_as_its_view_and_copies_one_from_a_bulky_frame() -> None:
    """Through the core: a chunk alone in its frame reaches the worker's outbox as the same view; one that
    shared a bulky frame reaches it as its own bytes."""
    h = Harness()
    client = h.client()
    worker, plan_id = placed(h, "w1", client)
    put_open(h, client, worker, plan_id)
    encoder = Codec("msgpack", FromClient, "client")
    decoder = Codec("msgpack", with_chunk_views(FromClient), "client")
    first = DataChunk(plan_id=plan_id, attempt=1, name="x", offset=0, data=CHUNK)
    (lone,) = decoder.decode(encoder.encode([first]))
    h.send(client, lone)
    (passed,) = [m for m in h.take(worker) if isinstance(m, DataChunk)]
    assert passed is lone and own_frame(passed) is not None
    second = DataChunk(plan_id=plan_id, attempt=1, name="x", offset=MAX_CHUNK_BYTES, data=CHUNK)
    bulk = DataEnd(plan_id="other", attempt=1, name="y", message="m" * 600_000)
    bulky = decoder.decode(encoder.encode([second, bulk]))
    h.send(client, bulky[0])
    (copied,) = [m for m in h.take(worker) if isinstance(m, DataChunk)]
    assert type(copied.data) is bytes and copied.data == CHUNK and copied.offset == MAX_CHUNK_BYTES
