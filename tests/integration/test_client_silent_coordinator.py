"""The SDK's client puts a coordinator that upgrades and then answers nothing at the back of its turn (loopback).

The client's dial ends at the upgrade (it has no ``welcome`` to wait for): a coordinator that never answers the
upgrade is a dial that timed out (tests/integration/test_reconnect_frozen.py). One that upgrades and then goes
silent (its loop wedged: no frame, not even a keepalive's pong) is left when the keepalive gives up; that session
served nothing and heard nothing, so its URL goes to the back of the turn too (protocol/urls.py ``UrlTurn``), as the
worker's hung handshake (tests/integration/test_worker_hung_handshake.py): the next reconnect goes to the live one.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
from collections.abc import AsyncIterator

import pytest

from coordinator.io.frontdoor.server import CoordinatorServer, ServerSettings
from fleetwire import Client
from protocol import ENCODING_SUBPROTOCOL
from tests.waiting import until

pytestmark = pytest.mark.timeout(60)

_GUID = b"258EAFA5-E914-47DA-95CA-C5AB0DC85B11"  # RFC 6455 §1.3


class Silent:
    """A coordinator that answers the websocket upgrade (101) and then reads and drops every byte: no frame, no
    pong, no close."""

    def __init__(self) -> None:
        self.upgrades = 0
        self.url = ""

    async def connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(OSError, asyncio.IncompleteReadError):
            request = await reader.readuntil(b"\r\n\r\n")
            headers = dict(line.split(b": ", 1) for line in request.split(b"\r\n")[1:] if b": " in line)
            accept = base64.b64encode(hashlib.sha1(headers[b"Sec-WebSocket-Key"].strip() + _GUID).digest())
            subprotocol = ENCODING_SUBPROTOCOL["msgpack"].encode()
            writer.write(b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                         b"Sec-WebSocket-Accept: " + accept + b"\r\n"
                         b"Sec-WebSocket-Protocol: " + subprotocol + b"\r\n\r\n")  # fmt: skip
            await writer.drain()
            self.upgrades += 1
            while await reader.read(65536):
                pass
        writer.close()


@pytest.fixture
async def silent() -> AsyncIterator[Silent]:
    coordinator = Silent()
    server = await asyncio.start_server(coordinator.connection, "127.0.0.1", 0)
    coordinator.url = f"ws://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    try:
        yield coordinator
    finally:
        server.close()


async def test_a_reconnect_that_lands_on_a_silent_coordinator_puts_it_at_the_back(
    silent: Silent, client_dials: list[str]
) -> None:
    """Client([live, silent]): after a drop the turn's silent URL upgrades and answers nothing; the keepalive leaves
    it and the client resumes at the live one; after a second drop the silent URL, at the back now, is not dialled."""
    server = CoordinatorServer(ServerSettings(port=0, insecure=True))
    await server.start()
    live = server.url
    try:
        client = Client([live, silent.url], token="", reconnect_dial_timeout_s=1.0, ping_interval_s=0.1,
                        ping_timeout_s=0.3, reconnect_base_s=0.01, reconnect_cap_s=0.05,
                        reconnect_give_up_s=20)  # fmt: skip
        async with client:
            for _ in range(2):
                ws = client._ws
                assert ws is not None
                ws.transport.abort()  # the connection drops (a network cut, a coordinator gone)
                await until(lambda ws=ws: client._ws is not ws and client.url.startswith(live),  # type: ignore[misc]
                            timeout_s=8)  # fmt: skip
                await asyncio.wait_for(client.workers(), 5)  # the resumed session is served
    finally:
        await server.stop()
    assert client_dials == [live, silent.url, live, live] and silent.upgrades == 1
