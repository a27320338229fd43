"""The client SDK against a scripted coordinator over real loopback websockets.

``FakeCoordinator`` plays the coordinator's client side of docs/SEMANTICS.md §Client
session: it authenticates, answers ``submit`` with ``accepted`` followed by the plan's
lifecycle events, and answers ``subscribe``, ``get_plan``, ``cancel`` and
``list_workers``. Plans run by a script keyed by ``op``; switches on the fake make it
hold replies, repeat events or drop the connection, so no test waits on a clock.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any

import msgspec
import pytest
from websockets.asyncio.server import Server, ServerConnection, serve
from websockets.datastructures import Headers
from websockets.exceptions import ConnectionClosed
from websockets.http11 import Request, Response

from fleetwire import (
    AuthError,
    Client,
    FleetwireConnectionError,
    InvalidArgument,
    PlanCancelled,
    PlanFailed,
    PlanNotFound,
    RequestError,
    SyncClient,
    options,
)
from fleetwire.client import resolve_url
from protocol import errors as codes
from protocol.codec import SUBPROTOCOL_JSON, SUBPROTOCOL_MSGPACK, SUBPROTOCOLS, Codec
from protocol.messages import (
    TERMINAL_STATES,
    Accepted,
    Cancel,
    Capabilities,
    Error,
    ErrorInfo,
    Event,
    FromClient,
    GetPlan,
    ListWorkers,
    Ok,
    PlanInfo,
    PlanReply,
    Submit,
    Subscribe,
    Subscribed,
    Unsubscribe,
    WorkerInfo,
    Workers,
    type_name,
)

CLIENT_TOKEN = "client-secret"
WORKER_TOKEN = "worker-secret"
WAIT_S = 5.0  # upper bound on any wait; tests finish long before it


# --------------------------------------------------------------------------- the fake


@dataclass
class FakePlan:
    id: str
    op: str
    state: str = "queued"
    attempt: int = 0
    worker_id: str | None = None
    result: Any = None
    error: ErrorInfo | None = None
    events: list[Event] = field(default_factory=list)

    def info(self) -> PlanInfo:
        return PlanInfo(
            id=self.id,
            op=self.op,
            state=self.state,  # type: ignore[arg-type]
            attempt=self.attempt,
            worker_id=self.worker_id,
            result=self.result,
            error=self.error,
            last_seq=len(self.events),
        )


@dataclass
class FakeSession:
    ws: ServerConnection
    codec: Codec
    subscriptions: set[str] = field(default_factory=set)
    out: list[Any] = field(default_factory=list)


class FakeCoordinator:
    """A scripted coordinator for clients: ``echo`` succeeds, ``fail`` fails, ``hang`` stays queued."""

    def __init__(self) -> None:
        self.plans: dict[str, FakePlan] = {}
        self.sessions: list[FakeSession] = []
        self.frames: list[list[str]] = []  # message types of every frame received, in order
        self.frame_is_text: list[bool] = []
        self.submits: list[Submit] = []
        self.subprotocols: list[str | None] = []
        self.repeat_events = False  # send every event twice (a replay overlap)
        self.hold_get_plan: set[str] = set()  # never answer get_plan for these ids
        self.reverse_get_plan_batch = 0  # hold this many get_plan replies, then answer in reverse
        self.on_list_workers: str | tuple[int, str] = "answer"  # "abort" or (close code, reason)
        self._held: list[tuple[FakeSession, GetPlan]] = []
        self._next_id = 0
        self._server: Server | None = None
        self.url = ""

    async def start(self) -> None:
        self._server = await serve(
            self._session,
            "127.0.0.1",
            0,
            subprotocols=[SUBPROTOCOL_MSGPACK, SUBPROTOCOL_JSON],  # type: ignore[list-item]
            process_request=self._authenticate,
            compression=None,
        )
        port = next(iter(self._server.sockets)).getsockname()[1]
        self.url = f"ws://127.0.0.1:{port}"

    async def stop(self) -> None:
        assert self._server is not None
        self._server.close()
        await self._server.wait_closed()

    def _authenticate(self, connection: ServerConnection, request: Request) -> Response | None:
        if request.path != "/v1/client":
            return connection.respond(HTTPStatus.NOT_FOUND, "no such endpoint\n")
        token = _bearer(request.headers)
        if token == WORKER_TOKEN:
            return connection.respond(HTTPStatus.FORBIDDEN, "worker token on /v1/client\n")
        if token != CLIENT_TOKEN:
            return connection.respond(HTTPStatus.UNAUTHORIZED, "missing or wrong token\n")
        return None

    async def _session(self, ws: ServerConnection) -> None:
        self.subprotocols.append(ws.subprotocol)
        codec = Codec(SUBPROTOCOLS.get(ws.subprotocol or "", "msgpack"), FromClient, role="client")
        session = FakeSession(ws, codec)
        self.sessions.append(session)
        try:
            async for frame in ws:
                self.frame_is_text.append(isinstance(frame, str))
                msgs = codec.decode(frame)
                self.frames.append([type_name(type(msg)) for msg in msgs])
                for msg in msgs:
                    if await self._handle(session, msg) == "stop":
                        return
                await self._flush()
        except ConnectionClosed:
            pass
        finally:
            self.sessions.remove(session)

    async def _flush(self) -> None:
        for session in self.sessions:
            if session.out:
                out, session.out = session.out, []
                with contextlib.suppress(ConnectionClosed):
                    await session.ws.send(session.codec.encode(out), text=session.codec.text)

    async def _handle(self, session: FakeSession, msg: Any) -> str | None:
        match msg:
            case Submit():
                self._submit(session, msg)
            case Subscribe():
                unknown = [plan_id for plan_id in msg.plan_ids if plan_id not in self.plans]
                if unknown:
                    self._error(session, msg.req_id, codes.PLAN_NOT_FOUND, f"no plan {unknown[0]!r}", unknown[0])
                    return None
                session.out.append(Subscribed(req_id=msg.req_id, plan_ids=msg.plan_ids))
                for plan_id in msg.plan_ids:
                    session.subscriptions.add(plan_id)
                    session.out.extend(e for e in self.plans[plan_id].events if e.seq > msg.from_seq)
            case GetPlan():
                if msg.plan_id in self.hold_get_plan:
                    return None
                if self.reverse_get_plan_batch:
                    self._held.append((session, msg))
                    if len(self._held) == self.reverse_get_plan_batch:
                        for held_session, held in reversed(self._held):
                            self._answer_get_plan(held_session, held)
                        self._held.clear()
                    return None
                self._answer_get_plan(session, msg)
            case Cancel():
                plan = self.plans.get(msg.plan_id)
                if plan is None:
                    self._error(session, msg.req_id, codes.PLAN_NOT_FOUND, f"no plan {msg.plan_id!r}", msg.plan_id)
                    return None
                if plan.state not in TERMINAL_STATES:
                    plan.state = "cancelled"
                    self._emit(plan, "cancelled", {"reason": "cancelled by client"})
                session.out.append(PlanReply(req_id=msg.req_id, plan=plan.info()))
            case ListWorkers():
                if self.on_list_workers == "abort":
                    session.ws.transport.abort()
                    return "stop"
                if isinstance(self.on_list_workers, tuple):
                    await session.ws.close(*self.on_list_workers)
                    return "stop"
                worker = WorkerInfo(
                    id="w1",
                    capabilities=Capabilities(cpu_cores=8, ram_bytes=16_000_000_000, ops=["echo"]),
                    connected=True,
                    alive=True,
                )
                session.out.append(
                    Workers(req_id=msg.req_id, workers=[worker], summary="1 workers (8 CPUs, 0 GPUs, 16.0 GB RAM)")
                )
            case Unsubscribe() if not msg.plan_ids and not msg.all:  # the probe first on every connection
                session.out.append(Ok(req_id=msg.req_id))  # (fleetwire/connection.py first_probe): changes nothing
            case Unsubscribe():
                raise AssertionError("the SDK does not unsubscribe")
            case _:
                self._error(session, getattr(msg, "req_id", 0), msg.code, msg.message)
        return None

    def _submit(self, session: FakeSession, msg: Submit) -> None:
        self.submits.append(msg)
        if not msg.op or msg.max_attempts < 1:
            self._error(session, msg.req_id, codes.INVALID_ARGUMENT, "max_attempts must be >= 1")
            return
        if msg.plan_id in self.plans:
            existing = self.plans[msg.plan_id]
            session.out.append(Accepted(req_id=msg.req_id, plan_id=existing.id, state=existing.state, duplicate=True))  # type: ignore[arg-type]
            return
        self._next_id += 1
        plan = FakePlan(id=msg.plan_id or f"plan-{self._next_id}", op=msg.op)
        self.plans[plan.id] = plan
        if msg.subscribe:
            session.subscriptions.add(plan.id)
        session.out.append(Accepted(req_id=msg.req_id, plan_id=plan.id, state="queued"))
        self._emit(plan, "queued", {})
        if msg.op == "hang":
            self._emit(plan, "waiting", {"reason": "no connected worker handles op 'hang'"})
            return
        plan.state, plan.attempt, plan.worker_id = "running", 1, "w1"
        self._emit(plan, "leased", {"worker_id": "w1", "attempt": 1})
        self._emit(plan, "running", {"worker_id": "w1", "attempt": 1})
        self._emit(plan, "log", {"line": "working"})
        if msg.op == "fail":
            plan.state = "failed"
            plan.error = ErrorInfo(code=codes.HANDLER_ERROR, message="boom", detail={"exc": "ValueError"})
            self._emit(plan, "failed", {**msgspec.structs.asdict(plan.error), "worker_id": "w1", "attempt": 1})
        else:
            plan.state, plan.result = "succeeded", msg.args
            self._emit(plan, "succeeded", {"result": msg.args, "worker_id": "w1", "attempt": 1})

    def _emit(self, plan: FakePlan, kind: str, data: Any) -> None:
        event = Event(plan_id=plan.id, kind=kind, data=data, seq=len(plan.events) + 1)
        plan.events.append(event)
        for session in self.sessions:
            if plan.id in session.subscriptions:
                session.out.extend([event, event] if self.repeat_events else [event])

    def _answer_get_plan(self, session: FakeSession, msg: GetPlan) -> None:
        plan = self.plans.get(msg.plan_id)
        if plan is None:
            self._error(session, msg.req_id, codes.PLAN_NOT_FOUND, f"no plan {msg.plan_id!r}", msg.plan_id)
        else:
            session.out.append(PlanReply(req_id=msg.req_id, plan=plan.info()))

    def _error(self, session: FakeSession, req_id: int, code: str, message: str, plan_id: str | None = None) -> None:
        session.out.append(Error(code=code, message=message, req_id=req_id, plan_id=plan_id))


def _bearer(headers: Headers) -> str | None:
    value = headers.get("Authorization", "")
    return value.removeprefix("Bearer ") if value.startswith("Bearer ") else None


@pytest.fixture
async def coordinator() -> AsyncIterator[FakeCoordinator]:
    fake = FakeCoordinator()
    await fake.start()
    yield fake
    await fake.stop()


@contextlib.contextmanager
def coordinator_in_thread() -> Iterator[FakeCoordinator]:
    """A ``FakeCoordinator`` on its own loop in a thread, for tests without a running loop."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    fake = FakeCoordinator()
    try:
        asyncio.run_coroutine_threadsafe(fake.start(), loop).result(WAIT_S)
        yield fake
        asyncio.run_coroutine_threadsafe(fake.stop(), loop).result(WAIT_S)
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(WAIT_S)
        loop.close()


async def collect(plan: Any) -> list[Event]:
    async with asyncio.timeout(WAIT_S):
        return [event async for event in plan.events()]


# --------------------------------------------------------------------------- tests


async def test_submit_streams_events_in_order_then_result(coordinator: FakeCoordinator) -> None:
    """submit returns a plan whose events arrive in seq order, end at the terminal one, and give the result."""
    async with Client(coordinator.url, token=CLIENT_TOKEN) as client:
        plan = await client.submit("echo", args={"x": 1}, tags=["cpu"], requirements={"tags": ["x86"]}, priority=5)
        events = await collect(plan)
        assert [e.kind for e in events] == ["queued", "leased", "running", "log", "succeeded"]
        assert [e.seq for e in events] == [1, 2, 3, 4, 5]
        assert await plan.result() == {"x": 1}
        assert (plan.state, plan.worker_id, plan.attempt, plan.done()) == ("succeeded", "w1", 1, True)
    sent = coordinator.submits[0]
    assert (sent.subscribe, sent.requirements.tags, sent.priority) == (True, ["x86", "cpu"], 5)
    assert coordinator.subprotocols == [SUBPROTOCOL_MSGPACK]


async def test_failed_plan_raises_plan_failed_with_code(coordinator: FakeCoordinator) -> None:
    """A plan that ends failed makes result() raise PlanFailed with the event's code, message and detail."""
    async with Client(coordinator.url, token=CLIENT_TOKEN) as client:
        plan = await client.submit("fail")
        with pytest.raises(PlanFailed) as caught:
            await plan.result()
    assert (caught.value.code, caught.value.message) == (codes.HANDLER_ERROR, "boom")
    assert (caught.value.detail, caught.value.plan_id, caught.value.worker_id) == ({"exc": "ValueError"}, plan.id, "w1")


async def test_cancel_ends_plan_with_plan_cancelled(coordinator: FakeCoordinator) -> None:
    """cancel() returns the cancelled PlanInfo; the stream ends with cancelled; result() raises PlanCancelled."""
    async with Client(coordinator.url, token=CLIENT_TOKEN) as client:
        plan = await client.submit("hang")
        info = await client.cancel(plan.id)
        assert (info.id, info.state) == (plan.id, "cancelled")
        with pytest.raises(PlanCancelled) as caught:
            await plan.result()
        assert caught.value.reason == "cancelled by client"
        assert [e.kind for e in await collect(plan)] == ["queued", "waiting", "cancelled"]


async def test_error_reply_raises_request_error_with_code(coordinator: FakeCoordinator) -> None:
    """An error reply raises the RequestError subclass for its code, and the session stays usable."""
    async with Client(coordinator.url, token=CLIENT_TOKEN) as client:
        with pytest.raises(PlanNotFound) as not_found:
            await client.get_plan("nope")
        assert isinstance(not_found.value, RequestError)
        assert (not_found.value.code, not_found.value.plan_id) == (codes.PLAN_NOT_FOUND, "nope")
        with pytest.raises(InvalidArgument) as invalid:
            await client.submit("echo", max_attempts=0)
        assert invalid.value.code == codes.INVALID_ARGUMENT
        with pytest.raises(PlanNotFound):
            await client.cancel("nope")
        assert (await client.workers()).summary == "1 workers (8 CPUs, 0 GPUs, 16.0 GB RAM)"


async def test_concurrent_requests_are_matched_by_req_id(coordinator: FakeCoordinator) -> None:
    """Replies answered in reverse order still reach the coroutine that sent each request."""
    async with Client(coordinator.url, token=CLIENT_TOKEN) as client:
        plans = [await client.submit("echo", args=i) for i in range(5)]
        coordinator.reverse_get_plan_batch = 5
        infos = await asyncio.gather(*(client.get_plan(plan.id) for plan in plans))
    assert [info.id for info in infos] == [plan.id for plan in plans]
    assert [info.result for info in infos] == [0, 1, 2, 3, 4]


async def test_requests_queued_together_go_out_as_one_frame(coordinator: FakeCoordinator) -> None:
    """Requests made while the writer is busy are coalesced into one frame (an array of messages)."""
    async with Client(coordinator.url, token=CLIENT_TOKEN) as client:
        plans = await asyncio.gather(*(client.submit("echo", args=i) for i in range(10)))
        assert [await plan.result() for plan in plans] == list(range(10))
    # The first frame on a connection is the first reply's probe (fleetwire/connection.py first_probe), alone.
    assert coordinator.frames[:2] == [["unsubscribe"], ["submit"] * 10]


async def test_events_arriving_before_events_call_are_kept(coordinator: FakeCoordinator) -> None:
    """Events received before events() is called are buffered; every iterator starts from the first."""
    async with Client(coordinator.url, token=CLIENT_TOKEN) as client:
        plan = await client.submit("echo", args="late")
        assert await plan.result() == "late"
        first, second = await collect(plan), await collect(plan)
    assert [e.seq for e in first] == [e.seq for e in second] == [1, 2, 3, 4, 5]


async def test_repeated_events_are_dropped_by_seq(coordinator: FakeCoordinator) -> None:
    """An event whose seq the plan already holds (a replay overlap) is not delivered twice."""
    coordinator.repeat_events = True
    async with Client(coordinator.url, token=CLIENT_TOKEN) as client:
        plan = await client.submit("echo")
        assert [e.seq for e in await collect(plan)] == [1, 2, 3, 4, 5]


async def test_watch_replays_events_after_from_seq(coordinator: FakeCoordinator) -> None:
    """watch() on another session replays events after from_seq and ends with the plan's outcome."""
    async with Client(coordinator.url, token=CLIENT_TOKEN) as submitter:
        plan_id = (await submitter.submit("echo", args="w")).id
    async with Client(coordinator.url, token=CLIENT_TOKEN) as watcher:
        watched = await watcher.watch(plan_id, from_seq=2)
        assert [e.seq for e in await collect(watched)] == [3, 4, 5]
        assert await watched.result() == "w"
        past_end = await watcher.watch(plan_id, from_seq=5)
        assert await collect(past_end) == []
        assert (past_end.state, await past_end.result()) == ("succeeded", "w")
        with pytest.raises(PlanNotFound):
            await watcher.watch("nope")


async def test_duplicate_submit_returns_the_existing_plan(coordinator: FakeCoordinator) -> None:
    """Submitting a known plan_id again yields the existing plan, marked duplicate, with its full stream."""
    async with Client(coordinator.url, token=CLIENT_TOKEN) as client:
        first = await client.submit("echo", args=1, plan_id="job-1")
        again = await client.submit("echo", args=2, plan_id="job-1")
        assert (first.duplicate, again.duplicate, again.id) == (False, True, "job-1")
        assert await again.result() == 1
        assert [e.seq for e in await collect(again)] == [1, 2, 3, 4, 5]
    assert len(coordinator.plans) == 1


@pytest.mark.parametrize("given", [None, ""])
async def test_a_duplicate_of_the_id_the_sdk_made_is_not_a_duplicate_to_the_caller(
    coordinator: FakeCoordinator, monkeypatch: pytest.MonkeyPatch, given: str | None
) -> None:
    """No plan id given (None or ""): the SDK's id coming back duplicate (its submit re-sent) is the caller's plan."""
    monkeypatch.setattr(options, "new_plan_id", lambda: "sdk-made")
    coordinator.plans["sdk-made"] = FakePlan(id="sdk-made", op="echo")  # as after a re-send the coordinator had
    async with Client(coordinator.url, token=CLIENT_TOKEN) as client:
        plan = await client.submit("echo", args=1, plan_id=given)
    assert (plan.id, plan.duplicate) == ("sdk-made", False)


async def test_json_encoding_round_trip(coordinator: FakeCoordinator) -> None:
    """encoding='json' negotiates fleetwire.v1.json and talks in text frames."""
    async with Client(coordinator.url, token=CLIENT_TOKEN, encoding="json") as client:
        plan = await client.submit("echo", args={"text": "héllo", "n": [1, 2]})
        assert await plan.result() == {"text": "héllo", "n": [1, 2]}
        assert (await client.get_plan(plan.id)).state == "succeeded"
    assert coordinator.subprotocols == [SUBPROTOCOL_JSON]
    assert coordinator.frame_is_text and all(coordinator.frame_is_text)


async def test_wrong_or_missing_token_raises_auth_error_401(
    coordinator: FakeCoordinator, monkeypatch: pytest.MonkeyPatch
) -> None:
    """HTTP 401 at the handshake raises AuthError, saying whether a token was sent at all."""
    monkeypatch.delenv("FLEETWIRE_TOKEN", raising=False)
    with pytest.raises(AuthError) as wrong:
        await Client(coordinator.url, token="guess").connect()
    assert (wrong.value.status, wrong.value.code) == (401, "unauthorized")
    assert "not one of its tokens" in str(wrong.value) and "guess" not in str(wrong.value)
    assert not isinstance(wrong.value, ConnectionError)
    with pytest.raises(AuthError, match="no token was sent"):
        await Client(coordinator.url).connect()


async def test_worker_token_raises_auth_error_403(coordinator: FakeCoordinator) -> None:
    """HTTP 403 at the handshake (a valid token of the wrong role) raises AuthError naming the role needed."""
    with pytest.raises(AuthError, match="client or admin token") as caught:
        await Client(coordinator.url, token=WORKER_TOKEN).connect()
    assert (caught.value.status, caught.value.code) == (403, "forbidden")


async def test_token_and_url_default_to_the_environment(
    coordinator: FakeCoordinator, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without arguments the client dials $FLEETWIRE_URL with $FLEETWIRE_TOKEN, appending /v1/client."""
    monkeypatch.setenv("FLEETWIRE_URL", coordinator.url)
    monkeypatch.setenv("FLEETWIRE_TOKEN", CLIENT_TOKEN)
    async with Client() as client:
        assert client.url == coordinator.url + "/v1/client"
        assert (await client.workers()).workers[0].id == "w1"


def test_resolve_url_appends_the_client_path_only_when_there_is_none() -> None:
    """ws://host:port gains /v1/client; a URL with a path is kept; http(s) means ws(s); other schemes are refused."""
    assert resolve_url("ws://h:1") == "ws://h:1/v1/client"
    assert resolve_url("wss://h:1/") == "wss://h:1/v1/client"
    assert resolve_url("ws://h:1/proxy/v1/client") == "ws://h:1/proxy/v1/client"
    assert resolve_url("http://h:1") == "ws://h:1/v1/client"
    with pytest.raises(ValueError, match="use ws:// \\(plain\\) or wss://"):
        resolve_url("gopher://h:1")


async def test_connection_drop_fails_pending_calls_and_plans(coordinator: FakeCoordinator) -> None:
    """Without reconnect, a dropped connection fails pending calls, unfinished plans and later calls."""
    coordinator.on_list_workers = "abort"
    async with Client(coordinator.url, token=CLIENT_TOKEN, reconnect=False) as client:
        plan = await client.submit("hang")
        coordinator.hold_get_plan.add(plan.id)
        held, dropped = await asyncio.gather(client.get_plan(plan.id), client.workers(), return_exceptions=True)
        assert isinstance(held, FleetwireConnectionError) and isinstance(dropped, FleetwireConnectionError)
        assert "lost the connection" in str(held)
        seen: list[str] = []
        with pytest.raises(FleetwireConnectionError):
            async for event in plan.events():
                seen.append(event.kind)
        assert seen == ["queued", "waiting"]
        with pytest.raises(FleetwireConnectionError):
            await plan.result()
        with pytest.raises(FleetwireConnectionError):
            await client.get_plan(plan.id)
        assert client.closed


async def test_close_code_from_the_coordinator_is_reported(coordinator: FakeCoordinator) -> None:
    """When the coordinator closes the session, pending calls fail with its close code and reason."""
    coordinator.on_list_workers = (codes.CLOSE_PROTOCOL, "too many protocol errors")
    async with Client(coordinator.url, token=CLIENT_TOKEN) as client:
        with pytest.raises(FleetwireConnectionError) as caught:
            await client.workers()
    assert (caught.value.close_code, caught.value.close_reason) == (4400, "too many protocol errors")
    assert "4400" in str(caught.value)


async def test_closing_the_client_fails_unfinished_plans(coordinator: FakeCoordinator) -> None:
    """After close(), an unfinished plan's result() raises FleetwireConnectionError saying the client closed."""
    async with Client(coordinator.url, token=CLIENT_TOKEN) as client:
        plan = await client.submit("hang")
    with pytest.raises(FleetwireConnectionError, match="client was closed"):
        await plan.result()


async def test_bad_requirements_fail_before_anything_is_sent(coordinator: FakeCoordinator) -> None:
    """Unknown requirement fields and unencodable args raise in the caller; nothing reaches the wire."""
    async with Client(coordinator.url, token=CLIENT_TOKEN) as client:
        with pytest.raises(ValueError, match="unknown requirements"):
            await client.submit("echo", requirements={"gpus": 2})
        with pytest.raises(TypeError):
            await client.submit("echo", args=object())
        assert await (await client.submit("echo", args="ok")).result() == "ok"
    assert [m.args for m in coordinator.submits] == ["ok"]


def test_sync_client_round_trip() -> None:
    """SyncClient submits, iterates events, gets results, cancels and lists workers without an event loop."""
    with coordinator_in_thread() as fake, SyncClient(fake.url, token=CLIENT_TOKEN) as client:
        plan = client.submit("echo", args=[1, 2])
        assert [e.kind for e in plan.events(timeout=WAIT_S)] == ["queued", "leased", "running", "log", "succeeded"]
        assert plan.result(timeout=WAIT_S) == [1, 2]
        assert client.get_plan(plan.id).state == "succeeded"
        with pytest.raises(PlanFailed, match="boom"):
            client.submit("fail").result(timeout=WAIT_S)
        hanging = client.submit("hang")
        assert hanging.cancel().state == "cancelled"
        with pytest.raises(PlanCancelled):
            hanging.result(timeout=WAIT_S)
        assert client.watch(plan.id, from_seq=4).result(timeout=WAIT_S) == [1, 2]
        assert client.workers().workers[0].id == "w1"


def test_sync_client_submit_passes_routing_and_retries() -> None:
    """SyncClient.submit sends hints, session_key, policy and retries exactly as Client.submit does."""
    with coordinator_in_thread() as fake, SyncClient(fake.url, token=CLIENT_TOKEN) as client:
        plan = client.submit(
            "echo", args="x", hints={"prompt_tokens": 7}, session_key="chat-1", policy="least_busy", retries=2
        )
        assert plan.result(timeout=WAIT_S) == "x"
        with pytest.raises(ValueError, match="unknown hints"):
            client.submit("echo", hints={"nope": 1})
    sent = fake.submits[-1]
    assert (sent.retries, sent.hints.session_key, sent.hints.policy, sent.hints.prompt_tokens) == (
        2, "chat-1", "least_busy", 7,
    )
    assert len(fake.submits) == 1  # the bad hints failed before anything was sent


def test_cli_submit_sends_session_policy_and_retries(capsys: pytest.CaptureFixture[str]) -> None:
    """`fleetwire submit --session K --policy P --retries N` puts them in the submit it sends."""
    from fleetwire.cli.main import _run, build_parser

    with coordinator_in_thread() as fake:
        argv = ["submit", "echo", "--args", '"hi"', "--session", "s-1", "--policy", "least_busy", "--retries", "3",
                "--url", fake.url, "--token", CLIENT_TOKEN, "--detach"]
        ns = build_parser().parse_args(argv)
        # ns.func, not main: main configures process-wide logging onto pytest's captured stdout.
        assert _run(ns.func(ns)) == 0
    sent = fake.submits[-1]
    assert (sent.args, sent.hints.session_key, sent.hints.policy, sent.retries) == ("hi", "s-1", "least_busy", 3)
    assert "submitted" in capsys.readouterr().out


async def test_coalesced_frames_stay_under_the_size_cap(coordinator: FakeCoordinator) -> None:
    """Many large requests queued at once go out in several frames, none over the coordinator's 1 MiB limit."""
    blob = "x" * 100_000
    async with Client(coordinator.url, token=CLIENT_TOKEN) as client:
        plans = await asyncio.gather(*(client.submit("echo", args=blob) for _ in range(20)))
        assert [await plan.result() for plan in plans] == [blob] * 20
    submit_frames = [frame for frame in coordinator.frames if "submit" in frame]
    assert 1 < len(submit_frames) < 20 and sum(map(len, submit_frames)) == 20
