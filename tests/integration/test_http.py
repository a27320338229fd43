"""HTTP on the coordinator's port over real loopback sockets: health, readiness, metrics, dashboard files,
and the operator requests (list_plans, drain, undrain) through the SDK against a real server and agent."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from coordinator.io.frontdoor.server import CoordinatorServer, ServerSettings
from coordinator.io.ops.metrics import METRIC_NAMES
from fleetwire import Client, RequestError
from worker_agent import Agent

WORKER_TOKEN = "w-secret"
CLIENT_TOKEN = "c-secret"
ADMIN_TOKEN = "a-secret"
pytestmark = pytest.mark.timeout(30)


@pytest.fixture
async def server() -> AsyncIterator[CoordinatorServer]:
    """A real coordinator on a free loopback port."""
    srv = CoordinatorServer(ServerSettings(port=0, worker_tokens=(WORKER_TOKEN,), client_tokens=(CLIENT_TOKEN,),
                                           admin_tokens=(ADMIN_TOKEN,)),
                            version="1.2.3")
    await srv.start()
    yield srv
    await srv.stop()


@pytest.fixture
async def http(server: CoordinatorServer) -> AsyncIterator[httpx.AsyncClient]:
    """An HTTP client for the coordinator's port."""
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{server.port}", trust_env=False) as client:
        yield client


@pytest.fixture
async def agent(server: CoordinatorServer) -> AsyncIterator[Agent]:
    """A real worker agent registered with the server."""
    worker = Agent(server.url, WORKER_TOKEN, worker_id="w1", max_concurrency=2)
    task = asyncio.create_task(worker.run())
    await asyncio.wait_for(worker.registered.wait(), 5)
    yield worker
    worker.stop()
    await asyncio.wait_for(task, 10)


async def test_healthz_and_readyz(server: CoordinatorServer, http: httpx.AsyncClient) -> None:
    """/healthz says the process is up; /readyz says it accepts, and 503 with the reason once stopping."""
    assert (await http.get("/healthz")).text == "ok\n"
    ready = await http.get("/readyz")
    assert (ready.status_code, ready.text) == (200, "ready\n")
    server._stopping = True  # what stop() sets first; the listener is still open for this request
    refused = await http.get("/readyz")
    assert refused.status_code == 503 and "shutting down" in refused.text
    server._stopping = False


async def test_metrics_are_scraped_by_the_prometheus_parser_with_every_family(
    server: CoordinatorServer, http: httpx.AsyncClient, agent: Agent
) -> None:
    """After a real plan ran, /metrics parses with prometheus_client and has every family, frames counted."""
    async with Client(server.url, token=CLIENT_TOKEN) as client:
        plan = await client.submit("echo", args={"x": 1})
        assert await plan.result() == {"x": 1}
    response = await http.get("/metrics")
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/plain")
    families = {f.name: f for f in text_string_to_metric_families(response.text)}
    assert set(METRIC_NAMES) <= set(families), sorted(set(METRIC_NAMES) - set(families))
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value for f in families.values() for s in f.samples}
    assert samples[("fleetwire_plans", (("state", "succeeded"),))] == 1
    assert samples[("fleetwire_plans_submitted_total", ())] == 1
    assert samples[("fleetwire_workers_alive", ())] == 1
    assert samples[("fleetwire_frames_total", (("direction", "in"), ("role", "worker")))] >= 2
    assert samples[("fleetwire_bytes_total", (("direction", "out"), ("role", "client")))] > 0
    assert samples[("fleetwire_plan_run_seconds_count", (("outcome", "succeeded"),))] == 1
    assert samples[("fleetwire_info", (("version", "1.2.3"),))] == 1
    assert "process_cpu_seconds_total" in {s.name for f in families.values() for s in f.samples}


async def test_dashboard_files_are_served_with_a_strict_policy(http: httpx.AsyncClient) -> None:
    """/ serves the page and its script and style come from the same server, under a self-only CSP."""
    page = await http.get("/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "default-src 'none'" in page.headers["content-security-policy"]
    assert '<script src="/dashboard/app.js"' in page.text and "http" not in page.text.split("<body>")[0]
    for path, kind in (("/dashboard/app.js", "text/javascript"), ("/dashboard/style.css", "text/css")):
        response = await http.get(path)
        assert response.status_code == 200 and response.headers["content-type"].startswith(kind), path
    missing = await http.get("/dashboard/../server.py")
    assert missing.status_code == 404 and "/metrics" in missing.text


async def test_drain_and_undrain_through_the_sdk(server: CoordinatorServer, agent: Agent) -> None:
    """drain (admin token) makes the worker show draining and hold new plans back; undrain runs them."""
    async with Client(server.url, token=ADMIN_TOKEN) as client:
        await client.drain("w1", deadline_s=30)
        row = (await client.workers()).workers[0]
        assert row.draining is True
        plan = await client.submit("echo", args=1)
        listing = await client.plans(states=["queued"])
        assert listing.queue == [plan.id]
        assert listing.plans[0].waiting_reason == "the only matching worker (w1) is draining"
        await client.undrain("w1")
        assert await asyncio.wait_for(plan.result(), 5) == 1
        assert (await client.workers()).workers[0].draining is False
        with pytest.raises(RequestError) as info:
            await client.drain("ghost")
        assert info.value.code == "unknown_worker" and "ghost" in str(info.value)
    async with Client(server.url, token=CLIENT_TOKEN) as client:  # a client token may not drain
        with pytest.raises(RequestError) as info:
            await client.drain("w1")
        assert info.value.code == "forbidden" and "admin token" in str(info.value)
        assert (await client.workers()).workers[0].draining is False
        with pytest.raises(ValueError, match="plan states"):
            await client.plans(states=["bogus"])
