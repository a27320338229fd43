"""kill -9 of a coordinator in the middle of commits under load: nothing it acknowledged is missing when reopened.

Real processes; the store file is opened again by the test itself (the checks a restart makes:
quick_check, checksums, the generation side file), then by a new coordinator. Commits on the
event loop (an idle writer) and through the writer thread (load) both run before the kill
(coordinator/io/stores/commit.py).
"""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path

import pytest

from coordinator.io.stores.sqlite import SQLiteStore
from coordinator.io.stores.store import DB_FILE
from fleetwire.plan import Plan
from tests.e2e.conftest import Cluster
from tests.e2e.test_durability import FAST, WORKER, client

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]


async def test_kill_9_under_load_loses_no_acknowledged_plan_or_result(cluster: Cluster) -> None:
    """Submitters and a worker at full speed, kill -9: every accepted plan is stored, every seen result as it was."""
    coordinator = await cluster.coordinator(*FAST)
    port = cluster.url.rsplit(":", 1)[1]
    await cluster.worker("w1", *WORKER, "--max-concurrency", "64")
    accepted: list[str] = []
    results: dict[str, int] = {}
    enough = asyncio.Event()

    async def result(plan: Plan, n: int) -> None:
        if await plan.result() == n:
            results[plan.id] = n

    waiting: list[asyncio.Task[None]] = []

    async def submitter(c: object, lane: int) -> None:
        n = 0
        while True:
            n += 1
            plan = await c.submit("echo", n, plan_id=f"l{lane}-{n}")  # type: ignore[attr-defined]
            accepted.append(plan.id)  # acknowledged: accepted only once its record is durable
            waiting.append(asyncio.create_task(result(plan, n)))
            if len(accepted) >= 400 and len(results) >= 150:
                enough.set()

    async with client(cluster.url) as c:
        lanes = [asyncio.create_task(submitter(c, lane)) for lane in range(6)]  # sequential and concurrent groups
        try:
            await asyncio.wait_for(enough.wait(), 60)
            coordinator.stop(signal.SIGKILL)
            acknowledged, finished = list(accepted), dict(results)
            await coordinator.wait()
        finally:
            for task in [*lanes, *waiting]:
                task.cancel()
            await asyncio.gather(*lanes, *waiting, return_exceptions=True)
    store = SQLiteStore(Path(cluster.data_dir) / DB_FILE)
    try:
        stored = {p.created.plan_id: p for p in store.stream()}
    finally:
        store.close()
    missing = [p for p in acknowledged if p not in stored]
    assert not missing, f"{len(missing)} acknowledged plans lost, e.g. {missing[:5]}"
    assert all(stored[p].status is not None and stored[p].status.state == "succeeded"  # type: ignore[union-attr]
               and stored[p].status.result == n for p, n in finished.items())  # type: ignore[union-attr]
    await cluster.coordinator(*FAST, "--port", port)  # a restart on the same files: starts, nothing damaged
    async with client(cluster.url) as c:
        info = await c.get_plan(acknowledged[-1])
    assert info.id == acknowledged[-1]
