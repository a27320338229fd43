"""The direct path's fixed cost per transfer, over loopback sockets: round trips per upload (``Expect:
100-continue`` instead of a ``HEAD`` first), answers from the head before any body byte, a server that
ignores ``Expect``, and big spool files unlinked off the worker's event loop."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

import fleetwire.direct
from fleetwire.data import DataTransferError, Grant
from fleetwire.direct import DirectTransport
from fleetwire.inputs import prepare_inputs
from protocol.tickets import FileClaim, TicketClaims, sign, worker_key
from tests.integration.data_helpers import MASTER, SIZE, WORKER, data_endpoint, digest, grant, random_input
from worker_agent.dataplane import BODY_CHUNK, DataServer
from worker_agent.spool_files import UNLINK_AWAY_BYTES, remove_file

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
async def endpoint(tmp_path: Path) -> AsyncIterator[DataServer]:
    async with data_endpoint(tmp_path) as server:
        yield server


@pytest.fixture
def payload(tmp_path: Path) -> tuple[Path, bytes]:
    return random_input(tmp_path)


async def _upload(url: str, path: Path, key: bytes = MASTER) -> None:
    source = (await prepare_inputs({"x": path}))["x"]
    transport = DirectTransport(stall_timeout_s=5.0)
    try:
        await transport.upload(grant(url, "x", source.size, source.digest, key=key), source)
    finally:
        await transport.aclose()


async def test_a_fresh_upload_is_one_put_and_no_head(endpoint: DataServer, payload: tuple[Path, bytes]) -> None:
    """A first upload asks nothing first: one PUT (Expect: 100-continue), no HEAD, and the input is verified."""
    path, data = payload
    await _upload(endpoint.url, path)
    entry = endpoint.spool.input("p1", 1, "x")
    assert entry is not None and entry.state == "verified"
    assert entry.path is not None and entry.path.read_bytes() == data
    assert dict(endpoint.requests) == {"PUT": 1}


async def test_a_resumed_upload_learns_its_offset_before_sending_any_body(endpoint: DataServer,
                                                                          payload: tuple[Path, bytes]) -> None:
    """The worker already holds a part: the first PUT is answered 409 from its head, then only the rest is sent."""
    path, data = payload
    entry = endpoint.spool.declare("p1", 1, "x", SIZE, digest(data))
    entry.write(data[:BODY_CHUNK])
    entry.pause()
    await _upload(endpoint.url, path)
    assert entry.state == "verified" and entry.path is not None and entry.path.read_bytes() == data
    assert endpoint.bytes_in == SIZE - BODY_CHUNK  # the refused PUT's body was never sent
    assert endpoint.refused[409] == 1 and dict(endpoint.requests) == {"PUT": 2, "HEAD": 1}


async def test_a_forged_ticket_is_refused_before_any_body(endpoint: DataServer, payload: tuple[Path, bytes]) -> None:
    """A ticket signed with another key: the PUT fails 401 from its head and no body byte reaches the worker."""
    path, _ = payload
    with pytest.raises(DataTransferError) as caught:
        await _upload(endpoint.url, path, key=b"g" * 32)
    assert caught.value.status == 401
    assert endpoint.bytes_in == 0 and dict(endpoint.requests) == {"PUT": 1}


async def test_a_server_that_ignores_expect_still_gets_the_body(payload: tuple[Path, bytes],
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """No "100 Continue" comes (a server or proxy that ignores Expect): the body goes after a short wait."""
    path, data = payload
    monkeypatch.setattr(fleetwire.direct, "CONTINUE_WAIT_S", 0.05)
    received: list[bytes] = []

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                      if line.lower().startswith(b"content-length:"))
        received.append(await reader.readexactly(length))
        writer.write(b"HTTP/1.1 201 Created\r\nContent-Length: 2\r\n\r\n{}")
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    async with server:
        port = server.sockets[0].getsockname()[1]
        await _upload(f"http://127.0.0.1:{port}", path)
    assert received == [data]


async def test_a_big_spool_file_is_unlinked_in_a_thread(tmp_path: Path) -> None:
    """On the event loop a spool file of UNLINK_AWAY_BYTES or more goes in a thread; a small one at once."""
    big, small = tmp_path / "big", tmp_path / "small"
    big.write_bytes(b"\0" * UNLINK_AWAY_BYTES)
    small.write_bytes(b"\0" * 1024)
    assert remove_file(small, 1024) is None and not small.exists()
    away = remove_file(big, UNLINK_AWAY_BYTES)
    assert away is not None
    await away
    assert not big.exists()


def test_without_a_running_loop_a_big_spool_file_goes_at_once(tmp_path: Path) -> None:
    """No event loop (a worker shutting down, a tool): even a big file is unlinked before remove_file returns."""
    big = tmp_path / "big"
    big.write_bytes(b"\0" * UNLINK_AWAY_BYTES)
    assert remove_file(big, UNLINK_AWAY_BYTES) is None and not big.exists()


async def test_transfers_to_one_worker_share_a_keep_alive_connection(endpoint: DataServer, tmp_path: Path,
                                                                      payload: tuple[Path, bytes]) -> None:
    """Two uploads and a download to the same endpoint, one after another: one connection, reused."""
    path, data = payload
    other = tmp_path / "other.bin"
    other.write_bytes(data[::-1])
    endpoint.spool.add_output("p1", 1, "out", data)
    transport = DirectTransport(stall_timeout_s=5.0)
    try:
        for name, file in (("x", path), ("y", other)):
            source = (await prepare_inputs({name: file}))[name]
            claims = TicketClaims("p1", 1, WORKER, "put", {name: FileClaim(SIZE, source.digest)}, time.time() + 60)
            ticket = sign(claims, "k1", worker_key(MASTER, WORKER))
            await transport.upload(Grant("p1", 1, endpoint.url, ticket, ticket), source)
        target = await transport.download_to(grant(endpoint.url, "out", -1, "", "get"), "out", tmp_path / "out.bin")
    finally:
        await transport.aclose()
    assert target.read_bytes() == data
    assert endpoint.connections == 1 and dict(endpoint.requests) == {"PUT": 2, "GET": 1}


async def test_a_connection_the_server_closed_while_idle_is_not_reused(payload: tuple[Path, bytes]) -> None:
    """A server that closes each connection after answering (without saying so): the next upload dials again."""
    path, data = payload
    received: list[bytes] = []
    closed: list[asyncio.Future[None]] = []

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                      if line.lower().startswith(b"content-length:"))
        writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        received.append(await reader.readexactly(length))
        writer.write(b"HTTP/1.1 201 Created\r\nContent-Length: 2\r\n\r\n{}")
        await writer.drain()
        writer.close()
        await writer.wait_closed()
        closed[len(received) - 1].set_result(None)

    loop = asyncio.get_running_loop()
    closed.extend(loop.create_future() for _ in range(2))
    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    async with server:
        url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
        source = (await prepare_inputs({"x": path}))["x"]
        transport = DirectTransport(stall_timeout_s=5.0)
        try:
            await transport.upload(grant(url, "x", source.size, source.digest), source)
            await asyncio.wait_for(closed[0], 5)
            await transport.upload(grant(url, "x", source.size, source.digest), source)
        finally:
            await transport.aclose()
    assert received == [data, data]


async def test_several_big_inputs_are_hashed_at_once_and_keep_their_order(tmp_path: Path) -> None:
    """Files, a big buffer and a small one: each gets its own size and digest, in the order given."""
    first, second = os.urandom(3 << 20), os.urandom(2 << 20)
    (tmp_path / "a").write_bytes(first)
    (tmp_path / "b").write_bytes(second)
    sources = await prepare_inputs({"b": tmp_path / "b", "small": b"tiny", "a": tmp_path / "a", "buf": second})
    assert list(sources) == ["b", "small", "a", "buf"]
    assert [(s.size, s.digest) for s in sources.values()] == [
        (len(second), digest(second)), (4, digest(b"tiny")), (len(first), digest(first)),
        (len(second), digest(second)),
    ]


async def test_one_bad_input_among_big_ones_fails_the_whole_preparation(tmp_path: Path) -> None:
    """A value of the wrong type beside big inputs: TypeError naming it, once every other pass has ended."""
    (tmp_path / "a").write_bytes(os.urandom(2 << 20))
    with pytest.raises(TypeError, match="input 'bad' must be bytes"):
        await prepare_inputs({"a": tmp_path / "a", "bad": 12345})  # type: ignore[dict-item]
