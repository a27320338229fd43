"""Cluster mode end to end: real coordinator processes sharing shards on one real PostgreSQL (docs/CLUSTER.md)."""

from __future__ import annotations

import asyncio
import json
import signal
import urllib.request

import pytest

from coordinator.shards import pool_shard
from fleetwire import Client
from tests.e2e.conftest import ADMIN_TOKEN, CLIENT_TOKEN, WORKER_TOKEN, Cluster, Proc

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]

SHARDS = 4
FAST = ("--heartbeat-interval", "0.2", "--heartbeat-timeout", "1", "--reaper-interval", "0.05",
        "--lease-ttl", "1", "--lease-renew", "0.25", "--shards", str(SHARDS))  # fmt: skip


async def coordinator(cluster: Cluster, dsn: str) -> tuple[Proc, str]:
    env = cluster.env(FLEETWIRE_WORKER_TOKEN=WORKER_TOKEN, FLEETWIRE_CLIENT_TOKEN=CLIENT_TOKEN,
                      FLEETWIRE_ADMIN_TOKEN=ADMIN_TOKEN, FLEETWIRE_STORE=dsn)  # fmt: skip
    proc = await cluster.run("coordinator", "--port", "0", *FAST, name="coordinator", env=env)
    url = (await proc.wait_for_line(r"listening on (ws://\S+)")).group(1)
    return proc, url


async def topology(url: str) -> dict[int, dict[str, object]]:
    http = url.replace("ws://", "http://") + "/v1/topology"
    body = await asyncio.to_thread(lambda: urllib.request.urlopen(http, timeout=5).read())
    return {row["shard"]: row for row in json.loads(body)["topology"]}


def pool_on(shard: int) -> str:
    """A pool name whose shard slot is ``shard``."""
    return next(f"p{i}" for i in range(1000) if pool_shard(f"p{i}", SHARDS) == shard)


async def test_two_coordinators_split_shards_moved_and_kill_9_takeover(cluster: Cluster, pg_dsn: str) -> None:
    """Two coordinators split the slots; a URL list lands on the owner via moved; kill -9 moves its shards over."""
    a, a_url = await coordinator(cluster, pg_dsn)
    for _ in range(SHARDS):
        await a.wait_for_line("serving shard")
    b, b_url = await coordinator(cluster, pg_dsn)
    for _ in range(SHARDS // 2):  # a gives back two slots (fair share 2 of 4), b takes them
        await b.wait_for_line("serving shard")
    rows = await topology(a_url)
    assert len([r for r in rows.values() if r["live"]]) == SHARDS
    owners = {r["owner"] for r in rows.values()}
    assert len(owners) == 2, rows
    b_owner = json.loads(await asyncio.to_thread(
        lambda: urllib.request.urlopen(b_url.replace("ws://", "http://") + "/v1/topology", timeout=5).read()
    ))["coordinator"]  # fmt: skip
    b_shards = sorted(s for s, r in rows.items() if r["owner"] == b_owner)
    assert len(b_shards) == SHARDS // 2
    pool = pool_on(b_shards[0])
    urls = f"{a_url},{b_url}"
    # The worker dials a first: a's main port answers moved to b's server for that shard.
    await cluster.worker("w1", "--url", urls, "--pool", pool, "--reconnect-base", "0.05", "--reconnect-cap", "0.3")
    async with Client([a_url, b_url], token=CLIENT_TOKEN, pool=pool, reconnect_base_s=0.05,
                      reconnect_cap_s=0.3) as client:  # fmt: skip
        plan = await client.submit("echo", {"n": 1}, tags=[f"pool:{pool}"], plan_id="on-b")
        assert await asyncio.wait_for(plan.result(), 30) == {"n": 1}
        assert client.url != a_url and not client.url.startswith(a_url)
        idle_pool = pool_on(b_shards[1])
    async with Client([a_url, b_url], token=CLIENT_TOKEN, pool=idle_pool, reconnect_base_s=0.05,
                      reconnect_cap_s=0.3) as client:  # fmt: skip
        acked = await client.submit("echo", {"before": "kill"}, tags=[f"pool:{idle_pool}"], plan_id="acked")
    assert acked.id == "acked"
    b.stop(signal.SIGKILL)
    assert await b.wait() == -signal.SIGKILL
    for _ in range(SHARDS // 2):  # a takes b's shards once their leases expire
        await a.wait_for_line("serving shard", timeout_s=30)
    await cluster.worker("w2", "--url", urls, "--pool", idle_pool, "--reconnect-base", "0.05",
                         "--reconnect-cap", "0.3")  # fmt: skip
    async with Client([b_url, a_url], token=CLIENT_TOKEN, pool=idle_pool, reconnect_base_s=0.05,
                      reconnect_cap_s=0.3) as client:  # fmt: skip
        watched = await client.watch("acked")
        assert await asyncio.wait_for(watched.result(), 30) == {"before": "kill"}
        again = await client.submit("echo", {"before": "kill"}, tags=[f"pool:{idle_pool}"], plan_id="acked")
        assert again.duplicate


async def test_sigterm_hands_over_and_a_stolen_shard_stops_only_that_shard(cluster: Cluster, pg_dsn: str) -> None:
    """SIGTERM releases every slot (the other takes them at once); a stolen slot stops only that shard's core."""
    first, _ = await coordinator(cluster, pg_dsn)
    for _ in range(SHARDS):
        await first.wait_for_line("serving shard")
    second, second_url = await coordinator(cluster, pg_dsn)
    first.stop(signal.SIGTERM)
    assert await first.wait() == 0
    for _ in range(SHARDS):
        await second.wait_for_line("serving shard", timeout_s=10)
    import asyncpg  # type: ignore[import-untyped]

    conn = await asyncpg.connect(pg_dsn)
    try:  # another coordinator "takes" shard 0: the owner's next renewal sees it and stops that shard only
        await conn.execute("UPDATE shard_leases SET owner = 'thief', epoch = epoch + 1, "
                           "expires_at = now() + interval '1 minute' WHERE shard = 0")  # fmt: skip
    finally:
        await conn.close()
    await second.wait_for_line(r"lost shard 0\b", timeout_s=10)
    rows = await topology(second_url)
    assert rows[0]["owner"] == "thief"
    assert all(rows[s]["live"] and rows[s]["url"] for s in range(1, SHARDS))
    assert second.proc.returncode is None  # still serving the other shards
