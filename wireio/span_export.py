"""Noted spans to the SDK's OTLP exporter, in this process or in a helper one (docs/OPERATIONS.md §Tracing).

wireio/tracing.py notes each finished span as one tuple of plain values (:data:`RawSpan`) and hands
batches of them to one of two senders:

* :class:`SpanBuilder` (the client in an application's process, or an exporter given in code):
  exports a batch in the tracer's exporter thread. To the standard OTLP/HTTP exporter it hands the
  ``ExportTraceServiceRequest`` bytes that wireio/otlp.py encodes straight from the tuples (~3.6 µs
  a span), posted by that exporter's own HTTP client (its endpoint, headers, TLS, compression,
  timeout and retries); to any other exporter (an in-memory one in tests) the SDK's ``ReadableSpan``
  objects it builds from them (the SDK's encoder would cost ~23 µs a span).
* :class:`ExportProcess` (the coordinator and worker daemons, ``Tracing(..., export_process=True)``):
  the tuples go as msgpack frames down a pipe to a child process (``python -m wireio.span_export``,
  :func:`main`) that does the same with the standard OTLP/HTTP exporter, configured by the same
  ``OTEL_*`` variables. The encoding (~1 µs a span to unpack, ~3.6 to encode; the coordinator's step
  records are made into its spans' bytes at once, :class:`StepSpans`, ~18k instructions a span in all) and
  the posts then run on another core than the daemon's event loop, never hold its GIL, and the daemon never
  imports OpenTelemetry (nor the ~18,000 objects of the SDK, protobuf and ``requests`` its
  collector would rescan). Sending costs the daemon's exporter thread ~0.2 µs a span (msgpack).

The child is a helper, never a dependency: a child that dies (crash, OOM, killed) costs the spans in
its pipe, counted as dropped, and is started again at the next batch (after 1 s, doubling to 60 s
while it keeps dying young); a child that stops reading (a collector that hangs it past the
exporter's timeout) is killed after :data:`STUCK_S` of a full pipe. Writes happen in the tracer's
exporter thread, never on the event loop, and the span queue in front of it is bounded (spans past
it are dropped and counted), so a missing, stuck or crashed child never stalls the daemon. The
child reads until its pipe closes (the daemon's shutdown, or its death), exports what it holds and
exits (killed past :data:`EXIT_WAIT_S`: the spans it had not answered for are dropped and counted, as a
crashed child's); it is in its own session, so a Ctrl-C at the terminal reaches only the daemon, which flushes
through it.

The pipe's frames: a little-endian u32 length, then msgpack: ``[0, [span, ...]]`` (spans) or
``[1, seq]`` (flush). The child answers each frame, once it has exported what came before, with
``[seq, failed, exported]`` (0 for spans; the child's totals) on its stdout (its own output goes
to stderr): the daemon reads the answers at each batch, and counts the spans a dead or killed
child had not answered for as dropped.
"""

from __future__ import annotations

import contextlib
import gc
import os
import random
import select
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any, Final

import msgspec

from wireio.otlp import COMMIT_SPAN, SpanEncoder, expand

__all__ = ["COMMIT_RECORD", "EXIT_WAIT_S", "RESPAWN_S", "STEP_RECORD", "STUCK_S", "ExportProcess", "RawSpan",
           "SpanBuilder", "StepSpans", "main"]  # fmt: skip

RawSpan = tuple[Any, ...]
"""A noted span: (name, trace id hex, span id, parent span id (an int, its hex, or 0: a root), parent
remote, start ns, end ns (the later of the two, if before start), attributes or None, events [(name,
ns, attributes)] or None, kind, error); or a compact one, (template, traceparent, start ns, end ns,
*values): wireio/otlp.py ``COMPACT_SPANS``."""

STEP_RECORD: Final = -1
"""``(STEP_RECORD, step, flushed ns, [(traceparent, plan id, attempt, kind, data), ...])``: one step of the
coordinator's traced plans, as its core noted them (coordinator/effects.py ``TraceNote``), made into spans
by :class:`StepSpans` where they are exported."""
COMMIT_RECORD: Final = -2
"""``(COMMIT_RECORD, step, committed ns)``: that step's records are committed (its plans' commit spans)."""

KINDS: Final = ("internal", "server", "client", "producer", "consumer")  # OpenTelemetry's SpanKind values, in order
STUCK_S: Final = 30.0
"""A child that takes no bytes from a full pipe for this long is killed (the OTLP exporter's own
timeout is 10 s an export)."""
EXIT_WAIT_S: Final = 15.0
"""How long a shutdown waits for the child to export what it holds and exit before killing it."""
RESPAWN_S: Final = 1.0
"""The pause before a dead child's successor starts (doubling while children die young)."""
_SPANS: Final = 0
_FLUSH: Final = 1
_PIPE_BYTES: Final = 1 << 20  # a full batch of 2,048 spans is ~0.5 MB: it goes in one write, not a wait
_F_SETPIPE_SZ: Final = 1031  # Linux fcntl
_PR_SET_DUMPABLE: Final = 4  # Linux prctl
_HEAD: Final = 4
_RESPAWN_MAX_S: Final = 60.0
_getrandbits: Final = random.getrandbits
_GC_THRESHOLDS: Final = (50_000, 20, 100)  # the child's collector, as the daemons tune theirs: each batch it
# decodes is ~10,000 new containers (a tuple and a dict a span), none in a cycle, all freed after the post


_QUEUED_BY: Final = frozenset({"queued", "requeued", "preempted"})
_ENDS: Final = frozenset({"succeeded", "failed", "cancelled"})
_COMMITTED: Final = _ENDS | {"queued"}
_PENDING_STEPS: Final = 65_536  # steps flushed and not yet committed that are kept (the oldest go first)


class StepSpans:
    """The coordinator's spans made from its step records (:data:`STEP_RECORD`, :data:`COMMIT_RECORD`), where they
    are exported, so that its event loop does no work per plan for them (coordinator/io/ops/tracing.py says which
    spans). It keeps what spans across steps: each traced plan's open queue span (bounded by the traced plans queued
    now) and each flushed step's notes until its commit. A step's time stands for each of its notes."""

    def __init__(self) -> None:
        self._queued: dict[str, list[Any]] = {}  # plan id -> [traceparent, since ns, attempt, reason, events]
        self._steps: dict[int, tuple[int, Sequence[Sequence[Any]]]] = {}  # step -> (flushed ns, its notes)

    @property
    def queued(self) -> int:
        """Traced plans whose queue span is open."""
        return len(self._queued)

    def expand(self, batch: Sequence[Sequence[Any]], encoder: SpanEncoder | None = None) -> list[Any]:
        """``batch`` with each step record replaced by the spans it ends (queue spans, :data:`RawSpan`) and each
        commit record by its step's commit spans (compact, wireio/otlp.py ``COMMIT_SPAN``); other spans as they are.
        With ``encoder``, the spans a record makes come as their ``Span`` messages, encoded at once (no tuple built
        to be taken apart again): :meth:`SpanEncoder.encode` takes them as they are."""
        out: list[Any] = []
        for raw in batch:
            what = raw[0]
            if what.__class__ is str or what >= 0:
                out.append(raw)
            elif what == STEP_RECORD:
                self._step(raw[2], raw[3], out, encoder)
                if len(self._steps) >= _PENDING_STEPS:
                    del self._steps[next(iter(self._steps))]
                self._steps[raw[1]] = (raw[2], raw[3])
            elif what == COMMIT_RECORD:
                self._commit(raw[1], raw[2], out, encoder)
        return out

    def _step(self, now: int, notes: Sequence[Sequence[Any]], out: list[Any], encoder: SpanEncoder | None) -> None:
        """A step's notes: the queue spans its placements (or ends while queued) close."""
        queued = self._queued
        for traceparent, plan_id, attempt, kind, data in notes:
            if kind == "leased" or kind in _ENDS:
                entry = queued.pop(plan_id, None)
                if entry is None:
                    if kind != "leased":
                        continue
                    entry = [traceparent, now, attempt, "", None]  # queued before a restart: a queue span from here
                if encoder is not None:  # the same span, encoded from its fields
                    out.append(encoder.queue(entry[0], entry[1], now, plan_id, entry[2], entry[3],
                                             data if kind == "leased" else None, entry[4],
                                             "" if kind == "leased" else f"ended {kind} while queued"))  # fmt: skip
                    continue
                attributes: dict[str, Any] = {"fleetwire.plan_id": plan_id, "fleetwire.attempt": entry[2]}
                if entry[3]:  # no attribute for a plan that never waited: each one costs the encoding
                    attributes["fleetwire.wait_reason"] = entry[3]
                error = ""
                if kind != "leased":
                    error = f"ended {kind} while queued"
                elif data:  # the placement that leased it: (policy, worker id); none when recovery adopted the lease
                    attributes["fleetwire.policy"] = str(data[0])
                    attributes["fleetwire.worker_id"] = str(data[1])
                parent = entry[0]
                out.append(("fleetwire.queue", parent[3:35], _getrandbits(64) or 1, parent[36:52], True, entry[1], now,
                            attributes, entry[4], "internal", error))  # fmt: skip
            elif kind in _QUEUED_BY:
                queued[plan_id] = [traceparent, now, attempt + 1, "", None]
            elif kind == "waiting":
                entry = queued.get(plan_id)
                if entry is None:  # queued before a restart: its wait is known from here on
                    entry = queued[plan_id] = [traceparent, now, attempt + 1, "", None]
                entry[3] = reason = str((data or {}).get("reason", ""))
                if entry[4] is None:
                    entry[4] = []
                entry[4].append(("waiting", now, {"reason": reason}))

    def _commit(self, step: int, now: int, out: list[Any], encoder: SpanEncoder | None) -> None:
        """A step committed: the commit spans of the plans it recorded or ended (one a plan)."""
        flushed = self._steps.pop(step, None)
        if flushed is None:
            return
        started, notes = flushed
        if encoder is not None:
            encoder.commits(notes, _COMMITTED, started, now, out)
            return
        done: set[str] = set()
        for traceparent, plan_id, attempt, kind, _ in notes:
            if kind in _COMMITTED and plan_id not in done:
                done.add(plan_id)
                out.append((COMMIT_SPAN, traceparent, started, now, plan_id, attempt, kind))


class SpanBuilder:
    """Exports noted spans (:data:`RawSpan`) of one service: the OTLP request's bytes (wireio/otlp.py) to the
    standard OTLP/HTTP exporter, the SDK's ``ReadableSpan`` objects to any other (imports the SDK).

    Raises:
        ImportError: the OpenTelemetry SDK is not installed.
    """

    def __init__(self, service: str) -> None:
        from opentelemetry import trace
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import Event as SdkEvent
        from opentelemetry.sdk.trace import ReadableSpan
        from opentelemetry.sdk.trace.export import SpanExportResult
        from opentelemetry.sdk.util.instrumentation import InstrumentationScope

        self.failure = SpanExportResult.FAILURE
        self._trace = trace
        self._readable = ReadableSpan
        self._event = SdkEvent
        self._resource = _cached_hash(Resource.create({"service.name": service}))
        self._scope = InstrumentationScope("fleetwire")
        self._kinds = tuple(trace.SpanKind(i) for i in range(len(KINDS)))
        self._flags = trace.TraceFlags(trace.TraceFlags.SAMPLED)
        self._ok = trace.Status(trace.StatusCode.UNSET)
        self._encoder = SpanEncoder(self._resource.attributes, "fleetwire", self._resource.schema_url or "")
        self.steps = StepSpans()
        """The coordinator's step records made into spans (they come only from it)."""
        try:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            self._otlp: type | None = OTLPSpanExporter
        except ImportError:
            self._otlp = None

    def build(self, name: str, trace_hex: str, span_id: int, parent_id: int | str, remote: bool, start_ns: int,
              end_ns: int, attributes: Mapping[str, Any] | None, events: Sequence[Sequence[Any]] | None,
              kind: str, error: str) -> Any:  # fmt: skip
        """The ``ReadableSpan`` of one noted span (its fields, splatted)."""
        trace, flags = self._trace, self._flags
        trace_id = int(trace_hex, 16)
        if parent_id.__class__ is str:
            parent_id = int(parent_id, 16)
        parent = trace.SpanContext(trace_id, parent_id, remote, flags) if parent_id else None
        return self._readable(
            name=name, context=trace.SpanContext(trace_id, span_id, False, flags), parent=parent,
            resource=self._resource, attributes=attributes,
            events=[self._event(n, a, t) for n, t, a in events] if events else (),
            kind=self._kinds[KINDS.index(kind)],
            status=trace.Status(trace.StatusCode.ERROR, error) if error else self._ok,
            start_time=start_ns, end_time=max(start_ns, end_ns), instrumentation_scope=self._scope,
        )  # fmt: skip

    def export(self, exporter: Any, batch: Sequence[Sequence[Any]], steps: bool = True) -> bool:
        """Export one batch; whether the exporter took it (a raising exporter: no). ``steps``: it may hold step
        records (:class:`StepSpans`; False: a tracer that never noted one, spared the look).

        The standard OTLP/HTTP exporter gets the request's bytes from :class:`wireio.otlp.SpanEncoder` and
        posts them with its own HTTP client (its endpoint, headers, TLS, compression, timeout and retries);
        any other exporter (an in-memory one in tests, one given in code) gets ``ReadableSpan`` objects."""
        try:
            post = self._post(exporter)
            if post is not None:
                encoder = self._encoder
                return bool(post(encoder.encode(self.steps.expand(batch, encoder) if steps else batch)).success)
            if steps:
                batch = self.steps.expand(batch)
            return exporter.export([self.build(*expand(raw)) for raw in batch]) is not self.failure
        except Exception:  # a failing exporter (or a malformed span) loses its batch, never the caller
            return False

    def _post(self, exporter: Any) -> Any:
        """The standard OTLP/HTTP exporter's ``export(bytes)`` (its HTTP client), or None: build ``ReadableSpan``s.
        Only for that exact class (a subclass may export otherwise), open, in a version that has the client."""
        if self._otlp is None or exporter.__class__ is not self._otlp or getattr(exporter, "_shutdown", True):
            return None
        return getattr(getattr(exporter, "_client", None), "export", None)


def _cached_hash(resource: Any) -> Any:
    """The resource, as one whose hash is computed once (the OTLP encoder hashes it per span: ~3 µs each)."""
    base = type(resource)
    cached = type("FleetwireResource", (base,), {"__hash__": lambda self: self._fleetwire_hash, "__eq__": base.__eq__})
    clone = cached(resource.attributes, resource.schema_url)
    clone._fleetwire_hash = hash(resource)
    return clone


# -- the daemon's side ---------------------------------------------------------------------------


class ExportProcess:
    """The child that exports this process's spans (module docstring); started by :meth:`start` or the first batch.

    Not thread-safe: the tracer calls it under its export lock.

    Args:
        service: the service name the child's spans carry.
        endpoint: the collector's full traces URL; "": the child's ``OTEL_*`` variables say.
        environ: the ``OTEL_*`` variables the child gets (the rest of its environment is this process's,
            less every ``FLEETWIRE_*`` variable: the tokens a worker reads at its start stay out of it).
        stuck_s: see :data:`STUCK_S`.
        exit_wait_s: see :data:`EXIT_WAIT_S`.
        respawn_s: the first pause before a dead child's successor starts (it doubles, to 60 s, while
            children die within a minute of their start).
    """

    def __init__(self, service: str, endpoint: str, environ: Mapping[str, str], *, stuck_s: float = STUCK_S,
                 exit_wait_s: float = EXIT_WAIT_S, respawn_s: float = RESPAWN_S) -> None:  # fmt: skip
        self.service = service
        self.endpoint = endpoint
        self.env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "FLEETWIRE_"))}  # no tokens
        self.env.update((k, v) for k, v in environ.items() if k.startswith("OTEL_"))
        self.stuck_s = stuck_s
        self.exit_wait_s = exit_wait_s
        self.respawn_s = respawn_s
        self.proc: subprocess.Popen[bytes] | None = None
        self.started = 0
        """Children started so far."""
        self._failed_before = 0  # spans the children before this one did not export
        self._sent = 0  # spans sent to this child
        self._settled = 0  # ... that it has answered for (exported or failed)
        self._child_failed = 0  # ... that it could not export
        self._encode = msgspec.msgpack.Encoder().encode
        self._decode = msgspec.msgpack.Decoder().decode
        self._seq = 0
        self._answers = b""
        self._next_start = 0.0
        self._backoff = 0.0
        self._started_at = 0.0
        self._closed = False
        self._pid = os.getpid()  # a fork of this process (multiprocessing) must never write to our child's pipe

    @property
    def failed(self) -> int:
        """Spans sent that were not exported, as far as known: the child's exporter failed them (as of its last
        answer), or they were in the pipe of a child that died or was killed."""
        return self._failed_before + self._child_failed

    def start(self) -> bool:
        """Start the child now (the SDK's imports then overlap the daemon's start-up); whether it started."""
        return self._child() is not None

    def send(self, batch: Sequence[RawSpan]) -> bool:
        """Hand a batch to the child (started if need be); whether it went (if not: lost, the child is gone)."""
        if not self._write(self._encode((_SPANS, batch))):
            return False
        self._sent += len(batch)
        while self._read_answer(0.0) is not None:  # the answers so far: what the child settled
            pass
        return True

    def flush(self, timeout_s: float) -> bool:
        """Whether the child exported everything sent before, within ``timeout_s`` (no child: nothing is pending)."""
        if self.proc is None or os.getpid() != self._pid:
            return True
        self._seq += 1
        seq = self._seq
        deadline = time.monotonic() + timeout_s
        if not self._write(self._encode((_FLUSH, seq)), deadline):
            return False
        while True:
            answer = self._read_answer(deadline)
            if answer is None:
                return False
            if answer[0] == seq:
                return True

    def close(self) -> bool:
        """Flush, then close the pipe: the child exits (killed if flushing and exiting take over ``exit_wait_s``).
        The spans it held and had not answered for when it exited count in :attr:`failed` (a killed child's).

        Returns:
            Whether the child exported everything sent to it.
        """
        self._closed = True  # no child is started after this
        if os.getpid() != self._pid:
            return True
        deadline = time.monotonic() + self.exit_wait_s
        done = self.flush(self.exit_wait_s)
        proc = self.proc
        if proc is None:  # none, or the flush's write found it gone or stuck (_discard counted its spans)
            return done
        with contextlib.suppress(OSError):
            proc.stdin.close()  # type: ignore[union-attr]
        try:
            proc.wait(max(deadline - time.monotonic(), 0.0) if done else 0.0)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        while self._read_answer(0.0) is not None:  # what it answered before it exited (or was killed)
            pass
        self.proc = None
        # Spans it held and never answered for died with it (killed mid-post): lost, as a crashed child's.
        self._failed_before += self._child_failed + self._sent - self._settled
        self._sent = self._settled = self._child_failed = 0
        with contextlib.suppress(OSError):
            proc.stdout.close()  # type: ignore[union-attr]
        return done

    def kill(self) -> None:
        """Kill the child now and start none after it: a shutdown past its bound whose exporter thread is still
        writing to the child (its pipe full: it reads a batch a post, each post to a collector that never answers
        waiting out the exporter's timeout). That write then fails at once, and the writer's :meth:`_discard` reaps
        the child and counts what it held in :attr:`failed`. Called without the tracer's export lock (the writer
        holds it): it only signals the child."""
        self._closed = True
        proc = self.proc
        if proc is not None:
            with contextlib.suppress(OSError):
                proc.kill()

    # -- the pipe ---------------------------------------------------------------------------------

    def _child(self) -> subprocess.Popen[bytes] | None:
        """The running child, started if there is none and its backoff is over (None: not now)."""
        if os.getpid() != self._pid:  # a forked copy: its spans are dropped (the pipe is the parent's)
            return None
        proc = self.proc
        if proc is not None and proc.poll() is None:
            return proc
        if proc is not None:  # it died: start another after a pause that grows while children die young
            self._discard()
        if self._closed or time.monotonic() < self._next_start:
            return None
        argv = [sys.executable, "-m", "wireio.span_export", self.service, self.endpoint]
        try:
            proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=self.env,
                                    start_new_session=True)  # fmt: skip
        except OSError:  # no process to be had now (EAGAIN): try again after the pause
            self._backoff = min(max(self._backoff * 2, self.respawn_s), _RESPAWN_MAX_S)
            self._next_start = time.monotonic() + self._backoff
            return None
        assert proc.stdin is not None and proc.stdout is not None
        with contextlib.suppress(OSError):  # a bigger pipe where Linux allows it: a batch in one write
            import fcntl

            fcntl.fcntl(proc.stdin.fileno(), _F_SETPIPE_SZ, _PIPE_BYTES)
        os.set_blocking(proc.stdin.fileno(), False)
        self.proc = proc
        self.started += 1
        self._started_at = time.monotonic()
        self._answers = b""
        return proc

    def _write(self, body: bytes, deadline: float | None = None) -> bool:
        proc = self._child()
        if proc is None:
            return False
        assert proc.stdin is not None
        data = memoryview(len(body).to_bytes(_HEAD, "little") + body)
        fd = proc.stdin.fileno()
        poller = select.poll()
        poller.register(fd, select.POLLOUT)
        give_up = time.monotonic() + self.stuck_s if deadline is None else deadline
        while data:
            try:
                data = data[os.write(fd, data) :]
                continue
            except BlockingIOError:
                pass
            except OSError:  # the child is gone (EPIPE): its pipe's spans with it
                self._discard()
                return False
            left = give_up - time.monotonic()
            if left <= 0:  # stuck (or a flush's deadline): half a frame is in the pipe, so the child goes
                self._discard()
                return False
            poller.poll(left * 1000)
        return True

    def _read_answer(self, deadline: float) -> list[Any] | None:
        proc = self.proc
        if proc is None:
            return None
        assert proc.stdout is not None
        fd = proc.stdout.fileno()
        while True:
            if len(self._answers) >= _HEAD:
                size = int.from_bytes(self._answers[:_HEAD], "little")
                if len(self._answers) >= _HEAD + size:
                    body, self._answers = self._answers[_HEAD : _HEAD + size], self._answers[_HEAD + size :]
                    answer: list[Any] = self._decode(body)
                    self._child_failed, self._settled = answer[1], answer[1] + answer[2]
                    return answer
            left = deadline - time.monotonic()
            poller = select.poll()  # not select(): a busy daemon's descriptors pass 1,024
            poller.register(fd, select.POLLIN)
            if not poller.poll(max(left, 0.0) * 1000):
                return None
            chunk = os.read(fd, 65536)
            if not chunk:  # the child died
                return None
            self._answers += chunk

    def _discard(self) -> None:
        """Kill and reap the child (it died, or is stuck, or its pipe holds half a frame); its successor waits."""
        proc, self.proc = self.proc, None
        if proc is None:
            return
        with contextlib.suppress(OSError):
            proc.kill()
        proc.wait()
        self._failed_before += self._child_failed + self._sent - self._settled  # its failures and its pipe's spans
        self._sent = self._settled = self._child_failed = 0
        for pipe in (proc.stdin, proc.stdout):
            with contextlib.suppress(OSError):
                pipe.close()  # type: ignore[union-attr]
        now = time.monotonic()
        young = now - self._started_at < _RESPAWN_MAX_S
        self._backoff = min(self._backoff * 2, _RESPAWN_MAX_S) if young and self._backoff else self.respawn_s
        self._next_start = now + self._backoff


# -- the child -----------------------------------------------------------------------------------


def _not_dumpable() -> None:
    """Linux: same-user processes cannot read this one's memory or ``/proc/PID/environ`` (as the worker daemon)."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_DUMPABLE, 0, 0, 0, 0)


def main(argv: Sequence[str]) -> int:
    """The exporter child: ``python -m wireio.span_export SERVICE [TRACES_URL]`` (module docstring)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the daemon's Ctrl-C is the daemon's: it flushes through us
    _not_dumpable()  # a worker's plans (same user) cannot read the collector's headers from /proc/PID/environ
    answers = os.dup(1)
    os.dup2(2, 1)  # stray prints (the SDK logs to stderr anyway) never corrupt the answers
    service, endpoint = argv[0], argv[1] if len(argv) > 1 else ""
    try:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        builder = SpanBuilder(service)
    except ImportError as exc:
        print(f"fleetwire span exporter: {exc}: pip install 'fleetwire[otel]'", file=sys.stderr)
        return 2
    exporter: Any = OTLPSpanExporter(endpoint=endpoint or None)
    gc.freeze()  # the SDK, protobuf and requests (~18,000 objects): never rescanned
    gc.set_threshold(*_GC_THRESHOLDS)
    decode = msgspec.msgpack.Decoder().decode
    encode = msgspec.msgpack.Encoder().encode
    exported = failed = 0
    with os.fdopen(0, "rb", buffering=_PIPE_BYTES) as pipe:
        while True:
            head = pipe.read(_HEAD)
            if len(head) < _HEAD:
                break
            size = int.from_bytes(head, "little")
            body = pipe.read(size)
            if len(body) < size:
                break
            what, payload = decode(body)
            seq = 0
            if what == _SPANS:
                if builder.export(exporter, payload):
                    exported += len(payload)
                else:
                    failed += len(payload)
            elif what == _FLUSH:
                seq = payload
            answer = encode((seq, failed, exported))
            os.write(answers, len(answer).to_bytes(_HEAD, "little") + answer)
    exporter.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
