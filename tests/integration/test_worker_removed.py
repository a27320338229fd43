"""A removed worker stops for good (issue #25 part 7): the real coordinator and agent over loopback.

``fleetwire remove`` closes the worker's session ``4410``; a restarted agent with that id gets its
``hello`` closed ``4410`` too. Both must end the agent (``WorkerRemoved``; ``fleetwire worker``
exits :data:`~worker_agent.session.EXIT_REMOVED`), never redial forever.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
from collections.abc import AsyncIterator

import pytest

from coordinator.io.frontdoor.server import CoordinatorServer, ServerSettings
from fleetwire import Client
from worker_agent import Agent
from worker_agent.main import add_worker_arguments, run_worker
from worker_agent.session import EXIT_REMOVED, WorkerRemoved

pytestmark = pytest.mark.timeout(30)

WORKER_TOKEN = "worker-token-for-removal-tests"
ADMIN_TOKEN = "admin-token-for-removal-tests"


@pytest.fixture
async def server() -> AsyncIterator[CoordinatorServer]:
    srv = CoordinatorServer(ServerSettings(port=0, worker_tokens=(WORKER_TOKEN,), admin_tokens=(ADMIN_TOKEN,)))
    await srv.start()
    try:
        yield srv
    finally:
        await srv.stop()


async def _removed(server: CoordinatorServer, worker_id: str) -> None:
    """Register ``worker_id`` and remove it; its agent's run() must raise WorkerRemoved."""
    agent = Agent(server.url, WORKER_TOKEN, worker_id=worker_id, reconnect_base_s=0.01, reconnect_cap_s=0.05)
    run = asyncio.create_task(agent.run())
    try:
        await asyncio.wait_for(agent.registered.wait(), 10)
        async with Client(server.url, token=ADMIN_TOKEN) as client:
            await client.remove_worker(worker_id)
        with pytest.raises(WorkerRemoved, match=f"worker {worker_id} was removed by an operator"):
            await asyncio.wait_for(run, 10)
    finally:
        run.cancel()
        with contextlib.suppress(BaseException):
            await run


async def test_a_removed_worker_stops_with_worker_removed(server: CoordinatorServer) -> None:
    """remove_worker closes the live session 4410: the agent's run() raises WorkerRemoved instead of reconnecting."""
    await _removed(server, "gone-1")


async def test_a_restarted_agent_with_a_removed_id_is_told_and_stops(server: CoordinatorServer) -> None:
    """A new agent with a removed id: its hello is closed 4410 and run() raises WorkerRemoved (it redialled forever)."""
    await _removed(server, "gone-2")
    again = Agent(server.url, WORKER_TOKEN, worker_id="gone-2", reconnect_base_s=0.01, reconnect_cap_s=0.05)
    with pytest.raises(WorkerRemoved, match="start the worker with another --id"):
        await asyncio.wait_for(again.run(), 10)


async def test_fleetwire_worker_exits_with_the_removed_status(
    server: CoordinatorServer, capsys: pytest.CaptureFixture[str]
) -> None:
    """`fleetwire worker` with a removed id exits EXIT_REMOVED (4) with one line saying so."""
    await _removed(server, "gone-3")
    parser = argparse.ArgumentParser()
    add_worker_arguments(parser)
    ns = parser.parse_args(["--url", server.url, "--token", WORKER_TOKEN, "--id", "gone-3", "--reconnect-base", "0.01"])
    assert await asyncio.wait_for(run_worker(ns), 10) == EXIT_REMOVED
    assert "gone-3 was removed by an operator" in capsys.readouterr().err
