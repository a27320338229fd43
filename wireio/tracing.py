"""OpenTelemetry traces for the client, the coordinator and the worker (docs/OPERATIONS.md §Tracing).

Optional: ``pip install 'fleetwire[otel]'`` brings the OpenTelemetry SDK and its OTLP/HTTP
exporter. Nothing here imports OpenTelemetry until a :class:`Tracing` is built, and one is built
only when tracing is asked for: an ``OTEL_EXPORTER_OTLP_ENDPOINT`` (or ``..._TRACES_ENDPOINT``) in
the environment, or a flag (``--otlp-endpoint``). Off, a plan costs one empty-string test per hop.

Theory of operation:

* Each service has its own :class:`Tracing` (its own ``TracerProvider``, never the global one, so
  a test can run a client, a coordinator and a worker in one process): service names
  ``fleetwire-client``, ``fleetwire-coordinator``, ``fleetwire-worker`` unless ``OTEL_SERVICE_NAME``
  says otherwise; the sampler is ``OTEL_TRACES_SAMPLER`` (default ``parentbased_always_on``).
* Spans are linked by W3C ``traceparent`` strings (protocol/tracecontext.py), never by a context
  carried in the process: the SDK's submit span's context rides in ``submit.traceparent``, the
  coordinator stores it with the plan and hands it to each attempt in ``assign.traceparent``.
  :meth:`Tracing.record` writes a finished span with explicit times (the coordinator's spans, built
  from what its core noted), :meth:`Tracing.start` a live one (the worker's attempt and handler).
* Parent-based: a parent whose ``sampled`` flag is clear makes no span here (:meth:`record` and
  :meth:`start` return at once); the caller decided.
* Spans leave through a ``BatchSpanProcessor`` (its own thread, bounded queue: a slow collector
  drops spans, never stalls a session) to OTLP over HTTP/protobuf. :meth:`Tracing.shutdown` flushes.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable, Mapping
from typing import Any, Final

from protocol.tracecontext import format_traceparent, is_sampled, parse_traceparent

__all__ = [
    "SERVICE_CLIENT",
    "SERVICE_COORDINATOR",
    "SERVICE_WORKER",
    "LiveSpan",
    "Tracing",
    "current_traceparent",
    "tracing_requested",
]

SERVICE_CLIENT: Final = "fleetwire-client"
SERVICE_COORDINATOR: Final = "fleetwire-coordinator"
SERVICE_WORKER: Final = "fleetwire-worker"

Attributes = Mapping[str, str | int | float | bool]
Event = tuple[str, int, Attributes]
"""A span event: its name, when (Unix ns) and its attributes."""

_MISSING: Final = (
    "tracing needs the OpenTelemetry SDK and its OTLP/HTTP exporter: pip install 'fleetwire[otel]' "
    "(opentelemetry-sdk, opentelemetry-exporter-otlp-proto-http)"
)


def tracing_requested(environ: Mapping[str, str] | None = None, endpoint: str | None = None) -> bool:
    """Whether tracing is on: an endpoint given, or the standard variables name one (and
    ``OTEL_SDK_DISABLED`` is not ``true``, ``OTEL_TRACES_EXPORTER`` not ``none``)."""
    env = os.environ if environ is None else environ
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    if env.get("OTEL_TRACES_EXPORTER", "otlp").strip().lower() == "none":
        return False
    return bool(endpoint or env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_ENDPOINT"))


def current_traceparent() -> str:
    """The ``traceparent`` of the caller's current OpenTelemetry span, if the application uses
    OpenTelemetry (already imported it) and has a valid one; ``""`` otherwise. Imports nothing."""
    trace = sys.modules.get("opentelemetry.trace")
    if trace is None:
        return ""
    context = trace.get_current_span().get_span_context()
    if not context.is_valid:
        return ""
    return format_traceparent(context.trace_id, context.span_id, sampled=bool(context.trace_flags & 1))


class LiveSpan:
    """A span under way (:meth:`Tracing.start`): its ``traceparent`` for children, then :meth:`end`."""

    __slots__ = ("_span", "traceparent")

    def __init__(self, span: Any, traceparent: str) -> None:
        self._span = span
        self.traceparent = traceparent

    def set(self, key: str, value: str | int | float | bool) -> None:
        """Set an attribute."""
        self._span.set_attribute(key, value)

    def event(self, name: str, attributes: Attributes | None = None) -> None:
        """Add an event, now."""
        self._span.add_event(name, dict(attributes or {}))

    def end(self, error: str = "") -> None:
        """End it; ``error`` (a code or message) marks it failed."""
        if error:
            from opentelemetry.trace import Status, StatusCode

            self._span.set_status(Status(StatusCode.ERROR, error))
        self._span.end()


class Tracing:
    """One service's tracer: spans to OTLP/HTTP (module docstring).

    Args:
        service: the default service name (``OTEL_SERVICE_NAME`` in ``environ`` wins unless
            ``service_name`` is given).
        endpoint: the collector's base URL (``/v1/traces`` is appended) or full traces URL; None:
            the standard variables say.
        environ: where ``OTEL_*`` are read (default: the process's).
        exporter: a span exporter to use instead of OTLP/HTTP (an in-memory one in tests).
        service_name: this exact service name, whatever ``OTEL_SERVICE_NAME`` says.

    Raises:
        ValueError: the OpenTelemetry SDK is not installed (the message says what to install).
    """

    def __init__(
        self, service: str, *, endpoint: str | None = None, environ: Mapping[str, str] | None = None,
        exporter: Any = None, service_name: str | None = None,
    ) -> None:  # fmt: skip
        env = os.environ if environ is None else environ
        try:
            from opentelemetry import trace
            from opentelemetry.sdk.resources import Resource
            from opentelemetry.sdk.trace import TracerProvider
            from opentelemetry.sdk.trace.export import BatchSpanProcessor
        except ImportError:
            raise ValueError(_MISSING) from None
        if exporter is None:
            try:
                from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
            except ImportError:
                raise ValueError(_MISSING) from None
            exporter = OTLPSpanExporter(endpoint=_traces_url(endpoint) if endpoint else None)
        self.service = service_name or env.get("OTEL_SERVICE_NAME") or service
        self._trace = trace
        self.provider = TracerProvider(resource=Resource.create({"service.name": self.service}),
                                       shutdown_on_exit=False)  # fmt: skip
        self.provider.add_span_processor(BatchSpanProcessor(exporter))
        self.tracer = self.provider.get_tracer("fleetwire")
        kinds = trace.SpanKind
        self._kinds = {"internal": kinds.INTERNAL, "client": kinds.CLIENT, "server": kinds.SERVER,
                       "producer": kinds.PRODUCER, "consumer": kinds.CONSUMER}  # fmt: skip

    @classmethod
    def from_env(cls, service: str, *, endpoint: str | None = None,
                 environ: Mapping[str, str] | None = None) -> Tracing | None:  # fmt: skip
        """A tracer when tracing is asked for (:func:`tracing_requested`), else None.

        Raises:
            ValueError: asked for, without the SDK installed.
        """
        if not tracing_requested(environ, endpoint):
            return None
        return cls(service, endpoint=endpoint, environ=environ)

    def _parent(self, traceparent: str) -> Any:
        """The OpenTelemetry context whose span is the remote parent ``traceparent`` names (None: a new trace)."""
        trace = self._trace
        parsed = parse_traceparent(traceparent)
        if parsed is None:
            return None
        context = trace.SpanContext(
            trace_id=int(parsed.trace_id, 16), span_id=int(parsed.span_id, 16), is_remote=True,
            trace_flags=trace.TraceFlags(parsed.flags & 0xFF),
        )  # fmt: skip
        return trace.set_span_in_context(trace.NonRecordingSpan(context))

    def start(self, name: str, parent: str = "", attributes: Attributes | None = None, *, kind: str = "internal",
              start_ns: int | None = None, root: bool = False) -> LiveSpan | None:  # fmt: skip
        """Start a span, child of ``parent``; None when ``parent`` is unsampled or absent (unless
        ``root``: then an absent parent starts a new trace, which the sampler may sample)."""
        if parent and not is_sampled(parent):
            return None
        if not parent and not root:
            return None
        span = self.tracer.start_span(name, context=self._parent(parent) if parent else None,
                                      kind=self._kinds[kind], attributes=dict(attributes or {}),
                                      start_time=start_ns)  # fmt: skip
        context = span.get_span_context()
        return LiveSpan(span, format_traceparent(context.trace_id, context.span_id,
                                                 sampled=bool(context.trace_flags & 1)))  # fmt: skip

    def record(self, name: str, parent: str, start_ns: int, end_ns: int, attributes: Attributes | None = None, *,
               events: Iterable[Event] = (), kind: str = "internal", error: str = "") -> str:  # fmt: skip
        """Write a finished span, child of ``parent``, from ``start_ns`` to ``end_ns`` (Unix ns);
        returns its ``traceparent`` (``""``: the parent is unsampled, nothing written)."""
        if not is_sampled(parent):
            return ""
        span = self.tracer.start_span(name, context=self._parent(parent), kind=self._kinds[kind],
                                      attributes=dict(attributes or {}), start_time=start_ns)  # fmt: skip
        for event_name, at_ns, event_attributes in events:
            span.add_event(event_name, dict(event_attributes), timestamp=at_ns)
        if error:
            span.set_status(self._trace.Status(self._trace.StatusCode.ERROR, error))
        context = span.get_span_context()
        span.end(end_time=max(start_ns, end_ns))
        return format_traceparent(context.trace_id, context.span_id, sampled=True)

    def flush(self, timeout_s: float = 5.0) -> bool:
        """Export what is queued now; whether it all went within ``timeout_s``."""
        return bool(self.provider.force_flush(int(timeout_s * 1000)))

    def shutdown(self) -> None:
        """Flush and stop the exporter's thread."""
        self.provider.shutdown()


def _traces_url(endpoint: str) -> str:
    """A collector's base URL as its OTLP/HTTP traces URL (a full ``.../v1/traces`` URL is kept)."""
    endpoint = endpoint.rstrip("/")
    return endpoint if endpoint.endswith("/v1/traces") else f"{endpoint}/v1/traces"
