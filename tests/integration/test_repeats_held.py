"""Repeated 401s and /metrics scrapes from one address are held (issue 17 findings 9 and 10), over loopback sockets.

Behaviour only (which answers are held, what they carry, what /metrics counts); what the hold
saves the coordinator is measured in bench/hostile_neighbors.py (f9-metrics, f10-401-flood).
"""

from __future__ import annotations

import asyncio
import base64
import os

import pytest

from coordinator.io.frontdoor.gate import REPEAT_BURST
from coordinator.io.frontdoor.server import CoordinatorServer, ServerSettings
from coordinator.limits import Limits
from tests.integration.test_fairness import scraped
from tests.integration.test_security import Start, start  # noqa: F401
from tests.waiting import until

pytestmark = pytest.mark.timeout(60)


async def request(port: int, path: str, token: str | None = None) -> tuple[int, dict[str, str], str]:
    """One raw HTTP/1.1 request (a websocket upgrade for /v1/ paths); (status, headers, body)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    fields = {"Host": f"127.0.0.1:{port}"}
    if token is not None:
        fields["Authorization"] = f"Bearer {token}"
    if path.startswith("/v1/"):
        fields.update({"Upgrade": "websocket", "Connection": "Upgrade", "Sec-WebSocket-Version": "13",
                       "Sec-WebSocket-Key": base64.b64encode(os.urandom(16)).decode()})
    head = f"GET {path} HTTP/1.1\r\n" + "".join(f"{k}: {v}\r\n" for k, v in fields.items()) + "\r\n"
    try:
        writer.write(head.encode())
        raw = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
        lines = raw.decode().split("\r\n")
        status = int(lines[0].split()[1])
        headers = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:] if line)}
        body = b"" if status == 101 else await asyncio.wait_for(reader.read(), 10)
    finally:  # also when the connection is dropped before an answer
        writer.close()
    return status, headers, body.decode()


async def test_past_the_burst_a_wrong_token_gets_a_held_401_with_retry_after(start: Start) -> None:  # noqa: F811
    """The first 100 wrong-token upgrades from an address get plain 401s, then Retry-After; a valid token passes."""
    srv = await start(Limits(penalty_hold_s=0.2))
    answers = [await request(srv.port, "/v1/client", "not-a-token") for _ in range(REPEAT_BURST)]
    assert {status for status, _, _ in answers} == {401}
    assert not any("retry-after" in headers for _, headers, _ in answers)
    status, headers, _ = await request(srv.port, "/v1/client", "not-a-token")
    assert status == 401 and headers["retry-after"] == "1"
    assert (await request(srv.port, "/v1/client", "alice-token"))[0] == 101  # the same address, a valid token
    _, _, body = await request(srv.port, "/metrics")
    assert scraped(body, "fleetwire_repeats_held_total") == 1


async def test_past_the_burst_metrics_scrapes_are_held_and_counted(start: Start) -> None:  # noqa: F811
    """A scrape loop from one address: past the burst each scrape is still answered 200, and counted as held."""
    srv = await start(Limits(penalty_hold_s=0.05), metrics_cache_s=0.0)
    answers = [await request(srv.port, "/metrics") for _ in range(REPEAT_BURST + 3)]
    assert {status for status, _, _ in answers} == {200}
    held = [line for line in answers[-1][2].splitlines() if line.startswith("fleetwire_repeats_held_total")]
    assert 'fleetwire_repeats_held_total{kind="metrics"} 2.0' in held  # the last scrape is counted after it is built


async def test_a_stop_during_a_held_401_drops_its_connection_and_returns() -> None:
    """A stop while a held 401 waits out its hold: the held connection, still before its upgrade, is dropped
    with the others the stop aborts, and the stop returns (it waits at most the hold for that handshake)."""
    srv = CoordinatorServer(ServerSettings(port=0, worker_tokens=("worker-token-0123456789",),
                                           client_tokens=("client-token-0123456789",),
                                           limits=Limits(penalty_hold_s=2.0)))  # fmt: skip
    await srv.start()
    try:
        for _ in range(REPEAT_BURST):
            await request(srv.port, "/v1/client", "not-a-token")
        held = asyncio.ensure_future(request(srv.port, "/v1/client", "not-a-token"))
        await until(lambda: srv._gate.auth_failures.over_count == 1)  # counted: its answer is in its hold now
    finally:
        await asyncio.wait_for(srv.stop(), 30)
    with pytest.raises(asyncio.IncompleteReadError):
        await held


async def test_a_held_401_whose_connection_is_dropped_ends_its_handler_before_the_hold(start: Start) -> None:  # noqa: F811
    """A held 401 whose client drops the connection during the hold: its handler ends then, not after the hold."""
    srv = await start(Limits(penalty_hold_s=4.0))
    assert srv._gate.hold_s == 4.0 and srv._server is not None
    for _ in range(REPEAT_BURST):
        await request(srv.port, "/v1/client", "not-a-token")
    await until(lambda: all(task.done() for task in srv._server.handler_tasks))  # (the burst's answered handlers)
    _, writer = await asyncio.open_connection("127.0.0.1", srv.port)
    key = base64.b64encode(os.urandom(16)).decode()
    writer.write(f"GET /v1/client HTTP/1.1\r\nHost: 127.0.0.1:{srv.port}\r\nAuthorization: Bearer not-a-token\r\n"
                 f"Upgrade: websocket\r\nConnection: Upgrade\r\nSec-WebSocket-Version: 13\r\n"
                 f"Sec-WebSocket-Key: {key}\r\n\r\n".encode())  # fmt: skip
    await until(lambda: srv._gate.auth_failures.over_count == 1)  # counted: its answer is in its hold now
    (handler,) = [task for task in srv._server.handler_tasks if not task.done()]
    writer.close()  # the client gives up on it
    await writer.wait_closed()
    done, _ = await asyncio.wait([handler], timeout=srv._gate.hold_s / 2)
    if not done:  # the bug: it ends with the hold
        await asyncio.wait([handler], timeout=10)
    assert done, "the held handler waited out its hold after its connection was dropped"
