"""The direct path's transfer threads and counters, over loopback sockets: file inputs by sendfile, resumes,
outputs straight to a file, progress reports, and the worker's and coordinator's data-plane counts."""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from coordinator.io.frontdoor.server import CoordinatorServer
from fleetwire import Client
from fleetwire.direct import DirectTransport
from fleetwire.inputs import PARALLEL_HASH_BYTES, prepare_inputs
from protocol.messages import Load
from tests.integration.data_helpers import (
    CLIENT_TOKEN,
    SIZE,
    coordinator_and_data_worker,
    data_endpoint,
    digest,
    grant,
    random_input,
)
from worker_agent.agent import Agent
from worker_agent.dataplane import BODY_CHUNK, DataServer

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
async def endpoint(tmp_path: Path) -> AsyncIterator[DataServer]:
    async with data_endpoint(tmp_path) as server:
        yield server


@pytest.fixture
def payload(tmp_path: Path) -> tuple[Path, bytes]:
    return random_input(tmp_path)


async def test_file_input_goes_whole_by_sendfile_and_is_counted(endpoint: DataServer,
                                                                 payload: tuple[Path, bytes]) -> None:
    """A file input spanning several chunks arrives whole and verified; progress reaches its size; bytes counted."""
    path, data = payload
    source = (await prepare_inputs({"x": path}))["x"]
    assert source.digest == digest(data)
    transport = DirectTransport()
    seen: list[int] = []
    transport.progress = lambda name, done, size: seen.append(done)
    try:
        await transport.upload(grant(endpoint.url, "x", SIZE, source.digest), source)
    finally:
        await transport.aclose()
    entry = endpoint.spool.input("p1", 1, "x")
    assert entry is not None and entry.state == "verified" and entry.received == SIZE
    assert entry.path is not None and entry.path.read_bytes() == data
    assert seen == sorted(seen) and seen[-1] == SIZE
    assert endpoint.count_into(Load()).data_bytes_in == SIZE


@pytest.mark.parametrize("size", [PARALLEL_HASH_BYTES - 1, PARALLEL_HASH_BYTES + 4097])
async def test_big_inputs_hashed_on_every_core_have_the_one_threaded_digest(tmp_path: Path, size: int) -> None:
    """A file mapped and hashed by blake3's threads, and a buffer hashed so, declare what one thread computes."""
    data = os.urandom(size)
    path = tmp_path / "big.bin"
    path.write_bytes(data)
    sources = await prepare_inputs({"file": path, "buffer": bytearray(data), "view": memoryview(data)[1:]})
    assert sources["file"].digest == sources["buffer"].digest == digest(data) and sources["file"].size == size
    assert sources["view"].digest == digest(data[1:]) and sources["view"].size == size - 1


def _peak_rss() -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) << 10 for line in status if line.startswith("VmHWM:"))


def _reset_peak_rss() -> None:
    """The peak (VmHWM) starts again from what is resident now."""
    try:
        with open("/proc/self/clear_refs", "w") as refs:
            refs.write("5")
    except OSError as exc:
        pytest.skip(f"cannot reset the peak RSS here: {exc}")


async def test_hashing_a_big_file_maps_one_window_at_a_time(tmp_path: Path) -> None:
    """The process's peak resident memory grows by about a window, not by the file (mapped pages count in RSS)."""
    path = tmp_path / "big.bin"
    await asyncio.to_thread(path.write_bytes, os.urandom(6 * PARALLEL_HASH_BYTES))
    _reset_peak_rss()
    before = _peak_rss()
    source = (await prepare_inputs({"big": path}))["big"]
    assert source.size == 6 * PARALLEL_HASH_BYTES
    assert _peak_rss() - before <= 2 * PARALLEL_HASH_BYTES  # a 96 MiB file: at most two windows' worth


async def test_upload_resumes_from_the_workers_offset(endpoint: DataServer, payload: tuple[Path, bytes]) -> None:
    """When the worker already holds part of an input, the SDK sends only the rest (Content-Range) and it verifies."""
    path, data = payload
    source = (await prepare_inputs({"x": path}))["x"]
    upload_grant = grant(endpoint.url, "x", SIZE, source.digest)
    entry = endpoint.spool.declare("p1", 1, "x", SIZE, source.digest)
    entry.write(data[:BODY_CHUNK + 7])  # what an earlier, dropped connection left
    entry.pause()
    transport = DirectTransport()
    try:
        await transport.upload(upload_grant, source)
    finally:
        await transport.aclose()
    assert entry.state == "verified"
    assert endpoint.bytes_in == SIZE - (BODY_CHUNK + 7)


async def test_cancelled_upload_ends_its_thread_and_keeps_what_arrived(endpoint: DataServer,
                                                                       tmp_path: Path) -> None:
    """Cancelling an upload mid-body shuts its socket: the transfer thread ends and the worker keeps the
    bytes it stored, to resume from."""
    big = tmp_path / "big.bin"
    await asyncio.to_thread(big.write_bytes, b"")
    await asyncio.to_thread(os.truncate, big, 64 << 20)  # sparse: 64 MiB of zeros, quick to make
    source = (await prepare_inputs({"x": big}))["x"]
    original = endpoint.spool.declare("p1", 1, "x", source.size, source.digest)
    loop = asyncio.get_running_loop()
    sent = asyncio.Event()
    transport = DirectTransport()

    def progressed(name: str, done: int, size: int) -> None:
        loop.call_soon_threadsafe(sent.set)

    transport.progress = progressed
    threads_before = {t.ident for t in threading.enumerate()}
    upload = asyncio.create_task(transport.upload(grant(endpoint.url, "x", source.size, source.digest), source))
    await asyncio.wait_for(sent.wait(), 10)  # a first chunk is on its way
    upload.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await upload
    await transport.aclose()
    for thread in threading.enumerate():
        if thread.ident not in threads_before and thread.name == "fleetwire-data":
            thread.join(5)
            assert not thread.is_alive()
    await endpoint.wait_no_uploads(5.0)  # the worker sees the connection close and stores what arrived
    assert endpoint.open_uploads == 0
    assert 0 < original.received < source.size and original.state == "receiving"


async def test_refusals_are_counted_by_status(endpoint: DataServer) -> None:
    """A request without a ticket is refused 401 and counted under "401" in the worker's load."""
    reader, writer = await asyncio.open_connection(endpoint.host, endpoint.port)
    writer.write(b"HEAD /v1/data/p1/1/inputs/x HTTP/1.1\r\nHost: h\r\n\r\n")
    await writer.drain()
    line = await asyncio.wait_for(reader.readline(), 5)
    writer.close()
    assert line.startswith(b"HTTP/1.1 401")
    assert endpoint.count_into(Load()).data_refused == {"401": 1}


# --------------------------------------------------------------------------- SDK <-> coordinator <-> agent


@pytest.fixture
async def cluster(tmp_path: Path) -> AsyncIterator[tuple[CoordinatorServer, Agent]]:
    async def mirror(ctx: Any, args: Any) -> int:
        source = ctx.inputs["data"]
        await asyncio.to_thread(ctx.output, "copy", source.path)
        return int(source.size)

    async with coordinator_and_data_worker(tmp_path, {"mirror": mirror}, input_timeout_s=10.0) as (server, agent):
        yield server, agent


async def test_file_in_file_out_through_the_sdk(cluster: tuple[CoordinatorServer, Agent], tmp_path: Path,
                                                payload: tuple[Path, bytes]) -> None:
    """A file input and its copy as an output written with output_to: same bytes; tickets and worker bytes counted."""
    server, agent = cluster
    path, data = payload
    async with Client(server.url, token=CLIENT_TOKEN) as client:
        plan = await client.submit("mirror", inputs={"data": path}, outputs=["copy"])
        assert await asyncio.wait_for(plan.result(), 30) == SIZE
        target = await plan.output_to("copy", tmp_path / "copy.bin")
    assert target.read_bytes() == data
    assert not (tmp_path / ".copy.bin.partial").exists()
    assert server.core.data.tickets_issued >= 2  # data_ready's put and get, and the output's fresh get
    assert agent.data_server is not None
    load = agent.data_server.count_into(Load())
    assert load.data_bytes_in == SIZE and load.data_bytes_out == SIZE
