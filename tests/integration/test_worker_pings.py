"""Websocket keepalive pings: client sessions always, worker sessions only with ServerSettings.ping_workers."""

from __future__ import annotations

from coordinator.limits import Limits
from tests.integration.test_security import Start, peer, server_side, start, still_served, worker

__all__ = ["start"]  # the fixture, re-exported for pytest


async def test_worker_sessions_are_not_pinged_but_clients_are(start: Start) -> None:
    """By default a worker session has no keepalive task (its heartbeat covers liveness); a client's has one."""
    srv = await start(Limits(ping_interval_s=0.2, ping_timeout_s=0.2))
    w = await worker(srv, "w1")
    c = await peer(srv, "alice")
    assert server_side(srv, w).keepalive_task is None
    client_keepalive = server_side(srv, c).keepalive_task
    assert client_keepalive is not None and not client_keepalive.done()
    await still_served(srv)


async def test_worker_pings_can_be_turned_back_on(start: Start) -> None:
    """ServerSettings(ping_workers=True) keeps websockets' keepalive on worker sessions too."""
    srv = await start(Limits(ping_interval_s=0.2, ping_timeout_s=0.2), ping_workers=True)
    w = await worker(srv, "w1")
    keepalive = server_side(srv, w).keepalive_task
    assert keepalive is not None and not keepalive.done()
