"""The relay over loopback: a real coordinator and agent in this process, inputs and outputs carried through
the coordinator (docs/PROTOCOL.md §11 Relay), and args and results over the frame limit."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from coordinator.core import CoreConfig
from coordinator.io.server import CoordinatorServer, ServerSettings
from fleetwire import Client, FleetwireConnectionError
from protocol import errors
from tests.integration.data_helpers import digest
from worker_agent.agent import Agent

pytestmark = pytest.mark.timeout(60)

WORKER_TOKEN = "w-secret"
CLIENT_TOKEN = "c-secret"
SIZE = 3 << 20  # 3 MiB



@contextlib.asynccontextmanager
async def running(tmp_path: Path, **agent_options: Any) -> AsyncIterator[tuple[CoordinatorServer, Agent]]:
    server = CoordinatorServer(ServerSettings(
        port=0, worker_tokens=(WORKER_TOKEN,), client_tokens=(CLIENT_TOKEN,),
        core=CoreConfig(heartbeat_interval_s=0.5, heartbeat_timeout_s=3.0), reaper_interval_s=0.1,
    ))
    await server.start()
    agent = Agent(server.url, WORKER_TOKEN, worker_id="w1", spool_dir=str(tmp_path / "spool"), input_timeout_s=10.0,
                  **agent_options)

    @agent.handler
    async def reverse(ctx: Any, args: Any) -> dict[str, Any]:
        data = ctx.inputs["data"].path.read_bytes()
        ctx.output("reversed", data[::-1])
        return {"size": len(data), "digest": digest(data), "inputs": sorted(ctx.inputs)}

    @agent.handler
    async def measure(ctx: Any, args: Any) -> dict[str, Any]:
        return {"blob": len(args["blob"]), "digest": digest(args["blob"]), "inputs": sorted(ctx.inputs)}

    @agent.handler
    async def produce(ctx: Any, args: Any) -> Any:
        return bytes(range(256)) * (args["size"] // 256)

    task = asyncio.create_task(agent.run())
    await asyncio.wait_for(agent.registered.wait(), 10)
    try:
        yield server, agent
    finally:
        agent.stop()
        agent.stop()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(task, 10)
        await server.stop()


def received_via(plan: Any) -> dict[str, str]:
    return {e.data["name"]: e.data["via"] for e in plan._stream.events if e.kind == "input_received"}


async def test_worker_without_data_endpoint_gets_inputs_and_returns_outputs_relayed(tmp_path: Path) -> None:
    """No --data-listen: a 3 MiB input reaches the handler through the coordinator and a 3 MiB output comes back."""
    data = bytes(range(256)) * (SIZE // 256)
    async with running(tmp_path) as (server, agent), Client(server.url, token=CLIENT_TOKEN) as client:
        assert agent.data_server is None
        plan = await client.submit("reverse", inputs={"data": data}, outputs=["reversed"])
        result = await asyncio.wait_for(plan.result(), 30)
        assert result == {"size": SIZE, "digest": digest(data), "inputs": ["data"]}
        assert await asyncio.wait_for(plan.output("reversed"), 30) == data[::-1]
        target = await asyncio.wait_for(plan.output_to("reversed", tmp_path / "out.bin"), 30)
        assert target.read_bytes() == data[::-1]
        assert received_via(plan) == {"data": "relay"}
        assert plan.uploads is not None
        await asyncio.wait_for(plan.uploads.task, 10)
        assert plan.transfers == {("put", "data"): "relay", ("get", "reversed"): "relay"}
        relay = server.core.relay
        assert relay.streams == {} and relay.reserved == 0 and relay.bytes_relayed >= 3 * SIZE


async def test_relay_on_request_even_with_a_data_endpoint(tmp_path: Path) -> None:
    """submit(relay=True) carries the bytes through the coordinator though the worker could be dialled."""
    data = b"abc" * 1000
    async with running(tmp_path, data_listen="127.0.0.1:0") as (server, _agent):
        async with Client(server.url, token=CLIENT_TOKEN) as client:
            plan = await client.submit("reverse", inputs={"data": data}, outputs=["reversed"], relay=True)
            await asyncio.wait_for(plan.result(), 30)
            assert await plan.output("reversed") == data[::-1]
            assert received_via(plan) == {"data": "relay"}
            direct = await client.submit("reverse", inputs={"data": data}, outputs=["reversed"])
            await asyncio.wait_for(direct.result(), 30)
            assert await direct.output("reversed") == data[::-1]
            assert received_via(direct) == {"data": "direct"}
            assert direct.uploads is not None
            await asyncio.wait_for(direct.uploads.task, 10)  # its upload may finish after the plan does
            assert direct.transfers == {("put", "data"): "direct", ("get", "reversed"): "direct"}


async def test_unreachable_data_endpoint_falls_back_to_the_relay(tmp_path: Path) -> None:
    """A worker advertising an address nobody listens on: the SDK's dial fails and the relay carries the bytes."""
    data = b"xyz" * 50_000
    options = {"data_listen": "127.0.0.1:0", "data_advertise": "http://127.0.0.1:9"}  # port 9: nothing there
    async with running(tmp_path, **options) as (server, _agent), Client(server.url, token=CLIENT_TOKEN) as client:
        plan = await client.submit("reverse", inputs={"data": data}, outputs=["reversed"])
        assert (await asyncio.wait_for(plan.result(), 30))["digest"] == digest(data)
        assert await plan.output("reversed") == data[::-1]
        assert received_via(plan) == {"data": "relay"}
        assert plan.uploads is not None
        await asyncio.wait_for(plan.uploads.task, 10)
        assert plan.transfers == {("put", "data"): "relay", ("get", "reversed"): "relay"}


async def test_oversize_args_move_to_the_data_plane_instead_of_closing_the_session(tmp_path: Path) -> None:
    """A 2 MiB args submit succeeds, the handler sees the args as given, and the session stays up."""
    blob = bytes(range(256)) * (8 << 10)  # 2 MiB
    async with running(tmp_path) as (server, _agent), Client(server.url, token=CLIENT_TOKEN) as client:
        plan = await client.submit("measure", args={"blob": blob})
        result = await asyncio.wait_for(plan.result(), 30)
        assert result == {"blob": len(blob), "digest": digest(blob), "inputs": []}
        assert not client.closed
        assert (await client.submit("echo", args=1)).id  # the same session goes on
        assert server.core.plans[plan.id].args is None


async def test_oversize_submit_without_the_move_closes_the_session_1009(tmp_path: Path) -> None:
    """What a raw peer still gets (and the SDK did before): the 2 MiB frame closes the session with 1009."""
    blob = b"b" * (2 << 20)
    async with running(tmp_path) as (server, _agent):
        client = Client(server.url, token=CLIENT_TOKEN, reconnect=False)
        await client.connect()
        client.max_inline_bytes = 1 << 30  # as if the SDK did not move the args
        with pytest.raises(FleetwireConnectionError) as closed:
            await asyncio.wait_for(client.submit("measure", args={"blob": blob}), 30)
        await client.close()
    assert str(errors.CLOSE_TOO_BIG) in str(closed.value)


async def test_oversize_result_is_fetched_by_result(tmp_path: Path) -> None:
    """A handler returning 2 MiB: the plan succeeds and plan.result() fetches it from the worker (relayed here)."""
    size = 2 << 20
    async with running(tmp_path) as (server, _agent), Client(server.url, token=CLIENT_TOKEN) as client:
        plan = await client.submit("produce", args={"size": size})
        result = await asyncio.wait_for(plan.result(), 30)
        assert result == bytes(range(256)) * (size // 256)
        assert await plan.result() is result  # fetched once
        assert server.core.plans[plan.id].result is None
