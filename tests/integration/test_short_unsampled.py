"""The SDK's "not sampled" in one character, per connection (issue #32; docs/PROTOCOL.md §1 ``X-Fleetwire-Accepts``).

A coordinator says in a client session's ``101`` that it accepts ``submit.traceparent`` ``"0"``; the SDK reads it at
each connect and sends ``"0"`` only there, ``"00"`` elsewhere, and a submit it keeps and sends again after a reconnect
goes in the form the new connection accepts. Real coordinators over loopback; the client traces at ratio 0, outside
any span, so every plan carries the unsampled decision.
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator, Iterator

import msgspec
import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

import coordinator.client_session
import fleetwire.tracing
from coordinator.io.frontdoor.server import CoordinatorServer, ServerSettings
from fleetwire import Client
from protocol.messages import Submit
from tests.integration.test_client_sdk import CLIENT_TOKEN, FakeCoordinator
from tests.integration.test_client_sdk import coordinator as websockets_server  # noqa: F401 (fixture)
from tests.waiting import until
from wireio.tracing import SERVICE_CLIENT, Tracing

pytestmark = pytest.mark.timeout(30)


@pytest.fixture
def unsampled(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The client's tracing on at ratio 0: every plan outside a span is not sampled."""
    environ = {"OTEL_TRACES_SAMPLER": "parentbased_traceidratio", "OTEL_TRACES_SAMPLER_ARG": "0",
               "OTEL_BSP_SCHEDULE_DELAY": "600000"}  # fmt: skip
    tracing = Tracing(SERVICE_CLIENT, exporter=InMemorySpanExporter(), environ=environ)
    monkeypatch.setattr(fleetwire.tracing, "_tracing", tracing)
    yield
    tracing.shutdown()


@pytest.fixture
async def server() -> AsyncIterator[CoordinatorServer]:
    """A coordinator with no worker: plans stay queued (and their submits kept by the SDK)."""
    srv = CoordinatorServer(ServerSettings(port=0, insecure=True, store="memory"))
    await srv.start()
    yield srv
    await srv.stop()


def sent(client: Client, plan_id: str) -> str:
    """The traceparent of the submit the client sent for ``plan_id`` (the encoded submit it keeps for recovery)."""
    return msgspec.msgpack.decode(client.session._specs[plan_id], type=Submit).traceparent


async def test_the_sdk_sends_0_to_a_coordinator_whose_upgrade_says_it_accepts_it(
    unsampled: None, server: CoordinatorServer
) -> None:
    """The coordinator's 101 says short-unsampled: a lone submit and a batch carry "0"; the plans hold "00"."""
    async with Client(server.url) as client:
        assert client.session.unsampled == "0"
        lone = await client.submit("echo", plan_id="lone")
        batch = await client.submit_many("echo", range(3))
        plan_ids = [lone.id, *(plan.id for plan in batch)]
        assert [sent(client, plan_id) for plan_id in plan_ids] == ["0"] * 4
        assert [server.core.plans[plan_id].traceparent for plan_id in plan_ids] == ["00"] * 4


async def test_the_sdk_sends_00_to_a_coordinator_that_does_not_say_it(
    unsampled: None, server: CoordinatorServer
) -> None:
    """With the header off (as a coordinator before it), every submit carries "00", lone or in a batch."""
    server._gate.accepts = ""
    async with Client(server.url) as client:
        assert client.session.unsampled == "00"
        lone = await client.submit("echo", plan_id="lone")
        batch = await client.submit_many("echo", range(3))
        assert [sent(client, plan.id) for plan in [lone, *batch]] == ["00"] * 4


async def test_a_websockets_server_without_the_header_gets_00(
    unsampled: None,
    websockets_server: FakeCoordinator,  # noqa: F811
) -> None:
    """A server that never heard of the header (a plain websockets one, scripted): the submits it decodes carry
    "00"."""
    async with Client(websockets_server.url, token=CLIENT_TOKEN) as client:
        assert client.session.unsampled == "00"
        await client.submit("echo", args=1)
        await client.submit_many("echo", range(2))
    assert [submit.traceparent for submit in websockets_server.submits] == ["00"] * 3


async def test_a_kept_submit_is_sent_again_as_00_to_an_older_coordinator_after_a_reconnect(
    unsampled: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A plan submitted as "0" to a coordinator that accepts it; that coordinator is replaced on its port by an older
    one (no header, "0" refused invalid_argument, no plans: a store loss): the SDK's recovery resubmits it as "00",
    accepted, and the plan goes on."""
    server = CoordinatorServer(ServerSettings(port=0, insecure=True, store="memory"))
    await server.start()
    async with Client(server.url, reconnect_base_s=0.01, reconnect_cap_s=0.05) as client:
        plan = await client.submit("echo", plan_id="kept")
        assert sent(client, "kept") == "0"
        await server.stop()
        older = CoordinatorServer(dataclasses.replace(server.settings, port=server.port))
        older._gate.accepts = ""
        refused: list[str] = []
        problem = coordinator.client_session.submit_problem

        def before_0_was_accepted(msg: Submit) -> str | None:
            if msg.traceparent == "0":
                refused.append(msg.plan_id or "")
                return "submit.traceparent '0' is not W3C"
            return problem(msg)

        monkeypatch.setattr(coordinator.client_session, "submit_problem", before_0_was_accepted)
        await older.start()
        try:
            await until(lambda: "kept" in older.core.plans or refused, 10)
            assert client.session.unsampled == "00" and client.session.recovered == 1 and refused == []
            assert older.core.plans["kept"].traceparent == "00" and plan.id == "kept"
        finally:
            await older.stop()
