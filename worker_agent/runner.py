"""How the worker runs plans: assign, prefetch, revoke, cancel, preempt, finish, silence (no awaits).

:class:`PlanRunner` owns the plans of one worker: those running, the prefetched ones waiting
for a slot, and the silenced ones whose tasks are still ending. The agent
(worker_agent/agent.py) holds one and hands it each plan message it reads; the runner answers
through the :class:`Outbound` it was given (the agent's send queue), never through the session.
Everything here except :meth:`PlanRunner.silence_all` runs synchronously, from the reader's
dispatch or a plan task's done callback, so no state changes interleave. The rules are in the
agent module's docstring and docs/SEMANTICS.md §Worker session.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import time
import traceback
from collections.abc import Callable
from typing import Any, Protocol

import msgspec
import structlog
import structlog.contextvars

import protocol
from protocol import errors
from protocol.relay import ARGS_INPUT, RESULT_OUTPUT
from protocol.tracecontext import UNSAMPLED, UNSAMPLED_SHORT
from worker_agent.devices import DeviceAllocator, DeviceRequest
from worker_agent.handlers import DEFAULT_ISOLATION, Context, Handler, run_handler, run_on_loop, runs_on_loop
from worker_agent.isolation import PlanIsolation
from worker_agent.plan_tracing import LiveSpan, Tracing, attempt_span, child_span, traced_on_loop
from worker_agent.probe import LoadTracker
from worker_agent.pull import Puller
from worker_agent.pull_relay import PullRelay
from worker_agent.spool import Spool
from worker_agent.spool_files import INPUTS_UNAVAILABLE, InputFile
from worker_agent.telemetry import Telemetry

__all__ = ["REJECTED", "Outbound", "PlanRunner"]

#: The context variables ``structlog.contextvars.bind_contextvars(worker_id=, plan_id=, attempt=)`` sets (its
#: tokens name them): a plan's task sets them directly, without the call's dict and key names per plan. Found in a
#: context of their own, so that nothing is bound where this module is imported.
_WORKER_ID, _PLAN_ID, _ATTEMPT = (token.var for token in contextvars.copy_context().run(
    structlog.contextvars.bind_contextvars, worker_id=None, plan_id=None, attempt=None).values())  # fmt: skip

#: Reject code for a worker that is full or draining (docs/PROTOCOL.md §Messages, ``reject``);
#: ``reason`` says which. An op without a handler gets ``unknown_op``.
REJECTED = "rejected"


class Outbound(Protocol):
    """Where the runner's messages go (the agent's :class:`~worker_agent.outbox.SendQueue`)."""

    def send(self, msg: Any) -> None:
        """Queue a message for the coordinator, numbering plan messages."""

    def forget(self, plan_id: str, attempt: int | None = None) -> None:
        """Drop what is queued or unacknowledged for a plan (of one attempt when given)."""

    # Optional: ``send_event(event)``, where events go when it differs from ``send`` (one call fewer per event).


class _PlanRun:
    """One attempt of one plan on this worker.

    Its bound methods are the callbacks its plan needs (the handler's event sink, the task's done
    callback, the result spill): one small object each per plan, where a ``functools.partial`` of a
    runner method would make two, and a plan's every object is work for the garbage collector.
    """

    __slots__ = (
        "attempt", "awaiting_inputs", "cancel_requested", "ctx", "devices", "plan_id", "preempted", "pulls", "runner",
        "silent", "span", "started", "started_at", "stop_timer", "task",
    )

    def __init__(self, runner: PlanRunner, plan_id: str, attempt: int, started_at: float) -> None:
        self.runner = runner
        self.plan_id = plan_id
        self.attempt = attempt
        self.started_at = started_at
        self.ctx: Context
        self.task: asyncio.Task[None] | None = None
        self.started = False  # its task's coroutine began (one cancelled before that never runs: ended by the runner)
        self.silent = False  # no longer our lease: send nothing more for it
        self.cancel_requested = False
        self.awaiting_inputs = False  # running, its handler not started: its inputs are not all in yet
        self.devices: tuple[int, ...] = ()  # held from start until its task ends (worker_agent/devices.py)
        self.span: LiveSpan | None = None  # its ``fleetwire.attempt`` span, when sampled (worker_agent/plan_tracing.py)
        self.preempted: str | None = None  # why it was preempted (docs/SEMANTICS.md §Preemption); None: it was not
        self.stop_timer: asyncio.TimerHandle | None = None  # cancels it when its preemption grace is over
        self.pulls: asyncio.Task[None] | None = None  # fetching its inputs that are other plans' outputs (pull.py)

    @property
    def key(self) -> str:
        """Its key in the device allocator and the energy meters: one per attempt (a superseded attempt still
        ending keeps its own)."""
        return f"{self.plan_id}#{self.attempt}"

    def emit(self, kind: str, data: Any, ephemeral: bool) -> None:
        """The handler's event sink (``Context``)."""
        self.runner._on_event(self, kind, data, ephemeral)

    def spill(self, encoded: bytes) -> protocol.OutputSpec:
        """Keeps a result over the frame limit (``Context.spill_result``)."""
        return self.runner._spill_result(self.plan_id, self.attempt, encoded)


class PlanRunner:
    """The plan lifecycle of one worker.

    Args:
        worker_id: the worker's id, for handlers' contexts and reject reasons.
        max_concurrency: plans run at once.
        kill_grace_s: seconds between SIGTERM and SIGKILL for a cancelled plan's subprocesses.
        max_payload_bytes: the largest encoded event data or result a handler may produce.
        handlers: the ops offered, by name; the runner owns the dict from now on.
        telemetry: told when each plan starts and ends (energy per token).
        outbound: where accept, reject, event and done messages go.
        logger: the agent's bound logger.
        spool: where plans' inputs and outputs are kept (None: no data endpoint; a plan with
            inputs fails ``inputs_unavailable``).
        input_timeout_s: how long a started plan waits with no byte of its inputs arriving before it fails
            ``inputs_unavailable`` (spool.PlanData.wait).
        isolation: how plans' processes start (worker_agent/isolation.py: ``--plan-env``, ``--plan-user``).
    """

    def __init__(
        self,
        *,
        worker_id: str,
        max_concurrency: int,
        kill_grace_s: float,
        max_payload_bytes: int,
        handlers: dict[str, Handler],
        telemetry: Telemetry,
        outbound: Outbound,
        logger: Any,
        spool: Spool | None = None,
        input_timeout_s: float = 600.0,
        isolation: PlanIsolation = DEFAULT_ISOLATION,
    ) -> None:
        self.spool = spool
        self.isolation = isolation
        self.input_timeout_s = input_timeout_s
        self.pull_relay: PullRelay | None = None  # pulls through the relay when a holder cannot be dialled (agent's)
        self.worker_id = worker_id
        self.max_concurrency = max_concurrency
        self.kill_grace_s = kill_grace_s
        self.max_payload_bytes = max_payload_bytes
        self.telemetry = telemetry
        self.load = LoadTracker()
        self.idle = asyncio.Event()  # no plan is running
        self.idle.set()
        self._handlers = handlers
        self._on_loop = {op for op, fn in handlers.items() if runs_on_loop(fn)}  # ops whose handler runs on the loop
        self._outbound = outbound
        self._send_event: Callable[[Any], None] = getattr(outbound, "send_event", outbound.send)
        self._log = logger
        self._plans: dict[str, _PlanRun] = {}
        self._waiting: dict[str, protocol.Assign] = {}  # prefetched assigns, unstarted, in arrival order
        self._prefetch = 0  # how many may wait (from welcome)
        self._orphans: set[_PlanRun] = set()  # silenced plans whose tasks are still ending
        self._stopping = False
        self._draining = False
        self._starting = False  # _start_waiting is starting plans (one that ends on the loop calls it again)
        self._start_again = False
        self.devices = DeviceAllocator(())  # this worker's devices; the agent sets them with its capabilities
        self.tracing: Tracing | None = None  # where attempt, input and handler spans go (the agent sets it)

    # ------------------------------------------------------------------ what the agent asks

    @property
    def ops(self) -> list[str]:
        """The ops this worker advertises, sorted."""
        return sorted(self._handlers)

    @property
    def running_count(self) -> int:
        """Plans running now (not counting prefetched ones waiting for a slot)."""
        return len(self._plans)

    def add_handler(self, name: str, fn: Handler) -> None:
        """Offer op ``name``, run by ``fn(ctx, args)`` (replaces one of that name).

        Raises:
            ValueError: an empty or non-string name.
            TypeError: ``fn`` is not callable.
        """
        if not isinstance(name, str) or not name:
            raise ValueError(f"handler name must be a non-empty string, got {name!r}")
        if not callable(fn):
            raise TypeError(f"handler {name!r} must be callable, got {type(fn).__name__}")
        self._handlers[name] = fn
        if runs_on_loop(fn):
            self._on_loop.add(name)
        else:
            self._on_loop.discard(name)

    def running_plans(self) -> list[protocol.RunningPlan]:
        """The plans this worker holds, running or waiting, for ``hello``."""
        running = [
            protocol.RunningPlan(plan_id=r.plan_id, attempt=r.attempt, devices=list(r.devices))
            for r in self._plans.values()
        ]
        running += [protocol.RunningPlan(plan_id=a.plan_id, attempt=a.attempt) for a in self._waiting.values()]
        return running

    def stop_accepting(self) -> None:
        """The worker is stopping: reject every new assign and start no waiting plan."""
        self._stopping = True

    # ------------------------------------------------------------------ coordinator messages

    def on_welcome(self, welcome: protocol.Welcome) -> None:
        """A session began: take its prefetch, forget a past drain, silence the abandoned plans."""
        self._prefetch = max(0, welcome.prefetch)
        # An operator's drain is the coordinator's to keep: it sends drain again right after
        # welcome while it still wants one, and one that restarted without it must not be refused.
        self._draining = False
        for plan_id in welcome.abandon_plans:
            self._waiting.pop(plan_id, None)
            run = self._plans.get(plan_id)
            if run is not None:
                self._silence(run, "abandoned by the coordinator")
            else:
                self._outbound.forget(plan_id)

    def on_assign(self, assign: protocol.Assign) -> None:
        """Start, queue (prefetch), re-accept or reject an assigned plan."""
        waiting = self._waiting.get(assign.plan_id)
        if waiting is not None:
            if assign.attempt <= waiting.attempt:
                return  # a repeated (or older) assign of a plan waiting here
            del self._waiting[assign.plan_id]  # superseded; the newer attempt is handled below
        current = self._plans.get(assign.plan_id)
        if current is not None:
            if assign.attempt == current.attempt:
                self._outbound.send(protocol.Accept(plan_id=assign.plan_id, attempt=assign.attempt))
                return  # a repeated assign: it is running
            if assign.attempt < current.attempt:
                return  # older than what we run: stale
            self._silence(current, f"superseded by attempt {assign.attempt}")
        if self._stopping or self._draining:
            self._reject(assign, REJECTED, f"worker {self.worker_id} is draining")
            return
        handler = self._handlers.get(assign.op)
        if handler is None:
            reason = f"worker {self.worker_id} has no handler for op {assign.op!r}; it handles: {', '.join(self.ops)}"
            self._reject(assign, errors.UNKNOWN_OP, reason)
            return
        request = DeviceRequest.of(assign.resources) if assign.resources is not None else None
        if request is not None and len(self.devices.gpus) < request.count:
            reason = f"worker {self.worker_id} has {len(self.devices.gpus)} devices; the plan needs {request.count}"
            self._reject(assign, REJECTED, reason)
            return
        if request is not None and not self.devices.could_allocate(request):
            reason = f"worker {self.worker_id}: too few of its devices match the plan outside quarantine"
            self._reject(assign, REJECTED, reason)
            return
        if request is not None and not self.devices.can_allocate(request):
            # The coordinator counted devices free that a plan still ending here holds: start it once they are.
            self._waiting[assign.plan_id] = assign
            self.load.queued = len(self._waiting)
            return
        if len(self._plans) >= self.max_concurrency:
            if len(self._waiting) < self._prefetch:
                self._waiting[assign.plan_id] = assign  # accepted when it starts
                self.load.queued = len(self._waiting)
                return
            self._reject(assign, REJECTED, f"worker {self.worker_id} is running {len(self._plans)} plans (max)")
            return
        self._start(assign, handler, request)

    def on_revoke(self, revoke: protocol.Revoke) -> None:
        """Give back a waiting plan with ``reject(revoked)``; a started one keeps running."""
        waiting = self._waiting.get(revoke.plan_id)
        if waiting is None or waiting.attempt != revoke.attempt:
            return  # started (the coordinator sees our accept) or not ours: the revoke is refused
        del self._waiting[revoke.plan_id]
        self.load.queued = len(self._waiting)
        self._reject(waiting, errors.REVOKED, "revoked before it started")

    def on_cancel(self, cancel: protocol.Cancel) -> None:
        """End a waiting plan ``cancelled`` at once, or cancel a running plan's task."""
        waiting = self._waiting.get(cancel.plan_id)
        if waiting is not None and (not cancel.attempt or cancel.attempt == waiting.attempt):
            del self._waiting[cancel.plan_id]
            self.load.queued = len(self._waiting)
            self._outbound.send(protocol.Done(plan_id=waiting.plan_id, attempt=waiting.attempt, outcome="cancelled"))
            return
        run = self._plans.get(cancel.plan_id)
        if run is None or (cancel.attempt and cancel.attempt != run.attempt) or run.cancel_requested:
            return  # not ours, or already stopping (a second task.cancel would cut the kill grace short)
        run.cancel_requested = True
        run.ctx.mark_cancelled()
        self._cancel_task(run)

    def on_preempt(self, preempt: protocol.Preempt) -> None:
        """Preempt one attempt (docs/SEMANTICS.md §Preemption): a waiting one ends at once, a running one is told
        (``ctx.preempted``, SIGTERM to its processes) and cancelled once ``grace_s`` is over."""
        waiting = self._waiting.get(preempt.plan_id)
        if waiting is not None and waiting.attempt == preempt.attempt:
            del self._waiting[preempt.plan_id]
            self.load.queued = len(self._waiting)
            why = f"preempted before it started: {preempt.reason}" if preempt.reason else "preempted before it started"
            self._outbound.send(protocol.Done(
                plan_id=waiting.plan_id, attempt=waiting.attempt, outcome="cancelled", preempted=True,
                error=protocol.ErrorInfo(code=errors.CANCELLED, message=why),
            ))  # fmt: skip
            return
        run = self._plans.get(preempt.plan_id)
        if run is None or run.attempt != preempt.attempt:
            return  # not ours (ended, or another attempt)
        self._preempt(run, preempt.grace_s, preempt.reason or "preempted by the coordinator")

    def preempt_all(self, grace_s: float, reason: str) -> int:
        """This host is being interrupted: hand the waiting plans back and preempt every running one with
        ``grace_s`` (``--interruption-command``, SIGUSR1). Returns the plans preempted."""
        self.hand_back_waiting(f"worker {self.worker_id} is being interrupted: {reason}")
        runs = [run for run in self._plans.values() if not run.silent]
        for run in runs:
            self._preempt(run, grace_s, f"worker {self.worker_id} is being interrupted: {reason}")
        return len(runs)

    def preempt_holding(self, devices: frozenset[int], grace_s: float, reason: str) -> int:
        """Devices were quarantined and this worker requeues what runs on them (``--on-quarantine requeue``,
        docs/OPERATIONS.md §GPU health): preempt every running plan holding one of ``devices`` with ``grace_s``;
        its ``done(preempted)`` has the coordinator queue it again without charging an attempt. Returns how many."""
        runs = [run for run in self._plans.values() if not run.silent and not devices.isdisjoint(run.devices)]
        for run in runs:
            self._preempt(run, grace_s, reason)
        return len(runs)

    def _preempt(self, run: _PlanRun, grace_s: float, reason: str) -> None:
        if run.preempted is not None or run.cancel_requested:
            return  # told already, or stopping anyway
        run.preempted = reason
        self._log.info("plan preempted", plan_id=run.plan_id, attempt=run.attempt, grace_s=grace_s, reason=reason)
        run.ctx.mark_preempted()  # ctx.preempted, SIGTERM to its processes: checkpoint now
        run.stop_timer = asyncio.get_running_loop().call_later(max(0.0, grace_s), self._grace_over, run)

    def _grace_over(self, run: _PlanRun) -> None:
        """A preempted plan's grace is over: it is cancelled (its processes: SIGTERM, then SIGKILL)."""
        run.stop_timer = None
        if self._plans.get(run.plan_id) is not run or run.cancel_requested:
            return
        run.cancel_requested = True
        run.ctx.mark_cancelled()
        self._cancel_task(run)

    def on_error(self, error: protocol.Error) -> None:
        """A ``stale_lease`` silences the plan it names; any other error is logged."""
        if error.code == errors.STALE_LEASE and error.plan_id:
            waiting = self._waiting.get(error.plan_id)
            if waiting is not None and (not error.attempt or error.attempt == waiting.attempt):
                del self._waiting[error.plan_id]
            run = self._plans.get(error.plan_id)
            if run is not None and (not error.attempt or error.attempt == run.attempt):
                self._silence(run, "stale lease")
            elif run is None:
                self._outbound.forget(error.plan_id, error.attempt or None)
            return
        self._log.warning("coordinator error", code=error.code, message=error.message, plan_id=error.plan_id)

    def on_drain(self, drain: protocol.Drain) -> None:
        """Reject new plans and hand the waiting ones back until ``undrain`` (or the next welcome)."""
        self._draining = True
        self._log.info("draining: new plans will be rejected", deadline_s=drain.deadline_s)
        self.hand_back_waiting(f"worker {self.worker_id} is draining")

    def on_undrain(self) -> None:
        """Take new plans again."""
        self._draining = False
        self._log.info("undrained: taking new plans again")

    # ------------------------------------------------------------------ stopping

    def hand_back_waiting(self, reason: str) -> None:
        """Give every prefetched plan back to the coordinator (draining or stopping)."""
        for assign in list(self._waiting.values()):
            self._reject(assign, REJECTED, reason)
        self._waiting.clear()
        self.load.queued = 0

    def hand_back_unfed(self, reason: str) -> None:
        """Give back the running plans still waiting for inputs of which no byte has arrived (stopping).

        Their handlers have not started, so another worker can run them as they are (their client
        uploads the inputs to each attempt's worker); waiting for them would hold the stop for the
        whole drain timeout for a client that may never come. One whose upload has begun is
        drained like a running plan.
        """
        for run in list(self._plans.values()):
            data = run.ctx.data if run.awaiting_inputs else None
            if data is not None and data.untouched:
                self._silence(run, reason)

    def silence_running(self, reason: str) -> None:
        """Cancel every running plan and send nothing more for any (the worker is leaving)."""
        for run in list(self._plans.values()):
            self._silence(run, reason)

    async def silence_all(self, reason: str) -> None:
        """Drop the waiting plans, silence the running ones, and wait for their tasks to end."""
        self._waiting.clear()  # no session to hand them back on: the coordinator requeues them as lost
        self.silence_running(reason)
        tasks = [run.task for run in self._orphans if run.task is not None]
        if tasks:  # let cancelled handlers kill their subprocesses before run() returns
            await asyncio.gather(*tasks, return_exceptions=True)

    # ------------------------------------------------------------------ plan lifecycle

    def _reject(self, assign: protocol.Assign, code: str, reason: str) -> None:
        self._log.debug("rejecting plan", plan_id=assign.plan_id, code=code)
        self._outbound.send(protocol.Reject(plan_id=assign.plan_id, attempt=assign.attempt, code=code, reason=reason))

    def _start_waiting(self) -> None:
        """Start prefetched plans, oldest first, while slots are free (a plan whose devices are held waits on).

        A plan that runs on the loop ends inside ``_start`` and calls this again: that inner call only asks the
        outer one for another pass (the devices it held may let a plan it passed over start now)."""
        if not self._waiting:  # the usual case, at every plan's end
            self.load.queued = 0
            return
        if self._starting:
            self._start_again = True
            return
        self._starting = True
        try:
            self._start_again = True
            while self._start_again and self._waiting:
                self._start_again = False
                for plan_id, assign in list(self._waiting.items()):
                    if len(self._plans) >= self.max_concurrency or self._stopping:
                        break
                    request = DeviceRequest.of(assign.resources)
                    if request is not None and not self.devices.can_allocate(request):
                        continue
                    del self._waiting[plan_id]
                    handler = self._handlers.get(assign.op)
                    if handler is None:  # removed since it was queued
                        reason = f"worker {self.worker_id} has no handler for op {assign.op!r}"
                        self._reject(assign, errors.UNKNOWN_OP, reason)
                        continue
                    self._start(assign, handler, request)
        finally:
            self._starting = False
        self.load.queued = len(self._waiting)

    def _start(self, assign: protocol.Assign, handler: Handler, request: DeviceRequest | None) -> None:
        """Run an assigned plan (``request``: its devices, None: none): on the loop, ended before this returns, or
        in a task of its own."""
        loop = asyncio.get_running_loop()
        run = _PlanRun(self, assign.plan_id, assign.attempt, time.monotonic())  # (the loop's clock, without its call)
        data = None
        if self.spool is not None and (assign.inputs or assign.outputs):
            data = self.spool.plan_data(assign.plan_id, assign.attempt, assign.inputs)
            self.spool.claim(assign.plan_id, assign.attempt)
            if assign.pulls:  # inputs that are other plans' outputs, fetched from their holders (worker_agent/pull.py)
                run.pulls = Puller(self.spool, self.worker_id, relay=self.pull_relay).start(assign.pulls, data)
        run.ctx = Context(
            data=data,
            plan_id=assign.plan_id,
            attempt=assign.attempt,
            worker_id=self.worker_id,
            args=assign.args,
            sink=run.emit,
            kill_grace_s=self.kill_grace_s,
            max_payload_bytes=self.max_payload_bytes,
            loop=loop,
        )
        if self.spool is not None:
            run.ctx.spill_result = run.spill
        if self.isolation is not DEFAULT_ISOLATION:  # else the class's (Context: a stored field is work per plan)
            run.ctx.isolation = self.isolation
        traceparent = assign.traceparent
        if traceparent:  # the plan's trace (docs/OPERATIONS.md §Tracing): an attempt span when sampled
            # "00" (the caller's "no", without ids): fresh ids if the handler reads it (handlers.py). Stored in the
            # property's field, not through its setter: at 1 % sampling 99 plans in 100 come here with "00", so it
            # is told apart first. A sampled plan's handler gets its handler span's context (traced_on_loop,
            # _attempt), set before the handler starts: nothing reads the attempt span's, so it is not formatted.
            # "0" is "00" as the coordinator forwards it to this worker (capabilities.short_unsampled): translated
            # here, tested first, so the handler's side (Context.traceparent, handler_traceparent) knows only "00".
            if traceparent == UNSAMPLED_SHORT:
                run.ctx.assigned_traceparent = UNSAMPLED
            else:
                run.ctx.assigned_traceparent = traceparent
                if traceparent != UNSAMPLED and self.tracing is not None:
                    run.span = attempt_span(self.tracing, assign, self.worker_id)
        if request is not None:
            run.devices = self.devices.allocate(run.key, request, assign.devices) or ()
        if self.devices.gpus:  # a worker with devices shows each plan only its own (none without a request: "")
            run.ctx.gpus = list(map(self.devices.gpus.__getitem__, run.devices))  # no comprehension: no cell a call
            run.ctx.devices = [gpu.visible_id or str(gpu.index) for gpu in run.ctx.gpus]
            run.ctx.cuda_visible_devices = ",".join(run.ctx.devices)
        on_loop = not assign.inputs and assign.op in self._on_loop  # traced too: its spans need no task
        if not on_loop:  # (one that runs on the loop has ended before anyone could see it running)
            if not self._plans:  # the first running plan: no longer idle (set again when the last one ends)
                self.idle.clear()
            self._plans[run.plan_id] = run
        self.load.started()
        # Keyed by attempt, as the devices: a superseded attempt still ending must not end this one's energy count.
        if run.devices or self.telemetry.timed:  # else nothing is noted per plan: not even its key is made
            self.telemetry.plan_started(run.key, self._physical(run) if run.devices else ())
        # Straight to the queue, as an event: an accept ends no attempt (data_side.WatchedOutbound watches the rest).
        self._send_event(protocol.Accept(plan_id=run.plan_id, attempt=run.attempt))
        if on_loop:  # no task, no thread: it runs and ends here (handlers.on_loop), its context closed
            if run.span is None:
                self._report(run, run_on_loop(handler, run.ctx, run.ctx.args), self._release(run))
            else:
                self._report(run, traced_on_loop(self.tracing, run.span, handler, run.ctx), self._release(run))
            return
        # The task keeps what it needs of the assign, not the assign (its lists go at once: less for the collector).
        # It ends its plan itself (_plan_finished, at the end of its coroutine): no done callback, no loop turn more.
        run.task = loop.create_task(self._run_plan(run, handler, bool(assign.inputs), assign.timeout_s))

    async def _run_plan(self, run: _PlanRun, handler: Handler, has_inputs: bool, timeout_s: float | None) -> None:
        """A plan's task: runs it and ends it (_plan_finished), however it ends; cancelled, it ends and re-raises."""
        run.started = True
        # The task's own context copy: handlers' structlog calls carry the plan's ids (bind_contextvars's variables).
        _WORKER_ID.set(self.worker_id)
        _PLAN_ID.set(run.plan_id)
        _ATTEMPT.set(run.attempt)
        try:
            if has_inputs or run.span is not None:
                done = await self._attempt(run, handler, has_inputs, timeout_s)
            else:  # the usual plan: its handler alone (one coroutine fewer)
                done = await run_handler(handler, run.ctx, run.ctx.args, timeout_s=timeout_s)
        except asyncio.CancelledError:  # cancelled outside run_handler (waiting for its inputs)
            self._ended_in_task(run, None)
            raise
        except Exception as exc:  # a fault of the runner's: the plan fails ``internal``
            self._ended_in_task(run, exc)
            return
        self._ended_in_task(run, done)

    def _ended_in_task(self, run: _PlanRun, outcome: protocol.Done | Exception | None) -> None:
        """End a plan from its own task; plans it lets start are not run in its structlog context."""
        if self._waiting:  # (a plan that runs on the loop would run here, in this task's context)
            _WORKER_ID.set(Ellipsis)  # structlog's "not bound"
            _PLAN_ID.set(Ellipsis)
            _ATTEMPT.set(Ellipsis)
        self._plan_finished(run, outcome)

    async def _attempt(
        self, run: _PlanRun, handler: Handler, has_inputs: bool, timeout_s: float | None
    ) -> protocol.Done:
        """A plan with inputs (waited for and verified first) or a sampled trace (spans around the handler)."""
        if has_inputs:  # the plan stays running, its handler unstarted, until its inputs are verified
            data = run.ctx.data
            error: protocol.ErrorInfo | None
            if data is None:
                error = protocol.ErrorInfo(
                    code=INPUTS_UNAVAILABLE,
                    message=f"worker {self.worker_id} has no data endpoint (--data-listen) to receive inputs",
                )
            else:
                run.awaiting_inputs = True
                inputs = child_span(self.tracing, run.span, "fleetwire.inputs", {"fleetwire.inputs": len(data.inputs)})
                try:
                    error = await data.wait(self.input_timeout_s, functools.partial(self._input_verified, run))
                finally:
                    run.awaiting_inputs = False
                    if run.pulls is not None:  # a fetch still going when the wait ended (failed, cancelled) stops
                        run.pulls.cancel()
                    if inputs is not None:
                        inputs.end()
            if error is None and data is not None and ARGS_INPUT in data.inputs:
                error = self._oversize_args(run)
            if error is not None:
                run.ctx.close()
                return protocol.Done(plan_id=run.plan_id, attempt=run.attempt, outcome="failed", error=error)
        if run.span is None:
            return await run_handler(handler, run.ctx, run.ctx.args, timeout_s=timeout_s)
        span = child_span(self.tracing, run.span, "fleetwire.handler", {"fleetwire.plan_id": run.plan_id})
        if span is not None:
            run.ctx.traceparent = span.traceparent  # what the handler forwards (the inference engine's request)
        done = await run_handler(handler, run.ctx, run.ctx.args, timeout_s=timeout_s)
        if span is not None:
            span.end(done.error.code if done.error is not None else "")
        return done

    def _oversize_args(self, run: _PlanRun) -> protocol.ErrorInfo | None:
        """Args the SDK moved to the input ``__args__`` (over the frame limit): decoded, hidden from ``ctx.inputs``."""
        data = run.ctx.data
        assert data is not None
        reader = data.inputs[ARGS_INPUT]
        try:
            run.ctx.args = msgspec.msgpack.decode(reader.read())
        except (msgspec.DecodeError, OSError) as exc:
            return protocol.ErrorInfo(code=errors.INVALID_ARGUMENT, message=f"input {ARGS_INPUT!r} (the plan's args, "
                                      f"moved there for their size) is not msgpack: {exc}")
        reader.close()
        data.inputs = {name: r for name, r in data.inputs.items() if name != ARGS_INPUT}
        return None

    def _spill_result(self, plan_id: str, attempt: int, encoded: bytes) -> protocol.OutputSpec:
        """Keep a result over the frame limit as the output ``__result__`` (``plan.result()`` fetches it)."""
        assert self.spool is not None
        return self.spool.add_output(plan_id, attempt, RESULT_OUTPUT, encoded).spec()

    def _input_verified(self, run: _PlanRun, entry: InputFile) -> None:
        data = {"name": entry.name, "size": entry.size, "digest": entry.digest, "via": entry.via}
        self._on_event(run, "input_received", data, False)

    def _on_event(self, run: _PlanRun, kind: str, data: Any, ephemeral: bool) -> None:
        if run.silent:
            return
        self._send_event(  # send numbers it
            protocol.Event(plan_id=run.plan_id, kind=kind, data=data, attempt=run.attempt, ephemeral=ephemeral)
        )

    def _release(self, run: _PlanRun) -> protocol.Receipt | None:
        """The plan's handler ended, however: its devices are free; its receipt, if any."""
        if run.devices:  # however it ended: its processes are gone, its devices are free
            self.devices.release(run.key)
        run_s = time.monotonic() - run.started_at
        self.load.finished(run_s)
        if run.devices:
            receipt = self.telemetry.plan_finished(
                run.key, run.ctx.tokens, self._physical(run), list(map(self._device_name, run.devices)), run_s
            )
        elif run.ctx.tokens or self.telemetry.timed:  # no devices: nothing to look up (None: nothing was measured)
            receipt = self.telemetry.plan_finished(run.key, run.ctx.tokens, run_s=run_s)
        else:  # nothing measured and no tokens: no receipt (Telemetry.plan_finished would say None)
            receipt = None
        return receipt

    def _cancel_task(self, run: _PlanRun) -> None:
        """Cancel a plan's task; one cancelled before its coroutine began never runs it, so its plan ends here."""
        if run.task is None:
            return
        run.task.cancel()
        if not run.started:
            run.started = True  # (ended once)
            self._plan_finished(run, None)

    def _plan_finished(self, run: _PlanRun, outcome: protocol.Done | Exception | None) -> None:
        """A plan's task ended: with its ``done``, a fault of the runner's, or None: cancelled outside its handler."""
        run.ctx.close()  # (run_handler closed it, unless the task was cancelled before it ran)
        receipt = self._release(run)
        self._orphans.discard(run)
        if self._plans.get(run.plan_id) is run:
            del self._plans[run.plan_id]
            if not self._plans:
                self.idle.set()
        if run.silent:
            if run.span is not None:
                run.span.end("silenced")  # no longer this worker's lease: another attempt (or nobody) goes on
            self._end_data(run, keep_outputs=False)
            if run.devices:
                self._start_waiting()  # a plan waiting for the devices it held may start now
            return
        if outcome is None:  # cancelled before run_handler ran (or outside it)
            done = protocol.Done(plan_id=run.plan_id, attempt=run.attempt, outcome="cancelled")
        elif isinstance(outcome, Exception):
            self._log.error(
                "plan task failed", plan_id=run.plan_id, exception="".join(traceback.format_exception(outcome))
            )
            info = protocol.ErrorInfo(code=errors.INTERNAL, message=f"{type(outcome).__name__}: {outcome}")
            done = protocol.Done(plan_id=run.plan_id, attempt=run.attempt, outcome="failed", error=info)
        else:
            done = outcome
        self._report(run, done, receipt)

    def _report(self, run: _PlanRun, done: protocol.Done, receipt: protocol.Receipt | None) -> None:
        """Send the ``done`` of a plan that ended (not silenced) and start what waits for its slot."""
        if run.stop_timer is not None:
            run.stop_timer.cancel()
            run.stop_timer = None
        if run.preempted is not None and done.outcome != "succeeded":  # queued again by the coordinator, for free
            message = f"preempted: {run.preempted}"
            done = protocol.Done(plan_id=run.plan_id, attempt=run.attempt, outcome="cancelled", preempted=True,
                                 error=protocol.ErrorInfo(code=errors.CANCELLED, message=message))  # fmt: skip
        if run.ctx.data is not None:  # (_end_data's own test: most plans have no data)
            self._end_data(run, keep_outputs=done.outcome == "succeeded")
            if done.outcome == "succeeded" and self.spool is not None:
                done.outputs = self.spool.outputs_of(run.plan_id, run.attempt)
        done.receipt = receipt
        if run.span is not None:
            run.span.set("fleetwire.outcome", done.outcome)
            run.span.end(done.error.code if done.error is not None else "")
        self._outbound.send(done)
        if self._waiting:
            self._start_waiting()
        else:  # (_start_waiting's own first test, without its call)
            self.load.queued = 0

    def _physical(self, run: _PlanRun) -> list[int]:
        """NVML indices of the whole GPUs the plan holds alone (none when shared or MIG: counted by power)."""
        gpus = self.devices.gpus
        if not run.devices or self.devices.share > 1 or any(gpus[i].parent_uuid for i in run.devices):
            return []
        return sorted({gpus[i].index for i in run.devices})

    def _device_name(self, i: int) -> str:
        gpu = self.devices.gpus[i]
        return gpu.visible_id or str(gpu.index)

    def _end_data(self, run: _PlanRun, *, keep_outputs: bool) -> None:
        """The attempt ended: its inputs go; its outputs stay only if it succeeded."""
        data = run.ctx.data
        if data is None or self.spool is None:
            return
        data.close()
        self.spool.release(run.plan_id, run.attempt)
        if not keep_outputs:
            self.spool.drop_outputs(run.plan_id, run.attempt)

    def _silence(self, run: _PlanRun, reason: str) -> None:
        """Stop a plan that is no longer our lease, sending nothing more for it."""
        self._log.info("stopping plan without reporting it", plan_id=run.plan_id, attempt=run.attempt, reason=reason)
        run.silent = True
        if self._plans.get(run.plan_id) is run:
            del self._plans[run.plan_id]
            if not self._plans:
                self.idle.set()
        self._outbound.forget(run.plan_id, run.attempt)
        if run.task is not None and not run.task.done():
            self._orphans.add(run)
            run.ctx.mark_cancelled()
            self._cancel_task(run)
        self._start_waiting()
