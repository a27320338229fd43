"""``subscribe`` with ``all`` on a cluster's main port: every new plan of every shard, read through the doorbell.

An in-process cluster host (coordinator/io/cluster/host.py) serving two shards on a real
PostgreSQL (tests/pg.py; skipped without one), a raw JSON view session (as the dashboard's) on its
main port, and an SDK client submitting to the shards' cores.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from websockets.asyncio.client import connect
from websockets.typing import Subprotocol

from coordinator.io.cluster.doorbell import Doorbell, open_connection
from coordinator.io.cluster.host import ClusterHost
from coordinator.io.frontdoor.server import ServerSettings
from coordinator.shards import ClusterConfig, pool_shard
from fleetwire import Client
from tests.integration.test_cluster_doorbell import listen_to_commits
from tests.waiting import until

pytestmark = pytest.mark.timeout(120)

CLUSTER = ClusterConfig(shards=2, lease_ttl_s=30.0, lease_renew_s=1.0)
NO_REPLAY = 2**53  # the dashboard's from_seq: live events only


def pool_on(shard: int) -> str:
    """A pool name whose plans live on ``shard``."""
    return next(f"p{i}" for i in range(1000) if pool_shard(f"p{i}", CLUSTER.shards) == shard)


async def serving_host(dsn: str) -> ClusterHost:
    """A started cluster host serving every shard."""
    served = asyncio.Event()

    def announce(line: str) -> None:
        if line.startswith("serving shard") and len(host.servers) >= CLUSTER.shards:
            served.set()

    host = ClusterHost(ServerSettings(port=0, insecure=True, store=dsn, cluster=CLUSTER), announce=announce)
    await host.start()
    await asyncio.wait_for(served.wait(), 30)
    return host


async def test_subscribe_all_on_a_main_port_streams_new_plans_of_every_shard_to_their_end(pg_dsn: str) -> None:
    """After subscribe(all), each new plan of both shards streams queued..cancelled in seq order; older ones don't."""
    host = await serving_host(pg_dsn)
    try:
        pools = [pool_on(0), pool_on(1)]
        async with Client(host.url, pool=pools[0]) as before:
            await before.submit("echo", {}, tags=[f"pool:{pools[0]}"], plan_id="before")  # no worker: queued
        assert host.doorbell.rung == 0  # nobody watches anywhere: no NOTIFY for its commits
        async with connect(host.url + "/v1/client", subprotocols=[Subprotocol("fleetwire.v1.json")]) as ws:
            await ws.send(json.dumps({"type": "subscribe", "req_id": 1, "all": True, "from_seq": NO_REPLAY}))
            first = json.loads(await ws.recv())
            assert (first[0] if isinstance(first, list) else first)["type"] == "subscribed"
            for shard, pool in enumerate(pools):
                async with Client(host.url, pool=pool) as client:
                    await client.submit("echo", {}, tags=[f"pool:{pool}"], plan_id=f"new-{shard}")
                    await client.cancel(f"new-{shard}")
            events: dict[str, list[tuple[int, str]]] = {}

            def ended() -> bool:
                return all(any(kind == "cancelled" for _, kind in events.get(f"new-{s}", [])) for s in (0, 1))

            async with asyncio.timeout(30):
                while not ended():
                    frame: Any = json.loads(await ws.recv())
                    for msg in frame if isinstance(frame, list) else [frame]:
                        assert msg["type"] == "event", msg
                        events.setdefault(msg["plan_id"], []).append((msg["seq"], msg["kind"]))
            await until(lambda: host.doorbell.wanted)  # a round read the view's mark: the owners ring now
            async with Client(host.url, pool=pools[1]) as client:
                await client.submit("echo", {}, tags=[f"pool:{pools[1]}"], plan_id="rung")
            await until(lambda: host.doorbell.rung > 0)
        assert set(events) == {"new-0", "new-1"}, events  # "before" was created before the subscribe
        for plan_events in events.values():
            assert [seq for seq, _ in plan_events] == list(range(1, len(plan_events) + 1))  # no gap, no duplicate
            assert plan_events[0][1] == "queued" and plan_events[-1][1] == "cancelled"
    finally:
        await host.stop()


async def test_a_gated_doorbell_rings_only_while_a_watcher_waits_somewhere(pg_dsn: str) -> None:
    """Gated and unwanted: a ring sends no NOTIFY; once a round reads a watcher's mark (wanted), rings go out."""
    listener, heard, arrived = await listen_to_commits(pg_dsn)
    bell = Doorbell(pg_dsn, open_connection, gated=True)
    bell.bind(asyncio.get_running_loop())
    try:
        bell.ring(0, 7)  # nobody wants it: dropped
        bell.wanted = True  # as a lease round sets it after reading another coordinator's mark
        bell.ring(1, 9)
        await asyncio.wait_for(arrived.wait(), 10)
        assert heard == ["1:9"]  # one connection, in order: "0:7" would have come first
    finally:
        await bell.close()
        await listener.close()
