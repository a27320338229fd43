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


def test_a_lone_unsampled_submit_runs_three_python_functions_and_lone_submits_sample_at_the_ratio(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``Client.submit``'s tracing (start_submit_spans of one submit) outside any span, at a ratio, for a plan not
    sampled: it reads the current context once (empty: no span; no Python function) and counts the plan off the
    sampler's gap, with no other Python function and no cell made (docs/PERFORMANCE.md §T32h, §T32j: on a lone
    round trip each cold function costs microseconds). Lone submits are still sampled at the ratio, each sampled
    one with its span's context, the others "00"."""
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
        # the current context read by its ContextVar's get, a C call (wireio/tracing.py context_reader)
        assert names == ["start_submit_spans", "current_traceparent", "Tracing.start_each"]
        # and start_each makes no cell a call (its sampled spans' comprehensions are _start_sampled's)
        assert Tracing.start_each.__code__.co_cellvars == ()
        sampled = [span for msg in msgs[2:] for span in fleetwire.tracing.start_submit_spans([msg]) or ()]
    assert 900 <= len(sampled) <= 1_100  # 5 % of 19,998
    carried = [msg.traceparent for msg in msgs[2:]]
    assert sorted(set(carried) - {UNSAMPLED}) == sorted(span.traceparent for span in sampled)


def test_the_current_context_is_read_through_opentelemetrys_context_variable_and_agrees_with_get_current() -> None:
    """wireio/tracing.py ``context_reader`` reads the installed OpenTelemetry's current context by its runtime
    context's ``ContextVar`` (private names: this fails when OpenTelemetry renames them, and the SDK falls back to
    the public ``get_current``, three Python functions a submit slower), and reads what ``get_current`` does,
    outside a span and inside one attached."""
    from opentelemetry import context, trace

    from wireio.tracing import context_reader

    read = context_reader(context)
    assert read != context.get_current and getattr(read, "__self__", None) is context._RUNTIME_CONTEXT._current_context
    assert read() is context.get_current() and not read()
    provider = TracerProvider(sampler=ALWAYS_ON)
    with provider.get_tracer("t").start_as_current_span("caller") as span:
        assert read() is context.get_current() and read()
        expected = format_traceparent(span.get_span_context().trace_id, span.get_span_context().span_id, sampled=True)
        assert fleetwire.tracing.current_traceparent() == expected
    assert not read() and trace.get_current_span() is trace.INVALID_SPAN


def test_the_current_context_falls_back_to_get_current_when_opentelemetrys_private_names_change() -> None:
    """Without the runtime context's ``ContextVar`` where ``context_reader`` looks (another runtime context, a
    renamed field), the public ``get_current`` reads the context."""
    from types import SimpleNamespace

    from wireio.tracing import context_reader

    def get_current() -> dict[str, object]:
        return {}

    class ContextVarsRuntimeContext:  # the default's name, its field renamed
        def __init__(self) -> None:
            self._context = None

    for runtime in (None, object(), ContextVarsRuntimeContext()):
        module = SimpleNamespace(_RUNTIME_CONTEXT=runtime, get_current=get_current)
        assert context_reader(module) is get_current
    assert context_reader(SimpleNamespace(get_current=get_current)) is get_current
