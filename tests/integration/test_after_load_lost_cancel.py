"""A handshake waiting for the store's load (coordinator/io/frontdoor/server.py ``_after_load``) that is cancelled
in the loop iteration in which the load ends is not admitted.

On Python 3.11 ``asyncio.wait_for`` returns its result when the caller's cancel arrives in the
iteration in which the awaited call ends: the wait for the load ran under it, and a handshake
cancelled then (a stop cancelling the handlers past its bound) went on and was admitted. Here the
cancel comes deterministically from the server's own ``loaded.set()``, before the wait hears it.
"""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

import pytest
from websockets.asyncio.client import connect

from coordinator.io.frontdoor.server import CoordinatorServer
from coordinator.io.stores.store import DB_FILE
from tests.integration.test_restart_loading import HeldStore, fill, handshakes_waiting, settings

pytestmark = pytest.mark.timeout(60)


class CancelsAsSet(asyncio.Event):
    """The server's ``loaded`` event, whose ``set()`` cancels the port's handler tasks in the same iteration."""

    server: CoordinatorServer | None = None
    cancelled: list[asyncio.Task[None]]

    def set(self) -> None:
        super().set()
        assert self.server is not None and self.server._server is not None
        self.cancelled = [task for task in self.server._server.handler_tasks if not task.done()]
        for task in self.cancelled:
            task.cancel()


async def test_a_handshake_cancelled_as_the_load_ends_is_not_admitted(tmp_path: Path) -> None:
    """A handshake waiting for the load, cancelled in the loop iteration in which the load ends, ends cancelled
    instead of being admitted (its session opened)."""
    fill(tmp_path / DB_FILE, 10)
    store = HeldStore(tmp_path / DB_FILE)
    server = CoordinatorServer(settings(), store=store)  # type: ignore[arg-type]
    loaded = server.loaded = CancelsAsSet()
    loaded.server = server
    starting = asyncio.create_task(server.start())
    client: asyncio.Task[None] | None = None
    try:
        await asyncio.wait_for(server.listening.wait(), 10)
        assert await asyncio.to_thread(store.started.wait, 10)

        async def open_session() -> None:
            async with connect(server.url + "/v1/client", open_timeout=10):
                await asyncio.Future()  # held open: a session the test sees admitted

        client = asyncio.create_task(open_session())
        await handshakes_waiting(server, 1)
        store.go.set()
        await asyncio.wait_for(starting, 20)
        (handler,) = loaded.cancelled
        await asyncio.wait([handler], timeout=5)
        assert handler.cancelled(), "the cancelled handshake went on: admitted, its session runs"
    finally:
        store.go.set()
        if client is not None:
            client.cancel()
            with contextlib.suppress(BaseException):
                await client
        if not starting.done():
            await asyncio.gather(starting, return_exceptions=True)
        await server.stop()
