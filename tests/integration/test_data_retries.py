"""What the SDK does on its own when a transfer breaks in ways the worker's copy survives (issue #25 part 6): one byte
damaged in transit is sent again (upload) or fetched again (download) instead of failing the plan or the download;
a ticket whose key is gone (a coordinator restart) is replaced by a fresh one and the transfer goes on from the byte
it reached; a relayed download goes on across a real coordinator restart (loopback sockets, a tampering TCP proxy
between the SDK and the worker's data endpoint; a real coordinator and agent in this process for the relay)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest

from coordinator.core import CoreConfig
from coordinator.io.frontdoor.server import CoordinatorServer, ServerSettings
from fleetwire import Client
from fleetwire.data import Grant, OutputCheck
from fleetwire.direct import DirectTransport, fetch_to
from fleetwire.inputs import prepare_inputs
from protocol.messages import DataKey
from protocol.tickets import FileClaim, TicketClaims, sign, worker_key
from tests.integration.data_helpers import MASTER, WORKER, data_endpoint, digest, grant
from worker_agent.agent import Agent
from worker_agent.dataplane import DataServer

pytestmark = pytest.mark.timeout(60)

SIZE = 3 << 20


class Tamper:
    """A TCP proxy to a data endpoint that, once, flips one body byte (``flip_at``) of the first request (``up``) or
    answer (``down``) that has a body, or cuts every connection ``cut_at`` bytes into an answer's body (``on_cut``
    runs first)."""

    def __init__(self, port: int, direction: str, *, flip_at: int | None = None, cut_at: int | None = None,
                 on_cut: Callable[[], None] | None = None) -> None:
        self.port = port
        self.direction = direction
        self.flip_at = flip_at
        self.cut_at = cut_at
        self.on_cut = on_cut
        self.flipped = 0
        self.done = False
        self.url = ""
        self._server: asyncio.Server | None = None
        self._writers: list[asyncio.StreamWriter] = []

    async def __aenter__(self) -> Tamper:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self._server.sockets[0].getsockname()[1]}"
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()
        for writer in self._writers:
            writer.transport.abort()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.port)
        self._writers += [writer, up_writer]
        await asyncio.gather(self._pump(reader, up_writer, "up"), self._pump(up_reader, writer, "down"),
                             return_exceptions=True)
        for w in (writer, up_writer):
            w.transport.abort()

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, direction: str) -> None:
        seen = bytearray()  # the start of this direction's stream, until its first head with a body is found
        body_start: int | None = None
        position = 0
        with contextlib.suppress(ConnectionError):
            while data := await reader.read(1 << 16):
                chunk = bytearray(data)
                if direction == self.direction and not self.done:
                    if body_start is None:
                        seen += chunk
                        body_start = _body_start(seen)
                    if body_start is not None:
                        if self.flip_at is not None:
                            target = body_start + self.flip_at
                            if position <= target < position + len(chunk):
                                chunk[target - position] ^= 0xFF
                                self.flipped += 1
                                self.done = True
                        elif self.cut_at is not None and position + len(chunk) >= body_start + self.cut_at:
                            writer.write(chunk[: body_start + self.cut_at - position])
                            await writer.drain()
                            self.done = True
                            if self.on_cut is not None:
                                self.on_cut()
                            for w in self._writers:
                                w.transport.abort()
                            return
                position += len(chunk)
                writer.write(chunk)
                await writer.drain()


def _body_start(seen: bytearray) -> int | None:
    """Where the body of the first head that is not a ``100 Continue`` begins in ``seen``, once it is there."""
    position = 0
    while (end := seen.find(b"\r\n\r\n", position)) >= 0:
        if not seen.startswith(b"HTTP/1.1 100", position):
            return end + 4
        position = end + 4
    return None


@pytest.fixture
async def endpoint(tmp_path: Path) -> AsyncIterator[DataServer]:
    async with data_endpoint(tmp_path) as server:
        yield server


async def test_a_byte_damaged_on_the_way_up_is_sent_again_from_zero(endpoint: DataServer) -> None:
    """One flipped byte of an upload: the worker drops its bytes and answers 409 from 0, the SDK sends it again,
    and the input is verified (the plan would have failed input_mismatch)."""
    data = os.urandom(SIZE)
    source = (await prepare_inputs({"x": data}))["x"]
    transport = DirectTransport()
    async with Tamper(endpoint.port, "up", flip_at=SIZE // 2) as tamper:
        try:
            await transport.upload(grant(tamper.url, "x", SIZE, source.digest), source)
        finally:
            await transport.aclose()
    entry = endpoint.spool.input("p1", 1, "x")
    assert tamper.flipped == 1
    assert entry is not None and entry.state == "verified" and entry.restarts == 1
    assert entry.path is not None and entry.path.read_bytes() == data


async def test_a_byte_damaged_on_the_way_down_is_fetched_again(endpoint: DataServer, tmp_path: Path) -> None:
    """One flipped byte of a download: the digest check fails, the SDK fetches the output again, the file is sound."""
    data = os.urandom(SIZE)
    endpoint.spool.add_output("p1", 1, "out", data)
    transport = DirectTransport()
    async with Tamper(endpoint.port, "down", flip_at=SIZE // 2) as tamper:
        try:
            target = await fetch_to(transport, grant(tamper.url, "out", -1, "", "get"), "out", tmp_path / "out.bin",
                                    OutputCheck("out", digest(data)))
        finally:
            await transport.aclose()
    assert tamper.flipped == 1 and endpoint.requests["GET"] == 2
    assert target.read_bytes() == data


def signed(url: str, name: str, kid: str, master: bytes, refresh: Callable[[], Any] | None = None) -> Grant:
    """A get ticket for output ``name`` of p1 attempt 1 on w1, under key ``kid``."""
    claims = TicketClaims("p1", 1, WORKER, "get", {name: FileClaim()}, time.time() + 60)
    ticket = sign(claims, kid, worker_key(master, WORKER))
    return Grant("p1", 1, url, ticket, ticket, refresh)


async def test_a_download_whose_ticket_key_went_gets_a_fresh_ticket_and_goes_on(endpoint: DataServer,
                                                                                tmp_path: Path) -> None:
    """Cut mid-download while the worker's keys change (what a coordinator restart does): the resumed GET is 401
    'unknown ticket key'; the SDK asks for a fresh ticket once and goes on from the byte it reached."""
    data = os.urandom(SIZE)
    endpoint.spool.add_output("p1", 1, "out", data)
    new_master = b"n" * 32
    endpoint.set_keys([DataKey(kid="old", key=worker_key(MASTER, WORKER))])
    asked: list[int] = []

    def restarted() -> None:
        endpoint.set_keys([DataKey(kid="new", key=worker_key(new_master, WORKER))])

    async with Tamper(endpoint.port, "down", cut_at=SIZE // 3, on_cut=restarted) as tamper:

        async def refresh() -> Grant:
            asked.append(1)
            return signed(tamper.url, "out", "new", new_master)

        transport = DirectTransport()
        try:
            target = await transport.download_to(signed(tamper.url, "out", "old", MASTER, refresh), "out",
                                                 tmp_path / "out.bin", OutputCheck("out", digest(data)))
        finally:
            await transport.aclose()
    assert tamper.done and asked == [1]
    assert endpoint.requests["GET"] == 3 and endpoint.refused[401] == 1  # the cut one, the 401, the resumed one
    assert target.read_bytes() == data


async def test_a_streamed_download_refused_401_gets_a_fresh_ticket(endpoint: DataServer) -> None:
    """``download`` (the chunks of ``plan.output_chunks``) with a ticket whose key is gone: a fresh one, then the
    bytes."""
    data = os.urandom(1 << 20)
    endpoint.spool.add_output("p1", 1, "out", data)
    new_master = b"n" * 32
    endpoint.set_keys([DataKey(kid="new", key=worker_key(new_master, WORKER))])

    async def refresh() -> Grant:
        return signed(endpoint.url, "out", "new", new_master)

    transport = DirectTransport()
    try:
        chunks = [c async for c in transport.download(signed(endpoint.url, "out", "old", MASTER, refresh), "out")]
    finally:
        await transport.aclose()
    assert b"".join(chunks) == data


# --------------------------------------------------------------------------- the relay across a coordinator restart


async def produce(ctx: Any, args: Any) -> str:
    ctx.output("blob", bytes(range(256)) * (args["size"] // 256))
    return "made"


def settings(tmp_path: Path, port: int = 0) -> ServerSettings:
    return ServerSettings(
        port=port, insecure=True, core=CoreConfig(heartbeat_interval_s=0.2, heartbeat_timeout_s=1.0),
        reaper_interval_s=0.05, store=f"sqlite:{tmp_path / 'coordinator.sqlite3'}",
    )  # fmt: skip


async def test_a_relayed_download_goes_on_across_a_coordinator_restart(tmp_path: Path) -> None:
    """A relayed 48 MiB download: the coordinator stops after its first chunk and starts again on its store (new
    ticket keys); the SDK resumes the session, gets a fresh ticket for the worker's new key and the bytes arrive
    whole (it failed 'unknown ticket key')."""
    size = 48 << 20
    first = CoordinatorServer(settings(tmp_path))
    await first.start()
    agent = Agent(first.url, None, worker_id="w1", reconnect_base_s=0.02, reconnect_cap_s=0.2, handshake_timeout_s=5,
                  spool_dir=str(tmp_path / "spool"))
    agent.add_handler("produce", produce)
    worker = asyncio.create_task(agent.run())
    second: CoordinatorServer | None = None
    try:
        await asyncio.wait_for(agent.registered.wait(), 10)
        client = Client(first.url, token="", reconnect_base_s=0.02, reconnect_cap_s=0.2, reconnect_give_up_s=20)
        async with client:
            plan = await client.submit("produce", {"size": size}, outputs=["blob"], relay=True)
            assert await asyncio.wait_for(plan.result(), 20) == "made"
            chunks = plan.output_chunks("blob")
            received = [await asyncio.wait_for(anext(chunks), 20)]
            await first.stop()
            second = CoordinatorServer(settings(tmp_path, port=first.port))
            await second.start()
            async with asyncio.timeout(40):
                received += [chunk async for chunk in chunks]
    finally:
        agent.stop()
        agent.stop()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(worker, 10)
        for server in (second, first):
            if server is not None:
                with contextlib.suppress(Exception):
                    await server.stop()
    assert b"".join(received) == bytes(range(256)) * (size // 256)
