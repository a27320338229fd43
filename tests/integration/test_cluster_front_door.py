"""A cluster's main port admits as a single coordinator's port does (issue 24 part 6; coordinator/io/frontdoor/gate.py).

An in-process cluster host (coordinator/io/cluster/host.py) on a real PostgreSQL (tests/pg.py;
skipped without one), and raw HTTP and websocket clients on its main port over loopback.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed
from websockets.typing import Subprotocol

from coordinator.io.cluster.host import ClusterHost
from coordinator.io.frontdoor.gate import REPEAT_BURST
from coordinator.io.frontdoor.server import ServerSettings
from coordinator.limits import Limits
from coordinator.shards import ClusterConfig
from protocol import errors as codes
from tests.integration.test_repeats_held import request

pytestmark = pytest.mark.timeout(120)

CLUSTER = ClusterConfig(shards=1, lease_ttl_s=30.0, lease_renew_s=1.0)
JSON = [Subprotocol("fleetwire.v1.json")]
WORKER, CLIENT, ADMIN = "worker-token-0123456789", "client-token-0123456789", "admin-token-0123456789"

Host = Callable[..., Awaitable[ClusterHost]]


@pytest.fixture
async def cluster_host(pg_dsn: str) -> AsyncIterator[Host]:
    """Starts cluster hosts serving every shard (with tokens unless ``insecure``); stops them all."""
    hosts: list[ClusterHost] = []

    async def _start(limits: Limits | None = None, *, insecure: bool = False) -> ClusterHost:
        served = asyncio.Event()
        tokens: dict[str, Any] = {} if insecure else {
            "worker_tokens": (WORKER,), "client_tokens": (CLIENT,), "admin_tokens": (ADMIN,)}
        settings = ServerSettings(port=0, store=pg_dsn, cluster=CLUSTER, limits=limits or Limits(), insecure=insecure,
                                  **tokens)  # fmt: skip
        host = ClusterHost(settings, announce=lambda line: served.set() if line.startswith("serving shard") else None)
        await host.start()
        hosts.append(host)
        await asyncio.wait_for(served.wait(), 30)  # stopping one mid-start would leave its core half open
        return host

    yield _start
    for host in hosts:
        await host.stop()


async def test_a_bad_token_on_the_main_port_is_refused_before_the_upgrade(cluster_host: Host) -> None:
    """/v1/worker and /v1/client: no or a wrong token 401, the other role's 403, before any upgrade; valid ones pass."""
    host = await cluster_host()
    for path in ("/v1/worker", "/v1/worker?worker_id=w1", "/v1/client", "/v1/client?pool=gpu"):
        status, headers, body = await request(host.port, path)
        assert status == 401 and "missing" in body and headers["www-authenticate"].startswith("Bearer"), (path, body)
        assert (await request(host.port, path, "not-a-token"))[:3:2] == (401, "invalid token\n"), path
    status, _, body = await request(host.port, "/v1/worker", CLIENT)
    assert status == 403 and "use a worker token" in body
    assert (await request(host.port, "/v1/client", WORKER))[0] == 403
    assert (await request(host.port, "/v1/worker", WORKER))[0] == 101
    assert (await request(host.port, "/v1/client", CLIENT))[0] == 101
    assert (await request(host.port, "/v1/client?pool=gpu", ADMIN))[0] == 101


async def test_past_the_burst_bad_tokens_on_the_main_port_get_a_held_401_with_retry_after(cluster_host: Host) -> None:
    """A wrong-token loop from one address: 100 plain 401s, then Retry-After (held); /v1/plans counts too."""
    host = await cluster_host(Limits(penalty_hold_s=0.2))
    answers = [await request(host.port, "/v1/worker", "not-a-token") for _ in range(REPEAT_BURST)]
    assert {status for status, _, _ in answers} == {401}
    assert not any("retry-after" in headers for _, headers, _ in answers)
    status, headers, _ = await request(host.port, "/v1/worker", "not-a-token")
    assert status == 401 and headers["retry-after"] == "1"
    status, headers, body = await request(host.port, "/v1/plans", "not-a-token")
    assert status == 401 and headers["retry-after"] == "1" and "admin token" in body
    assert (await request(host.port, "/v1/client", CLIENT))[0] == 101  # the same address, a valid token


async def test_past_the_burst_scrapes_and_topology_reads_on_the_main_port_are_held(cluster_host: Host) -> None:
    """A loop of /metrics or /v1/topology (a database read) from one address: past the burst each is held, then
    answered 200."""
    host = await cluster_host(Limits(penalty_hold_s=0.05))
    answers = [await request(host.port, "/metrics") for _ in range(REPEAT_BURST + 1)]
    assert {status for status, _, _ in answers} == {200}
    assert host._gate.scrapes.over_count == 1
    status, _, body = await request(host.port, "/v1/topology")
    assert status == 200 and json.loads(body)["shards"] == CLUSTER.shards
    assert host._gate.scrapes.over_count == 2


async def test_a_view_session_closed_for_flooding_puts_it_in_the_penalty_box(cluster_host: Host) -> None:
    """Closed 4429 on the main port: its next upgrade is 429 with Retry-After, as on a single coordinator."""
    host = await cluster_host(Limits(client_rate=100, client_burst=10, flood_grace_s=0.3, cost_rate=0,
                                     penalty_hold_s=0.05), insecure=True)  # fmt: skip
    flood = json.dumps([{"type": "get_plan", "req_id": i, "plan_id": "nope"} for i in range(50)])
    async with connect(host.url + "/v1/client", subprotocols=JSON) as ws:

        async def drain() -> None:
            async for _ in ws:
                pass

        reader = asyncio.create_task(drain())
        with pytest.raises(ConnectionClosed):
            for _ in range(400):
                await ws.send(flood)
                await asyncio.sleep(0)
            await asyncio.wait_for(reader, 30)
        reader.cancel()
        await asyncio.wait_for(ws.wait_closed(), 10)
        assert ws.close_code == codes.CLOSE_RATE_LIMITED
    status, headers, body = await request(host.port, "/v1/client")
    assert status == 429 and int(headers["retry-after"]) >= 1 and "abuse" in body


async def test_an_oversize_frame_on_the_main_port_closes_1009_and_boxes_the_peer(cluster_host: Host) -> None:
    """A view session's frame over the client frame limit: closed 1009, its next upgrade 429; other tokens pass."""
    host = await cluster_host(Limits(client_frame_bytes=64 << 10, penalty_hold_s=0.05))
    async with connect(host.url + "/v1/client", subprotocols=JSON,
                       additional_headers={"Authorization": f"Bearer {CLIENT}"}) as ws:  # fmt: skip
        with contextlib.suppress(ConnectionClosed):
            await ws.send("x" * (1 << 20))
            await asyncio.wait_for(ws.recv(), 10)
        await asyncio.wait_for(ws.wait_closed(), 10)
        assert ws.close_code == codes.CLOSE_TOO_BIG
    status, headers, body = await request(host.port, "/v1/client", CLIENT)
    assert status == 429 and int(headers["retry-after"]) >= 1 and "abuse" in body
    assert (await request(host.port, "/v1/client", ADMIN))[0] == 101  # another principal from the same address


async def test_idle_sockets_at_the_main_port_past_the_budget_evict_the_oldest(cluster_host: Host) -> None:
    """100 idle TCP connections against a budget of 16: the oldest are dropped at once; a view session still opens."""
    host = await cluster_host(Limits(max_pending_handshakes=16, defer_accept_s=0, handshake_timeout_s=60),
                              insecure=True)  # fmt: skip
    idle = [await asyncio.open_connection("127.0.0.1", host.port) for _ in range(100)]
    try:
        async with connect(host.url + "/v1/client", subprotocols=JSON) as ws:
            await ws.send(json.dumps({"type": "list_workers", "req_id": 1}))
            assert json.loads(await asyncio.wait_for(ws.recv(), 10))["type"] == "workers"
        # Well before any handshake timeout (websockets' default is 10 s; here 60 s): evicted by the newer ones.
        dropped = await asyncio.wait_for(asyncio.gather(*(reader.read() for reader, _ in idle[:80])), 4)
        assert dropped == [b""] * 80
    finally:
        for _, writer in idle:
            writer.close()
