"""How few steps a plan takes on a worker (issue #29). Plans whose handler runs on the loop (worker_agent/handlers.py
``on_loop``, the built-in ``echo``): no task, no thread; the plan ends in the step that reads its assign, with the
outcomes of any other handler. Plans with a task: it ends its plan in its last step (no done callback), and one
cancelled before it began is ended by the runner."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import structlog

import protocol
from protocol import errors
from worker_agent.handlers import Context, HandlerError, builtin_handlers, on_loop, run_handler, runs_on_loop
from worker_agent.outbox import SendQueue
from worker_agent.runner import PlanRunner
from worker_agent.telemetry import Telemetry


@on_loop
def refuses(ctx: Context, args: Any) -> None:
    raise HandlerError("bad_input", f"refused {args!r}")


@on_loop
def breaks(ctx: Context, args: Any) -> None:
    raise KeyError("missing")


@on_loop
def big(ctx: Context, args: Any) -> bytes:
    return b"x" * 4096


async def waits(ctx: Context, args: Any) -> None:
    await asyncio.sleep(60)


def runner(max_concurrency: int = 4) -> tuple[PlanRunner, SendQueue]:
    queue = SendQueue(10_000, structlog.get_logger())
    handlers = {**builtin_handlers(), "refuses": refuses, "breaks": breaks, "big": big, "waits": waits}
    plans = PlanRunner(
        worker_id="w1", max_concurrency=max_concurrency, kill_grace_s=1.0, max_payload_bytes=1024,
        handlers=handlers, telemetry=Telemetry(), outbound=queue, logger=structlog.get_logger(),
    )
    return plans, queue


def assign(plan_id: str, op: str, args: Any = None) -> protocol.Assign:
    return protocol.Assign(plan_id=plan_id, attempt=1, op=op, args=args)


def queued(queue: SendQueue) -> list[Any]:
    return queue.outbox.take(10_000)


async def test_echo_ends_in_the_step_that_reads_its_assign() -> None:
    """echo's accept, event and succeeded done are queued, numbered, when on_assign returns; no task is left."""
    plans, queue = runner()
    assert runs_on_loop(builtin_handlers()["echo"])
    tasks_before = len(asyncio.all_tasks())
    plans.on_assign(assign("p1", "echo", {"x": [1, 2]}))
    accept, event, done = queued(queue)
    assert (type(accept), accept.seq) == (protocol.Accept, 1)
    assert (event.kind, event.data, event.attempt, event.seq) == ("echo", {"x": [1, 2]}, 1, 2)
    assert (done.outcome, done.result, done.seq, done.receipt) == ("succeeded", {"x": [1, 2]}, 3, None)
    assert plans.running_count == 0 and plans.idle.is_set() and plans.load.in_flight == 0
    assert plans.load.finished_count == 1
    assert len(asyncio.all_tasks()) == tasks_before


async def test_a_handler_on_the_loop_fails_as_any_handler_does() -> None:
    """HandlerError keeps its code; any other exception is handler_error; a result over the limit fails (no spool)."""
    plans, queue = runner()
    plans.on_assign(assign("p1", "refuses", 7))
    plans.on_assign(assign("p2", "breaks"))
    plans.on_assign(assign("p3", "big"))
    done = {m.plan_id: m for m in queued(queue) if isinstance(m, protocol.Done)}
    assert done["p1"].error is not None and (done["p1"].error.code, done["p1"].error.message) == ("bad_input",
                                                                                                 "refused 7")
    assert done["p2"].error is not None and done["p2"].error.code == errors.HANDLER_ERROR
    assert done["p2"].error.message == "KeyError: 'missing'"
    assert done["p3"].outcome == "failed" and done["p3"].error is not None
    assert "4099 bytes encoded; the limit is 1024" in done["p3"].error.message


async def test_prefetched_plans_on_the_loop_all_start_when_a_slot_frees() -> None:
    """With one slot, echo plans waiting behind a running plan all run, in order, once it is taken back."""
    plans, queue = runner(max_concurrency=1)
    plans.on_welcome(protocol.Welcome(worker_id="w1", heartbeat_interval_s=10, heartbeat_timeout_s=30, prefetch=3))
    plans.on_assign(assign("slow", "waits"))
    for i in range(3):
        plans.on_assign(assign(f"e{i}", "echo", i))
    assert [type(m) for m in queued(queue)] == [protocol.Accept]
    plans.on_error(protocol.Error(code=errors.STALE_LEASE, message="not yours", plan_id="slow", attempt=1))
    done = [m for m in queued(queue) if isinstance(m, protocol.Done)]
    assert [(m.plan_id, m.outcome, m.result) for m in done] == [("e0", "succeeded", 0), ("e1", "succeeded", 1),
                                                                ("e2", "succeeded", 2)]
    assert plans.load.queued == 0
    await plans.silence_all("test over")


async def test_run_handler_calls_a_handler_on_the_loop_without_a_thread() -> None:
    """Through run_handler (a plan with inputs or a trace), an on-loop handler is called on the loop's thread."""
    import threading

    seen: list[int] = []

    @on_loop
    def where(ctx: Context, args: Any) -> int:
        seen.append(threading.get_ident())
        return 1

    ctx = Context(plan_id="p1", attempt=1, worker_id="w1", args=None, sink=lambda *_: None)
    done = await run_handler(where, ctx, None)
    assert done.outcome == "succeeded" and seen == [threading.get_ident()]


def test_on_loop_refuses_an_async_function() -> None:
    """Marking an async def handler on_loop is a TypeError naming it."""
    with pytest.raises(TypeError, match="on_loop is for plain functions"):
        on_loop(waits)


# ---------------------------------------------------------------- plans with a task


async def test_a_task_sends_its_done_in_the_step_its_handler_returns() -> None:
    """The done is queued by the plan's task as its handler returns, not a loop turn later by a done callback."""
    release: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    async def awaits(ctx: Context, args: Any) -> int:
        await release
        return 5

    plans, queue = runner()
    plans.add_handler("awaits", awaits)
    plans.on_assign(assign("p1", "awaits"))
    await asyncio.sleep(0)  # the task starts and waits
    release.set_result(None)
    await asyncio.sleep(0)  # one loop turn: the task's last step
    done = [m for m in queued(queue) if isinstance(m, protocol.Done)]
    assert [(m.outcome, m.result) for m in done] == [("succeeded", 5)]
    assert plans.running_count == 0 and plans.idle.is_set()


async def test_a_plan_cancelled_before_its_task_began_ends_cancelled_once() -> None:
    """A cancel read with the assign (its task not yet run) ends it cancelled at once, once; a silenced one sends
    nothing; neither task runs its handler."""
    ran: list[str] = []

    async def noted(ctx: Context, args: Any) -> None:
        ran.append(ctx.plan_id)

    plans, queue = runner()
    plans.add_handler("noted", noted)
    plans.on_assign(assign("p1", "noted"))
    plans.on_cancel(protocol.Cancel(plan_id="p1", attempt=1))
    plans.on_assign(assign("p2", "noted"))
    plans.on_error(protocol.Error(code=errors.STALE_LEASE, message="not yours", plan_id="p2", attempt=1))
    assert plans.running_count == 0 and plans.idle.is_set()
    for _ in range(3):
        await asyncio.sleep(0)
    done = [(m.plan_id, m.outcome) for m in queued(queue) if isinstance(m, protocol.Done)]
    assert done == [("p1", "cancelled")] and ran == []
    assert plans.load.in_flight == 0
    await plans.silence_all("test over")
