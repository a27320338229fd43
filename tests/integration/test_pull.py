"""A worker fetches a plan's referenced input from the worker that holds it (worker_agent/pull.py), over a real
loopback data endpoint: the bytes verified as an upload's, a local copy when held here, output_lost when gone."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path
from typing import Any, cast

import pytest

from protocol import errors, relay
from protocol.messages import InputSpec, OutputRef, Pull
from protocol.tickets import FileClaim, TicketClaims, sign, worker_key
from tests.integration.data_helpers import MASTER, WORKER, data_endpoint, digest
from worker_agent.pull import Puller
from worker_agent.pull_relay import PullRelay, RelayRefused
from worker_agent.spool import PlanData, Spool

SIZE = (9 << 20) + 4321  # more than two of the puller's batches


def _ticket(name: str, *, plan: str = "p1") -> str:
    claims = TicketClaims(plan, 1, WORKER, "get", {name: FileClaim()}, time.time() + 60)
    return sign(claims, "k1", worker_key(MASTER, WORKER))


def _consumer(tmp_path: Path, data: bytes) -> tuple[Spool, PlanData]:
    spool = Spool(tmp_path / "consumer", memory_bytes=1024)
    spec = InputSpec("x", len(data), digest(data), ref=OutputRef("p1", "y"))
    return spool, spool.plan_data("p2", 1, [spec])


async def test_a_referenced_input_is_fetched_from_its_holder_and_verified(tmp_path: Path) -> None:
    """The consumer's worker GETs the output with the holder's ticket; the input verifies with its bytes, and the
    holder keeps the output its whole retention (a client's whole download would end its stay)."""
    data = os.urandom(SIZE)
    async with data_endpoint(tmp_path) as holder:
        kept = holder.spool.add_output("p1", 1, "y", data).expires_at
        spool, plan = _consumer(tmp_path, data)
        puller = Puller(spool, "w2")
        pull = Pull("x", "p1", 1, "y", WORKER, url=holder.url, ticket=_ticket("y"))
        task = puller.start([pull], plan)
        assert task is not None
        assert await plan.wait(5.0, lambda entry: None) is None
        await task
        output = holder.spool.output("p1", 1, "y")
        assert output is not None and output.expires_at == kept  # kept its whole retention for other consumers
    assert plan.inputs["x"].path.read_bytes() == data and puller.pulled_bytes == SIZE
    assert plan.entries["x"].via == "pull"


async def test_an_input_held_here_is_copied_from_this_workers_own_spool(tmp_path: Path) -> None:
    """A pull naming this worker copies its own output: nothing is fetched."""
    data = os.urandom(1 << 20)
    spool = Spool(tmp_path / "w", memory_bytes=1024)
    spool.add_output("p1", 1, "y", data)
    plan = spool.plan_data("p2", 1, [InputSpec("x", len(data), digest(data), ref=OutputRef("p1", "y"))])
    puller = Puller(spool, "w1")
    task = puller.start([Pull("x", "p1", 1, "y", "w1")], plan)
    assert task is not None
    assert await plan.wait(5.0, lambda entry: None) is None
    assert plan.inputs["x"].path.read_bytes() == data and puller.copied_bytes == len(data) and not puller.pulled_bytes
    assert plan.entries["x"].via == "local"


@pytest.mark.parametrize("where", ["holder", "no_endpoint", "here"])
async def test_an_output_that_is_gone_fails_the_input_output_lost_naming_it(tmp_path: Path, where: str) -> None:
    """A 404 from the holder, a holder without a data endpoint, or an output gone from this worker's spool: the
    input fails output_lost, its detail naming the plan, attempt and output (what the coordinator rebuilds)."""
    data = b"never made"
    async with data_endpoint(tmp_path) as holder:
        spool, plan = _consumer(tmp_path, data)
        worker = "w2" if where == "here" else WORKER
        pull = Pull("x", "p1", 1, "y", worker, url="" if where == "no_endpoint" else holder.url, ticket=_ticket("y"))
        task = Puller(spool, "w2").start([pull], plan)
        error = await plan.wait(5.0, lambda entry: None)
        assert task is not None
        await task
    assert error is not None and error.code == errors.OUTPUT_LOST
    assert error.detail == {"input": "x", "plan_id": "p1", "attempt": 1, "output": "y", "worker_id": worker}
    assert "output 'y' of plan p1" in error.message


@pytest.mark.parametrize("kid", ["k1", "c-other"])
async def test_a_ticket_the_holder_refuses_fails_the_input_ticket_refused_not_output_lost(
    tmp_path: Path, kid: str
) -> None:
    """A ticket the holder does not accept (signed with a key it does not know, or its known key id with another
    secret: coordinators whose cluster secrets differ) fails the input ticket_refused at once, with the holder's
    reason: the output it holds is not reported lost (nothing is made again for it)."""
    data = b"made, and kept"
    async with data_endpoint(tmp_path) as holder:
        holder.spool.add_output("p1", 1, "y", data)
        spool, plan = _consumer(tmp_path, data)
        claims = TicketClaims("p1", 1, WORKER, "get", {"y": FileClaim()}, time.time() + 60)
        ticket = sign(claims, kid, worker_key(b"another cluster secret's key", WORKER))
        task = Puller(spool, "w2").start([Pull("x", "p1", 1, "y", WORKER, url=holder.url, ticket=ticket)], plan)
        error = await plan.wait(5.0, lambda entry: None)
        assert task is not None
        await task
    assert error is not None and error.code == errors.TICKET_REFUSED
    assert error.detail == {"input": "x", "plan_id": "p1", "attempt": 1, "output": "y", "worker_id": WORKER}
    why = "unknown ticket key 'c-other'" if kid == "c-other" else "bad ticket signature"
    assert f"refused the ticket to fetch it (401: {why}" in error.message
    assert "--cluster-secret-file" in error.message and "not known to be lost" in error.message


async def test_a_ticket_the_holder_refuses_through_the_relay_fails_the_input_ticket_refused(tmp_path: Path) -> None:
    """A holder without a data endpoint, reached through the relay, that refuses the ticket (data_end unauthorized):
    the input fails ticket_refused naming the relay's answer, not output_lost."""

    class RefusingRelay:
        async def fetch(self, *args: Any, **kwargs: Any) -> None:
            raise RelayRefused("unauthorized: unknown ticket key 'c-other'", relay.UNAUTHORIZED)

    spool, plan = _consumer(tmp_path, b"held")
    puller = Puller(spool, "w2", relay=cast(PullRelay, RefusingRelay()))
    task = puller.start([Pull("x", "p1", 1, "y", WORKER, url="", ticket=_ticket("y"))], plan)
    error = await plan.wait(5.0, lambda entry: None)
    assert task is not None
    await task
    assert error is not None and error.code == errors.TICKET_REFUSED
    assert "through the relay unauthorized: unknown ticket key 'c-other'" in error.message


@pytest.mark.timeout(20)
async def test_a_pull_cancelled_as_a_read_returns_ends(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The attempt's task cancelled in the loop iteration in which a read of the body returns ends there (on Python
    3.11 asyncio.wait_for lost that cancel: the fetch went on to the output's last byte after the attempt ended)."""
    data = os.urandom(SIZE)
    task: asyncio.Task[None] | None = None
    reads = 0
    read = asyncio.StreamReader.read

    async def read_then_cancel(reader: asyncio.StreamReader, n: int = -1) -> bytes:
        """The real read; as the consumer's second one (the body's, after the head's) returns, the attempt's task
        is cancelled. The holder's reads (the request, in this process too) are not counted."""
        nonlocal reads
        chunk = await read(reader, n)
        if chunk and not chunk.startswith(b"GET "):
            reads += 1
            if reads == 2 and task is not None:
                task.cancel()
        return chunk

    async with data_endpoint(tmp_path) as holder:
        holder.spool.add_output("p1", 1, "y", data)
        spool, plan = _consumer(tmp_path, data)
        puller = Puller(spool, "w2", stall_timeout_s=10)
        monkeypatch.setattr(asyncio.StreamReader, "read", read_then_cancel)
        task = puller.start([Pull("x", "p1", 1, "y", WORKER, url=holder.url, ticket=_ticket("y"))], plan)
        assert task is not None
        await asyncio.wait([task], timeout=10)
        monkeypatch.undo()
    assert task.cancelled()
    assert reads == 2, f"the fetch went on reading after it was cancelled ({reads} reads, {puller.pulled_bytes} bytes)"


@pytest.mark.timeout(20)
async def test_a_pull_cancelled_as_its_connection_opens_ends(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The attempt's task cancelled in the loop iteration in which the connection to the holder opens ends there,
    fetching nothing (on Python 3.11 asyncio.wait_for lost that cancel: the whole output was fetched)."""
    data = os.urandom(SIZE)
    task: asyncio.Task[None] | None = None
    open_connection = asyncio.open_connection

    async def open_then_cancel(*args: Any, **kwargs: Any) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        """The real open_connection; as it returns, the attempt's task is cancelled."""
        opened = await open_connection(*args, **kwargs)
        assert task is not None
        task.cancel()
        return opened

    async with data_endpoint(tmp_path) as holder:
        holder.spool.add_output("p1", 1, "y", data)
        spool, plan = _consumer(tmp_path, data)
        puller = Puller(spool, "w2", stall_timeout_s=10)
        monkeypatch.setattr(asyncio, "open_connection", open_then_cancel)
        task = puller.start([Pull("x", "p1", 1, "y", WORKER, url=holder.url, ticket=_ticket("y"))], plan)
        assert task is not None
        await asyncio.wait([task], timeout=10)
        monkeypatch.undo()
    assert task.cancelled()
    assert puller.pulled_bytes == 0, f"the fetch went on after it was cancelled ({puller.pulled_bytes} bytes)"
