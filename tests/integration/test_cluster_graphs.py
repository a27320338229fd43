"""References across shards (cluster mode, issue #28): a consumer submitted on one shard runs on the output of a
producer of another shard (coordinator/io/cluster/remote_refs.py, coordinator/graphs/remote.py).

An in-process cluster host serving two shards on a real PostgreSQL (tests/pg.py; skipped without one), one worker
agent with a data endpoint per shard's pool, and SDK clients submitting to each pool's shard.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from coordinator.io.cluster.host import ClusterHost
from coordinator.io.frontdoor.server import ServerSettings
from fleetwire import Client, OutputRef
from fleetwire.errors import FleetwireError
from protocol import errors
from tests.integration.data_helpers import digest
from tests.integration.test_cluster_view_all import CLUSTER, pool_on, serving_host
from tests.waiting import until
from worker_agent.agent import Agent

pytestmark = pytest.mark.timeout(120)

SIZE = (1 << 20) + 333


@contextlib.asynccontextmanager
async def two_shards(dsn: str, tmp_path: Path, gate: asyncio.Event,
                     hosts: int = 1) -> AsyncIterator[tuple[list[ClusterHost], list[str]]]:  # fmt: skip
    """A host serving shards 0 and 1, and worker ``w0`` of shard 0's pool and ``w1`` of shard 1's (each with a data
    endpoint); ``make`` writes output ``y`` once ``gate`` is set, ``take`` answers its input's digest. ``hosts`` 2:
    a second host, each serving one shard (the workers dial both). Yields the hosts and the two pools."""

    async def make(ctx: Any, args: Any) -> None:
        await gate.wait()
        if args and args.get("fail"):
            raise RuntimeError("producer failed on purpose")
        ctx.output("y", os.urandom(SIZE))

    async def take(ctx: Any, args: Any) -> str:
        return digest(ctx.inputs["x"].path.read_bytes())

    host = await serving_host(dsn)
    started = [host]
    agents: list[Agent] = []
    tasks: list[asyncio.Task[None]] = []
    try:
        if hosts == 2:
            started.append(other := ClusterHost(ServerSettings(port=0, insecure=True, store=dsn, cluster=CLUSTER)))
            await other.start()
            await until(lambda: all(len(h.servers) == 1 and not h.cores.moving for h in started), timeout_s=60)
        pools = [pool_on(0), pool_on(1)]
        urls = ",".join(h.url for h in started)
        agents = [Agent(urls, "token", worker_id=f"w{shard}", tags=[f"pool:{pools[shard]}"],
                        spool_dir=str(tmp_path / f"w{shard}"), data_listen="127.0.0.1:0", input_timeout_s=10.0)
                  for shard in (0, 1)]  # fmt: skip
        for agent in agents:
            agent.add_handler("make", make)
            agent.add_handler("take", take)
        tasks = [asyncio.create_task(agent.run()) for agent in agents]
        for agent in agents:
            await asyncio.wait_for(agent.registered.wait(), 30)
        yield started, pools
    finally:
        for agent in agents:
            agent.stop()
            agent.stop()
        for task in tasks:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(task, 10)
        for each in reversed(started):
            await each.stop()


@pytest.mark.parametrize("hosts", [1, 2], ids=["one_host", "two_hosts"])
async def test_a_consumer_on_one_shard_runs_on_the_output_of_a_producer_on_another(
    pg_dsn: str, tmp_path: Path, hosts: int
) -> None:
    """A (shard 0's pool) runs; B (shard 1's pool) on A's output is accepted and waits; once A succeeded B runs on
    shard 1's worker with A's bytes pulled worker to worker from shard 0's worker (via pull), and C on a failing
    producer of shard 0 fails upstream_failed naming it. Two hosts, each serving one shard: B's ticket, signed by
    one coordinator, verifies on the worker of the other's shard (the shared key is the database's)."""
    gate = asyncio.Event()
    async with two_shards(pg_dsn, tmp_path, gate, hosts) as (started, pools):
        urls = [h.url for h in started]
        async with Client(urls, pool=pools[0]) as first, Client(urls, pool=pools[1]) as second:
            a = await first.submit("make", {}, outputs=["y"], tags=[f"pool:{pools[0]}"], plan_id="a")
            await first.submit("make", {"fail": True}, outputs=["y"], tags=[f"pool:{pools[0]}"], plan_id="bad")
            b = await second.submit("take", inputs={"x": OutputRef("a", "y")}, tags=[f"pool:{pools[1]}"],
                                    plan_id="b")  # fmt: skip
            c = await second.submit("take", inputs={"x": OutputRef("bad", "y")}, tags=[f"pool:{pools[1]}"],
                                    plan_id="c")  # fmt: skip
            assert (await second.get_plan("b")).state == "queued"
            owner = next(h for h in started if 1 in h.servers)
            assert owner.cores.refs[1].lookups == 2 and (hosts == 1 or 0 not in owner.servers)
            gate.set()
            result = await asyncio.wait_for(b.result(), 60)
            assert result == digest(await a.output("y"))
            assert (a.worker_id, b.worker_id) == ("w0", "w1")
            via = {e.data["name"]: e.data["via"] for e in b._stream.events if e.kind == "input_received"}
            assert via == {"x": "pull"}
            with pytest.raises(FleetwireError):
                await asyncio.wait_for(c.result(), 60)
            info = await second.get_plan("c")
            assert info.error is not None and info.error.code == errors.UPSTREAM_FAILED, info.error
            assert "plan bad" in info.error.message and (await first.get_plan("bad")).state == "failed"
            with pytest.raises(FleetwireError, match="has not submitted in any shard of this cluster"):
                await second.submit("take", inputs={"x": OutputRef("nobody", "y")}, tags=[f"pool:{pools[1]}"])


async def test_a_new_owner_of_the_consumers_shard_waits_on_the_remote_upstream_again(
    pg_dsn: str, tmp_path: Path
) -> None:
    """B (shard 1) waits on A (shard 0); shard 1 is handed off and served again by a new core loaded from PostgreSQL:
    its B waits on A again (from its stored reference), and runs on A's output once A succeeds."""
    gate = asyncio.Event()
    async with (two_shards(pg_dsn, tmp_path, gate) as ([host], pools), Client(host.url, pool=pools[0]) as first,
                Client(host.url, pool=pools[1]) as second):  # fmt: skip
        a = await first.submit("make", {}, outputs=["y"], tags=[f"pool:{pools[0]}"], plan_id="a")
        await second.submit("take", inputs={"x": OutputRef("a", "y")}, tags=[f"pool:{pools[1]}"], plan_id="b")
        old = host.servers[1]
        await host.cores.stop(1, release=True, why="handed off by the test")
        await until(lambda: 1 in host.servers and host.servers[1] is not old, timeout_s=30)
        graphs = host.servers[1].core.graphs
        assert graphs.remotes.plans and host.servers[1].core.plans["b"].state == "queued"
        gate.set()
        await until(lambda: host.servers[1].core.plans["b"].state == "succeeded", timeout_s=60)
        assert host.servers[1].core.plans["b"].result == digest(await a.output("y"))


async def test_a_submit_whose_upstream_cannot_be_looked_up_is_answered_unavailable_and_sent_again(
    pg_dsn: str, tmp_path: Path
) -> None:
    """While shard 1's driver cannot read the database, B's submit (naming A of shard 0) is answered unavailable,
    not refused; the SDK sends it again, and once the database answers B is accepted waiting on A."""
    gate = asyncio.Event()
    async with (two_shards(pg_dsn, tmp_path, gate) as ([host], pools), Client(host.url, pool=pools[0]) as first,
                Client(host.url, pool=pools[1]) as second):  # fmt: skip
        await first.submit("make", {}, outputs=["y"], tags=[f"pool:{pools[0]}"], plan_id="a")
        refs = host.cores.refs[1]
        reachable = refs.connect

        @contextlib.asynccontextmanager
        async def unreachable() -> AsyncIterator[Any]:
            import asyncpg  # type: ignore[import-untyped]

            conn = await asyncpg.connect("postgresql://nobody@127.0.0.1:1/none", timeout=5)  # refused
            yield conn  # pragma: no cover

        refs.connect = unreachable
        submit = asyncio.create_task(
            second.submit("take", inputs={"x": OutputRef("a", "y")}, tags=[f"pool:{pools[1]}"], plan_id="b"))
        driver = host.servers[1].driver
        await until(lambda: driver.unavailable_answers >= 1, timeout_s=30)
        refs.connect = reachable
        b = await asyncio.wait_for(submit, 30)
        assert (await second.get_plan(b.id)).state == "queued"
        gate.set()
        await asyncio.wait_for(b.result(), 60)
