"""A real OTLP/HTTP trace receiver for tests: decodes what the OpenTelemetry exporter posts.

It is what a collector's ``otlphttp`` receiver does, reduced to traces: ``POST /v1/traces`` with an
``ExportTraceServiceRequest`` (protobuf, optionally gzip), decoded with the ``opentelemetry-proto``
package and kept as :class:`ReceivedSpan` rows; answered ``200`` with an empty response. It runs in
a thread of its own (the exporter posts from its processor's thread), on 127.0.0.1.
"""

from __future__ import annotations

import gzip
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

__all__ = ["OtlpReceiver", "ReceivedSpan"]


def _value(any_value: Any) -> Any:
    kind = any_value.WhichOneof("value")
    return getattr(any_value, kind) if kind else None


@dataclass
class ReceivedSpan:
    """One span as the receiver decoded it (ids in lower-case hex, times in Unix ns)."""

    service: str
    name: str
    trace_id: str
    span_id: str
    parent_span_id: str
    start_ns: int
    end_ns: int
    attributes: dict[str, Any] = field(default_factory=dict)
    events: list[str] = field(default_factory=list)
    error: bool = False


class OtlpReceiver:
    """``with OtlpReceiver() as rx:`` — ``rx.endpoint`` for ``OTEL_EXPORTER_OTLP_ENDPOINT``, ``rx.spans``."""

    def __init__(self) -> None:
        self.spans: list[ReceivedSpan] = []
        self.headers: list[dict[str, str]] = []  # each request's HTTP headers (names lower case)
        self.requests = 0
        self._changed = threading.Condition()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                receiver.headers.append({k.lower(): v for k, v in self.headers.items()})
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                if self.path != "/v1/traces":
                    self.send_error(404)
                    return
                request = ExportTraceServiceRequest()
                request.ParseFromString(body)
                receiver._take(request)
                answer = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.endpoint = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, name="otlp-receiver", daemon=True)

    def __enter__(self) -> OtlpReceiver:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(5)

    def _take(self, request: ExportTraceServiceRequest) -> None:
        rows = []
        for resource_spans in request.resource_spans:
            attributes = {a.key: _value(a.value) for a in resource_spans.resource.attributes}
            service = str(attributes.get("service.name", ""))
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    rows.append(ReceivedSpan(
                        service=service, name=span.name, trace_id=span.trace_id.hex(), span_id=span.span_id.hex(),
                        parent_span_id=span.parent_span_id.hex(), start_ns=span.start_time_unix_nano,
                        end_ns=span.end_time_unix_nano, attributes={a.key: _value(a.value) for a in span.attributes},
                        events=[e.name for e in span.events], error=span.status.code == 2,
                    ))  # fmt: skip
        with self._changed:
            self.requests += 1
            self.spans.extend(rows)
            self._changed.notify_all()

    def wait_for(self, condition: Callable[[list[ReceivedSpan]], bool], timeout_s: float = 20.0) -> list[ReceivedSpan]:
        """Block until ``condition(spans)`` holds (checked at each export): the spans; TimeoutError past it."""
        with self._changed:
            if not self._changed.wait_for(lambda: condition(self.spans), timeout_s):
                names = sorted(f"{s.service}:{s.name}" for s in self.spans)
                raise TimeoutError(f"the receiver did not get the spans looked for in {timeout_s} s; it has {names}")
            return list(self.spans)

    def trace(self, trace_id: str) -> list[ReceivedSpan]:
        """The spans received of one trace."""
        with self._changed:
            return [s for s in self.spans if s.trace_id == trace_id]
