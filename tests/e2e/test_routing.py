"""Routing end to end: real coordinator and worker processes, capabilities from worker flags, the SDK's hints."""

from __future__ import annotations

import asyncio

import pytest

from fleetwire import Client
from fleetwire.plan import Plan
from tests.e2e.conftest import CLIENT_TOKEN, Cluster

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]


async def _waiting_reason(plan: Plan) -> str:
    async with asyncio.timeout(15):
        async for event in plan.events():
            if event.kind == "waiting":
                return str(event.data["reason"])
    raise AssertionError(f"plan {plan.id} ended without waiting")


async def test_sessions_stick_and_plans_land_only_where_they_fit(cluster: Cluster) -> None:
    """A session key keeps going to one worker under round robin; tag/model/GPU/KV needs decide where plans land."""
    await cluster.coordinator("--policy", "round_robin")
    await cluster.worker("w-eu", "--tags", "eu", "--model", "llama-3-8b", "--carbon-zone", "FR",
                         "--kv-blocks", "1000", "--kv-block-tokens", "16", "--max-concurrency", "4")
    await cluster.worker("w-us", "--tags", "us", "--model", "mistral-7b", "--model", "llama-3-8b",
                         "--accelerator", "mixed", "--max-concurrency", "4")
    async with Client(cluster.url, token=CLIENT_TOKEN) as client:
        rows = {w.id: w.capabilities for w in (await client.workers()).workers}
        assert (rows["w-eu"].models, rows["w-eu"].carbon_zone, rows["w-eu"].kv_blocks) == (["llama-3-8b"], "FR", 1000)
        assert (rows["w-us"].models, rows["w-us"].accelerator) == (["mistral-7b", "llama-3-8b"], "mixed")

        # Round robin alone alternates; with a session key every plan goes back to the first one's worker.
        spread = [await client.submit("echo", {"n": n}) for n in range(2)]
        await asyncio.gather(*(p.result() for p in spread))
        assert {p.worker_id for p in spread} == {"w-eu", "w-us"}
        homes = []
        for n in range(4):
            plan = await client.submit("echo", {"turn": n}, session_key="chat-42")
            assert await plan.result() == {"turn": n}
            homes.append(plan.worker_id)
        assert len(set(homes)) == 1 and homes[0] in rows

        # Tag plus model: only w-us has both; w-eu has the model but not the tag.
        for _ in range(3):
            plan = await client.submit("echo", 1, tags=["us"], requirements={"model": "llama-3-8b"})
            await plan.result()
            assert plan.worker_id == "w-us"
        plan = await client.submit("echo", 1, requirements={"model": "mistral-7b", "accelerator": "gpu"})
        await plan.result()
        assert plan.worker_id == "w-us"  # a mixed host serves a gpu requirement

        # GPU memory: workers report the GPUs their probe found (none on a CPU-only host).
        gpu_hosts = {wid for wid, caps in rows.items() if any(g.memory_bytes >= 10**9 for g in caps.gpus)}
        plan = await client.submit("echo", 1, requirements={"min_gpu_memory_bytes": 10**9})
        if gpu_hosts:
            await plan.result()
            assert plan.worker_id in gpu_hosts
        else:
            reason = await _waiting_reason(plan)
            assert "a GPU with at least 1.0 GB of memory" in reason
            await client.cancel(plan.id)

        # KV admission: 20k tokens need 1250 blocks of 16; w-eu, the only eu worker, has 1000.
        plan = await client.submit("echo", 1, tags=["eu"], hints={"prompt_tokens": 19_000, "max_output_tokens": 1_000})
        reason = await _waiting_reason(plan)
        assert "1250 KV blocks" in reason and "w-eu" in reason
        await client.cancel(plan.id)
        plan = await client.submit("echo", 1, tags=["eu"], hints={"prompt_tokens": 1_000, "policy": "kv_aware"})
        await plan.result()
        assert plan.worker_id == "w-eu"
