"""A cluster worker leaves a coordinator that upgrades and never answers ``hello``, over loopback sockets.

A stuck coordinator (its loop wedged on its store, a partial hang) completes the websocket upgrade and then sends
nothing. The agent's wait for ``welcome`` is then a dial that timed out (worker_agent/handshake.py): bounded by the
dial's timeout (a cluster reconnect's ``reconnect_dial_timeout_s``, not the whole ``handshake_timeout_s``), and its
URL goes to the back of the turn (protocol/urls.py ``UrlTurn``), so the next reconnects go to the live coordinator.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
from structlog.testing import capture_logs
from websockets.asyncio.client import ClientConnection
from websockets.asyncio.server import ServerConnection, serve
from websockets.exceptions import ConnectionClosed

import protocol
import worker_agent.agent
from coordinator.io.frontdoor.server import CoordinatorServer, ServerSettings
from protocol import ENCODING_SUBPROTOCOL, Codec
from protocol.backoff import ReconnectBackoff
from tests.waiting import until
from worker_agent import Agent

pytestmark = pytest.mark.timeout(60)

SHORT_S = 0.3  # a cluster reconnect's dial bound here


class Mute:
    """A coordinator that upgrades every worker connection, reads its frames and never answers one."""

    def __init__(self) -> None:
        self.codec = Codec("msgpack", protocol.messages.FromWorker, "worker")
        self.hellos = 0
        self.url = ""

    async def session(self, ws: ServerConnection) -> None:
        with contextlib.suppress(ConnectionClosed):
            async for frame in ws:
                self.hellos += sum(isinstance(m, protocol.Hello) for m in self.codec.decode(frame))


@pytest.fixture
async def mute() -> AsyncIterator[Mute]:
    coordinator = Mute()
    subprotocols = [ENCODING_SUBPROTOCOL["msgpack"]]
    async with serve(coordinator.session, "127.0.0.1", 0, subprotocols=subprotocols,  # type: ignore[arg-type]
                     compression=None) as server:  # fmt: skip
        coordinator.url = f"ws://127.0.0.1:{next(iter(server.sockets)).getsockname()[1]}"
        yield coordinator


@pytest.fixture
async def live() -> AsyncIterator[str]:
    server = CoordinatorServer(ServerSettings(port=0, insecure=True))
    await server.start()
    try:
        yield server.url
    finally:
        await server.stop()


@pytest.fixture
def dials(monkeypatch: pytest.MonkeyPatch) -> tuple[list[str], list[ClientConnection]]:
    """The agent's dials (each URL's scheme, host and port) and the websockets they opened."""
    urls: list[str] = []
    opened: list[ClientConnection] = []
    real_connect = worker_agent.agent.connect

    async def recording_connect(url: str, **kwargs: Any) -> ClientConnection:
        urls.append(url.split("/v1/")[0])
        ws = await real_connect(url, **kwargs)
        opened.append(ws)
        return ws

    monkeypatch.setattr(worker_agent.agent, "connect", recording_connect)
    return urls, opened


async def _drop_and_reregister(agent: Agent, opened: list[ClientConnection], times: int, within_s: float) -> None:
    """Drop the registered session ``times`` times; each time the agent registers again within ``within_s``."""
    for _ in range(times):
        registered = opened[-1]
        registered.transport.abort()  # the connection drops (a network cut, a coordinator restart)
        await until(lambda ws=registered: not agent.registered.is_set() or opened[-1] is not ws,  # type: ignore[misc]
                    timeout_s=5)  # fmt: skip
        began = time.monotonic()
        await until(lambda: agent.registered.is_set(), timeout_s=within_s)
        assert time.monotonic() - began < within_s


async def test_the_first_url_upgrading_and_never_welcoming_goes_to_the_back_and_the_agent_keeps_the_second(
    mute: Mute, live: str, dials: tuple[list[str], list[ClientConnection]]
) -> None:
    """Agent("mute,live"): the first dial's hello goes unanswered for handshake_timeout_s, the agent registers at
    the live coordinator, and after each of two drops it goes back to the live one, never to the mute one again."""
    urls, opened = dials
    agent = Agent(f"{mute.url},{live}", None, worker_id="w-hung", handshake_timeout_s=1.0,
                  reconnect_dial_timeout_s=SHORT_S, reconnect_base_s=0.01, reconnect_cap_s=0.05)  # fmt: skip
    with capture_logs() as logs:
        run = asyncio.create_task(agent.run())
        try:
            await asyncio.wait_for(agent.registered.wait(), 8)
            assert agent.url.startswith(live)
            await _drop_and_reregister(agent, opened, 2, within_s=5)
        finally:
            agent.stop()
            await asyncio.wait_for(run, 10)
    assert urls == [mute.url, live, live, live] and mute.hellos == 1
    (error,) = [e for e in logs if e["log_level"] == "error"]
    assert error["event"] == "no welcome from the coordinator within --handshake-timeout after hello; reconnecting"
    assert error["url"] == f"{mute.url}/v1/worker" and error["timeout_s"] == 1.0


async def test_a_reconnect_leaves_a_coordinator_that_never_welcomes_after_the_short_bound(
    mute: Mute, live: str, dials: tuple[list[str], list[ClientConnection]]
) -> None:
    """Agent("live,mute"), handshake_timeout_s 10: after a drop the turn's mute URL upgrades and never answers hello;
    the agent leaves it after reconnect_dial_timeout_s (not 10 s) and registers at the live one; after a second
    drop the mute URL, at the back now, is not dialled."""
    urls, opened = dials
    agent = Agent(f"{live},{mute.url}", None, worker_id="w-hung-2", handshake_timeout_s=10.0,
                  reconnect_dial_timeout_s=SHORT_S, reconnect_base_s=0.01, reconnect_cap_s=0.05)  # fmt: skip
    with capture_logs() as logs:
        run = asyncio.create_task(agent.run())
        try:
            await asyncio.wait_for(agent.registered.wait(), 8)
            await _drop_and_reregister(agent, opened, 2, within_s=5)  # well under the 10 s handshake timeout
        finally:
            agent.stop()
            await asyncio.wait_for(run, 10)
    assert agent.url.startswith(live)
    assert urls == [live, mute.url, live, live] and mute.hellos == 1
    (error,) = [e for e in logs if e["log_level"] == "error"]
    assert error["event"] == (
        "no welcome from the coordinator within --reconnect-dial-timeout after hello; reconnecting"
    )
    assert error["url"] == f"{mute.url}/v1/worker" and error["timeout_s"] == SHORT_S


async def test_the_backoff_takes_a_welcome_that_never_came_as_a_dial_that_timed_out(
    mute: Mute, live: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Agent("mute,live"): the hello the mute coordinator never answers is, for the reconnect backoff, a dial that
    timed out (unanswered: the ceiling grows only once a whole pass was silent), not an answer that refused (which
    ends a hold and, from the second, doubles the ceiling)."""
    said: list[str] = []

    class Recording(ReconnectBackoff):
        def served(self) -> float:
            said.append("served")
            return super().served()

        def refused(self, retry_after_s: float | None = None) -> float:
            said.append("refused")
            return super().refused(retry_after_s)

        def unanswered(self) -> float:
            said.append("unanswered")
            return super().unanswered()

    monkeypatch.setattr(worker_agent.agent, "ReconnectBackoff", Recording)
    agent = Agent(f"{mute.url},{live}", None, worker_id="w-hung-3", handshake_timeout_s=SHORT_S,
                  reconnect_base_s=0.01, reconnect_cap_s=0.05)  # fmt: skip
    run = asyncio.create_task(agent.run())
    try:
        await asyncio.wait_for(agent.registered.wait(), 8)
    finally:
        agent.stop()
        await asyncio.wait_for(run, 10)
    assert mute.hellos == 1 and said[0] == "unanswered"
