"""The reconnect budget holds the crash-looping worker id only, over loopback sockets with real agents (issue 17).

Workers on one host often share a token and an address (``fleetwire up``, a rack behind one NAT).
A worker agent names its id in its upgrade (``?worker_id=``), and the penalty box for a worker id
past its reconnect budget is keyed by principal, address and that id: the looping id's next
upgrades get HTTP 429 before any ``hello``, while a neighbour with another id registers at once.
The agent backs off by the refusal's ``retry_after_s``. The pure parts: tests/unit/test_reconnect_key.py.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from websockets.exceptions import InvalidStatus

from protocol import errors
from protocol.messages import Capabilities, Hello
from tests.integration.test_reconnect_budget import refused_churn, serve
from tests.integration.test_security import closed_with, peer, refusals_scraped
from tests.waiting import until
from worker_agent import Agent

pytestmark = pytest.mark.timeout(60)


async def run_until_registered(agent: Agent) -> asyncio.Task[None]:
    """Start ``agent``; its run task once it is registered."""
    task = asyncio.create_task(agent.run())
    await asyncio.wait_for(agent.registered.wait(), 10)
    return task


async def stopped(agent: Agent, task: asyncio.Task[None]) -> None:
    agent.stop()
    await asyncio.wait_for(task, 10)


async def test_a_crash_looping_agent_gets_429_while_its_neighbour_with_the_token_registers_at_once(
    tmp_path: Path,
) -> None:
    """Two agents, one token, 127.0.0.1: the id past its budget is refused 429 before hello; the other registers."""
    srv = await serve(tmp_path, rate=0.001, penalty_base_s=60.0)  # twice at once, then (almost) never
    tasks: list[tuple[Agent, asyncio.Task[None]]] = []
    try:
        for _ in range(2):  # the process restarts in a loop: a new agent each time
            agent = Agent(srv.url, "fleet-token", worker_id="churn", reconnect_base_s=0.01, reconnect_cap_s=0.05)
            await stopped(agent, await run_until_registered(agent))
        looping = Agent(srv.url, "fleet-token", worker_id="churn", reconnect_base_s=0.01, reconnect_cap_s=0.05)
        tasks.append((looping, asyncio.create_task(looping.run())))
        await until(lambda: srv.core.counters.get("worker_reconnects_refused") == 1)  # hello refused, 4429
        # A restarted process of the looping id: its upgrade gets 429 (cheap), no hello reaches the core.
        before = refusals_scraped(srv).get("429", 0)
        restarted = Agent(srv.url, "fleet-token", worker_id="churn", reconnect_base_s=0.01, reconnect_cap_s=0.05)
        tasks.append((restarted, asyncio.create_task(restarted.run())))
        await until(lambda: refusals_scraped(srv).get("429", 0) > before)
        # The neighbour: same token, same address, another id. Without the id in the key it waits 60 s.
        calm = Agent(srv.url, "fleet-token", worker_id="calm")
        tasks.append((calm, await run_until_registered(calm)))
        assert srv.core.registry.get("calm").conn_id is not None
        assert srv.core.counters["worker_reconnects_refused"] == 1
        assert not looping.registered.is_set() and not restarted.registered.is_set()
        with pytest.raises(InvalidStatus) as info:  # the 429 names the id and the budget
            await peer(srv, "fleet", path="worker?worker_id=churn")
        assert info.value.response.status_code == 429 and b"'churn'" in info.value.response.body
    finally:
        for agent, task in tasks:
            await stopped(agent, task)
        await srv.stop()


async def test_a_peer_cannot_dodge_the_id_key_by_naming_another_id(tmp_path: Path) -> None:
    """Unnamed peers keep the (token, address) key; upgrade 'other' + hello 'churn' is closed 4403; an id over
    the cap gets 400."""
    srv = await serve(tmp_path, rate=0.001, penalty_base_s=60.0)
    try:
        await refused_churn(srv, "churn")  # raw peers name no id: the (token, address) key, as before
        with pytest.raises(InvalidStatus) as info:
            await peer(srv, "fleet", path="worker?worker_id=anyone")
        assert info.value.response.status_code == 429
    finally:
        await srv.stop()
    srv = await serve(tmp_path, rate=0.001, penalty_base_s=60.0)
    try:
        dodge = await peer(srv, "fleet", path="worker?worker_id=other")
        await dodge.send(Hello(worker_id="churn", capabilities=Capabilities(ops=["echo"])))
        assert await closed_with(dodge) == errors.CLOSE_FORBIDDEN
        assert "churn" not in srv.core.registry
        with pytest.raises(InvalidStatus) as info:  # an id over the cap is refused at the upgrade
            await peer(srv, "fleet", path="worker?worker_id=" + "x" * 200)
        assert info.value.response.status_code == 400 and b"at most 128 bytes" in info.value.response.body
    finally:
        await srv.stop()


async def test_the_agent_backs_off_by_the_refused_hellos_retry_after(tmp_path: Path) -> None:
    """With no penalty box, an agent whose hello is refused too_many_reconnects waits its retry_after_s:
    it registers after one refusal, not after a dozen quick retries at its 10 ms back-off."""
    srv = await serve(tmp_path, rate=0.5, penalty_base_s=0.0)  # a token every 2 s
    agent = Agent(srv.url, "fleet-token", worker_id="w", reconnect_base_s=0.01, reconnect_cap_s=0.02)
    try:
        await refused_churn(srv, "w")
        task = await run_until_registered(agent)
        assert srv.core.counters["worker_reconnects_refused"] <= 2  # the churn's, and at most one of the agent's
        await stopped(agent, task)
    finally:
        await srv.stop()
