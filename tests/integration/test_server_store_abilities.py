"""A coordinator's port uses what its store declares (coordinator/io/stores/abilities.py), never what it merely has.

A real ``CoordinatorServer`` over loopback with a ``MemoryStore`` that has an ``away`` method (a
database failover, as ``PgStore.away`` says it): declared, new sessions get 503 + Retry-After;
only present, the server does not see it (the getattr probes it used to make are gone).
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from coordinator.io.frontdoor.server import CoordinatorServer, ServerSettings
from coordinator.io.stores.abilities import StoreAbilities
from coordinator.io.stores.store import MemoryStore
from tests.integration.test_repeats_held import request

pytestmark = pytest.mark.timeout(60)

AWAY = "the database is away (a failover, in this test)"


class AwayStore(MemoryStore):
    """A memory store whose database is away; it declares so only when ``declared``."""

    def __init__(self, declared: bool) -> None:
        super().__init__()
        self.abilities = StoreAbilities(away=self.away) if declared else StoreAbilities()  # type: ignore[misc]

    def away(self) -> str | None:
        return AWAY


@pytest.fixture
async def servers() -> AsyncIterator[list[CoordinatorServer]]:
    started: list[CoordinatorServer] = []
    yield started
    for server in started:
        await server.stop()


async def serve(started: list[CoordinatorServer], store: MemoryStore) -> CoordinatorServer:
    server = CoordinatorServer(ServerSettings(port=0, insecure=True), store=store)
    await server.start()
    started.append(server)
    return server


async def test_a_declared_away_store_answers_new_sessions_503_retry_after(servers: list[CoordinatorServer]) -> None:
    """A store that declares ``away``: an upgrade while it is away gets 503 + Retry-After naming why."""
    server = await serve(servers, AwayStore(declared=True))
    status, headers, body = await request(server.port, "/v1/client")
    assert status == 503 and headers["retry-after"] == "1" and AWAY in body
    assert server.refusals == {"503": 1}


async def test_an_away_method_the_store_does_not_declare_is_not_used(servers: list[CoordinatorServer]) -> None:
    """The same method, not declared in ``abilities``: the server never probes for it, the upgrade goes on."""
    server = await serve(servers, AwayStore(declared=False))
    assert (await request(server.port, "/v1/client"))[0] == 101
    assert server.refusals == {}
