"""Cross-shard views: any coordinator's main port answers /v1/plans for every shard from PostgreSQL (admin token)."""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request

import pytest

from fleetwire import Client
from tests.e2e.conftest import ADMIN_TOKEN, CLIENT_TOKEN, Cluster
from tests.e2e.test_cluster import SHARDS, coordinator, pool_on, topology

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]


def get(url: str, token: str | None) -> tuple[int, str]:
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


async def test_main_port_lists_and_gets_plans_of_shards_it_does_not_own(cluster: Cluster, pg_dsn: str) -> None:
    """A plan of b's shard is read on a's main port (by id, listed); no/wrong token 401/403; bad query 400."""
    a, a_url = await coordinator(cluster, pg_dsn)
    for _ in range(SHARDS):
        await a.wait_for_line("serving shard")
    b, b_url = await coordinator(cluster, pg_dsn)
    for _ in range(SHARDS // 2):
        await b.wait_for_line("serving shard")
    rows = await topology(b_url)
    b_owner = json.loads(get(b_url.replace("ws://", "http://") + "/v1/topology", None)[1])["coordinator"]
    pool = pool_on(next(s for s, r in rows.items() if r["owner"] == b_owner))
    async with Client([a_url, b_url], token=CLIENT_TOKEN, pool=pool) as client:
        await client.submit("echo", {"n": 1}, tags=[f"pool:{pool}"], plan_id="on-b")  # no worker: stays queued
    base = a_url.replace("ws://", "http://") + "/v1/plans"
    status, body = await asyncio.to_thread(get, base + "?id=on-b", ADMIN_TOKEN)
    assert status == 200, body
    (info,) = json.loads(body)["plans"]
    assert (info["id"], info["op"], info["state"]) == ("on-b", "echo", "queued")
    status, body = await asyncio.to_thread(get, base + "?state=queued&limit=10", ADMIN_TOKEN)
    listing = json.loads(body)
    assert status == 200 and [p["id"] for p in listing["plans"]] == ["on-b"] and listing["total"] == 1
    assert (await asyncio.to_thread(get, base + "?id=nope", ADMIN_TOKEN))[0] == 404
    assert (await asyncio.to_thread(get, base, None))[0] == 401
    assert (await asyncio.to_thread(get, base, CLIENT_TOKEN))[0] == 403
    status, body = await asyncio.to_thread(get, base + "?state=bogus", ADMIN_TOKEN)
    assert status == 400 and "bogus" in body
    # The CLI given the list reads the same view (an admin token), whichever shard the plan is on.
    cli = await cluster.run("plans", "--url", f"{a_url},{b_url}", "--json",
                            env=cluster.env(FLEETWIRE_ADMIN_TOKEN=ADMIN_TOKEN))  # fmt: skip
    assert await cli.wait() == 0, cli.lines
    listing = json.loads(cli.lines[-1])
    assert [p["id"] for p in listing["plans"]] == ["on-b"] and listing["counts"] == {"queued": 1}
