"""A cluster host's stop waits for the store that a shard's start it cancelled was still opening
(coordinator/io/cluster/host.py ``ClusterHost.stop``; teardown.py ``opened``, ``settled``).

test_cluster_shared_key.py's teardown warned now and then of two unclosed asyncpg connections: its
``host.stop()`` cancelled a shard's start while the shard's store connected in a thread, and the store,
made after the stop had returned, was closed later by a callback (or, the loop ended, never); so was one
whose core was still loading its plans. Here the store's constructor (or its load) waits for the test's
gate, which opens as the stop closes its control connection (its last step before this fix): the stop
must not return before that store is made and closed. Without the gate ever opening the stop gives up
within its bound, says so, and the store is still closed once made. On a real PostgreSQL (tests/pg.py;
skipped without one).
"""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import asyncpg  # type: ignore[import-untyped]
import pytest
from structlog.testing import capture_logs

from coordinator.io.cluster import cores as cores_module
from coordinator.io.cluster import host as host_module
from coordinator.io.cluster import teardown
from coordinator.io.cluster.cores import ShardPgStore
from coordinator.io.cluster.host import ClusterHost
from coordinator.io.cluster.teardown import STOP_DB_S, STOP_TASK_S
from coordinator.io.frontdoor.server import ServerSettings
from coordinator.io.stores.integrity import StoreError
from coordinator.shards import ClusterConfig
from tests.waiting import until

pytestmark = pytest.mark.timeout(90)

CLUSTER = ClusterConfig(shards=1, lease_ttl_s=30.0, lease_renew_s=0.2)


def slow_store(
    monkeypatch: pytest.MonkeyPatch, *, slow_load: bool = False
) -> tuple[threading.Event, threading.Event, list[ShardPgStore]]:
    """The shard's store, whose constructor (``slow_load``: whose load of the plans) waits in its thread for the
    returned gate before it connects (reads): (entered, gate, the stores made)."""
    entered, gate = threading.Event(), threading.Event()
    made: list[ShardPgStore] = []

    class Slow(ShardPgStore):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            if not slow_load:
                entered.set()
                gate.wait(60)
            super().__init__(*args, **kwargs)
            made.append(self)

        def load(self) -> Any:
            if slow_load:
                entered.set()
                gate.wait(60)
            return super().load()

    monkeypatch.setattr(cores_module, "ShardPgStore", Slow)
    return entered, gate, made


def gated_host(dsn: str, gate: threading.Event, monkeypatch: pytest.MonkeyPatch) -> ClusterHost:
    """A host whose stop opens ``gate`` once it has closed its control connection (its last step of its own)."""
    host = ClusterHost(ServerSettings(port=0, store=dsn, cluster=CLUSTER, insecure=True))
    control = host.control
    assert control is not None
    close_control = control.close

    def close_and_open_the_gate() -> None:  # (in the stop's thread for it)
        close_control()
        gate.set()

    monkeypatch.setattr(control, "close", close_and_open_the_gate)
    return host


async def close_left(made: list[ShardPgStore]) -> list[ShardPgStore]:
    """The stores left open (closed here, so that a failing test leaves nothing behind)."""
    left = [store for store in made if not store.closed]
    for store in left:
        await asyncio.to_thread(store.close)
    return left


@pytest.mark.parametrize("slow_load", [False, True], ids=["opening", "loading"])
async def test_a_stop_returns_only_once_the_store_a_cancelled_shard_start_was_opening_is_closed(
    pg_dsn: str, monkeypatch: pytest.MonkeyPatch, slow_load: bool
) -> None:
    """The shard's store is made (its core's load ends) as the stop closes its control connection: the stop
    returns with it closed."""
    entered, gate, made = slow_store(monkeypatch, slow_load=slow_load)
    host = gated_host(pg_dsn, gate, monkeypatch)
    await host.start()
    try:
        assert await asyncio.to_thread(entered.wait, 30)
        await asyncio.wait_for(host.stop(), STOP_TASK_S + STOP_DB_S + 10)
        assert gate.is_set()
        made_by_then = list(made)
        closed_by_then = [store for store in made_by_then if store.closed]
    finally:
        gate.set()
    if not made_by_then:  # the bug: the stop returned while the store was still opening
        await until(lambda: bool(made), timeout_s=15)
    left = await close_left(made)
    assert made_by_then, "the stop returned while the shard's store was still opening"
    assert closed_by_then == made_by_then and not left, "the stop returned with the shard's store open"
    assert len(made) == 1


@pytest.mark.parametrize("slow_load", [False, True], ids=["opening", "loading"])
async def test_a_stop_gives_back_the_slot_of_a_shard_whose_start_it_cancelled(
    pg_dsn: str, monkeypatch: pytest.MonkeyPatch, slow_load: bool
) -> None:
    """A won shard whose store is still opening (whose core still loads) when the stop comes: the stop cancels
    that start and releases the slot (a standby takes it at its next scan) instead of leaving it to expire after
    the lease's TTL."""
    entered, gate, made = slow_store(monkeypatch, slow_load=slow_load)
    host = gated_host(pg_dsn, gate, monkeypatch)
    await host.start()
    try:
        assert await asyncio.to_thread(entered.wait, 30)
        with capture_logs() as logs:
            await asyncio.wait_for(host.stop(), STOP_TASK_S + STOP_DB_S + 10)
    finally:
        gate.set()
    try:
        await until(lambda: bool(made) and made[0].closed, timeout_s=15)
    except TimeoutError:
        pass
    await close_left(made)
    conn = await asyncpg.connect(pg_dsn)
    try:
        released = await conn.fetchval("SELECT expires_at <= now() FROM shard_leases WHERE shard = 0")
    finally:
        await conn.close()
    assert released, "the slot of the shard whose start the stop cancelled was left to expire after the TTL"
    cancelled = [e for e in logs if e["event"] == "a shard's start was cancelled by the host's stop"]
    assert [(e["shard"], e["release_left_to_the_stop"]) for e in cancelled] == [(0, True)]


async def test_a_store_still_opening_past_the_stops_bound_is_logged_and_closed_once_made(
    pg_dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The shard's store is not made within the stop's bound: the stop returns after it, says so, and the store
    is closed once made (nobody uses it)."""
    for module in (host_module, teardown):
        monkeypatch.setattr(module, "STOP_TASK_S", 0.5)
    for module in (host_module, cores_module, teardown):
        monkeypatch.setattr(module, "STOP_DB_S", 0.5)
    entered, gate, made = slow_store(monkeypatch)
    host = ClusterHost(ServerSettings(port=0, store=pg_dsn, cluster=CLUSTER, insecure=True))
    await host.start()
    try:
        assert await asyncio.to_thread(entered.wait, 30)
        with capture_logs() as logs:
            began = time.monotonic()
            await asyncio.wait_for(host.stop(), 30)
            stop_s = time.monotonic() - began
    finally:
        gate.set()
    try:
        await until(lambda: bool(made) and made[0].closed, timeout_s=15)
    except TimeoutError:
        pass
    left = await close_left(made)
    given_up = [e for e in logs if e["event"].startswith("a store still opening or closing after the stop")]
    assert given_up and given_up[0]["stores"] == 1, [e["event"] for e in logs]
    assert stop_s < 10, stop_s  # its bound (1 s here) plus the rest of the stop, not the store's 60 s gate
    assert made and not left, "the store made after the stop gave up was left open"


async def test_a_stop_returns_only_once_the_store_a_failed_shard_start_was_closing_is_closed(
    pg_dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A shard's core failed to start and its store is closing (a thread) when the stop cancels the shard's start:
    the stop returns only once that close has ended."""
    closing, gate = threading.Event(), threading.Event()
    made: list[ShardPgStore] = []
    closed: list[ShardPgStore] = []

    class SlowToClose(ShardPgStore):
        """Refuses the load (a damaged row); its close waits for the gate."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            made.append(self)

        def load(self) -> Any:
            raise StoreError("a damaged row (the test's)")

        def close(self) -> None:
            closing.set()
            gate.wait(60)
            super().close()
            closed.append(self)

    monkeypatch.setattr(cores_module, "ShardPgStore", SlowToClose)
    host = gated_host(pg_dsn, gate, monkeypatch)
    await host.start()
    try:
        assert await asyncio.to_thread(closing.wait, 30)
        await asyncio.wait_for(host.stop(), STOP_TASK_S + STOP_DB_S + 10)
        made_by_then, closed_by_then = list(made), list(closed)
    finally:
        gate.set()
    await until(lambda: len(closed) == len(made), timeout_s=15)
    assert made_by_then and closed_by_then == made_by_then, "the stop returned while the shard's store was closing"
