"""The cross-shard views' doorbell on a real PostgreSQL: at most one NOTIFY per group commit, never per event."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from coordinator.io.cluster.cores import ShardPgStore
from coordinator.io.cluster.doorbell import CHANNEL, Doorbell, bell_payload, open_connection, parse_bell
from coordinator.records import PlanStatus
from coordinator.shards import ClusterConfig
from tests.integration.test_pg_store import hold
from tests.unit.test_store import created, event
from tests.waiting import until

pytestmark = pytest.mark.timeout(60)

CLUSTER = ClusterConfig(shards=4, lease_ttl_s=2.0, lease_renew_s=0.2)


def test_payload_round_trips_and_an_unknown_one_is_ignored() -> None:
    """``shard:max seq`` is read back; a payload of another form gives None (ignored, not an error)."""
    assert parse_bell(bell_payload(3, 41)) == (3, 41)
    assert parse_bell("3") == (3, 0)
    assert parse_bell("shard three") is None


async def listen_to_commits(dsn: str) -> tuple[Any, list[str], asyncio.Event]:
    """A connection listening to the doorbell's channel: it, the payloads heard in order, and an event set on each."""
    import asyncpg  # type: ignore[import-untyped]

    heard: list[str] = []
    arrived = asyncio.Event()

    def on_notify(conn: Any, pid: int, channel: str, payload: str) -> None:
        heard.append(payload)
        arrived.set()

    listener = await asyncpg.connect(dsn)
    await listener.add_listener(CHANNEL, on_notify)
    return listener, heard, arrived


async def test_a_group_commit_of_many_events_rings_once_and_a_burst_of_rings_coalesces(pg_dsn: str) -> None:
    """40 events in one group commit: one NOTIFY ``0:40``; 200 rings of a shard at once: one NOTIFY, the max seq."""
    listener, heard, arrived = await listen_to_commits(pg_dsn)
    bell = Doorbell(pg_dsn, open_connection)
    bell.bind(asyncio.get_running_loop())
    store = await asyncio.to_thread(lambda: hold(ShardPgStore(pg_dsn, CLUSTER)))
    store.fence = {0: store.fence[0]}  # a shard's core holds its one shard
    store.doorbell = bell
    try:
        records = [created("p"), *(event("p", seq) for seq in range(1, 41)), PlanStatus("p", "running", next_seq=41)]
        await asyncio.to_thread(store.write, records)
        await asyncio.wait_for(arrived.wait(), 10)
        arrived.clear()
        for seq in range(200):
            bell.ring(1, seq)
        while "1:199" not in heard:
            await asyncio.wait_for(arrived.wait(), 10)
            arrived.clear()
        assert heard == ["0:40", "1:199"]
        await until(lambda: bell.rung >= 2, timeout_s=10)  # counted once the NOTIFY's round trip is back: it can
        assert bell.rung == 2  # reach the listener first (seen at load ~10: rung 1)
    finally:
        await asyncio.to_thread(store.close)
        await bell.close()
        await listener.close()


async def test_a_watcher_is_woken_by_the_doorbell_of_its_shard_only(pg_dsn: str) -> None:
    """wait_on LISTENs; a doorbell of the watched shard sets the wake-up, another shard's does not."""
    bell = Doorbell(pg_dsn, open_connection)
    bell.bind(asyncio.get_running_loop())
    wake, witness = asyncio.Event(), asyncio.Event()
    try:
        await bell.wait_on(wake, {2})
        await bell.wait_on(witness, {3})
        bell.ring(3, 5)
        await asyncio.wait_for(witness.wait(), 10)  # shard 3's doorbell came back to this connection
        assert not wake.is_set()
        bell.ring(2, 7)
        await asyncio.wait_for(wake.wait(), 10)
        bell.forget(wake)
        bell.forget(witness)
    finally:
        await bell.close()


class Scanned(list[Any]):
    """A group of records that counts the passes over it."""

    passes = 0

    def __iter__(self) -> Any:
        self.passes += 1
        return super().__iter__()


async def test_an_unheard_doorbell_costs_no_scan_and_rings_once_a_watcher_joins(pg_dsn: str) -> None:
    """Gated, nobody watching: a group commit sends no NOTIFY and the store makes no pass of its own over the group
    for the seq; a watcher that joins later (wait_on) is woken by the next group commit of its shard."""
    listener, heard, arrived = await listen_to_commits(pg_dsn)
    bell = Doorbell(pg_dsn, open_connection, gated=True)
    bell.bind(asyncio.get_running_loop())
    store = await asyncio.to_thread(lambda: hold(ShardPgStore(pg_dsn, CLUSTER)))
    store.fence = {0: store.fence[0]}
    store.doorbell = bell
    wake = asyncio.Event()
    try:
        assert bell.unheard()
        quiet = Scanned([created("q"), event("q", 1), PlanStatus("q", "running", next_seq=2)])
        await asyncio.to_thread(store.write, quiet)
        alone = Scanned([created("r"), event("r", 1), PlanStatus("r", "running", next_seq=2)])
        store.doorbell = None  # the same group's passes without a doorbell: the store's own
        await asyncio.to_thread(store.write, alone)
        assert quiet.passes == alone.passes
        store.doorbell = bell
        await bell.wait_on(wake, {0})  # a watcher joins: the bell is heard now
        assert not bell.unheard()
        await asyncio.to_thread(store.write, [event("q", 2), event("q", 3), PlanStatus("q", "running", next_seq=4)])
        await asyncio.wait_for(wake.wait(), 10)
        await asyncio.wait_for(arrived.wait(), 10)
        assert heard == ["0:3"]
        bell.forget(wake)
    finally:
        await asyncio.to_thread(store.close)
        await bell.close()
        await listener.close()
