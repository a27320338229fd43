"""Trace context on the wire (protocol/tracecontext.py) and the OpenTelemetry layer (wireio/tracing.py)."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import pytest

from protocol.tracecontext import (
    format_traceparent,
    handler_traceparent,
    is_sampled,
    parse_traceparent,
    trace_id_of,
    traceparent_problem,
)
from tests.otlp_receiver import OtlpReceiver
from tests.waiting import until
from wireio.span_export import ExportProcess
from wireio.tracing import SERVICE_COORDINATOR, Tracing, tracing_requested

TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
SPAN = "00f067aa0ba902b7"
SAMPLED = f"00-{TRACE}-{SPAN}-01"
UNSAMPLED = f"00-{TRACE}-{SPAN}-00"


def test_a_w3c_traceparent_parses_and_formats_back() -> None:
    """The W3C example parses into its trace, span and sampled flag, and formats back to itself."""
    parsed = parse_traceparent(SAMPLED)
    assert parsed is not None
    assert (parsed.trace_id, parsed.span_id, parsed.sampled) == (TRACE, SPAN, True)
    assert parsed.traceparent == SAMPLED
    assert format_traceparent(int(TRACE, 16), int(SPAN, 16), sampled=False) == UNSAMPLED
    assert (trace_id_of(SAMPLED), is_sampled(SAMPLED), is_sampled(UNSAMPLED)) == (TRACE, True, False)


def test_is_sampled_reads_bit_0_of_every_flags_byte() -> None:
    """Every flags byte, in lower or upper case hex: sampled exactly when its bit 0 is set."""
    for flags in range(256):
        for text in (f"{flags:02x}", f"{flags:02X}"):
            assert is_sampled(f"00-{TRACE}-{SPAN}-{text}") is bool(flags & 1), text
    assert not is_sampled(f"00-{TRACE}-{SPAN}") and not is_sampled("")


@pytest.mark.parametrize(
    ("text", "said"),
    [
        ("00-xyz", "is not a W3C traceparent"),
        (f"00-{TRACE.upper()}-{SPAN}-01", "lower case"),
        (f"00-{'0' * 32}-{SPAN}-01", "trace id is all zeros"),
        (f"00-{TRACE}-{'0' * 16}-01", "parent span id is all zeros"),
        (f"ff-{TRACE}-{SPAN}-01", "version ff is invalid"),
        (f"00-{TRACE}-{SPAN}-01-extra", "version 00 has exactly four fields"),
        ("0" * 300, "at most 256"),
    ],
)
def test_a_bad_traceparent_is_refused_naming_the_rule(text: str, said: str) -> None:
    """Each malformed traceparent gets a reason naming what is wrong; an empty one is no context, not an error."""
    problem = traceparent_problem(text)
    assert problem is not None and said in problem
    assert parse_traceparent(text) is None
    assert traceparent_problem("") is None
    assert traceparent_problem(f"01-{TRACE}-{SPAN}-01-future") is None  # a later version may add fields


def test_tracing_is_on_only_when_asked() -> None:
    """An OTLP endpoint (flag or variable) turns tracing on; OTEL_SDK_DISABLED and OTEL_TRACES_EXPORTER=none off."""
    assert not tracing_requested({})
    assert tracing_requested({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318"})
    assert tracing_requested({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://c:4318/v1/traces"})
    assert tracing_requested({}, endpoint="http://c:4318")
    assert not tracing_requested({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c", "OTEL_SDK_DISABLED": "true"})
    assert not tracing_requested({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c", "OTEL_TRACES_EXPORTER": "none"})
    assert Tracing.from_env(SERVICE_COORDINATOR, environ={}) is None


def test_importing_the_packages_imports_no_opentelemetry() -> None:
    """No cost when off: the SDK, the coordinator and the worker agent import no opentelemetry module."""
    code = (
        "import sys, fleetwire, fleetwire.client, coordinator.core, coordinator.io.frontdoor.server, "
        "worker_agent.agent, wireio.tracing; "
        "print(sorted(m for m in sys.modules if m.startswith('opentelemetry')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_spans_reach_a_real_otlp_receiver_as_children_of_the_remote_parent() -> None:
    """A recorded span and a live one go over OTLP/HTTP, in the parent's trace, under the service's name;
    an unsampled parent makes none."""
    with OtlpReceiver() as receiver:
        tracing = Tracing(SERVICE_COORDINATOR, endpoint=receiver.endpoint, environ={})
        child = tracing.record("fleetwire.queue", SAMPLED, 1_000, 2_000, {"fleetwire.plan_id": "p1"},
                               events=[("waiting", 1_500, {"reason": "no worker has tag gpu"})])  # fmt: skip
        assert trace_id_of(child) == TRACE and is_sampled(child)
        assert tracing.record("fleetwire.queue", UNSAMPLED, 1_000, 2_000) == ""
        assert tracing.start("fleetwire.attempt", UNSAMPLED) is None
        live = tracing.start("fleetwire.attempt", child, {"fleetwire.attempt": 1}, kind="consumer")
        assert live is not None
        live.end(error="handler_error")
        tracing.shutdown()
        spans = receiver.wait_for(lambda got: len(got) >= 2)
    by_name = {s.name: s for s in spans}
    queue, attempt = by_name["fleetwire.queue"], by_name["fleetwire.attempt"]
    assert {s.service for s in spans} == {"fleetwire-coordinator"}
    assert (queue.trace_id, queue.parent_span_id) == (TRACE, SPAN)
    assert (queue.start_ns, queue.end_ns, queue.events) == (1_000, 2_000, ["waiting"])
    assert queue.attributes == {"fleetwire.plan_id": "p1"}
    assert attempt.parent_span_id == queue.span_id and attempt.error
    assert len(spans) == 2


class _Counting:
    """A span exporter that keeps what it is handed (the SDK's interface: export, force_flush, shutdown)."""

    def __init__(self) -> None:
        self.spans: list[object] = []

    def export(self, spans: list[object]) -> None:
        self.spans += spans

    def force_flush(self, timeout_millis: int = 0) -> bool:
        return True

    def shutdown(self) -> None:
        pass


def test_the_root_sampler_draws_the_ratio_and_ids_a_downstream_ratio_sampler_agrees_with() -> None:
    """At ratio 0.01 about 1 % of roots are sampled, each id under the SDK's TraceIdRatioBased bound; always_off samples
    none; a parent-based sampler follows the parent's flag, a plain ratio one the parent's trace id."""
    import random

    from opentelemetry.sdk.trace.sampling import TraceIdRatioBased

    from wireio.tracing import Sampler

    sampler = Sampler.from_env({"OTEL_TRACES_SAMPLER": "parentbased_traceidratio", "OTEL_TRACES_SAMPLER_ARG": "0.01"})
    rng = random.Random(7)
    ids = [sampler.root(rng) for _ in range(20_000)]
    sampled = [i for i in ids if i]
    assert 140 <= len(sampled) <= 260  # 200 expected
    sdk = TraceIdRatioBased(0.01)
    assert all(sdk.should_sample(None, i, "x").decision.is_sampled() for i in sampled)
    assert Sampler("always_off").root(rng) == 0 and Sampler("bogus").name == "parentbased_always_on"
    assert sampler.child(SAMPLED) and not sampler.child(UNSAMPLED)
    plain = Sampler("traceidratio", 0.5)
    assert plain.child(f"00-{'0' * 16}{'f' * 16}-{SPAN}-01") is False
    assert plain.child(f"00-{'0' * 16}{'0' * 15}1-{SPAN}-00") is True


def test_an_unsampled_context_notes_nothing_and_a_full_queue_drops_without_blocking() -> None:
    """An unsampled parent or root is no span at all (nothing queued, nothing exported); past
    OTEL_BSP_MAX_QUEUE_SIZE spans are dropped and counted, never waited for."""
    exporter = _Counting()
    environ = {"OTEL_BSP_MAX_QUEUE_SIZE": "3", "OTEL_BSP_SCHEDULE_DELAY": "600000", "OTEL_TRACES_SAMPLER": "always_off"}
    tracing = Tracing(SERVICE_COORDINATOR, exporter=exporter, environ=environ)
    try:
        assert tracing.start("fleetwire.submit", "", kind="producer", root=True) is None
        assert tracing.record("fleetwire.queue", UNSAMPLED, 1, 2) == ""
        assert len(tracing._queue) == 0
        for _ in range(5):
            tracing.record("fleetwire.queue", SAMPLED, 1, 2)
        assert (len(tracing._queue), tracing.dropped) == (3, 2)
        tracing.flush()
        assert (len(exporter.spans), tracing.exported) == (3, 3)
    finally:
        tracing.shutdown()


def test_the_client_decides_once_and_an_unsampled_plan_carries_only_its_callers_context(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With the client's sampler off, a submit outside any span carries the decision alone ("00": unsampled, no ids)
    and makes no span; inside an application's unsampled span it carries that span's context, flag clear, so no hop
    makes a span."""
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.sampling import ALWAYS_OFF

    import fleetwire.tracing
    from protocol.messages import Submit

    tracing = Tracing("fleetwire-client", exporter=_Counting(), environ={"OTEL_TRACES_SAMPLER": "always_off"})
    monkeypatch.setattr(fleetwire.tracing, "_tracing", tracing)
    try:
        msgs = [Submit(req_id=1, op="echo"), Submit(req_id=2, op="echo")]
        assert fleetwire.tracing.start_submit_spans(msgs) is None
        assert [m.traceparent for m in msgs] == ["00", "00"]
        app = TracerProvider(sampler=ALWAYS_OFF).get_tracer("app")
        with app.start_as_current_span("request") as request:
            assert fleetwire.tracing.start_submit_spans(msgs) is None
        context = request.get_span_context()
        assert {m.traceparent for m in msgs} == {format_traceparent(context.trace_id, context.span_id, sampled=False)}
        assert len(tracing._queue) == 0
    finally:
        tracing.shutdown()


def test_a_batch_the_collector_refuses_counts_as_dropped_not_exported() -> None:
    """An export that fails (the SDK exporter's FAILURE: collector away or refusing) counts its spans in dropped."""
    from opentelemetry.sdk.trace.export import SpanExportResult

    class Refusing(_Counting):
        def export(self, spans: list[object]) -> SpanExportResult:  # type: ignore[override]
            return SpanExportResult.FAILURE

    tracing = Tracing(SERVICE_COORDINATOR, exporter=Refusing(), environ={"OTEL_BSP_SCHEDULE_DELAY": "600000"})
    try:
        tracing.record("fleetwire.queue", SAMPLED, 1, 2)
        tracing.flush()
        assert (tracing.exported, tracing.dropped) == (0, 1)
    finally:
        tracing.shutdown()


def test_an_exporter_process_posts_the_spans_and_the_daemon_imports_no_sdk() -> None:
    """With export_process the spans reach a real receiver through the child (service name, parent and attributes
    kept, flush waits for the post), and the process that noted them never imported the SDK or protobuf."""
    code = (
        "import sys; from wireio.tracing import Tracing; "
        "t = Tracing('fleetwire-worker', endpoint=sys.argv[1], environ={}, export_process=True); "
        f"t.record('fleetwire.queue', {SAMPLED!r}, 1_000, 2_000, {{'fleetwire.attempt': 2, 'ok': True}}, "
        "events=[('waiting', 1_500, {'reason': 'r'})]); "
        "assert t.flush(20), 'flush'; t.shutdown(); "
        "print(sorted(m for m in sys.modules if m.startswith(('opentelemetry.sdk.', 'google.protobuf', 'requests'))), "
        "t.exported, t.dropped, t.process.started)"
    )
    with OtlpReceiver() as receiver:
        out = subprocess.run([sys.executable, "-c", code, receiver.endpoint], capture_output=True, text=True,
                             check=True, timeout=60).stdout  # fmt: skip
        (span,) = receiver.wait_for(lambda got: len(got) >= 1)
    assert out.split() == ["[]", "1", "0", "1"]
    assert (span.service, span.name, span.trace_id, span.parent_span_id) == ("fleetwire-worker", "fleetwire.queue",
                                                                             TRACE, SPAN)  # fmt: skip
    assert (span.start_ns, span.end_ns, span.events) == (1_000, 2_000, ["waiting"])
    assert span.attributes == {"fleetwire.attempt": 2, "ok": True}


def _process_tracing(receiver: OtlpReceiver, batch: int = 2048) -> Tracing:
    """A tracer whose child posts to ``receiver``; its thread sends only full batches (of ``batch`` spans)."""
    environ = {"OTEL_BSP_SCHEDULE_DELAY": "600000", "OTEL_BSP_MAX_EXPORT_BATCH_SIZE": str(batch)}
    tracing = Tracing(SERVICE_COORDINATOR, endpoint=receiver.endpoint, environ=environ, export_process=True)
    assert tracing.process is not None and tracing.process.proc is not None
    return tracing


def test_a_killed_exporter_process_is_replaced_and_spans_meanwhile_are_dropped_not_waited_for() -> None:
    """A child killed between batches is replaced at the next batch and its spans go through; the spans a child dies
    with are counted dropped, and while its successor waits out the pause after a death, a batch is dropped and
    counted at once, never waited for."""
    import signal
    import time

    with OtlpReceiver() as receiver:
        tracing = _process_tracing(receiver)
        process = tracing.process
        assert process is not None and process.proc is not None
        try:
            process.respawn_s = 0.0
            process.proc.send_signal(signal.SIGKILL)
            process.proc.wait()
            tracing.record("after-kill", SAMPLED, 1, 2)
            assert tracing.flush(20)
            assert receiver.wait_for(lambda got: any(s.name == "after-kill" for s in got))
            assert (process.started, tracing.exported, tracing.dropped) == (2, 1, 0)

            process.respawn_s = 600.0  # the next death's successor waits: what comes meanwhile is lost
            child = process.proc
            assert child is not None
            child.send_signal(signal.SIGSTOP)
            tracing.record("in-its-pipe", SAMPLED, 1, 2)
            assert not tracing.flush(0.3)  # sent, never answered for
            child.send_signal(signal.SIGKILL)
            child.wait()
            tracing.record("while-away", SAMPLED, 1, 2)
            began = time.monotonic()
            assert not tracing.flush(20)
            assert time.monotonic() - began < 5
            assert (process.started, process.proc, tracing.exported, tracing.dropped) == (2, None, 1, 2)
        finally:
            tracing.shutdown()
        assert not {"in-its-pipe", "while-away"} & {s.name for s in receiver.spans}


def _settled(tracing: Tracing) -> Tracing:
    """``tracing`` once its exporter thread woke for a first span and went back to its delay (600 s here): it exports
    nothing more until a full batch (or the shutdown) wakes it. A span noted while it unparks may wake it again
    (the noter saw it parked and sets its event after the thread cleared it): an export then, at a time the test does
    not choose."""
    tracing.record("fleetwire.first", SAMPLED, 0, 1)
    asyncio.run(until(lambda: not tracing._wake.is_set(), timeout_s=20))
    return tracing


def _note_spans(tracing: Tracing, count: int) -> None:
    for i in range(count):
        tracing.record("fleetwire.queue", SAMPLED, i, i + 1, {"fleetwire.plan_id": f"plan-{i:08d}"})


def _stopped_child(tracing: Tracing, stuck_s: float) -> tuple[ExportProcess, subprocess.Popen[bytes]]:
    """``tracing``'s exporter child stopped (SIGSTOP: it reads nothing more), killed by the parent once its pipe has
    been full for ``stuck_s``, at a close after 0.5 s, and not started again; the process handle and the child."""
    import signal

    process = tracing.process
    assert process is not None and process.proc is not None
    stopped = process.proc
    process.stuck_s, process.exit_wait_s, process.respawn_s = stuck_s, 0.5, 600.0
    stopped.send_signal(signal.SIGSTOP)
    return process, stopped


def _batch_in_flight(tracing: Tracing) -> None:
    """A full batch (20,000 spans with the first, ~3 MB for a 1 MB pipe) noted and taken by the exporter thread,
    whose write to the stopped child then waits out stuck_s."""
    _note_spans(_settled(tracing), 20_000 - 1)
    asyncio.run(until(lambda: tracing._in_flight == 20_000, timeout_s=20))


def test_a_stuck_exporter_process_is_killed_and_a_flush_or_shutdown_never_hangs() -> None:
    """A child that stops reading (SIGSTOP) is killed once its pipe has been full for stuck_s: the spans it did not
    take are dropped and counted, the flush that found it says so within its bound, and the shutdown is prompt."""
    import signal
    import time

    with OtlpReceiver() as receiver:
        tracing = _process_tracing(receiver, batch=1_000_000)  # the flush below sends them: one ~3 MB frame
        process, stopped = _stopped_child(tracing, stuck_s=0.3)
        try:
            _settled(tracing)  # the spans are the flush's to send, not an export of the thread's at its own time
            _note_spans(tracing, 20_000 - 1)  # 20,000 with the first: more than the pipe holds
            began = time.monotonic()
            assert not tracing.flush(1.0)
            assert time.monotonic() - began < 5
            assert stopped.returncode == -signal.SIGKILL and process.proc is None
            assert (tracing.exported, tracing.dropped) == (0, 20_000)
        finally:
            began = time.monotonic()
            tracing.shutdown()
            assert time.monotonic() - began < 5


def test_a_flush_says_false_when_the_exporter_threads_batch_is_lost_while_it_waits() -> None:
    """The exporter thread took a full batch (noted before the flush) and is writing it to a child that stopped
    reading: the flush waits behind that write, the child is killed at stuck_s and the batch dropped, which leaves
    the flush nothing to send itself. It says False: spans noted before it were lost (it said True)."""
    import signal

    with OtlpReceiver() as receiver:
        tracing = _process_tracing(receiver, batch=20_000)
        process, stopped = _stopped_child(tracing, stuck_s=3.0)
        try:
            _batch_in_flight(tracing)
            assert not tracing.flush(30)
            assert stopped.returncode == -signal.SIGKILL and process.proc is None
            assert (tracing.exported, tracing.dropped) == (0, 20_000)
        finally:
            tracing.shutdown()


def test_a_flush_behind_the_exporter_threads_stuck_write_ends_at_its_own_bound() -> None:
    """The exporter thread is writing a full batch to a child that stopped reading (stuck_s 10 s): flush(0.5) says
    False within a few seconds (it waited out the thread's write: 10 s), and the shutdown then kills the child at
    its exit_wait_s, the batch counted dropped."""
    import signal
    import time

    with OtlpReceiver() as receiver:
        tracing = _process_tracing(receiver, batch=20_000)
        process, stopped = _stopped_child(tracing, stuck_s=10.0)
        try:
            _batch_in_flight(tracing)
            began = time.monotonic()
            assert not tracing.flush(0.5)
            assert time.monotonic() - began < process.stuck_s / 2
        finally:
            began = time.monotonic()
            tracing.shutdown()
            assert time.monotonic() - began < process.stuck_s / 2
        assert stopped.returncode == -signal.SIGKILL and process.proc is None
        assert (tracing.exported, tracing.dropped) == (0, 20_000)


def test_fleetwire_trace_export_says_where_a_tracer_from_the_environment_exports() -> None:
    """FLEETWIRE_TRACE_EXPORT=process gives the client an exporter process, =thread keeps a daemon's in-process; any
    other value is refused naming the variable."""
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:9", "OTEL_BSP_SCHEDULE_DELAY": "600000"}
    client = Tracing.from_env("fleetwire-client", environ={**env, "FLEETWIRE_TRACE_EXPORT": "process"})
    daemon = Tracing.from_env(SERVICE_COORDINATOR, environ={**env, "FLEETWIRE_TRACE_EXPORT": "Thread"},
                              export_process=True)  # fmt: skip
    default = Tracing.from_env(SERVICE_COORDINATOR, environ=env, export_process=True)
    try:
        assert client is not None and client.process is not None
        assert daemon is not None and daemon.process is None
        assert default is not None and default.process is not None
    finally:
        for tracing in (client, daemon, default):
            if tracing is not None:
                tracing.shutdown()
    with pytest.raises(ValueError, match="FLEETWIRE_TRACE_EXPORT='both'"):
        Tracing.from_env(SERVICE_COORDINATOR, environ={**env, "FLEETWIRE_TRACE_EXPORT": "both"})


def test_a_forked_copy_never_writes_to_the_parents_exporter_process() -> None:
    """A fork of a process with an exporter child (multiprocessing's default) drops its own spans and leaves the pipe
    alone: the parent's spans still arrive whole, and the fork's shutdown does not stop the parent's child."""
    import os

    with OtlpReceiver() as receiver:
        tracing = _process_tracing(receiver)
        process = tracing.process
        assert process is not None
        process.respawn_s = 0.0  # nothing but the fork check keeps the fork from starting a child of its own
        pid = os.fork()
        if pid == 0:  # the fork: note, flush, shut down, then leave without running the parent's cleanup
            tracing.record("from-the-fork", SAMPLED, 1, 2)
            ok = tracing.flush(5) is False and tracing.dropped == 1 and process.started == 1
            tracing.shutdown()
            os._exit(0 if ok else 1)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        try:
            tracing.record("from-the-parent", SAMPLED, 1, 2)
            assert tracing.flush(20) and process.started == 1
            receiver.wait_for(lambda got: any(s.name == "from-the-parent" for s in got))
        finally:
            tracing.shutdown()
        assert not any(s.name == "from-the-fork" for s in receiver.spans)


def test_the_exporter_process_gets_the_otel_variables_and_no_fleetwire_token(monkeypatch: pytest.MonkeyPatch) -> None:
    """The child's environment has the tracer's OTEL_* variables and none of the FLEETWIRE_* ones a worker reads
    its tokens from before it forgets them."""
    monkeypatch.setenv("FLEETWIRE_WORKER_TOKEN", "wt-secret")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_HEADERS", "from-the-process")
    tracing = Tracing(SERVICE_COORDINATOR, endpoint="http://127.0.0.1:9", export_process=True,
                      environ={"OTEL_EXPORTER_OTLP_HEADERS": "authorization=Bearer%20c"})  # fmt: skip
    try:
        assert tracing.process is not None
        env = tracing.process.env
        assert env["OTEL_EXPORTER_OTLP_HEADERS"] == "authorization=Bearer%20c"
        assert not [k for k in env if k.startswith("FLEETWIRE_")] and "PATH" in env
    finally:
        tracing.shutdown()


def test_the_exporter_process_posts_through_the_standard_exporters_client_with_its_settings() -> None:
    """The hand-encoded request goes out as the standard OTLP/HTTP exporter configures it: gzip and the headers
    its OTEL_* variables name; the receiver decodes every span."""
    with OtlpReceiver() as receiver:
        environ = {"OTEL_EXPORTER_OTLP_TRACES_COMPRESSION": "gzip", "OTEL_EXPORTER_OTLP_TRACES_HEADERS": "x-tenant=t1"}
        tracing = Tracing(SERVICE_COORDINATOR, endpoint=receiver.endpoint, environ=environ, export_process=True)
        try:
            for i in range(3):
                tracing.add("fleetwire.store.commit", SAMPLED, 1_000, 2_000, {"fleetwire.plan_id": f"p{i}"})
            assert tracing.flush(20)
        finally:
            tracing.shutdown()
        spans = receiver.wait_for(lambda got: len(got) >= 3)
    assert sorted(s.attributes["fleetwire.plan_id"] for s in spans) == ["p0", "p1", "p2"]
    assert {(h.get("content-encoding"), h.get("x-tenant")) for h in receiver.headers} == {("gzip", "t1")}


def test_start_each_decides_a_batch_once_under_a_parent_and_builds_attributes_only_for_sampled_spans() -> None:
    """Under a sampled parent every item gets a span, child of it; under an unsampled one none, and no attributes
    are built; without a parent (ratio 0.5) each item is its own trace, decided alone. Each sampled span comes with
    its item's place."""
    environ = {"OTEL_TRACES_SAMPLER": "parentbased_traceidratio", "OTEL_TRACES_SAMPLER_ARG": "0.5"}
    tracing = Tracing("fleetwire-client", exporter=_Counting(), environ=environ)
    built: list[int] = []

    def attributes_of(item: int) -> dict[str, str | int | float | bool]:
        built.append(item)
        return {"item": item}

    try:
        spans = tracing.start_each("s", SAMPLED, [1, 2, 3], attributes_of)
        assert [i for i, _ in spans] == [0, 1, 2] and all(s.traceparent[3:35] == TRACE for _, s in spans)
        assert built == [1, 2, 3]
        built.clear()
        assert tracing.start_each("s", UNSAMPLED, [1, 2], attributes_of) == []
        assert built == []
        roots = tracing.start_each("s", "", list(range(400)), attributes_of)
        assert 120 < len(built) < 280
        assert built == [i for i, _ in roots] and [s._attributes["item"] for _, s in roots] == built
        assert len({s.trace_id for _, s in roots}) == len(built)
    finally:
        tracing.shutdown()


def test_the_unsampled_decision_without_ids_is_valid_and_a_handler_gets_a_fresh_w3c_context_for_it() -> None:
    """"00" (unsampled, no ids) is a valid traceparent that is not sampled and names no trace; for it a handler gets
    fresh unsampled W3C contexts (valid, flags 00, all distinct, across the pool's refills); any other is kept."""
    from protocol.tracecontext import _TRACEPARENT, UNSAMPLED

    assert UNSAMPLED == "00" and traceparent_problem(UNSAMPLED) is None and parse_traceparent(UNSAMPLED) is None
    assert (is_sampled(UNSAMPLED), trace_id_of(UNSAMPLED)) == (False, "")
    fresh = [handler_traceparent(UNSAMPLED) for _ in range(600)]
    assert len(set(fresh)) == 600 and len({t[3:35] for t in fresh}) == 600
    for text in fresh:
        parsed = parse_traceparent(text)
        assert _TRACEPARENT.fullmatch(text) and parsed is not None and parsed.flags == 0 and not is_sampled(text)
    assert [handler_traceparent(t) for t in (SAMPLED, UNSAMPLED[:0], UNSAMPLED * 0)] == [SAMPLED, "", ""]
    assert handler_traceparent(f"00-{TRACE}-{SPAN}-00") == f"00-{TRACE}-{SPAN}-00"


def test_next_roots_carries_the_gap_across_calls_and_samples_each_root_at_the_ratio() -> None:
    """next_roots over a stream of calls (lone submits, batches of any size): every root sampled with the ratio's
    probability wherever it falls, one draw per sampled root, none for a call whose roots all fall in the gap."""
    import random

    from wireio.tracing import Sampler

    class Counted(random.Random):
        draws = 0

        def random(self) -> float:
            Counted.draws += 1
            return super().random()

    rng = Counted(5)
    sampler = Sampler("parentbased_traceidratio", 0.01)
    sizes = [1, 1, 7, 500, 1, 64] * 2_000  # 1,148,000 roots
    picked = [i for n in sizes for i in sampler.next_roots(n, rng)]
    assert 10_900 <= len(picked) <= 12_100 and Counted.draws == len(picked)
    lone = sum(1 for n, places in ((n, sampler.next_roots(n, rng)) for n in [1] * 200_000) if places)
    assert 1_800 <= lone <= 2_200
    half = Sampler("traceidratio", 0.5)
    counts = [0] * 4
    for _ in range(20_000):
        for i in half.next_roots(4, rng):
            counts[i] += 1
    assert all(9_500 <= n <= 10_500 for n in counts)
    off = Sampler("always_off")
    assert [off.next_roots(9, rng) for _ in range(3)] == [[], [], []]
    assert Sampler("x").next_roots(3) == [0, 1, 2] and Sampler("traceidratio", 1e-300).next_roots(9) == []


def test_step_records_weigh_their_notes_against_the_queue_and_a_batch() -> None:
    """A step record (the coordinator's notes of one step) counts its notes against OTEL_BSP_MAX_QUEUE_SIZE (past
    it, the record is dropped and counted) and against a batch: a batch holds records up to the batch size in
    notes, so a pipe frame stays about a batch of spans."""
    from wireio.span_export import COMMIT_RECORD, STEP_RECORD

    environ = {"OTEL_BSP_MAX_QUEUE_SIZE": "10", "OTEL_BSP_MAX_EXPORT_BATCH_SIZE": "4",
               "OTEL_BSP_SCHEDULE_DELAY": "600000"}  # fmt: skip
    tracing = Tracing(SERVICE_COORDINATOR, exporter=_Counting(), environ=environ)
    try:
        notes = [(SAMPLED, f"p{i}", 0, "queued", None) for i in range(3)]
        for step in (1, 2):
            tracing.add_step(step, 1_000, notes)
            tracing.add_commit(step, 2_000)
        tracing.add_step(3, 1_000, notes)  # 4 records and 6 notes queued: 10
        assert (len(tracing._queue), tracing.dropped) == (4, 1)
        assert [r[0] for r in tracing._take_weighed(4)] == [STEP_RECORD, COMMIT_RECORD]  # 3 notes + 1: a batch
        assert (tracing._noted - tracing._taken, len(tracing._queue)) == (3, 2)
        assert [r[1] for r in tracing._take_weighed(4)] == [2, 2] and tracing._noted == tracing._taken == 6
    finally:
        tracing.shutdown()


def test_a_shutdown_while_a_flush_starts_its_thread_goes_on(monkeypatch: pytest.MonkeyPatch) -> None:
    """A shutdown (the worker's executor) that runs while a flush in another thread has made its exporting thread but
    not yet started it: the shutdown closes the child (no "cannot join thread before it is started"); the flush,
    let go after, finds the tracer closed and ends."""
    import threading

    tracing = Tracing(SERVICE_COORDINATOR, endpoint="http://127.0.0.1:9", export_process=True)
    start, held, go = threading.Thread.start, threading.Event(), threading.Event()

    def slow_start(thread: threading.Thread) -> None:
        if thread.name.startswith("fleetwire-spans-flush"):
            held.set()
            go.wait(10)
        start(thread)

    monkeypatch.setattr(threading.Thread, "start", slow_start)
    flushing = threading.Thread(target=tracing.flush, args=(5.0,), name="test-flush-caller")
    flushing.start()
    try:
        assert held.wait(10)
        tracing.shutdown()
        assert tracing.process is not None and tracing.process.proc is None  # the child closed
    finally:
        go.set()
        flushing.join(10)
    assert not flushing.is_alive()
