"""The client checks each output's bytes against the digest its worker reported (a real coordinator and agent
in this process, the output's file damaged in the worker's spool): direct, by chunks and relayed."""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from coordinator.io.frontdoor.server import CoordinatorServer
from fleetwire import Client
from fleetwire.data import OutputMismatch
from fleetwire.plan import Plan
from tests.integration.data_helpers import CLIENT_TOKEN, coordinator_and_data_worker
from worker_agent.agent import Agent

pytestmark = pytest.mark.timeout(60)

DATA = bytes(range(256)) * (9 << 12)  # 9 MiB: more than two of the download's buffers


@pytest.fixture
async def cluster(tmp_path: Path) -> AsyncIterator[tuple[CoordinatorServer, Agent]]:
    async def make(ctx: Any, args: Any) -> dict[str, Any]:
        ctx.output("out", DATA)
        return {"size": len(DATA)}

    async with coordinator_and_data_worker(tmp_path, {"make": make}) as (server, agent):
        yield server, agent


async def _made(client: Client, agent: Agent, *, damage: bool) -> Plan:
    """A succeeded plan with output ``out``; with ``damage``, one byte of its spool file flipped (same size)."""
    plan = await client.submit("make", outputs=["out"])
    await asyncio.wait_for(plan.result(), 20)
    if damage:
        spool = agent.runner.spool
        assert spool is not None
        output = next(o for attempt in range(4) if (o := spool.output(plan.id, attempt, "out")) is not None)
        await asyncio.to_thread(_flip_byte, output.path, len(DATA) - 5)
    return plan


def _flip_byte(path: Path, offset: int) -> None:
    with open(path, "r+b") as file:
        file.seek(offset)
        byte = file.read(1)
        file.seek(offset)
        file.write(bytes([byte[0] ^ 0xFF]))


def _leftovers(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.name.startswith((".out", "out")))


async def test_intact_output_passes_the_check_on_every_path(cluster: tuple[CoordinatorServer, Agent],
                                                           tmp_path: Path) -> None:
    """An undamaged output arrives whole by output(), output_to() and chunks: the check passes."""
    server, agent = cluster
    async with Client(server.url, token=CLIENT_TOKEN) as client:
        plan = await _made(client, agent, damage=False)
        assert await plan.output("out") == DATA
        target = await plan.output_to("out", tmp_path / "out.bin")
        assert hashlib.sha256(target.read_bytes()).digest() == hashlib.sha256(DATA).digest()


async def test_damaged_output_fails_output_to_and_leaves_no_file(cluster: tuple[CoordinatorServer, Agent],
                                                                 tmp_path: Path) -> None:
    """A spool file damaged on the worker: output_to (direct) raises OutputMismatch naming it, and writes nothing."""
    server, agent = cluster
    async with Client(server.url, token=CLIENT_TOKEN) as client:
        plan = await _made(client, agent, damage=True)
        with pytest.raises(OutputMismatch, match=r"output 'out': the bytes received have digest blake3:"):
            await plan.output_to("out", tmp_path / "out.bin")
    assert _leftovers(tmp_path) == []
    assert plan.transfers.get(("get", "out")) is None  # not counted as a finished transfer


async def test_damaged_output_fails_output_and_chunks(cluster: tuple[CoordinatorServer, Agent]) -> None:
    """The same damage fails plan.output() and the end of output_chunks() with OutputMismatch."""
    server, agent = cluster
    async with Client(server.url, token=CLIENT_TOKEN) as client:
        plan = await _made(client, agent, damage=True)
        with pytest.raises(OutputMismatch, match="reported when the plan succeeded"):
            await plan.output("out")
        received = 0
        with pytest.raises(OutputMismatch):
            async for chunk in plan.output_chunks("out"):
                received += len(chunk)
        assert received == len(DATA)


async def test_damaged_output_fails_relayed(cluster: tuple[CoordinatorServer, Agent], tmp_path: Path) -> None:
    """Relayed through the coordinator, the damaged output fails the same way and leaves no file."""
    server, agent = cluster
    async with Client(server.url, token=CLIENT_TOKEN) as client:
        plan = await _made(client, agent, damage=True)
        plan.relay = True
        with pytest.raises(OutputMismatch, match="output 'out'"):
            await plan.output_to("out", tmp_path / "out.bin")
        with pytest.raises(OutputMismatch):
            await plan.output("out")
    assert _leftovers(tmp_path) == []
