"""The ``python`` op runs a plan that holds devices in its own process (worker_agent/pyproc.py), real processes."""

from __future__ import annotations

import asyncio
import os
from typing import Any

import pytest

import protocol
from tests.unit.test_handlers import wait_gone
from worker_agent.handlers import Context, make_python_handler, run_handler

pytestmark = pytest.mark.timeout(60)

FUNCTIONS = "tests.gpu_functions"


class Sink:
    """Records a plan's events; tests wait on one arriving."""

    def __init__(self) -> None:
        self.events: list[tuple[str, Any, bool]] = []
        self.arrived = asyncio.Event()

    def __call__(self, kind: str, data: Any, ephemeral: bool) -> None:
        self.events.append((kind, data, ephemeral))
        self.arrived.set()


def device_ctx(args: Any, devices: list[str], *, kill_grace_s: float = 5.0) -> tuple[Context, Sink]:
    """A plan's Context as the runner builds it on a worker with devices."""
    sink = Sink()
    ctx = Context(plan_id="p1", attempt=1, worker_id="w1", args=args, sink=sink, kill_grace_s=kill_grace_s)
    ctx.devices = devices
    ctx.cuda_visible_devices = ",".join(devices)
    return ctx, sink


async def run_python(function: str, devices: list[str], *, args: list[Any] | None = None,
                     timeout_s: float | None = None) -> tuple[protocol.Done, Context, Sink]:  # fmt: skip
    op_args = {"function": f"{FUNCTIONS}:{function}", "args": args or []}
    ctx, sink = device_ctx(op_args, devices)
    done = await run_handler(make_python_handler([f"{FUNCTIONS}:*"]), ctx, op_args, timeout_s=timeout_s)
    return done, ctx, sink


async def test_plan_with_devices_runs_in_its_own_process_seeing_only_them() -> None:
    """CUDA_VISIBLE_DEVICES is the plan's, in another process; events, tokens and the devices kwarg come through."""
    done, ctx, sink = await run_python("visible", ["2", "3"], args=["a"])
    assert done.outcome == "succeeded", done
    result = done.result
    assert result["cuda"] == "2,3" and result["pid"] != os.getpid()
    assert result["devices"] == ["2", "3"] and result["ctx_devices"] == ["2", "3"]
    assert sink.events == [("seen", {"tag": "a", "cuda": "2,3"}, False)]
    assert ctx.tokens == 3


async def test_plan_without_devices_on_a_worker_with_devices_sees_none() -> None:
    """A plan holding no device on a worker that has devices runs in its own process, seeing no device."""
    done, _, _ = await run_python("visible", [], args=["b"])
    assert done.outcome == "succeeded", done
    assert done.result["pid"] != os.getpid() and done.result["cuda"] == ""


async def test_plan_on_a_worker_without_devices_stays_in_the_worker_process() -> None:
    """A worker without devices runs the function in its own process, as before (the hot path is unchanged)."""
    op_args = {"function": "tests.plan_functions:seen"}
    ctx, _ = device_ctx(op_args, [])
    ctx.cuda_visible_devices = None  # what the runner leaves on a worker without devices
    done = await run_handler(make_python_handler(["tests.plan_functions:*"]), ctx, op_args)
    assert done.outcome == "succeeded", done
    assert done.result["pid"] == os.getpid()


async def test_async_function_is_awaited_in_its_process() -> None:
    """A coroutine function runs to its end in the plan's process."""
    done, _, _ = await run_python("async_visible", ["1"])
    assert done.outcome == "succeeded" and done.result == "1"


@pytest.mark.parametrize(
    ("function", "code", "message", "detail"),
    [
        ("fail_with_code", "model_missing", "no weights here", {"path": "/nowhere"}),
        ("boom", "handler_error", "ValueError: boom", None),
        ("crash", "handler_error", "the plan's process exited with status 3 without a result", {"exit_code": 3}),
        ("unencodable", "handler_error", "TypeError: the result is not msgpack-encodable", None),
        ("no_such_function", "invalid_argument", "has no attribute 'no_such_function'", None),
    ],
)
async def test_failures_in_the_process_fail_the_plan_as_in_process(function: str, code: str, message: str,
                                                                   detail: Any) -> None:  # fmt: skip
    """A HandlerError keeps its code and detail; an exception, a crash, a bad result or name fail clearly."""
    done, _, _ = await run_python(function, ["0"])
    assert done.outcome == "failed" and done.error is not None
    assert done.error.code == code and message in done.error.message, done.error
    assert done.error.detail == detail


async def test_cancel_and_timeout_stop_the_process() -> None:
    """Cancelling the plan ends it cancelled, a timeout fails it timeout; either way its process is gone."""
    op_args = {"function": f"{FUNCTIONS}:forever"}
    python = make_python_handler([f"{FUNCTIONS}:*"])
    ctx, sink = device_ctx(op_args, ["0"], kill_grace_s=1.0)
    task = asyncio.create_task(run_handler(python, ctx, op_args))
    async with asyncio.timeout(20):
        await sink.arrived.wait()
    pid = sink.events[0][1]
    task.cancel()
    assert (await task).outcome == "cancelled"
    await wait_gone(pid, timeout_s=10)

    ctx, sink = device_ctx(op_args, ["0"], kill_grace_s=1.0)
    # Its pid arrives 0.25-0.4 s after the start at load 6: 2.5 s leaves room for a loaded machine.
    task = asyncio.create_task(run_handler(python, ctx, op_args, timeout_s=2.5))
    async with asyncio.timeout(20):
        await sink.arrived.wait()
    pid = sink.events[0][1]
    done = await task
    assert done.outcome == "failed" and done.error is not None and done.error.code == "timeout"
    await wait_gone(pid, timeout_s=10)


async def test_outputs_left_in_the_process_are_kept_by_the_worker(tmp_path: Any) -> None:
    """ctx.output in the plan's process (bytes or a file) lands in the worker's spool as the plan's outputs."""
    from worker_agent.spool import Spool

    spool = Spool(tmp_path / "spool")
    op_args = {"function": f"{FUNCTIONS}:leave_outputs", "args": [str(tmp_path)]}
    ctx, _ = device_ctx(op_args, ["0"])
    ctx.data = spool.plan_data("p1", 1, [])
    done = await run_handler(make_python_handler([f"{FUNCTIONS}:*"]), ctx, op_args)
    assert done.outcome == "succeeded" and done.result == "left", done
    outputs = {o.name: o.size for o in spool.outputs_of("p1", 1)}
    assert outputs == {"raw": len(b"from the child"), "file": len(b"a file")}
