"""A worker agent's host interruption ends with its run (worker_agent/agent.py ``Agent.interrupt``, ``Agent.run``)."""

from __future__ import annotations

import asyncio

import pytest

from tests.waiting import until
from worker_agent.agent import Agent

pytestmark = pytest.mark.timeout(30)


async def test_an_interruption_still_waiting_for_its_preempted_plans_ends_before_the_agents_run_returns() -> None:
    """The agent stopped (a second signal, an operator) while its interruption waits for the preempted plans to end:
    ``Agent.run`` cancels that wait and waits for it, so no task of the agent's is left pending when run returns. It
    was cancelled and never awaited: still 'cancelling' after run, it ended (or was destroyed pending) in whatever
    ran on the loop next."""
    agent = Agent("ws://127.0.0.1:9", "t", worker_id="w-interruption-end", reconnect_base_s=5.0,
                  reconnect_cap_s=5.0, preemption_grace_s=30.0)  # fmt: skip
    run = asyncio.create_task(agent.run())
    try:
        await until(lambda: agent.runner.spool is not None, timeout_s=10)  # run began (its data side started)
        agent.runner.idle.clear()  # a preempted plan still running: the interruption waits for it
        agent.interrupt("the test's host interruption")
        interruption = agent._interruption
        assert interruption is not None and not interruption.done()
        agent.stop()
        await asyncio.wait_for(run, 10)
        pending = [t for t in asyncio.all_tasks() if t is not asyncio.current_task() and not t.done()]
        assert pending == [], pending
        assert interruption.cancelled()
    finally:
        agent.stop()
        if not run.done():
            await asyncio.wait_for(run, 10)
