"""A tracer that imports the OpenTelemetry SDK and its OTLP exporter into this process (wireio/tracing.py) leaves
no full collection pending for the application's next young ones (docs/PERFORMANCE.md §T32o): the import's
objects, counted pending for the oldest generation, made CPython run one inside a client's first batch."""

from __future__ import annotations

import subprocess
import sys

_CODE = """
import gc, sys
from wireio import tracing

OTLP = "opentelemetry.exporter.otlp.proto.http.trace_exporter"

events = []
def note(phase, info):
    if phase == "stop":
        module = sys.modules.get(OTLP)
        events.append((info["generation"], hasattr(module, "OTLPSpanExporter")))
gc.callbacks.append(note)
environ = {"OTEL_TRACES_SAMPLER": "parentbased_traceidratio", "OTEL_TRACES_SAMPLER_ARG": sys.argv[1]}
t = tracing.Tracing("fleetwire-client", endpoint="http://127.0.0.1:9", environ=environ)
if sys.argv[1] == "0":  # the first export of a ratio-0 tracer builds the exporter (in its thread: called here)
    assert OTLP not in sys.modules
    t._build_exporter()
gc.callbacks.remove(note)
print(OTLP in sys.modules, events[-1] if events else None, gc.isenabled())
t.shutdown()
"""


def _last_collection(ratio: str, *, disabled: bool = False) -> str:
    code = ("import gc; gc.disable()\n" if disabled else "") + _CODE
    return subprocess.run([sys.executable, "-c", code, ratio], capture_output=True, text=True, check=True,
                          timeout=60).stdout.strip()  # fmt: skip


def test_the_last_collection_while_a_tracer_imports_the_sdk_is_a_full_one_after_the_import() -> None:
    """At 1 % (the SDK imported when the tracer is built) and at ratio 0 (at its first export), the last
    collection the tracer's start makes is a full one (generation 2) with the exporter's module imported: nothing
    of the import is left pending; without it the last was a young one, the import's objects still pending."""
    assert _last_collection("0.01") == "True (2, True) True"
    assert _last_collection("0") == "True (2, True) True"


def test_an_application_that_turned_the_collector_off_gets_no_collection() -> None:
    """gc.disable() is the application's: the tracer collects nothing then."""
    out = _last_collection("0.01", disabled=True)
    assert out.startswith("True ") and out.endswith(" False") and "(2, True)" not in out
