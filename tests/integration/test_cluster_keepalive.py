"""Cluster-mode keepalive: the SDK leaves a frozen coordinator (no pong) within its ping timeout."""

from __future__ import annotations

import asyncio
import contextlib

import pytest
from websockets.asyncio.server import ServerConnection, serve
from websockets.typing import Subprotocol

from fleetwire import Client
from fleetwire.errors import FleetwireConnectionError
from protocol.codec import SUBPROTOCOL_MSGPACK
from protocol.urls import CLUSTER_KEEPALIVE, SINGLE_KEEPALIVE, keepalive


def test_keepalive_is_fast_in_cluster_mode_only() -> None:
    """Several URLs (or a followed moved) ping at ~lease renew/TTL; one URL keeps websockets' 20 s; 0 disables."""
    assert keepalive(None, None, cluster=True) == CLUSTER_KEEPALIVE == (1.0, 3.0, 1.0)
    assert keepalive(None, None, cluster=False) == SINGLE_KEEPALIVE
    assert keepalive(0.5, None, cluster=False) == (0.5, SINGLE_KEEPALIVE[1], SINGLE_KEEPALIVE[2])
    assert keepalive(0, 0, cluster=True) == (None, None, 1.0)


async def test_client_leaves_a_frozen_coordinator_within_its_ping_timeout() -> None:
    """A coordinator that accepted the session then stops answering (SIGSTOP-like) ends it after ~the ping timeout."""
    frozen, done = asyncio.Event(), asyncio.Event()

    async def handler(ws: ServerConnection) -> None:
        ws.transport.pause_reading()  # frozen: reads nothing, so it never answers a ping
        frozen.set()
        await done.wait()

    # close_timeout: at the end the frozen side closes without waiting 10 s for a close frame it cannot read.
    async with serve(handler, "127.0.0.1", 0, subprotocols=[Subprotocol(SUBPROTOCOL_MSGPACK)],
                     close_timeout=0.1) as server:
        port = server.sockets[0].getsockname()[1] if server.sockets else 0
        urls = [f"ws://127.0.0.1:{port}", f"ws://127.0.0.1:{port}"]
        client = Client(urls, token="", reconnect=False, ping_interval_s=0.1, ping_timeout_s=0.3)
        await client.connect()
        try:
            await asyncio.wait_for(frozen.wait(), 5)
            # The request is never answered; the session ends when the keepalive gives up (websockets'
            # defaults would take 20 s + 20 s + a 10 s close timeout).
            with pytest.raises(FleetwireConnectionError, match="lost the connection"):
                await asyncio.wait_for(client.workers(), 5)
            assert client.closed
        finally:
            done.set()
            with contextlib.suppress(Exception):
                await client.close()
