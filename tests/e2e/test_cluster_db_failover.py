"""Cluster mode through a database failover: primary kill -9, sync standby promoted, nothing acknowledged lost."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest

from fleetwire import Client
from tests.e2e.conftest import CLIENT_TOKEN, Cluster
from tests.e2e.test_cluster import SHARDS, coordinator, pool_on
from tests.pg import PostgresServer, missing_reason, postgres_server, standby_dsn

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]


@pytest.fixture
def primary_and_standby() -> Iterator[tuple[PostgresServer, PostgresServer, str]]:
    """A primary with a synchronous streaming standby (its own servers: the test kills the primary)."""
    reason = missing_reason()
    if reason is not None:
        pytest.skip(reason)
    with postgres_server() as primary:
        database = primary.new_database().rsplit("/", 1)[1]
        standby = primary.replica()
        try:
            yield primary, standby, standby_dsn(primary, standby, database)
        finally:
            standby.stop()


async def test_coordinator_reconnects_to_the_promoted_standby_and_loses_nothing_acknowledged(
    cluster: Cluster, primary_and_standby: tuple[PostgresServer, PostgresServer, str]
) -> None:
    """kill -9 of the primary then promotion: the same coordinator serves again, acknowledged plans are all there."""
    primary, standby, dsn = primary_and_standby
    proc, url = await coordinator(cluster, dsn)
    for _ in range(SHARDS):
        await proc.wait_for_line("serving shard")
    pool = pool_on(0)
    await cluster.worker("w1", "--url", url, "--pool", pool, "--reconnect-base", "0.05", "--reconnect-cap", "0.3")
    async with Client([url, url], token=CLIENT_TOKEN, pool=pool, reconnect_base_s=0.05, reconnect_cap_s=0.3,
                      reconnect_give_up_s=60) as client:  # fmt: skip
        acked = [await client.submit("echo", {"n": i}, tags=[f"pool:{pool}"], plan_id=f"before-{i}") for i in range(5)]
        assert [await asyncio.wait_for(p.result(), 30) for p in acked[:1]] == [{"n": 0}]
        await asyncio.to_thread(primary.kill)
        await asyncio.to_thread(standby.promote)
        # The coordinator process survives: its shards stop on the failed write or the lapsed lease and are
        # served again from the promoted standby (a multi-host DSN with target_session_attrs=read-write).
        after = await client.submit("echo", {"n": "after"}, tags=[f"pool:{pool}"], plan_id="after")
        assert await asyncio.wait_for(after.result(), 60) == {"n": "after"}
        for i, plan in enumerate(acked):  # every plan acknowledged before the kill was on the standby, and ends
            assert await asyncio.wait_for(plan.result(), 60) == {"n": i}
            assert (await client.get_plan(f"before-{i}")).state == "succeeded"
    assert proc.proc.returncode is None  # the coordinator never exited
