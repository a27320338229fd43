"""One trace per plan across the client, the coordinator, the worker and the engine, into a real OTLP/HTTP receiver.

Real sockets in one process: a coordinator, a worker agent fronting the example's fake engine, and a
client, each with its own tracer (service names fleetwire-client, -coordinator, -worker), exporting
to tests/otlp_receiver.py. The caller's own span (service ``app``) is the plan's root.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import pytest
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor

import fleetwire.tracing
from coordinator.io.frontdoor.server import CoordinatorServer, ServerSettings
from coordinator.io.stores.store import MemoryStore
from fleetwire import Client
from tests.integration.test_inference import fake_engine
from tests.otlp_receiver import OtlpReceiver, ReceivedSpan
from wireio.tracing import SERVICE_WORKER, Tracing
from worker_agent import Agent
from worker_agent.handlers import Context, HandlerError
from worker_agent.inference import InferenceEngine

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def receiver(monkeypatch: pytest.MonkeyPatch) -> Iterator[OtlpReceiver]:
    """A receiver; the client's tracer (built on first use) exports to it."""
    with OtlpReceiver() as rx:
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", rx.endpoint)
        monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "50")  # ms between exports: the test waits less
        monkeypatch.delenv("OTEL_SERVICE_NAME", raising=False)
        monkeypatch.setattr(fleetwire.tracing, "_tracing", fleetwire.tracing._UNSET)
        yield rx
        client = fleetwire.tracing.client_tracing()
        if client is not None:
            client.shutdown()


@pytest.fixture
def app(receiver: OtlpReceiver) -> Iterator[Any]:
    """The application's own tracer (service ``app``), exporting each span as it ends."""
    provider = TracerProvider(resource=Resource.create({"service.name": "app"}))
    provider.add_span_processor(SimpleSpanProcessor(OTLPSpanExporter(endpoint=f"{receiver.endpoint}/v1/traces")))
    yield provider.get_tracer("app")
    provider.shutdown()


@dataclasses.dataclass
class Fleet:
    coordinator: CoordinatorServer
    agent: Agent
    engine: Any
    store: MemoryStore


@pytest.fixture
async def fleet(receiver: OtlpReceiver) -> AsyncIterator[Fleet]:
    """A traced coordinator (memory store) and a traced worker with op ``generate`` (the fake engine) and ``flaky``;
    both export through a child process, as the daemons do (wireio/span_export.py)."""
    engine = fake_engine.FakeEngine(name="e1", model="m1", token_delay_s=0.0).start()
    store = MemoryStore()
    coordinator = CoordinatorServer(ServerSettings(port=0, insecure=True, store="memory",
                                                   otlp_endpoint=receiver.endpoint), store=store)  # fmt: skip
    await coordinator.start()
    inference = InferenceEngine(engine.url)
    tracing = Tracing(SERVICE_WORKER, endpoint=receiver.endpoint, export_process=True)  # as the worker daemon's
    agent = Agent(coordinator.url, None, worker_id="w1", tracing=tracing, reconnect_base_s=0.02, reconnect_cap_s=0.2)
    agent.add_handler("generate", inference.generate)
    failed: set[str] = set()

    @agent.handler("flaky")
    async def flaky(ctx: Context, args: Any) -> str:
        if ctx.plan_id not in failed:
            failed.add(ctx.plan_id)
            raise HandlerError("handler_error", "first attempt fails")
        return "ok"

    task = asyncio.create_task(agent.run())
    await asyncio.wait_for(agent.registered.wait(), 10)
    fleet = Fleet(coordinator, agent, engine, store)
    try:
        yield fleet
    finally:
        agent.stop()
        await asyncio.wait_for(task, 10)
        await fleet.coordinator.stop()
        await inference.aclose()
        engine.stop()


def by_name(spans: list[ReceivedSpan], name: str) -> list[ReceivedSpan]:
    return [s for s in spans if s.name == name]


async def test_a_plan_submitted_in_a_client_span_is_one_trace_across_every_service(
    receiver: OtlpReceiver, app: Any, fleet: Fleet
) -> None:
    """Client, coordinator and worker spans share the caller's trace, each parented as the plan went; the engine
    got the handler span's context; the receipt and get_plan name the trace."""
    async with Client(fleet.coordinator.url) as client:
        with app.start_as_current_span("request") as root:
            plan = await client.submit("generate", args={"prompt": "a b"})
        await plan.result()
        info = await client.get_plan(plan.id)
    trace_id = f"{root.get_span_context().trace_id:032x}"
    assert info.trace_id == trace_id and info.receipt is not None and info.receipt.trace_id == trace_id
    await asyncio.to_thread(fleet.agent.runner.tracing.flush)  # type: ignore[union-attr]
    wanted = {"request", "fleetwire.submit", "fleetwire.queue", "fleetwire.store.commit", "fleetwire.attempt",
              "fleetwire.handler"}  # fmt: skip
    await asyncio.to_thread(fleetwire.tracing.client_tracing().flush)  # type: ignore[union-attr]

    def complete(got: list[ReceivedSpan]) -> bool:
        names = [s.name for s in got if s.trace_id == trace_id]
        return wanted <= set(names) and names.count("fleetwire.store.commit") == 2

    spans = await asyncio.to_thread(receiver.wait_for, complete)
    spans = [s for s in spans if s.trace_id == trace_id]
    assert {s.service for s in spans} == {"app", "fleetwire-client", "fleetwire-coordinator", "fleetwire-worker"}
    (request,), (submit,) = by_name(spans, "request"), by_name(spans, "fleetwire.submit")
    (queue,) = by_name(spans, "fleetwire.queue")
    (attempt,), (handler,) = by_name(spans, "fleetwire.attempt"), by_name(spans, "fleetwire.handler")
    assert submit.parent_span_id == request.span_id
    assert {queue.parent_span_id, attempt.parent_span_id} == {submit.span_id}
    assert queue.attributes["fleetwire.worker_id"] == "w1" and queue.attributes["fleetwire.policy"]
    assert handler.parent_span_id == attempt.span_id
    assert {s.attributes["fleetwire.event"] for s in by_name(spans, "fleetwire.store.commit")} == {
        "queued",
        "succeeded",
    }
    assert fleet.engine.traceparents[-1] == f"00-{trace_id}-{handler.span_id}-01"
    url = fleet.coordinator.url.replace("ws://", "http://") + "/metrics"
    async with httpx.AsyncClient() as http:  # a scrape that asks for OpenMetrics gets the trace as an exemplar
        scraped = await http.get(url, headers={"Accept": "application/openmetrics-text; version=1.0.0"})
    assert scraped.headers["content-type"].startswith("application/openmetrics-text")
    assert f'# {{trace_id="{trace_id}"}}' in scraped.text


async def test_a_retry_and_a_coordinator_restart_stay_in_the_plans_trace(receiver: OtlpReceiver, fleet: Fleet) -> None:
    """A failed first attempt and its retry are two attempt spans of one trace; a plan queued across a restart of
    the coordinator keeps its trace (its context is stored with it)."""
    async with Client(fleet.coordinator.url) as client:
        plan = await client.submit("flaky", retries=1)
        assert await plan.result() == "ok"
        info = await client.get_plan(plan.id)
        fleet.agent.stop()  # no worker: the next plan stays queued across the restart
    await asyncio.to_thread(fleet.agent.runner.tracing.flush)  # type: ignore[union-attr]
    spans = await asyncio.to_thread(
        receiver.wait_for, lambda got: len(by_name(receiver.trace(info.trace_id), "fleetwire.attempt")) == 2
    )
    attempts = by_name(spans, "fleetwire.attempt")
    assert sorted(s.attributes["fleetwire.attempt"] for s in attempts if s.trace_id == info.trace_id) == [1, 2]
    assert sorted(s.error for s in attempts if s.trace_id == info.trace_id) == [False, True]

    first = fleet.coordinator
    async with Client(first.url) as client:
        queued = await client.submit("flaky", plan_id="across-restart")
        traced = (await client.get_plan(queued.id)).trace_id
    await first.stop()
    second = CoordinatorServer(dataclasses.replace(first.settings, port=first.port), store=fleet.store)
    await second.start()
    fleet.coordinator = second
    assert second.core.plans["across-restart"].traceparent.split("-")[1] == traced
    tracing = Tracing(SERVICE_WORKER, endpoint=receiver.endpoint, export_process=True)  # the first agent's is shut
    agent = Agent(second.url, None, worker_id="w2", tracing=tracing)  # down: a stopped agent shuts its tracer down
    agent.add_handler("flaky", lambda ctx, args: "ok")
    task = asyncio.create_task(agent.run())
    try:
        await asyncio.to_thread(
            receiver.wait_for, lambda got: any(s.trace_id == traced and s.name == "fleetwire.attempt" for s in got)
        )
    finally:
        agent.stop()
        await asyncio.wait_for(task, 10)


async def test_a_killed_or_stopped_span_exporter_never_stalls_the_coordinator(
    receiver: OtlpReceiver, app: Any, fleet: Fleet
) -> None:
    """With the coordinator's exporter process stopped (SIGSTOP) traced plans still run to the end; killed, it is
    replaced and the next plan's coordinator spans reach the collector."""
    import signal

    tracing = fleet.coordinator.tracing
    assert tracing is not None and tracing.process is not None and tracing.process.proc is not None
    tracing.process.respawn_s = 0.0
    child = tracing.process.proc
    async with Client(fleet.coordinator.url) as client:
        child.send_signal(signal.SIGSTOP)
        with app.start_as_current_span("while-stopped"):
            plans = await client.submit_many("echo", range(20))
        assert [await p.result() for p in plans] == list(range(20))
        child.send_signal(signal.SIGKILL)
        await asyncio.to_thread(child.wait)
        with app.start_as_current_span("after-kill") as root:
            plan = await client.submit("echo", args=1)
        assert await plan.result() == 1
    trace_id = f"{root.get_span_context().trace_id:032x}"
    assert await asyncio.to_thread(tracing.flush, 20)
    queued = await asyncio.to_thread(receiver.wait_for, lambda got: [s for s in got if s.trace_id == trace_id
                                                                     and s.name == "fleetwire.queue"])  # fmt: skip
    assert tracing.process.started == 2 and tracing.process.proc is not child and queued
