"""W3C Trace Context on the wire: the ``traceparent`` a plan carries from its caller to every hop.

A ``submit`` may carry ``traceparent`` (docs/PROTOCOL.md §5, *Tracing*): the caller's span
context, as the W3C header writes it, ``00-<trace id: 32 hex>-<parent span id: 16 hex>-<flags: 2 hex>``.
The coordinator stores it with the plan (it is a field of the stored ``submit``, so it survives a
restart and a cluster failover) and hands it to each attempt's worker in ``assign.traceparent``;
the worker's handler spans are its children, and the inference handler forwards the header to the
engine. Sampling is the caller's: only a context whose ``sampled`` flag (bit 0 of the flags) is set
makes spans downstream (parent-based sampling); an unsampled or absent one costs one string test.

A caller whose sampler decided *not* to sample a plan and that has no context of its own (the SDK's
client outside any application span) sends :data:`UNSAMPLED`, ``"00"``: the flags of an unsampled
context without its ids. It costs no id drawn, no parse and three bytes on the wire and in the store,
yet the decision still reaches every hop: no span is made, and a worker hands its handler a fresh
unsampled W3C context (:func:`handler_traceparent`), so an engine the handler calls (vLLM) follows
the caller's "no" rather than deciding anew.

This module is pure (no OpenTelemetry import): it parses, checks and writes the header, so the
pure core can keep and test it. wireio/tracing.py turns a context into OpenTelemetry spans.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Final

__all__ = [
    "ACCEPTS_HEADER",
    "ACCEPTS_SHORT_UNSAMPLED",
    "MAX_TRACEPARENT",
    "UNSAMPLED",
    "UNSAMPLED_SHORT",
    "SpanContext",
    "format_traceparent",
    "handler_traceparent",
    "is_sampled",
    "parse_traceparent",
    "trace_id_of",
    "traceparent_problem",
]

#: Longest ``traceparent`` accepted (version 00 is 55 characters; later versions may append fields).
MAX_TRACEPARENT: Final = 256

UNSAMPLED: Final = "00"
"""The caller decided not to sample the plan and has no context to share (module docstring)."""

UNSAMPLED_SHORT: Final = "0"
""":data:`UNSAMPLED` in one character, which a decoder hands out as CPython's cached one-character string (no
allocation): the coordinator forwards it so in ``assign.traceparent`` to a worker whose ``hello`` says it reads it
(``capabilities.short_unsampled``, docs/PROTOCOL.md), and accepts it in ``submit.traceparent`` (kept as
:data:`UNSAMPLED`), which a client sends only to a coordinator known to accept it: an older one refuses it."""

ACCEPTS_HEADER: Final = "X-Fleetwire-Accepts"
"""A response header of a client session's websocket upgrade (``101``): what this coordinator accepts beyond what
every coordinator does, as comma-separated tokens (docs/PROTOCOL.md §1). The client session has no ``welcome``, so a
client reads it at each connect: a reconnect may reach another coordinator (a cluster mid-upgrade)."""

ACCEPTS_SHORT_UNSAMPLED: Final = "short-unsampled"
"""The :data:`ACCEPTS_HEADER` token saying ``submit.traceparent`` may be :data:`UNSAMPLED_SHORT`."""

_V00: Final = re.compile(r"00-(?!0{32})[0-9a-f]{32}-(?!0{16})[0-9a-f]{16}-[0-9a-f]{2}")  # the usual header, one match
_TRACEPARENT: Final = re.compile(r"([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})(-[-0-9a-zA-Z_.]*)?")
_ZERO_TRACE: Final = "0" * 32
_ZERO_SPAN: Final = "0" * 16
_ODD_HEX: Final = "13579bdfBDF"


@dataclass(frozen=True, slots=True)
class SpanContext:
    """One parsed ``traceparent``: the trace, the parent span and whether the caller sampled it."""

    trace_id: str  # 32 lower-case hex digits, never all zero
    span_id: str  # 16 lower-case hex digits, never all zero
    flags: int  # the trace flags; bit 0 is ``sampled``

    @property
    def sampled(self) -> bool:
        """Whether the caller recorded its span: downstream hops record theirs only then."""
        return bool(self.flags & 1)

    @property
    def traceparent(self) -> str:
        """The version-00 header of this context."""
        return format_traceparent(self.trace_id, self.span_id, sampled=self.sampled)


def traceparent_problem(text: str) -> str | None:
    """Why ``text`` is not a ``traceparent`` the coordinator keeps, naming the rule; None when it is
    one (or empty: no context)."""
    if not text or text == UNSAMPLED or text == UNSAMPLED_SHORT or _V00.fullmatch(text) is not None:
        return None
    if len(text) > MAX_TRACEPARENT:
        return f"traceparent is {len(text)} characters; at most {MAX_TRACEPARENT}"
    match = _TRACEPARENT.fullmatch(text)
    if match is None:
        return (f"traceparent {text[:80]!r} is not a W3C traceparent: 00-<32 hex trace id>-<16 hex span id>-"
                "<2 hex flags>, lower case")  # fmt: skip
    version, trace_id, span_id, _flags, rest = match.groups()
    if version == "ff":
        return f"traceparent {text!r}: version ff is invalid"
    if version == "00" and rest:
        return f"traceparent {text!r}: version 00 has exactly four fields"
    if trace_id == _ZERO_TRACE:
        return f"traceparent {text!r}: the trace id is all zeros"
    if span_id == _ZERO_SPAN:
        return f"traceparent {text!r}: the parent span id is all zeros"
    return None


def parse_traceparent(text: str) -> SpanContext | None:
    """The context a ``traceparent`` names; None when it is empty or invalid (:func:`traceparent_problem`)."""
    if len(text) < 55 or traceparent_problem(text) is not None:
        return None
    _, trace_id, span_id, flags = text.split("-")[:4]
    return SpanContext(trace_id=trace_id, span_id=span_id, flags=int(flags, 16))


def format_traceparent(trace_id: str | int, span_id: str | int, *, sampled: bool) -> str:
    """The version-00 ``traceparent`` of a trace and span (hex strings, or OpenTelemetry's integers)."""
    trace = trace_id if isinstance(trace_id, str) else f"{trace_id:032x}"
    span = span_id if isinstance(span_id, str) else f"{span_id:016x}"
    return f"00-{trace}-{span}-{'01' if sampled else '00'}"


def trace_id_of(text: str) -> str:
    """The trace id of a valid ``traceparent`` (``""``: none). Cheap: no full parse."""
    return text[3:35] if len(text) >= 55 else ""


def is_sampled(text: str) -> bool:
    """Whether a (valid) ``traceparent`` has its ``sampled`` flag set: bit 0 of the flags, so their last hex
    digit is odd. One index and a test (no int parse: a hot-path check, several per plan)."""
    return len(text) >= 55 and text[54] in _ODD_HEX


_POOL_SIZE: Final = 256
_pool: list[str] = []


def handler_traceparent(text: str) -> str:
    """The context a handler passes on for a plan's ``traceparent``: itself, or for :data:`UNSAMPLED` a fresh
    unsampled W3C context (random ids, flags ``00``), so what the handler calls follows the caller's decision.
    (:data:`UNSAMPLED_SHORT` is a wire form only: the worker's runner stores it as :data:`UNSAMPLED`.)
    The ids are drawn 256 contexts at a time (one ``os.urandom`` and one hex); the worker calls this only when a
    handler reads ``ctx.traceparent`` (worker_agent/handlers.py), as each call costs ~0.4 µs."""
    if text != UNSAMPLED:
        return text
    if not _pool:
        digits = os.urandom(24 * _POOL_SIZE).hex()
        _pool.extend(f"00-{digits[i : i + 32]}-{digits[i + 32 : i + 48]}-00" for i in range(0, 48 * _POOL_SIZE, 48))
    return _pool.pop()
