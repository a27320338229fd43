"""A worker's memory per plan: what a plan that ended leaves behind (issue #25 part 5, bench/leak.py).

The daemon's collector runs its oldest generation rarely (fleetwire/cli/serve.py ``DAEMON_GC_THRESHOLDS``),
so a reference cycle left by each plan is memory that grows with every plan until then: a plan's
run, context, task and inputs must be freed by reference counting alone when it ends.
"""

from __future__ import annotations

import asyncio
import gc
import os
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import structlog

import protocol
from protocol.tickets import DIGEST_DEFAULT, new_hasher_of
from tests.waiting import until
from worker_agent.handlers import Context, builtin_handlers, on_loop
from worker_agent.outbox import SendQueue
from worker_agent.runner import PlanRunner
from worker_agent.spool import Spool
from worker_agent.telemetry import Telemetry


@pytest.fixture
def no_collector() -> Iterator[None]:
    """The cycle collector off for the test: what is freed was freed by reference counting."""
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


async def copy(ctx: Context, args: Any) -> int:
    """Read input ``data``, report progress, leave output ``out``: a plan's whole data path."""
    data = ctx.inputs["data"].read()
    ctx.progress(0.5, "read")
    ctx.output("out", data[::-1])
    return len(data)


async def fail(ctx: Context, args: Any) -> None:
    raise RuntimeError("handler failed")


_on_loop_contexts: list[weakref.ref[Context]] = []


@on_loop
def noted_echo(ctx: Context, args: Any) -> Any:
    """echo, run on the loop as the built-in is, noting its context (weakly) for the test."""
    _on_loop_contexts.append(weakref.ref(ctx))
    ctx.emit("echo", args)
    return args


def _runner(spool: Spool) -> tuple[PlanRunner, SendQueue]:
    queue = SendQueue(10_000, structlog.get_logger())
    handlers = {**builtin_handlers(allow_shell=False, python_allow=[]), "copy": copy, "fail": fail,
                "noted_echo": noted_echo}
    runner = PlanRunner(
        worker_id="w1", max_concurrency=4, kill_grace_s=1.0, max_payload_bytes=1 << 20, handlers=handlers,
        telemetry=Telemetry(), outbound=queue, logger=structlog.get_logger(), spool=spool,
    )
    return runner, queue


async def _run(runner: PlanRunner, spool: Spool, assign: protocol.Assign, data: bytes | None) -> list[weakref.ref[Any]]:
    """Run one plan to its end; weak references to what it held while it ran."""
    runner.on_assign(assign)
    run = runner._plans.get(assign.plan_id)  # the runner's own record of a running plan (weakly held below)
    if run is None:  # a handler that runs on the loop (handlers.on_loop): it ended in on_assign, with no task
        assert data is None
        return []
    assert run.task is not None
    refs: list[weakref.ref[Any]] = [weakref.ref(run.task), weakref.ref(run.ctx)]
    del run
    if data is not None:
        entry = spool.input(assign.plan_id, assign.attempt, "data")
        assert entry is not None
        refs.append(weakref.ref(entry))
        entry.write(data)
        entry.finish()
        del entry
    await until(lambda: runner.running_count == 0, timeout_s=10)
    return refs


async def test_ended_plans_are_freed_without_the_cycle_collector(tmp_path: Path, no_collector: None) -> None:
    """Plans that succeeded (with an input and an output, and an echo run on the loop), failed or were cancelled
    leave no object of theirs behind once they end: their task, handler context and inputs are freed at once."""
    spool = Spool(tmp_path / "spool", clock=lambda: 0.0)
    runner, queue = _runner(spool)
    refs: list[weakref.ref[Any]] = []
    for i in range(5):
        data = os.urandom(4096)
        hasher = new_hasher_of(DIGEST_DEFAULT)
        hasher.update(data)
        spec = protocol.InputSpec(name="data", size=len(data), digest=f"{DIGEST_DEFAULT}:{hasher.hexdigest()}")
        assign = protocol.Assign(plan_id=f"copy-{i}", attempt=1, op="copy", inputs=[spec], outputs=["out"])
        refs += await _run(runner, spool, assign, data)
        echo = protocol.Assign(plan_id=f"echo-{i}", attempt=1, op="noted_echo", args=i)
        refs += await _run(runner, spool, echo, None)
        refs += await _run(runner, spool, protocol.Assign(plan_id=f"fail-{i}", attempt=1, op="fail"), None)
    runner.on_assign(protocol.Assign(plan_id="sleep", attempt=1, op="sleep", args={"seconds": 60}))
    run = runner._plans["sleep"]
    assert run.task is not None
    refs += [weakref.ref(run.task), weakref.ref(run.ctx)]
    del run
    await asyncio.sleep(0)  # it started sleeping
    runner.on_cancel(protocol.Cancel(plan_id="sleep", attempt=1))
    await until(lambda: runner.running_count == 0, timeout_s=10)
    await asyncio.sleep(0)  # the done callback of the last task
    outcomes = [m.outcome for m in queue.outbox.take(10_000) if isinstance(m, protocol.Done)]
    assert outcomes == ["succeeded", "succeeded", "failed"] * 5 + ["cancelled"]
    assert len(_on_loop_contexts) == 5
    refs += _on_loop_contexts
    alive = [r() for r in refs if r() is not None]
    assert alive == [], f"{len(alive)} of {len(refs)} objects of ended plans wait for the collector: {alive[:4]}"
