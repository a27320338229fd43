"""Coordinator restarts over real loopback sockets: SQLite store, worker agent and SDK resume in one process."""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path
from typing import Any

import pytest

from coordinator.core import CoreConfig
from coordinator.io.frontdoor.server import CoordinatorServer, ServerSettings
from coordinator.io.stores.store import MemoryStore
from fleetwire import Client
from worker_agent import Agent, Context

pytestmark = pytest.mark.timeout(30)


def settings(tmp_path: Path, port: int = 0) -> ServerSettings:
    # The heartbeat timeout is generous: the coordinator, the worker and the client share one loop here, and a
    # loaded CI host once held it past 1 s, so the worker was reaped and job-1 re-run (attempt 2). No test of this
    # file waits for a reap; a worker reconnecting after a restart is back well within it.
    return ServerSettings(
        port=port, insecure=True, core=CoreConfig(heartbeat_interval_s=0.2, heartbeat_timeout_s=5.0),
        reaper_interval_s=0.05,
        store=f"sqlite:{tmp_path / 'coordinator.sqlite3'}",
    )  # fmt: skip


def fast_client(url: str) -> Client:
    return Client(url, token="", reconnect_base_s=0.02, reconnect_cap_s=0.2, reconnect_give_up_s=10)


def fast_agent(url: str, gate: asyncio.Event) -> Agent:
    agent = Agent(url, None, worker_id="w1", reconnect_base_s=0.02, reconnect_cap_s=0.2, handshake_timeout_s=5)

    @agent.handler("gated")
    async def gated(ctx: Context, args: Any) -> str:
        ctx.emit("started")
        await gate.wait()
        ctx.emit("finished")
        return "done"

    return agent


async def next_kind(events: Any, kind: str) -> None:
    async with asyncio.timeout(10):
        async for event in events:
            if event.kind == kind:
                return


async def test_running_plan_survives_a_coordinator_restart(tmp_path: Path) -> None:
    """Coordinator stopped mid-plan and restarted on its store: the worker continues it, the client resumes,
    and the stream has every seq once (matrix rows 8 and 11)."""
    first = CoordinatorServer(settings(tmp_path))
    await first.start()
    gate = asyncio.Event()
    agent = fast_agent(first.url, gate)
    worker = asyncio.create_task(agent.run())
    second: CoordinatorServer | None = None
    try:
        async with fast_client(first.url) as client:
            plan = await client.submit("gated", plan_id="job-1")
            events = plan.events()
            await next_kind(events, "started")
            await first.stop()  # closes every session with 1001
            second = CoordinatorServer(settings(tmp_path, port=first.port))
            await second.start()
            assert second.core.plans["job-1"].state == "running"
            await asyncio.wait_for(agent.registered.wait(), 10)  # the worker is back and continues job-1
            gate.set()
            assert await asyncio.wait_for(plan.result(), 10) == "done"
            stream = [event async for event in plan.events()]
        seqs = [event.seq for event in stream]
        assert seqs == list(range(1, len(seqs) + 1))
        kinds = [event.kind for event in stream]
        assert kinds.count("started") == kinds.count("finished") == kinds.count("succeeded") == 1
        assert stream[-1].data["attempt"] == 1  # the same attempt went on: nothing was re-run
        assert second.core.counters["plans_requeued"] == 0
    finally:
        agent.stop()
        agent.stop()
        await asyncio.wait_for(worker, 10)
        if second is not None:
            await second.stop()


async def test_submit_is_idempotent_across_a_restart(tmp_path: Path) -> None:
    """A plan id submitted before a restart and again after it names one plan, with its state (matrix row 12)."""
    first = CoordinatorServer(settings(tmp_path))
    await first.start()
    async with fast_client(first.url) as client:
        await client.submit("nobody-runs-this", plan_id="job-7")
    await first.stop()
    second = CoordinatorServer(settings(tmp_path, port=first.port))
    await second.start()
    try:
        async with fast_client(second.url) as client:
            again = await client.submit("nobody-runs-this", plan_id="job-7")
            assert again.duplicate and again.state == "queued"
            assert list(second.core.plans) == ["job-7"]
    finally:
        await second.stop()


async def test_client_resumes_when_a_memory_store_coordinator_restarts_in_process() -> None:
    """A server restarted with the same MemoryStore object restores its plans; the SDK's watch resumes."""
    store = MemoryStore()
    base = dataclasses.replace(settings(Path("/nonexistent")), store="memory")
    first = CoordinatorServer(base, store=store)
    await first.start()
    second: CoordinatorServer | None = None
    try:
        async with fast_client(first.url) as client:
            plan = await client.submit("nobody-runs-this")
            await next_kind(plan.events(), "waiting")
            await first.stop()
            second = CoordinatorServer(dataclasses.replace(base, port=first.port), store=store)
            await second.start()
            info = await asyncio.wait_for(client.get_plan(plan.id), 10)  # sent again on the new session
            assert info.state == "queued" and not client.closed
    finally:
        if second is not None:
            await second.stop()


async def test_watch_after_a_restart_marks_lost_ephemeral_events_with_resync(tmp_path: Path) -> None:
    """Ephemeral events do not survive a restart: a replay from seq 0 yields a resync marker in their
    place, the durable events around it, and seqs 1..n with no silent gap."""
    first = CoordinatorServer(settings(tmp_path))
    await first.start()
    gate = asyncio.Event()
    agent = Agent(first.url, None, worker_id="w1", reconnect_base_s=0.02, reconnect_cap_s=0.2)

    @agent.handler("tokens")
    async def tokens(ctx: Context, args: Any) -> str:
        for token in ("a", "b", "c"):
            ctx.emit("token", token, ephemeral=True)
        ctx.emit("log", "after the tokens")
        await gate.wait()
        return "ok"

    worker = asyncio.create_task(agent.run())
    second: CoordinatorServer | None = None
    try:
        await asyncio.wait_for(agent.registered.wait(), 10)
        async with fast_client(first.url) as client:
            plan = await client.submit("tokens", plan_id="job-t")
            await next_kind(plan.events(), "log")
        await first.stop()
        second = CoordinatorServer(settings(tmp_path, port=first.port))
        await second.start()
        async with fast_client(second.url) as client:
            watched = await client.watch("job-t")
            await asyncio.wait_for(agent.registered.wait(), 10)
            gate.set()
            stream = [event async for event in watched.events()]
        kinds = [event.kind for event in stream]
        assert kinds[:5] == ["queued", "leased", "running", "resync", "log"] and kinds[-1] == "succeeded"
        marker = stream[3]
        assert (marker.data["first_seq"], marker.data["last_seq"], marker.data["recovered"]) == (4, 6, False)
        assert marker.seq == 6 and watched.resyncs == 1  # the three tokens: seqs 4-6
        assert [event.seq for event in stream] == list(range(1, 4)) + list(range(6, 6 + len(stream) - 3))
    finally:
        agent.stop()
        agent.stop()
        await asyncio.wait_for(worker, 10)
        if second is not None:
            await second.stop()
