"""The SDK's reconnect against a coordinator that accepts the websocket and closes it at once (1011, 1014).

Such a session served nothing (no frame came back on it): it is a refusal (protocol/backoff.py), so the backoff's
ceiling grows with each one, instead of a served session's ``U(0, base)`` for ever (before, every 1011 close counted
as served and the client dialled it ~every ``base`` without end). The waits are read from the backoff, not timed."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import msgspec
import pytest
from websockets.asyncio.server import Server, ServerConnection, serve
from websockets.typing import Subprotocol

from fleetwire.client import Client
from protocol.codec import SUBPROTOCOL_JSON, SUBPROTOCOL_MSGPACK
from protocol.messages import Accepted
from tests.waiting import until

pytestmark = pytest.mark.timeout(60)

BASE_S = 0.01


class ClosingServer:
    """A loopback websocket server that closes every session with ``code`` at once, or (``answer_first``) after one
    frame of its own, a served session."""

    def __init__(self, code: int, *, answer_first: bool = False) -> None:
        self.code = code
        self.answer_first = answer_first
        self.sessions = 0
        self.url = ""
        self._server: Server | None = None

    async def _session(self, ws: ServerConnection) -> None:
        self.sessions += 1
        if self.answer_first:
            await ws.send(msgspec.msgpack.encode(Accepted(req_id=1, plan_id="p")))  # a reply nobody awaits
        await ws.close(self.code, "closing at once")

    async def __aenter__(self) -> ClosingServer:
        self._server = await serve(
            self._session, "127.0.0.1", 0, compression=None,
            subprotocols=[Subprotocol(SUBPROTOCOL_MSGPACK), Subprotocol(SUBPROTOCOL_JSON)],
        )  # fmt: skip
        port = next(iter(self._server.sockets)).getsockname()[1]
        self.url = f"ws://127.0.0.1:{port}"
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()
        await self._server.wait_closed()


@contextlib.asynccontextmanager
async def _client(url: str) -> AsyncIterator[Client]:
    client = Client(url, token="t", reconnect_base_s=BASE_S, reconnect_cap_s=100.0, reconnect_give_up_s=None)
    await client.connect()
    try:
        yield client
    finally:
        await client.close()


@pytest.mark.parametrize("code", [1011, 1014])
async def test_sessions_closed_at_once_unanswered_grow_the_backoff(code: int) -> None:
    async with ClosingServer(code) as server:
        async with _client(server.url) as client:
            backoff = client._resumer._backoff
            await until(lambda: backoff.refusals >= 5, timeout_s=30)
            assert backoff.ceiling_s() >= BASE_S * 2**3  # the refusals but the first double it
            assert server.sessions >= 5


async def test_sessions_that_answered_before_the_close_still_count_as_served() -> None:
    async with ClosingServer(1011, answer_first=True) as server:
        async with _client(server.url) as client:
            backoff = client._resumer._backoff
            await until(lambda: server.sessions >= 5, timeout_s=30)
            assert backoff.refusals == 0 and backoff.ceiling_s() == BASE_S
