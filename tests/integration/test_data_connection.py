"""The data endpoint's connection protocol (worker_agent/http_conn.py) over loopback sockets: a body read
straight into reused buffers never takes the next request's bytes, a slow upload that keeps sending is not
dropped, an oversized head is refused, and a body spanning several buffers arrives whole."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from protocol.messages import DataKey
from protocol.tickets import FileClaim, TicketClaims, sign, worker_key
from tests.integration.data_helpers import digest
from worker_agent.dataplane import BODY_CHUNK, MAX_HEAD_BYTES, DataServer
from worker_agent.spool import Spool

pytestmark = pytest.mark.timeout(60)

MASTER = b"c" * 32
WORKER = "w1"



def _ticket(name: str, data: bytes) -> str:
    claims = TicketClaims("p1", 1, WORKER, "put", {name: FileClaim(len(data), digest(data))}, time.time() + 60)
    return sign(claims, "k1", worker_key(MASTER, WORKER))


def _put(name: str, data: bytes, *, length: int | None = None) -> bytes:
    return (f"PUT /v1/data/p1/1/inputs/{name} HTTP/1.1\r\nHost: h\r\nAuthorization: Bearer {_ticket(name, data)}\r\n"
            f"Content-Length: {len(data) if length is None else length}\r\n\r\n").encode()


@pytest.fixture
async def endpoint(tmp_path: Path) -> AsyncIterator[DataServer]:
    server = DataServer(Spool(tmp_path / "spool", memory_bytes=1024), worker_id=WORKER, stall_timeout_s=0.5)
    server.set_keys([DataKey(kid="k1", key=worker_key(MASTER, WORKER))])
    await server.start()
    yield server
    await server.close()


async def _close(writer: asyncio.StreamWriter) -> None:
    writer.close()
    with contextlib.suppress(ConnectionError):
        await writer.wait_closed()


async def _answers(reader: asyncio.StreamReader, *methods: str) -> list[str]:
    """The status lines of the answers to requests of ``methods`` (bodies skipped; a HEAD's has none)."""
    statuses = []
    for method in methods:
        head = (await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)).decode("latin-1")
        statuses.append(head.split("\r\n", 1)[0])
        length = next((int(line.split(":", 1)[1]) for line in head.split("\r\n")
                       if line.lower().startswith("content-length:")), 0)
        await reader.readexactly(0 if method == "HEAD" else length)
    return statuses


async def test_pipelined_request_after_a_body_is_answered_not_swallowed(endpoint: DataServer) -> None:
    """A PUT and a HEAD sent in one write: the body takes exactly its length, the HEAD gets its own answer."""
    data = b"a" * 5000  # spooled to a file (over memory_bytes)
    head = (f"HEAD /v1/data/p1/1/inputs/x HTTP/1.1\r\nHost: h\r\nAuthorization: Bearer {_ticket('x', data)}\r\n"
            "\r\n").encode()
    reader, writer = await asyncio.open_connection(endpoint.host, endpoint.port)
    writer.write(_put("x", data) + data + head)
    await writer.drain()
    assert await _answers(reader, "PUT", "HEAD") == ["HTTP/1.1 201 Created", "HTTP/1.1 200 OK"]
    entry = endpoint.spool.input("p1", 1, "x")
    assert entry is not None and entry.state == "verified" and entry.received == len(data)
    await _close(writer)


async def test_slow_upload_that_keeps_sending_outlives_the_stall_timeout(endpoint: DataServer) -> None:
    """1 KiB every 0.1 s for 1.6 s (stall timeout 0.5 s, all within one body buffer): verified, not dropped."""
    data = bytes(range(256)) * 64  # 16 KiB
    reader, writer = await asyncio.open_connection(endpoint.host, endpoint.port)
    writer.write(_put("slow", data))
    for start in range(0, len(data), 1024):
        writer.write(data[start : start + 1024])
        await writer.drain()
        await asyncio.sleep(0.1)
    assert await _answers(reader, "PUT") == ["HTTP/1.1 201 Created"]
    entry = endpoint.spool.input("p1", 1, "slow")
    assert entry is not None and entry.state == "verified"
    await _close(writer)


async def test_body_over_several_buffers_arrives_whole_with_its_digest(endpoint: DataServer) -> None:
    """A body of 2.5 buffers, sent in odd-sized writes, is stored in order: the digest matches."""
    data = hashlib.sha256(b"seed").digest() * ((5 * BODY_CHUNK // 2) // 32)
    reader, writer = await asyncio.open_connection(endpoint.host, endpoint.port)
    writer.write(_put("big", data) + data[:777])
    for start in range(777, len(data), 300_001):
        writer.write(data[start : start + 300_001])
        await writer.drain()
    assert await _answers(reader, "PUT") == ["HTTP/1.1 201 Created"]
    entry = endpoint.spool.input("p1", 1, "big")
    assert entry is not None and entry.state == "verified" and entry.path is not None
    assert hashlib.sha256(entry.path.read_bytes()).digest() == hashlib.sha256(data).digest()
    await _close(writer)


async def test_oversized_head_is_refused_431(endpoint: DataServer) -> None:
    """A head with no blank line within the limit is answered 431 and the connection closed."""
    reader, writer = await asyncio.open_connection(endpoint.host, endpoint.port)
    writer.write(b"PUT /v1/data/p1/1/inputs/x HTTP/1.1\r\nX-Pad: " + b"p" * (MAX_HEAD_BYTES + 1024))
    await writer.drain()
    answer = await asyncio.wait_for(reader.read(), 10)
    assert answer.startswith(b"HTTP/1.1 431 ")
    await _close(writer)
