"""View sessions on a cluster's main port are charged as a core's client sessions (coordinator/limits.py).

An in-process cluster host (coordinator/io/cluster/host.py) on a real PostgreSQL (tests/pg.py;
skipped without one), with small limits, and a raw websocket client on its main port.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed
from websockets.typing import Subprotocol

from coordinator.io.cluster.host import ClusterHost
from coordinator.io.cluster.leases import ACQUIRE
from coordinator.io.cluster.sessions import COUNTS_TTL_S
from coordinator.io.frontdoor.server import ServerSettings
from coordinator.io.stores.postgres import PgStore
from coordinator.limits import Limits
from coordinator.records import PlanCreated
from coordinator.shards import ClusterConfig
from protocol import errors as codes
from protocol.messages import Submit

pytestmark = pytest.mark.timeout(120)

CLUSTER = ClusterConfig(shards=2, lease_ttl_s=30.0, lease_renew_s=1.0)
JSON = [Subprotocol("fleetwire.v1.json")]


def seed(dsn: str, n: int) -> None:
    """``n`` plans of the principal ``client`` (the --insecure one), written under a lease of 'seed'."""
    store = PgStore(dsn, CLUSTER)
    try:
        rows = store.execute(lambda c: c.fetch(ACQUIRE, "seed", "", 30.0, list(range(CLUSTER.shards))))
        store.owner, store.fence = "seed", {r[0]: r[1] for r in rows}
        store.write([PlanCreated(f"p{i}", "client", i + 1, Submit(req_id=1, op="echo", plan_id=f"p{i}"))
                     for i in range(n)])  # fmt: skip
        store.execute(lambda c: c.execute("UPDATE shard_leases SET expires_at = now() - interval '1 second'"))
    finally:
        store.close()


def listing(first_req: int, n: int, limit: int) -> str:
    return json.dumps([{"type": "list_plans", "req_id": first_req + i, "limit": limit} for i in range(n)])


async def host_with(dsn: str, limits: Limits) -> ClusterHost:
    """A started cluster host serving every shard (stopping one mid-start would leave cores half open)."""
    served = asyncio.Event()

    def announce(line: str) -> None:
        if line.startswith("serving shard") and len(host.servers) >= CLUSTER.shards:
            served.set()

    host = ClusterHost(ServerSettings(port=0, insecure=True, store=dsn, cluster=CLUSTER, limits=limits),
                       announce=announce)  # fmt: skip
    await host.start()
    await asyncio.wait_for(served.wait(), 30)
    return host


async def test_a_message_flood_on_a_view_session_is_throttled_then_closed_4429(pg_dsn: str) -> None:
    """Over the client message rate past the grace: closed 4429 'message rate limit exceeded', as a core's session."""
    await asyncio.to_thread(seed, pg_dsn, 3)
    host = await host_with(pg_dsn, Limits(client_rate=100, client_burst=10, flood_grace_s=0.3, cost_rate=0))
    try:
        async with connect(host.url + "/v1/client", subprotocols=JSON) as ws:
            replies = 0

            async def read() -> None:
                nonlocal replies
                async for frame in ws:
                    replies += len(json.loads(frame)) if isinstance(json.loads(frame), list) else 1

            reader = asyncio.create_task(read())
            with pytest.raises(ConnectionClosed):
                for k in range(200):  # 50 requests a frame: five times the burst, each frame
                    await ws.send(listing(k * 50, 50, 5))
                    await asyncio.sleep(0)
                await asyncio.wait_for(reader, 30)
            reader.cancel()
            await asyncio.wait_for(ws.wait_closed(), 10)
            assert ws.close_code == codes.CLOSE_RATE_LIMITED == 4429, (ws.close_code, ws.close_reason)
            assert ws.close_reason == "message rate limit exceeded"
            assert 0 < replies < 200 * 50  # served while throttled, never all of the flood
        assert host.views.rate_closes == 1
    finally:
        await host.stop()


async def test_a_listing_flood_is_throttled_by_the_principals_work_units_and_nothing_is_dropped(
    pg_dsn: str,
) -> None:
    """list_plans costs its rows (the counts' scan once per COUNTS_TTL_S): past cost_rate the reader pauses."""
    await asyncio.to_thread(seed, pg_dsn, 120)
    host = await host_with(pg_dsn, Limits(client_rate=0, cost_rate=2_000, cost_burst=500))
    try:
        async with connect(host.url + "/v1/client", subprotocols=JSON) as ws:
            for k in range(6):  # each listing: 1 + 120 counted (first only) + 51 rows + 4 * 50 built
                await ws.send(listing(k * 3, 3, 50))
            got: list[Any] = []
            while len(got) < 18:
                frame = json.loads(await asyncio.wait_for(ws.recv(), 30))
                got.extend(frame if isinstance(frame, list) else [frame])
        assert [m["type"] for m in got] == ["plans"] * 18 and sorted(m["req_id"] for m in got) == list(range(18))
        assert all(m["counts"] == {"queued": 120} and len(m["plans"]) == 50 for m in got)
        assert host.views.cost_throttles >= 3  # about 760 units a frame against 500 at once and 2,000/s
    finally:
        await host.stop()


async def test_the_counts_scan_is_cached_per_principal(pg_dsn: str) -> None:
    """Two listings within COUNTS_TTL_S scan the counts once: the second is charged no scan."""
    await asyncio.to_thread(seed, pg_dsn, 10)
    host = await host_with(pg_dsn, Limits())
    try:
        views = host.views
        async with views.conn() as conn:
            first = await views.counts(conn, "client")
            second = await views.counts(conn, "client")
            other = await views.counts(conn, "nobody")
        assert first == ({"queued": 10}, 10) and second == ({"queued": 10}, 0) and other == ({}, 0)
        assert COUNTS_TTL_S <= 2.0  # a listing's counts are at most this stale
    finally:
        await host.stop()
