"""Carbon time shifting end to end (issue #31's done-when), with real processes and nothing timed: a real
coordinator with a forecast file, one worker in zone DE, plans submitted by the SDK, a kill -9 and restart, and
`fleetwire release` by the CLI.

The forecast says 300 g/kWh now and 50 from an hour on, so a plan due in three hours is held for that step however
slowly the processes start: the test waits on events and states, never on the clock. What the clock decides (the
step reached, a latest start passed while the coordinator was down, a release before the step, the receipt's
avoided gCO2e) is played on the core's fake clock, the same scenario, in tests/unit/test_carbon_shift.py: played
here against the wall clock it depended on a loaded machine's process starts.
"""

from __future__ import annotations

import asyncio
import contextlib
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
H = 3600.0
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


async def test_held_plans_stay_held_across_a_kill_and_restart_and_the_cli_releases_one(cluster: Cluster) -> None:
    """No deadline: at once. Due in three hours: held for the greener step (the reason says so), still held after
    kill -9 and restart; `fleetwire release` runs one of them at once while the other stays held."""
    path = Path(cluster.data_dir) / "forecast.csv"
    now = time.time()
    rows = [(now - 120, 300.0), (now + H, 50.0), (now + 2 * H, 300.0), (now + 4 * H, 300.0)]
    await asyncio.to_thread(write_forecast, path, rows)
    coordinator = await cluster.coordinator(*FAST, *SHIFT, "--carbon-forecast", str(path))
    port = cluster.url.rsplit(":", 1)[1]
    await cluster.worker("w1", *WORKER, "--max-concurrency", "4")
    async with asyncio.timeout(20):
        # The feed's count is read over HTTP from another process: no event to wait on.
        while await asyncio.to_thread(forecast_fetches, cluster.url) < 1:  # noqa: ASYNC110 - the file was read
            await asyncio.sleep(0.1)
    async with client(cluster.url) as c:
        at_once = Watch(await c.submit("sleep", {"seconds": 0.2}))
        await asyncio.wait_for(at_once.task, 30)  # no deadline: placed at once
        green = Watch(await c.submit("sleep", {"seconds": 0.2}, deadline_at=now + 3 * H, expected_run_s=1))
        released = Watch(await c.submit("sleep", {"seconds": 0.2}, deadline_at=now + 3 * H, expected_run_s=1))
        await until(lambda: green.held() and released.held(), timeout_s=20)
        coordinator.stop(signal.SIGKILL)
        await coordinator.wait()
        await cluster.coordinator(*FAST, *SHIFT, "--carbon-forecast", str(path), "--port", port)
        release = await cluster.run("release", released.plan.id, name="release")
        assert await release.wait(30) == 0
        await asyncio.wait_for(released.task, 60)
        info = await c.get_plan(green.plan.id)
        green.task.cancel()
    assert green.reasons[0].startswith("deferred for carbon until") and "(50 g/kWh vs 300 now)" in green.reasons[0]
    assert not at_once.reasons and "succeeded" in at_once.seen
    assert "succeeded" in released.seen  # released by the CLI, after the restart, an hour before the step
    assert info.state == "queued" and "running" not in green.seen  # still held after the restart
    assert info.waiting_reason is not None and info.waiting_reason.startswith("deferred for carbon until")
