"""The worker agent's session over a real loopback websocket, against a scripted coordinator."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
from collections.abc import AsyncIterator, Iterator
from typing import Any, TypeVar

import pytest
import structlog
from websockets.asyncio.server import Server, ServerConnection, serve
from websockets.exceptions import ConnectionClosed
from websockets.http11 import Request, Response

import protocol
from protocol import ENCODING_SUBPROTOCOL, Codec, Encoding
from worker_agent import Agent, AuthError, Context
from worker_agent.main import add_worker_arguments, run_worker

pytestmark = pytest.mark.timeout(15)

M = TypeVar("M")


class FakeCoordinator:
    """Plays the coordinator: records what the agent sends; sends what the test scripts.

    Args:
        refuse: answer every handshake with this HTTP status instead of upgrading.
        encoding: the subprotocol it selects.
    """

    def __init__(self, *, refuse: int | None = None, encoding: Encoding = "msgpack") -> None:
        self.refuse = refuse
        self.encoding = encoding
        self.codec = Codec(encoding, protocol.messages.FromWorker, "worker")
        self.inbox: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()
        self.sessions: list[ServerConnection] = []
        self.requests: list[Request] = []
        self.url = ""
        self._server: Server | None = None

    async def start(self) -> None:
        self._server = await serve(
            self._session,
            "127.0.0.1",
            0,
            subprotocols=[ENCODING_SUBPROTOCOL[self.encoding]],  # type: ignore[list-item]
            process_request=self._process_request,
            compression=None,
        )
        port = next(iter(self._server.sockets)).getsockname()[1]
        self.url = f"ws://127.0.0.1:{port}"

    async def close(self) -> None:
        assert self._server is not None
        self._server.close()
        await self._server.wait_closed()

    def _process_request(self, connection: ServerConnection, request: Request) -> Response | None:
        self.requests.append(request)
        if self.refuse is not None:
            return connection.respond(self.refuse, "refused by the test\n")
        return None

    async def _session(self, ws: ServerConnection) -> None:
        index = len(self.sessions)
        self.sessions.append(ws)
        with contextlib.suppress(ConnectionClosed):
            async for frame in ws:
                for msg in self.codec.decode(frame):
                    self.inbox.put_nowait((index, msg))

    async def send(self, *msgs: Any) -> None:
        """Send one frame with ``msgs`` on the latest session."""
        await self.sessions[-1].send(self.codec.encode(list(msgs)), text=self.codec.text)

    async def expect(self, cls: type[M], *, session: int | None = None) -> M:
        """The next message other than a heartbeat; it must be a ``cls`` (from ``session``)."""
        async with asyncio.timeout(5):
            while True:
                index, msg = await self.inbox.get()
                if isinstance(msg, protocol.Heartbeat) and cls is not protocol.Heartbeat:
                    continue
                assert isinstance(msg, cls), f"expected {cls.__name__}, got {msg!r}"
                if session is not None:
                    assert index == session, f"{msg!r} came on session {index}, expected {session}"
                return msg

    async def register(self, agent: Agent, *, session: int = 0, **welcome: Any) -> protocol.Hello:
        """Take the agent's hello and welcome it."""
        hello = await self.expect(protocol.Hello, session=session)
        await self.send(
            protocol.Welcome(worker_id=hello.worker_id, heartbeat_interval_s=0.05, heartbeat_timeout_s=1.0, **welcome)
        )
        await asyncio.wait_for(agent.registered.wait(), 5)
        return hello


@pytest.fixture
async def coordinator() -> AsyncIterator[FakeCoordinator]:
    fake = FakeCoordinator()
    await fake.start()
    yield fake
    await fake.close()


def make_agent(url: str, **kwargs: Any) -> Agent:
    options: dict[str, Any] = {
        "worker_id": "w1",
        "reconnect_base_s": 0.01,
        "reconnect_cap_s": 0.05,
        "kill_grace_s": 0.5,
        "handshake_timeout_s": 5.0,
    }
    return Agent(url, "s3cret", **{**options, **kwargs})


@contextlib.asynccontextmanager
async def running(agent: Agent) -> AsyncIterator[asyncio.Task[None]]:
    task = asyncio.create_task(agent.run())
    try:
        yield task
    finally:
        agent.stop()
        agent.stop()  # skip the drain wait
        await asyncio.wait_for(task, 10)


class Gate:
    """A handler that reports start, waits for the test, and records being cancelled."""

    def __init__(self) -> None:
        self.open = asyncio.Event()
        self.finished = asyncio.Event()
        self.cancelled = asyncio.Event()

    async def __call__(self, ctx: Context, args: Any) -> str:
        ctx.emit("started")
        try:
            await self.open.wait()
        except asyncio.CancelledError:
            self.cancelled.set()
            raise
        ctx.emit("finished")
        self.finished.set()
        return "opened"


def assign(plan_id: str, op: str, args: Any = None, attempt: int = 1, **kw: Any) -> protocol.Assign:
    return protocol.Assign(plan_id=plan_id, attempt=attempt, op=op, args=args, **kw)


async def test_hello_welcome_heartbeat_assign_events_done(coordinator: FakeCoordinator) -> None:
    """hello → welcome → heartbeat, then assign → accept → events → one done with the result."""
    agent = make_agent(coordinator.url, tags=["blue"])
    async with running(agent):
        hello = await coordinator.register(agent)
        request = coordinator.requests[0]
        assert request.path == "/v1/worker?worker_id=w1"  # the id in the upgrade keys its reconnect budget's 429
        assert request.headers["Authorization"] == "Bearer s3cret"
        assert coordinator.sessions[0].subprotocol == "fleetwire.v1.msgpack"
        assert hello.worker_id == "w1" and hello.running == [] and hello.version
        assert hello.capabilities.ops == ["echo", "fleetwire.copy", "sleep"]
        assert hello.capabilities.tags == ["blue"] and hello.capabilities.max_concurrency == 4
        beat = await coordinator.expect(protocol.Heartbeat)
        assert beat.load.in_flight == 0

        await coordinator.send(assign("p1", "echo", {"n": 1}))
        assert await coordinator.expect(protocol.Accept) == protocol.Accept(plan_id="p1", attempt=1, seq=1)
        event = await coordinator.expect(protocol.Event)
        assert (event.plan_id, event.attempt, event.kind, event.data, event.ephemeral, event.seq) == (
            "p1",
            1,
            "echo",
            {"n": 1},
            False,
            2,
        )
        done = await coordinator.expect(protocol.Done)
        # No NVML, no power model, no tokens here: the receipt would say nothing, so none is sent.
        assert done == protocol.Done(plan_id="p1", attempt=1, outcome="succeeded", result={"n": 1}, seq=3)


async def test_unknown_op_is_rejected(coordinator: FakeCoordinator) -> None:
    """An assign for an op without a handler (shell not allowed) is rejected with unknown_op."""
    agent = make_agent(coordinator.url)
    async with running(agent):
        await coordinator.register(agent)
        await coordinator.send(assign("p1", "shell", {"cmd": "true"}))
        reject = await coordinator.expect(protocol.Reject)
        assert (reject.plan_id, reject.attempt, reject.code) == ("p1", 1, "unknown_op")
        assert "'shell'" in reject.reason


async def test_assign_beyond_max_concurrency_is_rejected(coordinator: FakeCoordinator) -> None:
    """With max_concurrency plans running, another assign is rejected (code rejected, reason says full)."""
    agent = make_agent(coordinator.url, max_concurrency=1)
    async with running(agent):
        await coordinator.register(agent)
        await coordinator.send(assign("p1", "sleep", {"seconds": 30}), assign("p2", "echo"))
        assert (await coordinator.expect(protocol.Accept)).plan_id == "p1"
        reject = await coordinator.expect(protocol.Reject)
        assert (reject.plan_id, reject.code) == ("p2", "rejected")
        assert "running 1 plans (max)" in reject.reason


async def test_cancel_ends_plan_with_done_cancelled(coordinator: FakeCoordinator) -> None:
    """cancel stops a running plan and the worker answers done(cancelled)."""
    agent = make_agent(coordinator.url)
    async with running(agent):
        await coordinator.register(agent)
        await coordinator.send(assign("p1", "sleep", {"seconds": 30}))
        await coordinator.expect(protocol.Accept)
        await coordinator.send(protocol.Cancel(plan_id="p1", attempt=1))
        done = await coordinator.expect(protocol.Done)
        assert (done.plan_id, done.outcome) == ("p1", "cancelled")


async def test_cancel_in_the_same_frame_as_assign(coordinator: FakeCoordinator) -> None:
    """A cancel right behind its assign (before the plan's first step) still yields one done."""
    agent = make_agent(coordinator.url)
    async with running(agent):
        await coordinator.register(agent)
        await coordinator.send(assign("p1", "sleep", {"seconds": 30}), protocol.Cancel(plan_id="p1", attempt=1))
        await coordinator.expect(protocol.Accept)
        done = await coordinator.expect(protocol.Done)
        assert (done.plan_id, done.outcome) == ("p1", "cancelled")
        await coordinator.send(assign("p2", "echo"))  # and nothing else was sent for p1
        assert (await coordinator.expect(protocol.Accept)).plan_id == "p2"


async def test_timeout_fails_the_plan(coordinator: FakeCoordinator) -> None:
    """assign.timeout_s passing fails the plan with code timeout."""
    agent = make_agent(coordinator.url)
    async with running(agent):
        await coordinator.register(agent)
        await coordinator.send(assign("p1", "sleep", {"seconds": 30}, timeout_s=0.1))
        await coordinator.expect(protocol.Accept)
        done = await coordinator.expect(protocol.Done)
        assert done.outcome == "failed" and done.error is not None and done.error.code == "timeout"


async def test_reconnect_lists_the_running_plan_in_hello(coordinator: FakeCoordinator) -> None:
    """After the coordinator drops the session, the agent reconnects and its hello lists the running plan."""
    agent = make_agent(coordinator.url)
    async with running(agent):
        await coordinator.register(agent)
        await coordinator.send(assign("p1", "sleep", {"seconds": 30}, attempt=2))
        accept = await coordinator.expect(protocol.Accept)
        await coordinator.sessions[0].close()
        hello = await coordinator.register(agent, session=1, continue_plans=["p1"])
        assert hello.running == [protocol.RunningPlan(plan_id="p1", attempt=2)]
        assert await coordinator.expect(protocol.Accept, session=1) == accept  # never acked: sent again
        await coordinator.send(protocol.Cancel(plan_id="p1", attempt=2))
        done = await coordinator.expect(protocol.Done, session=1)
        assert (done.plan_id, done.attempt, done.outcome) == ("p1", 2, "cancelled")


async def test_messages_from_while_disconnected_are_sent_after_welcome(coordinator: FakeCoordinator) -> None:
    """Events and done produced before re-registering are queued and sent after the next welcome."""
    agent = make_agent(coordinator.url)
    gate = Gate()
    agent.add_handler("gated", gate)
    async with running(agent):
        await coordinator.register(agent)
        await coordinator.send(assign("p1", "gated"))
        await coordinator.expect(protocol.Accept)
        assert (await coordinator.expect(protocol.Event)).kind == "started"
        await coordinator.sessions[0].close()
        hello = await coordinator.expect(protocol.Hello, session=1)
        assert hello.running == [protocol.RunningPlan(plan_id="p1", attempt=1)]
        gate.open.set()
        await asyncio.wait_for(gate.finished.wait(), 5)
        await coordinator.send(protocol.Welcome(worker_id="w1", heartbeat_interval_s=5, heartbeat_timeout_s=15))
        # The unacknowledged accept and first event come again first, then what was produced offline.
        assert (await coordinator.expect(protocol.Accept, session=1)).seq == 1
        assert (await coordinator.expect(protocol.Event, session=1)).kind == "started"
        assert (await coordinator.expect(protocol.Event, session=1)).kind == "finished"
        done = await coordinator.expect(protocol.Done, session=1)
        assert (done.plan_id, done.outcome, done.result, done.seq) == ("p1", "succeeded", "opened", 4)


async def test_acknowledged_messages_are_not_sent_again(coordinator: FakeCoordinator) -> None:
    """After ack(seq), a new session re-sends only the plan messages above seq."""
    agent = make_agent(coordinator.url)
    gate = Gate()
    agent.add_handler("gated", gate)
    async with running(agent):
        await coordinator.register(agent)
        await coordinator.send(assign("p1", "gated"))
        accept = await coordinator.expect(protocol.Accept)
        started = await coordinator.expect(protocol.Event)
        await coordinator.send(protocol.Ack(seq=accept.seq))
        await coordinator.send(assign("p2", "echo"))  # answered after the ack was read
        p2 = [await coordinator.expect(cls) for cls in (protocol.Accept, protocol.Event, protocol.Done)]
        await coordinator.sessions[0].close()
        await coordinator.register(agent, session=1, continue_plans=["p1"])
        resent = [await coordinator.expect(cls, session=1) for cls in (protocol.Event, *map(type, p2))]
        assert resent == [started, *p2]  # p1's accept (acked) is not sent again; everything after it is


async def test_abandoned_plan_is_cancelled_without_done(coordinator: FakeCoordinator) -> None:
    """A running plan listed in welcome.abandon_plans is cancelled locally and never reported."""
    agent = make_agent(coordinator.url)
    gate = Gate()
    agent.add_handler("gated", gate)
    async with running(agent):
        await coordinator.register(agent)
        await coordinator.send(assign("p1", "gated"))
        await coordinator.expect(protocol.Accept)
        await coordinator.expect(protocol.Event)
        await coordinator.sessions[0].close()
        await coordinator.register(agent, session=1, abandon_plans=["p1"])
        await asyncio.wait_for(gate.cancelled.wait(), 5)
        await coordinator.send(assign("p2", "echo"))
        assert (await coordinator.expect(protocol.Accept, session=1)).plan_id == "p2"  # no done for p1 before it


async def test_stale_lease_error_stops_the_plan_without_done(coordinator: FakeCoordinator) -> None:
    """error(stale_lease) for a plan cancels it locally and nothing more is sent for it."""
    agent = make_agent(coordinator.url)
    gate = Gate()
    agent.add_handler("gated", gate)
    async with running(agent):
        await coordinator.register(agent)
        await coordinator.send(assign("p1", "gated"))
        await coordinator.expect(protocol.Accept)
        await coordinator.expect(protocol.Event)
        await coordinator.send(protocol.Error(code="stale_lease", message="attempt 1 is not current", plan_id="p1"))
        await asyncio.wait_for(gate.cancelled.wait(), 5)
        await coordinator.send(assign("p2", "echo"))
        assert (await coordinator.expect(protocol.Accept)).plan_id == "p2"


async def test_drain_rejects_new_assigns(coordinator: FakeCoordinator) -> None:
    """After drain the worker rejects new plans (code rejected, reason says draining)."""
    agent = make_agent(coordinator.url)
    async with running(agent):
        await coordinator.register(agent)
        await coordinator.send(protocol.Drain(), assign("p1", "echo"))
        reject = await coordinator.expect(protocol.Reject)
        assert (reject.plan_id, reject.code) == ("p1", "rejected") and "draining" in reject.reason


async def test_stop_finishes_running_plans_then_says_goodbye(coordinator: FakeCoordinator) -> None:
    """stop() lets a running plan finish, sends its done, then goodbye, and run() returns."""
    agent = make_agent(coordinator.url)
    gate = Gate()
    agent.add_handler("gated", gate)
    task = asyncio.create_task(agent.run())
    await coordinator.register(agent)
    await coordinator.send(assign("p1", "gated"))
    await coordinator.expect(protocol.Accept)
    await coordinator.expect(protocol.Event)
    agent.stop()
    await coordinator.send(assign("p2", "echo"))
    assert "draining" in (await coordinator.expect(protocol.Reject)).reason
    gate.open.set()
    assert (await coordinator.expect(protocol.Event)).kind == "finished"
    assert (await coordinator.expect(protocol.Done)).outcome == "succeeded"
    await coordinator.expect(protocol.Goodbye)
    await asyncio.wait_for(task, 5)


async def test_json_session(coordinator: FakeCoordinator) -> None:
    """With encoding='json' the agent speaks fleetwire.v1.json in text frames."""
    fake = FakeCoordinator(encoding="json")
    await fake.start()
    try:
        agent = make_agent(fake.url, encoding="json")
        async with running(agent):
            await fake.register(agent)
            assert fake.sessions[0].subprotocol == "fleetwire.v1.json"
            await fake.send(assign("p1", "echo", {"k": "v"}))
            await fake.expect(protocol.Accept)
            await fake.expect(protocol.Event)
            assert (await fake.expect(protocol.Done)).result == {"k": "v"}
    finally:
        await fake.close()


async def test_result_above_the_frame_limit_fails_the_plan() -> None:
    """A JSON frame above max_frame_bytes is not sent: its event is dropped, its result fails the plan."""
    fake = FakeCoordinator(encoding="json")
    await fake.start()
    big = [100] * 4000  # about 4 KB in msgpack (within the payload limit), 16 KB in JSON

    async def bulky(ctx: Context, args: Any) -> list[int]:
        ctx.emit("bulk", big)
        ctx.emit("small", 1)
        return big

    try:
        agent = make_agent(fake.url, encoding="json", max_frame_bytes=8192)
        agent.add_handler("bulky", bulky)
        async with running(agent):
            await fake.register(agent)
            await fake.send(assign("p1", "bulky"))
            await fake.expect(protocol.Accept)
            assert (await fake.expect(protocol.Event)).kind == "small"
            done = await fake.expect(protocol.Done)
            assert done.outcome == "failed" and done.error is not None
            assert done.error.code == "handler_error" and "frame limit is 8192" in done.error.message
    finally:
        await fake.close()


@pytest.mark.parametrize("status", [401, 403])
async def test_refused_token_is_fatal(status: int) -> None:
    """HTTP 401/403 at the handshake ends run() with AuthError instead of retrying."""
    fake = FakeCoordinator(refuse=status)
    await fake.start()
    try:
        agent = make_agent(fake.url)
        with pytest.raises(AuthError) as info:
            await asyncio.wait_for(agent.run(), 5)
        assert info.value.status == status and str(status) in str(info.value)
        assert len(fake.requests) == 1
    finally:
        await fake.close()


@contextlib.contextmanager
def logged(event: str) -> Iterator[asyncio.Event]:
    """An asyncio.Event set when a log line with this event name is emitted (loggers bound inside)."""
    seen = asyncio.Event()

    def watch(logger: Any, method: str, event_dict: Any) -> Any:
        if event_dict.get("event") == event:
            seen.set()
        raise structlog.DropEvent

    config = structlog.get_config()
    structlog.configure(processors=[watch])
    try:
        yield seen
    finally:
        structlog.configure(**config)


@pytest.mark.parametrize("hang", [True, False])
async def test_stop_interrupts_dialing_and_backoff(hang: bool) -> None:
    """stop() ends run() at once whether it is stuck in a handshake or waiting to redial."""
    connected = asyncio.Event()
    peers: list[asyncio.StreamWriter] = []

    async def accept(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peers.append(writer)
        connected.set()
        if not hang:  # not a websocket server: the handshake fails and the agent backs off
            writer.close()

    server = await asyncio.start_server(accept, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    with logged("cannot reach coordinator") as failed:
        agent = make_agent(
            f"ws://127.0.0.1:{port}", reconnect_base_s=30.0, reconnect_cap_s=30.0, handshake_timeout_s=30.0
        )
        task = asyncio.create_task(agent.run())
        try:
            await asyncio.wait_for((connected if hang else failed).wait(), 5)
            agent.stop()
            await asyncio.wait_for(task, 5)
        finally:
            for peer in peers:
                peer.close()
            server.close()
            await server.wait_closed()
    assert failed.is_set() is not hang


def _worker_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_worker_arguments(parser)
    return parser.parse_args(argv)


async def test_run_worker_without_url_exits_2(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`fleetwire worker` with neither --url nor FLEETWIRE_URL says what to pass and returns 2."""
    monkeypatch.delenv("FLEETWIRE_URL", raising=False)
    assert await run_worker(_worker_args()) == 2
    assert "--url" in capsys.readouterr().err


async def test_run_worker_bad_handler_spec_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    """A bad --handler spec is reported before connecting, with status 2."""
    assert await run_worker(_worker_args("--url", "ws://127.0.0.1:1", "--handler", "nope")) == 2
    assert "bad handler spec 'nope'" in capsys.readouterr().err


async def test_run_worker_registers_and_stops_on_sigterm(
    coordinator: FakeCoordinator, capsys: pytest.CaptureFixture[str]
) -> None:
    """The CLI worker prints its registered line, advertises its flags, and SIGTERM stops it with 0."""
    ns = _worker_args(
        "--url", coordinator.url, "--token", "s3cret", "--id", "cli-1", "--tags", "a,b", "--tags", "c",
        "--allow-shell", "--python-allow", "math:*", "--handler", "dump=json:dumps", "--reconnect-base", "0.01",
    )  # fmt: skip
    task = asyncio.create_task(run_worker(ns))
    hello = await coordinator.expect(protocol.Hello)
    assert hello.worker_id == "cli-1" and hello.capabilities.tags == ["a", "b", "c"]
    assert hello.capabilities.ops == ["dump", "echo", "fleetwire.copy", "python", "shell", "sleep"]
    await coordinator.send(protocol.Welcome(worker_id="cli-1", heartbeat_interval_s=5, heartbeat_timeout_s=15))
    await coordinator.expect(protocol.Heartbeat)
    os.kill(os.getpid(), signal.SIGTERM)
    await coordinator.expect(protocol.Goodbye)
    assert await asyncio.wait_for(task, 5) == 0
    assert f"worker cli-1 registered with {coordinator.url}" in capsys.readouterr().out


def test_url_gets_the_worker_path() -> None:
    """ws://host:port gets /v1/worker; a path is kept; http(s) means ws(s); no scheme or another is refused."""
    assert Agent("ws://h:1").url == "ws://h:1/v1/worker"
    assert Agent("ws://h:1/").url == "ws://h:1/v1/worker"
    assert Agent("wss://h:1/custom/path").url == "wss://h:1/custom/path"
    assert Agent("http://h:1").url == "ws://h:1/v1/worker"
    assert Agent("https://h:1").url == "wss://h:1/v1/worker"
    with pytest.raises(ValueError, match="has no scheme: write ws://h:1"):
        Agent("h:1")
    with pytest.raises(ValueError, match="use ws:// \\(plain\\) or wss://"):
        Agent("ftp://h:1")


def test_handler_decorator_registers_ops() -> None:
    """@agent.handler, @agent.handler() and @agent.handler('name') all add an op."""
    agent = Agent("ws://h:1", allow_shell=True)

    @agent.handler
    async def first(ctx: Context, args: Any) -> None: ...

    @agent.handler()
    def second(ctx: Context, args: Any) -> None: ...

    @agent.handler("third-op")
    def third(ctx: Context, args: Any) -> None: ...

    assert agent.ops == ["echo", "first", "fleetwire.copy", "second", "shell", "sleep", "third-op"]
