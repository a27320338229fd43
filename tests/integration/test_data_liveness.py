"""The worker's data endpoint takes bytes only for live attempts, and caps its connections (issue #24 parts 3, 5):
a cancelled or ended plan's put ticket is refused 410 before a body byte is read; an upload ahead of its assign is
held a bounded time and count; idle sockets past the budget evict the oldest; a silent one is dropped at the
first-byte deadline, and is not even accepted before its first byte; idle connections share one read buffer;
refusals repeated by one host are answered after a hold, a bounded number at once (loopback sockets; a real
coordinator and agent in this process where the agent's part shows)."""

from __future__ import annotations

import asyncio
import contextlib
import resource
import socket
import ssl
import time
import tracemalloc
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import trustme

from fleetwire import Client, PlanCancelled
from fleetwire.data import Grant
from protocol.messages import DataKey
from protocol.tickets import FileClaim, TicketClaims, sign, worker_key
from tests.integration.data_helpers import CLIENT_TOKEN, MASTER, WORKER, coordinator_and_data_worker, digest, grant
from tests.integration.test_data_plane import NeverUploads
from tests.waiting import until
from worker_agent.attempts import Attempts
from worker_agent.dataplane import DataServer
from worker_agent.http_conn import raise_fd_limit
from worker_agent.spool import Spool

pytestmark = pytest.mark.timeout(60)

MIB = 1 << 20


async def put(url: str, grant: Grant, name: str, body: bytes, *, offset: int = 0, size: int | None = None
              ) -> tuple[int, dict[str, str], bytes]:
    """One raw PUT of ``body`` with ``Expect: 100-continue`` (the body follows a 100): status, headers, body."""
    target = httpx.URL(grant.resource("inputs", name))
    total = len(body) if size is None else size
    head = (f"PUT {target.raw_path.decode()} HTTP/1.1\r\nHost: h\r\nAuthorization: Bearer {grant.ticket}\r\n"
            f"Content-Length: {len(body)}\r\nContent-Range: bytes {offset}-{offset + len(body) - 1}/{total}\r\n"
            "Expect: 100-continue\r\n\r\n")
    reader, writer = await asyncio.open_connection(target.host, target.port)
    try:
        writer.write(head.encode())
        status, headers = await _answer(reader)
        if status == 100:
            writer.write(body)
            status, headers = await _answer(reader)
        return status, headers, await reader.readexactly(int(headers.get("content-length", "0")))
    finally:
        writer.transport.abort()


async def blind_put(grant: Grant, name: str, body: bytes) -> None:
    """A raw PUT sent head and body in one write, as a flood would (the answer may be lost to a reset: unread)."""
    target = httpx.URL(grant.resource("inputs", name))
    head = (f"PUT {target.raw_path.decode()} HTTP/1.1\r\nHost: h\r\nAuthorization: Bearer {grant.ticket}\r\n"
            f"Content-Length: {len(body)}\r\n\r\n")
    reader, writer = await asyncio.open_connection(target.host, target.port)
    try:
        writer.write(head.encode() + body)
        with contextlib.suppress(ConnectionError):
            await writer.drain()
            await asyncio.wait_for(reader.read(), 10)  # until the worker closes
    finally:
        writer.transport.abort()


async def _answer(reader: asyncio.StreamReader) -> tuple[int, dict[str, str]]:
    lines = (await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)).decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:] if line)}
    return int(lines[0].split(" ")[1]), headers


async def hold(ctx: Any, args: Any) -> str:
    return "ran"


async def data_ready(plan: Any) -> Grant:
    async for event in plan.events():
        if event.kind == "data_ready":
            return Grant.from_event(event)
    raise AssertionError("no data_ready")


# --------------------------------------------------------------------------- live attempts (a real agent)


async def test_cancelled_plans_put_tickets_are_410_and_no_body_byte_is_read(tmp_path: Path) -> None:
    """1 MiB uploads for 40 cancelled plans (one had half its input in): every PUT is refused 410 from its head,
    naming the plan attempt as cancelled; blind ones (the body right behind the head) as well: not one body byte
    is taken, and the spool holds nothing of them."""
    plans = 40
    data = bytes(range(256)) * (MIB // 256)
    fleet = coordinator_and_data_worker(tmp_path, {"hold": hold}, input_timeout_s=60.0, max_concurrency=plans)
    async with fleet as (server, agent), Client(server.url, token=CLIENT_TOKEN) as client:
        client.transport = NeverUploads()
        submitted = [await client.submit("hold", inputs={"data": data}) for _ in range(plans)]
        grants = [await asyncio.wait_for(data_ready(plan), 10) for plan in submitted]
        endpoint = agent.data_server
        assert endpoint is not None
        status, _, _ = await put(endpoint.url, grants[0], "data", data[: MIB // 2], size=MIB)
        assert status == 204  # live: half of it taken
        assert endpoint.bytes_in == MIB // 2
        for plan in submitted:
            await client.cancel(plan.id)
        for plan in submitted:
            with pytest.raises(PlanCancelled):
                await asyncio.wait_for(plan.result(), 10)
        await until(lambda: len(agent.attempts) == 0, 10)  # the cancels reached the worker
        answers = [await put(endpoint.url, g, "data", data) for g in grants]
        resumed = await put(endpoint.url, grants[0], "data", data[MIB // 2 :], offset=MIB // 2, size=MIB)
        for g in grants:
            await blind_put(g, "data", data)
        spool = endpoint.spool
        assert all(status == 410 for status, _, _ in [*answers, resumed])
        assert all(f"plan {g.plan_id!r} attempt 1 was cancelled" in body.decode() for g, (_, _, body) in
                   zip(grants, answers, strict=True))
        assert endpoint.bytes_in == MIB // 2  # nothing of the flood was read
        assert spool.input(grants[0].plan_id, 1, "data") is None
        assert (spool.used_bytes, spool.memory_used) == (0, 0)
        assert endpoint.refused[410] == 2 * plans + 1


async def test_a_succeeded_plans_put_ticket_is_410_ended(tmp_path: Path) -> None:
    """Once a plan's attempt ended, its put ticket (valid for an hour) takes nothing more: 410 'ended succeeded'."""
    data = b"abc"
    async with coordinator_and_data_worker(tmp_path, {"hold": hold}) as (server, agent), \
            Client(server.url, token=CLIENT_TOKEN) as client:
        plan = await client.submit("hold", inputs={"data": data})
        assert await asyncio.wait_for(plan.result(), 10) == "ran"
        ready = await data_ready(plan)
        assert agent.data_server is not None
        await until(lambda: not agent.attempts.live(plan.id, 1), 10)
        status, _, body = await put(agent.data_server.url, ready, "data", data)
    assert status == 410 and f"plan {plan.id!r} attempt 1 ended succeeded" in body.decode()


# --------------------------------------------------------------------------- held before the assign (the endpoint)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@contextlib.asynccontextmanager
async def held_endpoint(tmp_path: Path, clock: Clock, max_early: int = 64) -> AsyncIterator[DataServer]:
    """Worker w1's endpoint with no assign ever coming: every attempt is held, on ``clock``."""
    spool = Spool(tmp_path / "spool", memory_bytes=1024)
    attempts = Attempts(early_hold_s=60.0, max_early=max_early, clock=clock, on_end=spool.drop_unclaimed)
    server = DataServer(spool, worker_id=WORKER, attempts=attempts, stall_timeout_s=2.0)
    server.set_keys([DataKey(kid="k1", key=worker_key(MASTER, WORKER))])
    await server.start()
    try:
        yield server
    finally:
        await server.close()


async def test_an_upload_ahead_of_its_assign_is_held_then_dropped_and_refused(tmp_path: Path) -> None:
    """Bytes for an attempt not (yet) assigned are taken; no assign within the hold: they go, and it is refused 410."""
    clock = Clock()
    data = b"x" * 5000
    async with held_endpoint(tmp_path, clock) as endpoint:
        ticket = grant(endpoint.url, "x", len(data), digest(data))
        status, _, _ = await put(endpoint.url, ticket, "x", data[:3000], size=len(data))
        assert status == 204 and endpoint.spool.input("p1", 1, "x") is not None
        clock.now += 61
        status, _, body = await put(endpoint.url, ticket, "x", data[3000:], offset=3000, size=len(data))
        assert status == 410 and "is not assigned to this worker" in body.decode()
        assert endpoint.spool.input("p1", 1, "x") is None and endpoint.spool.used_bytes == 0


async def test_attempts_held_ahead_of_their_assign_are_bounded_in_number(tmp_path: Path) -> None:
    """Past max_early attempts held at once, an upload for another is answered 503 with Retry-After, nothing read."""
    clock = Clock()
    async with held_endpoint(tmp_path, clock, max_early=2) as endpoint:
        for plan in ("a", "b"):
            assert (await put(endpoint.url, abc_grant(endpoint.url, plan), "x", b"abc"))[0] == 201
        status, headers, body = await put(endpoint.url, abc_grant(endpoint.url, "c"), "x", b"abc")
        assert endpoint.bytes_in == 6
    assert status == 503 and headers["retry-after"] == "1" and "not yet assigned" in body.decode()


def abc_grant(url: str, plan: str) -> Grant:
    """A put ticket for input ``x`` (b"abc") of ``plan`` attempt 1 on worker w1 (data_helpers.grant signs p1)."""
    claims = TicketClaims(plan, 1, WORKER, "put", {"x": FileClaim(3, digest(b"abc"))}, time.time() + 60)
    ticket = sign(claims, "k1", worker_key(MASTER, WORKER))
    return Grant(plan, 1, url, ticket, ticket)


# --------------------------------------------------------------------------- connection caps


async def test_idle_sockets_past_the_budget_evict_the_oldest_and_uploads_are_served(tmp_path: Path) -> None:
    """200 token-less idle sockets against a budget of 16: the oldest are closed by the worker, at most 16 stay
    idle, and uploads made meanwhile all succeed."""
    spool = Spool(tmp_path / "spool", memory_bytes=1024)
    # The kernel's deferred accept off: the budget is for the idle sockets it does hand over (after its
    # deferral, or through SYN cookies past the backlog).
    endpoint = DataServer(spool, worker_id=WORKER, max_idle_connections=16, stall_timeout_s=30.0, defer_accept_s=0)
    endpoint.set_keys([DataKey(kid="k1", key=worker_key(MASTER, WORKER))])
    await endpoint.start()
    idle: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []
    try:
        for _ in range(200):
            idle.append(await asyncio.open_connection(endpoint.host, endpoint.port))
        await until(lambda: endpoint.connections >= 200, 10)
        answers = []
        for n in range(10):
            data = bytes([n]) * 4000
            answers.append((await put(endpoint.url, _named(endpoint.url, f"in{n}", data), f"in{n}", data))[0])
        assert answers == [201] * 10
        assert len(endpoint.idle) <= 16 and endpoint.idle.evicted >= 184
        first_reader = idle[0][0]
        assert await asyncio.wait_for(first_reader.read(), 5) == b""  # the oldest was closed by the worker
    finally:
        for _, writer in idle:
            writer.transport.abort()
        await endpoint.close()


def _named(url: str, name: str, data: bytes) -> Grant:
    return grant(url, name, len(data), digest(data))


async def test_a_silent_new_connection_is_dropped_at_the_first_byte_deadline(tmp_path: Path) -> None:
    """A connection that sends nothing is closed after first_byte_timeout_s, well before the stall timeout."""
    spool = Spool(tmp_path / "spool", memory_bytes=1024)
    endpoint = DataServer(spool, worker_id=WORKER, first_byte_timeout_s=0.3, stall_timeout_s=30.0)
    await endpoint.start()
    try:
        reader, writer = await asyncio.open_connection(endpoint.host, endpoint.port)
        assert await asyncio.wait_for(reader.read(), 5) == b""
        writer.transport.abort()
    finally:
        await endpoint.close()


async def test_a_silent_connection_to_a_tls_endpoint_is_dropped_at_the_first_byte_deadline(tmp_path: Path) -> None:
    """Over TLS the handshake comes before the connection is counted: a socket that never starts it is dropped
    after first_byte_timeout_s too (asyncio's default would hold it 60 s)."""
    tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    trustme.CA().issue_cert("127.0.0.1").configure_cert(tls)
    spool = Spool(tmp_path / "spool", memory_bytes=1024)
    endpoint = DataServer(spool, worker_id=WORKER, tls=tls, first_byte_timeout_s=0.3, stall_timeout_s=30.0)
    await endpoint.start()
    try:
        reader, writer = await asyncio.open_connection(endpoint.host, endpoint.port)
        assert await asyncio.wait_for(reader.read(), 5) == b""
        writer.transport.abort()
    finally:
        await endpoint.close()


@pytest.mark.skipif(not hasattr(socket, "TCP_DEFER_ACCEPT"), reason="TCP_DEFER_ACCEPT is Linux's")
async def test_a_silent_socket_is_not_accepted_before_its_first_byte(tmp_path: Path) -> None:
    """50 token-less sockets that never send are held by the kernel (TCP_DEFER_ACCEPT): an upload made after them
    is served, and it is the only connection the endpoint accepted; nothing is evicted."""
    spool = Spool(tmp_path / "spool", memory_bytes=1024)
    endpoint = DataServer(spool, worker_id=WORKER, max_idle_connections=16, stall_timeout_s=30.0)
    endpoint.set_keys([DataKey(kid="k1", key=worker_key(MASTER, WORKER))])
    await endpoint.start()
    idle: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []
    try:
        assert endpoint.deferred_s >= 10  # about the first-byte deadline
        for _ in range(50):
            idle.append(await asyncio.open_connection(endpoint.host, endpoint.port))
        data = b"abc" * 1000
        assert (await put(endpoint.url, _named(endpoint.url, "in", data), "in", data))[0] == 201
        assert (endpoint.connections, endpoint.idle.evicted) == (1, 0)
    finally:
        for _, writer in idle:
            writer.transport.abort()
        await endpoint.close()


async def test_idle_connections_share_one_read_buffer(tmp_path: Path) -> None:
    """200 accepted connections waiting for a request head cost the worker well under 64 KiB each (they had a
    64 KiB read buffer each: 1,200 idle sockets were 75 MiB of RSS)."""
    spool = Spool(tmp_path / "spool", memory_bytes=1024)
    endpoint = DataServer(spool, worker_id=WORKER, stall_timeout_s=30.0, defer_accept_s=0)
    await endpoint.start()
    idle: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for _ in range(200):
            idle.append(await asyncio.open_connection(endpoint.host, endpoint.port))
        await until(lambda: len(endpoint.idle) == 200, 10)
        grown = tracemalloc.get_traced_memory()[0] - before  # both ends of each connection: this process is both
        assert grown < 200 * 16 << 10, f"{grown / 200:.0f} bytes per idle connection"
    finally:
        tracemalloc.stop()
        for _, writer in idle:
            writer.transport.abort()
        await endpoint.close()


@contextlib.asynccontextmanager
async def refusing_endpoint(tmp_path: Path, **options: Any) -> AsyncIterator[DataServer]:
    """Worker w1's endpoint where plan p1 attempt 1 was cancelled (its put ticket: 410), with ``options``."""
    attempts = Attempts()
    attempts.ended("p1", 1, "was cancelled")
    endpoint = DataServer(Spool(tmp_path / "spool", memory_bytes=1024), worker_id=WORKER, attempts=attempts,
                          stall_timeout_s=30.0, **options)
    endpoint.set_keys([DataKey(kid="k1", key=worker_key(MASTER, WORKER))])
    await endpoint.start()
    try:
        yield endpoint
    finally:
        await endpoint.close()


async def test_refusals_repeated_by_one_host_are_held_while_its_live_uploads_are_served(tmp_path: Path) -> None:
    """Past the burst (3 here), a cancelled plan's PUT (its 1 MiB body right behind the head) is held, not
    answered; a live upload from the same host is served at once meanwhile."""
    body = bytes(MIB)
    async with refusing_endpoint(tmp_path, repeat_burst=3, refusal_hold_s=30.0) as endpoint:
        cancelled = grant(endpoint.url, "x", MIB, digest(body))
        for _ in range(3):
            status, _, text = await put(endpoint.url, cancelled, "x", body)
            assert status == 410 and "was cancelled" in text.decode()
        held = asyncio.ensure_future(blind_put(cancelled, "x", body))
        await until(lambda: endpoint.holding == 1, 10)
        data = b"abc"
        assert (await put(endpoint.url, abc_grant(endpoint.url, "live"), "x", data))[0] == 201
        assert (endpoint.holding, endpoint.held, endpoint.refused[410]) == (1, 0, 4)
        endpoint.refusal_hold_s = 0.0  # later holds end at once: the test needs not wait 30 s for this one
        held.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await held


async def test_held_refusals_answer_after_the_hold(tmp_path: Path) -> None:
    """A refusal past the burst gets its answer (410, naming why) once the hold is over (jittered: at least half)."""
    async with refusing_endpoint(tmp_path, repeat_burst=0, refusal_hold_s=0.4) as endpoint:
        cancelled = grant(endpoint.url, "x", 3, digest(b"abc"))
        started = time.monotonic()
        status, _, text = await put(endpoint.url, cancelled, "x", b"abc")
        assert status == 410 and "was cancelled" in text.decode()
        assert time.monotonic() - started >= 0.2 and endpoint.held == 1


async def test_refusals_held_together_are_answered_apart(tmp_path: Path) -> None:
    """20 refused PUTs held at once are answered spread over the jittered hold (0.5 to 1.5 times it), not in one
    lump: a loop's requests then come back apart too."""
    async with refusing_endpoint(tmp_path, repeat_burst=0, refusal_hold_s=0.4) as endpoint:
        cancelled = grant(endpoint.url, "x", 3, digest(b"abc"))
        answered: list[float] = []

        async def one() -> None:
            assert (await put(endpoint.url, cancelled, "x", b"abc"))[0] == 410
            answered.append(time.monotonic())

        await asyncio.gather(*(one() for _ in range(20)))
        assert endpoint.held == 20 and max(answered) - min(answered) > 0.1


async def test_a_request_that_is_not_http_is_counted_and_held_like_any_refusal(tmp_path: Path) -> None:
    """A head that is not HTTP/1.1 is a refusal like a bad ticket: counted (400) and, past the burst, held."""
    async with refusing_endpoint(tmp_path, repeat_burst=0, refusal_hold_s=0.4) as endpoint:
        reader, writer = await asyncio.open_connection(endpoint.host, endpoint.port)
        started = time.monotonic()
        writer.write(b"HELLO THERE\r\n\r\n")
        status, _ = await _answer(reader)
        writer.transport.abort()
        assert status == 400 and time.monotonic() - started >= 0.2
        assert (endpoint.refused[400], endpoint.held) == (1, 1)


async def test_refusals_held_at_once_are_capped_and_one_more_is_closed_unanswered(tmp_path: Path) -> None:
    """With max_held refusals held, one more is closed at once with no answer (a flood cannot hold the worker's
    fds and buffers without bound)."""
    async with refusing_endpoint(tmp_path, repeat_burst=0, refusal_hold_s=30.0, max_held=2) as endpoint:
        cancelled = grant(endpoint.url, "x", 3, digest(b"abc"))
        held = [asyncio.ensure_future(put(endpoint.url, cancelled, "x", b"abc")) for _ in range(2)]
        await until(lambda: endpoint.holding == 2, 10)
        with pytest.raises((asyncio.IncompleteReadError, ConnectionError)):
            await put(endpoint.url, cancelled, "x", b"abc")
        assert (endpoint.held_dropped, endpoint.holding) == (1, 2)
        for task in held:
            task.cancel()
        await asyncio.gather(*held, return_exceptions=True)


def test_the_open_file_limit_is_raised_to_the_hard_limit() -> None:
    """A soft limit below the hard one is raised to it (the worker does so at start, before listening)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard <= 256:
        pytest.skip("the hard open-file limit leaves no room to lower the soft one")
    resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))
    try:
        before, now = raise_fd_limit()
        assert before == 256 and now == resource.getrlimit(resource.RLIMIT_NOFILE)[0] > 256
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
