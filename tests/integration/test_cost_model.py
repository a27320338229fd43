"""The cost model over loopback sockets (issue 17: findings 1, 2, 4 and 5's SDK side).

Behaviour only; timing goals live in bench/hostile_neighbors.py.
"""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path
from typing import Any

import msgspec
import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import InvalidStatus

from coordinator.limits import Limits
from fleetwire import Client
from protocol import SUBPROTOCOL_MSGPACK
from protocol.caps import MAX_TAG_BYTES, MAX_TAGS
from protocol.messages import ListPlans, ListWorkers, Requirements, Submit, Workers
from tests.integration.test_security import TOKENS, Start, peer, start  # noqa: F401
from tests.waiting import until

pytestmark = pytest.mark.timeout(60)

BIG_TAGS = [f"{i:03d}" + "t" * (MAX_TAG_BYTES - 3) for i in range(MAX_TAGS)]


async def fill(srv: Any, name: str, n: int, **submit: Any) -> None:
    """Submit ``n`` plans as ``name`` (no worker runs them: they stay queued)."""
    p = await peer(srv, name)
    for first in range(0, n, 50):  # frames under the 1 MiB limit even with the largest tag lists
        await p.send(*[Submit(req_id=i + 1, op="nobody", **submit) for i in range(first, min(n, first + 50))])
    accepted = 0
    while accepted < n:
        accepted += type(await p.recv()).__name__ == "Accepted"
    await p.ws.close()


async def _drain(ws: Any) -> None:
    with contextlib.suppress(Exception):
        async for _ in ws:
            pass


async def test_one_frame_of_expensive_requests_lets_others_in_between(start: Start) -> None:  # noqa: F811
    """300 list_plans in one frame: another client's request is handled before the frame's last one,
    because a frame's requests past the per-turn cost budget wait for the next loop turn."""
    srv = await start()
    await fill(srv, "alice", 2_000)
    order: list[str] = []
    receive = srv.core.receive

    def noting(conn_id: int, msg: Any, now: float) -> None:
        order.append(type(msg).__name__)
        if isinstance(msg, ListPlans) and not started.is_set():
            started.set()
        receive(conn_id, msg, now)

    started = asyncio.Event()
    srv.core.receive = noting  # type: ignore[method-assign]
    attacker = await peer(srv, "alice")
    legit = await peer(srv, "bob")
    reader = asyncio.create_task(_drain(attacker.ws))
    await attacker.send(*[ListPlans(req_id=i + 1, limit=10_000) for i in range(300)])
    await asyncio.wait_for(started.wait(), 10)
    await legit.send(ListWorkers(req_id=1))
    assert isinstance(await asyncio.wait_for(legit.recv(), 20), Workers)
    assert order.count("ListPlans") < 300  # answered in between, not after the whole frame
    await until(lambda: order.count("ListPlans") == 300)  # the attacker reads: all of its frame is answered
    await until(lambda: srv.cost_throttles >= 1)  # and its principal, over its work-unit rate, is read more slowly
    await attacker.ws.close()  # with its reader still draining: a cancelled reader leaves the replies in flight
    await reader  # unread, websockets stops reading and the close waits its 10 s close_timeout
    await legit.ws.close()


async def test_a_client_that_never_reads_is_closed_4503_by_real_bytes(start: Start) -> None:  # noqa: F811
    """A client sending list_plans without reading is closed 4503 once its unsent replies pass
    --max-pending-bytes as encoded, not after tens of thousands of messages counted 64 bytes each."""
    srv = await start(Limits(max_pending_bytes=2 << 20, cost_rate=0))
    await fill(srv, "alice", 400, requirements=Requirements(tags=BIG_TAGS[:8]))
    token = TOKENS["alice"][1]
    ws = await connect(f"{srv.url}/v1/client", additional_headers={"Authorization": f"Bearer {token}"},
                       subprotocols=[SUBPROTOCOL_MSGPACK], compression=None, max_queue=1,  # type: ignore[list-item]
                       max_size=None)
    frame = msgspec.msgpack.encode([{"type": "list_plans", "req_id": i, "limit": 10_000} for i in range(50)])
    with contextlib.suppress(Exception):
        for _ in range(40):  # 2,000 requests, each answered with ~400 KB it never reads
            await ws.send(frame)
            if srv.refusals.get("4503"):
                break
    await until(lambda: srv.refusals.get("4503", 0) >= 1)
    ws.transport.abort()
    await ws.wait_closed()


async def test_one_client_token_cannot_take_every_connection(start: Start) -> None:  # noqa: F811
    """With --max-connections 80, one client token gets its share (20), another token and a worker still get in."""
    srv = await start(Limits(max_connections=80))
    held = [await peer(srv, "alice") for _ in range(20)]
    with pytest.raises(InvalidStatus) as refused:
        await peer(srv, "alice")
    assert refused.value.response.status_code == 503
    assert b"--max-connections-per-principal" in refused.value.response.body
    other = await peer(srv, "bob")
    worker = await peer(srv, "fleet")
    for p in [*held, other, worker]:
        await p.ws.close()


async def test_the_sdk_follows_pages_of_a_long_listing(start: Start) -> None:  # noqa: F811
    """Client.plans(limit=N) over plans too big for one page returns N rows, paged under the frame limit."""
    srv = await start()
    await fill(srv, "alice", 300, requirements=Requirements(tags=BIG_TAGS))
    async with Client(srv.url, token=TOKENS["alice"][1]) as client:
        reply = await client.plans(limit=300)
    assert len(reply.plans) == 300 and len({p.id for p in reply.plans}) == 300
    assert reply.total == 300 and not reply.next_cursor


def test_tokens_fixture_is_shared(tmp_path: Path) -> None:
    """The token names these tests use exist in the shared token file (alice, bob: clients; fleet: workers)."""
    assert TOKENS["alice"][0] == "client" and TOKENS["bob"][0] == "client" and TOKENS["fleet"][0] == "worker"


async def test_bytes_received_are_charged_so_a_big_submit_loop_is_read_more_slowly(start: Start) -> None:  # noqa: F811
    """Frames cost a unit per KiB: three 512 KiB submits against a 1,000-unit burst throttle their principal."""
    srv = await start(Limits(cost_rate=1_000, cost_burst=1_000))
    p = await peer(srv, "alice")
    for i in range(3):
        await p.send(Submit(req_id=i + 1, op="nobody", args="x" * (512 << 10)))
    await until(lambda: srv.cost_throttles >= 1)
    await p.ws.close()
