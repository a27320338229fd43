"""A relayed upload survives its client's dropped connection: the SDK resumes the session and the upload
continues from the offset the worker holds (a real coordinator and agent in this process; the client's
connection goes through a loopback TCP proxy that cuts it once, mid-upload)."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from fleetwire import Client
from tests.integration.data_helpers import digest
from tests.integration.test_relay import CLIENT_TOKEN, running

pytestmark = pytest.mark.timeout(60)

SIZE = 24 << 20
CUT_AFTER = 6 << 20  # client -> coordinator bytes forwarded before the cut


class CuttingProxy:
    """Forwards TCP connections to ``port``; aborts every connection once ``cut_after`` bytes went upstream."""

    def __init__(self, port: int, cut_after: int) -> None:
        self.port = port
        self.cut_after = cut_after
        self.forwarded = 0
        self.cut = asyncio.Event()
        self.connections = 0
        self._transports: list[asyncio.StreamWriter] = []
        self._tasks: set[asyncio.Task[None]] = set()
        self._server: asyncio.Server | None = None
        self.url = ""

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.url = f"ws://127.0.0.1:{self._server.sockets[0].getsockname()[1]}"

    async def close(self) -> None:
        assert self._server is not None
        self._server.close()
        for writer in self._transports:
            writer.transport.abort()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.port)
        self._transports += [writer, up_writer]
        pumps = [asyncio.ensure_future(self._pump(reader, up_writer, upstream=True)),
                 asyncio.ensure_future(self._pump(up_reader, writer, upstream=False))]
        self._tasks.update(pumps)
        await asyncio.gather(*pumps, return_exceptions=True)
        for w in (writer, up_writer):
            w.transport.abort()

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, *, upstream: bool) -> None:
        with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError):
            while data := await reader.read(1 << 16):
                writer.write(data)
                await writer.drain()
                if upstream and not self.cut.is_set():
                    self.forwarded += len(data)
                    if self.forwarded >= self.cut_after:  # no close frame: the client sees a dropped connection
                        self.cut.set()
                        for w in list(self._transports):
                            w.transport.abort()
                        return
        writer.transport.abort()


@pytest.fixture
async def relayed(tmp_path: Path) -> AsyncIterator[tuple[Any, CuttingProxy]]:
    async with running(tmp_path) as (server, agent):
        assert agent.data_server is None  # no data endpoint: every byte is relayed
        proxy = CuttingProxy(server.port, CUT_AFTER)
        await proxy.start()
        try:
            yield server, proxy
        finally:
            await proxy.close()


async def test_relayed_upload_resumes_after_the_clients_connection_drops(relayed: tuple[Any, CuttingProxy],
                                                                         tmp_path: Path) -> None:
    """The client's connection is cut after 6 MiB of a 24 MiB relayed input: it reconnects, the upload goes
    on where the worker's spool stands, and the handler sees the whole input with its digest."""
    server, proxy = relayed
    data = hashlib.sha256(b"relay").digest() * (SIZE // 32)
    source = tmp_path / "input.bin"
    await asyncio.to_thread(source.write_bytes, data)
    async with Client(proxy.url, token=CLIENT_TOKEN) as client:
        plan = await client.submit("reverse", inputs={"data": source})
        result = await asyncio.wait_for(plan.result(), 45)
    assert proxy.cut.is_set() and proxy.connections >= 2
    # resumed, not started over: at most the window in flight at the cut crossed the relay twice
    assert SIZE <= server.core.relay.bytes_in <= SIZE + (2 << 20)
    assert result == {"size": SIZE, "digest": digest(data), "inputs": ["data"]}
