"""End to end: a worker declaring four GPUs with --gpus runs four 1-GPU shell plans on four distinct devices."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from fleetwire import Client
from fleetwire.plan import Plan
from tests.e2e.conftest import CLIENT_TOKEN, Cluster

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]

# Prints its device, then holds it until its release file appears (a sleep-until-file, not a fixed sleep).
HOLD = 'echo "dev=$CUDA_VISIBLE_DEVICES"; while [ ! -f "{gate}" ]; do sleep 0.05; done'


async def device_of(plan: Plan) -> str:
    """The CUDA_VISIBLE_DEVICES the plan's command printed."""
    async for event in plan.events():
        if event.kind == "stdout" and str(event.data).startswith("dev="):
            return str(event.data)[4:]
    raise AssertionError(f"plan {plan.id} ended without printing its device")


async def test_four_plans_get_four_devices_and_a_fifth_waits(cluster: Cluster, tmp_path: Path) -> None:
    """Four concurrent gpus=1 plans see four distinct devices; a fifth (CLI --gpus 1) waits saying why, then runs."""
    await cluster.coordinator()
    await cluster.worker("gpu-w", "--gpus", "0,1,2,3", "--max-concurrency", "8", "--allow-shell")
    async with Client(cluster.url, token=CLIENT_TOKEN) as client:
        gates = [tmp_path / f"go-{i}" for i in range(4)]
        plans = [
            await client.submit("shell", {"cmd": HOLD.format(gate=gate)}, resources={"gpus": 1}) for gate in gates
        ]
        devices = await asyncio.wait_for(asyncio.gather(*(device_of(p) for p in plans)), 30)
        assert sorted(devices) == ["0", "1", "2", "3"]

        fifth_gate = tmp_path / "go-5"
        fifth = await cluster.run("submit", "shell", "--gpus", "1", "--json", "--follow",
                                  "--args", json.dumps({"cmd": HOLD.format(gate=fifth_gate)}))
        waiting = await fifth.wait_for_line(r'"kind": ?"waiting"')
        assert "needs 1 free GPU; largest free: 0 on gpu-w" in waiting.string

        gates[2].touch()  # the third plan ends: its device is free again
        assert await plans[2].result() == {"exit_code": 0}
        line = await fifth.wait_for_line(r'"data": ?"dev=')
        assert f"dev={devices[2]}" in line.string
        fifth_gate.touch()
        for gate in gates:
            gate.touch()
        assert await fifth.wait() == 0
        for plan in plans:
            assert await plan.result() == {"exit_code": 0}

        workers = await client.workers()
        row = next(w for w in workers.workers if w.id == "gpu-w")
        assert len(row.capabilities.gpus) == 4 and sum(row.gpu_use) == 0


async def test_gpus_contradicting_nvml_or_malformed_refused_at_start(cluster: Cluster) -> None:
    """A malformed --gpus declaration stops the worker at start with a message naming it (exit 2)."""
    await cluster.coordinator()
    proc = await cluster.run("worker", "--id", "bad", "--gpus", "0,0", name="bad")
    assert await proc.wait() == 2
