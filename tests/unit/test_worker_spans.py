"""The worker's spans of a traced plan (worker_agent/plan_tracing.py) as its runner makes them."""

from __future__ import annotations

import asyncio
import tracemalloc
from typing import Any

import pytest
import structlog

import protocol
from wireio.tracing import SERVICE_WORKER, Tracing
from worker_agent.handlers import Context, builtin_handlers, on_loop
from worker_agent.outbox import SendQueue
from worker_agent.plan_tracing import attempt_span
from worker_agent.runner import PlanRunner
from worker_agent.telemetry import Telemetry

TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
SAMPLED = f"00-{TRACE}-00f067aa0ba902b7-01"
seen: list[str] = []


@on_loop
def remembers(ctx: Context, args: Any) -> None:
    seen.append(ctx.traceparent)


class _Kept:
    """A span exporter that keeps the ReadableSpans it is handed (the SDK's interface)."""

    def __init__(self) -> None:
        self.spans: list[Any] = []

    def export(self, spans: list[Any]) -> None:
        self.spans += spans

    def force_flush(self, timeout_millis: int = 0) -> bool:
        return True

    def shutdown(self) -> None:
        pass


def _traced_runner() -> tuple[_Kept, Tracing, SendQueue, PlanRunner]:
    """A plan runner whose tracer keeps its spans (exported only at a flush), and the queue its messages go to."""
    exporter = _Kept()
    tracing = Tracing(SERVICE_WORKER, exporter=exporter, environ={"OTEL_BSP_SCHEDULE_DELAY": "600000"})
    queue = SendQueue(10_000, structlog.get_logger())
    plans = PlanRunner(
        worker_id="w1", max_concurrency=4, kill_grace_s=1.0, max_payload_bytes=1024,
        handlers={**builtin_handlers(), "remembers": remembers}, telemetry=Telemetry(), outbound=queue,
        logger=structlog.get_logger(),
    )  # fmt: skip
    plans.tracing = tracing
    return exporter, tracing, queue, plans


async def test_a_traced_plan_whose_handler_runs_on_the_loop_still_needs_no_task() -> None:
    """A sampled echo (an on_loop handler) ends in the step that reads its assign, with its attempt span and a
    handler span under it whose context the handler saw; an unsampled one makes no span."""
    exporter, tracing, queue, plans = _traced_runner()
    tasks_before = len(asyncio.all_tasks())
    try:
        plans.on_assign(protocol.Assign(plan_id="p1", attempt=1, op="remembers", traceparent=SAMPLED))
        plans.on_assign(protocol.Assign(plan_id="p2", attempt=1, op="echo", traceparent=SAMPLED[:-1] + "0"))
        done = [m for m in queue.outbox.take(10_000) if isinstance(m, protocol.Done)]
        assert [(d.plan_id, d.outcome) for d in done] == [("p1", "succeeded"), ("p2", "succeeded")]
        assert len(asyncio.all_tasks()) == tasks_before and plans.running_count == 0
        tracing.flush()
    finally:
        tracing.shutdown()
    spans = {s.name: s for s in exporter.spans}
    assert sorted(spans) == ["fleetwire.attempt", "fleetwire.handler"]
    attempt, handler = spans["fleetwire.attempt"], spans["fleetwire.handler"]
    assert handler.parent.span_id == attempt.context.span_id and attempt.parent.span_id == 0x00F067AA0BA902B7
    assert attempt.attributes["fleetwire.outcome"] == "succeeded"
    assert seen == [f"00-{TRACE}-{handler.context.span_id:016x}-01"]


@pytest.mark.parametrize("unsampled", ["00", "0"])
async def test_a_plan_its_caller_chose_not_to_sample_hands_its_handler_a_fresh_unsampled_context(
    unsampled: str,
) -> None:
    """An assign whose traceparent is "00" (unsampled, no ids), or "0" as the coordinator forwards it to this worker
    (``capabilities.short_unsampled``), makes no span, and its handler sees a valid W3C context flagged unsampled (what
    it passes to an engine follows the caller's "no"), another one for each plan."""
    from protocol.tracecontext import parse_traceparent

    exporter, tracing, _, plans = _traced_runner()
    seen.clear()
    try:
        for plan_id in ("p1", "p2"):
            plans.on_assign(protocol.Assign(plan_id=plan_id, attempt=1, op="remembers", traceparent=unsampled))
        tracing.flush()
    finally:
        tracing.shutdown()
    contexts = [parse_traceparent(text) for text in seen]
    assert exporter.spans == [] and len(set(seen)) == 2
    assert all(c is not None and c.flags == 0 for c in contexts)
    ctx = Context(plan_id="p3", attempt=1, worker_id="w1", args=None, sink=lambda _: None, kill_grace_s=1.0,
                  max_payload_bytes=1024)  # fmt: skip
    ctx.traceparent = "00"  # what the runner stores for either form (the wire's "0" is translated there)
    assert ctx.traceparent == ctx.traceparent != "00"  # drawn once, at the first read
    assert parse_traceparent(ctx.traceparent) is not None


@pytest.mark.parametrize("traced", [True, False])
async def test_the_runner_stores_the_one_character_unsampled_decision_as_00(traced: bool) -> None:
    """The wire's "0" (``capabilities.short_unsampled``) is translated to "00" once, by the runner: the plan's
    Context holds "00", so nothing on the handler's side (Context.traceparent, handler_traceparent) reads "0"."""
    stored: list[str] = []

    @on_loop
    def keeps_the_field(ctx: Context, args: Any) -> None:
        stored.append(ctx.assigned_traceparent)

    exporter, tracing, _, plans = _traced_runner()
    if not traced:
        plans.tracing = None
    plans.add_handler("keeps_the_field", keeps_the_field)
    try:
        plans.on_assign(protocol.Assign(plan_id="p1", attempt=1, op="keeps_the_field", traceparent="0"))
        plans.on_assign(protocol.Assign(plan_id="p2", attempt=1, op="keeps_the_field", traceparent="00"))
        tracing.flush()
    finally:
        tracing.shutdown()
    assert stored == ["00", "00"] and exporter.spans == []


def test_an_unsampled_assign_builds_nothing_for_an_attempt_span() -> None:
    """attempt_span of a plan not sampled ("00", or an unsampled context) allocates nothing: no attributes dict."""
    tracing = Tracing(SERVICE_WORKER, exporter=_Kept(), environ={"OTEL_BSP_SCHEDULE_DELAY": "600000"})
    bare = protocol.Assign(plan_id="p1", attempt=1, op="echo", args=0, traceparent="00", devices=[0])
    unsampled = protocol.Assign(plan_id="p2", attempt=1, op="echo", args=0, traceparent=SAMPLED[:-1] + "0")
    tracemalloc.start()
    try:
        attempt_span(tracing, bare, "w1"), attempt_span(tracing, unsampled, "w1")  # warm: nothing first-time below
        tracemalloc.reset_peak()
        before = tracemalloc.get_traced_memory()[0]
        spans = attempt_span(tracing, bare, "w1"), attempt_span(tracing, unsampled, "w1")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
        tracing.shutdown()
    assert spans == (None, None)
    assert peak - before <= 64  # the result tuple alone; the attributes dict alone would be ~360 bytes


@pytest.mark.parametrize("unsampled", ["00", "0"])
async def test_a_plan_its_caller_chose_not_to_sample_runs_the_same_python_calls_as_an_untraced_one(
    unsampled: str,
) -> None:
    """On a traced worker, an echo whose assign carries "00" (or "0", its forwarded form) runs exactly the Python
    functions of one without a traceparent: no property setter to keep the "no", no attempt_span call (at 1 %
    sampling 99 plans in 100)."""
    import sys

    _, tracing, _, plans = _traced_runner()

    def calls(plan_id: str, traceparent: str) -> list[str]:
        names: list[str] = []

        def profile(frame: Any, event: str, _arg: Any) -> None:
            if event == "call":
                names.append(frame.f_code.co_qualname)

        sys.setprofile(profile)
        try:
            plans.on_assign(protocol.Assign(plan_id=plan_id, attempt=1, op="echo", args=0, traceparent=traceparent))
        finally:
            sys.setprofile(None)
        return names

    try:
        calls("p0", unsampled), calls("p1", "")  # warm: nothing first-time below
        no, untraced = calls("p2", unsampled), calls("p3", "")
    finally:
        tracing.shutdown()
    assert no == untraced
    assert "attempt_span" not in no and "Context.traceparent" not in no


def test_this_worker_says_in_its_hello_that_it_reads_the_one_character_unsampled_decision() -> None:
    """``capabilities.short_unsampled`` (the coordinator then forwards "00" as "0"; the runner reads it as "00":
    test_the_runner_stores_the_one_character_unsampled_decision_as_00), and "00" gives a handler a fresh unsampled
    context each time."""
    from protocol.tracecontext import handler_traceparent, parse_traceparent
    from worker_agent.probe import probe_capabilities

    assert probe_capabilities(tags=(), max_concurrency=1, ops=["echo"]).short_unsampled
    fresh = handler_traceparent("00")
    context = parse_traceparent(fresh)
    assert context is not None and context.flags == 0 and fresh != handler_traceparent("00")


async def test_a_sampled_plan_formats_only_its_handler_spans_context() -> None:
    """A sampled plan's handler sees its handler span's context, whether it runs on the loop or in a task, and that
    is the one context formatted for it (``LiveSpan.traceparent`` read once a plan): the attempt span's is not, as
    it would be replaced before any handler could read it."""
    import sys

    from tests.waiting import until

    async def remembers_in_a_task(ctx: Context, args: Any) -> None:
        seen.append(ctx.traceparent)

    exporter, tracing, _, plans = _traced_runner()
    plans.add_handler("remembers_in_a_task", remembers_in_a_task)
    seen.clear()
    formatted: list[str] = []

    def profile(frame: Any, event: str, _arg: Any) -> None:
        if event == "call" and frame.f_code.co_qualname == "LiveSpan.traceparent":
            formatted.append(frame.f_code.co_qualname)

    sys.setprofile(profile)
    try:
        plans.on_assign(protocol.Assign(plan_id="p1", attempt=1, op="remembers", traceparent=SAMPLED))
        plans.on_assign(protocol.Assign(plan_id="p2", attempt=1, op="remembers_in_a_task", traceparent=SAMPLED))
        await until(lambda: plans.running_count == 0 and len(seen) == 2)
    finally:
        sys.setprofile(None)
    try:
        tracing.flush()
    finally:
        tracing.shutdown()
    handlers = {s.attributes["fleetwire.plan_id"]: s for s in exporter.spans if s.name == "fleetwire.handler"}
    assert seen == [f"00-{TRACE}-{handlers[p].context.span_id:016x}-01" for p in ("p1", "p2")]
    assert len(formatted) == 2  # one a plan


def test_an_assigns_traceparent_follows_its_args_and_either_order_decodes() -> None:
    """msgspec looks a map's key up from the field after the last one found, and an echo's assign is encoded in field
    order (type, plan_id, attempt, op, args, traceparent): right after ``args`` its traceparent is found at the first
    name tried (as the last field it was the 7th). A coordinator that sends it last is still understood (a map)."""
    import msgspec

    from protocol.codec import Codec

    fields = protocol.Assign.__struct_fields__
    assert fields.index("traceparent") == fields.index("args") + 1
    encoded = msgspec.msgpack.encode(protocol.Assign(plan_id="p1", attempt=1, op="echo", args=0, traceparent="0"))
    assert list(msgspec.msgpack.decode(encoded)) == ["type", "plan_id", "attempt", "op", "args", "traceparent"]
    older = {"type": "assign", "plan_id": "p1", "attempt": 1, "op": "echo", "args": 0, "timeout_s": 5.0,
             "devices": [0], "traceparent": "00"}  # fmt: skip
    (msg,) = Codec("msgpack", protocol.ToWorker, "coordinator").decode(msgspec.msgpack.encode([older]))
    assert isinstance(msg, protocol.Assign) and (msg.traceparent, msg.timeout_s, msg.devices) == ("00", 5.0, [0])
