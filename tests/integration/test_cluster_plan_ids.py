"""Cluster mode: another principal reusing your plan id in another shard does not take it from you through
a main port's view session (issue #24 part 6; coordinator/io/cluster_views.py ``plan_shard``).

An in-process cluster host serving two shards on a real PostgreSQL (tests/pg.py; skipped without one), a
token file with two client principals, and SDK clients: alice's ``job`` lives on shard 0, bob's newer
``job`` on shard 1 (the rows' look-up by id used to take the newest, bob's, whoever asked).
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from coordinator.auth import hash_token
from coordinator.io.cluster_host import ClusterHost
from coordinator.io.server import ServerSettings
from fleetwire import Client
from fleetwire.errors import PlanNotFound
from tests.integration.test_cluster_view_all import CLUSTER, pool_on

pytestmark = pytest.mark.timeout(120)

TOKENS = {"alice": "alice-token-0123456789abcdef", "bob": "bob-token-0123456789abcdefgh"}


async def serving_host(dsn: str, token_file: Path) -> ClusterHost:
    """A started cluster host serving every shard, with the token file's principals."""
    served = asyncio.Event()

    def announce(line: str) -> None:
        if line.startswith("serving shard") and len(host.servers) >= CLUSTER.shards:
            served.set()

    host = ClusterHost(ServerSettings(port=0, token_file=str(token_file), store=dsn, cluster=CLUSTER),
                       announce=announce)  # fmt: skip
    await host.start()
    await asyncio.wait_for(served.wait(), 30)
    return host


async def test_a_view_sessions_cancel_and_subscribe_find_the_callers_plan_not_a_newer_one_of_another(
    pg_dsn: str, tmp_path: Path
) -> None:
    """alice's job (shard 0), then bob's job (shard 1): through the main port alice's cancel cancels hers and
    her watch follows hers, bob's cancel cancels his; neither is told the id belongs to another principal."""
    token_file = tmp_path / "tokens.toml"
    token_file.write_text("".join(f'[[token]]\nname = "{name}"\nrole = "client"\nhash = "{hash_token(token)}"\n'
                                  for name, token in TOKENS.items()))  # fmt: skip
    host = await serving_host(pg_dsn, token_file)
    try:
        for name, shard in (("alice", 0), ("bob", 1)):
            pool = pool_on(shard)
            async with Client(host.url, token=TOKENS[name], pool=pool) as client:
                await client.submit("echo", {}, tags=[f"pool:{pool}"], plan_id="job")  # no worker: queued
        async with Client(host.url, token=TOKENS["alice"]) as alice:  # no pool: a view session
            watched = await alice.watch("job")
            info = await alice.cancel("job")
            assert (info.state, info.owner) == ("cancelled", "alice")
            async with asyncio.timeout(30):
                await watched.events().__anext__()  # its replay came: the stream is alice's plan
            assert watched.id == "job"
        async with Client(host.url, token=TOKENS["bob"]) as bob:
            info = await bob.cancel("job")
            assert (info.state, info.owner) == ("cancelled", "bob")
            with pytest.raises(PlanNotFound):
                await bob.get_plan("nobody-has-this")
    finally:
        await host.stop()
