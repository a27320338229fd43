"""Which messages a shard core's port shows cluster mode's redirect (coordinator/io/frontdoor/core_driver.py
``CoreSession.take``): only a ``hello`` and a ``submit`` can move a session, so no other message pays the call;
a hello of another pool and a submit of another shard are still moved. The real coordinator, agent and client
over loopback, with the real ``ClusterHost.redirect`` (its rows set as a scan would) as the server's redirect.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import AsyncIterator
from typing import Any

import pytest

from coordinator.io.cluster.host import ClusterHost
from coordinator.io.frontdoor.server import CoordinatorServer, ServerSettings
from coordinator.shards import ClusterConfig, LeaseRow, pool_shard
from fleetwire import Client
from protocol.messages import Hello, Moved, Submit
from tests.waiting import until
from worker_agent import Agent

pytestmark = pytest.mark.timeout(60)

SHARDS = 16
NOBODY = "ws://127.0.0.1:1"  # the other shard's owner as the scan has it: never dialled successfully here
OTHER_POOL = next(f"pool{i}" for i in range(1000) if pool_shard(f"pool{i}", SHARDS) != 0)


class Seen:
    """Shard 0's real redirect, with each call's (role, message type, answer) kept."""

    def __init__(self) -> None:
        config = ClusterConfig(shards=SHARDS)
        host = ClusterHost(ServerSettings(port=0, insecure=True, store="postgresql://nobody@127.0.0.1:1/none",
                                          cluster=config))  # fmt: skip
        host.rows = [LeaseRow(pool_shard(OTHER_POOL, SHARDS), "other", 2, True, NOBODY)]
        self.check = functools.partial(host.redirect, 0)
        self.calls: list[tuple[str, type, Moved | None]] = []

    def __call__(self, role: str, msg: Any) -> Moved | None:
        moved = self.check(role, msg)
        self.calls.append((role, type(msg), moved))
        return moved


@pytest.fixture
async def served() -> AsyncIterator[tuple[CoordinatorServer, Seen]]:
    seen = Seen()
    server = CoordinatorServer(ServerSettings(port=0, insecure=True, store="memory"), redirect=seen)
    await server.start()
    try:
        yield server, seen
    finally:
        await server.stop()


@contextlib.asynccontextmanager
async def running(agent: Agent) -> AsyncIterator[asyncio.Task[Any]]:
    task = asyncio.create_task(agent.run())
    try:
        yield task
    finally:
        task.cancel()
        with contextlib.suppress(BaseException):
            await task


async def test_only_hellos_and_submits_reach_the_redirect(served: tuple[CoordinatorServer, Seen]) -> None:
    """A worker's accepts, events and results and a client's other requests never call the redirect; its hello and
    the client's submits each call it once and stay (their shard is this one)."""
    server, seen = served
    async with running(Agent(server.url, worker_id="w-here")) as _:
        await until(lambda: len(server.core.registry) == 1, 10)
        async with Client(server.url) as client:
            for i in range(3):
                assert await (await client.submit("echo", args={"i": i})).result() == {"i": i}
            await client.workers()
    assert sorted({(role, kind) for role, kind, _ in seen.calls}, key=str) == [("client", Submit), ("worker", Hello)]
    assert [kind for role, kind, _ in seen.calls if role == "client"] == [Submit] * 3
    assert all(moved is None for _, _, moved in seen.calls)


async def test_a_hello_of_another_pool_is_still_moved(served: tuple[CoordinatorServer, Seen]) -> None:
    """A worker of another pool's shard is moved at its hello (to that shard's owner) and never registers here."""
    server, seen = served
    async with running(Agent(server.url, worker_id="w-away", tags=[f"pool:{OTHER_POOL}"])):
        await until(lambda: any(kind is Hello and moved is not None for _, kind, moved in seen.calls), 10)
    moved = next(moved for _, kind, moved in seen.calls if kind is Hello)
    assert moved == Moved(url=NOBODY, epoch=2, shard=pool_shard(OTHER_POOL, SHARDS))
    assert len(server.core.registry) == 0


async def test_a_submit_of_another_shard_is_still_moved(served: tuple[CoordinatorServer, Seen]) -> None:
    """A client's submit of another pool's shard is moved to that shard's owner; the core never takes the plan."""
    server, seen = served
    async with Client(server.url) as client:
        submitting = asyncio.create_task(client.submit("echo", args=1, tags=[f"pool:{OTHER_POOL}"]))
        try:
            await until(lambda: any(kind is Submit and moved is not None for _, kind, moved in seen.calls), 10)
        finally:
            submitting.cancel()
            with contextlib.suppress(BaseException):
                await submitting
    moved = next(moved for _, kind, moved in seen.calls if kind is Submit)
    assert moved == Moved(url=NOBODY, epoch=2, shard=pool_shard(OTHER_POOL, SHARDS))
    assert not server.core.plans
