"""The worker agent's prefetch queue and revoke, over a real loopback websocket against a scripted coordinator."""

from __future__ import annotations

import pytest

import protocol
from protocol import errors
from tests.integration.test_agent_session import FakeCoordinator, Gate, assign, coordinator, make_agent, running

pytestmark = pytest.mark.timeout(15)

__all__ = ["coordinator"]  # the fixture, re-exported for pytest


async def test_prefetched_plan_waits_unaccepted_and_starts_when_a_slot_frees(coordinator: FakeCoordinator) -> None:
    """With prefetch 1 and one slot, a second assign waits unaccepted, a third is rejected; the second starts later."""
    agent = make_agent(coordinator.url, max_concurrency=1)
    first, second = Gate(), Gate()
    agent.add_handler("first", first)
    agent.add_handler("second", second)
    async with running(agent):
        await coordinator.register(agent, prefetch=1)
        await coordinator.send(assign("p1", "first"))
        assert (await coordinator.expect(protocol.Accept)).plan_id == "p1"
        assert (await coordinator.expect(protocol.Event)).kind == "started"
        await coordinator.send(assign("p2", "second"), assign("p3", "echo"))
        reject = await coordinator.expect(protocol.Reject)  # p2 waits silently; p3 finds no room
        assert (reject.plan_id, reject.code) == ("p3", errors.REJECTED)
        first.open.set()
        assert (await coordinator.expect(protocol.Event)).kind == "finished"
        assert (await coordinator.expect(protocol.Done)).plan_id == "p1"
        assert (await coordinator.expect(protocol.Accept)).plan_id == "p2"
        second.open.set()
        events = [await coordinator.expect(protocol.Event) for _ in range(2)]
        done = await coordinator.expect(protocol.Done)
        assert [e.plan_id for e in events] == ["p2", "p2"] and done.plan_id == "p2"


async def test_revoke_drops_a_waiting_plan_and_is_ignored_for_a_started_one(coordinator: FakeCoordinator) -> None:
    """revoke of a waiting plan answers reject(revoked) and it never runs; revoke of a running plan changes nothing."""
    agent = make_agent(coordinator.url, max_concurrency=1)
    gate = Gate()
    agent.add_handler("gated", gate)
    async with running(agent):
        await coordinator.register(agent, prefetch=2)
        await coordinator.send(assign("p1", "gated"))
        await coordinator.expect(protocol.Accept)
        await coordinator.expect(protocol.Event)
        await coordinator.send(assign("p2", "echo"), protocol.Revoke(plan_id="p2", attempt=1))
        reject = await coordinator.expect(protocol.Reject)
        assert (reject.plan_id, reject.attempt, reject.code) == ("p2", 1, errors.REVOKED)
        await coordinator.send(protocol.Revoke(plan_id="p1", attempt=1))  # started: refused by ignoring it
        gate.open.set()
        assert (await coordinator.expect(protocol.Event)).kind == "finished"
        done = await coordinator.expect(protocol.Done)
        assert (done.plan_id, done.outcome) == ("p1", "succeeded")
        beat = await coordinator.expect(protocol.Heartbeat)
        assert (beat.load.in_flight, beat.load.queued) == (0, 0)  # p2 never started


async def test_cancel_of_a_waiting_plan_ends_it_at_once(coordinator: FakeCoordinator) -> None:
    """A cancel of a plan still in the local queue answers done(cancelled) without running it."""
    agent = make_agent(coordinator.url, max_concurrency=1)
    gate = Gate()
    agent.add_handler("gated", gate)
    async with running(agent):
        await coordinator.register(agent, prefetch=1)
        await coordinator.send(assign("p1", "gated"), assign("p2", "echo"))
        await coordinator.expect(protocol.Accept)
        await coordinator.expect(protocol.Event)
        await coordinator.send(protocol.Cancel(plan_id="p2", attempt=1))
        done = await coordinator.expect(protocol.Done)
        assert (done.plan_id, done.outcome) == ("p2", "cancelled")
        gate.open.set()
