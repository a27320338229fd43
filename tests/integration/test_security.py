"""Hostile peers against a real coordinator over loopback sockets: docs/OPERATIONS.md §Test matrix rows 13-22, and TLS.

Each test names its matrix row. Timing goals (others' p99, connect latency) live in
bench/fuzz_live.py and bench/; here the behaviour is asserted: who is refused, with which
status or close code, that the coordinator's state did not move, and that everyone else
is still served.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import os
import ssl
import zlib
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import msgspec
import psutil
import pytest
import trustme
from prometheus_client.parser import text_string_to_metric_families
from structlog.testing import capture_logs
from websockets.asyncio.client import connect
from websockets.asyncio.server import ServerConnection
from websockets.exceptions import ConnectionClosed, InvalidStatus

from coordinator.audit import snapshot
from coordinator.auth import hash_token
from coordinator.core import CoreConfig
from coordinator.io.frontdoor.server import CoordinatorServer, ServerSettings
from coordinator.limits import Limits
from fleetwire import Client
from fleetwire.errors import FleetwireConnectionError
from protocol import SUBPROTOCOL_MSGPACK, Codec, errors
from protocol.messages import (
    Capabilities,
    Done,
    Event,
    Heartbeat,
    Hello,
    ListWorkers,
    Submit,
    Subscribe,
    ToClient,
    ToWorker,
    Welcome,
    Workers,
)
from tests.integration.test_server import Peer
from worker_agent import Agent

pytestmark = pytest.mark.timeout(30)

# name -> (role, token, worker id glob)
TOKENS: dict[str, tuple[str, str, str | None]] = {
    "alice": ("client", "alice-token", None),
    "bob": ("client", "bob-token", None),
    "ops": ("admin", "ops-token", None),
    "fleet": ("worker", "fleet-token", None),
    "gpu": ("worker", "gpu-token", "gpu-*"),
}


def write_tokens(path: Path, names: list[str]) -> None:
    entries = []
    for name in names:
        role, token, glob = TOKENS[name]
        entry = f'[[token]]\nname = "{name}"\nrole = "{role}"\nhash = "{hash_token(token)}"\n'
        entries.append(entry + (f'worker_ids = "{glob}"\n' if glob else ""))
    path.write_text("\n".join(entries))


Start = Callable[..., Awaitable[CoordinatorServer]]


@pytest.fixture
async def start(tmp_path: Path) -> AsyncIterator[Start]:
    """Starts coordinators with a token file of every TOKENS entry (and the given settings); stops them all."""
    servers: list[CoordinatorServer] = []

    async def _start(limits: Limits | None = None, **settings: Any) -> CoordinatorServer:
        path = tmp_path / "tokens.toml"
        if not path.exists():
            write_tokens(path, list(TOKENS))
        srv = CoordinatorServer(ServerSettings(
            port=0, token_file=str(path), core=CoreConfig(heartbeat_interval_s=5.0, heartbeat_timeout_s=15.0),
            limits=limits or Limits(), **settings,
        ))
        await srv.start()
        servers.append(srv)
        return srv

    yield _start
    for srv in servers:
        await srv.stop()


async def peer(srv: CoordinatorServer, name: str, *, path: str | None = None, **kw: Any) -> Peer:
    role, token, _ = TOKENS[name]
    side = path or ("worker" if role == "worker" else "client")
    ws = await connect(f"{srv.url}/v1/{side}", additional_headers={"Authorization": f"Bearer {token}"},
                       subprotocols=[SUBPROTOCOL_MSGPACK], compression=None, **kw)  # type: ignore[list-item]
    return Peer(ws, Codec("msgpack", ToWorker if side == "worker" else ToClient, "coordinator"))


async def worker(srv: CoordinatorServer, worker_id: str, token: str = "fleet") -> Peer:
    p = await peer(srv, token)
    await p.send(Hello(worker_id=worker_id, capabilities=Capabilities(ops=["echo"], max_concurrency=4)))
    assert isinstance(await p.recv(), Welcome)
    return p


async def closed_with(p: Peer) -> int | None:
    """Read until the coordinator closes the session; its close code."""
    with contextlib.suppress(ConnectionClosed):
        while True:
            await asyncio.wait_for(p.ws.recv(), 10)
    return p.ws.close_code


def refusals_scraped(srv: CoordinatorServer) -> dict[str, int]:
    """``fleetwire_refusals_total`` by answer, as a /metrics scrape shows it."""
    body, _ = srv.metrics_exposition()
    return {
        s.labels["answer"]: int(s.value)
        for f in text_string_to_metric_families(body.decode())
        if f.name == "fleetwire_refusals"
        for s in f.samples
    }


async def still_served(srv: CoordinatorServer, name: str = "bob") -> None:
    """A fresh session of ``name`` is answered: the coordinator is up and serving."""
    p = await peer(srv, name)
    await p.send(ListWorkers(req_id=77))
    assert isinstance(await p.recv(), Workers)
    await p.ws.close()


def server_side(srv: CoordinatorServer, p: Peer) -> ServerConnection:
    """The coordinator's end of a peer's connection."""
    assert srv._server is not None
    local = p.ws.local_address[:2]
    return next(c for c in srv._server.connections if c.remote_address[:2] == local)


# ---------------------------------------------------------------- row 13: bad token


async def test_bad_or_missing_token_is_401_before_the_upgrade_and_never_logged(start: Start) -> None:
    """Row 13: no token, a wrong token or a token of the other role is refused before the upgrade; state unchanged."""
    srv = await start()
    await worker(srv, "w1")
    alice = await peer(srv, "alice")
    await alice.send(Submit(req_id=1, op="echo", plan_id="job"))
    await alice.recv_until(lambda m: isinstance(m, Event) and m.kind == "leased")
    before = snapshot(srv.core)
    attempts = [
        ("/v1/client", {}, 401),
        ("/v1/client", {"Authorization": "Bearer wrong-secret-123"}, 401),
        ("/v1/client", {"Authorization": "Basic alice-token"}, 401),
        ("/v1/worker", {"Authorization": "Bearer alice-token"}, 403),
        ("/v1/client", {"Authorization": "Bearer fleet-token"}, 403),
    ]
    with capture_logs() as logs:
        for path, headers, status in attempts:
            with pytest.raises(InvalidStatus) as info:
                await connect(srv.url + path, additional_headers=headers)
            assert info.value.response.status_code == status
    assert snapshot(srv.core) == before
    assert refusals_scraped(srv) == {"401": 3, "403": 2}
    refusals = [e for e in logs if e["event"] == "refused connection"]
    assert len(refusals) == len(attempts) and all(e["address"].startswith("127.0.0.1:") for e in refusals)
    assert {e.get("principal") for e in refusals} >= {"alice", "fleet"}  # the name, never the token
    text = repr(logs)
    assert "alice-token" not in text and "wrong-secret-123" not in text and "fleet-token" not in text


async def test_revoked_token_sessions_are_closed_4401_and_others_stay(start: Start, tmp_path: Path) -> None:
    """Row 13: after a reload without alice her session closes 4401 and she gets 401; everyone else stays."""
    srv = await start()
    w1 = await worker(srv, "w1")
    alice, bob = await peer(srv, "alice"), await peer(srv, "bob")
    write_tokens(tmp_path / "tokens.toml", ["bob", "fleet"])
    with capture_logs() as logs:
        assert srv.reload_tokens() == ["alice", "gpu", "ops"]
    assert await closed_with(alice) == errors.CLOSE_REVOKED
    assert "alice-token" not in repr(logs)
    with pytest.raises(InvalidStatus) as info:
        await peer(srv, "alice")
    assert info.value.response.status_code == 401
    await bob.send(Submit(req_id=1, op="echo"))  # bob and the worker kept their sessions
    assert (await w1.recv()).__class__.__name__ == "Assign"
    (tmp_path / "tokens.toml").write_text("not toml [")
    assert srv.reload_tokens() == []  # a broken file changes nothing
    await still_served(srv)


# ---------------------------------------------------------------- row 14: scope abuse


@pytest.mark.parametrize(("name", "msg"), [
    ("bob", Heartbeat()),
    ("bob", Hello(worker_id="w9", capabilities=Capabilities(ops=["echo"]))),
    ("bob", Done(plan_id="job", attempt=1, outcome="succeeded", result="forged")),
    ("fleet", Submit(req_id=1, op="echo")),
])
async def test_message_of_the_other_role_is_closed_4403_with_state_unchanged(start: Start, name: str, msg: Any) -> None:
    """Row 14: a client token sending worker frames (or the reverse) is closed 4403 and changes nothing."""
    srv = await start()
    await worker(srv, "w1")
    alice = await peer(srv, "alice")
    await alice.send(Submit(req_id=1, op="echo", plan_id="job"))
    await alice.recv_until(lambda m: isinstance(m, Event) and m.kind == "leased")
    before = snapshot(srv.core)
    abuser = await peer(srv, name)
    await abuser.ws.send(_encode(msg))
    assert await closed_with(abuser) == errors.CLOSE_FORBIDDEN
    assert snapshot(srv.core) == before
    await still_served(srv)


def _encode(msg: Any) -> bytes:
    return msgspec.msgpack.encode(msg)


async def test_worker_touching_another_workers_lease_is_closed_4403(start: Start) -> None:
    """Row 14: worker A finishing B's lease is closed 4403; B's plan, lease and stream are untouched."""
    srv = await start()
    b = await worker(srv, "b")
    alice = await peer(srv, "alice")
    await alice.send(Submit(req_id=1, op="echo", plan_id="job"))
    assign = await b.recv()
    a = await worker(srv, "a")
    plans_before, workers_before, queue_before, subs_before = snapshot(srv.core)
    await a.send(Done(plan_id="job", attempt=assign.attempt, outcome="succeeded", result="forged"))
    assert await closed_with(a) == errors.CLOSE_FORBIDDEN
    plans, workers, queue, subs = snapshot(srv.core)
    assert (plans, queue, subs) == (plans_before, queue_before, subs_before)
    assert dict(workers)["b"] == dict(workers_before)["b"]  # only A's own record saw its session end
    await b.send(Done(plan_id="job", attempt=assign.attempt, outcome="succeeded", result="real"))
    done = await alice.recv_until(lambda m: isinstance(m, Event) and m.kind == "succeeded")
    assert done[-1].data["result"] == "real"


async def test_worker_token_cannot_register_outside_its_glob(start: Start) -> None:
    """Row 14: a token limited to gpu-* is closed 4403 when it says hello as cpu-1; gpu-1 registers."""
    srv = await start()
    before = snapshot(srv.core)
    p = await peer(srv, "gpu")
    await p.send(Hello(worker_id="cpu-1", capabilities=Capabilities(ops=["echo"])))
    assert await closed_with(p) == errors.CLOSE_FORBIDDEN
    assert snapshot(srv.core) == before
    await worker(srv, "gpu-1", token="gpu")
    assert "gpu-1" in srv.core.registry


# ---------------------------------------------------------------- row 15: CSWSH


async def test_hostile_origin_is_403_and_own_or_allowed_origins_pass(start: Start) -> None:
    """Row 15: a browser from another origin is refused 403, even with a valid token; allowed origins connect."""
    srv = await start(Limits(allowed_origins=("https://dash.example.com",)))
    host = srv.url.removeprefix("ws://")
    for origin in ("https://evil.example", "null", f"http://{host.split(':')[0]}:1"):
        with pytest.raises(InvalidStatus) as info:
            await peer(srv, "alice", origin=origin)
        assert info.value.response.status_code == 403
    for origin in (f"http://{host}", "https://dash.example.com"):
        p = await peer(srv, "alice", origin=origin)
        await p.ws.close()


# ---------------------------------------------------------------- rows 16, 17: size, deflate bomb


async def test_oversize_frame_closes_1009_that_connection_only(start: Start) -> None:
    """Row 16: a 10 MiB frame closes its own connection with 1009; another client's session carries on."""
    srv = await start()
    alice, bob = await peer(srv, "alice"), await peer(srv, "bob")
    server_end = server_side(srv, alice)
    with capture_logs() as logs:
        # The coordinator stops reading at the frame header and closes, so the send itself may
        # fail with the 1009 (coordinator/io/frontdoor/connection.py); either way the close code is 1009.
        with contextlib.suppress(ConnectionClosed):
            await alice.ws.send(b"\x00" * (10 << 20))
        assert await closed_with(alice) == errors.CLOSE_TOO_BIG
        await asyncio.wait_for(server_end.wait_closed(), 5)
        await bob.send(ListWorkers(req_id=5))
        assert isinstance(await bob.recv(), Workers)
    assert len([e for e in logs if e["event"] == "refused: frame over the size limit"]) == 1
    assert refusals_scraped(srv) == {"1009": 1}


async def test_peer_closed_for_abuse_gets_429_at_reconnect_and_others_do_not(start: Start) -> None:
    """Row 16: after a 1009 that token from that address gets 429 + Retry-After (the SDK says so); others connect."""
    srv = await start(Limits(penalty_base_s=30.0, penalty_hold_s=0.05))
    alice = await peer(srv, "alice")
    with contextlib.suppress(ConnectionClosed):
        await alice.ws.send(b"\x00" * (2 << 20))
    assert await closed_with(alice) == errors.CLOSE_TOO_BIG
    with capture_logs() as logs:
        for _ in range(3):
            with pytest.raises(InvalidStatus) as refused:
                await peer(srv, "alice")
            assert refused.value.response.status_code == 429
            assert 29 <= int(refused.value.response.headers["Retry-After"]) <= 30
    assert len([e for e in logs if e.get("reason") == "penalty box"]) == 1  # once per cool-off, not per attempt
    with pytest.raises(FleetwireConnectionError, match=r"HTTP 429\): .*penalty box.*retry after") as sdk:
        await Client(srv.url, token="alice-token").connect()  # the SDK says why and how long to wait
    assert sdk.value.retry_after_s is not None and 29 <= sdk.value.retry_after_s <= 30
    await still_served(srv, "bob")
    with pytest.raises(InvalidStatus) as unknown:
        await connect(f"{srv.url}/v2/nowhere")
    assert unknown.value.response.status_code == 404
    assert refusals_scraped(srv) == {"1009": 1, "429": 4, "404": 1}
    body, _ = srv.metrics_exposition()
    scraped = {(s.name, tuple(s.labels.values())): s.value for f in text_string_to_metric_families(body.decode())
               for s in f.samples}
    assert scraped[("fleetwire_penalties_total", ("1009",))] == 1
    assert scraped[("fleetwire_penalty_boxed", ())] == 1


async def test_per_role_frame_limit(start: Start) -> None:
    """A smaller client frame limit applies to clients only; workers keep the larger one."""
    srv = await start(Limits(client_frame_bytes=4096))
    w = await worker(srv, "w1")
    await w.send(Heartbeat(), *[Heartbeat() for _ in range(2000)])  # ~2 KB per 1000: well under 1 MiB
    alice = await peer(srv, "alice")
    await alice.send(Submit(req_id=1, op="echo", args="x" * 8192))
    assert await closed_with(alice) == errors.CLOSE_TOO_BIG
    await w.send(Heartbeat())


async def test_deflate_bomb_finds_no_compression_to_inflate(start: Start) -> None:
    """Row 17: permessage-deflate is never negotiated; a compressed 100 MB bomb is refused without inflating it."""
    srv = await start()
    host, port = srv.url.removeprefix("ws://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    key = base64.b64encode(os.urandom(16)).decode()
    writer.write((
        f"GET /v1/client HTTP/1.1\r\nHost: {host}:{port}\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
        f"Sec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\nAuthorization: Bearer alice-token\r\n"
        "Sec-WebSocket-Extensions: permessage-deflate; client_max_window_bits\r\n\r\n"
    ).encode())
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
    assert head.startswith(b"HTTP/1.1 101") and b"sec-websocket-extensions" not in head.lower()
    deflate = zlib.compressobj(wbits=-15)
    chunk = bytes(1 << 20)
    bomb = b"".join(deflate.compress(chunk) for _ in range(100)) + deflate.flush(zlib.Z_SYNC_FLUSH)[:-4]
    rss_before = psutil.Process().memory_info().rss
    # FIN + RSV1 ("compressed") + binary, masked (with a zero key: the payload goes as is), 64-bit length.
    writer.write(bytes([0xC2, 0x80 | 127]) + len(bomb).to_bytes(8, "big") + bytes(4) + bomb)
    reply = await asyncio.wait_for(reader.read(), 5)  # the close frame, then EOF
    assert reply[0] == 0x88 and int.from_bytes(reply[2:4], "big") == 1002  # RSV1 without the extension
    assert psutil.Process().memory_info().rss - rss_before < 20 << 20
    writer.close()
    await writer.wait_closed()
    await still_served(srv)


# ---------------------------------------------------------------- row 19: slowloris


async def test_slowloris_handshakes_are_dropped_and_a_legit_client_still_connects(start: Start) -> None:
    """Row 19: unfinished handshakes are dropped at the handshake timeout; fds return to baseline; others connect."""
    srv = await start(Limits(handshake_timeout_s=0.5))
    host, port = srv.url.removeprefix("ws://").split(":")
    fds_before = len(os.listdir("/proc/self/fd"))
    loris = [await asyncio.open_connection(host, int(port)) for _ in range(100)]
    for _, writer in loris:
        writer.write(b"GET /v1/client HTTP/1.1\r\nHost: x\r\n")  # and never the rest
    await still_served(srv, "alice")  # while 100 handshakes hang
    for reader, _ in loris:
        assert await asyncio.wait_for(reader.read(), 5) == b""  # dropped by the coordinator
    for _, writer in loris:
        writer.close()
        await writer.wait_closed()
    assert len(os.listdir("/proc/self/fd")) <= fds_before


async def test_connection_limit_answers_503(start: Start) -> None:
    """Past max_connections a new session gets HTTP 503 before the upgrade; closing one makes room."""
    srv = await start(Limits(max_connections=2))
    first, second = await peer(srv, "alice"), await peer(srv, "bob")
    with pytest.raises(InvalidStatus) as info:
        await peer(srv, "alice")
    assert info.value.response.status_code == 503
    await first.ws.close()
    await closed_with(first)
    await still_served(srv)
    await second.ws.close()


# ---------------------------------------------------------------- row 20: flood


async def test_worker_waits_out_the_penalty_box_then_registers(start: Start) -> None:
    """A worker refused 429 logs the Retry-After, waits at least that long and registers after the cool-off."""
    srv = await start(Limits(penalty_base_s=0.5, penalty_hold_s=0.0))
    hostile = await peer(srv, "fleet")  # a host sharing the fleet token, from this address
    with contextlib.suppress(ConnectionClosed):
        await hostile.ws.send(b"\x00" * (2 << 20))
    assert await closed_with(hostile) == errors.CLOSE_TOO_BIG
    agent = Agent(srv.url, "fleet-token", worker_id="patient-1", reconnect_base_s=0.01, reconnect_cap_s=0.02)
    with capture_logs() as logs:
        await _agent_registers(agent)
    refused = [e for e in logs if e["event"] == "coordinator refused the connection"]
    assert refused and refused[0]["status"] == 429 and refused[0]["retry_after_s"] >= 1
    assert len(refused) == 1 == refusals_scraped(srv)["429"]  # backoff floor = Retry-After: no retry storm


async def test_flood_is_throttled_then_closed_4429_while_others_are_served(start: Start) -> None:
    """Row 20: a client far above its rate is throttled, then closed 4429 (its reconnect 429); others are served."""
    srv = await start(Limits(client_rate=200.0, client_burst=50, flood_grace_s=0.3, penalty_base_s=30.0,
                             penalty_hold_s=0.01))
    flooder = await peer(srv, "alice")
    answers = 0

    async def read() -> None:
        nonlocal answers
        with contextlib.suppress(ConnectionClosed):
            while True:
                flooder.codec.decode(await flooder.ws.recv())
                answers += 1

    async def flood() -> None:
        frame = _encode(ListWorkers(req_id=1))
        with contextlib.suppress(ConnectionClosed):
            while True:
                await flooder.ws.send(frame)

    reader, sender = asyncio.create_task(read()), asyncio.create_task(flood())
    await still_served(srv)  # served during the flood
    await asyncio.wait_for(reader, 10)
    sender.cancel()
    assert flooder.ws.close_code == errors.CLOSE_RATE_LIMITED
    assert answers >= 50  # its burst was answered before the throttle, not refused outright
    await still_served(srv)
    with pytest.raises(InvalidStatus) as refused:  # penalty box
        await peer(srv, "alice")
    assert refused.value.response.status_code == 429


# ---------------------------------------------------------------- row 21: slow consumer


@pytest.mark.parametrize(("limits", "cap"), [
    (Limits(max_pending_messages=100, close_timeout_s=0.3), 100),
    (Limits(max_pending_bytes=2 << 20, close_timeout_s=0.3), (2 << 20) // 32_768),  # 32 KiB events
])
async def test_slow_consumer_is_closed_with_its_buffer_bounded(start: Start, limits: Limits, cap: int) -> None:
    """Row 21: a subscriber that stops reading is closed 4503, its buffer bounded (messages or bytes)."""
    srv = await start(limits)
    w = await worker(srv, "w1")
    slow, bob = await peer(srv, "alice"), await peer(srv, "ops")  # ops (admin) follows alice's plan too
    await slow.send(Submit(req_id=1, op="echo", plan_id="stream"))
    assign = await w.recv()
    await bob.send(Subscribe(req_id=2, plan_ids=["stream"]))
    await bob.recv_until(lambda m: isinstance(m, Event) and m.kind == "leased")
    server_end = server_side(srv, slow)
    slow.ws.transport.pause_reading()  # it stops reading; the kernel buffers fill, then the coordinator's
    high_water = 0
    deliver = srv.driver.deliver

    def watch(effects: Any) -> None:
        nonlocal high_water
        deliver(effects)
        high_water = max([high_water, *(len(s.pending) for s in srv.door.sessions.values() if s.ws is server_end)])

    srv.driver.deliver = watch  # type: ignore[method-assign]
    blob = "x" * 32_768
    sent = 0
    while server_end.close_code is None and sent < 3_000:
        await w.send(*[Event(plan_id="stream", attempt=assign.attempt, kind="log", data=blob) for _ in range(10)])
        sent += 10
        last_seq = sent + 2  # seq 1 and 2 are queued and leased
        events = await bob.recv_until(lambda m, last=last_seq: isinstance(m, Event) and m.seq >= last)
        assert [e.seq for e in events if e.kind == "log"] == list(range(last_seq - 9, last_seq + 1))
    await asyncio.wait_for(server_end.wait_closed(), 5)
    sent_close = server_end.protocol.close_sent  # None when even the close frame could not be written
    assert sent_close is None or sent_close.code == errors.CLOSE_SLOW_CONSUMER
    assert high_water <= cap + 10  # at most one delivery past the cap before the close
    assert sent > cap
    await w.send(Done(plan_id="stream", attempt=assign.attempt, outcome="succeeded"))
    await bob.recv_until(lambda m: isinstance(m, Event) and m.kind == "succeeded")
    slow.ws.transport.abort()  # a paused transport never reads the coordinator's FIN itself


# ---------------------------------------------------------------- row 22: half-open TCP


async def test_half_open_peer_is_closed_by_the_ping_timeout(start: Start) -> None:
    """Row 22: a peer that vanishes without FIN (no pongs) is closed 1011 by the ping timeout; no task leaks."""
    srv = await start(Limits(ping_interval_s=0.2, ping_timeout_s=0.2, close_timeout_s=0.2))
    tasks_before = asyncio.all_tasks()
    ghost = await peer(srv, "alice", ping_interval=None)
    server_end = server_side(srv, ghost)
    ghost.ws.transport.pause_reading()  # from the coordinator's side: silence, no FIN
    await asyncio.wait_for(server_end.wait_closed(), 10)
    assert server_end.protocol.close_sent is not None
    assert server_end.protocol.close_sent.code == errors.CLOSE_INTERNAL  # "keepalive ping timeout"
    ghost.ws.transport.abort()
    await asyncio.wait_for(ghost.ws.wait_closed(), 5)
    its_tasks = asyncio.all_tasks() - tasks_before - {asyncio.current_task()}
    if its_tasks:  # the session's reader, writer and keepalive end once the close is through
        _, pending = await asyncio.wait(its_tasks, timeout=5)
        assert not pending
    assert not any(s.ws is server_end for s in srv.door.sessions.values())
    await still_served(srv)


# ---------------------------------------------------------------- TLS


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """A CA made for the test, a server certificate for 127.0.0.1, a worker client certificate, and a foreign CA."""
    tmp = tmp_path_factory.mktemp("pki")
    ca, other = trustme.CA(), trustme.CA()
    files = {"ca": tmp / "ca.pem", "other_ca": tmp / "other.pem", "server": tmp / "server.pem",
             "worker": tmp / "worker.pem"}
    ca.cert_pem.write_to_path(str(files["ca"]))
    other.cert_pem.write_to_path(str(files["other_ca"]))
    ca.issue_cert("127.0.0.1", "localhost").private_key_and_cert_chain_pem.write_to_path(str(files["server"]))
    ca.issue_cert("worker-1").private_key_and_cert_chain_pem.write_to_path(str(files["worker"]))
    return {k: str(v) for k, v in files.items()}


async def _agent_registers(agent: Agent) -> None:
    task = asyncio.create_task(agent.run())
    try:
        await asyncio.wait_for(agent.registered.wait(), 10)
    finally:
        agent.stop()
        await asyncio.wait_for(task, 10)


async def test_wss_serves_sdk_and_worker_that_trust_the_ca(start: Start, pki: dict[str, str]) -> None:
    """TLS: the coordinator serves wss://; the SDK and the worker agent connect with a CA file; other CAs fail."""
    srv = await start(tls_cert=pki["server"], tls_key=pki["server"])
    assert srv.url.startswith("wss://")
    await _agent_registers(Agent(srv.url, "fleet-token", worker_id="tls-1", ca_file=pki["ca"]))
    assert srv.core.counters["workers_left"] == 1  # tls-1 registered over wss://, then left with goodbye
    async with Client(srv.url, token="alice-token", ca_file=pki["ca"]) as client:
        reply = await client.workers()
        assert reply.workers == []  # a worker that said goodbye is removed at once
    with pytest.raises(FleetwireConnectionError):
        await Client(srv.url, token="alice-token", ca_file=pki["other_ca"]).connect()
    with pytest.raises(FleetwireConnectionError):
        await Client(srv.url.replace("wss://", "ws://"), token="alice-token").connect()  # plaintext to a TLS port


async def test_mtls_requires_a_client_certificate_from_workers_only(start: Start, pki: dict[str, str]) -> None:
    """mTLS: a worker without a client certificate is refused 403; with one it registers; clients need none."""
    srv = await start(tls_cert=pki["server"], tls_key=pki["server"], tls_client_ca=pki["ca"])
    bare = ssl.create_default_context(cafile=pki["ca"])
    with pytest.raises(InvalidStatus) as info:
        await connect(f"{srv.url}/v1/worker", ssl=bare, additional_headers={"Authorization": "Bearer fleet-token"})
    assert info.value.response.status_code == 403
    await _agent_registers(Agent(srv.url, "fleet-token", worker_id="m-1", ca_file=pki["ca"],
                                 cert_file=pki["worker"], key_file=pki["worker"]))
    assert srv.core.counters["workers_left"] == 1  # m-1 registered over mTLS, then left with goodbye
    async with Client(srv.url, token="alice-token", ca_file=pki["ca"]) as client:
        assert (await client.workers()).workers == []  # removed at once by its goodbye
