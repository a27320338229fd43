"""The client's side of a relayed transfer: an upload read straight into reusable frames (fleetwire/chunkread.py),
a download written and hashed by two threads (wireio/chunkwrite.py); bounded, failing cleanly."""

from __future__ import annotations

import asyncio
import concurrent.futures
import hashlib
import os
import threading
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import msgspec
import pytest

from fleetwire.chunkread import GROUP
from fleetwire.data import DataTransferError, Grant, OutputCheck, OutputMismatch, write_chunks
from fleetwire.inputs import InputSource
from fleetwire.relay import RelayTransport
from fleetwire.session import ClientSession
from protocol import Codec
from protocol.chunkview import frame_into
from protocol.messages import DataChunk, DataCredit, DataEnd, FromClient, ListWorkers
from protocol.relay import MAX_CHUNK_BYTES
from wireio.chunkwrite import ChunkWriter

DATA = bytes(range(256)) * (3 * (1 << 20) // 256)  # 3 MiB: 12 relayed chunks, 3 batches (fewer than WRITES_AHEAD)
DIGEST = "sha256:" + hashlib.sha256(DATA).hexdigest()


async def relayed(data: bytes = DATA) -> AsyncIterator[bytes]:
    view = memoryview(data)
    for start in range(0, len(data), MAX_CHUNK_BYTES):
        yield view[start : start + MAX_CHUNK_BYTES]  # type: ignore[misc]  # as a msgpack session decodes them


class Gate:
    """A hasher that waits for ``gate`` before each update and tells ``hashed`` once it saw ``total`` bytes."""

    def __init__(self, total: int = len(DATA)) -> None:
        self.gate = threading.Event()
        self.hashed = threading.Event()
        self.total = total
        self.seen = 0

    def update(self, data: bytes | bytearray | memoryview) -> None:
        assert self.gate.wait(10)
        self.seen += len(data)
        if self.seen >= self.total:
            self.hashed.set()


async def test_a_relayed_download_is_hashed_while_its_writes_wait_for_the_disk(tmp_path: Path) -> None:
    """write_chunks hashes the chunks while the file's writes are held up (separate threads), and the file is whole."""
    hashed = threading.Event()

    class Check(OutputCheck):
        seen = 0

        def update(self, data: bytes | bytearray | memoryview) -> None:
            super().update(data)
            self.seen += len(data)
            if self.seen == len(DATA):
                hashed.set()

    os.mkfifo(tmp_path / ".out.partial")  # the download's temporary file: its writes block until read
    drained: list[bytes] = []
    hashed_before_read: list[bool] = []

    def drain() -> None:
        with open(tmp_path / ".out.partial", "rb") as fifo:
            hashed_before_read.append(hashed.wait(5))  # one thread for both: the hash waits behind the write
            drained.append(fifo.read())

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    await write_chunks(relayed(), tmp_path / "out", Check("out", DIGEST))
    await asyncio.to_thread(reader.join, 10)
    assert hashed_before_read == [True]
    assert drained == [DATA]


async def test_a_relayed_download_that_does_not_match_its_digest_leaves_no_file(tmp_path: Path) -> None:
    """Bytes with another digest than the worker reported: OutputMismatch, neither the file nor its partial is left."""
    wrong = "sha256:" + hashlib.sha256(b"other").hexdigest()
    with pytest.raises(OutputMismatch, match="'out'"):
        await write_chunks(relayed(), tmp_path / "out", OutputCheck("out", wrong))
    assert await asyncio.to_thread(lambda: sorted(tmp_path.iterdir())) == []


async def test_chunk_writer_holds_at_most_ahead_batches_under_way(tmp_path: Path) -> None:
    """put waits while `ahead` batches are not yet hashed: a slow hash bounds what the download holds in memory."""
    check = Gate(total=3 * MAX_CHUNK_BYTES)
    with open(tmp_path / "out", "wb") as file:  # noqa: ASYNC230  (a local file, opened once)
        writer = ChunkWriter(file, check, ahead=2)
        try:
            batch = [memoryview(DATA)[:MAX_CHUNK_BYTES]]
            await writer.put(batch)
            await writer.put(batch)
            third = asyncio.create_task(writer.put(batch))
            for _ in range(5):  # a put that did not wait would be done after a turn or two of the loop
                await asyncio.sleep(0)
            assert not third.done()
            check.gate.set()
            await asyncio.wait_for(third, 10)
            await writer.finish()
        finally:
            writer.close()
    assert check.hashed.is_set()
    assert (tmp_path / "out").read_bytes() == DATA[:MAX_CHUNK_BYTES] * 3


async def test_chunk_writer_raises_a_failed_write_and_stops(tmp_path: Path) -> None:
    """A write that fails (here: a file open for reading) is raised by finish; the threads end."""
    (tmp_path / "out").write_bytes(b"")
    with open(tmp_path / "out", "rb") as file:  # noqa: ASYNC230  (a local file, opened once)
        writer = ChunkWriter(file, OutputCheck("out", DIGEST))  # type: ignore[arg-type]
        try:
            await writer.put([b"x" * 10])
            with pytest.raises(OSError):
                await writer.finish()
        finally:
            writer.close()
    assert not [t for t in threading.enumerate() if t.name.startswith("fleetwire-output-")]


class FrameLink:
    """A msgpack client link: takes frames; decodes each at once (its buffer is reused once acknowledged)."""

    encoding = "msgpack"

    def __init__(self) -> None:
        self.codec = Codec("msgpack", FromClient, "client")
        self.chunks: list[DataChunk] = []
        self.buffers: list[int] = []  # id of each frame's buffer, in order
        self.posted: list[Any] = []
        self.framed = asyncio.Event()

    def post(self, msg: Any) -> None:
        self.posted.append(msg)

    def post_frame(self, frame: memoryview) -> None:
        (msg,) = self.codec.decode(bytes(frame))
        self.chunks.append(msg)
        self.buffers.append(id(frame.obj))
        self.framed.set()


@pytest.mark.parametrize("kind", ["file", "memory"])
async def test_a_relayed_upload_reads_into_frames_and_reuses_a_buffer_only_once_acknowledged(
        tmp_path: Path, kind: str) -> None:
    """A msgpack upload posts frames (no encode), in order within credit; a buffer comes back only after its ack."""
    data = bytes(range(256)) * (9 * MAX_CHUNK_BYTES // 256 + 7)
    path = tmp_path / "in.bin"
    path.write_bytes(data)
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    source = (InputSource("x", len(data), digest, path=path) if kind == "file"
              else InputSource("x", len(data), digest, data=memoryview(data)))
    link = FrameLink()
    relay = RelayTransport(link, stall_timeout_s=5)
    window = 4 * MAX_CHUNK_BYTES
    task = asyncio.create_task(relay.upload(Grant("p", 1, "", "t"), source))
    await asyncio.sleep(0)
    relay.receive(DataCredit(plan_id="p", attempt=1, name="x", offset=0, credit=window, size=len(data)))
    got, acked, seen = bytearray(), 0, 0
    unacked: dict[int, int] = {}  # buffer id -> end of its frame
    while len(got) < len(data):
        while len(link.chunks) == seen:  # the reader thread fills frames: wait for the next one
            link.framed.clear()
            await asyncio.wait_for(link.framed.wait(), 5)
        while seen < len(link.chunks):
            msg, buffer = link.chunks[seen], link.buffers[seen]
            seen += 1
            assert buffer not in unacked, "a buffer was reused before its frame was acknowledged"
            assert msg.offset == len(got) and 0 < len(msg.data) <= MAX_CHUNK_BYTES
            got += msg.data
            unacked[buffer] = len(got)
            assert len(got) - acked <= window
            assert msg.last == (len(got) == len(data))
        acked = len(got) - MAX_CHUNK_BYTES if len(got) < len(data) else len(got)  # the receiver lags a chunk
        unacked = {buffer: end for buffer, end in unacked.items() if end > acked}
        relay.receive(DataCredit(plan_id="p", attempt=1, name="x", offset=acked, credit=window))
    relay.receive(DataEnd(plan_id="p", attempt=1, name="x", offset=len(data)))
    await asyncio.wait_for(task, 5)
    assert bytes(got) == data
    assert not [m for m in link.posted if isinstance(m, DataChunk)]  # every chunk went as a frame
    assert len(set(link.buffers)) <= window // MAX_CHUNK_BYTES + GROUP + 1 < len(link.buffers)  # bounded, reused


async def test_a_relayed_upload_of_a_file_that_shrank_fails_naming_the_input(tmp_path: Path) -> None:
    """A file shorter than its declared size: the upload fails with an error that names the input."""
    path = tmp_path / "in.bin"
    path.write_bytes(b"a" * 1000)
    source = InputSource("x", 5000, "sha256:" + "0" * 64, path=path)
    link = FrameLink()
    relay = RelayTransport(link, stall_timeout_s=5)
    task = asyncio.create_task(relay.upload(Grant("p", 1, "", "t"), source))
    await asyncio.sleep(0)
    relay.receive(DataCredit(plan_id="p", attempt=1, name="x", offset=0, credit=4 * MAX_CHUNK_BYTES, size=5000))
    with pytest.raises(DataTransferError, match=r"'x'.*shrank"):
        await asyncio.wait_for(task, 5)


def test_a_frame_laid_out_around_its_data_is_the_chunk_encoded() -> None:
    """frame_into gives byte for byte the chunk's encoding, whatever the offset's width and last flag."""
    for offset, size, last in [(0, MAX_CHUNK_BYTES, False), (5 << 30, 100, True), (70000, 1, True)]:
        msg = DataChunk(plan_id="p" * 40, attempt=3, name="n" * 255, offset=offset, direction="put", last=last)
        frame, view = frame_into(bytearray(size + 1024), msg, size)
        view[:] = bytes(range(256)) * (size // 256) + bytes(size % 256)
        assert bytes(frame) == msgspec.msgpack.encode(msgspec.structs.replace(msg, data=bytes(view)))
    with pytest.raises(ValueError, match="does not fit"):
        frame_into(bytearray(10), msg, 100)


def test_a_posted_frame_goes_out_as_is_and_coalesces_with_requests() -> None:
    """A lone posted frame is the next frame itself (no copy); queued with a request, both go in one array."""
    session = ClientSession("msgpack")
    frame = memoryview(msgspec.msgpack.encode(DataChunk(plan_id="p", attempt=1, name="x", offset=0, data=b"z" * 9)))
    session.post_frame(frame)
    assert session.next_frame() is frame and session.next_frame() is None
    session.post_frame(frame)
    session.send_request(1, ListWorkers, session.encode(ListWorkers(req_id=1)), ListWorkers,
                         concurrent.futures.Future())
    batch = session.next_frame()
    assert batch is not None and session.next_frame() is None
    msgs = Codec("msgpack", FromClient, "client").decode(bytes(batch))
    assert [type(m) for m in msgs] == [DataChunk, ListWorkers] and msgs[0].data == b"z" * 9


async def test_a_relayed_upload_uses_a_window_that_grew_without_waiting_for_acks(tmp_path: Path) -> None:
    """When the credit's window grows mid-stream, the reader may fill that many more frames before any ack."""
    data = bytes(range(256)) * (12 * MAX_CHUNK_BYTES // 256)
    path = tmp_path / "in.bin"
    path.write_bytes(data)
    link = FrameLink()
    relay = RelayTransport(link, stall_timeout_s=5)
    task = asyncio.create_task(relay.upload(Grant("p", 1, "", "t"), InputSource("x", len(data), "sha256:", path=path)))
    await asyncio.sleep(0)
    relay.receive(DataCredit(plan_id="p", attempt=1, name="x", offset=0, credit=MAX_CHUNK_BYTES, size=len(data)))
    await asyncio.wait_for(link.framed.wait(), 5)  # the one chunk the first window allows
    relay.receive(DataCredit(plan_id="p", attempt=1, name="x", offset=0, credit=len(data)))  # no byte acked yet
    while len(link.chunks) < 12:
        link.framed.clear()
        await asyncio.wait_for(link.framed.wait(), 5)
    assert b"".join(msg.data for msg in link.chunks) == data
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
