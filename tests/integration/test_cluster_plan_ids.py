"""Cluster mode: plan ids are scoped per principal through a main port's view sessions (issue #24 part 6;
coordinator/io/cluster/views.py, sessions.py).

An in-process cluster host serving two shards on a real PostgreSQL (tests/pg.py; skipped without one), a
token file with client principals and an admin, and SDK clients: the same id in two shards (alice's ``job`` on
shard 0, bob's newer one on shard 1: the rows' look-up by id used to take the newest, bob's, whoever asked),
and in one shard (bob's under a key the core made, its ``name`` column the id he gave).
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from coordinator.auth import hash_token
from coordinator.io.cluster.host import ClusterHost
from coordinator.io.frontdoor.server import ServerSettings
from fleetwire import Client
from fleetwire.errors import PlanNotFound
from protocol.messages import ListPlans, Plans
from tests.integration.test_cluster_view_all import CLUSTER, pool_on

pytestmark = pytest.mark.timeout(120)

TOKENS = {"alice": "alice-token-0123456789abcdef", "bob": "bob-token-0123456789abcdefgh",
          "mallory": "mallory-token-0123456789abcd"}
ADMIN = "root-token-0123456789abcdefghij"


async def listing(client: Client, **filters: Any) -> Plans:
    """One ``list_plans`` page with ``filters`` (the SDK's ``plans()`` has no filters)."""
    reply: Plans = await client._request(ListPlans(req_id=client._session.next_req_id(), **filters), Plans)
    return reply


def write_tokens(path: Path) -> Path:
    """A token file of the client principals of :data:`TOKENS` and the admin ``root``."""
    path.write_text("".join(f'[[token]]\nname = "{name}"\nrole = "client"\nhash = "{hash_token(token)}"\n'
                            for name, token in TOKENS.items())
                    + f'[[token]]\nname = "root"\nrole = "admin"\nhash = "{hash_token(ADMIN)}"\n')  # fmt: skip
    return path


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
    host = await serving_host(pg_dsn, write_tokens(tmp_path / "tokens.toml"))
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


async def test_two_principals_plans_of_one_id_in_one_shard_are_each_ones_own_through_a_view_session(
    pg_dsn: str, tmp_path: Path
) -> None:
    """alice's and bob's ``job`` on one shard (bob's under a key the core made, its ``name`` column ``job``):
    through the main port each one's get_plan, listing and watch find its own by ``job``; mallory's look-up of
    ``job`` answers exactly as an unused id; an admin sees bob's by key, with owner and name."""
    host = await serving_host(pg_dsn, write_tokens(tmp_path / "tokens.toml"))
    try:
        pool = pool_on(0)
        for name in ("alice", "bob"):
            async with Client(host.url, token=TOKENS[name], pool=pool) as client:
                await client.submit("echo", {"who": name}, tags=[f"pool:{pool}"], plan_id="job")  # no worker: queued
        async with Client(host.url, token=TOKENS["bob"]) as bob:  # no pool: a view session
            info = await bob.get_plan("job")
            assert (info.id, info.owner, info.name) == ("job", "bob", None)
            listed = await listing(bob, id_contains="job")
            assert [(p.id, p.owner) for p in listed.plans] == [("job", "")] and listed.total == 1
            watched = await bob.watch("job")
            async with asyncio.timeout(30):
                first = await watched.events().__anext__()
            assert (first.plan_id, first.kind) == ("job", "queued")
            cancelled = await bob.cancel("job")  # forwarded to the shard's core with bob's token
            assert (cancelled.id, cancelled.state) == ("job", "cancelled")
        async with Client(host.url, token=TOKENS["alice"]) as alice:
            assert (await alice.get_plan("job")).state == "queued"
        async with Client(host.url, token=ADMIN) as root:
            rows = (await root.plans()).plans
            key = next(p.id for p in rows if p.name == "job")
            assert key != "job" and sorted((p.id == "job", p.name) for p in rows) == [(False, "job"), (True, None)]
            info = await root.get_plan(key)
            assert (info.owner, info.name, info.state) == ("bob", "job", "cancelled")
            assert (await listing(root, id_contains=key)).total == 1
        async with Client(host.url, token=TOKENS["bob"]) as bob:  # his plan's key is no id of his
            assert (await listing(bob, id_contains=key)).total == 0
        async with Client(host.url, token=TOKENS["mallory"]) as mallory:
            said = {}
            for plan_id in ("job", "nobody-has-this"):
                with pytest.raises(PlanNotFound) as caught:
                    await mallory.get_plan(plan_id)
                said[plan_id] = str(caught.value).replace(plan_id, "ID")
                with pytest.raises(PlanNotFound):
                    await mallory.cancel(plan_id)
            assert said["job"] == said["nobody-has-this"]
    finally:
        await host.stop()
