"""The traceparent each submit of a batch carries (fleetwire/submits.py's template, fleetwire/tracing.py): the same
with the context set once on the template as when it was set on each plan (docs/OPERATIONS.md §Tracing)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF, ALWAYS_ON

import fleetwire.tracing
from fleetwire import submits
from fleetwire.session import ClientSession
from fleetwire.tracing import LiveSpan
from protocol.codec import Codec
from protocol.messages import FromClient, Requirements
from protocol.tracecontext import UNSAMPLED, format_traceparent
from wireio.tracing import SERVICE_CLIENT, Tracing

COORDINATOR = Codec("msgpack", FromClient, "client")  # decodes what the session sends
PLANS = 400


@contextmanager
def _client_tracing(monkeypatch: pytest.MonkeyPatch, sampler: str, ratio: str = "1") -> Iterator[Tracing]:
    environ = {"OTEL_TRACES_SAMPLER": sampler, "OTEL_TRACES_SAMPLER_ARG": ratio, "OTEL_BSP_SCHEDULE_DELAY": "600000"}
    tracing = Tracing(SERVICE_CLIENT, exporter=InMemorySpanExporter(), environ=environ)
    monkeypatch.setattr(fleetwire.tracing, "_tracing", tracing)
    try:
        yield tracing
    finally:
        tracing.shutdown()


def _batch(count: int = PLANS) -> tuple[list[str], list[str]]:
    """A batch's plans' traceparents as encoded (what the coordinator reads), and what each plan's submit span says
    it should carry ("": no span)."""
    spans: list[LiveSpan | None] = []
    ids = [f"p{i}" for i in range(count)]
    requests = submits.batch(ClientSession("msgpack"), "echo", list(range(count)), ids, requirements=Requirements(),
                             priority=0, timeout_s=None, max_attempts=3, max_inline_bytes=1 << 20,
                             spans=spans)  # fmt: skip
    by_plan = {span._attributes["fleetwire.plan_id"]: span.traceparent for span in spans if span is not None}
    assert len(by_plan) == len(spans)
    return [COORDINATOR.decode(bytes(r.raw))[0].traceparent for r in requests], [by_plan.get(i, "") for i in ids]


def _context(span: Any, sampled: bool) -> str:
    context = span.get_span_context()
    return format_traceparent(context.trace_id, context.span_id, sampled=sampled)


def test_at_a_ratio_a_sampled_plan_carries_its_spans_context_and_the_others_00(monkeypatch: pytest.MonkeyPatch) -> None:
    """At 5 % outside any span each sampled plan carries its own submit span's context (never the template's "00"),
    every other plan "00"."""
    with _client_tracing(monkeypatch, "parentbased_traceidratio", "0.05"):
        carried, spans = _batch()
        sampled = [span for span in spans if span]
        assert 0 < len(sampled) < PLANS // 4 and len(set(sampled)) == len(sampled)
        assert carried == [span or UNSAMPLED for span in spans]
        assert all(text.endswith("-01") for text in sampled)


def test_inside_a_sampled_span_every_plan_carries_its_own_child_span(monkeypatch: pytest.MonkeyPatch) -> None:
    """Inside the caller's sampled span (parent-based) every plan is sampled and carries its own span's context, a
    child in the caller's trace: none carries the caller's context the template held."""
    with _client_tracing(monkeypatch, "parentbased_traceidratio", "0.05"):
        with TracerProvider(sampler=ALWAYS_ON).get_tracer("app").start_as_current_span("request") as request:
            carried, spans = _batch()
        caller = _context(request, sampled=True)
        assert all(spans) and caller not in carried
        assert carried == spans
        assert {text[3:35] for text in carried} == {caller[3:35]}


def test_inside_an_unsampled_span_every_plan_carries_the_callers_context(monkeypatch: pytest.MonkeyPatch) -> None:
    """Inside the caller's unsampled span every plan carries that span's context, flag clear, and makes no span."""
    with _client_tracing(monkeypatch, "parentbased_always_on"):
        with TracerProvider(sampler=ALWAYS_OFF).get_tracer("app").start_as_current_span("request") as request:
            carried, spans = _batch()
        assert spans == [""] * PLANS and carried == [_context(request, sampled=False)] * PLANS


def test_with_tracing_off_a_plan_carries_the_callers_context_or_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    """With the client's tracing off a plan carries the caller's context inside a span, else no traceparent."""
    monkeypatch.setattr(fleetwire.tracing, "_tracing", None)
    assert _batch(3) == ([""] * 3, [""] * 3)
    with TracerProvider(sampler=ALWAYS_ON).get_tracer("app").start_as_current_span("request") as request:
        carried, spans = _batch(3)
    assert spans == [""] * 3 and carried == [_context(request, sampled=True)] * 3


def test_a_lone_unsampled_submit_runs_five_python_functions_and_lone_submits_sample_at_the_ratio(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``Client.submit``'s tracing (start_submit_spans of one submit) outside any span, at a ratio, for a plan not
    sampled: it reads the current context once (empty: no span) and counts the plan off the sampler's gap, with no
    other Python function (docs/PERFORMANCE.md §T32h: on a lone round trip each cold function costs microseconds).
    Lone submits are still sampled at the ratio, each sampled one with its span's context, the others "00"."""
    import sys

    from protocol.messages import Submit

    with _client_tracing(monkeypatch, "parentbased_traceidratio", "0.05") as tracing:
        names: list[str] = []

        def profile(frame: Any, event: str, _arg: Any) -> None:
            if event == "call":
                names.append(frame.f_code.co_qualname)

        msgs = [Submit(req_id=i, op="echo") for i in range(20_000)]
        fleetwire.tracing.start_submit_spans(msgs[:1])  # warm: nothing first-time below
        tracing.sampler.gap = 10  # the next plan is not sampled
        sys.setprofile(profile)
        try:
            spans = fleetwire.tracing.start_submit_spans(msgs[1:2])
        finally:
            sys.setprofile(None)
        assert spans is None and msgs[1].traceparent == UNSAMPLED
        assert names == ["start_submit_spans", "current_traceparent", "get_current",
                         "ContextVarsRuntimeContext.get_current", "Tracing.start_each"]  # fmt: skip
        sampled = [span for msg in msgs[2:] for span in fleetwire.tracing.start_submit_spans([msg]) or ()]
    assert 900 <= len(sampled) <= 1_100  # 5 % of 19,998
    carried = [msg.traceparent for msg in msgs[2:]]
    assert sorted(set(carried) - {UNSAMPLED}) == sorted(span.traceparent for span in sampled)
