"""docs/PROTOCOL.md §1 and §7, handshake-level statements, checked against a real coordinator on loopback.

Subprotocol negotiation (an unknown one is 400 naming the supported ones; the bearer subprotocol
beside a supported one still works; a padded bearer token is 400 saying why), a websocket
upgrade on a non-websocket path (404, never the dashboard page), and close 1007 for a text frame
that is not UTF-8. Codec- and core-level statements are in tests/unit/test_protocol_truths.py.
"""

from __future__ import annotations

import asyncio
import base64
import http.client
from collections.abc import AsyncIterator

import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed, InvalidStatus
from websockets.frames import Frame, Opcode

from coordinator.io.frontdoor.server import CoordinatorServer, ServerSettings
from protocol import SUBPROTOCOL_JSON, SUBPROTOCOL_MSGPACK, Codec
from protocol.messages import ListWorkers, ToClient, Workers

CLIENT_TOKEN = "client-token-for-protocol-truths"
WORKER_TOKEN = "worker-token-for-protocol-truths"
pytestmark = pytest.mark.timeout(30)


@pytest.fixture
async def server() -> AsyncIterator[CoordinatorServer]:
    srv = CoordinatorServer(ServerSettings(port=0, worker_tokens=(WORKER_TOKEN,), client_tokens=(CLIENT_TOKEN,)))
    await srv.start()
    yield srv
    await srv.stop()


def _bearer(token: str, *, padded: bool = False) -> str:
    encoded = base64.urlsafe_b64encode(token.encode()).decode()
    return "fleetwire.bearer." + (encoded if padded else encoded.rstrip("="))


async def _refused(url: str, subprotocols: list[str], **kw: object) -> tuple[int, str]:
    with pytest.raises(InvalidStatus) as info:
        await connect(url, subprotocols=subprotocols, **kw)  # type: ignore[arg-type]
    return info.value.response.status_code, info.value.response.body.decode()


@pytest.mark.parametrize("offered", [["fleetwire.v2.json"], ["fleetwire.v2.json", "chat"]])
async def test_an_unknown_subprotocol_is_400_naming_the_supported_ones(
    server: CoordinatorServer, offered: list[str]
) -> None:
    """Offering only subprotocols it does not speak gets 400 naming fleetwire.v1.msgpack and fleetwire.v1.json."""
    headers = {"Authorization": f"Bearer {CLIENT_TOKEN}"}
    status, body = await _refused(f"{server.url}/v1/client", offered, additional_headers=headers)
    assert status == 400
    assert SUBPROTOCOL_MSGPACK in body and SUBPROTOCOL_JSON in body and offered[0] in body


async def test_unknown_beside_bearer_is_400_too(server: CoordinatorServer) -> None:
    """The bearer subprotocol does not count as an encoding: unknown + bearer is still 400."""
    status, body = await _refused(f"{server.url}/v1/client", ["fleetwire.v9.xml", _bearer(CLIENT_TOKEN)])
    assert status == 400 and SUBPROTOCOL_JSON in body


@pytest.mark.parametrize(
    ("offered", "selected"),
    [
        ([SUBPROTOCOL_JSON], SUBPROTOCOL_JSON),
        ([SUBPROTOCOL_JSON, "fleetwire.v2.json"], SUBPROTOCOL_JSON),
        ([SUBPROTOCOL_JSON, SUBPROTOCOL_MSGPACK], SUBPROTOCOL_MSGPACK),
        ([], None),
    ],
)
async def test_the_bearer_subprotocol_beside_a_supported_one_opens_the_session(
    server: CoordinatorServer, offered: list[str], selected: str | None
) -> None:
    """A browser's offer (encoding + unpadded bearer) is upgraded; the bearer is never selected."""
    async with connect(f"{server.url}/v1/client", subprotocols=[*offered, _bearer(CLIENT_TOKEN)]) as ws:  # type: ignore[list-item]
        assert ws.subprotocol == selected
        codec = Codec("json" if selected == SUBPROTOCOL_JSON else "msgpack", ToClient, "coordinator")
        await ws.send(codec.encode([ListWorkers(req_id=5)]), text=codec.text)
        [reply] = codec.decode(await asyncio.wait_for(ws.recv(), 5))
        assert isinstance(reply, Workers) and reply.req_id == 5


async def test_a_padded_bearer_subprotocol_is_400_saying_unpadded(server: CoordinatorServer) -> None:
    """A bearer token with '=' padding is 400 naming the rule (unpadded base64url), not a bare refusal."""
    token = "client-token-for-protocol-truth"  # 31 bytes: its base64 ends in '='
    assert base64.urlsafe_b64encode(token.encode()).endswith(b"=")
    offered = f"{SUBPROTOCOL_JSON}, {_bearer(token, padded=True)}"  # websockets' own client refuses to send it

    def handshake() -> tuple[int, str]:
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=5)
        try:
            conn.request("GET", "/v1/client", headers={
                "Upgrade": "websocket", "Connection": "Upgrade", "Sec-WebSocket-Version": "13",
                "Sec-WebSocket-Key": base64.b64encode(b"0123456789abcdef").decode(), "Sec-WebSocket-Protocol": offered,
            })
            response = conn.getresponse()
            return response.status, response.read().decode()
        finally:
            conn.close()

    status, body = await asyncio.to_thread(handshake)
    assert status == 400 and "unpadded base64url" in body


@pytest.mark.parametrize("path", ["/", "/healthz", "/index.html"])
async def test_a_websocket_upgrade_on_a_plain_path_is_404(server: CoordinatorServer, path: str) -> None:
    """An upgrade on / (or any non-websocket path) is 404 naming the websocket paths, never the dashboard."""
    headers = {"Authorization": f"Bearer {CLIENT_TOKEN}"}
    status, body = await _refused(f"{server.url}{path}", [SUBPROTOCOL_JSON], additional_headers=headers)
    assert status == 404 and "/v1/client" in body and "<html" not in body.lower()


async def test_a_plain_get_of_the_dashboard_still_answers_200(server: CoordinatorServer) -> None:
    """Without an upgrade, / is still the dashboard page."""

    def get() -> tuple[int, str]:
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=5)
        try:
            conn.request("GET", "/")
            response = conn.getresponse()
            return response.status, response.getheader("Content-Type") or ""
        finally:
            conn.close()

    status, content_type = await asyncio.to_thread(get)
    assert status == 200 and content_type.startswith("text/html")


async def test_a_text_frame_that_is_not_utf8_closes_1007(server: CoordinatorServer) -> None:
    """The websocket layer closes 1007 on invalid UTF-8 in a text frame (PROTOCOL.md §7 note)."""
    headers = {"Authorization": f"Bearer {CLIENT_TOKEN}"}
    async with connect(f"{server.url}/v1/client", subprotocols=[SUBPROTOCOL_JSON],  # type: ignore[list-item]
                       additional_headers=headers) as ws:
        ws.protocol.send_frame(Frame(Opcode.TEXT, b'{"type":"list_workers","req_id":1,"x":"\xff"}'))
        ws.send_data()  # type: ignore[attr-defined]
        with pytest.raises(ConnectionClosed) as info:
            await asyncio.wait_for(ws.recv(), 5)
    assert info.value.rcvd is not None and info.value.rcvd.code == 1007
