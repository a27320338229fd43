"""The usage ledger a store kept is in force after a coordinator restart (issue #27): a real server over loopback."""

from __future__ import annotations

import pytest

from coordinator.io.frontdoor.server import CoordinatorServer, ServerSettings
from coordinator.io.stores.store import MemoryStore
from coordinator.records import UsageRows
from fleetwire import Client

pytestmark = pytest.mark.timeout(60)


async def test_a_restarted_server_answers_get_usage_from_its_store() -> None:
    """Rows a store holds (written by an earlier coordinator) are what a new server's get_usage answers."""
    store = MemoryStore()  # --insecure: every client is the principal "client", which sees its own rows
    rows = [(3600, "client", "ml", [3, 1, 0, 12.5]), (7200, "client", "ml", [1, 0, 0, 2.5]), (3600, "bob", "web", [9])]
    store.write([UsageRows(rows)])
    server = CoordinatorServer(ServerSettings(port=0, insecure=True), store=store)
    await server.start()
    try:
        async with Client(f"ws://127.0.0.1:{server.port}") as client:
            reply = await client.usage(by="team")
        [row] = reply.rows
        assert (row.name, row.succeeded, row.failed, row.slot_seconds) == ("ml", 4, 1, 15.0)
    finally:
        await server.stop()
