"""The coordinator's asyncio server over real loopback sockets, with raw protocol peers."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import InvalidStatus

from coordinator.core import CoreConfig
from coordinator.errors import UnknownWorker
from coordinator.io.frontdoor.server import CoordinatorServer, ServerSettings
from protocol import SUBPROTOCOL_JSON, SUBPROTOCOL_MSGPACK, Codec
from protocol.messages import (
    Accept,
    Cancel,
    Capabilities,
    Done,
    Event,
    Heartbeat,
    Hello,
    ListWorkers,
    Submit,
    ToClient,
    ToWorker,
)

WORKER_TOKEN = "w-secret"
CLIENT_TOKEN = "c-secret"
pytestmark = pytest.mark.timeout(30)


@pytest.fixture
async def server() -> AsyncIterator[CoordinatorServer]:
    srv = CoordinatorServer(
        ServerSettings(port=0, worker_tokens=(WORKER_TOKEN,), client_tokens=(CLIENT_TOKEN,),
                       core=CoreConfig(heartbeat_interval_s=0.2, heartbeat_timeout_s=0.6), reaper_interval_s=0.05)
    )
    await srv.start()
    yield srv
    await srv.stop()


class Peer:
    """A raw protocol peer: sends Structs, receives decoded messages one at a time."""

    def __init__(self, ws: ClientConnection, codec: Codec) -> None:
        self.ws = ws
        self.codec = codec
        self.inbox: list[Any] = []

    async def send(self, *msgs: Any) -> None:
        await self.ws.send(self.codec.encode(list(msgs)), text=self.codec.text)

    async def recv(self) -> Any:
        while not self.inbox:
            frame = await asyncio.wait_for(self.ws.recv(), 5)
            self.inbox.extend(self.codec.decode(frame))
        return self.inbox.pop(0)

    async def recv_until(self, predicate: Any) -> list[Any]:
        seen = []
        while True:
            msg = await self.recv()
            seen.append(msg)
            if predicate(msg):
                return seen


async def open_peer(server: CoordinatorServer, role: str, token: str, encoding: str = "msgpack") -> Peer:
    ws = await connect(
        f"{server.url}/v1/{role}",
        additional_headers={"Authorization": f"Bearer {token}"},
        subprotocols=[SUBPROTOCOL_MSGPACK if encoding == "msgpack" else SUBPROTOCOL_JSON],  # type: ignore[list-item]
        compression=None,
    )
    inbound = ToWorker if role == "worker" else ToClient
    return Peer(ws, Codec(encoding, inbound, "coordinator"))  # type: ignore[arg-type]


async def register(server: CoordinatorServer, worker_id: str, ops: list[str], **caps: Any) -> Peer:
    peer = await open_peer(server, "worker", WORKER_TOKEN)
    await peer.send(Hello(worker_id=worker_id, capabilities=Capabilities(ops=ops, cpu_cores=2, **caps)))
    welcome = await peer.recv()
    assert welcome.__class__.__name__ == "Welcome"
    return peer


async def test_missing_token_is_401_before_upgrade(server: CoordinatorServer) -> None:
    """A connection without a token is refused with HTTP 401 and never upgraded."""
    with pytest.raises(InvalidStatus) as info:
        await connect(f"{server.url}/v1/client")
    assert info.value.response.status_code == 401
    assert "Bearer" in info.value.response.headers["WWW-Authenticate"]


async def test_wrong_token_is_401(server: CoordinatorServer) -> None:
    """A wrong token is refused with HTTP 401."""
    with pytest.raises(InvalidStatus) as info:
        await connect(f"{server.url}/v1/worker", additional_headers={"Authorization": "Bearer nope"})
    assert info.value.response.status_code == 401


async def test_token_of_other_role_is_403(server: CoordinatorServer) -> None:
    """A client token on /v1/worker and a worker token on /v1/client get HTTP 403."""
    for path, token in (("/v1/worker", CLIENT_TOKEN), ("/v1/client", WORKER_TOKEN)):
        with pytest.raises(InvalidStatus) as info:
            await connect(f"{server.url}{path}", additional_headers={"Authorization": f"Bearer {token}"})
        assert info.value.response.status_code == 403


async def test_unknown_path_is_404(server: CoordinatorServer) -> None:
    """An unknown path is answered 404 naming the paths that exist."""
    with pytest.raises(InvalidStatus) as info:
        await connect(f"{server.url}/v2/nothing", additional_headers={"Authorization": f"Bearer {CLIENT_TOKEN}"})
    assert info.value.response.status_code == 404
    assert b"/v1/worker" in info.value.response.body


def test_refuses_to_start_without_tokens() -> None:
    """Without tokens and without --insecure the server refuses to start, saying what to set."""
    with pytest.raises(ValueError, match="FLEETWIRE_WORKER_TOKEN"):
        CoordinatorServer(ServerSettings(port=0))


def test_insecure_only_on_loopback() -> None:
    """--insecure is refused on a non-loopback address."""
    with pytest.raises(ValueError, match="loopback"):
        CoordinatorServer(ServerSettings(host="0.0.0.0", port=0, insecure=True))


async def test_full_plan_round_trip(server: CoordinatorServer) -> None:
    """submit → assign → accept → event → done reaches the client as ordered events with seq."""
    worker = await register(server, "w1", ["echo"])
    client = await open_peer(server, "client", CLIENT_TOKEN)
    await client.send(Submit(req_id=1, op="echo", args={"x": b"\x00\x01"}))
    accepted = await client.recv()
    assert accepted.__class__.__name__ == "Accepted" and accepted.req_id == 1
    assign = await worker.recv()
    assert assign.__class__.__name__ == "Assign"
    assert assign.plan_id == accepted.plan_id and assign.args == {"x": b"\x00\x01"}
    await worker.send(
        Accept(plan_id=assign.plan_id, attempt=assign.attempt),
        Event(plan_id=assign.plan_id, attempt=assign.attempt, kind="progress", data={"pct": 50}),
        Done(plan_id=assign.plan_id, attempt=assign.attempt, outcome="succeeded", result={"x": 1}),
    )
    events = await client.recv_until(lambda m: isinstance(m, Event) and m.kind == "succeeded")
    kinds = [e.kind for e in events]
    assert kinds == ["queued", "leased", "running", "progress", "succeeded"]
    assert [e.seq for e in events] == [1, 2, 3, 4, 5]
    assert events[-1].data["result"] == {"x": 1}
    await worker.ws.close()
    await client.ws.close()


async def test_cancel_running_plan_reaches_worker(server: CoordinatorServer) -> None:
    """Cancelling a running plan ends it cancelled for the client and sends cancel to the worker."""
    worker = await register(server, "w1", ["sleep"])
    client = await open_peer(server, "client", CLIENT_TOKEN)
    await client.send(Submit(req_id=1, op="sleep", args={"seconds": 30}))
    plan_id = (await client.recv()).plan_id
    assign = await worker.recv()
    await worker.send(Accept(plan_id=plan_id, attempt=assign.attempt))
    await client.recv_until(lambda m: isinstance(m, Event) and m.kind == "running")
    await client.send(Cancel(req_id=2, plan_id=plan_id))
    msgs = await client.recv_until(lambda m: getattr(m, "req_id", None) == 2)
    assert msgs[-1].plan.state == "cancelled"
    cancel = await worker.recv()
    assert cancel.__class__.__name__ == "Cancel" and cancel.plan_id == plan_id
    await worker.ws.close()
    await client.ws.close()


async def test_unknown_type_answered_with_error_frame(server: CoordinatorServer) -> None:
    """An unknown message type gets an error frame with code unknown_type; the session stays open."""
    client = await open_peer(server, "client", CLIENT_TOKEN, encoding="json")
    await client.ws.send('{"type": "launch_missiles", "req_id": 9}')
    err = await client.recv()
    assert err.code == "unknown_type" and err.req_id == 9
    assert "launch_missiles" in err.message
    await client.send(ListWorkers(req_id=10))
    reply = await client.recv()
    assert reply.req_id == 10 and reply.summary.startswith("0 workers")
    await client.ws.close()


async def test_invalid_field_error_names_the_path(server: CoordinatorServer) -> None:
    """A field of the wrong type is answered with an error naming its $.path."""
    client = await open_peer(server, "client", CLIENT_TOKEN, encoding="json")
    await client.ws.send('{"type": "submit", "req_id": 3, "op": "echo", "requirements": {"tags": ["a", 2]}}')
    err = await client.recv()
    assert err.code == "invalid_message" and err.req_id == 3
    assert "$.requirements.tags[1]" in err.message
    await client.ws.close()


async def test_silent_worker_is_reaped_and_plan_requeued(server: CoordinatorServer) -> None:
    """A worker that stops beating is reaped and its plan runs on another worker."""
    silent = await register(server, "silent", ["echo"])
    client = await open_peer(server, "client", CLIENT_TOKEN)
    await client.send(Submit(req_id=1, op="echo", args=1))
    plan_id = (await client.recv()).plan_id
    assign = await silent.recv()
    assert assign.plan_id == plan_id
    healthy = await register(server, "healthy", ["echo"])
    beating = asyncio.create_task(_beat(healthy))
    try:
        reassign = await healthy.recv()
        assert reassign.plan_id == plan_id and reassign.attempt == assign.attempt + 1
        await healthy.send(Done(plan_id=plan_id, attempt=reassign.attempt, outcome="succeeded", result=1))
        events = await client.recv_until(lambda m: isinstance(m, Event) and m.kind == "succeeded")
        assert "requeued" in [e.kind for e in events]
        with pytest.raises(UnknownWorker):
            server.core.registry.get("silent")
    finally:
        beating.cancel()
    await client.ws.close()


async def _beat(peer: Peer) -> None:
    while True:
        await peer.send(Heartbeat())
        await asyncio.sleep(0.1)


async def test_browser_bearer_subprotocol_authenticates_and_is_not_echoed(server: CoordinatorServer) -> None:
    """A browser's offered fleetwire.bearer.<base64url> subprotocol authenticates; the server selects JSON, not it."""
    import base64

    offered = "fleetwire.bearer." + base64.urlsafe_b64encode(CLIENT_TOKEN.encode()).decode().rstrip("=")
    ws = await connect(f"{server.url}/v1/client", subprotocols=[SUBPROTOCOL_JSON, offered])  # type: ignore[list-item]
    assert ws.subprotocol == SUBPROTOCOL_JSON
    await ws.send('{"type": "list_workers", "req_id": 1}')
    assert '"workers"' in str(await asyncio.wait_for(ws.recv(), 5))
    await ws.close()
    with pytest.raises(InvalidStatus) as info:
        bad = "fleetwire.bearer." + base64.urlsafe_b64encode(b"wrong").decode().rstrip("=")
        await connect(f"{server.url}/v1/client", subprotocols=[SUBPROTOCOL_JSON, bad])  # type: ignore[list-item]
    assert info.value.response.status_code == 401
