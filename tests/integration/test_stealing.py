"""Prefetch and work stealing across the real stack: coordinator server, worker agents and SDK over loopback."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import pytest

from coordinator.core import CoreConfig
from coordinator.io.frontdoor.server import CoordinatorServer, ServerSettings
from coordinator.placement.placer import PlacementConfig
from fleetwire import Client
from worker_agent import Agent, Context

pytestmark = pytest.mark.timeout(30)


@contextlib.asynccontextmanager
async def serving(settings: ServerSettings) -> AsyncIterator[CoordinatorServer]:
    server = CoordinatorServer(settings)
    await server.start()
    try:
        yield server
    finally:
        await server.stop()


@contextlib.asynccontextmanager
async def agent_running(url: str, worker_id: str, gate: asyncio.Event) -> AsyncIterator[Agent]:
    agent = Agent(url, None, worker_id=worker_id, max_concurrency=1, reconnect_base_s=0.01, reconnect_cap_s=0.05)

    @agent.handler("gated")
    async def gated(ctx: Context, args: Any) -> str:
        await gate.wait()
        return ctx.worker_id

    task = asyncio.create_task(agent.run())
    await asyncio.wait_for(agent.registered.wait(), 10)
    try:
        yield agent
    finally:
        agent.stop()
        agent.stop()
        await asyncio.wait_for(task, 10)


async def test_idle_worker_steals_a_prefetched_plan() -> None:
    """Three plans on a one-slot worker with prefetch 2: a second worker joins and one of them is revoked to it."""
    settings = ServerSettings(
        port=0, insecure=True, core=CoreConfig(placement=PlacementConfig(policy="least_busy", prefetch=2))
    )
    gate = asyncio.Event()
    async with serving(settings) as server, agent_running(server.url, "busy", gate):
        async with Client(server.url) as client:
            plans = [await client.submit("gated", n) for n in range(3)]
            leases = Leases(plans)
            await leases.until(lambda held: all(held[p.id] == ["busy"] for p in plans))
            async with agent_running(server.url, "idle", gate):
                await leases.until(lambda held: sum(ids == ["busy", "idle"] for ids in held.values()) == 1)
                gate.set()
                results = await asyncio.wait_for(asyncio.gather(*(p.result() for p in plans)), 10)
            leases.close()
    assert sorted(results) == ["busy", "busy", "idle"]
    assert server.core.counters["plans_revoked"] == 1


class Leases:
    """The workers each plan was leased to, in order, from the plans' ``leased`` events."""

    def __init__(self, plans: list[Any]) -> None:
        self.held: dict[str, list[str]] = {p.id: [] for p in plans}
        self.changed = asyncio.Event()
        self._tasks = [asyncio.create_task(self._follow(p)) for p in plans]

    async def _follow(self, plan: Any) -> None:
        async for event in plan.events():
            if event.kind == "leased":
                self.held[plan.id].append(event.data["worker_id"])
                self.changed.set()

    async def until(self, condition: Any) -> None:
        """Wait (on the events, at most 10 s) until ``condition(held)`` is true."""
        async with asyncio.timeout(10):
            while not condition(self.held):
                self.changed.clear()
                await self.changed.wait()

    def close(self) -> None:
        for task in self._tasks:
            task.cancel()
