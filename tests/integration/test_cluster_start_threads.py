"""A cluster host starts its shards together, in threads of its own (coordinator/io/cluster/teardown.py
``store_opener``), not in the loop's default executor.

Each shard's start opens its store (a connection and the schema's check: round trips), loads its plans and hands its
committer's threaded writer over (its close: a round trip), each in a thread. They ran in the loop's default executor
(``asyncio.to_thread``: ``min(32, cpus + 4)`` threads, 6 on a 2-core host, shared with every other ``to_thread``), so
against a slow database a host that won more shards than that started them in waves, each wave one open's (then one
load's) wait long. Here the loop's default executor has fewer threads than the host has shards, and each of those
three steps holds its thread (the database's slowness) until every shard's same step has begun. On a real PostgreSQL
(tests/pg.py; skipped without one).
"""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from coordinator.io.cluster import cores
from coordinator.io.cluster.host import ClusterHost
from coordinator.io.cluster.teardown import OPENER_THREADS
from coordinator.io.frontdoor.server import CoordinatorServer, ServerSettings
from coordinator.io.stores.postgres import PgStore
from coordinator.shards import ClusterConfig
from tests.waiting import until

pytestmark = pytest.mark.timeout(120)

SHARDS = 4
DEFAULT_THREADS = 2  # the loop's default executor here: fewer threads than the host has shards
GATE_S = 8.0  # the longest a step waits for the others to begin (then it goes on: the test fails, it does not hang)
CLUSTER = ClusterConfig(shards=SHARDS, lease_ttl_s=30.0, lease_renew_s=0.2)


class Gate:
    """One start step of every shard: each holds its thread until all ``SHARDS`` have begun; records the order."""

    def __init__(self) -> None:
        self.steps: list[tuple[str, str]] = []  # ("began" | "ended", the thread's name)
        self._lock = threading.Lock()
        self._all_began = threading.Event()

    def hold(self, step: Any, *args: Any) -> Any:
        with self._lock:
            self.steps.append(("began", threading.current_thread().name))
            if sum(what == "began" for what, _ in self.steps) == SHARDS:
                self._all_began.set()
        self._all_began.wait(GATE_S)  # the database's slowness, until every shard's step is waiting on it
        try:
            return step(*args)
        finally:
            with self._lock:
                self.steps.append(("ended", threading.current_thread().name))

    def release(self) -> None:
        self._all_began.set()

    def check(self, what: str) -> None:
        began = [i for i, (step, _) in enumerate(self.steps) if step == "began"]
        ended = [i for i, (step, _) in enumerate(self.steps) if step == "ended"]
        assert len(began) == len(ended) == SHARDS, (what, self.steps)
        assert max(began) < min(ended), f"the shards' {what} ran in waves: {self.steps}"
        assert all(name.startswith(OPENER_THREADS) for _, name in self.steps), (what, self.steps)


def opener_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith(OPENER_THREADS)]


async def test_a_host_starts_more_shards_than_the_default_executor_has_threads_together(
    pg_dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Four shards won at once, a default executor of two threads, each start's open, load and writer hand-over held
    until all four shards' began: every one begins before any ends, each in the host's own opener threads, and those
    threads are gone after the stop."""
    opens, loads, hand_overs = Gate(), Gate(), Gate()

    class SlowOpen(cores.ShardPgStore):
        def __init__(self, *args: Any) -> None:
            opens.hold(super().__init__, *args)

    real_load, real_close_writer = CoordinatorServer._load, PgStore._close_writer

    def slow_load(server: CoordinatorServer) -> None:
        loads.hold(real_load, server)

    def slow_hand_over(store: PgStore, writer: Any) -> None:
        if isinstance(store, cores.ShardPgStore) and not store.closed:  # open_async's, not a close's
            hand_overs.hold(real_close_writer, store, writer)
        else:
            real_close_writer(store, writer)

    monkeypatch.setattr(cores, "ShardPgStore", SlowOpen)
    monkeypatch.setattr(CoordinatorServer, "_load", slow_load)
    monkeypatch.setattr(PgStore, "_close_writer", slow_hand_over)
    loop = asyncio.get_running_loop()
    default = ThreadPoolExecutor(max_workers=DEFAULT_THREADS, thread_name_prefix="test-default")
    loop.set_default_executor(default)
    host = ClusterHost(ServerSettings(port=0, store=pg_dsn, cluster=CLUSTER, insecure=True))
    try:
        await host.start()
        await until(lambda: len(host.servers) == SHARDS, timeout_s=60)
        await until(lambda: len(hand_overs.steps) == 2 * SHARDS, timeout_s=30)  # each committer's, after its start
    finally:
        for gate in (opens, loads, hand_overs):
            gate.release()
        await asyncio.wait_for(host.stop(), 60)
        default.shutdown(wait=False)
    opens.check("stores' opens")
    loads.check("loads")
    hand_overs.check("writers' hand-overs")
    await until(lambda: not opener_threads(), timeout_s=10)  # shut down at the host's end: its threads exit
