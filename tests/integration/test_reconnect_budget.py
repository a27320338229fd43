"""A worker reconnecting in a loop, over loopback sockets (issue 17 finding 5: bench phases f5-tags, f5-distinct).

Past its reconnect budget a worker id's ``hello`` gets ``error(too_many_reconnects)`` and close
4429, and the token's next upgrades from that address are answered HTTP 429 with Retry-After
(the penalty box), so the loop costs an HTTP answer instead of a session. The budget's rules
with a fake clock are tests/unit/test_reconnect_budget.py.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families
from websockets.exceptions import InvalidStatus

from coordinator.core import CoreConfig
from coordinator.io.frontdoor.server import CoordinatorServer, ServerSettings
from coordinator.limits import Limits
from protocol import errors
from protocol.messages import Capabilities, Error, Hello, Welcome
from tests.integration.test_security import TOKENS, closed_with, peer, worker, write_tokens
from worker_agent import Agent

pytestmark = pytest.mark.timeout(30)


async def serve(tmp_path: Path, rate: float, **limits: Any) -> CoordinatorServer:
    """A coordinator whose worker ids may register twice at once, then ``rate`` times per second."""
    path = tmp_path / "tokens.toml"
    write_tokens(path, list(TOKENS))
    server = CoordinatorServer(ServerSettings(
        port=0, token_file=str(path), limits=Limits(penalty_hold_s=0.0, **limits),
        # No reconnect grace: the churn here is of new processes, without a session secret, which the grace
        # would refuse first (worker_id_in_use; tests/unit/test_reconnect_grace.py).
        core=CoreConfig(heartbeat_interval_s=5.0, heartbeat_timeout_s=15.0, worker_reconnect_burst=2,
                        worker_reconnect_rate=rate, worker_reconnect_grace_s=0.0),
    ))
    await server.start()
    return server


@pytest.fixture
async def srv(tmp_path: Path) -> AsyncIterator[CoordinatorServer]:
    """Twice at once, and almost nothing regained during a test."""
    server = await serve(tmp_path, rate=0.001)
    yield server
    await server.stop()


async def refused_churn(srv: CoordinatorServer, worker_id: str) -> Error:
    """Register ``worker_id`` twice, then a third time: refused (too_many_reconnects, 4429); the refusal."""
    for _ in range(2):
        churn = await worker(srv, worker_id)
        await churn.ws.close()
    churn = await peer(srv, "fleet")
    await churn.send(Hello(worker_id=worker_id, capabilities=Capabilities(ops=["echo"])))
    refusal = await churn.recv()
    assert isinstance(refusal, Error) and refusal.code == errors.TOO_MANY_RECONNECTS
    assert await closed_with(churn) == errors.CLOSE_RATE_LIMITED
    return refusal


def scraped(srv: CoordinatorServer, name: str) -> float:
    body, _ = srv.metrics_exposition()
    for family in text_string_to_metric_families(body.decode()):
        for sample in family.samples:
            if sample.name == name:
                return sample.value
    raise KeyError(name)


async def test_a_worker_id_reconnecting_in_a_loop_is_refused_then_penalty_boxed(srv: CoordinatorServer) -> None:
    """The third hello of an id in a row: too_many_reconnects + 4429; the next upgrade gets 429 + Retry-After."""
    legit = await worker(srv, "gpu-steady", token="gpu")  # another token's worker, connected throughout
    refusal = await refused_churn(srv, "churn")
    assert refusal.retry_after_s > 0 and "--worker-reconnect-rate" in refusal.message
    with pytest.raises(InvalidStatus) as info:
        await peer(srv, "fleet")
    response = info.value.response
    assert response.status_code == 429 and int(response.headers["Retry-After"]) >= 1
    assert scraped(srv, "fleetwire_worker_reconnects_refused_total") == 1
    # Others are not held back: the connected worker keeps its session, another token registers.
    assert srv.core.registry.get("gpu-steady").conn_id is not None
    other = await peer(srv, "gpu")
    await other.send(Hello(worker_id="gpu-2", capabilities=Capabilities(ops=["echo"])))
    assert isinstance(await other.recv(), Welcome)
    await other.ws.close()
    await legit.ws.close()


async def test_the_worker_agent_backs_off_and_registers_once_the_budget_refills(tmp_path: Path) -> None:
    """An agent started while its id is out of budget and its token penalty-boxed waits, then registers."""
    srv = await serve(tmp_path, rate=1.0, penalty_base_s=0.5)
    agent = Agent(srv.url, "fleet-token", worker_id="w")
    task: asyncio.Task[None] | None = None
    try:
        await refused_churn(srv, "w")
        task = asyncio.create_task(agent.run())
        await asyncio.wait_for(agent.registered.wait(), 20)
        assert srv.core.registry.get("w").conn_id is not None
        assert srv.core.counters["worker_reconnects_refused"] >= 1
    finally:
        agent.stop()
        if task is not None:
            await asyncio.wait_for(task, 10)
        await srv.stop()
