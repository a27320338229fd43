"""The worker's spans noted in their fixed shapes (wireio/otlp.py ``LIVE_SPANS``) export exactly as noted in full."""

from __future__ import annotations

import collections
import itertools
import random
import threading
import types
from typing import Any

import pytest

import wireio.tracing
from protocol.messages import Assign
from wireio.otlp import LIVE_BASE, SpanEncoder, expand
from wireio.tracing import LiveSpan, Sampler, Tracing
from worker_agent.plan_tracing import attempt_span, child_span

PARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


def _tracing() -> Tracing:
    """A tracer's hot-path state only (no exporter thread): what it notes stays in its queue."""
    tracing = Tracing.__new__(Tracing)
    tracing._queue = collections.deque()
    tracing._max_queue = 1 << 20
    tracing._batch = 1 << 20
    tracing._wake = threading.Event()
    tracing._parked = False  # the exporter thread's park flag (61906e1): read by every noted span
    tracing.dropped = 0
    tracing.sampler = Sampler()
    return tracing


def _plans(tracing: Tracing) -> None:
    """A worker's spans in each shape: attempts with and without devices, ended with an outcome, failed, silenced
    (no outcome), one with another attribute set; handler and inputs spans, one with a key of its own."""
    for i, (devices, outcome, error, extra) in enumerate([
        ((), "succeeded", "", False), ((0, 3), "failed", "HANDLER_ERROR", False), ((1,), None, "silenced", False),
        ((), "succeeded", "", True), ((), None, "", False),
    ]):  # fmt: skip
        assign = Assign(plan_id=f"p-{i}", attempt=i + 1, op="echo", args=None, traceparent=PARENT, devices=devices)
        span = attempt_span(tracing, assign, "w1")
        assert span is not None
        inputs = child_span(tracing, span, "fleetwire.inputs", {"fleetwire.inputs": i})
        assert inputs is not None
        inputs.end()
        handler = child_span(tracing, span, "fleetwire.handler",
                             {"fleetwire.plan_id": assign.plan_id, **({"x": 1.5} if extra else {})})  # fmt: skip
        assert handler is not None
        handler.end(error)
        if extra:
            span.set("fleetwire.retry", True)
        if outcome is not None:
            span.set("fleetwire.outcome", outcome)
        span.end(error)


def _noted(monkeypatch: pytest.MonkeyPatch, full: bool) -> list[Any]:
    """What :func:`_plans` notes, with the same ids and times each time; ``full``: every span noted in full."""
    random.seed(7)
    clock = itertools.count(1_700_000_000_000_000_000, 1_000)
    monkeypatch.setattr(wireio.tracing, "time", types.SimpleNamespace(time_ns=lambda: next(clock)))
    if full:
        end = LiveSpan.end

        def end_in_full(self: LiveSpan, error: str = "") -> None:
            self._template = None
            end(self, error)

        monkeypatch.setattr(LiveSpan, "end", end_in_full)
    tracing = _tracing()
    _plans(tracing)
    monkeypatch.undo()
    return list(tracing._queue)


def test_the_workers_spans_in_their_shapes_export_the_same_bytes_and_spans_as_in_full(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each span noted in its fixed shape expands to the tuple noted in full (the SDK's path) and encodes to the same
    OTLP bytes; the spans that leave their shape (another key, no outcome is fine) are noted in full."""
    compact = _noted(monkeypatch, full=False)
    full = _noted(monkeypatch, full=True)
    assert len(compact) == len(full) == 15
    shaped = [raw for raw in compact if raw[0].__class__ is int]
    assert len(shaped) == 13 and all(raw[0] >= LIVE_BASE for raw in shaped)  # the two off their shape are in full
    assert [expand(raw) for raw in compact] == full
    resource = {"service.name": "fleetwire-worker"}
    assert SpanEncoder(resource).encode(compact) == SpanEncoder(resource).encode(full)
    one = SpanEncoder(resource)  # and each span alone, its key tables warm or not
    other = SpanEncoder(resource)
    for a, b in zip(compact * 2, full * 2, strict=True):
        assert one.encode([a]) == other.encode([b])
