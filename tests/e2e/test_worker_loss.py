"""A worker's lost connection is not silence (issue #25 part 2): real processes, default heartbeats.

kill -9 of a worker closes its connection at once; its plan is requeued when the reconnect grace
(``--worker-reconnect-grace-s``) is over, not when the heartbeat timeout (30 s) would reap it. A
worker whose connection is cut and that comes back within the grace continues its plan.
"""

from __future__ import annotations

import signal
import time

import pytest

from tests.e2e.conftest import Cluster
from tests.e2e.test_durability import WORKER, Proxy, assert_one_clean_stream, client, stream, until

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(90)]

GRACE = ("--worker-reconnect-grace-s", "2")  # the heartbeats keep their defaults: 10 s, timeout 30 s
SHORT_GRACE = ("--worker-reconnect-grace-s", "1")  # where the test waits the grace out


async def test_a_killed_workers_plan_is_requeued_within_the_grace(cluster: Cluster) -> None:
    """kill -9 of the worker running a plan: attempt 2 is leased to the other worker ~1 s later, not ~30 s."""
    await cluster.coordinator(*SHORT_GRACE)
    w1 = await cluster.worker("w1", *WORKER)
    async with client(cluster.url) as c:
        plan = await c.submit("sleep", {"seconds": 30}, plan_id="killed-1", tags=[])
        await until(plan, lambda e: e.kind == "running" and e.data["worker_id"] == "w1")
        await cluster.worker("w2", *WORKER)
        killed_at = time.monotonic()
        w1.stop(signal.SIGKILL)
        leased = await until(plan, lambda e: e.kind == "leased" and e.data["attempt"] == 2, timeout_s=20)
        requeued_after_s = time.monotonic() - killed_at
        await c.cancel(plan.id)
    assert leased.data["worker_id"] == "w2"
    assert 0.75 < requeued_after_s < 10, requeued_after_s  # the 1 s grace and a reaper tick, with room for load
    assert await w1.wait() == -signal.SIGKILL


async def test_a_worker_back_within_the_grace_continues_its_plan(cluster: Cluster) -> None:
    """The worker's connection cut mid-plan: it redials at once, presents its secret and its plan ends there, once."""
    await cluster.coordinator(*GRACE)
    proxy = Proxy(int(cluster.url.rsplit(":", 1)[1]))
    await proxy.start()
    try:
        w1 = await cluster.run("worker", "--id", "w1", "--url", f"ws://127.0.0.1:{proxy.port}", *WORKER, name="w1",
                               env=cluster.env(FLEETWIRE_TOKEN="e2e-worker-token"))  # fmt: skip
        await w1.wait_for_line("registered")
        async with client(cluster.url) as c:
            plan = await c.submit("sleep", {"seconds": 1.5}, plan_id="cut-1")
            await until(plan, lambda e: e.kind == "running")
            proxy.cut()
            done = assert_one_clean_stream(await stream(plan))
            cuts = proxy.cuts
    finally:
        await proxy.close()
    assert cuts == 1
    assert (done.kind, done.data["worker_id"], done.data["attempt"]) == ("succeeded", "w1", 1)


async def test_heartbeat_silence_on_an_open_connection_still_waits_for_the_timeout(cluster: Cluster) -> None:
    """SIGSTOP (the connection stays open): no requeue at the grace; the heartbeat timeout reaps it."""
    await cluster.coordinator(*SHORT_GRACE, "--heartbeat-interval", "0.5", "--heartbeat-timeout", "2.5",
                              "--reaper-interval", "0.05")  # fmt: skip
    w1 = await cluster.worker("w1", *WORKER)
    async with client(cluster.url) as c:
        plan = await c.submit("sleep", {"seconds": 30}, plan_id="frozen-2")
        await until(plan, lambda e: e.kind == "running")
        await cluster.worker("w2", *WORKER)
        stopped_at = time.monotonic()
        w1.stop(signal.SIGSTOP)
        try:
            await until(plan, lambda e: e.kind == "leased" and e.data["attempt"] == 2, timeout_s=20)
            silent_s = time.monotonic() - stopped_at
            await c.cancel(plan.id)
        finally:
            w1.stop(signal.SIGCONT)
    assert silent_s > 1.8, silent_s  # the 2.5 s timeout from the last beat (<= 0.5 s before), not the 1 s grace
