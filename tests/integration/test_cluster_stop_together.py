"""A cluster host's stop stops its shards' cores together (coordinator/io/cluster/cores.py ``ShardCores.stop_all``).

Each core's stop first waits up to ACK_FLUSH_WAIT_S for its steps whose commit is pending (core_driver.py
``flush_acks``); against a database that does not answer, one shard after another added that wait (and the
committer's and the store's closes) once per shard. Here each shard's store holds its commit (the database's
silence) until the first of those waits ends: every shard's wait must have begun by then. On a real PostgreSQL
(tests/pg.py; skipped without one).
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from structlog.testing import capture_logs

from coordinator.effects import Effects
from coordinator.io.cluster.host import ClusterHost
from coordinator.io.frontdoor.server import CoordinatorServer, ServerSettings
from coordinator.shards import ClusterConfig
from tests.waiting import until

pytestmark = pytest.mark.timeout(90)

SHARDS = 3
CLUSTER = ClusterConfig(shards=SHARDS, lease_ttl_s=30.0, lease_renew_s=0.2)


def hold_commits(server: CoordinatorServer, gate: asyncio.Event) -> None:
    """``server``'s store answers no commit until ``gate`` opens; a step's commit is then pending in its committer."""
    store = server.store

    async def silent(records: Any) -> None:  # the database's silence, then a commit as if it answered
        await gate.wait()

    store.write_async = silent  # type: ignore[method-assign]
    server.driver.committer.submit([], Effects(), 0)


async def test_a_hosts_stop_waits_for_its_shards_pending_commits_together_not_one_after_another(
    pg_dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Three shards whose commits the database does not answer: the host's stop begins every shard's wait for its
    pending commits before any of them ends (about one ACK_FLUSH_WAIT_S in all, not three); a shard whose stop
    fails (after its core stopped) is logged and the others' stops go on to the end."""
    host = ClusterHost(ServerSettings(port=0, store=pg_dsn, cluster=CLUSTER, insecure=True))
    await host.start()
    gate = asyncio.Event()
    steps: list[tuple[str, int]] = []
    stores = {}
    try:
        await until(lambda: len(host.servers) == SHARDS, timeout_s=30)
        for shard, server in host.servers.items():
            stores[shard] = server.store
            flush = server.driver.flush_acks

            async def flush_noted(shard: int = shard, flush: Any = flush) -> None:
                steps.append(("began", shard))
                try:
                    await flush()
                finally:
                    steps.append(("ended", shard))
                    gate.set()  # the first wait ended: the database answers from now on (the old stop goes on)

            monkeypatch.setattr(server.driver, "flush_acks", flush_noted)
            hold_commits(server, gate)
        failing = host.servers[1]
        stop_1 = failing.stop

        async def stop_then_fail() -> None:
            await stop_1()
            raise RuntimeError("the test's failure after shard 1's stop")

        monkeypatch.setattr(failing, "stop", stop_then_fail)
        with capture_logs() as logs:
            await asyncio.wait_for(host.stop(), 60)
    finally:
        gate.set()
    began = [i for i, (what, _) in enumerate(steps) if what == "began"]
    ended = [i for i, (what, _) in enumerate(steps) if what == "ended"]
    assert len(began) == len(ended) == SHARDS, steps
    assert max(began) < min(ended), f"the shards' waits ran one after another: {steps}"
    assert all(store.closed for store in stores.values())
    events = [(e["event"], e.get("shard")) for e in logs]
    assert ("shard not released cleanly; it expires after the TTL", 1) in events, events
    assert sorted(s for event, s in events if event == "stopped serving shard") == list(range(SHARDS)), events
