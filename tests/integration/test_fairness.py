"""Fairness under hostile and careless peers, over loopback sockets (issue 17: findings 6-10, 14).

Behaviour only; timing goals live in bench/hostile_neighbors.py.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import os
import socket
import struct
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families
from structlog.testing import capture_logs
from websockets.asyncio.client import connect
from websockets.exceptions import InvalidStatus

from coordinator.io.frontdoor.server import CoordinatorServer, ServerSettings
from coordinator.limits import Limits
from fleetwire import Client
from protocol import errors
from protocol.messages import Capabilities, Error, Hello
from tests.integration.test_security import Start, closed_with, peer, pki, start, worker  # noqa: F401
from worker_agent import Agent, AuthError

pytestmark = pytest.mark.timeout(30)


@pytest.fixture
async def insecure() -> AsyncIterator[Any]:
    """Starts --insecure coordinators on 127.0.0.1 with the given settings; stops them all."""
    servers: list[CoordinatorServer] = []

    async def _start(limits: Limits | None = None, **settings: Any) -> CoordinatorServer:
        srv = CoordinatorServer(ServerSettings(port=0, insecure=True, limits=limits or Limits(), **settings))
        await srv.start()
        servers.append(srv)
        return srv

    yield _start
    for srv in servers:
        await srv.stop()


async def http(
    port: int, path: str, headers: dict[str, str] | None = None, *, upgrade: bool = False
) -> tuple[int, str]:
    """One raw HTTP/1.1 request to 127.0.0.1:port (any Host header we like); (status, body)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    fields = {"Host": f"127.0.0.1:{port}", **(headers or {})}
    if upgrade:
        key = base64.b64encode(os.urandom(16)).decode()
        fields.update({"Upgrade": "websocket", "Connection": "Upgrade", "Sec-WebSocket-Key": key,
                       "Sec-WebSocket-Version": "13"})
    head = f"GET {path} HTTP/1.1\r\n" + "".join(f"{k}: {v}\r\n" for k, v in fields.items()) + "\r\n"
    writer.write(head.encode())
    await writer.drain()
    status_line = await asyncio.wait_for(reader.readline(), 10)
    status = int(status_line.split()[1])
    if status == 101:
        writer.close()
        return status, ""
    raw = await asyncio.wait_for(reader.read(), 10)
    writer.close()
    return status, raw.partition(b"\r\n\r\n")[2].decode()


def scraped(body: str, name: str) -> float:
    for family in text_string_to_metric_families(body):
        for sample in family.samples:
            if sample.name == name:
                return sample.value
    raise KeyError(name)


# ---------------------------------------------------------------- finding 7: DNS rebinding under --insecure


async def test_insecure_coordinator_refuses_a_rebinding_host_and_serves_loopback_names(insecure: Any) -> None:
    """With --insecure, a page on a name that resolves to 127.0.0.1 gets 403; loopback names and --allowed-host pass."""
    srv = await insecure(Limits(allowed_hosts=("dev.box",)))
    evil = f"evil.example:{srv.port}"
    status, body = await http(srv.port, "/v1/client", {"Host": evil, "Origin": f"http://{evil}"}, upgrade=True)
    assert status == 403 and "--allowed-host" in body
    assert (await http(srv.port, "/v1/worker", {"Host": evil}, upgrade=True))[0] == 403
    for host in (f"127.0.0.1:{srv.port}", f"localhost:{srv.port}", f"dev.box:{srv.port}"):
        assert (await http(srv.port, "/v1/client", {"Host": host}, upgrade=True))[0] == 101, host
    async with Client(srv.url) as client:  # the SDK names 127.0.0.1: served as before
        await client.workers()


# ---------------------------------------------------------------- finding 6: idle token-less sockets


async def test_idle_sockets_past_the_budget_evict_the_oldest_and_never_starve_a_real_handshake(insecure: Any) -> None:
    """200 idle TCP connections against a budget of 16: the oldest are dropped, a real client still connects."""
    srv = await insecure(Limits(max_pending_handshakes=16, defer_accept_s=0))  # accepted at once, as without Linux
    idle: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []
    try:
        with capture_logs() as logs:
            idle += [await asyncio.open_connection("127.0.0.1", srv.port) for _ in range(200)]
            async with Client(srv.url) as client:
                await client.workers()
        status, body = await http(srv.port, "/metrics")
        assert status == 200
        assert scraped(body, "fleetwire_handshakes_evicted_total") >= 200 - 16
        assert scraped(body, "fleetwire_handshakes_pending") <= 16
        evictions = [e for e in logs if e.get("reason") == "pending-handshake budget"]
        assert 1 <= len(evictions) <= Limits().refusal_log_burst  # logged, and rate-limited
        reader, _ = idle[0]
        assert await asyncio.wait_for(reader.read(), 5) == b""  # the oldest was dropped
    finally:
        for _, writer in idle:
            writer.close()


async def test_idle_sockets_cost_no_websocket_connection_until_their_first_byte(insecure: Any) -> None:
    """100 idle TCP connections start no handler task; a real client still connects; a silent one is dropped in time."""
    srv = await insecure(Limits(handshake_timeout_s=1.0, defer_accept_s=0))
    tasks_before = len(asyncio.all_tasks())
    idle = [await asyncio.open_connection("127.0.0.1", srv.port) for _ in range(100)]
    try:
        async with Client(srv.url) as client:  # accepted after the idle ones: they are all accepted by now
            await client.workers()
            assert len(asyncio.all_tasks()) - tasks_before < 20  # the client's own; none per idle socket
        reader, _ = idle[0]
        assert await asyncio.wait_for(reader.read(), 5) == b""  # dropped at the handshake timeout
    finally:
        for _, writer in idle:
            writer.close()


needs_defer_accept = pytest.mark.skipif(not hasattr(socket, "TCP_DEFER_ACCEPT"), reason="TCP_DEFER_ACCEPT is Linux's")


def idle_sockets(port: int, n: int) -> list[socket.socket]:
    """``n`` TCP connections to 127.0.0.1:port that send nothing (the kernel completes them without the server)."""
    return [socket.create_connection(("127.0.0.1", port)) for _ in range(n)]


def reset(socks: list[socket.socket]) -> None:
    """Close with RST, so the kernel forgets a connection it still holds back instead of handing it over at its FIN."""
    for sock in socks:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        sock.close()


@needs_defer_accept
async def test_idle_sockets_are_never_accepted_before_their_first_byte_and_a_real_client_is_at_once(
    insecure: Any,
) -> None:
    """With the default --defer-accept, 200 idle sockets against a budget of 16 are not accepted: no eviction."""
    srv = await insecure(Limits(max_pending_handshakes=16))
    idle = idle_sockets(srv.port, 200)
    try:
        async with Client(srv.url) as client:  # connected after the idle ones, accepted before them
            await client.workers()
        status, body = await http(srv.port, "/metrics")
        assert status == 200
        assert scraped(body, "fleetwire_defer_accept_seconds") >= Limits().handshake_timeout_s
        assert scraped(body, "fleetwire_handshakes_accepted_total") <= 3  # the client's and this scrape's
        assert scraped(body, "fleetwire_handshakes_evicted_total") == 0
    finally:
        reset(idle)


@needs_defer_accept
async def test_an_idle_socket_is_accepted_after_the_deferral_then_dropped_at_the_handshake_timeout(
    insecure: Any,
) -> None:
    """An idle socket reaches the coordinator after --defer-accept and is dropped at the handshake timeout, counted."""
    srv = await insecure(Limits(handshake_timeout_s=1.0, defer_accept_s=1.0))
    reader, writer = await asyncio.open_connection("127.0.0.1", srv.port)
    try:
        assert await asyncio.wait_for(reader.read(), 15) == b""  # kernel ~1 s, then the 1 s timeout
        status, body = await http(srv.port, "/metrics")
        assert status == 200
        assert scraped(body, "fleetwire_handshakes_idle_dropped_total") == 1
    finally:
        writer.close()


async def test_defer_accept_off_accepts_idle_sockets_at_once(insecure: Any) -> None:
    """--defer-accept 0: no TCP_DEFER_ACCEPT; idle sockets are accepted (and budgeted) as they come."""
    srv = await insecure(Limits(defer_accept_s=0))
    idle = idle_sockets(srv.port, 20)
    try:
        async with Client(srv.url) as client:  # connected after the idle ones, so accepted after them
            await client.workers()
        status, body = await http(srv.port, "/metrics")
        assert status == 200
        assert scraped(body, "fleetwire_defer_accept_seconds") == 0
        assert scraped(body, "fleetwire_handshakes_accepted_total") >= 21
    finally:
        reset(idle)


# ---------------------------------------------------------------- finding 9: /metrics cost and access


async def test_metrics_are_cached_and_can_require_a_token(insecure: Any) -> None:
    """Scrapes within --metrics-cache share one rendering; --metrics-token makes /metrics answer 401 without it."""
    token = "metrics-token-0123456789"
    srv = await insecure(metrics_cache_s=60.0, metrics_token=token)
    assert (await http(srv.port, "/metrics"))[0] == 401
    assert (await http(srv.port, "/metrics", {"Authorization": "Bearer wrong"}))[0] == 401
    bodies = [await http(srv.port, "/metrics", {"Authorization": f"Bearer {token}"}) for _ in range(20)]
    assert {status for status, _ in bodies} == {200} and len({body for _, body in bodies}) == 1
    assert srv.metrics_cache.builds == 1
    assert (await http(srv.port, "/healthz"))[0] == 200  # health needs no token


async def test_metrics_listen_serves_metrics_on_its_own_socket(insecure: Any) -> None:
    """--metrics-listen: /metrics moves to its own address and the main port answers 404 for it."""
    srv = await insecure(metrics_listen="127.0.0.1:0")
    assert srv.metrics_port
    status, body = await http(srv.port, "/metrics")
    assert status == 404 and "--metrics-listen" in body
    status, body = await http(srv.metrics_port, "/metrics")
    assert status == 200 and "fleetwire_workers_alive" in body
    assert (await http(srv.metrics_port, "/v1/client"))[0] == 404


# ---------------------------------------------------------------- finding 10: refusal logs


async def test_a_reconnect_loop_with_a_bad_token_is_logged_a_few_times_then_summed_up(start: Start) -> None:  # noqa: F811
    """50 401s from one host: 3 lines one by one, then one summary line with the count; /metrics counts all 50."""
    srv = await start(Limits(refusal_log_burst=3, refusal_log_interval_s=0.5))
    with capture_logs() as logs:
        for _ in range(50):
            with pytest.raises(InvalidStatus):
                await connect(f"{srv.url}/v1/client", additional_headers={"Authorization": "Bearer not-a-token"})
        deadline = time.monotonic() + 10
        while not any(e["event"].startswith("refused 50 connections") for e in logs):
            assert time.monotonic() < deadline, [e["event"] for e in logs]
            await asyncio.sleep(0.05)  # the summary is written by a timer at the interval's end
    single = [e for e in logs if e["event"] == "refused connection"]
    summary = next(e["event"] for e in logs if e["event"].startswith("refused 50"))
    assert len(single) == 3 and "from 127.0.0.1" in summary and "invalid token: 47" in summary
    _, body = await http(srv.port, "/metrics")
    assert scraped(body, "fleetwire_refusal_logs_suppressed_total") == 47


# ---------------------------------------------------------------- finding 8: worker impersonation


async def test_an_impostor_with_a_glob_token_cannot_evict_a_live_worker(start: Start) -> None:  # noqa: F811
    """A second gpu-* session saying hello gpu-1 gets worker_id_in_use naming the holder and 4409; gpu-1 stays."""
    srv = await start()
    agent = Agent(srv.url, "gpu-token", worker_id="gpu-1")
    task = asyncio.create_task(agent.run())
    try:
        await asyncio.wait_for(agent.registered.wait(), 10)
        holder = srv.core.registry.get("gpu-1")
        impostor = await peer(srv, "gpu")
        await impostor.send(Hello(worker_id="gpu-1", capabilities=Capabilities(ops=["echo"])))
        refusal = await impostor.recv()
        assert isinstance(refusal, Error) and refusal.code == errors.WORKER_ID_IN_USE
        assert holder.address in refusal.message
        assert await closed_with(impostor) == errors.CLOSE_REPLACED
        assert srv.core.registry.get("gpu-1").conn_id == holder.conn_id and agent.registered.is_set()
        async with Client(srv.url, token="alice-token") as client:  # plans still go to the real gpu-1
            result = await (await client.submit("echo", {"x": 1})).result()
            assert result == {"x": 1}
    finally:
        agent.stop()
        await asyncio.wait_for(task, 10)


# ---------------------------------------------------------------- finding 14: mTLS refusal wording


async def test_a_worker_without_a_client_certificate_is_told_so(
    start: Start, pki: dict[str, str]  # noqa: F811
) -> None:
    """mTLS: the 403 body and the agent's error both say a client certificate is required, not a role problem."""
    srv = await start(tls_cert=pki["server"], tls_key=pki["server"], tls_client_ca=pki["ca"])
    agent = Agent(srv.url, "fleet-token", worker_id="m-1", ca_file=pki["ca"])
    with pytest.raises(AuthError) as info:
        await asyncio.wait_for(agent.run(), 10)
    message = str(info.value)
    assert "client certificate" in message and "--tls-cert" in message and "worker role" not in message
    with contextlib.suppress(Exception):
        agent.stop()
