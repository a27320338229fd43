"""A cluster host's stop is bounded, whenever it is called (coordinator/io/cluster/host.py ``ClusterHost.stop``);
so is a single coordinator's lease keeper's (coordinator/io/cluster/leases.py ``LeaseKeeper.stop``).

The teardown of test_cluster_front_door.py once hung 120 s in ``host.stop()``: the stop cancelled
the lease rounds' task in the loop iteration in which a round ended, and on Python 3.11
``asyncio.wait_for`` (which ran the round) returned the round's result instead of the cancel;
the rounds went on and the stop waited for them for ever. Here the stop is called at that moment,
deterministically: from the round itself, so it runs before ``wait_for`` hears that the round
ended. On a real PostgreSQL (tests/pg.py; skipped without one).
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from typing import Any

import asyncpg  # type: ignore[import-untyped]
import pytest
from websockets.asyncio.client import connect
from websockets.typing import Subprotocol

from coordinator.io.cluster import cores as cores_module
from coordinator.io.cluster import host as host_module
from coordinator.io.cluster import teardown
from coordinator.io.cluster.cores import ShardPgStore
from coordinator.io.cluster.host import ClusterHost
from coordinator.io.cluster.leases import LeaseKeeper
from coordinator.io.cluster.teardown import STOP_DB_S, STOP_TASK_S
from coordinator.io.frontdoor.server import ServerSettings
from coordinator.io.stores.integrity import StoreError
from coordinator.io.stores.postgres import PgStore
from coordinator.limits import Limits
from coordinator.shards import ClusterConfig, LeaseState, Outcome
from tests.waiting import LagProbe, until

pytestmark = pytest.mark.timeout(60)

CLUSTER = ClusterConfig(shards=1, lease_ttl_s=30.0, lease_renew_s=0.2)
WAITING_ON_A_LOCK = (
    "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND datname = current_database()"
)


class StoppedAsARoundEnds(ClusterHost):
    """A host whose :meth:`stop` is started by a lease round of its keeper, as that round returns."""

    stopping: asyncio.Task[None] | None = None
    keeper: asyncio.Task[None] | None = None  # kept: the stop clears _keeper

    async def _round(self) -> None:
        await super()._round()
        if self.stopping is None and self.loaded.is_set() and self._keeper is not None:  # not start()'s round
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
    rounds_ended = keeper.done()
    if not (done and rounds_ended):  # the bug: end the rounds with a second cancel (it reaches their sleep)
        keeper.cancel()
        await asyncio.wait([stopping, keeper], timeout=30)
    assert done, "stop() still waited for the lease rounds"
    assert rounds_ended, "the lease rounds went on after stop()"
    stopping.result()
    assert not host.servers


class KeeperStoppedAsARenewalEnds(LeaseKeeper):
    """A lease keeper whose :meth:`stop` is started by a renewal of its own loop, as that renewal returns."""

    stopping: asyncio.Task[None] | None = None
    loop_task: asyncio.Task[None] | None = None

    async def attempt(self) -> Outcome:
        renewal = self.leases.state is LeaseState.OWNER
        outcome = await super().attempt()
        if self.stopping is None and renewal and self._task is not None:
            self.loop_task = self._task
            self.stopping = asyncio.ensure_future(self.stop(release=True))
        return outcome


async def test_a_lease_keeper_stopped_as_a_renewal_ends_returns_and_ends_its_loop(pg_dsn: str) -> None:
    """LeaseKeeper.stop() called in the loop iteration in which a renewal ends returns; the renewals end."""
    store = await asyncio.to_thread(PgStore, pg_dsn, CLUSTER)
    acquired = asyncio.Event()
    keeper = KeeperStoppedAsARenewalEnds(store, CLUSTER, "stop-test", on_acquired=acquired.set,
                                         on_fenced=lambda exc: None)  # fmt: skip
    try:
        keeper.start()
        await asyncio.wait_for(acquired.wait(), 30)
        await until(lambda: keeper.stopping is not None)  # the next renewal (every lease_renew_s) starts the stop
        stopping, loop_task = keeper.stopping, keeper.loop_task
        assert stopping is not None and loop_task is not None
        done, _ = await asyncio.wait([stopping], timeout=4 * STOP_TASK_S)
        renewals_ended = loop_task.done()
        if not (done and renewals_ended):  # the bug: end the loop with a second cancel (it reaches its sleep)
            loop_task.cancel()
            await asyncio.wait([stopping, loop_task], timeout=30)
        assert done, "LeaseKeeper.stop() still waited for the renewals"
        assert renewals_ended, "the renewals went on after stop()"
        stopping.result()
    finally:
        await asyncio.to_thread(store.close)


async def test_a_stop_while_a_view_session_waits_on_a_locked_table_cancels_it_and_returns(pg_dsn: str) -> None:
    """A main-port view session whose read waits on a lock: the stop cancels it past the handshake and close
    timeouts instead of waiting for the read (up to its 30 s command timeout, or a pool's queue of them)."""
    started = asyncio.Event()
    limits = Limits(handshake_timeout_s=0.5, close_timeout_s=0.5)
    host = ClusterHost(ServerSettings(port=0, store=pg_dsn, cluster=CLUSTER, insecure=True, limits=limits),
                       announce=lambda line: started.set())  # fmt: skip
    await host.start()
    locker = await asyncpg.connect(pg_dsn)
    watcher = await asyncpg.connect(pg_dsn)  # pg_stat_activity, outside the locker's transaction (it sees one snapshot)
    stopping: asyncio.Future[None] | None = None
    try:
        await asyncio.wait_for(started.wait(), 30)
        async with connect(host.url + "/v1/client", subprotocols=[Subprotocol("fleetwire.v1.json")]) as ws:
            async with locker.transaction():
                await locker.execute("LOCK TABLE fleetwire_plans IN ACCESS EXCLUSIVE MODE")
                await ws.send(json.dumps({"type": "get_plan", "req_id": 1, "plan_id": "p1"}))
                async with asyncio.timeout(30):  # the view session's read waits on the lock (no event to wait on)
                    while not await watcher.fetchval(WAITING_ON_A_LOCK):  # noqa: ASYNC110
                        await asyncio.sleep(0.005)
                stopping = asyncio.ensure_future(host.stop())
                done, _ = await asyncio.wait([stopping], timeout=4 * STOP_TASK_S)
            if not done:  # the bug: the lock is gone with the transaction, the read ends, the stop with it
                await asyncio.wait([stopping], timeout=30)
            assert done, "the stop waited for the view session's read"
            stopping.result()
    finally:
        if stopping is None:
            await host.stop()
        await locker.close()
        await watcher.close()


async def test_a_shard_store_still_opening_when_the_stop_comes_is_closed_once_open(
    pg_dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """stop() while a won shard's store is being opened (in a thread): the stop returns, and the store is closed
    once it has opened, not left with its connections and thread."""
    entered, go = threading.Event(), threading.Event()
    made: list[ShardPgStore] = []

    class SlowToOpen(ShardPgStore):
        """The real shard store, whose constructor waits until the test lets it connect."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            entered.set()
            go.wait(30)
            super().__init__(*args, **kwargs)
            made.append(self)

    monkeypatch.setattr(cores_module, "ShardPgStore", SlowToOpen)
    # The stop waits for the store up to STOP_TASK_S + STOP_DB_S, then gives it up (test_cluster_stop_opening.py):
    for module in (host_module, teardown):  # that bound, shortened: the store is released after it
        monkeypatch.setattr(module, "STOP_TASK_S", 0.5)
    for module in (host_module, cores_module, teardown):
        monkeypatch.setattr(module, "STOP_DB_S", 0.5)
    host = ClusterHost(ServerSettings(port=0, store=pg_dsn, cluster=CLUSTER, insecure=True))
    await host.start()
    try:
        assert await asyncio.to_thread(entered.wait, 30)
        await asyncio.wait_for(host.stop(), 4 * STOP_TASK_S)
    finally:
        go.set()
    try:
        await until(lambda: bool(made) and made[0].closed, timeout_s=15)
    except TimeoutError:
        pass
    left_open = [store for store in made if not store.closed]
    for store in left_open:  # the bug: close it here, so that nothing is left behind
        await asyncio.to_thread(store.close)
    assert made and not left_open, "the shard's store was left open after the stop"


async def test_a_view_sessions_follower_cancelled_as_its_doorbell_wakes_it_ends(pg_dsn: str) -> None:
    """A view session's follower cancelled in the loop iteration in which its wake-up is set (a doorbell, then the
    session's close) ends, instead of reading the watched plans on for ever (and reopening the views' pool)."""
    started = asyncio.Event()
    host = ClusterHost(ServerSettings(port=0, store=pg_dsn, cluster=CLUSTER, insecure=True),
                       announce=lambda line: started.set())  # fmt: skip
    await host.start()
    try:
        await asyncio.wait_for(started.wait(), 30)
        async with connect(host.url + "/v1/client", subprotocols=[Subprotocol("fleetwire.v1.json")]) as ws:
            await ws.send(json.dumps({"type": "subscribe", "req_id": 1, "all": True}))
            assert json.loads(await asyncio.wait_for(ws.recv(), 10))["type"] == "subscribed"
            (driver,) = host.views._open
            # Parked: waiting for its wake-up (a doorbell or the poll), after the first read of the watched plans.
            await until(lambda: driver.follower is not None and bool(driver.wake._waiters))
            follower = driver.follower
            assert follower is not None
            driver.wake.set()  # a doorbell rings ...
            follower.cancel()  # ... and the session's stop cancels the follower, in the same iteration
            done, _ = await asyncio.wait([follower], timeout=4 * STOP_TASK_S)
            if not done:  # the bug: a second cancel reaches it (in a read or its wait), so nothing is left running
                while not follower.done():
                    follower.cancel()
                    await asyncio.wait([follower], timeout=1)
            assert done, "the follower went on after it was cancelled"
    finally:
        await host.stop()


async def test_a_stop_against_a_database_that_does_not_answer_the_release_returns_within_its_bound(pg_dsn: str) -> None:
    """The lease release and the coordinator row's delete on stop wait on locked tables: the stop gives each up
    after STOP_DB_S (the leases expire after their TTL) instead of the 30 s command timeout each."""
    started = asyncio.Event()
    host = ClusterHost(ServerSettings(port=0, store=pg_dsn, cluster=CLUSTER, insecure=True),
                       announce=lambda line: started.set())  # fmt: skip
    await host.start()
    locker = await asyncpg.connect(pg_dsn)
    stopping: asyncio.Future[None] | None = None
    try:
        await asyncio.wait_for(started.wait(), 30)
        async with locker.transaction():
            await locker.execute("LOCK TABLE shard_leases, fleetwire_coordinators IN ACCESS EXCLUSIVE MODE")
            stopping = asyncio.ensure_future(host.stop())
            done, _ = await asyncio.wait([stopping], timeout=3 * STOP_DB_S + 2 * STOP_TASK_S)
        if not done:  # the bug: the locks are gone with the transaction, the statements end, the stop with them
            await asyncio.wait([stopping], timeout=60)
        assert done, "the stop waited for the database past its bound"
        stopping.result()
    finally:
        if stopping is None:
            await host.stop()
        await locker.close()


async def test_a_shard_whose_core_cannot_start_has_its_store_closed(
    pg_dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A won shard whose core fails to start (its store refuses the load): the slot is given back and the store
    it opened is closed, not left with its connections and thread (the shard is won again every round)."""
    made: list[ShardPgStore] = []

    class RefusesTheLoad(ShardPgStore):
        """The real shard store, whose plans cannot be loaded (as a damaged row makes it refuse them)."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            made.append(self)

        def load(self) -> Any:
            raise StoreError("a damaged row (the test's)")

    monkeypatch.setattr(cores_module, "ShardPgStore", RefusesTheLoad)
    host = ClusterHost(ServerSettings(port=0, store=pg_dsn, cluster=CLUSTER, insecure=True))
    await host.start()
    try:
        await until(lambda: len(made) >= 2)  # the first one failed, and the next round won the shard again
        await until(lambda: made[0].closed, timeout_s=10)
    finally:
        await host.stop()
        for store in made:  # (a store left open by the bug is closed here, so that nothing is left behind)
            if not store.closed:
                await asyncio.to_thread(store.close)


async def test_a_shard_core_still_loading_when_the_stop_comes_has_its_store_closed_once_loaded(
    pg_dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """stop() while a won shard's core loads its plans (a thread): the stop returns, and the store is closed once
    the load lets go of it, not left with its connections and thread."""
    loading, go = threading.Event(), threading.Event()
    made: list[ShardPgStore] = []

    class SlowToLoad(ShardPgStore):
        """The real shard store, whose load waits until the test lets it read."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            made.append(self)

        def load(self) -> Any:
            loading.set()
            go.wait(30)
            return super().load()

    monkeypatch.setattr(cores_module, "ShardPgStore", SlowToLoad)
    # The stop waits for the store up to STOP_TASK_S + STOP_DB_S, then gives it up (test_cluster_stop_opening.py):
    for module in (host_module, teardown):  # that bound, shortened: the store is released after it
        monkeypatch.setattr(module, "STOP_TASK_S", 0.5)
    for module in (host_module, cores_module, teardown):
        monkeypatch.setattr(module, "STOP_DB_S", 0.5)
    host = ClusterHost(ServerSettings(port=0, store=pg_dsn, cluster=CLUSTER, insecure=True))
    await host.start()
    try:
        assert await asyncio.to_thread(loading.wait, 30)
        await asyncio.wait_for(host.stop(), 4 * STOP_TASK_S)
    finally:
        go.set()
    try:
        await until(lambda: made[0].closed, timeout_s=15)
    except TimeoutError:
        pass
    left_open = [store for store in made if not store.closed]
    for store in left_open:  # the bug: close it here, so that nothing is left behind
        await asyncio.to_thread(store.close)
    assert not left_open, "the shard's store was left open after the stop"


async def test_a_stop_whose_stores_close_slowly_keeps_the_loop_responsive_and_returns_within_its_bound(
    pg_dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The control store's and a shard's store's closes (PgStore.close waits on its database: up to ~25 s against
    one that does not answer) run off the event loop: a 5 ms timer is never late by 1 s with the loop's thread blocked
    meanwhile (its waits for a CPU not counted: tests/waiting.py LagProbe), and the stop returns after STOP_DB_S while
    the control store still closes."""
    shard_hold_s, control_hold_s = 2.0, STOP_DB_S + 3.0
    control_closed = threading.Event()

    class SlowToClose(PgStore):
        """The real control store, whose close takes as long as against a database that does not answer."""

        def close(self) -> None:
            if not self.closed:
                time.sleep(control_hold_s)  # the database's silence (a thread of its own: never the loop's)
            super().close()
            control_closed.set()

    class ShardSlowToClose(ShardPgStore):
        """The real shard store, whose close takes as long as against a database that does not answer."""

        def close(self) -> None:
            if not self.closed:
                time.sleep(shard_hold_s)
            super().close()

    monkeypatch.setattr(host_module, "PgStore", SlowToClose)
    monkeypatch.setattr(cores_module, "ShardPgStore", ShardSlowToClose)
    started = asyncio.Event()
    host = ClusterHost(ServerSettings(port=0, store=pg_dsn, cluster=CLUSTER, insecure=True),
                       announce=lambda line: started.set())  # fmt: skip
    await host.start()
    try:
        await asyncio.wait_for(started.wait(), 30)  # a shard's core serves: its store is closed by the stop
        assert isinstance(host.control, SlowToClose)
        probe = LagProbe()
        began = time.monotonic()
        await asyncio.wait_for(host.stop(), 60)
        took_s = time.monotonic() - began
        still_closing = not control_closed.is_set()
        # The probe's tick due by now (late by a block at the stop's very end) runs before this timer's later one.
        await asyncio.sleep(0.01)
        probe.stop()
    finally:
        await asyncio.to_thread(control_closed.wait, 30)  # (nothing left behind, whatever the result)
    # Its lateness with the loop's thread blocked: a loaded host's waits for a CPU and the collector's pauses are not
    # the stop's (tests/waiting.py LagProbe).
    assert probe.worst_blocked_s < 1.0, (
        f"the loop was blocked {probe.worst_blocked_s:.2f} s during the stop ({probe.worst_s:.2f} s late in all)"
    )
    assert still_closing, f"the stop waited {took_s:.1f} s for the control store's close past STOP_DB_S"
