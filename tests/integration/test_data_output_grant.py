"""A succeeded plan's outputs are fetched with the ``get`` ticket its ``data_ready`` brought (no ``data_ticket``
round trip to the coordinator), and with a fresh one when that one does not cover the output or is about to
expire (a real coordinator and agent in this process)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

import fleetwire.plan
from coordinator.io.frontdoor.server import CoordinatorServer
from fleetwire import Client
from fleetwire.data import Grant
from tests.integration.data_helpers import CLIENT_TOKEN, coordinator_and_data_worker

pytestmark = pytest.mark.timeout(60)

DATA = bytes(range(256)) * (1 << 12)  # 1 MiB
EXTRA = b"not declared at submit"


@pytest.fixture
async def cluster(tmp_path: Path) -> AsyncIterator[CoordinatorServer]:
    async def make(ctx: Any, args: Any) -> dict[str, Any]:
        ctx.output("out", DATA)
        ctx.output("extra", EXTRA)
        return {"size": len(DATA)}

    async with coordinator_and_data_worker(tmp_path, {"make": make}) as (server, _agent):
        yield server


def _count_tickets(client: Client) -> list[str]:
    """Record each data_ticket request the client makes (the real request still goes to the coordinator)."""
    asked: list[str] = []
    real = client.data_ticket

    async def data_ticket(plan_id: str, direction: Any = "get", **lineage: str) -> Grant:
        asked.append(direction)
        return await real(plan_id, direction, **lineage)

    client.data_ticket = data_ticket  # type: ignore[method-assign]
    return asked


async def test_a_declared_output_is_fetched_without_asking_for_a_ticket(cluster: CoordinatorServer,
                                                                       tmp_path: Path) -> None:
    """output_to, output and output_chunks of a declared output use data_ready's get ticket: no data_ticket."""
    async with Client(cluster.url, token=CLIENT_TOKEN) as client:
        asked = _count_tickets(client)
        plan = await client.submit("make", outputs=["out"])
        await asyncio.wait_for(plan.result(), 20)
        target = await plan.output_to("out", tmp_path / "out.bin")
        assert target.read_bytes() == DATA
        assert await plan.output("out") == DATA
        assert b"".join([chunk async for chunk in plan.output_chunks("out")]) == DATA
        assert asked == []


async def test_an_undeclared_output_falls_back_to_a_fresh_ticket(cluster: CoordinatorServer, tmp_path: Path) -> None:
    """An output not named at submit is outside data_ready's ticket (403): a fresh ticket fetches it whole."""
    async with Client(cluster.url, token=CLIENT_TOKEN) as client:
        asked = _count_tickets(client)
        plan = await client.submit("make", outputs=["out"])
        await asyncio.wait_for(plan.result(), 20)
        assert (await plan.output_to("extra", tmp_path / "extra.bin")).read_bytes() == EXTRA
        assert await plan.output("extra") == EXTRA
        assert asked == ["get", "get"]


async def test_a_ticket_near_its_expiry_is_not_used(cluster: CoordinatorServer, tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """data_ready's ticket expires within READY_GRANT_MARGIN_S: the client asks for a fresh one first."""
    monkeypatch.setattr(fleetwire.plan, "READY_GRANT_MARGIN_S", 1e9)
    async with Client(cluster.url, token=CLIENT_TOKEN) as client:
        asked = _count_tickets(client)
        plan = await client.submit("make", outputs=["out"])
        await asyncio.wait_for(plan.result(), 20)
        assert (await plan.output_to("out", tmp_path / "out.bin")).read_bytes() == DATA
        assert asked == ["get"]
