"""Replicated outputs over loopback (``submit.replicas``): a real coordinator and two agents in this process; the
copy plan fetches the output worker to worker and keeps it, and a consumer after the producer's worker left
takes the copy without anything being run again."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from fleetwire import Client
from tests.integration.data_helpers import CLIENT_TOKEN, digest
from tests.integration.test_pull_relay import SIZE, fleet

pytestmark = pytest.mark.timeout(60)


async def test_a_replicated_output_is_copied_before_success_and_outlives_its_worker(tmp_path: Path) -> None:
    """A (replicas y=2) on w1 succeeds only once copy plan a.c1 holds y on w2; after w1 left, B takes y from
    w2's copy: its bytes are A's, and no plan was run again."""
    async with fleet(tmp_path, data_listen="127.0.0.1:0") as (server, w1, w2), \
            Client(server.url, token=CLIENT_TOKEN) as client:  # fmt: skip
        a = await client.submit("make", args={"size": SIZE}, outputs={"y": {"replicas": 2}}, tags=["first"])
        await asyncio.wait_for(a.result(), 30)
        succeeded = [e for e in a._stream.events if e.kind == "succeeded"][-1]
        assert succeeded.data["copies"] == {"y": ["w1", "w2"]}
        assert any(e.kind == "replicating" for e in a._stream.events)
        made = digest(await a.output("y"))
        copy = server.core.plans[f"{a.id}.c1"]
        assert copy.state == "succeeded" and copy.worker_id == "w2"
        w1.stop()
        w1.stop()
        await asyncio.wait_for(_gone(server, "w1"), 10)
        b = await client.submit("take", inputs={"x": a.ref("y")})
        assert await asyncio.wait_for(b.result(), 30) == made
        assert b.worker_id == "w2" and server.core.counters["plans_rebuilt"] == 0
        assert w2.worker_id == "w2"


async def _gone(server: object, worker_id: str) -> None:
    from tests.waiting import until

    await until(lambda: worker_id not in server.core.registry)  # type: ignore[attr-defined]
