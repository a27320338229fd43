"""Trace context on the wire (protocol/tracecontext.py) and the OpenTelemetry layer (wireio/tracing.py)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from protocol.tracecontext import (
    format_traceparent,
    is_sampled,
    parse_traceparent,
    trace_id_of,
    traceparent_problem,
)
from tests.otlp_receiver import OtlpReceiver
from wireio.tracing import SERVICE_COORDINATOR, Tracing, tracing_requested

TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
SPAN = "00f067aa0ba902b7"
SAMPLED = f"00-{TRACE}-{SPAN}-01"
UNSAMPLED = f"00-{TRACE}-{SPAN}-00"


def test_a_w3c_traceparent_parses_and_formats_back() -> None:
    """The W3C example parses into its trace, span and sampled flag, and formats back to itself."""
    parsed = parse_traceparent(SAMPLED)
    assert parsed is not None
    assert (parsed.trace_id, parsed.span_id, parsed.sampled) == (TRACE, SPAN, True)
    assert parsed.traceparent == SAMPLED
    assert format_traceparent(int(TRACE, 16), int(SPAN, 16), sampled=False) == UNSAMPLED
    assert (trace_id_of(SAMPLED), is_sampled(SAMPLED), is_sampled(UNSAMPLED)) == (TRACE, True, False)


@pytest.mark.parametrize(
    ("text", "said"),
    [
        ("00-xyz", "is not a W3C traceparent"),
        (f"00-{TRACE.upper()}-{SPAN}-01", "lower case"),
        (f"00-{'0' * 32}-{SPAN}-01", "trace id is all zeros"),
        (f"00-{TRACE}-{'0' * 16}-01", "parent span id is all zeros"),
        (f"ff-{TRACE}-{SPAN}-01", "version ff is invalid"),
        (f"00-{TRACE}-{SPAN}-01-extra", "version 00 has exactly four fields"),
        ("0" * 300, "at most 256"),
    ],
)
def test_a_bad_traceparent_is_refused_naming_the_rule(text: str, said: str) -> None:
    """Each malformed traceparent gets a reason naming what is wrong; an empty one is no context, not an error."""
    problem = traceparent_problem(text)
    assert problem is not None and said in problem
    assert parse_traceparent(text) is None
    assert traceparent_problem("") is None
    assert traceparent_problem(f"01-{TRACE}-{SPAN}-01-future") is None  # a later version may add fields


def test_tracing_is_on_only_when_asked() -> None:
    """An OTLP endpoint (flag or variable) turns tracing on; OTEL_SDK_DISABLED and OTEL_TRACES_EXPORTER=none off."""
    assert not tracing_requested({})
    assert tracing_requested({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318"})
    assert tracing_requested({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://c:4318/v1/traces"})
    assert tracing_requested({}, endpoint="http://c:4318")
    assert not tracing_requested({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c", "OTEL_SDK_DISABLED": "true"})
    assert not tracing_requested({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c", "OTEL_TRACES_EXPORTER": "none"})
    assert Tracing.from_env(SERVICE_COORDINATOR, environ={}) is None


def test_importing_the_packages_imports_no_opentelemetry() -> None:
    """No cost when off: the SDK, the coordinator and the worker agent import no opentelemetry module."""
    code = (
        "import sys, fleetwire, fleetwire.client, coordinator.core, coordinator.io.frontdoor.server, "
        "worker_agent.agent, wireio.tracing; "
        "print(sorted(m for m in sys.modules if m.startswith('opentelemetry')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_spans_reach_a_real_otlp_receiver_as_children_of_the_remote_parent() -> None:
    """A recorded span and a live one go over OTLP/HTTP, in the parent's trace, under the service's name;
    an unsampled parent makes none."""
    with OtlpReceiver() as receiver:
        tracing = Tracing(SERVICE_COORDINATOR, endpoint=receiver.endpoint, environ={})
        child = tracing.record("fleetwire.queue", SAMPLED, 1_000, 2_000, {"fleetwire.plan_id": "p1"},
                               events=[("waiting", 1_500, {"reason": "no worker has tag gpu"})])  # fmt: skip
        assert trace_id_of(child) == TRACE and is_sampled(child)
        assert tracing.record("fleetwire.queue", UNSAMPLED, 1_000, 2_000) == ""
        assert tracing.start("fleetwire.attempt", UNSAMPLED) is None
        live = tracing.start("fleetwire.attempt", child, {"fleetwire.attempt": 1}, kind="consumer")
        assert live is not None
        live.end(error="handler_error")
        tracing.shutdown()
        spans = receiver.wait_for(lambda got: len(got) >= 2)
    by_name = {s.name: s for s in spans}
    queue, attempt = by_name["fleetwire.queue"], by_name["fleetwire.attempt"]
    assert {s.service for s in spans} == {"fleetwire-coordinator"}
    assert (queue.trace_id, queue.parent_span_id) == (TRACE, SPAN)
    assert (queue.start_ns, queue.end_ns, queue.events) == (1_000, 2_000, ["waiting"])
    assert queue.attributes == {"fleetwire.plan_id": "p1"}
    assert attempt.parent_span_id == queue.span_id and attempt.error
    assert len(spans) == 2


class _Counting:
    """A span exporter that keeps what it is handed (the SDK's interface: export, force_flush, shutdown)."""

    def __init__(self) -> None:
        self.spans: list[object] = []

    def export(self, spans: list[object]) -> None:
        self.spans += spans

    def force_flush(self, timeout_millis: int = 0) -> bool:
        return True

    def shutdown(self) -> None:
        pass


def test_the_root_sampler_draws_the_ratio_and_ids_a_downstream_ratio_sampler_agrees_with() -> None:
    """At ratio 0.01 about 1 % of roots are sampled, each id under the SDK's TraceIdRatioBased bound; always_off samples
    none; a parent-based sampler follows the parent's flag, a plain ratio one the parent's trace id."""
    import random

    from opentelemetry.sdk.trace.sampling import TraceIdRatioBased

    from wireio.tracing import Sampler

    sampler = Sampler.from_env({"OTEL_TRACES_SAMPLER": "parentbased_traceidratio", "OTEL_TRACES_SAMPLER_ARG": "0.01"})
    rng = random.Random(7)
    ids = [sampler.root(rng) for _ in range(20_000)]
    sampled = [i for i in ids if i]
    assert 140 <= len(sampled) <= 260  # 200 expected
    sdk = TraceIdRatioBased(0.01)
    assert all(sdk.should_sample(None, i, "x").decision.is_sampled() for i in sampled)
    assert Sampler("always_off").root(rng) == 0 and Sampler("bogus").name == "parentbased_always_on"
    assert sampler.child(SAMPLED) and not sampler.child(UNSAMPLED)
    plain = Sampler("traceidratio", 0.5)
    assert plain.child(f"00-{'0' * 16}{'f' * 16}-{SPAN}-01") is False
    assert plain.child(f"00-{'0' * 16}{'0' * 15}1-{SPAN}-00") is True


def test_an_unsampled_context_notes_nothing_and_a_full_queue_drops_without_blocking() -> None:
    """An unsampled parent or root is no span at all (nothing queued, nothing exported); past
    OTEL_BSP_MAX_QUEUE_SIZE spans are dropped and counted, never waited for."""
    exporter = _Counting()
    environ = {"OTEL_BSP_MAX_QUEUE_SIZE": "3", "OTEL_BSP_SCHEDULE_DELAY": "600000", "OTEL_TRACES_SAMPLER": "always_off"}
    tracing = Tracing(SERVICE_COORDINATOR, exporter=exporter, environ=environ)
    try:
        assert tracing.start("fleetwire.submit", "", kind="producer", root=True) is None
        assert tracing.record("fleetwire.queue", UNSAMPLED, 1, 2) == ""
        assert len(tracing._queue) == 0
        for _ in range(5):
            tracing.record("fleetwire.queue", SAMPLED, 1, 2)
        assert (len(tracing._queue), tracing.dropped) == (3, 2)
        tracing.flush()
        assert (len(exporter.spans), tracing.exported) == (3, 3)
    finally:
        tracing.shutdown()


def test_the_client_decides_once_and_an_unsampled_plan_carries_only_its_callers_context(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With the client's sampler off, a submit outside any span carries no traceparent and makes no span; inside an
    application's unsampled span it carries that span's context, flag clear, so no hop makes a span."""
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.sampling import ALWAYS_OFF

    import fleetwire.tracing
    from protocol.messages import Submit

    tracing = Tracing("fleetwire-client", exporter=_Counting(), environ={"OTEL_TRACES_SAMPLER": "always_off"})
    monkeypatch.setattr(fleetwire.tracing, "_tracing", tracing)
    try:
        msgs = [Submit(req_id=1, op="echo"), Submit(req_id=2, op="echo")]
        assert fleetwire.tracing.start_submit_spans(msgs) is None
        assert [m.traceparent for m in msgs] == ["", ""]
        app = TracerProvider(sampler=ALWAYS_OFF).get_tracer("app")
        with app.start_as_current_span("request") as request:
            assert fleetwire.tracing.start_submit_spans(msgs) is None
        context = request.get_span_context()
        assert {m.traceparent for m in msgs} == {format_traceparent(context.trace_id, context.span_id, sampled=False)}
        assert len(tracing._queue) == 0
    finally:
        tracing.shutdown()


def test_a_batch_the_collector_refuses_counts_as_dropped_not_exported() -> None:
    """An export that fails (the SDK exporter's FAILURE: collector away or refusing) counts its spans in dropped."""
    from opentelemetry.sdk.trace.export import SpanExportResult

    class Refusing(_Counting):
        def export(self, spans: list[object]) -> SpanExportResult:  # type: ignore[override]
            return SpanExportResult.FAILURE

    tracing = Tracing(SERVICE_COORDINATOR, exporter=Refusing(), environ={"OTEL_BSP_SCHEDULE_DELAY": "600000"})
    try:
        tracing.record("fleetwire.queue", SAMPLED, 1, 2)
        tracing.flush()
        assert (tracing.exported, tracing.dropped) == (0, 1)
    finally:
        tracing.shutdown()
