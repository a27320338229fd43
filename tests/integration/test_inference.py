"""The OpenAI-compatible inference handler against a real SSE server on loopback (the example's fake engine)."""

from __future__ import annotations

import asyncio
import importlib.util
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from protocol import errors
from worker_agent.handlers import Context, HandlerError, run_handler
from worker_agent.inference import EngineLoad, InferenceEngine, parse_engine_metrics

pytestmark = pytest.mark.timeout(30)

_PATH = Path(__file__).resolve().parents[2] / "examples" / "inference_fleet" / "fake_engine.py"
_spec = importlib.util.spec_from_file_location("fake_engine", _PATH)
assert _spec is not None and _spec.loader is not None
fake_engine = importlib.util.module_from_spec(_spec)
sys.modules["fake_engine"] = fake_engine
_spec.loader.exec_module(fake_engine)


@pytest.fixture
def server() -> Iterator[Any]:
    """A fake vLLM-style engine serving on a free loopback port."""
    srv = fake_engine.FakeEngine(name="e1", model="m1", token_delay_s=0.0).start()
    yield srv
    srv.stop()


@pytest.fixture
async def engine(server: Any) -> AsyncIterator[InferenceEngine]:
    """The handler side, pointed at the fake engine."""
    eng = InferenceEngine(server.url)
    yield eng
    await eng.aclose()


def _context(events: list[tuple[str, Any, bool]], plan_id: str = "p1") -> Context:
    return Context(plan_id=plan_id, attempt=1, worker_id="w1", args=None,
                   sink=lambda kind, data, ephemeral: events.append((kind, data, ephemeral)))


async def test_chat_streams_tokens_as_ephemeral_events_and_returns_text_and_usage(engine: InferenceEngine,
                                                                                  server: Any) -> None:
    """A chat plan streams one ephemeral token event per SSE chunk and returns the text and the usage."""
    events: list[tuple[str, Any, bool]] = []
    ctx = _context(events)
    await engine.discover_models()
    result = await engine.generate(ctx, {"messages": [{"role": "user", "content": "one two three"}]})
    assert [data["text"] for kind, data, _ in events] == ["three", " two", " one", " [from e1]"]
    assert all(kind == "token" and ephemeral for kind, _, ephemeral in events)
    assert result["text"] == "three two one [from e1]"
    assert result["finish_reason"] == "stop"
    assert result["model"] == "m1"
    assert result["usage"] == {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}
    assert result["usage_estimated"] is False
    assert ctx.tokens == 4  # reported for energy per token
    body = server.requests[-1]
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True} and body["model"] == "m1"


async def test_tool_call_deltas_become_ephemeral_delta_events(engine: InferenceEngine, server: Any) -> None:
    """A chat delta's tool calls are emitted as ephemeral ``delta`` events as the engine sent them (no token events)."""
    events: list[tuple[str, Any, bool]] = []
    tools = [{"type": "function", "function": {"name": "count", "parameters": {"type": "object"}}}]
    args = {"messages": [{"role": "user", "content": "a b c"}], "tools": tools}
    result = await engine.generate(_context(events), args)
    assert [kind for kind, _, _ in events] == ["delta", "delta", "delta"]
    assert all(ephemeral for _, _, ephemeral in events)
    calls = [data["tool_calls"][0] for _, data, _ in events]
    assert calls[0]["id"] == "call_count" and calls[0]["function"]["name"] == "count"
    assert "".join(c["function"]["arguments"] for c in calls) == '{"words": 3}'
    assert result["finish_reason"] == "tool_calls" and result["text"] == ""
    assert server.requests[-1]["tools"] == tools  # passed through unchanged


async def test_completion_passes_fields_through_and_stops_at_max_tokens(engine: InferenceEngine, server: Any) -> None:
    """A completion plan uses /v1/completions with the plan's own fields; max_tokens ends it with 'length'."""
    events: list[tuple[str, Any, bool]] = []
    result = await engine.generate(_context(events), {"prompt": "a b c d", "max_tokens": 2, "temperature": 0.0})
    assert result["text"] == "d c"
    assert result["finish_reason"] == "length"
    assert result["usage"]["completion_tokens"] == 2
    assert server.requests[-1]["temperature"] == 0.0 and "messages" not in server.requests[-1]


async def test_without_usage_chunk_tokens_are_estimated(server: Any) -> None:
    """With include_usage off the engine sends no usage: completion tokens are counted from the chunks."""
    engine = InferenceEngine(server.url, include_usage=False)
    try:
        result = await engine.generate(_context([]), {"prompt": "x y"})
    finally:
        await engine.aclose()
    assert result["usage"]["completion_tokens"] == 3
    assert result["usage_estimated"] is True
    assert "stream_options" not in server.requests[-1]


async def test_engine_http_error_fails_the_plan_with_engine_error(engine: InferenceEngine) -> None:
    """An engine's HTTP error (unknown model) fails the plan with engine_error, its status and its message."""
    done = await run_handler(engine.generate, _context([]), {"prompt": "x", "model": "nope"}, timeout_s=None)
    assert done.outcome == "failed" and done.error is not None
    assert done.error.code == errors.ENGINE_ERROR
    assert "HTTP 404" in done.error.message and "does not exist" in done.error.message


async def test_unreachable_engine_fails_with_the_url_it_tried() -> None:
    """Nothing listening on the engine's port: the plan fails engine_error naming the URL."""
    server = fake_engine.FakeEngine()
    url = server.url
    server.stop()  # the port is now closed
    engine = InferenceEngine(url, connect_timeout_s=2.0)
    try:
        with pytest.raises(HandlerError) as info:
            await engine.generate(_context([]), {"prompt": "x"})
    finally:
        await engine.aclose()
    assert info.value.code == errors.ENGINE_ERROR and url in info.value.message


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        ("text", "map of OpenAI request fields"),
        ({}, "exactly one of 'messages'"),
        ({"prompt": "x", "messages": []}, "exactly one of 'messages'"),
        ({"prompt": "x", "n": 2}, "'n' must be 1"),
    ],
)
async def test_bad_arguments_fail_with_invalid_argument(engine: InferenceEngine, args: Any, fragment: str) -> None:
    """Arguments that are not one OpenAI chat or completion request fail invalid_argument, saying why."""
    with pytest.raises(HandlerError) as info:
        await engine.generate(_context([]), args)
    assert info.value.code == errors.INVALID_ARGUMENT and fragment in info.value.message


async def test_cancel_closes_the_stream_and_the_engine_sees_the_disconnect(server: Any) -> None:
    """Cancelling a generating plan closes its HTTP stream: the engine's running count falls back to 0."""
    server.token_delay_s = 0.05
    engine = InferenceEngine(server.url)
    events: list[tuple[str, Any, bool]] = []
    first_token = asyncio.Event()
    ctx = Context(plan_id="p", attempt=1, worker_id="w", args=None,
                  sink=lambda kind, data, eph: (events.append((kind, data, eph)), first_token.set()))
    task = asyncio.create_task(run_handler(engine.generate, ctx, {"prompt": " ".join(["w"] * 200)}, timeout_s=None))
    await asyncio.wait_for(first_token.wait(), 5)
    assert server.running == 1
    task.cancel()
    done = await task
    assert done.outcome == "cancelled"
    await engine.aclose()
    assert await asyncio.to_thread(server.wait_idle, 5.0)  # it noticed the closed socket on its next write
    assert len(events) < 200


async def test_metrics_scrape_reads_vllm_running_waiting_and_kv_usage(engine: InferenceEngine, server: Any) -> None:
    """The engine's /metrics is parsed into running, waiting and KV-cache usage for the load frames."""
    server.running = 3
    load = await engine.scrape_metrics()
    assert load is not None
    assert (load.running, load.waiting, load.kv_cache_usage) == (3, 0, pytest.approx(0.3))
    assert (load.kv_blocks_total, load.kv_block_tokens) == (2560, 16)  # vllm:cache_config_info
    assert engine.load == load
    server.running = 0


async def test_metrics_of_other_engines_and_labels_are_summed() -> None:
    """SGLang, TGI and llama.cpp names are understood; several label sets are summed, KV usage takes the max."""
    text = (
        "# TYPE sglang:num_running_reqs gauge\n"
        'sglang:num_running_reqs{model_name="a"} 2\nsglang:num_running_reqs{model_name="b"} 1\n'
        "# TYPE tgi_queue_size gauge\ntgi_queue_size 4\n"
        "# TYPE llamacpp:kv_cache_usage_ratio gauge\nllamacpp:kv_cache_usage_ratio 0.25\n"
        "# TYPE sglang:token_usage gauge\nsglang:token_usage 0.5\n"
        "# TYPE unrelated_total counter\nunrelated_total 9\n"
    )
    assert parse_engine_metrics(text) == EngineLoad(running=3, waiting=4, kv_cache_usage=0.5)


async def test_metrics_failure_keeps_the_last_load(server: Any) -> None:
    """A metrics URL that answers 404 is logged once and leaves the last known load in place."""
    engine = InferenceEngine(server.url, metrics_url=f"{server.url}/no-metrics-here")
    try:
        assert await engine.scrape_metrics() is None
        assert engine.load == EngineLoad()
    finally:
        await engine.aclose()


async def test_worker_fronting_an_engine_reports_its_load_models_energy_and_carbon(server: Any) -> None:
    """A real agent with --inference-url: op generate runs through the coordinator, and its heartbeats
    carry the engine's running requests, its model, the configured µJ/token and the zone's intensity."""
    from coordinator.io.frontdoor.server import CoordinatorServer, ServerSettings
    from fleetwire import Client
    from worker_agent import Agent
    from worker_agent.carbon import CarbonIntensity
    from worker_agent.energy import EnergyMeter
    from worker_agent.telemetry import Telemetry

    coordinator = CoordinatorServer(ServerSettings(port=0, insecure=True))
    await coordinator.start()
    server.running = 2  # as if two requests were in the engine's batch
    telemetry = Telemetry(meter=EnergyMeter(configured_uj_per_token=900.0), carbon=CarbonIntensity("FR"),
                          engine=InferenceEngine(server.url))
    agent = Agent(coordinator.url, None, worker_id="gpu-1", telemetry=telemetry)
    assert telemetry.engine is not None
    agent.add_handler("generate", telemetry.engine.generate)
    task = asyncio.create_task(agent.run())
    try:
        await asyncio.wait_for(agent.registered.wait(), 5)
        async with Client(coordinator.url) as client:
            row = (await client.workers()).workers[0]
            assert row.capabilities.models == ["m1"]
            assert row.capabilities.carbon_zone == "FR"
            assert (row.capabilities.kv_blocks, row.capabilities.kv_block_tokens) == (2560, 16)  # the engine's budget
            assert row.load is not None
            assert (row.load.engine_running, row.load.kv_cache_usage) == (2, pytest.approx(0.2))
            assert row.load.uj_per_token == 900.0 and row.load.zone_intensity_g_per_kwh == 56
            server.running = 0
            plan = await client.submit("generate", args={"messages": [{"role": "user", "content": "hi there"}]})
            tokens = [e.data["text"] async for e in plan.events() if e.kind == "token"]
            result = await plan.result()
        assert tokens == ["there", " hi", " [from e1]"] and result["text"] == "".join(tokens)
    finally:
        agent.stop()
        await asyncio.wait_for(task, 10)
        await coordinator.stop()


async def test_the_plans_trace_context_goes_to_the_engine(engine: InferenceEngine, server: Any) -> None:
    """ctx.traceparent is sent as the engine request's W3C traceparent header; none without one."""
    traced = _context([])
    traced.traceparent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    await engine.generate(traced, {"prompt": "a"})
    await engine.generate(_context([]), {"prompt": "b"})
    assert server.traceparents[-2:] == [traced.traceparent, ""]
