"""How the worker runs plans: assign, prefetch, revoke, cancel, finish, silence (no awaits).

:class:`PlanRunner` is the plan half of :class:`worker_agent.agent.Agent` (its base class):
everything here runs synchronously from the reader's dispatch or a plan task's done callback,
so no state changes interleave. The rules are in the agent module's docstring and
docs/SEMANTICS.md §Worker session; the session half (dial, hello, reader, writer) stays in
worker_agent/agent.py.
"""

from __future__ import annotations

import asyncio
import functools
from typing import Any

import structlog
import structlog.contextvars

import protocol
from protocol import errors
from worker_agent.handlers import Context, Handler, run_handler
from worker_agent.outbox import Outbox
from worker_agent.probe import LoadTracker
from worker_agent.telemetry import Telemetry

__all__ = ["REJECTED", "PlanRunner"]

#: Reject code for a worker that is full or draining (docs/PROTOCOL.md §Messages, ``reject``);
#: ``reason`` says which. An op without a handler gets ``unknown_op``.
REJECTED = "rejected"

_NUMBERED = (protocol.Accept, protocol.Reject, protocol.Event, protocol.Done)  # carry ``seq``; acked


class _PlanRun:
    """One attempt of one plan on this worker."""

    __slots__ = ("attempt", "cancel_requested", "ctx", "plan_id", "silent", "started_at", "task")

    def __init__(self, plan_id: str, attempt: int, started_at: float) -> None:
        self.plan_id = plan_id
        self.attempt = attempt
        self.started_at = started_at
        self.ctx: Context
        self.task: asyncio.Task[protocol.Done] | None = None
        self.silent = False  # no longer our lease: send nothing more for it
        self.cancel_requested = False


class PlanRunner:
    """The plan lifecycle of a worker agent; :class:`~worker_agent.agent.Agent` sets the state it uses."""

    worker_id: str
    max_concurrency: int
    kill_grace_s: float
    max_frame_bytes: int
    telemetry: Telemetry
    _handlers: dict[str, Handler]
    _plans: dict[str, _PlanRun]
    _waiting: dict[str, protocol.Assign]  # prefetched assigns, unstarted, in arrival order
    _prefetch: int
    _orphans: set[_PlanRun]
    _outbox: Outbox
    _wakeup: asyncio.Event
    _idle: asyncio.Event
    _stopping: bool
    _draining: bool
    _load: LoadTracker
    _event_seq: int
    _log: Any

    @property
    def ops(self) -> list[str]:
        """The ops this worker advertises, sorted."""
        return sorted(self._handlers)

    def _enqueue(self, msg: Any) -> None:
        if isinstance(msg, _NUMBERED):  # one counter for every plan message: the coordinator acks up to it
            self._event_seq += 1
            msg.seq = self._event_seq
        if self._outbox.append(msg):
            self._log.warning("outbox full: dropped old events", dropped_total=self._outbox.dropped)
        self._wakeup.set()

    def _reject(self, assign: protocol.Assign, code: str, reason: str) -> None:
        self._log.debug("rejecting plan", plan_id=assign.plan_id, code=code)
        self._enqueue(protocol.Reject(plan_id=assign.plan_id, attempt=assign.attempt, code=code, reason=reason))

    def _on_assign(self, assign: protocol.Assign) -> None:
        waiting = self._waiting.get(assign.plan_id)
        if waiting is not None:
            if assign.attempt <= waiting.attempt:
                return  # a repeated (or older) assign of a plan waiting here
            del self._waiting[assign.plan_id]  # superseded; the newer attempt is handled below
        current = self._plans.get(assign.plan_id)
        if current is not None:
            if assign.attempt == current.attempt:
                self._enqueue(protocol.Accept(plan_id=assign.plan_id, attempt=assign.attempt))
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
        if len(self._plans) >= self.max_concurrency:
            if len(self._waiting) < self._prefetch:
                self._waiting[assign.plan_id] = assign  # accepted when it starts
                self._load.queued = len(self._waiting)
                return
            self._reject(assign, REJECTED, f"worker {self.worker_id} is running {len(self._plans)} plans (max)")
            return
        self._start(assign, handler)

    def _start_waiting(self) -> None:
        """Start prefetched plans, oldest first, while slots are free."""
        while self._waiting and len(self._plans) < self.max_concurrency and not self._stopping:
            plan_id = next(iter(self._waiting))
            assign = self._waiting.pop(plan_id)
            handler = self._handlers.get(assign.op)
            if handler is None:  # removed since it was queued
                self._reject(assign, errors.UNKNOWN_OP, f"worker {self.worker_id} has no handler for op {assign.op!r}")
                continue
            self._start(assign, handler)
        self._load.queued = len(self._waiting)

    def _on_revoke(self, revoke: protocol.Revoke) -> None:
        waiting = self._waiting.get(revoke.plan_id)
        if waiting is None or waiting.attempt != revoke.attempt:
            return  # started (the coordinator sees our accept) or not ours: the revoke is refused
        del self._waiting[revoke.plan_id]
        self._load.queued = len(self._waiting)
        self._reject(waiting, errors.REVOKED, "revoked before it started")

    def _hand_back_waiting(self, reason: str) -> None:
        """Give every prefetched plan back to the coordinator (draining or stopping)."""
        for assign in list(self._waiting.values()):
            self._reject(assign, REJECTED, reason)
        self._waiting.clear()
        self._load.queued = 0

    def _start(self, assign: protocol.Assign, handler: Handler) -> None:
        loop = asyncio.get_running_loop()
        run = _PlanRun(assign.plan_id, assign.attempt, loop.time())
        run.ctx = Context(
            plan_id=assign.plan_id,
            attempt=assign.attempt,
            worker_id=self.worker_id,
            args=assign.args,
            sink=functools.partial(self._on_event, run),
            kill_grace_s=self.kill_grace_s,
            max_payload_bytes=self.max_frame_bytes - 4096,
            loop=loop,
        )
        self._plans[run.plan_id] = run
        self._idle.clear()
        self._load.started()
        self.telemetry.plan_started(run.plan_id)
        self._enqueue(protocol.Accept(plan_id=run.plan_id, attempt=run.attempt))
        run.task = loop.create_task(self._run_plan(run, handler, assign.args, assign.timeout_s))
        run.task.add_done_callback(functools.partial(self._plan_finished, run))

    async def _run_plan(self, run: _PlanRun, handler: Handler, args: Any, timeout_s: float | None) -> protocol.Done:
        # The task's own context copy: handlers' structlog calls carry the plan's ids.
        structlog.contextvars.bind_contextvars(worker_id=self.worker_id, plan_id=run.plan_id, attempt=run.attempt)
        return await run_handler(handler, run.ctx, args, timeout_s=timeout_s)

    def _on_event(self, run: _PlanRun, kind: str, data: Any, ephemeral: bool) -> None:
        if run.silent:
            return
        self._enqueue(  # _enqueue numbers it
            protocol.Event(plan_id=run.plan_id, kind=kind, data=data, attempt=run.attempt, ephemeral=ephemeral)
        )

    def _plan_finished(self, run: _PlanRun, task: asyncio.Task[protocol.Done]) -> None:
        self._load.finished(asyncio.get_running_loop().time() - run.started_at)
        self.telemetry.plan_finished(run.plan_id, run.ctx.tokens)
        run.ctx._close()
        self._orphans.discard(run)
        if self._plans.get(run.plan_id) is run:
            del self._plans[run.plan_id]
            if not self._plans:
                self._idle.set()
        if run.silent:
            return
        if task.cancelled():  # cancelled before its first step: run_handler never ran
            done = protocol.Done(plan_id=run.plan_id, attempt=run.attempt, outcome="cancelled")
        elif (exc := task.exception()) is not None:
            self._log.error("plan task failed", plan_id=run.plan_id, exc_info=exc)
            info = protocol.ErrorInfo(code=errors.INTERNAL, message=f"{type(exc).__name__}: {exc}")
            done = protocol.Done(plan_id=run.plan_id, attempt=run.attempt, outcome="failed", error=info)
        else:
            done = task.result()
        self._enqueue(done)
        self._start_waiting()

    def _on_cancel(self, cancel: protocol.Cancel) -> None:
        waiting = self._waiting.get(cancel.plan_id)
        if waiting is not None and (not cancel.attempt or cancel.attempt == waiting.attempt):
            del self._waiting[cancel.plan_id]
            self._load.queued = len(self._waiting)
            self._enqueue(protocol.Done(plan_id=waiting.plan_id, attempt=waiting.attempt, outcome="cancelled"))
            return
        run = self._plans.get(cancel.plan_id)
        if run is None or (cancel.attempt and cancel.attempt != run.attempt) or run.cancel_requested:
            return  # not ours, or already stopping (a second task.cancel would cut the kill grace short)
        run.cancel_requested = True
        run.ctx._mark_cancelled()
        if run.task is not None:
            run.task.cancel()

    def _on_error(self, error: protocol.Error) -> None:
        if error.code == errors.STALE_LEASE and error.plan_id:
            waiting = self._waiting.get(error.plan_id)
            if waiting is not None and (not error.attempt or error.attempt == waiting.attempt):
                del self._waiting[error.plan_id]
            run = self._plans.get(error.plan_id)
            if run is not None and (not error.attempt or error.attempt == run.attempt):
                self._silence(run, "stale lease")
            elif run is None:
                self._outbox.purge(error.plan_id, error.attempt or None)
            return
        self._log.warning("coordinator error", code=error.code, message=error.message, plan_id=error.plan_id)

    def _silence(self, run: _PlanRun, reason: str) -> None:
        """Stop a plan that is no longer our lease, sending nothing more for it."""
        self._log.info("stopping plan without reporting it", plan_id=run.plan_id, attempt=run.attempt, reason=reason)
        run.silent = True
        if self._plans.get(run.plan_id) is run:
            del self._plans[run.plan_id]
            if not self._plans:
                self._idle.set()
        self._outbox.purge(run.plan_id, run.attempt)
        if run.task is not None and not run.task.done():
            self._orphans.add(run)
            run.ctx._mark_cancelled()
            run.task.cancel()
        self._start_waiting()

    async def _silence_all(self, reason: str) -> None:
        self._waiting.clear()  # no session to hand them back on: the coordinator requeues them as lost
        for run in list(self._plans.values()):
            self._silence(run, reason)
        tasks = [run.task for run in self._orphans if run.task is not None]
        if tasks:  # let cancelled handlers kill their subprocesses before run() returns
            await asyncio.gather(*tasks, return_exceptions=True)
