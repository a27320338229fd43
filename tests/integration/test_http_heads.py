"""Malformed HTTP/1.1 heads are refused with 400 where the hand parsers took them (protocol/transfer/http1.py).

Issue #26's behaviour delta: the data endpoint and ``--metrics-listen`` now parse heads with
``httptools``; a space before a colon, two ``Content-Length`` s, an obsolete line folding, or
``Transfer-Encoding`` with ``Content-Length`` (the heads of request smuggling) get 400 naming what
is wrong, and the body behind such a head is never read. Well-formed requests are unchanged.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from coordinator.limits import Limits
from protocol.messages import DataKey
from protocol.tickets import FileClaim, TicketClaims, sign, worker_key
from tests.integration.data_helpers import digest
from tests.integration.test_fairness import http, insecure  # noqa: F401
from worker_agent.dataplane import DataServer
from worker_agent.spool import Spool

pytestmark = pytest.mark.timeout(60)

MASTER = b"h" * 32
WORKER = "w1"
DATA = b"hello"

MALFORMED = {
    "space before colon": "Content-Length : 5\r\n",
    "two content-lengths": "Content-Length: 5\r\nContent-Length: 5\r\n",
    "obs-fold": "Content-Length: 5\r\nX-Note: a\r\n folded\r\n",
    "te and cl": "Transfer-Encoding: chunked\r\nContent-Length: 5\r\n",
}


def _ticket() -> str:
    claims = TicketClaims("p1", 1, WORKER, "put", {"in": FileClaim(len(DATA), digest(DATA))}, time.time() + 60)
    return sign(claims, "k1", worker_key(MASTER, WORKER))


@pytest.fixture
async def endpoint(tmp_path: Path) -> AsyncIterator[DataServer]:
    server = DataServer(Spool(tmp_path / "spool"), worker_id=WORKER, stall_timeout_s=2)
    server.set_keys([DataKey(kid="k1", key=worker_key(MASTER, WORKER))])
    await server.start()
    yield server
    await server.close()


async def _exchange(port: int, raw: bytes) -> tuple[str, bytes]:
    """Send ``raw``; the status line and body of the answer (the server closes after a refusal)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(raw)
        answer = await asyncio.wait_for(reader.read(), 10)
    finally:
        writer.close()
    head, _, body = answer.partition(b"\r\n\r\n")
    return head.split(b"\r\n", 1)[0].decode("latin-1"), body


@pytest.mark.parametrize("fields", MALFORMED.values(), ids=list(MALFORMED))
async def test_a_malformed_put_head_gets_400_and_its_body_is_not_stored(endpoint: DataServer, fields: str) -> None:
    """Each smuggling-shaped head: 400 with a reason, the connection closed, no byte of the input taken."""
    raw = (f"PUT /v1/data/p1/1/inputs/in HTTP/1.1\r\nHost: h\r\nAuthorization: Bearer {_ticket()}\r\n{fields}\r\n"
           ).encode() + DATA
    status, body = await _exchange(endpoint.port, raw)
    assert status == "HTTP/1.1 400 Bad Request"
    assert b"malformed HTTP request head" in body
    assert endpoint.refused[400] == 1
    entry = endpoint.spool.input("p1", 1, "in")
    assert entry is None or entry.received == 0


async def test_the_same_put_well_formed_is_stored(endpoint: DataServer) -> None:
    """The control: one ``Content-Length: 5`` and the same body is verified (201)."""
    raw = (f"PUT /v1/data/p1/1/inputs/in HTTP/1.1\r\nHost: h\r\nAuthorization: Bearer {_ticket()}\r\n"
           "Content-Length: 5\r\nConnection: close\r\n\r\n").encode() + DATA
    status, _ = await _exchange(endpoint.port, raw)
    assert status == "HTTP/1.1 201 Created"
    entry = endpoint.spool.input("p1", 1, "in")
    assert entry is not None and entry.state == "verified"


async def test_a_malformed_head_at_metrics_listen_gets_400(insecure: Any) -> None:  # noqa: F811
    """``--metrics-listen``: two Content-Lengths get 400 (was served as a scrape); a plain GET is still 200."""
    srv = await insecure(Limits(defer_accept_s=0), metrics_listen="127.0.0.1:0")
    raw = b"GET /healthz HTTP/1.1\r\nHost: h\r\nContent-Length: 0\r\nContent-Length: 1\r\n\r\n"
    status, body = await _exchange(srv.metrics_port, raw)
    assert status == "HTTP/1.1 400 Bad Request" and b"Content-Length" in body
    assert (await http(srv.metrics_port, "/healthz"))[0] == 200
