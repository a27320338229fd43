"""OpenTelemetry traces for the client, the coordinator and the worker (docs/OPERATIONS.md §Tracing).

Optional: ``pip install 'fleetwire[otel]'`` brings the OpenTelemetry SDK and its OTLP/HTTP
exporter. Nothing here imports OpenTelemetry until a :class:`Tracing` is built, and one is built
only when tracing is asked for: an ``OTEL_EXPORTER_OTLP_ENDPOINT`` (or ``..._TRACES_ENDPOINT``) in
the environment, or a flag (``--otlp-endpoint``). Off, a plan costs one empty-string test per hop.

Theory of operation:

* Each service has its own :class:`Tracing` (its own resource and exporter, never the global
  provider, so a test can run a client, a coordinator and a worker in one process): service names
  ``fleetwire-client``, ``fleetwire-coordinator``, ``fleetwire-worker`` unless ``OTEL_SERVICE_NAME``
  says otherwise.
* Spans are linked by W3C ``traceparent`` strings (protocol/tracecontext.py), never by a context
  carried in the process: the SDK's submit span's context rides in ``submit.traceparent``, the
  coordinator stores it with the plan and hands it to each attempt in ``assign.traceparent``.
  :meth:`Tracing.record` notes a finished span with explicit times (the coordinator's spans, built
  from what its core noted), :meth:`Tracing.start` a live one (the worker's attempt and handler).
* **Sampling is decided once, at the root** (:class:`Sampler`, read from ``OTEL_TRACES_SAMPLER``
  and ``..._ARG`` as the SDK reads them; default ``parentbased_always_on``): the client decides
  for a plan submitted outside any span, at a ratio by drawing the gaps between sampled plans
  (:meth:`Sampler.next_roots`: an unsampled plan costs no draw; no OpenTelemetry call) and
  sending an unsampled one ``"00"`` (protocol/tracecontext.py ``UNSAMPLED``); inside the caller's
  span the parent-based samplers follow its flag. Downstream hops are
  always parent-based: a ``traceparent`` whose ``sampled`` flag is clear makes no span there
  (:meth:`record` and :meth:`start` test the flags byte and return), whatever their sampler says.
* **The hot path does no OpenTelemetry work.** A span is noted as one tuple of plain values (its
  name, the trace and span ids, the times in Unix ns, a small attributes dict; a span of a fixed
  shape, the worker's, its template's number and its attributes' values: :class:`LiveSpan`) appended to a
  bounded queue (``OTEL_BSP_MAX_QUEUE_SIZE``, default 65,536; past it spans are dropped and
  counted in :attr:`Tracing.dropped`, never a stall). An exporter thread wakes every
  ``OTEL_BSP_SCHEDULE_DELAY`` ms (default 5,000) while spans come, or when a batch
  (``OTEL_BSP_MAX_EXPORT_BATCH_SIZE``, default 2,048) is waiting, and hands the batch on
  (wireio/span_export.py); with nothing queued it sleeps until a span is noted (no timer wake-up): with
  ``export_process`` (the coordinator and worker daemons) as one msgpack frame to a child process
  that encodes the OTLP request (protobuf, wireio/otlp.py) and posts it with the standard OTLP/HTTP
  exporter's client, so this process never imports OpenTelemetry; without it (the client in an
  application's process, or an exporter given in code) the thread does that itself.
  The coordinator notes less still: one record per step of its core (:meth:`Tracing.add_step`, the
  step's trace notes as its core made them, and :meth:`Tracing.add_commit`), made into its spans
  where they are exported (wireio/span_export.py ``StepSpans``); a step record weighs its notes
  against the queue's bound and a batch.
  :meth:`Tracing.flush` exports what is queued now, within its ``timeout_s``; :meth:`Tracing.shutdown`
  flushes and stops the thread (and the child), within a bound (``exit_wait_s``, 15 s): a collector
  that never answers holds a daemon's stop or an application's exit no longer (the child is killed,
  the thread left, their spans counted dropped).

What a sampled span still costs, measured on the 2-core VM (docs/OPERATIONS.md §Tracing, *What it
costs*): about 1-2 µs to note it here (the hot path; the coordinator notes nothing per plan), then
about 3.6 µs to encode it (wireio/otlp.py; the SDK's ``ReadableSpan`` and ``encode_spans`` took
~23 µs) and its share of a post, in the exporter thread or (``export_process``) the child, where
the exporter thread only packs it (~0.2 µs) and the child unpacks it (~1 µs). An unsampled plan
costs the client no draw at a ratio (:meth:`Sampler.next_roots`) and the other hops one flags
test.
"""

from __future__ import annotations

import collections
import contextvars
import gc
import importlib.util
import math
import os
import random
import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Final, TypeVar

from protocol.tracecontext import format_traceparent, is_sampled
from wireio.otlp import LIVE_BASE, LIVE_SPANS
from wireio.span_export import COMMIT_RECORD, EXIT_WAIT_S, STEP_RECORD, ExportProcess, SpanBuilder

__all__ = [
    "EXPORT_VARIABLE",
    "SERVICE_CLIENT",
    "SERVICE_COORDINATOR",
    "SERVICE_WORKER",
    "LiveSpan",
    "Sampler",
    "Tracing",
    "context_reader",
    "current_traceparent",
    "tracing_requested",
]

SERVICE_CLIENT: Final = "fleetwire-client"
SERVICE_COORDINATOR: Final = "fleetwire-coordinator"
SERVICE_WORKER: Final = "fleetwire-worker"

Attributes = Mapping[str, str | int | float | bool]
Event = tuple[str, int, Attributes]
"""A span event: its name, when (Unix ns) and its attributes."""
T = TypeVar("T")

_MISSING: Final = (
    "tracing needs the OpenTelemetry SDK and its OTLP/HTTP exporter: pip install 'fleetwire[otel]' "
    "(opentelemetry-sdk, opentelemetry-exporter-otlp-proto-http)"
)
_SDK_MODULES: Final = ("opentelemetry.sdk.trace", "opentelemetry.exporter.otlp.proto.http.trace_exporter")
_MASK64: Final = (1 << 64) - 1
_SAMPLERS: Final = frozenset({"always_on", "always_off", "traceidratio", "parentbased_always_on",
                              "parentbased_always_off", "parentbased_traceidratio"})  # fmt: skip
EXPORT_VARIABLE: Final = "FLEETWIRE_TRACE_EXPORT"
"""``process`` or ``thread``: where a tracer built by :meth:`Tracing.from_env` exports (default: the
daemons ``process``, the client ``thread``)."""
DEFAULT_QUEUE_SPANS: Final = 65_536
DEFAULT_BATCH_SPANS: Final = 2_048
DEFAULT_DELAY_MS: Final = 5_000


def tracing_requested(environ: Mapping[str, str] | None = None, endpoint: str | None = None) -> bool:
    """Whether tracing is on: an endpoint given, or the standard variables name one (and
    ``OTEL_SDK_DISABLED`` is not ``true``, ``OTEL_TRACES_EXPORTER`` not ``none``)."""
    env = os.environ if environ is None else environ
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    if env.get("OTEL_TRACES_EXPORTER", "otlp").strip().lower() == "none":
        return False
    return bool(endpoint or env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_ENDPOINT"))


_current_context: Callable[[], Mapping[str, object]] | None = None
"""The current OpenTelemetry context's reader once OpenTelemetry is imported (:func:`current_traceparent`,
:func:`context_reader`)."""


def context_reader(context: Any) -> Callable[[], Mapping[str, object]]:
    """What reads the current OpenTelemetry context, given ``opentelemetry.context``: its runtime context's
    ``ContextVar``'s ``get`` (one C call) when the runtime context is the default ``ContextVarsRuntimeContext``,
    else the public ``context.get_current`` (three Python functions: its module's, the runtime context's, then that
    ``get``). The fast path reads two private names (``_RUNTIME_CONTEXT`` and its ``_current_context``): when
    OpenTelemetry renames them, or another runtime context is configured (``OTEL_PYTHON_CONTEXT``), or the variable
    does not give what ``get_current`` gives, this returns the public call, and tests/unit/test_tracing.py says the
    fast path was lost."""
    runtime = getattr(context, "_RUNTIME_CONTEXT", None)
    variable = getattr(runtime, "_current_context", None)
    if type(runtime).__name__ == "ContextVarsRuntimeContext" and isinstance(variable, contextvars.ContextVar):
        try:
            if variable.get() is context.get_current():
                return variable.get  # type: ignore[no-any-return]
        except LookupError:  # a variable without a default: not the one get_current reads
            pass
    return context.get_current  # type: ignore[no-any-return]


def current_traceparent() -> str:
    """The ``traceparent`` of the caller's current OpenTelemetry span, if the application uses
    OpenTelemetry (already imported it) and has a valid one; ``""`` otherwise. Imports nothing.

    An empty current context (no span, nothing attached: the usual case of a client whose own tracer imported
    OpenTelemetry) is told by one C call (:func:`context_reader`: the runtime context's ``ContextVar``) and one
    test, not the API's seven calls across four modules: on every submit that path's code and data are mostly out
    of the CPU's caches (the client wakes once a round trip among other processes), so its instructions cost ~10x
    their count (docs/PERFORMANCE.md §T32h, §T32j)."""
    global _current_context
    get_current = _current_context
    if get_current is None:
        if "opentelemetry.trace" not in sys.modules:
            return ""
        from opentelemetry import context  # imported with opentelemetry.trace: no new import

        get_current = _current_context = context_reader(context)
    if not get_current():
        return ""
    trace = sys.modules["opentelemetry.trace"]
    span = trace.get_current_span().get_span_context()
    if not span.is_valid:
        return ""
    return format_traceparent(span.trace_id, span.span_id, sampled=bool(span.trace_flags & 1))


class Sampler:
    """The decision at a trace's root, as ``OTEL_TRACES_SAMPLER`` names it, without OpenTelemetry.

    The SDK's six samplers (an unknown name is the SDK's default, ``parentbased_always_on``):
    ``always_on``, ``always_off``, ``traceidratio`` (``OTEL_TRACES_SAMPLER_ARG``, default 1.0) and
    their ``parentbased_`` forms, which follow a parent's ``sampled`` flag when there is a parent.
    A ratio decision is the SDK's ``TraceIdRatioBased`` one: a trace is sampled when the low 64 bits
    of its id are under ``ratio * 2**64``, so the ids :meth:`root` draws agree with any ratio
    sampler at least as wide downstream.
    """

    __slots__ = ("bound", "gap", "name", "parent_based", "ratio")

    def __init__(self, name: str = "parentbased_always_on", ratio: float = 1.0) -> None:
        self.name = name if name in _SAMPLERS else "parentbased_always_on"
        self.parent_based = self.name.startswith("parentbased_")
        rule = self.name.removeprefix("parentbased_")
        self.ratio = 1.0 if rule == "always_on" else 0.0 if rule == "always_off" else min(max(ratio, 0.0), 1.0)
        self.bound = round(self.ratio * (1 << 64))
        self.gap = self._gap(random)
        """New roots left before the next sampled one (a ratio under 1; :meth:`next_roots`)."""

    @classmethod
    def from_env(cls, environ: Mapping[str, str]) -> Sampler:
        """The sampler ``OTEL_TRACES_SAMPLER`` and ``OTEL_TRACES_SAMPLER_ARG`` name (a bad ratio: 1.0, as the SDK)."""
        name = environ.get("OTEL_TRACES_SAMPLER", "parentbased_always_on").strip().lower()
        try:
            ratio = float(environ.get("OTEL_TRACES_SAMPLER_ARG", ""))
        except ValueError:
            ratio = 1.0
        return cls(name, ratio)

    def root(self, _random: Any = random) -> int:
        """A new sampled trace's id, or 0: this root is not sampled. One ratio test when it is not."""
        ratio = self.ratio
        if ratio >= 1.0:  # every trace: 128 random bits in one draw
            return _random.getrandbits(128) or 1
        if ratio <= 0.0 or _random.random() >= ratio:
            return 0
        return self.sampled_id(_random)

    def sampled_id(self, _random: Any = random) -> int:
        """The id of a root this sampler sampled (a ratio under 1): its low 64 bits under the bound."""
        low = _random.randrange(self.bound) if self.bound else 0
        return (_random.getrandbits(64) << 64 | low) or 1

    def next_roots(self, count: int, _random: Any = random) -> list[int]:
        """Which of the next ``count`` new roots of a stream of calls are sampled, in order: each one independently
        with probability :attr:`ratio`, drawn as the gaps between the sampled ones (geometric); the gap to
        the next sampled root carries over from one call to the next (the gaps are geometric, so a gap's rest is
        another such gap: the same law), so a call whose roots all fall in the gap draws nothing and makes no
        generator: the client's lone submits at 1 %, one test and one subtraction each. Calls from two threads at
        once may pick differently than one after the other; each root is still sampled at the ratio."""
        gap = self.gap
        if gap >= count:
            self.gap = gap - count
            return []
        picked = []
        while gap < count:
            picked.append(gap)
            gap += 1 + self._gap(_random)
        self.gap = gap - count
        return picked

    def _gap(self, _random: Any) -> int:
        """Unsampled roots before the next sampled one, drawn (floor(log U / log(1 - ratio))); none sampled at
        ratio 0: a gap past any count."""
        ratio = self.ratio
        if ratio <= 0.0 or ratio >= 1.0:
            return 0 if ratio >= 1.0 else 1 << 62
        return int(math.log(1.0 - _random.random()) / math.log1p(-ratio))

    def child(self, parent: str) -> bool:
        """Whether a span under ``parent`` (a valid ``traceparent``) is sampled here."""
        if self.parent_based:
            return is_sampled(parent)
        return self.ratio >= 1.0 or int(parent[19:35], 16) < self.bound


class LiveSpan:
    """A span under way (:meth:`Tracing.start`): its ``traceparent`` for children, then :meth:`end`.

    Nothing of OpenTelemetry: its fields, noted as one tuple when it ends. A span of a fixed shape (``template``:
    wireio/otlp.py ``LIVE_SPANS``, its attributes' keys a prefix of the template's, in order) is noted with its
    attributes' values only, no dict; one that leaves the shape (another key set, an event) is noted in full.
    """

    __slots__ = ("_attributes", "_events", "_kind", "_name", "_parent_id", "_remote", "_start_ns", "_template",
                 "_tracing", "span_id", "trace_id")  # fmt: skip

    def __init__(self, tracing: Tracing, name: str, trace_id: str, parent_id: int | str, remote: bool,
                 start_ns: int, attributes: dict[str, str | int | float | bool], kind: str,
                 template: int | None = None) -> None:  # fmt: skip
        self._tracing = tracing
        self._name = name
        self.trace_id = trace_id
        self.span_id = _getrandbits(64) or 1
        self._parent_id = parent_id  # an int, its hex (a remote parent's, parsed by the exporter) or 0: a root
        self._remote = remote
        self._start_ns = start_ns
        self._attributes = attributes
        self._events: list[Event] | None = None
        self._kind = kind
        self._template = template

    @property
    def traceparent(self) -> str:
        """This span's context as a (sampled) ``traceparent``: its children's parent."""
        return f"00-{self.trace_id}-{self.span_id:016x}-01"

    def set(self, key: str, value: str | int | float | bool) -> None:
        """Set an attribute."""
        attributes = self._attributes
        if self._template is not None and key not in attributes:
            keys = LIVE_SPANS[self._template - LIVE_BASE][2]
            if len(attributes) >= len(keys) or keys[len(attributes)] != key:
                self._template = None  # not the template's next key: noted in full
        attributes[key] = value

    def event(self, name: str, attributes: Attributes | None = None) -> None:
        """Add an event, now."""
        if self._events is None:
            self._events = []
        self._events.append((name, time.time_ns(), attributes or {}))

    def end(self, error: str = "") -> None:
        """End it; ``error`` (a code or message) marks it failed."""
        tracing = self._tracing
        queue = tracing._queue
        if len(queue) >= tracing._max_queue:
            tracing.dropped += 1
            return
        if self._template is not None and self._events is None:
            queue.append((self._template, self.trace_id, self.span_id, self._parent_id, self._start_ns, time.time_ns(),
                          error, *self._attributes.values()))  # fmt: skip
        else:
            queue.append((self._name, self.trace_id, self.span_id, self._parent_id, self._remote, self._start_ns,
                          time.time_ns(), self._attributes, self._events, self._kind, error))  # fmt: skip
        if (len(queue) >= tracing._batch or tracing._parked) and not tracing._wake.is_set():
            tracing._wake.set()


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
        export_process: export through a child process (wireio/span_export.py: the daemons), not
            in this one; ignored with ``exporter``.

    Raises:
        ValueError: the OpenTelemetry SDK is not installed (the message says what to install).
    """

    def __init__(
        self, service: str, *, endpoint: str | None = None, environ: Mapping[str, str] | None = None,
        exporter: Any = None, service_name: str | None = None, export_process: bool = False,
    ) -> None:  # fmt: skip
        env = os.environ if environ is None else environ
        self.service = service_name or env.get("OTEL_SERVICE_NAME") or service
        self.sampler = Sampler.from_env(env)
        self.exporter = exporter
        self.process: ExportProcess | None = None
        """The child that exports (``export_process``), else None: the exporter runs in this process."""
        self._builder: SpanBuilder | None = None
        self._url = _traces_url(endpoint) if endpoint else None  # the OTLP exporter's (None: the variables say)
        if export_process and exporter is None:
            if not _sdk_installed():
                raise ValueError(_MISSING)
            self.process = ExportProcess(self.service, _traces_url(endpoint) if endpoint else "", env)
            self.process.start()
        elif exporter is None and self.sampler.ratio <= 0.0:
            # Its sampler samples no root (ratio 0: propagation only): a span comes only under a caller's sampled
            # context, maybe never. The SDK and the OTLP exporter (~20,000 objects for the collector to walk, in an
            # application's process: docs/PERFORMANCE.md §T32n) are imported when the first span is exported.
            if not _sdk_installed():
                raise ValueError(_MISSING)
        else:
            try:
                fresh = exporter is None and _OTLP_MODULE not in sys.modules
                self._builder = SpanBuilder(self.service)
                if exporter is None:
                    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

                    self.exporter = OTLPSpanExporter(endpoint=self._url)
            except ImportError:
                raise ValueError(_MISSING) from None
            if fresh:
                _collect_imported()
        self.dropped = 0
        """Spans not exported: the queue was full (a collector slower than the spans), the export failed, or
        the exporter process was lost with them."""
        self.exported = 0
        """Spans exported (with ``export_process``: handed to the child, less those it reported failed or died
        with, a child killed at the shutdown's bound included)."""
        self._max_queue = _env_int(env, "OTEL_BSP_MAX_QUEUE_SIZE", DEFAULT_QUEUE_SPANS)
        self._batch = min(_env_int(env, "OTEL_BSP_MAX_EXPORT_BATCH_SIZE", DEFAULT_BATCH_SPANS), self._max_queue)
        self._delay_s = _env_int(env, "OTEL_BSP_SCHEDULE_DELAY", DEFAULT_DELAY_MS) / 1000
        self._queue: collections.deque[tuple[Any, ...]] = collections.deque()
        self._noted = 0  # trace notes in step records queued so far (add_step: the noting thread's count)
        self._taken = 0  # ... and taken off the queue (the exporter's count)
        self._wake = threading.Event()
        self._parked = False  # the exporter thread waits for a first span, with no timeout (_run)
        self._export_lock = threading.Lock()  # one export at a time: the thread's, or a flush's
        self._closed = False
        self.exit_wait_s = EXIT_WAIT_S
        """Exporting in this process: how long :meth:`shutdown` gives the exporter thread to post what is queued
        before it leaves it (with ``export_process``: the child's own bound, ``process.exit_wait_s``)."""
        self._in_flight = 0  # spans taken off the queue and not yet counted exported or dropped (_export_queued)
        self._left = False  # the shutdown left the exporter thread at its bound and counted what it held dropped
        self._left_lock = threading.Lock()  # between the exporter thread's counts and the shutdown's leaving
        self._flusher: threading.Thread | None = None  # the last flush's exporting thread (left at its bound)
        self._thread = threading.Thread(target=self._run, name=f"fleetwire-spans-{self.service}", daemon=True)
        self._thread.start()

    @classmethod
    def from_env(cls, service: str, *, endpoint: str | None = None, environ: Mapping[str, str] | None = None,
                 export_process: bool = False) -> Tracing | None:  # fmt: skip
        """A tracer when tracing is asked for (:func:`tracing_requested`), else None; it exports through a
        child process when ``export_process`` says so, unless ``FLEETWIRE_TRACE_EXPORT`` (``process`` or
        ``thread``) says otherwise.

        Raises:
            ValueError: asked for, without the SDK installed; a ``FLEETWIRE_TRACE_EXPORT`` of another value.
        """
        if not tracing_requested(environ, endpoint):
            return None
        env = os.environ if environ is None else environ
        mode = env.get(EXPORT_VARIABLE, "").strip().lower()
        if mode not in ("", "process", "thread"):
            raise ValueError(f"{EXPORT_VARIABLE}={mode!r}: expected 'process' (a child process exports the spans) "
                             "or 'thread' (this process does)")  # fmt: skip
        process = mode == "process" if mode else export_process
        return cls(service, endpoint=endpoint, environ=environ, export_process=process)

    # -- the hot path: plain values into the queue ------------------------------------------------

    def start(self, name: str, parent: str = "", attributes: dict[str, str | int | float | bool] | None = None, *,
              kind: str = "internal", start_ns: int | None = None, root: bool = False,
              template: int | None = None) -> LiveSpan | None:  # fmt: skip
        """Start a span, child of ``parent``; None when ``parent`` is unsampled or absent (unless
        ``root``: then an absent parent starts a new trace, if :attr:`sampler` samples it, and a
        present one is a child if the sampler follows it: the root's decision). ``attributes``
        becomes the span's own (not copied: :meth:`LiveSpan.set` adds to it). ``template``: its fixed shape
        (wireio/otlp.py ``LIVE_SPANS``: ``name``, ``kind`` and ``attributes``' keys are that template's), for a
        span with a parent."""
        parent_id: int | str
        if parent:
            if not (self.sampler.child(parent) if root else is_sampled(parent)):
                return None
            trace_id, parent_id = parent[3:35], parent[36:52]  # hex: the exporter parses it
        elif root:
            trace = self.sampler.root()
            if not trace:
                return None
            trace_id, parent_id = f"{trace:032x}", 0
        else:
            return None
        return LiveSpan(self, name, trace_id, parent_id, True, time.time_ns() if start_ns is None else start_ns,
                        {} if attributes is None else attributes, kind, template if parent_id else None)  # fmt: skip

    def start_each(self, name: str, parent: str, items: Sequence[T],
                   attributes_of: Callable[[T], dict[str, str | int | float | bool]], *,
                   kind: str = "internal") -> list[tuple[int, LiveSpan]]:  # fmt: skip
        """:meth:`start` with ``root=True`` for each of ``items`` (one span each, started now, its attributes
        ``attributes_of(item)``, called only for a sampled one), in one call: the client's submit spans of one batch.
        Under a ``parent`` the sampler decides once for all of them (they share it); without one each is a new
        trace the sampler decides alone. Returns the sampled ones, each with its place in ``items``, in order (empty:
        none): at a ratio the work is in proportion to the sampled items, none for the others
        (:meth:`Sampler.next_roots`: a call none of whose items is sampled reads no clock and draws nothing)."""
        sampler = self.sampler
        if not parent and sampler.ratio < 1.0:
            gap, count = sampler.gap, len(items)
            if gap >= count:  # none of them (next_roots' first test, inline: one call less a lone submit)
                sampler.gap = gap - count
                return []
        # The spans are made in a function of their own: its comprehensions' variables are cells, made at each call of
        # the function that holds them (CPython 3.11), ~10 here: ~1.5k instructions that a lone unsampled submit
        # skips (docs/PERFORMANCE.md §T32j).
        return self._start_sampled(name, parent, items, attributes_of, kind)

    def _start_sampled(self, name: str, parent: str, items: Sequence[T],
                       attributes_of: Callable[[T], dict[str, str | int | float | bool]],
                       kind: str) -> list[tuple[int, LiveSpan]]:  # fmt: skip
        """:meth:`start_each` past its first test (at a ratio under 1 without a parent, some item is sampled)."""
        sampler = self.sampler
        if not parent and sampler.ratio < 1.0:
            places = sampler.next_roots(len(items))
            now = time.time_ns()
            return [(i, LiveSpan(self, name, f"{sampler.sampled_id():032x}", 0, True, now, attributes_of(items[i]),
                                 kind)) for i in places]  # fmt: skip
        now = time.time_ns()
        if parent:
            if not sampler.child(parent):
                return []
            trace_id, parent_id = parent[3:35], parent[36:52]  # hex: the exporter parses it
            return [(i, LiveSpan(self, name, trace_id, parent_id, True, now, attributes_of(item), kind))
                    for i, item in enumerate(items)]  # fmt: skip
        root = sampler.root  # every root (a ratio under 1 went first)
        return [(i, LiveSpan(self, name, f"{root():032x}", 0, True, now, attributes_of(item), kind))
                for i, item in enumerate(items)]  # fmt: skip

    def child(self, parent: LiveSpan, name: str, attributes: dict[str, str | int | float | bool] | None = None, *,
              kind: str = "internal", template: int | None = None) -> LiveSpan:  # fmt: skip
        """Start a span under a live one of this process (``attributes``, ``template``: as :meth:`start`'s)."""
        return LiveSpan(self, name, parent.trace_id, parent.span_id, False, time.time_ns(),
                        {} if attributes is None else attributes, kind, template)  # fmt: skip

    def record(self, name: str, parent: str, start_ns: int, end_ns: int, attributes: Attributes | None = None, *,
               events: Iterable[Event] = (), kind: str = "internal", error: str = "") -> str:  # fmt: skip
        """Note a finished span, child of ``parent``, from ``start_ns`` to ``end_ns`` (Unix ns);
        returns its ``traceparent`` (``""``: the parent is unsampled, nothing noted)."""
        if not is_sampled(parent):
            return ""
        span_id = _span_id()
        self._note((name, parent[3:35], span_id, int(parent[36:52], 16), True, start_ns, max(start_ns, end_ns),
                    attributes, list(events) if events else None, kind, error))  # fmt: skip
        return f"00-{parent[3:35]}-{span_id:016x}-01"

    def add(self, name: str, parent: str, start_ns: int, end_ns: int, attributes: Attributes | None,
            events: Sequence[Event] | None = None, error: str = "") -> None:  # fmt: skip
        """:meth:`record` for a caller that knows ``parent`` is sampled (the coordinator's notes are only of
        sampled plans) and needs no ``traceparent`` back: an internal span, the least work on the hot path.
        The ids stay hex and the times as given; the exporter parses and orders them (span_export.py)."""
        queue = self._queue
        if len(queue) >= self._max_queue:
            self.dropped += 1
            return
        queue.append((name, parent[3:35], _getrandbits(64) or 1, parent[36:52], True, start_ns, end_ns, attributes,
                      events, "internal", error))  # fmt: skip
        if (len(queue) >= self._batch or self._parked) and not self._wake.is_set():
            self._wake.set()

    def add_compact(self, template: int, parent: str, start_ns: int, end_ns: int, *values: Any) -> None:
        """:meth:`add` of a span of a fixed shape (wireio/otlp.py ``COMPACT_SPANS[template]``: its name and attribute
        keys; ``values``: its attributes' values, in order), noted as one short tuple: no dict, no id drawn here (the
        exporter draws it), less to pack and unpack. ``parent`` is sampled (the caller knows)."""
        queue = self._queue
        if len(queue) >= self._max_queue:
            self.dropped += 1
            return
        queue.append((template, parent, start_ns, end_ns, *values))
        if (len(queue) >= self._batch or self._parked) and not self._wake.is_set():
            self._wake.set()

    def add_step(self, step: int, at_ns: int, notes: Sequence[Any]) -> None:
        """A step's trace notes as one record (the coordinator's: coordinator/io/ops/tracing.py), numbered ``step``,
        flushed at ``at_ns``: its spans are made where they are exported (wireio/span_export.py ``StepSpans``), so
        the noting thread does nothing per plan. ``notes`` is the exporter's from now on (never changed). It weighs
        its notes against the queue's bound and batch size."""
        if self._full():
            self.dropped += 1
            return
        self._noted += len(notes)  # written by the noting thread only, _taken by the exporter only: no lost update;
        self._queue.append((STEP_RECORD, step, at_ns, notes))  # counted before queued (_export_queued's fast path)
        if (self._noted - self._taken >= self._batch or self._parked) and not self._wake.is_set():
            self._wake.set()

    def add_commit(self, step: int, at_ns: int) -> None:
        """Step ``step``'s records were committed at ``at_ns``: its plans' commit spans (:meth:`add_step`)."""
        if self._full():
            self.dropped += 1
            return
        self._queue.append((COMMIT_RECORD, step, at_ns))
        if self._parked and not self._wake.is_set():
            self._wake.set()

    def _full(self) -> bool:
        """Whether the queue is at its bound, each step record weighing its notes (:meth:`add_step`)."""
        return len(self._queue) + self._noted - self._taken >= self._max_queue

    def _note(self, span: tuple[Any, ...]) -> None:
        queue = self._queue
        if len(queue) >= self._max_queue:
            self.dropped += 1
            return
        queue.append(span)
        if (len(queue) >= self._batch or self._parked) and not self._wake.is_set():
            self._wake.set()

    # -- the exporter thread: tuples to ReadableSpans to OTLP --------------------------------------

    def _run(self) -> None:
        """Export every ``OTEL_BSP_SCHEDULE_DELAY`` while spans come (at once for a full batch); with none queued,
        park until the next one is noted (the noting side sets ``_wake`` while ``_parked``): an idle process,
        or one that samples nothing, is not woken every delay for nothing."""
        wake, queue = self._wake, self._queue
        while not self._closed:
            if not queue:
                self._parked = True
                if not queue:  # a span noted before _parked was set is seen here; one noted after sets _wake
                    wake.wait()
                self._parked = False
                if not self._closed and len(queue) + self._noted - self._taken < self._batch:
                    wake.clear()  # the first span: its delay starts now (a full batch, or a shutdown, goes at once)
            wake.wait(self._delay_s)
            wake.clear()
            self._export_queued()
        if self.process is None:  # the shutdown's last export, here: one the collector never answers is left there
            self._export_queued()

    def _export_queued(self) -> bool:
        """Export every span queued now, in batches; whether every batch went."""
        went = True
        with self._export_lock:
            queue, batch_size, process, builder = self._queue, self._batch, self.process, self._builder
            failed = process.failed if process is not None else 0
            while queue:
                with self._left_lock:
                    if self._left:  # the shutdown left this thread: what is queued is counted dropped
                        return False
                    count = min(batch_size, len(queue))
                    if self._noted == self._taken:  # spans only (a step record among the count was counted before it)
                        batch = [queue.popleft() for _ in range(count)]
                    else:
                        batch = self._take_weighed(batch_size)
                    self._in_flight = len(batch)
                if process is not None:
                    sent = process.send(batch)  # False: the child is gone (it is started again later)
                else:
                    if builder is None:  # the first span of a ratio-0 tracer (__init__)
                        builder = self._build_exporter()
                    # False: refused, or away (or the SDK found at the start failed to import: counted dropped)
                    sent = builder is not None and builder.export(self.exporter, batch, self._noted != 0)
                with self._left_lock:
                    self._in_flight = 0
                    if self._left:  # left at the shutdown's bound while posting: counted dropped there
                        return False
                    if sent:
                        self.exported += len(batch)
                    else:
                        self.dropped += len(batch)
                        went = False
            if process is not None:
                self._count_lost(process.failed - failed)
        return went

    def _build_exporter(self) -> SpanBuilder | None:
        """What exports in this process, built at the first export of a ratio-0 tracer (under the export lock); None:
        the SDK, found when the tracer was built, does not import."""
        fresh = _OTLP_MODULE not in sys.modules
        try:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            builder = SpanBuilder(self.service)
        except ImportError:
            return None
        self.exporter = OTLPSpanExporter(endpoint=self._url)
        self._builder = builder
        if fresh:
            _collect_imported()
        return builder

    def _take_weighed(self, batch_size: int) -> list[tuple[Any, ...]]:
        """The next batch off the queue, a step record weighing its notes (:meth:`add_step`)."""
        queue, batch, weight = self._queue, [], 0
        while queue and weight < batch_size:
            raw = queue.popleft()
            batch.append(raw)
            if raw[0] == STEP_RECORD:
                notes = len(raw[3])
                self._taken += notes
                weight += notes
            else:
                weight += 1
        return batch

    def flush(self, timeout_s: float = 5.0) -> bool:
        """Export what is queued now; whether it all went within ``timeout_s`` (none was lost).

        ``timeout_s`` bounds all of it, as :attr:`exit_wait_s` bounds the shutdown: the batches are handed on by a
        thread of the flush's own, after the exporter thread's export under way. Exporting in this process each post
        takes up to the OTLP exporter's timeout (10 s) against a collector that never answers; with
        ``export_process`` each write to a child that stopped reading up to its ``stuck_s`` (30 s). Past the bound
        the flush says False and leaves that thread exporting (a daemon thread), its spans counted exported or
        dropped as they go. Spans lost while it runs say False too: a batch the exporter thread took before the flush
        (whose spans were noted before it) and could not hand on leaves the flush nothing to export itself.
        """
        dropped = self.dropped
        deadline = time.monotonic() + timeout_s
        process = self.process
        done: list[bool] = []
        if process is not None:  # the child's flush bounded by what is left of timeout_s

            def export() -> None:
                went = self._export_queued()
                left = deadline - time.monotonic()  # past the bound: no flush frame (its write would kill the child)
                done.append(left > 0 and self._settle(lambda: process.flush(left)) and went)

        else:

            def export() -> None:
                done.append(self._export_queued())

        flusher = threading.Thread(target=export, name=f"fleetwire-spans-flush-{self.service}", daemon=True)
        flusher.start()
        self._flusher = flusher  # started first: a shutdown in another thread joins it (a thread not started: raises)
        flusher.join(timeout_s)
        if not done:  # still exporting at the bound
            return False
        if process is None and self.exporter is not None:  # (None: a ratio-0 tracer that has exported nothing)
            left_ms = max(0, int((deadline - time.monotonic()) * 1000))
            done.append(bool(self.exporter.force_flush(left_ms)))
        return all(done) and self.dropped == dropped

    def shutdown(self) -> None:
        """Export what is queued, stop the exporter's thread and the exporter (again: nothing); a tracer that dropped
        spans says so in a warning with its counts. Bounded: :attr:`exit_wait_s` exporting in this process (the
        thread is left there, what it had not exported counted dropped), the child's ``exit_wait_s`` with
        ``export_process`` (the child is killed there, what it held counted dropped)."""
        if self._closed:
            return
        self._closed = True
        self._wake.set()
        if self.process is None:
            # The thread posts what is queued (_run), a batch at a time, each post up to the OTLP exporter's timeout
            # (10 s) against a collector that never answers: it gets exit_wait_s in all, then is left (a daemon thread:
            # an application's exit does not wait for it), as the child is killed at its bound.
            self._thread.join(self.exit_wait_s)
            with self._left_lock:
                if self._thread.is_alive():
                    self._left = True
                    self.dropped += self._in_flight + len(self._queue) + self._noted - self._taken
            if self.exporter is not None:  # (None: a ratio-0 tracer that exported nothing)
                self.exporter.shutdown()  # its retries' waits end; a post under way ends at its own timeout
        else:
            # Against a collector that never answers the child reads a batch a post's timeout (10 s): its pipe full, the
            # thread's writes of the batches still queued went one a timeout (a full queue: ~5 minutes). Past the
            # child's own bound it is killed, the write fails at once, and what the child held, and the queue, are
            # counted dropped (ExportProcess.kill). A flush's thread left writing at its bound (flush) gets the same.
            deadline = time.monotonic() + self.process.exit_wait_s
            self._thread.join(self.process.exit_wait_s)
            flusher = self._flusher
            if flusher is not None:
                flusher.join(max(deadline - time.monotonic(), 0.0))
            if self._thread.is_alive() or (flusher is not None and flusher.is_alive()):
                self.process.kill()
                self._thread.join()
                if flusher is not None:
                    flusher.join()
            self._export_queued()
            # The child exports what it holds and exits (bounded: EXIT_WAIT_S); killed at the bound, what it held
            # unanswered is counted dropped (ExportProcess.close).
            self._settle(self.process.close)
        if self.dropped:  # the one place an operator is told of lost spans (no metric counts them)
            import structlog  # not at the module's import: the SDK's client imports this module without it

            structlog.get_logger(__name__).warning(
                "spans were not exported (queue full, export failed or the exporter process lost them)",
                service=self.service, dropped=self.dropped, exported=self.exported,
            )  # fmt: skip

    def _settle(self, call: Callable[[], bool]) -> bool:
        """Ask the exporter process (``call``) and count what it now says it did not export as dropped: what its
        exporter failed, and what a child that died or was killed (a close past its bound) held unanswered."""
        assert self.process is not None
        with self._export_lock:
            failed = self.process.failed
            done = call()
            self._count_lost(self.process.failed - failed)
        return done

    def _count_lost(self, lost: int) -> None:
        """Spans counted exported that the exporter process says it did not export (or died with)."""
        self.exported -= lost
        self.dropped += lost


_OTLP_MODULE: Final = "opentelemetry.exporter.otlp.proto.http.trace_exporter"


def _collect_imported() -> None:
    """One full collection right after this process imported the SDK and its OTLP exporter (docs/PERFORMANCE.md
    §T32o). The import leaves ~11,000-20,000 new objects counted as pending for the oldest generation, more than the
    quarter of it that CPython waits for, so a full collection was due at the next young one: in a client, inside
    its first batch of submits, walking every plan then in flight as well (47 ms in a 3,000-plan window, 15 µs a
    plan). Collected here, at the tracer's start, the heap is the application's and the SDK's only, and the count
    starts again from a heap that includes the SDK. Only what is garbage now is freed, as any collection does; no
    object is exempted from later ones (not ``gc.freeze``, which would keep the caller's objects of this moment
    from ever being collected). Not when the application turned the collector off."""
    if gc.isenabled():
        gc.collect()


def _sdk_installed() -> bool:
    """Whether the SDK and its OTLP/HTTP exporter can be imported (found, not imported)."""
    try:
        return all(importlib.util.find_spec(name) is not None for name in _SDK_MODULES)
    except (ImportError, ValueError):
        return False


_getrandbits: Final = random.getrandbits


def _span_id() -> int:
    return _getrandbits(64) or 1


def _env_int(env: Mapping[str, str], name: str, default: int) -> int:
    try:
        value = int(env.get(name, ""))
    except ValueError:
        return default
    return value if value > 0 else default


def _traces_url(endpoint: str) -> str:
    """A collector's base URL as its OTLP/HTTP traces URL (a full ``.../v1/traces`` URL is kept)."""
    endpoint = endpoint.rstrip("/")
    return endpoint if endpoint.endswith("/v1/traces") else f"{endpoint}/v1/traces"
