"""End to end: a --gpus 0,1,2,3 worker runs four 1-GPU ``python`` plans, each in its own process with its own device."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from fleetwire import Client
from fleetwire.plan import Plan
from tests.e2e.conftest import CLIENT_TOKEN, Cluster

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]


async def device_event(plan: Plan) -> str:
    """The CUDA_VISIBLE_DEVICES the plan's function emitted from its process."""
    async for event in plan.events():
        if event.kind == "device":
            return str(event.data)
    raise AssertionError(f"plan {plan.id} ended without emitting its device")


async def test_four_python_plans_see_four_distinct_devices(cluster: Cluster, tmp_path: Path) -> None:
    """Four concurrent gpus=1 python plans each return os.environ["CUDA_VISIBLE_DEVICES"]: four distinct devices."""
    await cluster.coordinator()
    allow = ("--python-allow", "tests.gpu_functions:*")
    await cluster.worker("gpu-py", "--gpus", "0,1,2,3", "--max-concurrency", "8", *allow)
    gate = tmp_path / "go"
    async with Client(cluster.url, token=CLIENT_TOKEN) as client:
        args = {"function": "tests.gpu_functions:hold", "args": [str(gate)]}
        plans = [await client.submit("python", args, resources={"gpus": 1}) for _ in range(4)]
        seen = await asyncio.wait_for(asyncio.gather(*(device_event(p) for p in plans)), 60)
        assert sorted(seen) == ["0", "1", "2", "3"]  # all four hold their device at once
        gate.touch()
        results = [await plan.result() for plan in plans]
        assert results == seen


async def test_up_autoscale_provisions_a_worker_with_the_gpus_a_queued_plan_needs(cluster: Cluster) -> None:
    """`up --autoscale 0..2 --autoscale-worker-gpus 2`: a queued gpus=2 plan brings up a 2-GPU worker that runs it."""
    up = await cluster.run("up", "--port", "0", "--autoscale", "0..2", "--autoscale-worker-gpus", "2",
                           "--autoscale-upscale-delay", "0", "--autoscale-cooldown", "0", name="up")  # fmt: skip
    url = (await up.wait_for_line(r"export FLEETWIRE_URL=(\S+)")).group(1)
    token = (await up.wait_for_line(r"export FLEETWIRE_TOKEN=(\S+)")).group(1)
    async with Client(url, token=token) as client:
        plan = await client.submit("echo", {"hi": 1}, resources={"gpus": 2})
        assert await asyncio.wait_for(plan.result(), 90) == {"hi": 1}
        assert plan.worker_id is not None and plan.worker_id.startswith("auto-")
        row = next(w for w in (await client.workers()).workers if w.id == plan.worker_id)
        assert len(row.capabilities.gpus) == 2
