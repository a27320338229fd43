"""A cluster host's stop is bounded, whenever it is called (coordinator/io/cluster/host.py ``ClusterHost.stop``).

The teardown of test_cluster_front_door.py once hung 120 s in ``host.stop()``: the stop cancelled
the lease rounds' task in the loop iteration in which a round ended, and on Python 3.11
``asyncio.wait_for`` (which ran the round) returned the round's result instead of the cancel;
the rounds went on and the stop waited for them for ever. Here the stop is called at that moment,
deterministically: from the round itself, so it runs before ``wait_for`` hears that the round
ended. On a real PostgreSQL (tests/pg.py; skipped without one).
"""

from __future__ import annotations

import asyncio

import pytest

from coordinator.io.cluster.host import STOP_TASK_S, ClusterHost
from coordinator.io.frontdoor.server import ServerSettings
from coordinator.shards import ClusterConfig
from tests.waiting import until

pytestmark = pytest.mark.timeout(60)

CLUSTER = ClusterConfig(shards=1, lease_ttl_s=30.0, lease_renew_s=0.2)


class StoppedAsARoundEnds(ClusterHost):
    """A host whose :meth:`stop` is started by a lease round of its keeper, as that round returns."""

    stopping: asyncio.Task[None] | None = None
    keeper: asyncio.Task[None] | None = None  # kept: the stop clears _keeper

    async def _round(self) -> None:
        await super()._round()
        if self.stopping is None and self.loaded.is_set() and asyncio.current_task() is self._keeper:
            self.keeper = self._keeper
            self.stopping = asyncio.ensure_future(self.stop())  # its first step runs before the round's end is heard


async def test_a_stop_called_as_a_lease_round_ends_returns_and_ends_the_rounds(pg_dsn: str) -> None:
    """stop() called in the loop iteration in which a lease round ends returns within its bound; the rounds end."""
    started = asyncio.Event()
    host = StoppedAsARoundEnds(ServerSettings(port=0, store=pg_dsn, cluster=CLUSTER, insecure=True),
                               announce=lambda line: started.set())  # fmt: skip
    await host.start()
    await asyncio.wait_for(started.wait(), 30)
    await until(lambda: host.stopping is not None)  # the keeper's next round (every scan_s) starts the stop
    stopping, keeper = host.stopping, host.keeper
    assert keeper is not None
    done, _ = await asyncio.wait([stopping], timeout=4 * STOP_TASK_S)
    if not done:  # the bug: end the rounds with a second cancel (it reaches their sleep), so nothing is left running
        keeper.cancel()
        await asyncio.wait([stopping], timeout=30)
    assert done, "stop() still waited for the lease rounds"
    stopping.result()
    assert keeper.done() and not host.servers
