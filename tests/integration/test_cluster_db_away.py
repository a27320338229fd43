"""While the PostgreSQL primary is away: 503 + Retry-After for new sessions, ``unavailable`` for submits, no loss.

A real PostgreSQL server of the test's own (tests/pg.py), stopped with ``pg_ctl stop -m immediate``
and started again on the same port, under an in-process cluster host (coordinator/io/cluster/host.py)
whose lease TTL outlasts the outage, so its shards ride through it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest

from coordinator.io.cluster.host import ClusterHost
from coordinator.io.frontdoor.server import ServerSettings
from coordinator.io.stores.postgres import PgStore
from coordinator.shards import ClusterConfig
from fleetwire import Client
from fleetwire.errors import FleetwireConnectionError
from tests.pg import PostgresServer, missing_reason, postgres_server, scratch_dir
from tests.waiting import until

pytestmark = pytest.mark.timeout(120)

CLUSTER = ClusterConfig(shards=2, lease_ttl_s=60.0, lease_renew_s=0.2)


@pytest.fixture
def own_pg() -> Iterator[PostgresServer]:
    """A PostgreSQL server of this test's own (it is stopped and restarted)."""
    reason = missing_reason()
    if reason is not None:
        pytest.skip(reason)
    with postgres_server(parent=scratch_dir()) as server:
        yield server


async def refused(url: str) -> FleetwireConnectionError:
    """The error of a fresh session's handshake at ``url`` (it must be refused)."""
    with pytest.raises(FleetwireConnectionError) as caught:
        async with Client(url, reconnect=False, open_timeout_s=5):
            pass
    return caught.value


async def test_primary_away_answers_503_and_unavailable_then_serves_again_with_nothing_lost(
    own_pg: PostgresServer,
) -> None:
    """Primary stopped: handshakes 503 + Retry-After, a submit on an open session waits (unavailable), then lands."""
    dsn = own_pg.new_database()
    host = ClusterHost(ServerSettings(port=0, insecure=True, store=dsn, cluster=CLUSTER))
    await host.start()
    try:
        await until(lambda: len(host.servers) == CLUSTER.shards)
        core = host.servers[0]  # the default pool's shard
        store = core.store
        assert isinstance(store, PgStore)
        async with Client([host.url, host.url], reconnect_base_s=0.05, reconnect_cap_s=0.3) as client:
            before = await client.submit("echo", {"n": 1}, plan_id="before")
            await asyncio.to_thread(own_pg.pause)
            await until(lambda: store.away() is not None and host.db_away)

            main = await refused(host.url)  # the main port: the host's rounds fail
            shard = await refused(core.url)  # the shard's own port: its writer connection is gone
            for error in (main, shard):
                assert "HTTP 503" in str(error) and error.retry_after_s == 1.0, error

            during = asyncio.create_task(client.submit("echo", {"n": 2}, plan_id="during"))
            await until(lambda: core.unavailable_answers >= 1)
            assert not during.done() and not client.closed  # answered unavailable, waiting; not closed

            await asyncio.to_thread(own_pg.resume)
            plan = await asyncio.wait_for(during, 30)  # sent again after Retry-After, accepted once committed
            assert plan.id == "during" and not plan.duplicate
            assert before.id == "before"
        assert core.fatal is not None and not core.fatal.done()  # the shard rode through: no fail-stop
        await until(lambda: not host.db_away)
        async with Client([host.url], reconnect=False) as again:  # new sessions are admitted again
            assert (await again.get_plan("during")).id == "during"
    finally:
        await host.stop()
    check = PgStore(dsn, CLUSTER)
    try:
        assert sorted(p.created.plan_id for p in check.load()) == ["before", "during"]
    finally:
        check.close()
