"""The worker's side of preemption (issue #27): ctx.preempted, SIGTERM to a plan's processes, the grace, and
done(preempted)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import structlog

import protocol
from protocol import errors
from tests.waiting import until
from worker_agent.handlers import Context, builtin_handlers
from worker_agent.outbox import SendQueue
from worker_agent.runner import PlanRunner
from worker_agent.telemetry import Telemetry

SEEN: dict[str, bool] = {}


async def checkpoints(ctx: Context, args: Any) -> str:
    """Works until preempted, then saves a checkpoint and gives up (raises)."""
    while not ctx.preempted:  # noqa: ASYNC110 - a handler polls ctx.preempted, as users' handlers do
        await asyncio.sleep(0.01)
    SEEN[ctx.plan_id] = True
    raise RuntimeError("checkpointed at step 7")


async def finishes(ctx: Context, args: Any) -> str:
    """Preempted near its end: finishes its work within the grace."""
    while not ctx.preempted:  # noqa: ASYNC110 - a handler polls ctx.preempted, as users' handlers do
        await asyncio.sleep(0.01)
    return "done anyway"


async def ignores(ctx: Context, args: Any) -> None:
    """Never looks at ctx.preempted."""
    await asyncio.sleep(60)


def runner(max_concurrency: int = 2) -> tuple[PlanRunner, SendQueue]:
    queue = SendQueue(10_000, structlog.get_logger())
    handlers = {**builtin_handlers(allow_shell=True), "checkpoints": checkpoints, "finishes": finishes,
                "ignores": ignores}  # fmt: skip
    plans = PlanRunner(
        worker_id="w1", max_concurrency=max_concurrency, kill_grace_s=1.0, max_payload_bytes=1 << 20,
        handlers=handlers, telemetry=Telemetry(), outbound=queue, logger=structlog.get_logger(),
    )
    return plans, queue


def dones(queue: SendQueue) -> list[protocol.Done]:
    return [m for m in queue.outbox.take(10_000) if isinstance(m, protocol.Done)]


async def ended(plans: PlanRunner, queue: SendQueue, timeout_s: float = 10.0) -> list[protocol.Done]:
    await until(lambda: plans.running_count == 0, timeout_s=timeout_s)
    return dones(queue)


def assign(plan_id: str, op: str, args: Any = None) -> protocol.Assign:
    return protocol.Assign(plan_id=plan_id, attempt=1, op=op, args=args)


async def test_a_handler_sees_ctx_preempted_and_its_done_says_preempted() -> None:
    """preempt sets ctx.preempted; the handler's failure after it is sent as done(cancelled, preempted=True)."""
    plans, queue = runner()
    plans.on_assign(assign("p1", "checkpoints"))
    plans.on_preempt(protocol.Preempt(plan_id="p1", attempt=1, grace_s=30.0, reason="team web waits"))
    [done] = await ended(plans, queue)
    assert SEEN["p1"]
    assert (done.outcome, done.preempted) == ("cancelled", True)
    assert done.error is not None and done.error.code == errors.CANCELLED
    assert done.error.message == "preempted: team web waits"


async def test_a_preempted_plan_that_finishes_within_its_grace_succeeds() -> None:
    """A handler that completes after the preempt reports succeeded, not preempted."""
    plans, queue = runner()
    plans.on_assign(assign("p1", "finishes"))
    plans.on_preempt(protocol.Preempt(plan_id="p1", attempt=1, grace_s=30.0))
    [done] = await ended(plans, queue)
    assert (done.outcome, done.preempted, done.result) == ("succeeded", False, "done anyway")


async def test_a_handler_that_ignores_preemption_is_cancelled_after_the_grace() -> None:
    """Past grace_s the plan is cancelled, and its done still says preempted."""
    plans, queue = runner()
    plans.on_assign(assign("p1", "ignores"))
    start = time.monotonic()
    plans.on_preempt(protocol.Preempt(plan_id="p1", attempt=1, grace_s=0.3))
    [done] = await ended(plans, queue)
    assert time.monotonic() - start >= 0.3
    assert (done.outcome, done.preempted) == ("cancelled", True)


async def test_a_shell_plan_gets_sigterm_at_the_preempt_not_after_the_grace() -> None:
    """The shell command's process group gets SIGTERM as soon as the preempt comes (its checkpoint signal)."""
    plans, queue = runner()
    # "ready" once its sleep is forked and then its trap set: a sleep forked after the SIGTERM never got it and held
    # the plan's pipes open for its 30 s (this test timed out on a loaded machine). The sleep is forked before the
    # trap, so it never inherits the shell's handler: forked after it, a SIGTERM that came before its exec ran the
    # inherited handler, which the exec then dropped, and the sleep lived on (1 run in 6 at load 4).
    plans.on_assign(assign("p1", "shell", {"cmd": "sleep 30 & trap 'echo saved; exit 3' TERM; echo ready; wait"}))
    msgs: list[Any] = []

    def said(line: str) -> bool:
        msgs.extend(queue.outbox.take(10_000))
        return any(isinstance(m, protocol.Event) and m.kind == "stdout" and m.data == line for m in msgs)

    # Its trap is set and its sleep runs (waiting only for the process let a loaded machine deliver SIGTERM
    # before the trap).
    await until(lambda: said("ready"), timeout_s=10)
    start = time.monotonic()
    plans.on_preempt(protocol.Preempt(plan_id="p1", attempt=1, grace_s=20.0))
    await until(lambda: plans.running_count == 0, timeout_s=10)
    said("saved")
    assert time.monotonic() - start < 10  # well within the 20 s grace: it stopped on SIGTERM
    assert any(isinstance(m, protocol.Event) and m.kind == "stdout" and m.data == "saved" for m in msgs)
    [done] = [m for m in msgs if isinstance(m, protocol.Done)]
    assert (done.outcome, done.preempted) == ("cancelled", True)


async def test_a_waiting_plan_preempted_ends_at_once() -> None:
    """A prefetched plan that has not started ends with done(cancelled, preempted=True) at once."""
    plans, queue = runner(max_concurrency=1)
    plans.on_welcome(protocol.Welcome(worker_id="w1", heartbeat_interval_s=10.0, heartbeat_timeout_s=30.0, prefetch=1))
    plans.on_assign(assign("p1", "ignores"))
    plans.on_assign(assign("p2", "ignores"))
    plans.on_preempt(protocol.Preempt(plan_id="p2", attempt=1))
    [done] = dones(queue)
    assert (done.plan_id, done.outcome, done.preempted) == ("p2", "cancelled", True)
    plans.on_cancel(protocol.Cancel(plan_id="p1", attempt=1))
    await ended(plans, queue)


async def test_an_interrupted_host_hands_back_waiting_plans_and_preempts_running_ones() -> None:
    """preempt_all: the waiting plan is rejected (it never started), the running one is preempted."""
    plans, queue = runner(max_concurrency=1)
    plans.on_welcome(protocol.Welcome(worker_id="w1", heartbeat_interval_s=10.0, heartbeat_timeout_s=30.0, prefetch=1))
    plans.on_assign(assign("p1", "checkpoints"))
    plans.on_assign(assign("p2", "ignores"))
    assert plans.preempt_all(5.0, "spot reclaim") == 1
    msgs = queue.outbox.take(10_000)
    assert [(m.plan_id, m.code) for m in msgs if isinstance(m, protocol.Reject)] == [("p2", "rejected")]
    [done] = await ended(plans, queue)
    assert (done.plan_id, done.preempted) == ("p1", True)
    assert done.error is not None and "spot reclaim" in done.error.message
