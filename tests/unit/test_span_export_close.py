"""Spans the exporter child held when its close killed it are counted dropped, not exported (wireio/span_export.py).

``ExportProcess.close`` flushes, closes the pipe and waits for the child, killing it past ``exit_wait_s``. Against a
collector that never answers, the child is still posting when the bound ends: the spans sent to it and never
confirmed die with it. They were counted as exported (handed to the child), and nothing said they were lost.
"""

from __future__ import annotations

import time

import pytest
from structlog.testing import capture_logs

from wireio.tracing import SERVICE_COORDINATOR, Tracing

pytestmark = pytest.mark.timeout(60)

SAMPLED = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
EXIT_WAIT_S = 1.0  # the child's close bound here (15 s by default); the OTLP exporter's post waits 10 s


def test_spans_the_child_dies_with_at_shutdown_are_dropped_and_logged(mute_collector: str) -> None:
    """A shutdown whose child is still posting to a mute collector at exit_wait_s kills it: the spans it held count
    in dropped (not exported) and the shutdown logs a warning with the counts."""
    environ = {"OTEL_BSP_SCHEDULE_DELAY": "600000"}
    tracing = Tracing(SERVICE_COORDINATOR, endpoint=mute_collector, environ=environ, export_process=True)
    process = tracing.process
    assert process is not None and process.proc is not None
    process.exit_wait_s = EXIT_WAIT_S
    child = process.proc
    for i in range(3):
        tracing.record("fleetwire.queue", SAMPLED, i, i + 1)
    began = time.monotonic()
    with capture_logs() as logs:
        tracing.shutdown()
    assert time.monotonic() - began < EXIT_WAIT_S + 5
    assert child.returncode is not None and process.proc is None
    assert (tracing.exported, tracing.dropped, process.failed) == (0, 3, 3)
    warnings = [e for e in logs if e["log_level"] == "warning"]
    assert [(e["dropped"], e["exported"], e["service"]) for e in warnings] == [(3, 0, SERVICE_COORDINATOR)], logs


def test_a_child_that_confirms_everything_drops_nothing_and_logs_nothing() -> None:
    """A collector that answers: the shutdown's close finds every span confirmed, none dropped, no warning."""
    from tests.otlp_receiver import OtlpReceiver

    with OtlpReceiver() as receiver:
        environ = {"OTEL_BSP_SCHEDULE_DELAY": "600000"}
        tracing = Tracing(SERVICE_COORDINATOR, endpoint=receiver.endpoint, environ=environ, export_process=True)
        tracing.record("fleetwire.queue", SAMPLED, 1, 2)
        with capture_logs() as logs:
            tracing.shutdown()
        assert receiver.wait_for(lambda got: len(got) >= 1)
    assert (tracing.exported, tracing.dropped) == (1, 0)
    assert [e for e in logs if e["log_level"] == "warning"] == []
