"""Batching on every hop, over real loopback sockets: SDK submit_many, the worker's frames, fan-out encoding."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

import msgspec
import pytest

from coordinator.io.frontdoor.core_driver import _encode_shared
from coordinator.io.frontdoor.server import CoordinatorServer, ServerSettings
from fleetwire import Client, InvalidArgument, SyncClient
from protocol import Codec
from protocol.messages import Event, FromClient, ToClient
from worker_agent import Agent

pytestmark = pytest.mark.timeout(30)


@pytest.fixture
async def fleet() -> AsyncIterator[tuple[CoordinatorServer, Agent]]:
    server = CoordinatorServer(ServerSettings(port=0, insecure=True))
    await server.start()
    agent = Agent(server.url, worker_id="batch-worker", max_concurrency=64)
    run = asyncio.create_task(agent.run())
    await asyncio.wait_for(agent.registered.wait(), 10)
    try:
        yield server, agent
    finally:
        agent.stop()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(run, 10)
        await server.stop()


async def test_submit_many_runs_every_plan_in_order_in_few_frames(fleet: tuple[CoordinatorServer, Agent]) -> None:
    """submit_many returns the plans in argument order, each with its result, sent in far fewer frames than plans."""
    server, _ = fleet
    async with Client(server.url) as client:
        before = server.frames.of("client")[0]
        plans = await client.submit_many("echo", [{"n": i} for i in range(200)])
        results = [await plan.result() for plan in plans]
        frames = server.frames.of("client")[0] - before
    assert results == [{"n": i} for i in range(200)]
    assert len({plan.id for plan in plans}) == 200
    assert frames < 20


async def test_submit_many_raises_the_refusal_after_every_reply(fleet: tuple[CoordinatorServer, Agent]) -> None:
    """A refused batch raises InvalidArgument once every reply is in; the session stays usable."""
    server, _ = fleet
    async with Client(server.url) as client:
        with pytest.raises(InvalidArgument, match="max_attempts"):
            await client.submit_many("echo", [1, 2, 3], max_attempts=0)
        assert client.session.pending_requests == 0  # every reply of the batch was matched
        assert [await p.result() for p in await client.submit_many("echo", [4, 5])] == [4, 5]


async def test_submit_many_needs_one_plan_id_per_item(fleet: tuple[CoordinatorServer, Agent]) -> None:
    """plan_ids of another length than args is refused before anything is sent."""
    server, _ = fleet
    async with Client(server.url) as client:
        with pytest.raises(ValueError, match="one per plan"):
            await client.submit_many("echo", [1, 2], plan_ids=["only-one"])


async def test_a_plan_that_ends_at_once_comes_from_the_worker_in_one_frame(
    fleet: tuple[CoordinatorServer, Agent],
) -> None:
    """The worker sends an echo plan's accept, event and done as one frame."""
    server, _ = fleet
    async with Client(server.url) as client:
        await (await client.submit("echo", args=0)).result()  # warm: nothing else left to send
        before = server.frames.of("worker")[0]
        for i in range(10):
            await (await client.submit("echo", args=i)).result()
        assert server.frames.of("worker")[0] - before == 10


def test_a_message_for_several_sessions_is_encoded_once_per_encoding() -> None:
    """An event sent to many sessions becomes one shared encoding per codec; others stay Structs."""
    msgpack = Codec("msgpack", FromClient, "client")
    json_codec = Codec("json", FromClient, "client")
    sessions: dict[int, Any] = {
        1: SimpleNamespace(codec=msgpack), 2: SimpleNamespace(codec=msgpack), 3: SimpleNamespace(codec=json_codec)
    }
    shared = Event(plan_id="p", kind="tok", data=[1, "x"], seq=7)
    own = Event(plan_id="q", kind="tok", data=2, seq=1)
    out = _encode_shared({1: [shared, own], 2: [shared], 3: [shared]}, sessions)
    assert out[1][0] is out[2][0] and isinstance(out[1][0], msgspec.Raw)
    assert out[1][1] is own
    assert msgspec.msgpack.decode(bytes(out[1][0]), type=ToClient) == shared
    assert msgspec.json.decode(bytes(out[3][0]), type=ToClient) == shared
    # A frame made of shared and own messages decodes like one made of Structs.
    frame = msgpack.encode(out[1])
    assert Codec("msgpack", ToClient, "coordinator").decode(frame) == [shared, own]


def test_nothing_shared_leaves_the_sends_as_they_are() -> None:
    """Messages each for one session are not pre-encoded."""
    codec = Codec("msgpack", FromClient, "client")
    sessions: dict[int, Any] = {i: SimpleNamespace(codec=codec) for i in (1, 2, 3)}
    sends: dict[int, list[Any]] = {i: [Event(plan_id=str(i), kind="k", seq=1)] for i in (1, 2, 3)}
    assert _encode_shared(sends, sessions) is sends


def test_a_sinks_messages_are_not_counted_as_shared() -> None:
    """A message for one session and a sink (the OpenAI door's request, no websocket) is no shared encoding."""
    codec = Codec("msgpack", FromClient, "client")
    sessions: dict[int, Any] = {1: SimpleNamespace(codec=codec), 2: SimpleNamespace(codec=codec)}
    event = Event(plan_id="p", kind="token", data={"text": "hi"}, seq=3)
    sends: dict[int, list[Any]] = {1: [event], 2: [Event(plan_id="q", kind="k", seq=1)], 1 << 48: [event]}
    assert _encode_shared(sends, sessions) is sends


def test_sync_client_submit_many() -> None:
    """SyncClient.submit_many returns SyncPlans in order; plans/drain/undrain work without an event loop."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    async def start() -> tuple[CoordinatorServer, Agent, asyncio.Task[None]]:
        server = CoordinatorServer(ServerSettings(port=0, worker_tokens=("w-token",), admin_tokens=("a-token",)))
        await server.start()
        agent = Agent(server.url, "w-token", worker_id="sync-batch-worker")
        task = asyncio.create_task(agent.run())
        await asyncio.wait_for(agent.registered.wait(), 10)
        return server, agent, task

    async def stop(server: CoordinatorServer, agent: Agent, task: asyncio.Task[None]) -> None:
        agent.stop()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(task, 10)
        await server.stop()

    server, agent, task = asyncio.run_coroutine_threadsafe(start(), loop).result(20)
    try:
        with SyncClient(server.url, token="a-token") as client:  # admin: drain/undrain
            plans = client.submit_many("echo", ["a", "b", "c"])
            assert [plan.result(timeout=10) for plan in plans] == ["a", "b", "c"]
            listed = client.plans(states=["succeeded"])
            assert {p.id for p in listed.plans} == {plan.id for plan in plans}
            client.drain("sync-batch-worker")
            assert next(w for w in client.workers().workers if w.id == "sync-batch-worker").draining
            client.undrain("sync-batch-worker")
            assert not next(w for w in client.workers().workers if w.id == "sync-batch-worker").draining
            with pytest.raises(ValueError, match="plan states"):
                client.plans(states=["finished"])
    finally:
        asyncio.run_coroutine_threadsafe(stop(server, agent, task), loop).result(20)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()
