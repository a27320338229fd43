"""A cluster host's stop closes its shards' stores together, in threads of its own (coordinator/io/cluster/teardown.py
``store_closer``), not in the loop's default executor.

``PgStore.close`` waits on its database (up to ~25 s against one that does not answer). The shards' stores were
closed with ``asyncio.to_thread``: the default executor's ``min(32, cpus + 4)`` threads (6 on a 2-core host), shared
with every other ``to_thread``; a host with more shards than that closed them in waves, each one close's wait long.
Here the loop's default executor has fewer threads than the host has shards, and each store's close holds its thread
(the database's silence) until every shard's close has begun. On a real PostgreSQL (tests/pg.py; skipped without one).
"""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from coordinator.io.cluster.host import ClusterHost
from coordinator.io.cluster.teardown import CLOSER_THREADS
from coordinator.io.frontdoor.server import ServerSettings
from coordinator.shards import ClusterConfig
from tests.waiting import until

pytestmark = pytest.mark.timeout(90)

SHARDS = 4
DEFAULT_THREADS = 2  # the loop's default executor here: fewer threads than the host has shards
GATE_S = 10.0  # the longest a close waits for the others to begin (then it goes on: the test fails, it does not hang)
CLUSTER = ClusterConfig(shards=SHARDS, lease_ttl_s=30.0, lease_renew_s=0.2)


def closer_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith(CLOSER_THREADS)]


async def test_a_hosts_stop_closes_more_shards_stores_than_the_default_executor_has_threads_together(
    pg_dsn: str,
) -> None:
    """Four shards, a default executor of two threads, each store's close held until all four began: every close
    begins before any ends, each in the host's own closer threads, and those threads are gone after the stop."""
    loop = asyncio.get_running_loop()
    default = ThreadPoolExecutor(max_workers=DEFAULT_THREADS, thread_name_prefix="test-default")
    loop.set_default_executor(default)
    host = ClusterHost(ServerSettings(port=0, store=pg_dsn, cluster=CLUSTER, insecure=True))
    all_began = threading.Event()
    steps: list[tuple[str, int, str]] = []
    stores = {}
    try:
        await host.start()
        await until(lambda: len(host.servers) == SHARDS, timeout_s=30)
        for shard, server in host.servers.items():
            store = stores[shard] = server.store
            real_close = store.close

            def held_close(shard: int = shard, real_close: Any = real_close) -> None:
                steps.append(("began", shard, threading.current_thread().name))
                if sum(what == "began" for what, _, _ in steps) == SHARDS:
                    all_began.set()
                all_began.wait(GATE_S)  # the database's silence, until every shard's close is waiting on it
                real_close()
                steps.append(("ended", shard, threading.current_thread().name))

            store.close = held_close  # type: ignore[method-assign]
        await asyncio.wait_for(host.stop(), 60)
    finally:
        all_began.set()
        default.shutdown(wait=False)
    began = [i for i, (what, _, _) in enumerate(steps) if what == "began"]
    ended = [i for i, (what, _, _) in enumerate(steps) if what == "ended"]
    assert len(began) == len(ended) == SHARDS, steps
    assert max(began) < min(ended), f"the shards' stores closed in waves: {steps}"
    assert all(name.startswith(CLOSER_THREADS) for _, _, name in steps), steps
    assert all(store.closed for store in stores.values())
    await until(lambda: not closer_threads(), timeout_s=10)  # shut down at the host's end: its threads exit
