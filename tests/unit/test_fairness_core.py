"""Fairness under hostile and careless peers, the pure parts (issue 17: findings 7, 8, 10, 12, 13, and 9's cache).

The core with a fake clock: worker-id takeover needs proof, name caps, one answer for another
principal's plan. The helpers the driver uses, with a fake clock: the Host check under
--insecure, the refusal log's aggregation, the exposition cache, the pending-handshake budget.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from structlog.testing import capture_logs

from coordinator.io.frontdoor.admission import PendingHandshakes, RefusalLog, pending_budget
from coordinator.io.ops.metrics_http import ExpositionCache, metrics_token_refused, parse_listen
from coordinator.limits import host_refused
from protocol import caps, errors
from protocol.messages import (
    Accept,
    Accepted,
    Capabilities,
    Error,
    GetPlan,
    Heartbeat,
    Hello,
    Requirements,
    RoutingHints,
    RunningPlan,
    Submit,
    Welcome,
)
from tests.unit.test_core import Harness, only


@pytest.fixture
def h() -> Harness:
    return Harness()


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def hello(worker_id: str, secret: str = "", running: list[tuple[str, int]] | None = None) -> Hello:
    return Hello(worker_id=worker_id, capabilities=Capabilities(ops=["echo"]), session_secret=secret,
                 running=[RunningPlan(p, a) for p, a in running or []])


def open_worker(h: Harness, address: str, identity: str = "") -> int:
    conn = next(h._conns)  # the harness's own counter, shared with its other sessions
    h.core.open_session(conn, "worker", h.now, address=address, worker_ids="gpu-*", identity=identity)
    return conn


# ---------------------------------------------------------------- finding 8: worker impersonation


def test_an_impostor_inside_the_id_glob_is_refused_and_the_holder_keeps_its_session(h: Harness) -> None:
    """A second session saying hello gpu-1 without the secret gets worker_id_in_use + 4409; gpu-1 keeps its plans."""
    real = open_worker(h, "10.0.0.1:4000")
    h.send(real, hello("gpu-1"))
    secret = only(h.take(real), Welcome).session_secret
    assert secret
    c = h.client()
    plan_id = h.submit(c)
    h.send(real, Accept(plan_id=plan_id, attempt=1))
    h.take(real)
    h.now = 1.0
    impostor = open_worker(h, "10.6.6.6:5000")
    h.send(impostor, hello("gpu-1", running=[(plan_id, 1)]))
    refusal = only(h.take(impostor), Error)
    assert refusal.code == errors.WORKER_ID_IN_USE and "10.0.0.1:4000" in refusal.message
    assert (impostor, errors.CLOSE_REPLACED) in [(conn, code) for conn, code, _ in h.closes]
    assert real not in [conn for conn, _, _ in h.closes]  # the holder keeps its session
    record = h.core.registry.get("gpu-1")
    assert record.conn_id == real and record.leases == {plan_id} and record.address == "10.0.0.1:4000"
    assert h.core.counters["takeovers_refused"] == 1
    assert secret not in repr(h.closes) + refusal.message


def test_the_holder_itself_reconnects_with_its_secret_and_keeps_its_plans(h: Harness) -> None:
    """A reconnect that presents the welcome's secret takes the live id over (4409 to the old session)."""
    old = open_worker(h, "10.0.0.1:4000")
    h.send(old, hello("gpu-1"))
    secret = only(h.take(old), Welcome).session_secret
    plan_id = h.submit(h.client())
    h.send(old, Accept(plan_id=plan_id, attempt=1))
    h.now = 1.0
    new = open_worker(h, "10.0.0.1:4001")
    h.send(new, hello("gpu-1", secret, running=[(plan_id, 1)]))
    welcome = only(h.take(new), Welcome)
    assert welcome.continue_plans == [plan_id] and welcome.session_secret == secret
    assert (old, errors.CLOSE_REPLACED) in [(conn, code) for conn, code, _ in h.closes]
    assert h.core.registry.get("gpu-1").conn_id == new


def test_the_same_client_certificate_is_proof_too(h: Harness) -> None:
    """With mTLS, a session with the holder's certificate identity may take the id without the secret."""
    old = open_worker(h, "10.0.0.1:4000", identity="cert-a")
    h.send(old, hello("gpu-1"))
    other = open_worker(h, "10.0.0.2:4000", identity="cert-b")
    h.send(other, hello("gpu-1"))
    assert only(h.take(other), Error).code == errors.WORKER_ID_IN_USE
    same = open_worker(h, "10.0.0.1:4001", identity="cert-a")
    h.send(same, hello("gpu-1"))
    assert only(h.take(same), Welcome).worker_id == "gpu-1"


def test_a_restarted_worker_gets_its_id_back_once_the_old_session_closes_or_goes_silent(h: Harness) -> None:
    """No secret after a restart: refused while the holder beats, admitted after it misses two beats, or once
    the reconnect grace of its closed session is over."""
    old = open_worker(h, "10.0.0.1:4000")
    h.send(old, hello("gpu-1"))
    h.take(old)
    # The old connection is half-open: the coordinator still sees it, but it beats no more.
    h.now = 10.0
    restarted = open_worker(h, "10.0.0.1:4100")
    h.send(restarted, hello("gpu-1"))
    assert only(h.take(restarted), Error).code == errors.WORKER_ID_IN_USE
    h.now = 20.5  # two heartbeat intervals (10 s each) without a beat, before the 30 s reaper timeout
    again = open_worker(h, "10.0.0.1:4101")
    h.send(again, hello("gpu-1"))
    assert only(h.take(again), Welcome).worker_id == "gpu-1"
    assert (old, errors.CLOSE_REPLACED) in [(conn, code) for conn, code, _ in h.closes]
    # A crash the kernel reports (the TCP connection closes): the id is its holder's for the reconnect grace
    # (5 s), then free; the refusal says when to retry.
    h.close(again)
    h.now = 21.0
    early = open_worker(h, "10.0.0.1:4102")
    h.send(early, hello("gpu-1"))
    refusal = only(h.take(early), Error)
    assert refusal.code == errors.WORKER_ID_IN_USE and refusal.retry_after_s == pytest.approx(4.5)
    h.now = 25.6
    fresh = open_worker(h, "10.0.0.1:4103")
    h.send(fresh, hello("gpu-1"))
    assert only(h.take(fresh), Welcome).worker_id == "gpu-1"


def test_a_beating_holder_is_never_replaced_without_proof(h: Harness) -> None:
    """Two processes with one id do not fight: the newcomer is refused every time while the holder beats."""
    holder = open_worker(h, "10.0.0.1:4000")
    h.send(holder, hello("gpu-1"))
    for second in range(1, 60, 5):
        h.now = float(second)
        h.send(holder, Heartbeat())
        dup = open_worker(h, "10.0.0.9:4000")
        h.send(dup, hello("gpu-1"))
        assert only(h.take(dup), Error).code == errors.WORKER_ID_IN_USE
    assert h.core.registry.get("gpu-1").conn_id == holder


def test_without_proof_a_free_id_is_registered_but_its_leases_are_not_continued(h: Harness) -> None:
    """Past the holder's reconnect grace (before the reaper ran), a hello without the secret registers the id but
    abandons the old leases."""
    old = open_worker(h, "10.0.0.1:4000")
    h.send(old, hello("gpu-1"))
    plan_id = h.submit(h.client())
    h.send(old, Accept(plan_id=plan_id, attempt=1))
    h.close(old)
    h.now = 5.5
    other = open_worker(h, "10.6.6.6:5000")
    h.send(other, hello("gpu-1", running=[(plan_id, 1)]))
    welcome = only(h.take(other), Welcome)
    assert welcome.continue_plans == [] and welcome.abandon_plans == [plan_id]
    assert h.core.plans[plan_id].attempt == 2  # requeued: a new attempt, not handed to the newcomer


# ---------------------------------------------------------------- finding 12: name caps


@pytest.mark.parametrize(
    ("submit", "field", "cap"),
    [
        ({"op": "x" * 257}, "op", 256),
        ({"plan_id": "p" * 129}, "plan_id", 128),
        ({"requirements": Requirements(tags=["t" * 129])}, "requirements.tags[0]", 128),
        ({"requirements": Requirements(tags=[f"t{i}" for i in range(65)])}, "requirements.tags", 64),
        ({"hints": RoutingHints(session_key="k" * 257)}, "hints.session_key", 256),
        ({"op": "é" * 129}, "op", 256),  # bytes, not characters
    ],
)
def test_names_over_their_cap_are_refused_naming_the_field_and_the_cap(
    h: Harness, submit: dict[str, Any], field: str, cap: int
) -> None:
    """A submit with an over-long op, plan id, tag, tag list or session key is invalid_argument; nothing is kept."""
    c = h.client()
    h.send(c, Submit(req_id=1, **{"op": "echo", **submit}))
    error = only(h.take(c), Error)
    assert error.code == errors.INVALID_ARGUMENT and field in error.message and str(cap) in error.message
    assert not h.core.plans


def test_names_at_their_cap_are_accepted(h: Harness) -> None:
    """Exactly the cap is fine."""
    c = h.client()
    h.send(c, Submit(req_id=1, op="o" * caps.MAX_OP_BYTES, plan_id="p" * caps.MAX_PLAN_ID_BYTES,
                     requirements=Requirements(tags=["t" * 128] * 64), hints=RoutingHints(session_key="k" * 256)))
    assert "p" * 128 in h.core.plans


def test_an_over_long_worker_id_is_refused(h: Harness) -> None:
    """hello.worker_id over 128 bytes is invalid_argument and registers nothing."""
    conn = open_worker(h, "10.0.0.1:4000")
    h.core.sessions[conn].worker_ids = None
    h.send(conn, hello("w" * 129))
    error = only(h.take(conn), Error)
    assert error.code == errors.INVALID_ARGUMENT and "hello.worker_id" in error.message and "128" in error.message
    assert len(h.core.registry) == 0


# ---------------------------------------------------------------- finding 13: existence oracle


def test_another_principals_plan_id_answers_as_an_unused_one(h: Harness) -> None:
    """Looking up bob's id answers as an id nobody uses ('no plan with id'), never its content; submitting it is
    accepted as alice's own plan (issue #24 part 6: tests/unit/test_plan_ids.py has the frame-by-frame check)."""
    bob, alice = h.client("bob"), h.client("alice")
    h.send(bob, Submit(req_id=1, op="echo", plan_id="bobs-job", args={"secret": "s3"}))
    h.send(alice, GetPlan(req_id=3, plan_id="bobs-job"))
    on_lookup = only(h.take(alice), Error)
    h.send(alice, GetPlan(req_id=4, plan_id="nobodys"))
    assert only(h.take(alice), Error).message == "no plan with id 'nobodys'"
    assert on_lookup.message == "no plan with id 'bobs-job'" and on_lookup.code == "plan_not_found"
    h.send(alice, Submit(req_id=2, op="echo", plan_id="bobs-job"))
    assert only(h.take(alice), Accepted).plan_id == "bobs-job"
    assert h.core.plans["bobs-job"].args == {"secret": "s3"}


# ---------------------------------------------------------------- finding 7: Host under --insecure


@pytest.mark.parametrize("host", ["127.0.0.1:8765", "127.3.2.1", "localhost:8765", "LOCALHOST.", "[::1]:8765", "::1"])
def test_loopback_hosts_pass(host: str) -> None:
    """127.0.0.0/8, ::1 and localhost, with or without a port, are loopback names."""
    assert host_refused(host, ()) is None


@pytest.mark.parametrize("host", ["evil.example:8765", "10.0.0.5:8765", "127.0.0.1.evil.example", "", None])
def test_other_hosts_are_refused_unless_allowed(host: str | None) -> None:
    """A rebinding name, a LAN address or no Host is refused, naming --allowed-host."""
    refused = host_refused(host, ())
    assert refused is not None and "--allowed-host" in refused
    assert host_refused("dev.box:8765", ("dev.box",)) is None


# ---------------------------------------------------------------- finding 10: refusal logs


def test_refusals_from_one_address_are_logged_a_few_times_then_summed_up() -> None:
    """3,000 refusals from one host in a minute: 5 lines, then one summary line with the count and reason."""
    clock = FakeClock()
    refusals = RefusalLog(burst=5, interval_s=60.0, clock=clock)
    with capture_logs() as logs:
        for i in range(3000):
            clock.now = i * 0.01
            refusals.refused(f"10.0.0.5:{40000 + i}", "invalid token", path="/v1/client")
        refusals.refused("10.0.0.6:1", "missing token")  # another address is logged on its own
        clock.now = 61.0
        refusals.flush()
    lines = [e for e in logs if e["log_level"] == "warning"]
    single = [e for e in lines if e["event"] == "refused connection"]
    summaries = [e["event"] for e in lines if e["event"] != "refused connection"]
    assert len(single) == 6 and {e["address"].split(":")[0] for e in single} == {"10.0.0.5", "10.0.0.6"}
    assert summaries == ["refused 3,000 connections from 10.0.0.5 in the last 60 s (invalid token: 2,995; "
                         "the first 5 logged above)"]
    assert refusals.suppressed == 2995


def test_the_refusal_log_tracks_a_bounded_number_of_addresses() -> None:
    """Past max_addresses, new addresses share one entry: memory stays bounded under a spoofed flood."""
    clock = FakeClock()
    refusals = RefusalLog(burst=1, interval_s=60.0, max_addresses=100, clock=clock)
    with capture_logs() as logs:
        for i in range(10_000):
            refusals.refused(f"10.{i // 256 % 256}.{i % 256}.1:1", "invalid token")
    assert len(refusals._windows) <= 101  # the bound itself is what is tested
    assert len(logs) <= 101


# ---------------------------------------------------------------- finding 9: the exposition cache


def test_the_exposition_is_rebuilt_at_most_once_per_cache_period() -> None:
    """1,000 scrapes within 2 s render once; the next period renders again."""
    clock = FakeClock()
    cache = ExpositionCache(lambda: f"at {clock.now}".encode(), 2.0, clock=clock)
    for i in range(1000):
        clock.now = i * 0.001
        assert cache.get() == b"at 0.0"
    clock.now = 2.5
    assert cache.get() == b"at 2.5" and cache.builds == 2


def test_metrics_token_and_listen_address() -> None:
    """--metrics-token needs the exact bearer token; --metrics-listen needs HOST:PORT."""
    assert metrics_token_refused(None, None) is None
    assert metrics_token_refused("Bearer right-token-1234567", "right-token-1234567") is None
    assert metrics_token_refused("Bearer wrong", "right-token-1234567") is not None
    assert metrics_token_refused(None, "right-token-1234567") is not None
    assert parse_listen("127.0.0.1:9464") == ("127.0.0.1", 9464) and parse_listen("[::1]:0") == ("::1", 0)
    with pytest.raises(ValueError, match="HOST:PORT"):
        parse_listen("9464")


# ---------------------------------------------------------------- finding 6: the pending-handshake budget


class _Transport:
    def __init__(self) -> None:
        self.aborted = False

    def abort(self) -> None:
        self.aborted = True


class _Conn:
    def __init__(self, n: int) -> None:
        self.remote_address = ("10.0.0.9", n)
        self.transport = _Transport()


def test_past_the_budget_the_oldest_pending_handshake_is_dropped() -> None:
    """The budget holds; each newcomer evicts the oldest pending connection, and finished ones leave it."""
    budget = PendingHandshakes(3, RefusalLog(burst=1))
    conns = [_Conn(i) for i in range(5)]
    with capture_logs():
        for conn in conns:
            budget.opened(conn)  # type: ignore[arg-type]
    assert len(budget) == 3 and budget.evicted == 2
    assert [c.transport.aborted for c in conns] == [True, True, False, False, False]
    budget.finished(conns[4])  # type: ignore[arg-type]
    budget.finished(conns[4])  # type: ignore[arg-type]  # idempotent
    assert len(budget) == 2


class _Socket:
    """A transport: records what the protocol does with it."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.protocol: Any = None
        self.aborted = asyncio.Event()

    def get_extra_info(self, name: str) -> Any:
        return ("10.0.0.9", self.port) if name == "peername" else None

    def set_protocol(self, protocol: Any) -> None:
        self.protocol = protocol

    def abort(self) -> None:
        self.aborted.set()


class _Built:
    """Stands for websockets' ServerConnection: records that it was built and what it was given."""

    made: list[Any] = []

    def __init__(self, protocol: Any, server: Any, **kwargs: Any) -> None:
        self.ws_protocol, self.kwargs, self.data = protocol, kwargs, b""
        _Built.made.append(self)

    def connection_made(self, transport: Any) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.data += data


async def test_an_idle_socket_builds_no_websocket_connection_and_is_dropped_at_the_timeout() -> None:
    """Accepted sockets cost no websocket connection until their first byte; a silent one is aborted in time."""
    _Built.made.clear()
    budget = PendingHandshakes(8, RefusalLog(), timeout_s=0.05)
    create = budget.connection_class(_Built)  # type: ignore[arg-type]
    idle, talking = _Socket(1), _Socket(2)
    first, second = create("proto-1", "server", ping_interval=5), create("proto-2", "server", ping_interval=5)
    first.connection_made(idle)
    second.connection_made(talking)
    assert len(budget) == 2 and _Built.made == [] and first.protocol == "proto-1"
    second.data_received(b"GET /v1/client")
    [conn] = _Built.made
    assert talking.protocol is conn and conn.transport is talking and conn.data == b"GET /v1/client"
    assert conn.ws_protocol == "proto-2" and conn.kwargs == {"ping_interval": 5} and budget.built == 1
    assert len(budget) == 2  # still in its handshake: it counts until the handshake ends
    await asyncio.wait_for(idle.aborted.wait(), 5)  # the silent one: dropped at the timeout
    assert not talking.aborted.is_set()  # the talking one's timer was cancelled
    first.connection_lost(None)
    assert len(budget) == 1


def test_the_budget_fits_the_open_file_limit() -> None:
    """A quarter of the usable fds at most, never below 8."""
    assert pending_budget(1024, 1_048_576) == 1024
    assert pending_budget(1024, 1024) == 240
    assert pending_budget(1024, 80) == 8
