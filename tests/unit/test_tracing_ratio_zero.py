"""A tracer whose sampler samples no root (ratio 0: propagation only) exporting in its own process
(wireio/tracing.py): no SDK imported until a span comes, which a caller's sampled context still makes."""

from __future__ import annotations

import subprocess
import sys

from tests.otlp_receiver import OtlpReceiver

TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
SPAN = "00f067aa0ba902b7"
SAMPLED = f"00-{TRACE}-{SPAN}-01"

_MODULES = "sorted(m for m in sys.modules if m.startswith(('opentelemetry.sdk.', 'google.protobuf', 'requests')))"


def _run(code: str, endpoint: str) -> list[str]:
    return subprocess.run([sys.executable, "-c", code, endpoint], capture_output=True, text=True, check=True,
                          timeout=60).stdout.split("\n")  # fmt: skip


def test_a_ratio_0_tracer_imports_no_sdk_until_a_sampled_callers_span_and_then_exports_it() -> None:
    """The client's tracer at ratio 0 (parent-based): built, deciding roots (none sampled) and shut down with no
    span, it imports nothing of OpenTelemetry; a span under a caller's sampled context reaches the collector."""
    env = "{'OTEL_TRACES_SAMPLER': 'parentbased_traceidratio', 'OTEL_TRACES_SAMPLER_ARG': '0'}"
    code = (
        "import sys; from wireio.tracing import Tracing; "
        f"t = Tracing('fleetwire-client', endpoint=sys.argv[1], environ={env}); "
        "assert t.start('fleetwire.submit', root=True) is None and t.start_each('s', '', [1, 2], dict) == []; "
        "assert t.flush(5); "
        f"print({_MODULES}); "
        f"s = t.start('fleetwire.submit', {SAMPLED!r}, {{'fleetwire.op': 'echo'}}, kind='producer', root=True); "
        "s.end(); assert t.flush(20), 'flush'; t.shutdown(); "
        "print(t.exported, t.dropped, 'opentelemetry.sdk.trace' in sys.modules)"
    )
    with OtlpReceiver() as receiver:
        before, after, _ = _run(code, receiver.endpoint)
        (span,) = receiver.wait_for(lambda got: len(got) >= 1)
    assert before == "[]"
    assert after.split() == ["1", "0", "True"]
    assert (span.service, span.name, span.trace_id, span.parent_span_id) == ("fleetwire-client", "fleetwire.submit",
                                                                             TRACE, SPAN)  # fmt: skip


def test_a_ratio_0_tracer_that_exported_nothing_shuts_down_quietly() -> None:
    """No span ever: flush says True, the shutdown stops the thread, nothing counted, nothing imported."""
    code = (
        "import sys; from wireio.tracing import Tracing; "
        "t = Tracing('fleetwire-client', endpoint=sys.argv[1], environ={'OTEL_TRACES_SAMPLER_ARG': '0', "
        "'OTEL_TRACES_SAMPLER': 'traceidratio'}); "
        "assert t.flush(5); t.shutdown(); t.shutdown(); "
        f"print(t.exported, t.dropped, t._thread.is_alive(), {_MODULES})"
    )
    (line, _) = _run(code, "http://127.0.0.1:9")
    assert line == "0 0 False []"
