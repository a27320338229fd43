"""Cluster usability against a real PostgreSQL (tests/pg.py; skipped without): the shard cores' ports
(``--shard-ports``), a ``moved`` the SDK follows without a warning, and waiting reasons that know pools."""

from __future__ import annotations

import asyncio
import logging
import socket

import pytest

from coordinator.io.cluster.host import ClusterHost
from coordinator.io.frontdoor.server import ServerSettings
from coordinator.shards import ClusterConfig
from fleetwire import Client

pytestmark = pytest.mark.timeout(120)

CLUSTER = ClusterConfig(shards=2, lease_ttl_s=30.0, lease_renew_s=1.0)


def free_ports(count: int) -> int:
    """The first of ``count`` consecutive ports nobody listens on now."""
    for _ in range(100):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            first = probe.getsockname()[1]
        if first + count <= 65535 and all(_free(first + i) for i in range(count)):
            return first
    raise RuntimeError(f"no {count} consecutive free ports")


def _free(port: int) -> bool:
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


async def serving_host(dsn: str, shard_ports: tuple[int, int] | None = None) -> ClusterHost:
    """A started cluster host serving every shard."""
    served = asyncio.Event()

    def announce(line: str) -> None:
        if line.startswith("serving shard") and len(host.servers) >= CLUSTER.shards:
            served.set()

    settings = ServerSettings(port=0, insecure=True, store=dsn, cluster=CLUSTER)
    host = ClusterHost(settings, announce=announce, shard_ports=shard_ports)
    await host.start()
    await asyncio.wait_for(served.wait(), 30)
    return host


async def test_each_shard_core_listens_on_its_port_of_the_shard_ports(pg_dsn: str) -> None:
    """--shard-ports FIRST-LAST: shard S listens on FIRST+S, and its owner URL (topology, moved) says so."""
    first = free_ports(CLUSTER.shards)
    host = await serving_host(pg_dsn, (first, first + CLUSTER.shards - 1))
    try:
        assert {shard: server.port for shard, server in host.servers.items()} == {0: first, 1: first + 1}
        assert {shard: host.where(shard).url for shard in (0, 1)} == {
            0: f"ws://127.0.0.1:{first}", 1: f"ws://127.0.0.1:{first + 1}"}
    finally:
        await host.stop()


async def test_a_taken_port_of_the_range_is_passed_over_for_another_of_the_range(pg_dsn: str) -> None:
    """Another process listens on FIRST: the shards take the other ports of the range, one each."""
    first = free_ports(3)
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", first))
        squatter.listen()
        host = await serving_host(pg_dsn, (first, first + 2))
        try:
            ports = sorted(server.port for server in host.servers.values())
            assert ports == [first + 1, first + 2]
        finally:
            await host.stop()


async def test_a_client_follows_moved_without_a_warning(pg_dsn: str, caplog: pytest.LogCaptureFixture) -> None:
    """A submit on the main port is moved to its shard's core: logged at debug, never as a warning."""
    host = await serving_host(pg_dsn)
    try:
        with caplog.at_level(logging.DEBUG, logger="fleetwire.client"):
            async with Client(host.url) as client:
                plan = await client.submit("echo", {}, tags=["pool:cpu"])
                assert plan.id
        records = [r for r in caplog.records if r.name == "fleetwire.client"]
        assert not [r for r in records if r.levelno >= logging.WARNING], [r.getMessage() for r in records]
        assert any("4307" in r.getMessage() and r.levelno == logging.DEBUG for r in records)
    finally:
        await host.stop()


async def test_a_plan_with_no_tags_waits_for_the_default_pool_not_for_a_connection(pg_dsn: str) -> None:
    """On a shard core, a plan with no tags and no worker there is told its pool, not "no worker is connected"."""
    host = await serving_host(pg_dsn)
    try:
        async with Client(host.url) as client:
            plan = await client.submit("echo", {})
            async for event in plan.events():
                if event.kind == "waiting":
                    assert event.data["reason"].startswith("no worker of the default pool (workers with no tags) "
                                                           "handles op 'echo'")
                    break
    finally:
        await host.stop()
