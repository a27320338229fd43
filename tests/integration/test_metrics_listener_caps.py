"""``--metrics-listen`` is capped as the main port (issue 24 part 5; coordinator/io/ops/metrics_http.py), over loopback.

It shares the process's file descriptors with the main port: idle sockets there must cycle out
(a connection budget, oldest first), wait in the kernel (TCP_DEFER_ACCEPT), and a loop of
scrapes or bad tokens is held as on the main port.
"""

from __future__ import annotations

import asyncio

import pytest
from structlog.testing import capture_logs

from coordinator.io.frontdoor.gate import REPEAT_BURST
from coordinator.io.ops.metrics_http import MAX_CONNECTIONS
from coordinator.limits import Limits
from fleetwire import Client
from tests.integration.test_fairness import http, idle_sockets, insecure, needs_defer_accept, reset  # noqa: F401
from tests.integration.test_repeats_held import request

pytestmark = pytest.mark.timeout(60)


async def test_idle_sockets_at_metrics_listen_past_its_budget_evict_the_oldest(insecure) -> None:  # noqa: F811
    """200 idle sockets at --metrics-listen: all but the newest 64 are dropped at once; scrapes and sessions go on."""
    srv = await insecure(Limits(defer_accept_s=0, handshake_timeout_s=60), metrics_listen="127.0.0.1:0")
    idle: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []
    try:
        with capture_logs() as logs:
            idle += [await asyncio.open_connection("127.0.0.1", srv.metrics_port) for _ in range(200)]
            status, body = await http(srv.metrics_port, "/metrics")
            assert status == 200 and "fleetwire_workers_alive" in body
            async with Client(srv.url) as client:
                await client.workers()
            oldest = 200 - MAX_CONNECTIONS
            # Well before the 60 s deadline: evicted by the newer ones (the scrape among them).
            dropped = await asyncio.wait_for(asyncio.gather(*(reader.read() for reader, _ in idle[:oldest])), 4)
            assert dropped == [b""] * oldest
        evictions = [e for e in logs if e.get("reason") == "metrics-listener connection budget"]
        assert 1 <= len(evictions) <= Limits().refusal_log_burst  # logged, and rate-limited
    finally:
        for _, writer in idle:
            writer.close()


async def test_a_silent_socket_at_metrics_listen_is_dropped_at_the_handshake_timeout(insecure) -> None:  # noqa: F811
    """A connection that sends nothing is closed after --handshake-timeout, not held for ever."""
    srv = await insecure(Limits(defer_accept_s=0, handshake_timeout_s=0.5), metrics_listen="127.0.0.1:0")
    reader, writer = await asyncio.open_connection("127.0.0.1", srv.metrics_port)
    try:
        assert await asyncio.wait_for(reader.read(), 5) == b""
    finally:
        writer.close()


@needs_defer_accept
async def test_idle_sockets_at_metrics_listen_wait_in_the_kernel(insecure) -> None:  # noqa: F811
    """With the default --defer-accept the listener's socket has TCP_DEFER_ACCEPT: 100 idle sockets are never
    accepted, so nothing is evicted, and a scrape is served at once."""
    srv = await insecure(metrics_listen="127.0.0.1:0")
    idle = idle_sockets(srv.metrics_port, 100)
    try:
        status, _ = await http(srv.metrics_port, "/metrics")
        assert status == 200
        listener = srv._metrics_listener
        assert listener is not None and listener.defer_accept_s >= Limits().handshake_timeout_s
        assert listener.budget.accepted == 1 and listener.budget.evicted == 0  # the scrape only
    finally:
        reset(idle)


async def test_a_loop_of_bad_tokens_or_scrapes_at_metrics_listen_is_held(insecure) -> None:  # noqa: F811
    """Past the burst from one address: a wrong --metrics-token gets 401 with Retry-After, held as on the main port."""
    token = "metrics-token-0123456789"
    srv = await insecure(Limits(penalty_hold_s=0.2), metrics_listen="127.0.0.1:0", metrics_token=token)
    port = srv.metrics_port
    assert port
    answers = [await request(port, "/metrics", "wrong") for _ in range(REPEAT_BURST)]
    assert {status for status, _, _ in answers} == {401} and not any("retry-after" in h for _, h, _ in answers)
    status, headers, body = await request(port, "/metrics", "wrong")
    assert status == 401 and headers["retry-after"] == "1" and "--metrics-token" in body
    assert (await request(port, "/metrics", token))[0] == 200
    assert srv._gate.auth_failures.over_count == 1


async def test_metrics_listen_answers_a_half_closed_request_and_refuses_an_oversize_head(insecure) -> None:  # noqa: F811
    """A peer that shuts its side after the request still gets the answer; a head over 8 KiB gets 431."""
    srv = await insecure(metrics_listen="127.0.0.1:0")
    reader, writer = await asyncio.open_connection("127.0.0.1", srv.metrics_port)
    writer.write(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
    writer.write_eof()
    assert (await asyncio.wait_for(reader.read(), 5)).startswith(b"HTTP/1.1 200 OK")
    writer.close()
    reader, writer = await asyncio.open_connection("127.0.0.1", srv.metrics_port)
    writer.write(b"GET /metrics HTTP/1.1\r\nX-Pad: " + b"a" * 9000)
    assert (await asyncio.wait_for(reader.read(), 5)).startswith(b"HTTP/1.1 431")
    writer.close()
