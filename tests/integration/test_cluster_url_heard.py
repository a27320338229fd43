"""A cluster host learns another coordinator's shard's URL when it is published, not by polling for it
(coordinator/io/cluster/host.py ``ClusterHost._url_known``; cores.py ``URL_CHANNEL``).

A shard another coordinator won has no URL (``owner_url`` '') until its core listens, which takes its load's time.
The host's rounds ran every 0.1 s meanwhile (``next_round_s``'s URL poll): a beat, a scan and a renewal each time, on
every other coordinator of the cluster, for as long as that shard loaded. The core now publishes its URL with a
``NOTIFY`` in the same statement, which every host ``LISTEN`` s for on its control connection: the host's next round
stays a scan period away, and the notification runs it at once. On a real PostgreSQL (tests/pg.py; skipped
without one).
"""

from __future__ import annotations

import time

import asyncpg  # type: ignore[import-untyped]
import pytest

from coordinator.io.cluster import cores
from coordinator.io.cluster.host import _BEAT, ClusterHost
from coordinator.io.frontdoor.server import ServerSettings
from coordinator.shards import ClusterConfig
from tests.waiting import until

pytestmark = pytest.mark.timeout(60)

# A scan period of 10 s: a round before it is the notification's (or a poll's), not the period's.
CLUSTER = ClusterConfig(shards=2, lease_ttl_s=60.0, lease_renew_s=20.0)
OTHER, OTHER_URL = "other-coordinator", "ws://other.invalid:7001"


async def test_a_url_published_by_another_coordinator_is_heard_not_polled_for(pg_dsn: str) -> None:
    """Shard 1 is another live coordinator's, without a URL yet: the host's next round is a period away (no poll);
    once that coordinator publishes the URL (cores._SET_URL), the host's main port names it well within the period;
    the same through a new control connection (a reconnect's)."""
    host = ClusterHost(ServerSettings(port=0, store=pg_dsn, cluster=CLUSTER, insecure=True))  # makes the schema
    conn = await asyncpg.connect(pg_dsn)
    try:
        await conn.execute(_BEAT, OTHER, "ws://other.invalid:7000", 60.0)  # a live peer: this host's share is 1
        await conn.execute("UPDATE shard_leases SET owner = $1, owner_url = '', epoch = 1, "
                           "expires_at = now() + interval '60 s' WHERE shard = 1", OTHER)  # fmt: skip
        await host.start()
        await until(lambda: 0 in host.servers, timeout_s=30)
        assert host.hearing_urls
        assert host.where(1).url == ""
        assert host._round_due - time.monotonic() > CLUSTER.scan_s / 2, "polled for shard 1's URL"
        await conn.execute(cores._SET_URL, OTHER_URL, 1, OTHER, 1)  # the other coordinator's core listens
        await until(lambda: host.where(1).url == OTHER_URL, timeout_s=CLUSTER.scan_s / 2)
        await host._reconnect()  # a new control connection (a round failed): it listens before it is used
        assert host.hearing_urls
        await conn.execute(cores._SET_URL, OTHER_URL + "/again", 1, OTHER, 1)
        await until(lambda: host.where(1).url == OTHER_URL + "/again", timeout_s=CLUSTER.scan_s / 2)
    finally:
        await conn.close()
        await host.stop()
