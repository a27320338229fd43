"""The SDK's side of a plan's trace: the ``submit`` carries the caller's context (docs/OPERATIONS.md §Tracing).

* With tracing on for the client (``OTEL_EXPORTER_OTLP_ENDPOINT`` set, ``fleetwire[otel]``
  installed: wireio/tracing.py), the client's sampler (``OTEL_TRACES_SAMPLER``, default parent-based
  always-on) decides for each submitted plan, once: inside the caller's current OpenTelemetry span
  the parent-based samplers follow its ``sampled`` flag; outside any span it is a ratio test
  (:class:`~wireio.tracing.Sampler`, a few hundred ns, no OpenTelemetry call). A sampled plan gets a
  ``fleetwire.submit`` span (kind producer, service ``fleetwire-client``), child of the caller's span
  or the root of a new trace, and its ``submit.traceparent`` is that span's context; the span ends
  when the coordinator accepts (or refuses) the plan. An unsampled plan carries the caller's
  context when there is one (its flag says "not sampled": no hop makes a span), else ``"00"``
  (protocol/tracecontext.py ``UNSAMPLED``: the decision without ids, three bytes; the worker
  hands its handler, and so the inference engine, a fresh unsampled context), or ``"0"`` on a
  connection whose coordinator says it accepts it (``UNSAMPLED_SHORT``: fleetwire/connection.py
  ``unsampled_form``, read at each connect; the session's ``unsampled``). At a ratio under 1
  the sampler draws only the gaps between sampled plans: an unsampled plan costs no draw.
* With tracing off, a caller that uses OpenTelemetry itself (it imported it and has a current span)
  still gets its context carried: ``submit.traceparent`` is that span's, so the coordinator's and
  the workers' spans join the caller's trace when they trace. Nothing is imported for it.
* Neither: ``traceparent`` stays empty and nothing else runs.

One :class:`~wireio.tracing.Tracing` serves every ``Client`` of a process (:func:`client_tracing`), so
``Client.close`` leaves it running; it exports what is still queued when the process exits, for up to its
``exit_wait_s`` (15 s): against a collector that never answers the exit waits no longer (the spans not
exported by then are counted dropped and logged). It exports in a thread of the application's
process (the OpenTelemetry SDK is imported there), unless ``FLEETWIRE_TRACE_EXPORT=process``: then a
child process does (wireio/span_export.py), as for the coordinator and the workers. A library does
not start processes in its host unasked, nor freeze its collector: docs/OPERATIONS.md §Tracing says
what each choice costs.
"""

from __future__ import annotations

import atexit
from collections.abc import Sequence
from typing import Final

from protocol.messages import Submit
from protocol.tracecontext import UNSAMPLED, UNSAMPLED_SHORT
from wireio.tracing import SERVICE_CLIENT, LiveSpan, Tracing, current_traceparent

__all__ = ["LiveSpan", "client_tracing", "end_submit_spans", "start_submit_spans", "submit_context"]

_UNSET: Final = object()
_tracing: object = _UNSET


def client_tracing() -> Tracing | None:
    """The client's tracer, built on first use from the standard variables (None: tracing is off).

    Raises:
        ValueError: tracing asked for without the OpenTelemetry SDK installed.
    """
    global _tracing
    if _tracing is _UNSET:
        _tracing = Tracing.from_env(SERVICE_CLIENT)
        if _tracing is not None:
            atexit.register(_tracing.shutdown)  # a CLI process's spans leave before it does
    return _tracing if isinstance(_tracing, Tracing) else None


def submit_context(unsampled: str = UNSAMPLED) -> str:
    """The ``traceparent`` every submit of a call carries unless its own span is sampled (module docstring): the
    caller's context (flag and all), else ``unsampled`` (the connection's form of "not sampled": ``"00"`` or
    ``"0"``) with tracing on, else ``""``. A batch sets it on the template its submits are copied from
    (fleetwire/submits.py), then :func:`start_submit_spans` with ``preset``.

    Raises:
        ValueError: tracing asked for without the OpenTelemetry SDK installed.
    """
    return current_traceparent() or (unsampled if client_tracing() is not None else "")


def start_submit_spans(
    msgs: Sequence[Submit], preset: str | None = None, unsampled: str = UNSAMPLED
) -> list[LiveSpan] | None:
    """Give each submit its ``traceparent`` (module docstring); the sampled ones' spans, to end once answered (None:
    none).

    ``preset``: what :func:`submit_context` returned, already carried by each of ``msgs`` (copied from a template
    that held it): only the sampled ones are set, so at a ratio an unsampled plan costs no work here.
    ``unsampled``: without ``preset``, the connection's form of "not sampled" (``"00"``, or ``"0"`` where the
    coordinator accepts it: the session's ``unsampled``).

    Each call runs as few Python functions as it can (the tracer read here, not through :func:`client_tracing`, once
    built): a lone submit's are mostly out of the CPU's caches, so each one costs far more than its instructions
    (docs/PERFORMANCE.md §T32h).
    """
    tracing = _tracing if isinstance(_tracing, Tracing) else client_tracing()
    if preset is None:
        parent = current_traceparent()
        carried = parent or (unsampled if tracing is not None else "")
        if carried:
            for msg in msgs:
                msg.traceparent = carried
    else:
        parent = "" if preset == UNSAMPLED or preset == UNSAMPLED_SHORT else preset
    if tracing is None:
        return None
    sampled = tracing.start_each("fleetwire.submit", parent, msgs, _submit_attributes, kind="producer")
    if not sampled:
        return None
    for i, span in sampled:
        msgs[i].traceparent = span.traceparent
    return [span for _, span in sampled]


def _submit_attributes(msg: Submit) -> dict[str, str | int | float | bool]:
    return {"fleetwire.op": msg.op, "fleetwire.plan_id": msg.plan_id or ""}


def end_submit_spans(spans: Sequence[LiveSpan | None] | None, error: str = "") -> None:
    """The submits were answered: their spans end (``error``: the refusal's code)."""
    for span in spans or ():
        if span is not None:
            span.end(error)
