"""The relay's shares and its output_gone end over loopback: a real coordinator and agent in this process
(issue #24 part 4, issue #25 part 12; docs/PROTOCOL.md §11 Relay)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import msgspec
import pytest
from websockets.asyncio.client import ClientConnection, connect

from fleetwire import Client
from fleetwire.relay import OutputGone
from protocol import SUBPROTOCOL_MSGPACK
from protocol.relay import DEFAULT_WINDOW_BYTES
from tests.integration.data_helpers import CLIENT_TOKEN, coordinator_and_data_worker, digest

pytestmark = pytest.mark.timeout(60)

MIB = 1 << 20


async def size_of(ctx: Any, args: Any) -> int:
    return int(ctx.inputs["data"].path.stat().st_size)


async def reverse(ctx: Any, args: Any) -> None:
    ctx.output("reversed", ctx.inputs["data"].path.read_bytes()[::-1])


def _msgs(frame: Any) -> list[dict[str, Any]]:
    decoded = msgspec.msgpack.decode(frame)
    return decoded if isinstance(decoded, list) else [decoded]


async def hog(url: str, streams: int) -> ClientConnection:
    """A client session that submits ``streams`` plans with a 1 MiB input each, opens each input's relayed stream
    and never sends a byte; returned once the coordinator answered every open (a window or a wait)."""
    ws = await connect(f"{url}/v1/client", additional_headers={"Authorization": f"Bearer {CLIENT_TOKEN}"},
                       subprotocols=[SUBPROTOCOL_MSGPACK], compression=None)  # type: ignore[list-item]
    spec = {"name": "data", "size": MIB, "digest": digest(bytes(MIB))}
    await ws.send(msgspec.msgpack.encode([{"type": "submit", "req_id": i + 1, "op": "size", "inputs": [spec]}
                                          for i in range(streams)]))
    opened = answered = 0
    while answered < streams:
        for msg in _msgs(await asyncio.wait_for(ws.recv(), 10)):
            if msg.get("type") == "event" and msg.get("kind") == "data_ready":
                opened += 1
                await ws.send(msgspec.msgpack.encode({
                    "type": "data_open", "plan_id": msg["plan_id"], "attempt": msg["data"]["attempt"],
                    "name": "data", "ticket": msg["data"]["ticket"], "stream": opened}))
            elif msg.get("type") == "data_credit":
                answered += 1
    return ws


async def test_a_session_that_opens_streams_and_never_sends_leaves_room_for_another_sessions_upload(
        tmp_path: Path) -> None:
    """The probe's relay hog: 4 accepted puts that never send hold one window (three wait in line), and another
    session's relayed 1 MiB upload goes through at once (it got relay_busy, 20 s and more, before)."""
    handlers = {"size": size_of}
    async with coordinator_and_data_worker(tmp_path, handlers, data_listen=None, max_concurrency=8,
                                           input_timeout_s=30.0) as (server, _):
        held = await hog(server.url, 4)
        relay = server.core.relay
        assert (relay.reserved, relay.waiting) == (DEFAULT_WINDOW_BYTES, 3)
        async with Client(server.url, token=CLIENT_TOKEN) as client:
            plan = await client.submit("size", inputs={"data": bytes(range(256)) * (MIB // 256)})
            assert await asyncio.wait_for(plan.result(), 5) == MIB
            assert plan.transfers == {("put", "data"): "relay"}
        await held.close()


async def test_an_output_its_worker_no_longer_holds_is_output_gone(tmp_path: Path) -> None:
    """A relayed fetch of an output the worker dropped raises OutputGone naming it (not a generic 404)."""
    async with coordinator_and_data_worker(tmp_path, {"reverse": reverse}, data_listen=None) as (server, agent), \
            Client(server.url, token=CLIENT_TOKEN) as client:
        plan = await client.submit("reverse", inputs={"data": b"abc"}, outputs=["reversed"])
        await asyncio.wait_for(plan.result(), 10)
        assert await asyncio.wait_for(plan.output("reversed"), 10) == b"cba"
        assert agent.relay is not None
        agent.relay.spool.drop_outputs(plan.id, 1)
        with pytest.raises(OutputGone, match=r"output 'reversed'.*output_gone.*no output 'reversed' on worker"):
            await asyncio.wait_for(plan.output("reversed"), 10)
