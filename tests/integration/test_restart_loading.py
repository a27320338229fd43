"""A restart on a big store (#18 finding 7): the port opens before the store loads, over real sockets.

The test holds the loader (a real SQLiteStore whose ``load`` waits for the test's go) so the load
is observed deterministically, not by timing: meanwhile ``/healthz`` is 200, ``/readyz`` is 503
"loading the store", and a worker and a client that connect wait in their handshake, then work.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import InvalidStatus

from coordinator.core import CoreConfig
from coordinator.io.frontdoor.server import CoordinatorServer, ServerSettings
from coordinator.io.stores.abilities import StoreAbilities
from coordinator.io.stores.sqlite import SQLiteStore
from coordinator.io.stores.store import DB_FILE
from coordinator.limits import Limits
from coordinator.records import PlanCreated, PlanStatus, Record, StoredPlan
from fleetwire import Client
from protocol.messages import Event, Submit
from worker_agent import Agent, Context

pytestmark = pytest.mark.timeout(60)

PLANS = 3000


class HeldStore:
    """A real SQLite store whose ``load`` tells the test it started, then waits for the test's go."""

    blocking = True
    abilities = StoreAbilities()  # no streamed load: the test holds the whole load

    def __init__(self, path: Path) -> None:
        self.inner = SQLiteStore(path)
        self.description = self.inner.description
        self.started = threading.Event()
        self.go = threading.Event()

    @property
    def closed(self) -> bool:
        return self.inner.closed

    def load(self) -> list[StoredPlan]:
        self.started.set()
        if not self.go.wait(30):
            raise TimeoutError("the test never let the load go on")
        return self.inner.load()

    def write(self, records: Sequence[Record]) -> None:
        self.inner.write(records)

    def close(self) -> None:
        self.inner.close()


def fill(path: Path, plans: int) -> None:
    """A store of ``plans`` queued plans, as a coordinator writes them."""
    store = SQLiteStore(path)
    try:
        for start in range(0, plans, 1000):
            records: list[Record] = []
            for n in range(start, min(plans, start + 1000)):
                pid = f"old-{n}"
                records += [
                    PlanCreated(pid, "", n + 1, Submit(req_id=1, op="parked", args={"n": n}, plan_id=pid)),
                    Event(plan_id=pid, kind="queued", data={}, seq=1),
                    PlanStatus(pid, "queued", next_seq=2),
                ]
            store.write(records)
    finally:
        store.close()


async def http_get(port: int, path: str) -> tuple[int, str]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(f"GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode())
    data = await reader.read()
    writer.close()
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), body.decode()


def settings(limits: Limits | None = None) -> ServerSettings:
    return ServerSettings(port=0, insecure=True, core=CoreConfig(heartbeat_interval_s=0.2, heartbeat_timeout_s=2.0),
                          limits=limits or Limits())  # fmt: skip


async def handshakes_waiting(server: CoordinatorServer, count: int, timeout_s: float = 10.0) -> None:
    """Wait until ``count`` websocket handshakes wait for the load (woken by each one that starts waiting)."""
    async with asyncio.timeout(timeout_s):
        while server.handshakes_waiting < count:
            await server.handshake_waits.wait()
            server.handshake_waits.clear()


async def held_start(tmp_path: Path, limits: Limits | None = None) -> tuple[CoordinatorServer, HeldStore, Any]:
    """A server starting on a filled store, its loader held: returned once the port is open and the load begun."""
    fill(tmp_path / DB_FILE, PLANS)
    store = HeldStore(tmp_path / DB_FILE)
    server = CoordinatorServer(settings(limits), store=store)  # type: ignore[arg-type]
    starting = asyncio.create_task(server.start())
    await asyncio.wait_for(server.listening.wait(), 10)
    assert await asyncio.to_thread(store.started.wait, 10)
    return server, store, starting


async def test_port_opens_before_the_store_loads_and_connects_wait_for_it(tmp_path: Path) -> None:
    """While the store loads: /healthz 200, /readyz and /metrics 503 "loading the store"; a worker and a
    client that connect meanwhile wait in their handshake, then register, submit and get a result."""
    server, store, starting = await held_start(tmp_path)
    agent: Agent | None = None
    worker: asyncio.Task[None] | None = None
    try:
        assert await http_get(server.port, "/healthz") == (200, "ok\n")
        status, body = await http_get(server.port, "/readyz")
        assert status == 503 and "loading the store" in body
        status, body = await http_get(server.port, "/metrics")
        assert status == 503 and "loading the store" in body
        agent = Agent(server.url, None, worker_id="w1", reconnect_base_s=0.02, reconnect_cap_s=0.2,
                      handshake_timeout_s=20)  # fmt: skip

        @agent.handler("echo")
        async def echo(ctx: Context, args: Any) -> Any:
            return args

        worker = asyncio.create_task(agent.run())

        async def submit_and_wait() -> Any:
            async with Client(server.url, token="", open_timeout_s=20) as client:
                plan = await client.submit("echo", {"x": 1})
                return await plan.result()

        result = asyncio.create_task(submit_and_wait())
        await handshakes_waiting(server, 2)  # both wait for the load, none refused
        assert not result.done() and not agent.registered.is_set() and not server.loaded.is_set()
        assert server.refusals == {}
        store.go.set()
        await asyncio.wait_for(starting, 20)
        assert await asyncio.wait_for(result, 20) == {"x": 1}
        assert agent.registered.is_set()
        assert sum(p.op == "parked" and p.state == "queued" for p in server.core.plans.values()) == PLANS
        assert await http_get(server.port, "/readyz") == (200, "ready\n")
        assert server.handshakes_waiting == 0
    finally:
        store.go.set()
        if agent is not None:
            agent.stop()
        if worker is not None:
            await asyncio.wait_for(asyncio.gather(worker, return_exceptions=True), 10)
        if not starting.done():
            await asyncio.gather(starting, return_exceptions=True)
        await server.stop()


async def test_a_handshake_waits_within_the_handshake_timeout_then_gets_503_retry_after(tmp_path: Path) -> None:
    """A load longer than the wait: the handshake gets 503 "loading the store" with Retry-After, counted."""
    server, store, starting = await held_start(tmp_path, Limits(handshake_timeout_s=0.4))
    try:
        with pytest.raises(InvalidStatus) as refused:
            async with connect(server.url + "/v1/client", open_timeout=5):
                pass
        response = refused.value.response
        assert response.status_code == 503 and response.headers["Retry-After"] == "1"
        assert b"loading the store" in response.body and server.refusals == {"503": 1}
        store.go.set()
        await asyncio.wait_for(starting, 20)
        async with connect(server.url + "/v1/client", open_timeout=5):
            pass
    finally:
        store.go.set()
        if not starting.done():
            await asyncio.gather(starting, return_exceptions=True)
        await server.stop()
