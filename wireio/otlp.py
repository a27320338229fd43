"""OTLP's ``ExportTraceServiceRequest`` encoded by hand from noted spans (docs/OPERATIONS.md §Tracing).

The SDK's OTLP encoder (``encode_spans``) builds a protobuf message per span, attribute and value
from ``ReadableSpan`` objects that wireio/span_export.py would first build from each noted span
(:data:`wireio.span_export.RawSpan`): ~15 µs a span on the 2-core VM, the larger part of what
tracing at 100 % cost. :class:`SpanEncoder` writes the same request's protobuf bytes straight from
the tuples, in one pass per batch: the resource and scope (encoded once, when the encoder is
built), then per span its ids, name, kind, times, attributes, events, status and flags, with the
pieces that repeat (names, attribute keys, kinds, a key's recent values) encoded once and kept. A
span's ids and times are one ``struct`` call; the coordinator's spans (:meth:`SpanEncoder.commits`,
:meth:`SpanEncoder.queue`) are written from their fields as wireio/span_export.py ``StepSpans``
makes them, with their remote parent's ids' fields kept per ``traceparent`` (a plan's spans share
them), and :meth:`SpanEncoder.encode` takes such bytes as they are. Fields are written in the
order that is cheapest (protobuf decoders take any order). The bytes decode to the message the
SDK's encoder makes of the same span (tests/unit/test_otlp_encode.py parses both with
opentelemetry-proto); any OTLP/HTTP collector takes them. Pure Python, no OpenTelemetry import; the
compiled build (setup.py ``COMPILED``) compiles it with mypyc, to the same bytes
(tests/unit/test_otlp_compiled.py), so its annotations hold at run time there.

Field numbers are opentelemetry-proto's ``trace/v1/trace.proto``, ``common/v1/common.proto`` and
``resource/v1/resource.proto``. Values: ``str``, ``bool``, ``int`` (int64; past it, its decimal
string, where the SDK's encoder would fail the whole batch), ``float`` (double) and sequences of
them (an ``ArrayValue``); anything else is written as its ``str()``.
"""

from __future__ import annotations

import binascii
import random
import struct
from collections.abc import Container, Iterable, Mapping, Sequence
from typing import Any, Final

__all__ = [
    "COMMIT_SPAN",
    "COMPACT_SPANS",
    "LIVE_BASE",
    "LIVE_SPANS",
    "QUEUE_KEYS",
    "SpanEncoder",
    "encode_attributes",
    "expand",
]

_KINDS: Final = ("internal", "server", "client", "producer", "consumer")  # SpanKind 1..5 in the proto
_FLAGS_HAS_IS_REMOTE: Final = 0x100  # SpanFlags.SPAN_FLAGS_CONTEXT_HAS_IS_REMOTE_MASK
_FLAGS_IS_REMOTE: Final = 0x200  # SpanFlags.SPAN_FLAGS_CONTEXT_IS_REMOTE_MASK
_STATUS_UNSET: Final = b"\x7a\x00"  # Span.status (15): an empty Status, as the SDK's encoder writes it
_FLAGS_LOCAL: Final = b"\x85\x01" + struct.pack("<I", _FLAGS_HAS_IS_REMOTE)  # Span.flags (16, fixed32)
_FLAGS_REMOTE: Final = b"\x85\x01" + struct.pack("<I", _FLAGS_HAS_IS_REMOTE | _FLAGS_IS_REMOTE)
_TIMES: Final = struct.Struct("<BQBQ").pack  # start_time_unix_nano (7) and end_time_unix_nano (8), fixed64
_LOCAL_END: Final = _STATUS_UNSET + _FLAGS_LOCAL  # a span's last two fields, as they mostly are
_REMOTE_END: Final = _STATUS_UNSET + _FLAGS_REMOTE
_DRAWN_HEAD: Final = struct.Struct("<28sBBQBQBQ").pack
"""A span with a remote parent and an id drawn here: its trace and parent ids' fields (:meth:`SpanEncoder._context`),
span_id (2: random bits, so their byte order is no matter) and both times, in one call. Fields may come in any
order (protobuf), so the ids go first and the span id after them."""
_ROOTED_HEAD: Final = struct.Struct("<2s16s2s8s2s8sBQBQ").pack  # trace_id, span_id, parent_span_id (1, 2, 4), times
_ROOT_HEAD: Final = struct.Struct("<2s16s2s8sBQBQ").pack  # trace_id, span_id (1, 2), times: a root span
_CONTEXTS: Final = 16_384  # remote parents whose ids' fields are kept (a plan's spans share one; then it starts again)
_EVENT_TIME: Final = struct.Struct("<BQ").pack  # Event.time_unix_nano (1), fixed64
_DOUBLE: Final = struct.Struct("<d").pack
_SMALL: Final = tuple(bytes((n,)) for n in range(128))
_INT64_MIN: Final = -(1 << 63)
_INT64_MAX: Final = (1 << 63) - 1
_getrandbits: Final = random.getrandbits
_unhex: Final = binascii.unhexlify  # hex ids to bytes: half the instructions of bytes.fromhex (no whitespace)


def _varint(n: int) -> bytes:
    if 0 <= n < 128:
        return _SMALL[n]
    if n < 0:
        n += 1 << 64  # int64: ten bytes, two's complement
    out = bytearray()
    while n >= 128:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _field(tag: int, body: bytes) -> bytes:
    """A length-delimited field: its tag byte (fields 1-15), the length, the bytes."""
    n = len(body)
    return bytes((tag, n)) + body if n < 128 else _SMALL[tag] + _varint(n) + body


def _any_value(value: Any) -> bytes:
    """An ``AnyValue``'s bytes."""
    cls = value.__class__
    if cls is str:
        return _field(0x0A, value.encode())  # string_value (1)
    if cls is bool:
        return b"\x10\x01" if value else b"\x10\x00"  # bool_value (2)
    if cls is int:  # int_value (3): an int64; one past it is written as its decimal string (never a bad varint)
        return b"\x18" + _varint(value) if _INT64_MIN <= value <= _INT64_MAX else _field(0x0A, str(value).encode())
    if cls is float:
        return b"\x21" + _DOUBLE(value)  # double_value (4)
    if isinstance(value, int):  # an int subclass (an IntEnum; bool has none, above)
        return _any_value(int(value))
    if isinstance(value, float):
        return b"\x21" + _DOUBLE(float(value))
    if isinstance(value, (list, tuple)):  # array_value (5): ArrayValue.values (1)
        return _field(0x2A, b"".join(_field(0x0A, _any_value(v)) for v in value))
    return _field(0x0A, str(value).encode())


def encode_attributes(tag: int, attributes: Mapping[str, Any] | None, keys: dict[str, bytes] | None = None) -> bytes:
    """``KeyValue`` fields (``tag``: the field's tag byte in its message) of ``attributes``; ``keys`` caches
    each key's encoded ``KeyValue.key``."""
    if not attributes:
        return b""
    parts = []
    for key, value in attributes.items():
        head = keys.get(key) if keys is not None else None
        if head is None:
            head = _field(0x0A, key.encode())  # KeyValue.key (1)
            if keys is not None and len(keys) < 4096:
                keys[key] = head
        parts.append(_field(tag, head + _field(0x12, _any_value(value))))  # KeyValue.value (2)
    return b"".join(parts)


COMMIT_SPAN: Final = 0
COMPACT_SPANS: Final = (("fleetwire.store.commit", ("fleetwire.plan_id", "fleetwire.attempt", "fleetwire.event")),)
"""Spans noted compactly (``Tracing.add_compact``) as ``(template, traceparent, start ns, end ns, *values)``: the
template's index here names the span and its attribute keys; an internal span, child of the (remote) parent the
``traceparent`` names, its id drawn where it is exported. Less to build on the noting process's hot path and to
ship and unpack than a :data:`wireio.span_export.RawSpan` (the coordinator's commit spans, two a plan)."""

LIVE_BASE: Final = 16
"""The first template number of :data:`LIVE_SPANS` (those of :data:`COMPACT_SPANS` are under it)."""
LIVE_SPANS: Final = (
    ("fleetwire.attempt", "consumer", ("fleetwire.plan_id", "fleetwire.attempt", "fleetwire.op", "fleetwire.worker_id",
                                       "fleetwire.outcome")),
    ("fleetwire.attempt", "consumer", ("fleetwire.plan_id", "fleetwire.attempt", "fleetwire.op", "fleetwire.worker_id",
                                       "fleetwire.devices", "fleetwire.outcome")),
    ("fleetwire.handler", "internal", ("fleetwire.plan_id",)),
    ("fleetwire.inputs", "internal", ("fleetwire.inputs",)),
)  # fmt: skip
"""Live spans of a fixed shape (the worker's: worker_agent/plan_tracing.py), noted by ``LiveSpan.end`` as ``(LIVE_BASE +
i, trace id hex, span id, parent id (its hex: a remote parent; an int: a local one), start ns, end ns, error,
*values)``: ``LIVE_SPANS[i]`` names the span, its kind and its attribute keys, the values come in that order (the
first ones: fewer values, fewer attributes). No attributes dict to pack, unpack and walk by key."""
LIVE_ATTEMPT: Final = LIVE_BASE
LIVE_ATTEMPT_DEVICES: Final = LIVE_BASE + 1
LIVE_HANDLER: Final = LIVE_BASE + 2
LIVE_INPUTS: Final = LIVE_BASE + 3

QUEUE_KEYS: Final = ("fleetwire.plan_id", "fleetwire.attempt", "fleetwire.wait_reason", "fleetwire.policy",
                     "fleetwire.worker_id")  # fmt: skip
"""The attributes of the coordinator's ``fleetwire.queue`` span, in order (:meth:`SpanEncoder.queue`)."""


def expand(raw: Sequence[Any]) -> tuple[Any, ...]:
    """A noted span as a :data:`wireio.span_export.RawSpan`: a compact one expanded, any other as it is."""
    if raw[0].__class__ is str:
        return tuple(raw)
    if raw[0] >= LIVE_BASE:
        live_name, kind, live_keys = LIVE_SPANS[raw[0] - LIVE_BASE]
        parent = raw[3]
        return (live_name, raw[1], raw[2], parent, parent.__class__ is str, raw[4], raw[5],
                dict(zip(live_keys, raw[7:], strict=False)), None, kind, raw[6])  # fmt: skip
    name, keys = COMPACT_SPANS[raw[0]]
    traceparent = raw[1]
    return (name, traceparent[3:35], _getrandbits(64) or 1, traceparent[36:52], True, raw[2], raw[3],
            dict(zip(keys, raw[4:], strict=False)), None, "internal", "")  # fmt: skip


_KV_CACHE: Final = 8192  # events whose encoding is kept (then the cache starts again)
_VALUES_PER_KEY: Final = 4096  # values of one attribute key whose encoding is kept (then it starts a new table)
_KEYS: Final = 64  # attribute keys whose values are kept (past it, a key's values are encoded every time)
_HEAD: Final = None  # in a key's table: the encoded KeyValue.key
_PREVIOUS: Final = ()  # ... and the table it replaced when it filled (a plan's spans come ~1,000-5,000 plans apart)


def _turn(values: dict[Any, Any]) -> None:
    """A full key's table starts again, keeping its values as the previous table (the one before is dropped)."""
    previous = dict(values)
    del previous[_HEAD]
    previous.pop(_PREVIOUS, None)
    head = values[_HEAD]
    values.clear()
    values[_HEAD] = head
    values[_PREVIOUS] = previous


def _attribute(head: bytes, value: Any) -> bytes:
    """A ``Span.attributes`` (9) field: ``head`` (the encoded ``KeyValue.key``) and the value."""
    if value.__class__ is str:
        v = value.encode()
        n = len(v)
        if n < 100 and len(head) < 24:  # every length one byte
            return b"".join((bytes((0x4A, len(head) + n + 4)), head, bytes((0x12, n + 2, 0x0A, n)), v))
    return _field(0x4A, head + _field(0x12, _any_value(value)))


def _kept(values: dict[Any, Any], value: Any) -> bytes:
    """A value missing from its key's table: from the previous table, else encoded; kept in the table (a ``str`` or an
    ``int``: never a bool or a float, since True == 1 == 1.0 would find another type's field)."""
    cls = value.__class__
    if cls is not str and cls is not int:
        return _attribute(values[_HEAD], value)
    previous = values.get(_PREVIOUS)
    field = previous.get(value) if previous is not None else None
    if field is None:
        field = _attribute(values[_HEAD], value)
    if len(values) > _VALUES_PER_KEY:  # a plan id's key: the latest plans' ids, in two tables
        _turn(values)
    values[value] = field
    return field


class SpanEncoder:
    """One service's spans as ``ExportTraceServiceRequest`` bytes (module docstring).

    Args:
        resource: the resource's attributes (``service.name`` and what the SDK's ``Resource.create`` adds).
        scope: the instrumentation scope's name.
        resource_schema_url: the resource's schema URL ("" when none).
    """

    def __init__(self, resource: Mapping[str, Any], scope: str = "fleetwire", resource_schema_url: str = "") -> None:
        self._keys: dict[str, bytes] = {}
        self._by_key: dict[str, dict[Any, Any]] = {}  # key -> {str or int value: its Span.attributes field}
        self._names: dict[str, bytes] = {}
        self._events: dict[tuple[Any, ...], bytes] = {}  # (name, *attribute items) -> Event.name and .attributes
        self._contexts: dict[str, bytes] = {}  # traceparent -> its children's trace and parent ids' fields
        self._kinds = {kind: bytes((0x30, i + 1)) for i, kind in enumerate(_KINDS)}  # Span.kind (6)
        resource_body = encode_attributes(0x0A, resource)  # Resource.attributes (1)
        self._resource = _field(0x0A, resource_body)  # ResourceSpans.resource (1)
        self._resource_schema = _field(0x1A, resource_schema_url.encode()) if resource_schema_url else b""
        self._scope = _field(0x0A, _field(0x0A, scope.encode()))  # ScopeSpans.scope (1): InstrumentationScope.name
        # each compact template's Span.name (5) and kind (6), and its keys' tables (kept whatever _KEYS says)
        self._templates = [(_field(0x2A, name.encode()) + b"\x30\x01",
                            tuple(self._by_key.setdefault(key, {_HEAD: _field(0x0A, key.encode())}) for key in keys))
                           for name, keys in COMPACT_SPANS]  # fmt: skip
        self._live = [(_field(0x2A, name.encode()) + self._kinds[kind],
                       tuple(self._by_key.setdefault(key, {_HEAD: _field(0x0A, key.encode())}) for key in keys))
                      for name, kind, keys in LIVE_SPANS]  # fmt: skip
        self._queue_head = _field(0x2A, b"fleetwire.queue") + b"\x30\x01"
        self._queue_tables = tuple(self._by_key.setdefault(key, {_HEAD: _field(0x0A, key.encode())}) for key in
                                   QUEUE_KEYS)  # fmt: skip

    def _values_of(self, key: str) -> dict[Any, Any]:
        """A new key's table: its encoded ``KeyValue.key`` (at :data:`_HEAD`), then its values' fields."""
        values: dict[Any, Any] = {_HEAD: _field(0x0A, key.encode())}  # KeyValue.key (1); _PREVIOUS: a dict
        if len(self._by_key) < _KEYS:
            self._by_key[key] = values
        return values

    def _context(self, traceparent: str) -> bytes:
        """``Span.trace_id`` (1) and ``Span.parent_span_id`` (4) of a child of ``traceparent``, kept: a plan's spans
        share their parent (the coordinator's three, ~1,000-5,000 plans apart)."""
        context = b"".join((b"\x0a\x10", _unhex(traceparent[3:35]), b"\x22\x08", _unhex(traceparent[36:52])))
        contexts = self._contexts
        if len(contexts) >= _CONTEXTS:
            contexts.clear()
        contexts[traceparent] = context
        return context

    def encode(self, batch: Iterable[Any]) -> bytes:
        """The request of a batch of noted spans (:data:`wireio.span_export.RawSpan`), compact ones
        (:data:`COMPACT_SPANS`) or ``Span`` messages already encoded (``bytes``: :meth:`commits`, :meth:`queue`).

        One join at the end: each span's field head and body, and the enclosing messages' heads written from the
        lengths summed on the way (each concatenation of a body with its head would copy the batch once more)."""
        span, compact, live = self.span, self.compact, self.live
        parts: list[bytes] = [b"", self._resource, b"", self._scope]  # [0], [2]: the heads, once the size is known
        append = parts.append
        size = 0
        for raw in batch:
            if raw.__class__ is bytes:
                body = raw
            elif raw[0].__class__ is str:
                body = span(*raw)
            elif raw[0] >= LIVE_BASE:
                body = live(raw)
            else:
                body = compact(raw)
            n = len(body)
            if n < 128:  # ScopeSpans.spans (2); most spans: a two-byte length
                append(b"\x12" + _SMALL[n])
                size += n + 2
            elif n < 16384:
                append(bytes((0x12, n & 0x7F | 0x80, n >> 7)))
                size += n + 3
            else:
                head = b"\x12" + _varint(n)
                append(head)
                size += n + len(head)
            append(body)
        size += len(self._scope)
        parts[2] = b"\x12" + _varint(size)  # ResourceSpans.scope_spans (2)
        append(self._resource_schema)
        size += len(parts[2]) + len(self._resource) + len(self._resource_schema)
        parts[0] = b"\x0a" + _varint(size)  # ExportTraceServiceRequest.resource_spans (1)
        return b"".join(parts)

    def _attributes(self, parts: list[bytes], items: Iterable[tuple[str, Any]]) -> None:
        """``Span.attributes`` (9) fields onto ``parts``: a value seen before under its key (a policy, a worker, a
        plan id of the latest plans) is copied."""
        by_key = self._by_key
        for key, value in items:
            values = by_key.get(key)
            if values is None:
                values = self._values_of(key)
            cls = value.__class__
            field = values.get(value) if cls is str or cls is int else None  # never bool or float: True == 1 == 1.0
            parts.append(field if field is not None else _kept(values, value))

    def compact(self, raw: Sequence[Any]) -> bytes:
        """One compact span's ``Span`` message (:data:`COMPACT_SPANS`: ``(template, traceparent, start ns, end ns,
        *values)``): an internal span, child of the (remote) parent its ``traceparent`` names, its id drawn here."""
        head, tables = self._templates[raw[0]]
        traceparent, start_ns, end_ns = raw[1], raw[2], raw[3]
        context = self._contexts.get(traceparent)
        if context is None:
            context = self._context(traceparent)
        parts = [_DRAWN_HEAD(context, 0x12, 8, _getrandbits(64) or 1, 0x39, start_ns, 0x41,
                             end_ns if end_ns > start_ns else start_ns), head]  # fmt: skip
        values: dict[Any, Any]  # for mypyc: a dict's get, not a method looked up by name (no bytecode in pure Python)
        for values, value in zip(tables, raw[4:]):  # noqa: B905  (a keyword makes zip ~300 ns slower, and a short one is a malformed span: fewer attributes)
            cls = value.__class__
            field = values.get(value) if cls is str or cls is int else None
            parts.append(field if field is not None else _kept(values, value))
        parts.append(_REMOTE_END)
        return b"".join(parts)

    def live(self, raw: Sequence[Any]) -> bytes:
        """One live span of a fixed shape's ``Span`` message (:data:`LIVE_SPANS`), as :meth:`span` writes the same span
        noted with its attributes dict."""
        head, tables = self._live[raw[0] - LIVE_BASE]
        start_ns, end_ns, parent_id = raw[4], raw[5], raw[3]
        if parent_id.__class__ is str:  # a remote parent's hex
            remote, parent = True, _unhex(parent_id)
        else:
            remote, parent = False, parent_id.to_bytes(8, "big")
        parts = [_ROOTED_HEAD(b"\x0a\x10", _unhex(raw[1]), b"\x12\x08", raw[2].to_bytes(8, "big"), b"\x22\x08", parent,
                              0x39, start_ns, 0x41, end_ns if end_ns > start_ns else start_ns), head]  # fmt: skip
        values: dict[Any, Any]  # (as compact's)
        for values, value in zip(tables, raw[7:]):  # noqa: B905  (as compact's)
            cls = value.__class__
            field = values.get(value) if cls is str or cls is int else None
            parts.append(field if field is not None else _kept(values, value))
        error = raw[6]
        if error:  # Status.message (2), Status.code (3) = STATUS_CODE_ERROR
            parts.append(_field(0x7A, _field(0x12, error.encode()) + b"\x18\x02"))
            parts.append(_FLAGS_REMOTE if remote else _FLAGS_LOCAL)
        else:
            parts.append(_REMOTE_END if remote else _LOCAL_END)
        return b"".join(parts)

    def commits(self, notes: Iterable[Sequence[Any]], kinds: Container[str], start_ns: int, end_ns: int,
                out: list[Any]) -> None:  # fmt: skip
        """The commit spans (:data:`COMMIT_SPAN`) of a committed step, each a ``Span`` message onto ``out``: one a note
        ``(traceparent, plan id, attempt, kind, data)`` whose kind is in ``kinds``, the first such of a plan only, as
        :meth:`compact` writes it from its fields, with no tuple built (wireio/span_export.py ``StepSpans``). One loop
        a step: the encoder's tables are read once a step, not once a span (~700 instructions a span less than a call
        each)."""
        head, (plan_ids, attempts, events) = self._templates[COMMIT_SPAN]
        contexts, pack, draw = self._contexts, _DRAWN_HEAD, _getrandbits
        end_ns = end_ns if end_ns > start_ns else start_ns
        done: set[str] = set()
        append, add = out.append, done.add
        for traceparent, plan_id, attempt, kind, _ in notes:
            if kind not in kinds or plan_id in done:
                continue
            add(plan_id)
            context = contexts.get(traceparent)
            if context is None:
                context = self._context(traceparent)
            plan_field = plan_ids.get(plan_id) if plan_id.__class__ is str else None
            attempt_field = attempts.get(attempt) if attempt.__class__ is int else None
            event_field = events.get(kind) if kind.__class__ is str else None
            append(b"".join((
                pack(context, 0x12, 8, draw(64) or 1, 0x39, start_ns, 0x41, end_ns),
                head,
                plan_field if plan_field is not None else _kept(plan_ids, plan_id),
                attempt_field if attempt_field is not None else _kept(attempts, attempt),
                event_field if event_field is not None else _kept(events, kind),
                _REMOTE_END,
            )))  # fmt: skip

    def queue(self, traceparent: str, start_ns: int, end_ns: int, plan_id: str, attempt: int, reason: str,
              placement: Sequence[Any] | None, events: Sequence[Sequence[Any]] | None,
              error: str) -> bytes:  # fmt: skip
        """The coordinator's ``fleetwire.queue`` span from its fields (wireio/span_export.py ``StepSpans``; no
        attributes dict): an internal span, child of the (remote) parent ``traceparent`` names, its id drawn here,
        with ``fleetwire.plan_id`` and ``fleetwire.attempt``, ``fleetwire.wait_reason`` when ``reason``, and the
        ``placement`` (policy, worker id) as ``fleetwire.policy`` and ``fleetwire.worker_id`` when there is one."""
        context = self._contexts.get(traceparent)
        if context is None:
            context = self._context(traceparent)
        plan_ids, attempts, reasons, policies, workers = self._queue_tables
        field = plan_ids.get(plan_id) if plan_id.__class__ is str else None
        parts = [_DRAWN_HEAD(context, 0x12, 8, _getrandbits(64) or 1, 0x39, start_ns, 0x41,
                             end_ns if end_ns > start_ns else start_ns), self._queue_head,
                 field if field is not None else _kept(plan_ids, plan_id)]  # fmt: skip
        field = attempts.get(attempt) if attempt.__class__ is int else None
        parts.append(field if field is not None else _kept(attempts, attempt))
        if reason:
            field = reasons.get(reason) if reason.__class__ is str else None
            parts.append(field if field is not None else _kept(reasons, reason))
        if placement:
            policy, worker = str(placement[0]), str(placement[1])
            field = policies.get(policy)
            parts.append(field if field is not None else _kept(policies, policy))
            field = workers.get(worker)
            parts.append(field if field is not None else _kept(workers, worker))
        if events:
            self._add_events(parts, events)
        if error:
            parts.append(_field(0x7A, _field(0x12, error.encode()) + b"\x18\x02"))
            parts.append(_FLAGS_REMOTE)
        else:
            parts.append(_REMOTE_END)
        return b"".join(parts)

    def span(self, name: str, trace_hex: str, span_id: int, parent_id: int | str, remote: bool, start_ns: int,
             end_ns: int, attributes: Mapping[str, Any] | None, events: Sequence[Sequence[Any]] | None,
             kind: str, error: str) -> bytes:  # fmt: skip
        """One span's ``Span`` message: a ``ScopeSpans.spans`` (2) field's body (:meth:`encode` writes the head)."""
        head = self._names.get(name)
        if head is None:
            head = self._names[name] = _field(0x2A, name.encode())  # Span.name (5)
        end_ns = end_ns if end_ns > start_ns else start_ns
        if parent_id:  # Span.parent_span_id (4)
            parent = _unhex(parent_id) if parent_id.__class__ is str else parent_id.to_bytes(8, "big")  # type: ignore[union-attr]
            parts = [_ROOTED_HEAD(b"\x0a\x10", _unhex(trace_hex), b"\x12\x08", span_id.to_bytes(8, "big"),
                                  b"\x22\x08", parent, 0x39, start_ns, 0x41, end_ns),
                     head, self._kinds[kind]]  # fmt: skip
        else:
            remote = False
            parts = [_ROOT_HEAD(b"\x0a\x10", _unhex(trace_hex), b"\x12\x08", span_id.to_bytes(8, "big"),
                                0x39, start_ns, 0x41, end_ns), head, self._kinds[kind]]  # fmt: skip
        if attributes:
            self._attributes(parts, attributes.items())
        if events:
            self._add_events(parts, events)
        if error:  # Status.message (2), Status.code (3) = STATUS_CODE_ERROR
            parts.append(_field(0x7A, _field(0x12, error.encode()) + b"\x18\x02"))
            parts.append(_FLAGS_REMOTE if remote else _FLAGS_LOCAL)
        else:
            parts.append(_REMOTE_END if remote else _LOCAL_END)
        return b"".join(parts)

    def _add_events(self, parts: list[bytes], events: Sequence[Sequence[Any]]) -> None:
        """``Span.events`` (11) onto ``parts``: an event's name and attributes are encoded once (its time each time)."""
        known = self._events
        for event_name, at, event_attributes in events:
            item = (event_name, *event_attributes.items()) if event_attributes else (event_name,)
            try:
                rest = known.get(item)
            except TypeError:  # an unhashable value (a list)
                rest = None
                item = ()
            if rest is None:
                rest = _field(0x12, event_name.encode()) + encode_attributes(0x1A, event_attributes, self._keys)
                if item:
                    if len(known) >= _KV_CACHE:
                        known.clear()
                    known[item] = rest
            parts.append(_field(0x5A, _EVENT_TIME(0x09, at) + rest))
