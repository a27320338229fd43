"""The OpenAI front door end to end in one process: the official ``openai`` client against a real
coordinator whose three worker agents front fake vLLM engines, over loopback (docs/OPENAI.md)."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from typing import Any

import httpx
import openai
import pytest

from coordinator.core import CoreConfig
from coordinator.io.frontdoor.server import CoordinatorServer, ServerSettings
from coordinator.placement.placer import PlacementConfig
from tests.integration.test_inference import fake_engine
from tests.waiting import until as wait_until
from worker_agent import Agent
from worker_agent.inference import InferenceEngine
from worker_agent.telemetry import Telemetry

pytestmark = pytest.mark.timeout(60)

WORKER_TOKEN = "worker-token-0123456789"
CLIENT_TOKEN = "client-token-0123456789"
MODEL = "m1"


@dataclass
class Fleet:
    server: CoordinatorServer
    engines: list[Any]
    agents: list[Agent]

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.server.port}/v1"

    def client(self, key: str = CLIENT_TOKEN) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=self.base_url, api_key=key, max_retries=0,
                                  http_client=httpx.AsyncClient(trust_env=False))  # fmt: skip


async def start_fleet(settings: ServerSettings, *, engines: int = 3, token_delay_s: float = 0.0) -> Fleet:
    server = CoordinatorServer(settings)
    await server.start()
    fakes = [fake_engine.FakeEngine(name=f"e{i}", model=MODEL, token_delay_s=token_delay_s).start()
             for i in range(engines)]  # fmt: skip
    agents = []
    for i, fake in enumerate(fakes):
        engine = InferenceEngine(fake.url, metrics_interval_s=60.0)
        agent = Agent(server.url, WORKER_TOKEN, worker_id=f"w{i}", telemetry=Telemetry(engine=engine))
        agent.add_handler("generate", engine.generate)
        agents.append(agent)
    fleet = Fleet(server, fakes, agents)
    fleet.tasks = [asyncio.create_task(a.run()) for a in agents]  # type: ignore[attr-defined]
    await wait_until(lambda: served(server) == engines, timeout_s=15)
    return fleet


def served(server: CoordinatorServer) -> int:
    """Workers the door counts as serving the model now."""
    assert server.openai is not None
    listing = server.openai.models.listing(time.monotonic())["data"]
    return int(listing[0]["fleetwire"]["workers"]) if listing else 0


async def stop_fleet(fleet: Fleet) -> None:
    for agent in fleet.agents:
        agent.stop()
    await asyncio.wait_for(asyncio.gather(*fleet.tasks), 10)  # type: ignore[attr-defined]
    await fleet.server.stop()
    for fake in fleet.engines:
        fake.stop()


SETTINGS = ServerSettings(port=0, worker_tokens=(WORKER_TOKEN,), client_tokens=(CLIENT_TOKEN,), store="memory",
                          core=CoreConfig(placement=PlacementConfig(policy="kv_aware")))  # fmt: skip


@pytest.fixture
async def fleet() -> AsyncIterator[Fleet]:
    """A coordinator (kv_aware placement) with three workers, each fronting its own fake engine serving m1."""
    running = await start_fleet(SETTINGS)
    try:
        yield running
    finally:
        await stop_fleet(running)


def engine_of(text: str) -> str:
    """Which fake engine answered: its answers end with ``[from eN]``."""
    return text.rsplit("[from ", 1)[1].rstrip("]")


async def test_openai_client_lists_models_completes_and_streams(fleet: Fleet) -> None:
    """The official client lists m1 (three workers), gets a chat completion and a completion, and streams both."""
    async with fleet.client() as client:
        models = await client.models.list()
        assert [m.id for m in models.data] == [MODEL]
        assert models.data[0].model_extra["fleetwire"] == {"workers": 3, "available": 3}
        raw = await client.chat.completions.with_raw_response.create(
            model=MODEL, messages=[{"role": "user", "content": "one two three"}])
        chat = raw.parse()
        plan_id = raw.headers["x-fleetwire-plan-id"]
        assert chat.id == f"chatcmpl-{plan_id}" and chat.choices[0].finish_reason == "stop"
        text = chat.choices[0].message.content or ""
        assert text.startswith("three two one [from e")
        assert chat.usage is not None and chat.usage.completion_tokens == 4 and chat.usage.prompt_tokens == 3
        assert chat.model_extra["fleetwire"]["plan_id"] == plan_id
        completion = await client.completions.create(model=MODEL, prompt="a b", max_tokens=1)
        assert completion.choices[0].text == "b" and completion.choices[0].finish_reason == "length"
        stream = await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "x y"}], stream=True,
            stream_options={"include_usage": True})
        chunks = [chunk async for chunk in stream]
        assert chunks[0].choices[0].delta.role == "assistant"
        streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert streamed.startswith("y x [from e")
        assert chunks[-1].choices == [] and chunks[-1].usage is not None and chunks[-1].usage.total_tokens == 5
        assert chunks[-1].model_extra["fleetwire"]["worker_id"].startswith("w")
        texts = [c.choices[0].text async for c in await client.completions.create(model=MODEL, prompt="p q",
                                                                                   stream=True)]  # fmt: skip
        assert "".join(texts).startswith("q p [from e")


async def test_refusals_are_what_openai_would_answer(fleet: Fleet) -> None:
    """A bad key is AuthenticationError (401), an unknown model NotFoundError (404), n=2 BadRequestError (400)."""
    async with fleet.client("wrong-key-0123456789") as bad:
        with pytest.raises(openai.AuthenticationError):
            await bad.models.list()
    async with fleet.client(WORKER_TOKEN) as worker:
        with pytest.raises(openai.PermissionDeniedError):
            await worker.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}])
    async with fleet.client() as client:
        with pytest.raises(openai.NotFoundError) as missing:
            await client.chat.completions.create(model="gpt-9", messages=[{"role": "user", "content": "x"}])
        assert missing.value.code == "model_not_found"
        with pytest.raises(openai.BadRequestError, match="n must be 1"):
            await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], n=2)


async def test_four_turn_conversation_stays_on_one_engine(fleet: Fleet) -> None:
    """Four turns of one chat (no session key: kv_aware on the door's prefix hashes) are all served by one engine."""
    messages: list[dict[str, str]] = [{"role": "system", "content": "You answer in reverse. " * 12}]
    served = []
    async with fleet.client() as client:
        for turn in range(4):
            messages.append({"role": "user", "content": f"turn {turn} " + "words to reverse " * 10})
            chat = await client.chat.completions.create(model=MODEL, messages=messages)  # type: ignore[arg-type]
            text = chat.choices[0].message.content or ""
            served.append(engine_of(text))
            messages.append({"role": "assistant", "content": text})
    assert len(set(served)) == 1, served


async def test_tools_pass_through_and_the_call_comes_back(fleet: Fleet) -> None:
    """tools reach the engine unchanged; its tool call comes back whole, and streamed in parts."""
    tools: Any = [{"type": "function", "function": {"name": "count", "parameters": {"type": "object"}}}]
    async with fleet.client() as client:
        chat = await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "a b c"}],
                                                    tools=tools)  # fmt: skip
        call = (chat.choices[0].message.tool_calls or [])[0]
        assert chat.choices[0].finish_reason == "tool_calls"
        assert call.function.name == "count" and json.loads(call.function.arguments) == {"words": 3}  # type: ignore[union-attr]
        stream = await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "a b"}],
                                                      tools=tools, stream=True)  # fmt: skip
        parts = [c.choices[0].delta.tool_calls for c in [c async for c in stream] if c.choices]
        arguments = "".join(p[0].function.arguments or "" for p in parts if p and p[0].function)
        assert json.loads(arguments) == {"words": 2}
    assert any(body.get("tools") == tools for engine in fleet.engines for body in engine.requests)


def test_sync_client_completes_and_streams() -> None:
    """The sync client (its own thread's loop) gets a completion and a stream from a coordinator on another loop."""
    loop = asyncio.new_event_loop()
    running = loop.run_until_complete(start_fleet(SETTINGS, engines=1))
    try:
        def use() -> tuple[str, str]:
            with openai.OpenAI(base_url=running.base_url, api_key=CLIENT_TOKEN, max_retries=0,
                               http_client=httpx.Client(trust_env=False)) as client:  # fmt: skip
                whole = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "u v"}])
                stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "w z"}],
                                                        stream=True)  # fmt: skip
                return whole.choices[0].message.content or "", "".join(c.choices[0].delta.content or "" for c in stream)
        whole, streamed = loop.run_until_complete(asyncio.to_thread(use))
        assert whole == "v u [from e0]" and streamed == "z w [from e0]"
    finally:
        loop.run_until_complete(stop_fleet(running))
        loop.close()


async def test_disconnect_mid_stream_cancels_the_plan(fleet: Fleet) -> None:
    """A client that goes away in the middle of a stream cancels its plan; the engine sees the disconnect."""
    for engine in fleet.engines:
        engine.token_delay_s = 0.05
    async with fleet.client() as client:
        async with client.chat.completions.with_streaming_response.create(
                model=MODEL, messages=[{"role": "user", "content": " ".join(["w"] * 200)}], stream=True) as response:
            plan_id = response.headers["x-fleetwire-plan-id"]
            async for _ in response.iter_lines():
                break
    core = fleet.server.core
    await wait_until(lambda: core.plans[plan_id].state == "cancelled", timeout_s=10)
    await wait_until(lambda: all(engine.running == 0 for engine in fleet.engines), timeout_s=10)


async def test_disconnect_while_queued_cancels_the_plan_at_once(fleet: Fleet) -> None:
    """A client that goes away while its plan waits for a worker cancels it then, not at the queue timeout."""
    for worker in fleet.server.core.registry:
        worker.draining = True  # nothing is placed: no token will ever be written to notice the disconnect
    core = fleet.server.core
    body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "x"}]}).encode()
    _, writer = await asyncio.open_connection("127.0.0.1", fleet.server.port)
    writer.write(post("/v1/chat/completions", body))
    await wait_until(lambda: any(p.state == "queued" for p in core.plans.values()), timeout_s=10)
    writer.close()
    await wait_until(lambda: all(p.state == "cancelled" for p in core.plans.values()), timeout_s=10)


async def test_queue_timeout_is_503_and_cancels(fleet: Fleet) -> None:
    """A request no worker takes within the queue timeout is 503 with Retry-After, and its plan is cancelled."""
    assert fleet.server.openai is not None
    fleet.server.openai.queue_timeout_s = 0.3
    for worker in fleet.server.core.registry:
        worker.draining = True  # alive, serving m1, taking nothing
    async with fleet.client() as client:
        with pytest.raises(openai.InternalServerError) as caught:
            await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}])
    assert caught.value.status_code == 503 and caught.value.response.headers["retry-after"] == "1"
    assert "within 0.3 s" in str(caught.value)
    plan_id = caught.value.response.headers["x-fleetwire-plan-id"]
    await wait_until(lambda: fleet.server.core.plans[plan_id].state == "cancelled", timeout_s=5)


async def raw_http(port: int, data: bytes, *, read_all: bool = True) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(data)
    await writer.drain()
    try:
        return await asyncio.wait_for(reader.read(-1) if read_all else reader.read(65536), 10)
    finally:
        writer.close()


def post(path: str, body: bytes, key: str = CLIENT_TOKEN, extra: str = "") -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {key}\r\nContent-Type: application/json"
            f"\r\nContent-Length: {len(body)}\r\nConnection: close\r\n{extra}\r\n").encode() + body


async def test_raw_hostile_requests_get_clear_errors_and_the_port_serves_on(fleet: Fleet) -> None:
    """Malformed JSON is 400 naming it, an oversize body 413 before it is read, a wrong method 405; then a
    well-formed request on the same port still works, websockets included."""
    port = fleet.server.port
    answer = await raw_http(port, post("/v1/chat/completions", b"{nope"))
    assert answer.startswith(b"HTTP/1.1 400 ") and b"not valid JSON" in answer
    huge = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {CLIENT_TOKEN}\r\n"
            f"Content-Length: {1 << 30}\r\n\r\n").encode()
    answer = await raw_http(port, huge)
    assert answer.startswith(b"HTTP/1.1 413 ") and b"at most" in answer
    answer = await raw_http(port, b"DELETE /v1/models HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    assert answer.startswith(b"HTTP/1.1 405 ")
    body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "k l"}], "frobnicate": 1}).encode()
    answer = await raw_http(port, post("/v1/chat/completions", body))
    assert answer.startswith(b"HTTP/1.1 200 ") and b"l k [from e" in answer
    assert any(b.get("frobnicate") == 1 for engine in fleet.engines for b in engine.requests)  # passed through
    answer = await raw_http(port, b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    assert answer.startswith(b"HTTP/1.1 200 ")  # not the door's: the websocket server's plain routes


async def test_pipelined_keep_alive_requests_are_answered_in_order(fleet: Fleet) -> None:
    """Two requests pipelined on one kept-alive connection are answered in order on it."""
    body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "first one"}]}).encode()
    body2 = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "second two"}]}).encode()
    one = post("/v1/chat/completions", body).replace(b"Connection: close\r\n", b"")
    two = post("/v1/chat/completions", body2)
    answer = await raw_http(fleet.server.port, one + two)
    assert answer.count(b"HTTP/1.1 200 ") == 2
    assert answer.index(b"one first") < answer.index(b"two second")


async def test_a_kept_alive_connection_closes_a_timeout_after_its_last_answer_not_its_first() -> None:
    """The idle timer counts from the last answer: a connection that sends each request within the timeout is
    served past the first answer's deadline, and closed once it has been idle for the timeout."""
    timeout_s = 1.5
    server = CoordinatorServer(replace(SETTINGS, limits=replace(SETTINGS.limits, handshake_timeout_s=timeout_s)))
    await server.start()
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        ask = f"GET /v1/models HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {CLIENT_TOKEN}\r\n\r\n".encode()

        async def models() -> float:
            writer.write(ask)
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
            assert head.startswith(b"HTTP/1.1 200 ")
            await reader.readexactly(int(head.split(b"Content-Length: ")[1].split(b"\r\n")[0]))
            return time.monotonic()

        first = await models()
        await asyncio.sleep(timeout_s * 0.7)  # time passing is what is tested: nothing to wait on
        await models()
        await asyncio.sleep(first + timeout_s * 1.3 - time.monotonic())  # past the first answer's deadline
        last = await models()  # still served
        assert await asyncio.wait_for(reader.read(), timeout_s * 5) == b""  # then closed, idle
        assert time.monotonic() - last >= timeout_s * 0.9
        writer.close()
    finally:
        await server.stop()


async def test_no_openai_leaves_the_routes_to_the_websocket_server() -> None:
    """--no-openai: the routes are not served (the port's plain 404)."""
    server = CoordinatorServer(replace(SETTINGS, openai=False))
    await server.start()
    try:
        assert server.openai is None
        answer = await raw_http(server.port, b"GET /v1/models HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        assert answer.startswith(b"HTTP/1.1 404 ")
    finally:
        await server.stop()



def test_door_serves_on_uvloop_as_the_cli_runs_it() -> None:
    """Under uvloop (the CLI's loop, whose transports are no asyncio.Transport subclass) the door answers too."""
    import uvloop

    async def scenario() -> bytes:
        server = CoordinatorServer(SETTINGS)
        await server.start()
        try:
            return await raw_http(server.port, b"GET /v1/models HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
                                               + CLIENT_TOKEN.encode() + b"\r\nConnection: close\r\n\r\n")  # fmt: skip
        finally:
            await server.stop()

    answer = uvloop.run(scenario())
    assert answer.startswith(b"HTTP/1.1 200 ") and b'"object":"list"' in answer


async def test_a_principal_over_its_request_rate_gets_429_with_retry_after() -> None:
    """--openai-rate 1 --openai-burst 1: the second request at once is RateLimitError (429, Retry-After 1);
    another principal is not held back by it."""
    other = "admin-token-0123456789"  # the principal "admin"
    server = CoordinatorServer(replace(SETTINGS, openai_rate=1.0, openai_burst=1, admin_tokens=(other,)))
    await server.start()
    try:
        base = f"http://127.0.0.1:{server.port}/v1"
        async with openai.AsyncOpenAI(base_url=base, api_key=CLIENT_TOKEN, max_retries=0,
                                      http_client=httpx.AsyncClient(trust_env=False)) as client:  # fmt: skip
            await client.models.list()
            with pytest.raises(openai.RateLimitError) as caught:
                await client.models.list()
        assert caught.value.response.headers["retry-after"] == "1" and caught.value.code == "rate_limit_exceeded"
        async with openai.AsyncOpenAI(base_url=base, api_key=other, max_retries=0,
                                      http_client=httpx.AsyncClient(trust_env=False)) as client:  # fmt: skip
            await client.models.list()
        assert server.openai is not None and server.openai.stats.rate_limited == 1
    finally:
        await server.stop()


async def test_metrics_count_answers_open_streams_and_the_first_byte(fleet: Fleet) -> None:
    """/metrics: a stream under way is an open stream and a request in flight; once answered, a 200 and one first
    byte in the histogram; a 404 counted by its status."""
    from coordinator.io.ops.metrics import render

    def scrape() -> str:
        return render(fleet.server.metrics_registry).decode()

    for engine in fleet.engines:
        engine.token_delay_s = 0.05
    async with fleet.client() as client:
        async with client.chat.completions.with_streaming_response.create(
                model=MODEL, messages=[{"role": "user", "content": "a b c d e f"}], stream=True) as response:
            lines = response.iter_lines()
            await anext(lines)
            assert "fleetwire_openai_streams_open 1.0" in scrape()
            assert "fleetwire_openai_requests_in_flight 1.0" in scrape()
            async for _ in lines:
                pass
        with pytest.raises(openai.NotFoundError):
            await client.chat.completions.create(model="gpt-9", messages=[{"role": "user", "content": "x"}])
    await wait_until(lambda: "fleetwire_openai_requests_in_flight 0.0" in scrape(), timeout_s=5)
    text = scrape()
    assert 'fleetwire_openai_requests_total{status="200"} 1.0' in text
    assert 'fleetwire_openai_requests_total{status="404"} 1.0' in text
    assert "fleetwire_openai_streams_open 0.0" in text and "fleetwire_openai_first_byte_seconds_count 1.0" in text
