"""An in-process ``Tracing.flush`` ends at its bound against a collector that never answers.

Exporting in this process (the SDK's client by default), the flush posted every queued batch on the caller's
thread, each post waiting out the OTLP exporter's timeout, after the exporter thread's post under way: against a
collector that never answers, a flush of ``timeout_s`` took a post's timeout a batch. One deadline now bounds it all,
as ``exit_wait_s`` bounds the shutdown (wireio/tracing.py ``Tracing.flush``).
"""

from __future__ import annotations

import time

import pytest
from structlog.testing import capture_logs

from wireio.tracing import SERVICE_CLIENT, Tracing

pytestmark = pytest.mark.timeout(60)

SAMPLED = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
POST_TIMEOUT_S = 5.0  # the OTLP exporter's, a post (10 s by default)
SPANS = 3  # a batch each


def test_an_in_process_flush_ends_at_its_bound_against_a_collector_that_never_answers(mute_collector: str) -> None:
    """Three one-span batches for a mute collector, each post up to 5 s: flush(0.5) says False within a few seconds
    (was: 5 s a batch, 15 s), nothing counted exported; the shutdown then counts all three dropped, once."""
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    exporter = OTLPSpanExporter(endpoint=f"{mute_collector}/v1/traces", timeout=POST_TIMEOUT_S)
    environ = {"OTEL_BSP_SCHEDULE_DELAY": "600000", "OTEL_BSP_MAX_EXPORT_BATCH_SIZE": "1"}
    tracing = Tracing(SERVICE_CLIENT, environ=environ, exporter=exporter)
    tracing.exit_wait_s = 0.5
    try:
        for i in range(SPANS):
            tracing.record("fleetwire.submit", SAMPLED, i, i + 1)
        began = time.monotonic()
        assert not tracing.flush(0.5)
        assert time.monotonic() - began < POST_TIMEOUT_S - 2
        assert tracing.exported == 0
    finally:
        with capture_logs() as logs:
            tracing.shutdown()
    assert (tracing.exported, tracing.dropped) == (0, SPANS)
    assert [e["dropped"] for e in logs if e["log_level"] == "warning"] == [SPANS]
