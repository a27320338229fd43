"""Fault tolerance end to end: real coordinator and worker processes killed, frozen and restarted
(docs/OPERATIONS.md §Test matrix rows 1, 5, 7, 8, 11). Timeouts are short by flag so the suite stays fast."""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import AsyncIterator
from typing import Any

import pytest

from fleetwire import Client
from fleetwire.plan import Plan
from protocol.messages import TERMINAL_STATES, Event
from tests.e2e.conftest import CLIENT_TOKEN, Cluster

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(90)]

FAST = ("--heartbeat-interval", "0.2", "--heartbeat-timeout", "1", "--reaper-interval", "0.05")
WORKER = ("--reconnect-base", "0.05", "--reconnect-cap", "0.3")


@contextlib.asynccontextmanager
async def client(url: str) -> AsyncIterator[Client]:
    async with Client(url, token=CLIENT_TOKEN, reconnect_base_s=0.05, reconnect_cap_s=0.3, reconnect_give_up_s=60) as c:
        yield c


async def stream(plan: Plan, timeout_s: float = 30.0) -> list[Event]:
    """Every event of the plan until its terminal one."""
    async with asyncio.timeout(timeout_s):
        return [event async for event in plan.events()]


async def until(plan: Plan, check: Any, timeout_s: float = 30.0) -> Event:
    """The first event of the plan for which ``check(event)`` holds."""
    async with asyncio.timeout(timeout_s):
        async for event in plan.events():
            if check(event):
                return event
    raise AssertionError(f"plan {plan.id} ended without the event")


def assert_one_clean_stream(events: list[Event]) -> Event:
    """Seqs 1..n each exactly once and one terminal event, the last; returns it."""
    assert [e.seq for e in events] == list(range(1, len(events) + 1)), [(e.seq, e.kind) for e in events]
    terminal = [e for e in events if e.kind in TERMINAL_STATES]
    assert len(terminal) == 1 and terminal[0] is events[-1]
    return terminal[0]


async def test_worker_killed_mid_plan_completes_elsewhere_once(cluster: Cluster) -> None:
    """kill -9 of the worker running a plan: it is requeued and succeeds on the other worker; one done counts."""
    await cluster.coordinator(*FAST)
    w1 = await cluster.worker("w1", *WORKER)
    async with client(cluster.url) as c:
        plan = await c.submit("sleep", {"seconds": 0.5}, plan_id="crash-1")
        await until(plan, lambda e: e.kind == "running")
        # Killed before w2 exists: on a loaded machine w2's start can outlast the 0.5 s plan.
        w1.stop(signal.SIGKILL)
        await cluster.worker("w2", *WORKER)
        done = assert_one_clean_stream(await stream(plan))
    assert (done.kind, done.data["worker_id"], done.data["attempt"]) == ("succeeded", "w2", 2)
    assert await w1.wait() == -signal.SIGKILL


async def test_coordinator_killed_with_200_plans_in_flight_loses_none(cluster: Cluster) -> None:
    """kill -9 of the coordinator mid-run and a restart on the same store: all 200 acknowledged plans end once."""
    coordinator = await cluster.coordinator(*FAST)
    port = cluster.url.rsplit(":", 1)[1]
    await asyncio.gather(*(cluster.worker(name, *WORKER, "--max-concurrency", "40") for name in ("w1", "w2")))
    async with client(cluster.url) as c:
        plans = await asyncio.gather(*(c.submit("sleep", {"seconds": 0.3}, plan_id=f"p{n}") for n in range(200)))
        streams = [asyncio.create_task(stream(plan, 60)) for plan in plans]
        async with asyncio.timeout(30):
            while sum(plan.done() for plan in plans) < 40:
                await asyncio.wait(streams, return_when=asyncio.FIRST_COMPLETED)
        in_flight = sum(not plan.done() for plan in plans)
        coordinator.stop(signal.SIGKILL)
        await coordinator.wait()
        await cluster.coordinator(*FAST, "--port", port)  # the same store (the cluster's data dir)
        results = await asyncio.gather(*streams)
        infos = [await c.get_plan(f"p{n}") for n in range(200)]
    assert in_flight > 0
    assert all(assert_one_clean_stream(events).kind == "succeeded" for events in results)
    assert [info.state for info in infos] == ["succeeded"] * 200


async def test_frozen_worker_is_fenced_and_the_newer_attempt_wins(cluster: Cluster) -> None:
    """SIGSTOP past the heartbeat timeout, then SIGCONT: the frozen worker's attempt is stale; attempt 2 counts."""
    await cluster.coordinator(*FAST)
    w1 = await cluster.worker("w1", *WORKER)
    async with client(cluster.url) as c:
        plan = await c.submit("sleep", {"seconds": 2}, plan_id="frozen-1")
        await until(plan, lambda e: e.kind == "running")
        w1.stop(signal.SIGSTOP)
        try:
            await cluster.worker("w2", *WORKER)
            await until(plan, lambda e: e.kind == "leased" and e.data["attempt"] == 2)
        finally:
            w1.stop(signal.SIGCONT)
        done = assert_one_clean_stream(await stream(plan))
        workers = {w.id: w for w in (await c.workers()).workers}
    assert (done.kind, done.data["worker_id"], done.data["attempt"]) == ("succeeded", "w2", 2)
    assert w1.proc.returncode is None  # alive again; its late attempt was abandoned, not counted
    assert "w2" in workers


async def test_poison_plan_fails_after_three_attempts(cluster: Cluster) -> None:
    """A plan that kills every worker running it fails worker_lost after 3 attempts, losing 3 workers."""
    await cluster.coordinator(*FAST)
    allow = ("--python-allow", "tests.plan_functions:exit_process")
    workers = await asyncio.gather(*(cluster.worker(f"w{n}", *WORKER, *allow) for n in (1, 2, 3)))
    async with client(cluster.url) as c:
        plan = await c.submit("python", {"function": "tests.plan_functions:exit_process", "args": [13]},
                              plan_id="poison")  # os:_exit itself is a built-in: the python op refuses it
        done = assert_one_clean_stream(await stream(plan, 60))
    assert done.kind == "failed" and done.data["code"] == "worker_lost" and done.data["attempt"] == 3
    attempts = done.data["detail"]["attempts"]
    assert sorted(a["worker_id"] for a in attempts) == ["w1", "w2", "w3"]
    assert [await w.wait() for w in workers] == [13, 13, 13]


class Proxy:
    """A TCP relay to the coordinator whose connections the test can cut (a network drop)."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.port = 0
        self.cuts = 0
        self._writers: set[asyncio.StreamWriter] = set()
        self._server: asyncio.Server | None = None

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._relay, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        self._writers |= {writer, up_writer}

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            with contextlib.suppress(ConnectionError):
                while data := await src.read(65536):
                    dst.write(data)
                    await dst.drain()
            dst.close()

        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer), return_exceptions=True)

    def cut(self) -> None:
        """Abort every relayed connection, as a network drop would (no close frame)."""
        self.cuts += 1
        for writer in self._writers:
            writer.transport.abort()
        self._writers.clear()

    async def close(self) -> None:
        self.cut()
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()


async def test_client_connection_dropped_mid_stream_resumes_without_gap_or_duplicate(cluster: Cluster) -> None:
    """The SDK's connection is cut at seq ~50 of a 300-line stream: events() resumes from there, 1..n once."""
    await cluster.coordinator(*FAST)
    await cluster.worker("w1", *WORKER, "--allow-shell")
    proxy = Proxy(int(cluster.url.rsplit(":", 1)[1]))
    await proxy.start()
    try:
        async with client(f"ws://127.0.0.1:{proxy.port}") as c:
            script = "for i in $(seq 1 300); do echo $i; sleep 0.002; done"
            plan = await c.submit("shell", {"cmd": script}, plan_id="stream-1")
            seen: list[Event] = []
            async with asyncio.timeout(30):
                async for event in plan.events():
                    seen.append(event)
                    if event.seq == 50:
                        proxy.cut()
    finally:
        await proxy.close()
    assert proxy.cuts >= 1 and c.session.resumed >= 1  # the stream really went over a second connection
    assert assert_one_clean_stream(seen).kind == "succeeded"
    assert [e.data for e in seen if e.kind == "stdout"] == [str(n) for n in range(1, 301)]
