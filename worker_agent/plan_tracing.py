"""The worker's spans of a plan (docs/OPERATIONS.md §Tracing): its attempt, its inputs' arrival, its handler.

An ``assign`` whose ``traceparent`` is sampled gets a ``fleetwire.attempt`` span (kind consumer),
child of the plan's context (the caller's submit span, stored with the plan by the coordinator), from
the assign to the ``done``; its children are ``fleetwire.inputs`` (the wait for the plan's inputs to
arrive and be verified) and ``fleetwire.handler`` (the handler's run), whose ``traceparent`` is
``ctx.traceparent``: the inference handler sends it to the engine (worker_agent/inference.py). A
retry or a requeue is another attempt span of the same trace. A handler that runs on the loop
(worker_agent/handlers.py ``on_loop``, the built-in ``echo``) keeps doing so when traced
(:func:`traced_on_loop`): its spans need no task. Without a tracer, or with an unsampled context,
none of this runs (worker_agent/runner.py tests ``assign.traceparent`` first). A plan its caller chose not
to sample, with no context of its own (``"00"``, protocol/tracecontext.py ``UNSAMPLED``), gives its
handler a fresh unsampled context (``handler_traceparent``, drawn when ``ctx.traceparent`` is first read:
worker_agent/handlers.py): the engine it calls follows the "no".
"""

from __future__ import annotations

from typing import Final

import protocol
from protocol.messages import Assign
from protocol.tracecontext import is_sampled
from wireio.otlp import LIVE_ATTEMPT, LIVE_ATTEMPT_DEVICES, LIVE_BASE, LIVE_HANDLER, LIVE_INPUTS, LIVE_SPANS
from wireio.tracing import LiveSpan, Tracing
from worker_agent.handlers import Context, Handler, run_on_loop

__all__ = ["LiveSpan", "Tracing", "attempt_span", "child_span", "traced_on_loop"]

_TEMPLATES: Final = {"fleetwire.handler": LIVE_HANDLER, "fleetwire.inputs": LIVE_INPUTS}
"""The child spans noted compactly (wireio/otlp.py ``LIVE_SPANS``: no attributes dict to pack and unpack)."""
_KEYS: Final = {template: LIVE_SPANS[template - LIVE_BASE][2] for template in _TEMPLATES.values()}


def attempt_span(tracing: Tracing, assign: Assign, worker_id: str) -> LiveSpan | None:
    """The ``fleetwire.attempt`` span of an assigned plan (None: its trace is not sampled, and nothing is built:
    at 1 % sampling 99 plans in 100 come here with ``"00"``, and its attributes cost ~0.2 µs a plan)."""
    if not is_sampled(assign.traceparent):
        return None
    attributes: dict[str, str | int | float | bool] = {
        "fleetwire.plan_id": assign.plan_id, "fleetwire.attempt": assign.attempt, "fleetwire.op": assign.op,
        "fleetwire.worker_id": worker_id,
    }  # fmt: skip
    template = LIVE_ATTEMPT
    if assign.devices:
        attributes["fleetwire.devices"] = ",".join(str(d) for d in assign.devices)
        template = LIVE_ATTEMPT_DEVICES
    return tracing.start("fleetwire.attempt", assign.traceparent, attributes, kind="consumer", template=template)


def child_span(tracing: Tracing | None, parent: LiveSpan | None, name: str,
               attributes: dict[str, str | int | float | bool]) -> LiveSpan | None:  # fmt: skip
    """A child of the attempt span (None without one)."""
    if tracing is None or parent is None:
        return None
    template = _TEMPLATES.get(name)
    if template is not None and list(attributes) != list(_KEYS[template]):
        template = None  # not its template's shape: noted in full
    return tracing.child(parent, name, attributes, template=template)


def traced_on_loop(tracing: Tracing | None, attempt: LiveSpan, handler: Handler, ctx: Context) -> protocol.Done:
    """``run_on_loop`` inside a ``fleetwire.handler`` span, child of ``attempt``: the handler sees its context."""
    span = child_span(tracing, attempt, "fleetwire.handler", {"fleetwire.plan_id": ctx.plan_id})
    if span is None:
        return run_on_loop(handler, ctx, ctx.args)
    ctx.traceparent = span.traceparent
    done = run_on_loop(handler, ctx, ctx.args)
    span.end(done.error.code if done.error is not None else "")
    return done
