"""`fleetwire worker --handshake-timeout`: a coordinator that upgrades and never answers ``hello``, over loopback.

The agent waits ``--handshake-timeout`` seconds for ``welcome`` (10 by default, fixed before the flag), then closes
the session, logs an error naming the URL and the timeout, and dials again as its backoff says (an answered dial
that served nothing: ``ReconnectBackoff.refused``, docs/OPERATIONS.md §Reconnects).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
from collections.abc import AsyncIterator

import pytest
from structlog.testing import capture_logs
from websockets.asyncio.server import ServerConnection, serve
from websockets.exceptions import ConnectionClosed

import protocol
from protocol import ENCODING_SUBPROTOCOL, Codec
from tests.waiting import until
from worker_agent.main import add_worker_arguments, run_worker
from worker_agent.settings import AgentSettings

pytestmark = pytest.mark.timeout(30)

TIMEOUT_S = 0.3


class Mute:
    """A coordinator that upgrades every worker connection, reads its frames and never answers one."""

    def __init__(self) -> None:
        self.codec = Codec("msgpack", protocol.messages.FromWorker, "worker")
        self.hellos: list[protocol.Hello] = []
        self.closed = 0  # sessions the agent closed
        self.url = ""

    async def session(self, ws: ServerConnection) -> None:
        with contextlib.suppress(ConnectionClosed):
            async for frame in ws:
                self.hellos.extend(m for m in self.codec.decode(frame) if isinstance(m, protocol.Hello))
        self.closed += 1


@pytest.fixture
async def mute() -> AsyncIterator[Mute]:
    coordinator = Mute()
    subprotocols = [ENCODING_SUBPROTOCOL["msgpack"]]
    async with serve(coordinator.session, "127.0.0.1", 0, subprotocols=subprotocols,  # type: ignore[arg-type]
                     compression=None) as server:  # fmt: skip
        coordinator.url = f"ws://127.0.0.1:{next(iter(server.sockets)).getsockname()[1]}"
        yield coordinator


def _worker_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_worker_arguments(parser)
    return parser.parse_args(argv)


async def test_no_welcome_within_the_handshake_timeout_is_an_error_naming_url_and_timeout_then_a_redial(
    mute: Mute,
) -> None:
    """--handshake-timeout 0.3: each hello left unanswered ends its session after 0.3 s with an error that names the
    URL and the timeout, and the agent dials again (backing off); SIGTERM then stops it with 0."""
    ns = _worker_args("--url", mute.url, "--token", "t", "--id", "mute-1", "--reconnect-base", "0.01",
                      "--reconnect-cap", "0.05", "--handshake-timeout", str(TIMEOUT_S))  # fmt: skip
    with capture_logs() as logs:
        task = asyncio.create_task(run_worker(ns))
        try:
            await until(lambda: len(mute.hellos) >= 3 and mute.closed >= 2, timeout_s=15)
        finally:
            os.kill(os.getpid(), signal.SIGTERM)
            status = await asyncio.wait_for(task, 10)
    assert status == 0
    assert {hello.worker_id for hello in mute.hellos} == {"mute-1"}
    errors = [e for e in logs if e["log_level"] == "error"]
    assert len(errors) >= 2, logs
    for error in errors:
        assert error["event"] == "no welcome from the coordinator within --handshake-timeout after hello; reconnecting"
        assert error["url"] == f"{mute.url}/v1/worker" and error["timeout_s"] == TIMEOUT_S
    # The reconnect policy: a hello never answered is a dial that timed out (unanswered), not a refusal: with one URL
    # each is a silent pass over the list, doubling the backoff's ceiling from the first (a refusal's first is free).
    failures = [e["failures"] for e in logs if e["event"] == "reconnecting"]
    assert failures[:2] == [1, 2], failures


def test_the_handshake_timeout_flag_sets_the_setting_and_refuses_nonpositive() -> None:
    """The flag's default is the setting's (10 s); 0 is refused by the parser, and by the settings too."""
    assert _worker_args().handshake_timeout == AgentSettings().handshake_timeout_s == 10.0
    with pytest.raises(SystemExit):
        _worker_args("--handshake-timeout", "0")
    with pytest.raises(ValueError, match="handshake_timeout_s must be > 0"):
        AgentSettings(handshake_timeout_s=0)
