"""Carbon time shifting end to end (issue #31's done-when): a real coordinator with a forecast file, one worker
in zone DE, plans submitted by the SDK, `fleetwire release` by the CLI, and a kill -9 and restart between.

The forecast (written once the coordinator runs: the file is re-read when it changes) says 300 g/kWh now, 200
for one second at T+3 and 50 from T+12. Quantum 1 s, queue margin 1 s, expected runs 1 s (so a latest start is
deadline - 2.2 s). A plan without deadline runs at once; one due at T+60 is held until T+12; one due at T+7 is
held until T+3 (its latest start is T+4.8). The coordinator is killed before T+3 and started again at
T+5.5: the short plan runs at once after the restart, the long one still at T+12 and within its deadline,
and its receipt states what the wait avoided; a third held plan released by `fleetwire release` runs before.
The margins leave room for a loaded machine's slow process starts: T is 4 s after the forecast is written,
and the kill must come before T+3 (at load 6 it came at T-2.3); the restart and the CLI's release have until
T+11 (at load 6 done by T+7.1, 1.6 s after the restart).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import signal
import time
import urllib.request
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from fleetwire import Client
from fleetwire.plan import Plan
from tests.e2e.conftest import CLIENT_TOKEN, Cluster
from tests.waiting import until

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]

SHIFT = ("--carbon-option", "quantum_s=1", "--carbon-option", "queue_margin_s=1", "--carbon-forecast-interval", "1")
FAST = ("--heartbeat-interval", "0.2", "--heartbeat-timeout", "3", "--reaper-interval", "0.05")
DIP, GREEN = 3, 12  # the 200 g/kWh second and the 50 g/kWh step, in seconds after T
WORKER = ("--reconnect-base", "0.05", "--reconnect-cap", "0.3", "--carbon-zone", "DE", "--power-watts", "100")


def write_forecast(path: Path, rows: list[tuple[float, float]]) -> None:
    stamp = time.strftime
    path.write_text("zone,time,gco2_per_kwh\n" + "".join(
        f"DE,{stamp('%Y-%m-%dT%H:%M:%SZ', time.gmtime(at))},{value}\n" for at, value in rows))  # fmt: skip


def forecast_fetches(url: str) -> float:
    """fleetwire_carbon_forecast_fetches_total from the coordinator's /metrics (blocking: in a thread)."""
    with urllib.request.urlopen(url.replace("ws://", "http://") + "/metrics", timeout=10) as answer:
        for line in answer.read().decode().splitlines():
            if line.startswith("fleetwire_carbon_forecast_fetches_total "):
                return float(line.split()[1])
    return 0.0


class Watch:
    """The wall time each event kind of a plan was first seen, and its held reason."""

    def __init__(self, plan: Plan) -> None:
        self.plan = plan
        self.seen: dict[str, float] = {}
        self.reasons: list[str] = []
        self.task = asyncio.ensure_future(self._watch())

    async def _watch(self) -> None:
        async for event in self.plan.events():
            self.seen.setdefault(event.kind, time.time())
            if event.kind == "waiting":
                self.reasons.append(event.data["reason"])

    def held(self) -> bool:
        return any(reason.startswith("deferred for carbon until") for reason in self.reasons)


@contextlib.asynccontextmanager
async def client(url: str) -> AsyncIterator[Client]:
    async with Client(url, token=CLIENT_TOKEN, reconnect_base_s=0.05, reconnect_cap_s=0.3, reconnect_give_up_s=60) as c:
        yield c


async def test_plans_wait_for_the_greener_step_across_a_restart_and_say_what_they_avoided(cluster: Cluster) -> None:
    """Held until the greener step (across kill -9 and restart), no deadline at once, a passed latest start at
    once after the restart, `fleetwire release` at once, deadlines met, and the receipt's avoided gCO2e."""
    path = Path(cluster.data_dir) / "forecast.csv"
    await asyncio.to_thread(write_forecast, path, [(time.time() - 120, 300.0), (time.time() + 3600, 300.0)])
    coordinator = await cluster.coordinator(*FAST, *SHIFT, "--carbon-forecast", str(path))
    port = cluster.url.rsplit(":", 1)[1]
    await cluster.worker("w1", *WORKER, "--max-concurrency", "4")
    t0 = math.ceil(time.time()) + 4
    rows = [(t0 - 120, 300.0), (t0 + DIP, 200.0), (t0 + DIP + 1, 300.0), (t0 + GREEN, 50.0), (t0 + 45, 300.0),
            (t0 + 90, 300.0)]
    await asyncio.to_thread(write_forecast, path, rows)
    async with asyncio.timeout(20):
        # The feed's count is read over HTTP from another process: no event to wait on.
        while await asyncio.to_thread(forecast_fetches, cluster.url) < 2:  # noqa: ASYNC110 - the change was read
            await asyncio.sleep(0.1)
    async with client(cluster.url) as c:
        at_once = Watch(await c.submit("sleep", {"seconds": 0.2}))
        await asyncio.wait_for(at_once.task, 30)  # no deadline: placed at once
        green = Watch(await c.submit("sleep", {"seconds": 0.3}, deadline_at=t0 + 60, expected_run_s=1))
        short = Watch(await c.submit("sleep", {"seconds": 0.2}, deadline_at=t0 + DIP + 4, expected_run_s=1))
        released = Watch(await c.submit("sleep", {"seconds": 0.2}, deadline_at=t0 + 60, expected_run_s=1))
        await until(lambda: green.held() and short.held() and released.held(), timeout_s=20)
        killed_at = time.time()
        coordinator.stop(signal.SIGKILL)
        await coordinator.wait()
        assert killed_at < t0 + DIP, f"the kill came {killed_at - t0:.1f} s after T: the machine is too slow"
        await asyncio.sleep(t0 + DIP + 2.5 - time.time())  # down past the short plan's latest start (T+4.8)
        await cluster.coordinator(*FAST, *SHIFT, "--carbon-forecast", str(path), "--port", port)
        release = await cluster.run("release", released.plan.id, name="release")
        assert await release.wait(30) == 0
        released_by = time.time()
        await asyncio.wait_for(asyncio.gather(green.task, short.task, released.task), 60)
        info = await c.get_plan(green.plan.id)
    assert green.reasons[0].startswith("deferred for carbon until") and "(50 g/kWh vs 300 now)" in green.reasons[0]
    assert short.reasons[0].startswith("deferred for carbon until") and "(200 g/kWh vs 300 now)" in short.reasons[0]
    assert not at_once.reasons and at_once.seen["running"] < killed_at
    # The short plan's window passed while the coordinator was down: it ran at once after the restart.
    assert t0 + DIP + 2.5 <= short.seen["running"] < t0 + GREEN
    if released_by < t0 + GREEN - 1:  # a machine so slow the CLI answered after the green step cannot tell
        assert released.seen["running"] < green.seen["running"]  # released early, by the CLI
    assert green.seen["running"] >= t0 + GREEN - 0.5  # the greener step, after the restart
    assert info.state == "succeeded" and info.ended_at is not None and info.ended_at <= t0 + 60
    receipt = green.plan.receipt
    assert receipt is not None and receipt.joules > 0
    assert (receipt.ran_g_per_kwh, receipt.at_submit_g_per_kwh) == (50.0, 300.0)
    assert receipt.avoided_co2e_g == pytest.approx(receipt.joules / 3.6e6 * 250)
