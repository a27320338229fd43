"""The cluster host's scan gives ``next_round_s`` each lease's time left, on a real PostgreSQL (tests/pg.py).

A slot never held keeps ``expires_at = '-infinity'`` (coordinator/io/stores/pg_schema.py): the scan
must not fail on it (``expires_at - now()`` of an infinite timestamp is an error in PostgreSQL: the
first version of this scan stopped every coordinator at its first round). A dead owner's lease
with 0.3 s left makes the next round come just after it expires; an owner that renewed leaves the
period. Skipped without PostgreSQL.
"""

from __future__ import annotations

import asyncio

import asyncpg  # type: ignore[import-untyped]
import pytest

from coordinator.io.cluster.host import _SCAN, EXPIRY_SLACK_S, next_round_s
from coordinator.io.stores.postgres import PgStore
from coordinator.shards import ClusterConfig, LeaseRow

pytestmark = pytest.mark.timeout(60)

CLUSTER = ClusterConfig(shards=3, lease_ttl_s=3.0, lease_renew_s=1.0)


async def test_the_scan_reads_each_leases_time_left_and_skips_never_held_slots(pg_dsn: str) -> None:
    store = await asyncio.to_thread(PgStore, pg_dsn, CLUSTER)  # the schema: three slots, never held
    await asyncio.to_thread(store.close)
    conn = await asyncpg.connect(pg_dsn)
    try:
        set_lease = """
            UPDATE shard_leases SET owner = $2, owner_url = $3, epoch = 1,
                expires_at = now() + make_interval(secs => $4)
            WHERE shard = $1
        """
        await conn.execute(set_lease, 0, "renewing", "ws://renewing/0", 2.9)
        await conn.execute(set_lease, 1, "dead", "ws://dead/1", 0.3)
        scanned = await conn.fetch(_SCAN)
    finally:
        await conn.close()
    rows = [LeaseRow(r[0], r[1], r[2], r[3], r[4]) for r in scanned]
    left = {r[0]: r[5] for r in scanned if r[5] is not None}
    assert [row.live for row in rows] == [True, True, False]
    assert set(left) == {0, 1}  # slot 2 was never held: -infinity, no time left to read
    assert 2.5 < left[0] <= 2.9 and 0.0 < left[1] <= 0.3
    assert next_round_s(CLUSTER.scan_s, rows, left, {}) == pytest.approx(left[1] + EXPIRY_SLACK_S)
    assert next_round_s(CLUSTER.scan_s, rows[:1], left, {}) == CLUSTER.scan_s
