"""A traced plan through the core (fake clock): the notes its steps leave, and the coordinator's spans made of them."""

from __future__ import annotations

from typing import Any

from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from coordinator.effects import TraceNote
from coordinator.io.ops.tracing import PlanSpans
from protocol import errors
from protocol.messages import (
    Accept,
    Assign,
    Capabilities,
    Done,
    Error,
    GetPlan,
    Hello,
    PlanReply,
    Receipt,
    Reject,
    Submit,
)
from tests.unit.test_core import Harness, only
from wireio.tracing import SERVICE_COORDINATOR, Tracing

TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
SAMPLED = f"00-{TRACE}-00f067aa0ba902b7-01"
UNSAMPLED = f"00-{TRACE}-00f067aa0ba902b7-00"


class Traced(Harness):
    """The harness with the core tracing, keeping each step's notes."""

    def __init__(self, **config: Any) -> None:
        super().__init__(**config)
        self.core.streams.tracing = True
        self.steps: list[list[TraceNote]] = []

    def _pump(self) -> None:
        effects = self.core.take_effects()
        if effects.traces is not None:
            self.steps.append(effects.traces)
        for conn_id, msgs in effects.sends.items():
            self.inbox.setdefault(conn_id, []).extend(msgs)

    def kinds(self) -> list[str]:
        return [note[3] for step in self.steps for note in step]


def test_a_sampled_plans_steps_are_noted_and_its_context_reaches_the_worker() -> None:
    """queued, waiting, leased (one note, with its placement's policy and worker), succeeded are noted with the
    caller's context (running is not: no span needs it); assign carries it; get_plan and the receipt name the
    trace."""
    h = Traced()
    c = h.client()
    plan = h.submit(c, traceparent=SAMPLED)
    w = h.worker("w1")
    assign = only(h.take(w), Assign)
    assert assign.traceparent == SAMPLED
    h.send(w, Accept(plan_id=plan, attempt=1))
    h.send(w, Done(plan_id=plan, attempt=1, outcome="succeeded", receipt=Receipt(joules=1.0)))
    assert h.kinds() == ["queued", "waiting", "leased", "succeeded"]
    leased = next(n for s in h.steps for n in s if n[3] == "leased")
    assert leased[4] == ("joule_weighted", "w1") and leased[0] == SAMPLED
    h.send(c, GetPlan(req_id=9, plan_id=plan))
    info = only(h.take(c), PlanReply).plan
    assert info.trace_id == TRACE
    assert info.receipt is not None and info.receipt.trace_id == TRACE


def test_unsampled_untraced_and_tracing_off_note_nothing() -> None:
    """An unsampled context, the caller's "no" without ids ("00"), no context, or a core that does not trace: no
    note, no trace id (the worker still gets the context)."""
    h = Traced()
    c = h.client()
    h.submit(c, traceparent=UNSAMPLED)
    bare = h.submit(c, traceparent="00")
    h.submit(c)
    w = h.worker("w1", max_concurrency=3)
    assert [a.traceparent for a in h.take(w) if isinstance(a, Assign)] == [UNSAMPLED, "00", ""]
    assert h.steps == [] and not any(plan.sampled for plan in h.core.plans.values())
    h.send(c, GetPlan(req_id=9, plan_id=bare))
    assert only(h.take(c), PlanReply).plan.trace_id == ""
    off = Traced()
    off.core.streams.tracing = False
    off.submit(off.client(), traceparent=SAMPLED)
    assert off.steps == []


def test_a_worker_that_reads_it_gets_the_unsampled_decision_in_one_character_and_an_older_one_gets_00() -> None:
    """A plan carrying "00" is assigned with "0" (protocol/tracecontext.py UNSAMPLED_SHORT) to a worker whose hello
    says ``capabilities.short_unsampled``, and with "00" to one that does not (an older worker); any other context
    goes to either as it came. The plan itself keeps "00" (stored, and forwarded again on a retry elsewhere)."""
    h = Traced()
    c = h.client()
    plans = [h.submit(c, traceparent=t) for t in ("00", SAMPLED, UNSAMPLED)] + [h.submit(c)]
    conn = 100
    h.core.open_session(conn, "worker", h.now, address="10.0.0.100:4000")
    caps = Capabilities(cpu_cores=4, ram_bytes=8_000_000_000, ops=["echo"], max_concurrency=4, short_unsampled=True)
    h.send(conn, Hello(worker_id="new", capabilities=caps))
    assert [a.traceparent for a in h.take(conn) if isinstance(a, Assign)] == ["0", SAMPLED, UNSAMPLED, ""]
    assert h.core.plans[plans[0]].traceparent == "00"
    old = Traced()
    old.submit(old.client(), traceparent="00")
    w = old.worker("old")
    assert [a.traceparent for a in old.take(w) if isinstance(a, Assign)] == ["00"]


def test_a_submit_may_carry_the_unsampled_decision_in_one_character_and_the_plan_keeps_00() -> None:
    """submit.traceparent "0" is accepted as "00" (docs/PROTOCOL.md §4 submit): the plan holds "00" (no step is
    noted) and is assigned as "00" is, "0" to a worker that reads it and "00" to an older one; a plan made again from
    its stored submit (recovery) holds "00" too."""
    from coordinator.plans import Plan

    h = Traced()
    c = h.client()
    plan = h.submit(c, traceparent="0")
    assert h.core.plans[plan].traceparent == "00" and not h.core.plans[plan].sampled
    conn = 100
    h.core.open_session(conn, "worker", h.now, address="10.0.0.100:4000")
    caps = Capabilities(cpu_cores=4, ram_bytes=8_000_000_000, ops=["echo"], max_concurrency=4, short_unsampled=True)
    h.send(conn, Hello(worker_id="new", capabilities=caps))
    assert [a.traceparent for a in h.take(conn) if isinstance(a, Assign)] == ["0"]
    assert h.steps == [] or all(not step for step in h.steps)
    old = Traced()
    old.submit(old.client(), traceparent="0")
    w = old.worker("old")
    assert [a.traceparent for a in old.take(w) if isinstance(a, Assign)] == ["00"]
    assert Plan.from_submit(Submit(req_id=1, op="echo", traceparent="0"), "p9", "alice", 0).traceparent == "00"


def test_a_malformed_traceparent_is_refused_naming_the_field() -> None:
    """submit.traceparent that is not W3C is invalid_argument, and no plan is made."""
    h = Traced()
    c = h.client()
    h.send(c, Submit(req_id=1, op="echo", traceparent="00-nope"))
    error = only(h.take(c), Error)
    assert error.code == errors.INVALID_ARGUMENT and error.message.startswith("submit.traceparent '00-nope'")
    assert h.core.plans == {}


def test_spans_from_notes_queue_with_wait_reasons_placement_and_commits() -> None:
    """The queue span runs from queued to its placement with each waiting reason as an event and the placement's
    policy and worker; a reject requeues it as a second queue span; the creation and end are commit spans."""
    h = Traced()
    c = h.client()
    plan = h.submit(c, traceparent=SAMPLED)
    w = h.worker("w1")
    h.send(w, Reject(plan_id=plan, attempt=1, code="rejected", reason="busy"))
    w2 = h.worker("w2")
    h.send(w2, Accept(plan_id=plan, attempt=2))
    h.send(w2, Done(plan_id=plan, attempt=2, outcome="succeeded"))
    exporter = InMemorySpanExporter()
    tracing = Tracing(SERVICE_COORDINATOR, exporter=exporter, environ={})
    clock = iter(range(1_000, 100_000, 1_000))
    spans = PlanSpans(tracing, clock=lambda: next(clock))
    for step in h.steps:
        spans.flushed(step)
        spans.delivered(step)
    tracing.flush()
    got = exporter.get_finished_spans()
    names = [s.name for s in got]
    assert names.count("fleetwire.queue") == 2 and names.count("fleetwire.store.commit") == 2
    assert len(names) == 4  # no span beside these: each costs the exporter's encoding
    first_queue = next(s for s in got if s.name == "fleetwire.queue")
    assert [e.name for e in first_queue.events] == ["waiting"]
    assert first_queue.attributes is not None
    assert first_queue.attributes["fleetwire.wait_reason"] == "no connected worker handles op 'echo'"
    assert first_queue.attributes["fleetwire.attempt"] == 1
    placements = [s.attributes for s in got if s.name == "fleetwire.queue"]
    assert [(a["fleetwire.worker_id"], a["fleetwire.attempt"], a["fleetwire.policy"]) for a in placements if a] == [
        ("w1", 1, "joule_weighted"), ("w2", 2, "joule_weighted")]
    assert all(s.parent is not None and f"{s.parent.span_id:016x}" == "00f067aa0ba902b7" for s in got)
    assert {f"{s.context.trace_id:032x}" for s in got} == {TRACE}
    assert tracing._builder is not None and tracing._builder.steps.queued == 0
    tracing.shutdown()


def test_a_plan_placed_at_once_has_a_queue_span_without_a_wait_reason() -> None:
    """A plan a connected worker takes at once: its queue span names the placement but carries no empty
    wait_reason attribute (each attribute costs the exporter's encoding)."""
    h = Traced()
    w = h.worker("w1")
    c = h.client()
    plan = h.submit(c, traceparent=SAMPLED)
    h.send(w, Accept(plan_id=plan, attempt=1))
    exporter = InMemorySpanExporter()
    tracing = Tracing(SERVICE_COORDINATOR, exporter=exporter, environ={})
    clock = iter(range(1_000, 100_000, 1_000))
    spans = PlanSpans(tracing, clock=lambda: next(clock))
    for step in h.steps:
        spans.flushed(step)
        spans.delivered(step)
    tracing.flush()
    (queue,) = [s for s in exporter.get_finished_spans() if s.name == "fleetwire.queue"]
    assert dict(queue.attributes or {}) == {"fleetwire.plan_id": plan, "fleetwire.attempt": 1,
                                            "fleetwire.policy": "joule_weighted", "fleetwire.worker_id": "w1"}
    tracing.shutdown()


def test_a_lease_without_a_queued_note_still_ends_a_queue_span_and_an_adopted_lease_names_no_placement() -> None:
    """A plan queued before a restart and leased after it gets a queue span from the lease, with its placement; a
    lease recovery adopted (no placement) ends the plan's queue span without policy or worker."""
    exporter = InMemorySpanExporter()
    tracing = Tracing(SERVICE_COORDINATOR, exporter=exporter, environ={})
    spans = PlanSpans(tracing, clock=lambda: 5_000)
    spans.flushed([(SAMPLED, "p1", 1, "leased", ("fifo", "w1"))])
    spans.flushed([(SAMPLED, "p2", 0, "queued", None)])
    spans.flushed([(SAMPLED, "p2", 3, "leased", None)])
    tracing.flush()
    got = {(s.attributes or {})["fleetwire.plan_id"]: dict(s.attributes or {}) for s in exporter.get_finished_spans()}
    assert got == {"p1": {"fleetwire.plan_id": "p1", "fleetwire.attempt": 1, "fleetwire.policy": "fifo",
                          "fleetwire.worker_id": "w1"},
                   "p2": {"fleetwire.plan_id": "p2", "fleetwire.attempt": 1}}  # fmt: skip
    assert tracing._builder is not None and tracing._builder.steps.queued == 0
    tracing.shutdown()


def test_the_loop_hands_the_tracer_one_record_a_step_and_an_end_note_carries_no_result() -> None:
    """PlanSpans does no work per plan on the event loop: a step of 50 traced plans is one record when flushed and
    one when committed; a plan's end is noted without its event's data (its result is never packed for spans)."""
    h = Traced()
    w = h.worker("w1", max_concurrency=50)
    c = h.client()
    plans = [h.submit(c, traceparent=SAMPLED) for _ in range(50)]
    for plan in plans:
        h.send(w, Accept(plan_id=plan, attempt=1))
        h.send(w, Done(plan_id=plan, attempt=1, outcome="succeeded", result="x" * 1_000))
    ends = [n for step in h.steps for n in step if n[3] == "succeeded"]
    assert len(ends) == 50 and {n[4] for n in ends} == {None}
    environ = {"OTEL_BSP_SCHEDULE_DELAY": "600000"}
    tracing = Tracing(SERVICE_COORDINATOR, exporter=InMemorySpanExporter(), environ=environ)
    try:
        spans = PlanSpans(tracing, clock=lambda: 5_000)
        step = [n for s in h.steps for n in s]
        spans.flushed(step)
        spans.delivered(step)
        assert len(step) >= 150 and len(tracing._queue) == 2
    finally:
        tracing.shutdown()
