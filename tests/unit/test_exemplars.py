"""Trace exemplars on the latency histograms (coordinator/stats.py, OpenMetrics in coordinator/io/ops/metrics.py)."""

from __future__ import annotations

from coordinator.io.ops.metrics import build_registry, render, render_openmetrics
from coordinator.io.ops.metrics_http import wants_openmetrics
from protocol.messages import Accept, Done
from tests.unit.test_core import Harness

TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"


def test_a_sampled_plans_latencies_carry_its_trace_id_in_openmetrics_only() -> None:
    """The queue-wait and run-time buckets of a sampled plan link to its trace in OpenMetrics; the text format has
    no exemplar; an unsampled plan leaves none."""
    h = Harness()
    c = h.client()
    w = h.worker("w1", max_concurrency=2)
    traced = h.submit(c, traceparent=f"00-{TRACE}-00f067aa0ba902b7-01")
    untraced = h.submit(c, traceparent=f"00-{'1' * 32}-00f067aa0ba902b7-00")
    h.now = 0.2
    for plan in (traced, untraced):
        h.send(w, Accept(plan_id=plan, attempt=1))
    h.now = 0.7
    for plan in (traced, untraced):
        h.send(w, Done(plan_id=plan, attempt=1, outcome="succeeded"))
    registry = build_registry(h.core, process=False)
    openmetrics = render_openmetrics(registry).decode()
    exemplars = [line for line in openmetrics.splitlines() if "trace_id" in line]
    assert any(line.startswith('fleetwire_plan_queue_wait_seconds_bucket{le="0.5"}') for line in exemplars)
    assert any(line.startswith('fleetwire_plan_run_seconds_bucket{le="0.5",outcome="succeeded"}') for line in exemplars)
    assert all(f'trace_id="{TRACE}"' in line for line in exemplars) and len(exemplars) == 2
    assert "trace_id" not in render(registry).decode()
    assert wants_openmetrics("application/openmetrics-text; version=1.0.0,text/plain;q=0.5")
    assert not wants_openmetrics("text/plain") and not wants_openmetrics(None)
