"""How long a started attempt waits for its inputs (the worker's --input-timeout, worker_agent/spool.py
PlanData.wait): bounded by silence, not by the transfer; a new attempt whose client has gone fails
inputs_unavailable naming the inputs (a real coordinator and two agents in this process)."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from coordinator.core import CoreConfig
from coordinator.io.frontdoor.server import CoordinatorServer, ServerSettings
from fleetwire import Client, PlanFailed
from protocol.messages import InputSpec
from tests.integration.test_data_plane import NeverUploads
from worker_agent.agent import Agent
from worker_agent.spool import Spool
from worker_agent.spool_files import INPUTS_UNAVAILABLE

pytestmark = pytest.mark.timeout(60)

WORKER_TOKEN = "w-secret"
CLIENT_TOKEN = "c-secret"
DATA = bytes(range(256)) * 16  # 4 KiB: kept in memory


def _spec(data: bytes) -> InputSpec:
    return InputSpec(name="data", size=len(data), digest=f"sha256:{hashlib.sha256(data).hexdigest()}")


async def test_slow_upload_that_keeps_going_is_not_cut_off(tmp_path: Path) -> None:
    """Bytes arriving every 0.05 s for 1.6 s in all, with a 0.5 s input timeout: the input is verified."""
    spool = Spool(tmp_path / "spool")
    data = spool.plan_data("p1", 1, [_spec(DATA)])
    entry = data.entries["data"]
    verified: list[str] = []

    async def trickle() -> None:
        for start in range(0, len(DATA), 128):  # 32 pieces
            await asyncio.sleep(0.05)
            entry.write(DATA[start : start + 128])
        entry.finish()

    writer = asyncio.create_task(trickle())
    began = time.monotonic()
    error = await data.wait(0.5, lambda e: verified.append(e.name))
    await writer
    assert error is None and verified == ["data"]
    assert time.monotonic() - began > 1.0  # longer than the timeout: progress kept it waiting


async def test_silence_fails_inputs_unavailable_counted_from_the_last_byte(tmp_path: Path) -> None:
    """Some bytes, then nothing: inputs_unavailable names the input and what arrived, no sooner than the
    timeout after the last byte."""
    spool = Spool(tmp_path / "spool")
    data = spool.plan_data("p1", 1, [_spec(DATA)])
    entry = data.entries["data"]
    last_write: list[float] = []

    async def then_gone() -> None:
        await asyncio.sleep(0.3)
        entry.write(DATA[:100])
        last_write.append(time.monotonic())

    writer = asyncio.create_task(then_gone())
    error = await data.wait(0.5, lambda e: None)
    await writer
    assert error is not None and error.code == INPUTS_UNAVAILABLE
    assert time.monotonic() - last_write[0] >= 0.5
    assert "'data' (100 of 4096 bytes)" in error.message and "--input-timeout" in error.message
    assert error.detail == {"inputs": ["data"]}


@contextlib.asynccontextmanager
async def agent(server: CoordinatorServer, tmp_path: Path, worker_id: str, input_timeout_s: float
                ) -> AsyncIterator[Agent]:
    worker = Agent(server.url, WORKER_TOKEN, worker_id=worker_id, data_listen="127.0.0.1:0",
                   spool_dir=str(tmp_path / worker_id), input_timeout_s=input_timeout_s, drain_timeout_s=0.2)

    @worker.handler
    async def digest(ctx: Any, args: Any) -> dict[str, Any]:
        return {"size": ctx.inputs["data"].size}

    task = asyncio.create_task(worker.run())
    await asyncio.wait_for(worker.registered.wait(), 10)
    try:
        yield worker
    finally:
        worker.stop()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(task, 10)


async def test_new_attempt_whose_client_has_gone_fails_inputs_unavailable(tmp_path: Path) -> None:
    """The client leaves; its plan's worker stops; the next attempt's worker waits its --input-timeout for the
    client, then the plan fails inputs_unavailable naming the input (seen by another client watching it)."""
    server = CoordinatorServer(ServerSettings(
        port=0, worker_tokens=(WORKER_TOKEN,), client_tokens=(CLIENT_TOKEN,),
        core=CoreConfig(heartbeat_interval_s=0.5, heartbeat_timeout_s=3.0), reaper_interval_s=0.1,
    ))
    await server.start()
    try:
        async with agent(server, tmp_path, "first", input_timeout_s=30.0) as first:
            async with Client(server.url, token=CLIENT_TOKEN) as client:
                client.transport = NeverUploads()
                plan = await client.submit("digest", inputs={"data": DATA})
                async for event in plan.events():
                    if event.kind == "data_ready":
                        break
                plan_id = plan.id
            # the client has gone; the worker holding attempt 1 stops and hands its plan back
            async with agent(server, tmp_path, "second", input_timeout_s=1.0):
                first.stop()
                async with Client(server.url, token=CLIENT_TOKEN) as watcher:
                    watched = await watcher.watch(plan_id)
                    with pytest.raises(PlanFailed) as failed:
                        await asyncio.wait_for(watched.result(), 30)
                    info = await watcher.get_plan(plan_id)
    finally:
        await server.stop()
    assert failed.value.code == "inputs_unavailable"
    assert "'data' (0 of 4096 bytes)" in failed.value.message
    assert "did not come back" in failed.value.message
    assert (info.worker_id, info.attempt) == ("second", 2)
