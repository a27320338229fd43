"""A view session's wait never takes the others' reads (coordinator/io/cluster/sessions.py: the reads' pool).

The view reads' asyncpg pool has two connections. A ``list_workers`` after a quiet spell waits (up to 3 x
``--lease-renew``) for the owners' fresh registry rows; two such waits must not stall a third session's read.
A real PostgreSQL (tests/pg.py; skipped without one) whose two shards are leased to an owner that never writes
its registry, so both waits run their full length.
"""

from __future__ import annotations

import asyncio
import time
import types
from typing import Any

import pytest

from coordinator.auth import Principal
from coordinator.io.cluster import sessions
from coordinator.io.cluster.leases import ACQUIRE
from coordinator.io.cluster.sessions import ViewDriver, ViewSessions
from coordinator.io.stores.postgres import PgStore
from coordinator.shards import ClusterConfig
from protocol.messages import GetPlan, ListWorkers, Moved
from tests.waiting import until

pytestmark = pytest.mark.timeout(120)

CLUSTER = ClusterConfig(shards=2, lease_ttl_s=60.0, lease_renew_s=1.0)
RENEW_S = 3.0  # each list_workers waits 3 x this for rows nobody writes


def lease_every_shard(dsn: str) -> None:
    """Both shards leased (60 s) to 'silent', which never writes a registry row."""
    store = PgStore(dsn, CLUSTER)
    try:
        store.execute(lambda c: c.fetch(ACQUIRE, "silent", "", 60.0, list(range(CLUSTER.shards))))
    finally:
        store.close()


class _Ws:
    """The websocket a ViewDriver sends on: its frames, kept."""

    request = None

    def __init__(self) -> None:
        self.sent: list[Any] = []

    async def send(self, frame: Any, text: bool = False) -> None:
        self.sent.append(frame)


def driver(views: ViewSessions) -> tuple[ViewDriver, _Ws]:
    ws = _Ws()
    codec = types.SimpleNamespace(encode=lambda msgs: msgs, text=False)
    return ViewDriver(views, ws, Principal("client", "client"), codec, None, None), ws  # type: ignore[arg-type]


async def test_two_list_workers_waiting_for_fresh_rows_leave_a_third_sessions_read_prompt(
    pg_dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    await asyncio.to_thread(lease_every_shard, pg_dsn)
    reads = 0
    real = sessions.read_workers

    async def counted(conn: Any, since: Any = None) -> Any:
        nonlocal reads
        reads += 1
        return await real(conn, since)

    monkeypatch.setattr(sessions, "read_workers", counted)
    views = ViewSessions(pg_dsn, where=lambda shard: Moved(shard=shard, url=""), submit_shard=lambda _: 0,
                         doorbell=None, renew_s=RENEW_S)  # type: ignore[arg-type]  # fmt: skip
    try:
        (first, ws1), (second, ws2), (third, ws3) = driver(views), driver(views), driver(views)
        waits = [asyncio.create_task(d.answer(ListWorkers(req_id=1))) for d in (first, second)]
        await until(lambda: reads >= 2)  # both looked once, found no fresh rows: both wait
        assert not any(w.done() for w in waits)
        started = time.monotonic()
        await asyncio.wait_for(third.answer(GetPlan(req_id=7, plan_id="nobody")), 30)
        took = time.monotonic() - started
        assert [type(m).__name__ for frame in ws3.sent for m in frame] == ["Error"]  # plan_not_found, answered
        assert took < RENEW_S, f"a read behind two waiting list_workers took {took:.2f} s"
        assert not any(w.done() for w in waits)  # answered while both still waited
        await asyncio.wait_for(asyncio.gather(*waits), 30)
        assert [type(m).__name__ for ws in (ws1, ws2) for frame in ws.sent for m in frame] == ["Workers"] * 2
    finally:
        await views.close()
