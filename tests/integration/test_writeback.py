"""Write-behind (wireio/writeback.py) on real files: the bytes are intact and a big file does not stay in
the page cache, alone and on the direct path (an upload's spool file, a download's target)."""

from __future__ import annotations

import asyncio
import ctypes
import hashlib
import mmap
import os
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from fleetwire.data import OutputCheck
from fleetwire.direct import DirectTransport
from fleetwire.inputs import prepare_inputs
from tests.integration.data_helpers import data_endpoint, digest, grant
from wireio.chunkwrite import STAGE_BYTES, ChunkWriter
from wireio.writeback import DIRECT_ALIGN, WriteBehind
from worker_agent.dataplane import DataServer
from worker_agent.spool_files import InputFile

pytestmark = pytest.mark.timeout(60)

MASTER = b"w" * 32
WORKER = "w1"
BIG = 64 << 20  # well past what write-behind leaves cached (LAG + 2 windows)
PAGE = os.sysconf("SC_PAGE_SIZE")


def _resident(path: Path) -> int:
    """Bytes of the file now in the page cache (mincore on a mapping that touches nothing)."""
    size = path.stat().st_size
    libc = ctypes.CDLL(None, use_errno=True)
    with open(path, "rb") as file, mmap.mmap(file.fileno(), size, access=mmap.ACCESS_COPY) as mapping:
        pages = (size + PAGE - 1) // PAGE
        vector = (ctypes.c_ubyte * pages)()
        anchor = ctypes.c_char.from_buffer(mapping)
        try:
            if libc.mincore(ctypes.c_void_p(ctypes.addressof(anchor)), ctypes.c_size_t(size), vector) != 0:
                pytest.skip(f"mincore failed: {os.strerror(ctypes.get_errno())}")
        finally:
            del anchor
        return sum(1 for flag in vector if flag & 1) * PAGE


def _on_tmpfs(path: Path) -> bool:
    best, kind = "", ""
    with open("/proc/mounts") as mounts:
        for line in mounts:
            fields = line.split()
            point = fields[1]
            if str(path).startswith(point.rstrip("/") + "/") and len(point) > len(best):
                best, kind = point, fields[2]
    return kind in ("tmpfs", "ramfs")


@pytest.fixture
def cached_dir(tmp_path: Path) -> Path:
    """A directory on a disk file system with write-behind available (else the test is skipped)."""
    if not os.path.exists("/proc/mounts") or _on_tmpfs(tmp_path):
        pytest.skip("needs a disk-backed file system (the page cache is the file's only home on tmpfs)")
    probe = tmp_path / "probe"
    with open(probe, "wb") as file:
        if not WriteBehind(file.fileno()).active:
            pytest.skip("no sync_file_range here")
    probe.unlink()
    return tmp_path


def _write(path: Path, data: bytes, chunk: int, behind: bool) -> None:
    with open(path, "wb") as file:
        pacer = WriteBehind(file.fileno(), window=4 << 20, lag=1) if behind else None
        for start in range(0, len(data), chunk):
            file.write(data[start : start + chunk])
            if pacer is not None:
                pacer.wrote(min(len(data), start + chunk))


def test_bytes_are_intact_and_the_file_leaves_the_page_cache(cached_dir: Path) -> None:
    """A file written through WriteBehind reads back whole, and at most a few windows of it stay cached."""
    data = os.urandom(BIG)
    control = cached_dir / "control.bin"
    _write(control, data, 1 << 20, behind=False)
    if _resident(control) < BIG // 2:
        pytest.skip("this machine's page cache does not keep a freshly written file (memory pressure)")
    paced = cached_dir / "paced.bin"
    _write(paced, data, 3 << 20, behind=True)  # windows and chunks not aligned
    assert _resident(paced) <= 16 << 20
    assert hashlib.sha256(paced.read_bytes()).digest() == hashlib.sha256(data).digest()


def test_a_pipe_is_written_as_is(tmp_path: Path) -> None:
    """A descriptor without writeback (a pipe) makes WriteBehind a no-op, not an error."""
    read_end, write_end = os.pipe()
    try:
        pacer = WriteBehind(write_end, window=4)
        for n in range(1, 4):
            os.write(write_end, b"abcd")
            pacer.wrote(4 * n)
        assert not pacer.active
        assert os.read(read_end, 64) == b"abcd" * 3
    finally:
        os.close(read_end)
        os.close(write_end)


@pytest.fixture
async def endpoint(cached_dir: Path) -> AsyncIterator[DataServer]:
    async with data_endpoint(cached_dir, stall_timeout_s=5.0) as server:
        yield server


async def test_a_direct_upload_and_download_leave_little_in_the_page_cache(endpoint: DataServer,
                                                                           cached_dir: Path) -> None:
    """The worker's spool file of a 64 MiB upload and the client's file of its download are mostly not cached."""
    data = os.urandom(BIG)
    source_path = cached_dir / "input.bin"
    source_path.write_bytes(data)
    source = (await prepare_inputs({"in": source_path}))["in"]
    transport = DirectTransport()
    try:
        await transport.upload(grant(endpoint.url, "in", BIG, source.digest, "put"), source)
        entry = endpoint.spool.input("p1", 1, "in")
        assert entry is not None and entry.state == "verified" and entry.path is not None
        assert _resident(entry.path) <= 48 << 20
        output = endpoint.spool.add_output("p1", 1, "out", source_path)
        target = cached_dir / "out.bin"
        fetch = grant(endpoint.url, "out", BIG, output.digest, "get")
        await transport.download_to(fetch, "out", target, OutputCheck("out", output.digest))
        assert _resident(target) <= 48 << 20
        assert hashlib.sha256(target.read_bytes()).digest() == hashlib.sha256(data).digest()
    finally:
        await transport.aclose()


async def test_a_relayed_download_goes_to_disk_by_o_direct_through_an_aligned_stage(cached_dir: Path) -> None:
    """ChunkWriter(direct_io=True): chunks of any size are staged and written with O_DIRECT a stage at a time,
    the unaligned tail through the page cache; the file is whole, hashed as written, and mostly not cached."""
    try:
        os.close(os.open(cached_dir / "probe", os.O_WRONLY | os.O_CREAT | os.O_DIRECT))
    except OSError as exc:
        pytest.skip(f"this file system refuses O_DIRECT ({exc.strerror}): the writer writes buffered there")
    data = os.urandom(3 * STAGE_BYTES + 5 * 4096 + 123)
    view = memoryview(data)
    check = OutputCheck("out", digest(data))
    target = cached_dir / "out.bin"
    with await asyncio.to_thread(open, target, "wb") as file:
        writer = ChunkWriter(file, check, direct_io=True)
        pos, sizes = 0, [1, 262_144, 100_000, 3 << 20, 77]
        while pos < len(data):
            batch = []
            for size in sizes:
                batch.append(view[pos : pos + size])
                pos += size
            await writer.put([chunk for chunk in batch if chunk.nbytes])
        await writer.finish()
    check.verify()
    assert _resident(target) <= 64 << 10  # the O_DIRECT pages never entered the page cache (read below)
    assert writer.direct_bytes == 3 * STAGE_BYTES + 5 * 4096  # all but the last 123 bytes
    assert target.read_bytes() == data


def _page_aligned(size: int) -> memoryview:
    return memoryview(mmap.mmap(-1, size))


def test_aligned_chunks_go_by_o_direct_the_rest_buffered_and_the_file_is_whole(cached_dir: Path) -> None:
    """Page-aligned whole-page chunks skip the page cache; a chunk from an unaligned buffer, one at an odd
    offset and a short tail are written buffered in between; the file reads back as what was put."""
    try:
        os.close(os.open(cached_dir / "probe", os.O_WRONLY | os.O_CREAT | os.O_DIRECT))
    except OSError as exc:
        pytest.skip(f"this file system refuses O_DIRECT ({exc.strerror}): the spool writes buffered there")
    data = os.urandom(BIG + 12345)
    entry = InputFile("in", len(data), "", cached_dir / "in.bin")
    odd = (4 << 20) - 100
    pieces = [4 << 20, 4 << 20, 100, odd, 8 << 20]  # aligned, aligned, short, at an odd offset, aligned
    pieces.append(len(data) - sum(pieces))  # the rest, not a whole number of pages: buffered
    direct = 0
    for size in pieces:
        start = entry.received
        if size == odd:  # a chunk in an unaligned buffer (a bytes object) at an odd offset
            chunk: memoryview = memoryview(data[start : start + size])
        else:
            chunk = _page_aligned(size)
            chunk[:] = data[start : start + size]
            if start % DIRECT_ALIGN == 0 and size % DIRECT_ALIGN == 0:
                direct += size
        entry.put(chunk, write_behind=True, direct_io=True)
        entry.advance(size)
    entry.pause()
    assert entry.path is not None and entry.path.stat().st_size == len(data)
    assert hashlib.sha256(entry.path.read_bytes()).digest() == hashlib.sha256(data).digest()
    assert entry.direct_bytes == direct == (16 << 20)  # the first two chunks and the 8 MiB at offset 12 MiB
