"""Plan handlers: the Context, the built-in ops, and how a plan's end becomes one ``done``."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil
import pytest
from structlog.testing import capture_logs

import protocol
from tests.lost_cancel import act_as_the_start_ends
from worker_agent.handlers import (
    Context,
    Handler,
    HandlerError,
    builtin_handlers,
    echo,
    load_handler_spec,
    make_python_handler,
    run_handler,
    shell,
    sleep,
)

pytestmark = pytest.mark.timeout(15)


class Recorder:
    """An event sink that tests can wait on."""

    def __init__(self) -> None:
        self.events: list[tuple[str, Any, bool]] = []
        self._changed = asyncio.Event()

    def __call__(self, kind: str, data: Any, ephemeral: bool) -> None:
        self.events.append((kind, data, ephemeral))
        self._changed.set()

    def kinds(self) -> list[str]:
        return [kind for kind, _, _ in self.events]

    async def wait_for(self, predicate: Callable[[list[tuple[str, Any, bool]]], bool]) -> None:
        async with asyncio.timeout(5):
            while not predicate(self.events):
                self._changed.clear()
                await self._changed.wait()


def make_ctx(args: Any = None, *, kill_grace_s: float = 5.0) -> tuple[Context, Recorder]:
    sink = Recorder()
    ctx = Context(plan_id="p1", attempt=1, worker_id="w1", args=args, sink=sink, kill_grace_s=kill_grace_s)
    return ctx, sink


async def run(fn: Handler, args: Any = None, *, timeout_s: float | None = None) -> tuple[protocol.Done, Recorder]:
    ctx, sink = make_ctx(args)
    return await run_handler(fn, ctx, args, timeout_s=timeout_s), sink


def gone(pid: int) -> bool:
    """The process no longer runs (reaped, or a zombie waiting for a reaper)."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


# --------------------------------------------------------------------------- helpers for the python op


def scaled(x: int, *, factor: int = 1, ctx: Context) -> dict[str, Any]:
    ctx.progress(0.5, "half way")
    return {"value": x * factor, "thread": threading.get_ident()}


async def async_add(a: int, b: int) -> int:
    await asyncio.sleep(0)
    return a + b


# --------------------------------------------------------------------------- built-ins


async def test_echo_returns_args_and_emits_one_event() -> None:
    """echo succeeds with its args as the result, after one 'echo' event carrying them."""
    done, sink = await run(echo, {"x": [1, 2], "b": b"\x00"})
    assert done == protocol.Done(plan_id="p1", attempt=1, outcome="succeeded", result={"x": [1, 2], "b": b"\x00"})
    assert sink.events == [("echo", {"x": [1, 2], "b": b"\x00"}, False)]


async def test_sleep_emits_progress_about_once_a_second() -> None:
    """sleep reports ephemeral progress events and how long it slept."""
    done, sink = await run(sleep, {"seconds": 1.3})
    assert done.outcome == "succeeded"
    assert done.result["slept_s"] >= 1.3
    assert sink.kinds() == ["progress"]
    _, data, ephemeral = sink.events[0]
    assert ephemeral and 0.5 < data["fraction"] < 1.0 and data["message"]


async def test_sleep_rejects_bad_args() -> None:
    """sleep without a non-negative number of seconds fails with invalid_argument."""
    done, _ = await run(sleep, {"seconds": "soon"})
    assert done.outcome == "failed" and done.error is not None
    assert done.error.code == "invalid_argument" and "seconds" in done.error.message


async def test_shell_streams_stdout_and_stderr_lines() -> None:
    """A string command runs through /bin/sh; each output line is an event without its newline."""
    done, sink = await run(shell, {"cmd": "echo out1; echo err1 >&2; printf 'out2\\r\\n'"})
    assert done.outcome == "succeeded" and done.result == {"exit_code": 0}
    assert [(k, d) for k, d, _ in sink.events if k == "stdout"] == [("stdout", "out1"), ("stdout", "out2")]
    assert [(k, d) for k, d, _ in sink.events if k == "stderr"] == [("stderr", "err1")]


async def test_shell_list_command_with_env_and_cwd(tmp_path: Any) -> None:
    """A list command runs as is, with env added to the worker's environment and cwd applied."""
    done, sink = await run(
        shell,
        {
            "cmd": ["/bin/sh", "-c", 'echo "$FLEETWIRE_TEST_VAR"; pwd; test -n "$PATH"'],
            "cwd": str(tmp_path),
            "env": {"FLEETWIRE_TEST_VAR": "hello"},
        },
    )
    assert done.outcome == "succeeded", done
    assert [d for k, d, _ in sink.events if k == "stdout"] == ["hello", str(tmp_path)]


async def test_shell_nonzero_exit_fails_with_status() -> None:
    """A non-zero exit status fails the plan with handler_error naming the status."""
    done, _ = await run(shell, {"cmd": "exit 3"})
    assert done.outcome == "failed" and done.error is not None
    assert done.error.code == "handler_error"
    assert done.error.message == "command exited with status 3"


async def test_shell_is_offered_only_when_allowed() -> None:
    """The shell op is absent from the built-ins unless allow_shell is set."""
    assert "shell" not in builtin_handlers()
    assert builtin_handlers(allow_shell=True)["shell"] is shell
    assert set(builtin_handlers()) == {"echo", "sleep", "fleetwire.copy"}


async def test_shell_cancel_kills_the_process_group() -> None:
    """Cancelling a shell plan SIGTERMs its whole process group, grandchildren included."""
    ctx, sink = make_ctx()
    task = asyncio.create_task(run_handler(shell, ctx, {"cmd": "sleep 60 & echo $!; wait"}))
    await sink.wait_for(lambda events: any(k == "stdout" for k, _, _ in events))
    grandchild = int(sink.events[0][1])
    assert not gone(grandchild)
    task.cancel()
    done = await task
    assert done.outcome == "cancelled"
    assert ctx.cancelled
    await wait_gone(grandchild)


async def test_shell_cancel_escalates_to_sigkill_after_grace() -> None:
    """A command that ignores SIGTERM is SIGKILLed once kill_grace_s has passed."""
    ctx, sink = make_ctx(kill_grace_s=0.3)
    task = asyncio.create_task(run_handler(shell, ctx, {"cmd": "trap '' TERM; sleep 60 & echo $!; wait; wait"}))
    await sink.wait_for(lambda events: any(k == "stdout" for k, _, _ in events))
    grandchild = int(sink.events[0][1])
    started = time.monotonic()
    task.cancel()
    done = await task
    assert done.outcome == "cancelled"
    assert time.monotonic() - started >= 0.25  # the grace (0.3 s), less timer slack
    await wait_gone(grandchild)


async def test_shell_cancelled_while_its_process_starts_stops_what_it_started(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A cancel that lands while asyncio starts the command (its last pipe connected, its background sleep started,
    create_subprocess_exec not yet returned) stops the command's group: asyncio alone SIGKILLed the shell's pid and
    the sleep ran on."""
    pid_file = tmp_path / "pid"
    ctx, _ = make_ctx(kill_grace_s=1.0)
    plan: list[asyncio.Task[protocol.Done]] = []
    act_as_the_start_ends(monkeypatch, pid_file, lambda: plan[0].cancel())
    plan.append(asyncio.create_task(run_handler(shell, ctx, {"cmd": f"sleep 60 & echo $! > {pid_file}; wait"})))
    assert (await plan[0]).outcome == "cancelled"
    sleep_pid = int(pid_file.read_text())
    try:
        await wait_gone(sleep_pid)
    finally:
        with contextlib.suppress(ProcessLookupError):  # without the fix the sleep runs on: not past the test
            os.kill(sleep_pid, signal.SIGKILL)


async def wait_gone(pid: int, timeout_s: float = 5.0) -> None:
    """Wait for a (possibly reparented) process to exit, through a pidfd that polls readable (no polling loop)."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return
    loop = asyncio.get_running_loop()
    exited = loop.create_future()
    loop.add_reader(fd, lambda: exited.done() or exited.set_result(None))
    try:
        async with asyncio.timeout(timeout_s):
            await exited
    finally:
        loop.remove_reader(fd)
        os.close(fd)
    assert gone(pid)


async def test_shell_timeout_fails_and_kills() -> None:
    """A shell plan past its timeout fails with code timeout and its process is gone."""
    ctx, sink = make_ctx()
    done = await run_handler(shell, ctx, {"cmd": "echo $$; exec sleep 60"}, timeout_s=0.5)
    assert done.outcome == "failed" and done.error is not None and done.error.code == "timeout"
    await wait_gone(int(sink.events[0][1]))


# --------------------------------------------------------------------------- outcomes


async def test_timeout_fails_with_code_timeout() -> None:
    """A handler still running at timeout_s fails the plan with code timeout."""

    async def forever(ctx: Context, args: Any) -> None:
        await asyncio.Event().wait()

    done, _ = await run(forever, timeout_s=0.05)
    assert done.outcome == "failed" and done.error is not None
    assert done.error.code == "timeout" and "0.05" in done.error.message


async def test_handler_exception_becomes_handler_error_without_traceback() -> None:
    """An exception fails the plan with '<Type>: <msg>'; the traceback is only logged locally."""

    def broken(ctx: Context, args: Any) -> None:
        raise ValueError("boom")

    with capture_logs() as logs:
        done, _ = await run(broken)
    assert done.error == protocol.ErrorInfo(code="handler_error", message="ValueError: boom")
    assert any(entry["event"] == "handler raised" and entry.get("plan_id") == "p1" for entry in logs)


async def test_handler_own_timeout_error_is_a_handler_error() -> None:
    """A TimeoutError raised by the handler itself is not mistaken for the plan's timeout."""

    async def flaky(ctx: Context, args: Any) -> None:
        raise TimeoutError("upstream took too long")

    done, _ = await run(flaky, timeout_s=10)
    assert done.error is not None and done.error.code == "handler_error"


async def test_handler_error_carries_its_code_and_detail() -> None:
    """HandlerError lets a handler choose the failure code and detail."""

    async def refuses(ctx: Context, args: Any) -> None:
        raise HandlerError("invalid_argument", "need a prompt", {"field": "prompt"})

    done, _ = await run(refuses)
    expected = protocol.ErrorInfo(code="invalid_argument", message="need a prompt", detail={"field": "prompt"})
    assert done.error == expected


async def test_system_exit_in_handler_does_not_stop_the_worker() -> None:
    """sys.exit() in a sync handler fails the plan instead of ending the worker."""

    def exits(ctx: Context, args: Any) -> None:
        raise SystemExit(4)

    with capture_logs():
        done, _ = await run(exits)
    assert done.error == protocol.ErrorInfo(code="handler_error", message="SystemExit: 4")


async def test_unencodable_result_fails_the_plan() -> None:
    """A result msgpack cannot encode fails the plan with handler_error, not the session."""

    async def returns_object(ctx: Context, args: Any) -> object:
        return object()

    with capture_logs():
        done, _ = await run(returns_object)
    assert done.error is not None and done.error.code == "handler_error" and "encodable" in done.error.message


async def test_emit_refuses_reserved_kinds_and_unencodable_data() -> None:
    """Lifecycle kinds belong to the coordinator; data must encode: both raise in the handler."""
    ctx, sink = make_ctx()
    with pytest.raises(ValueError, match="reserved"):
        ctx.emit("succeeded", {})
    with pytest.raises(TypeError, match=r"^data of event 'token' is not msgpack-encodable"):
        ctx.emit("token", {"x": object()})
    with pytest.raises(ValueError, match=r"^data of event 'big' is \d+ bytes encoded; the limit is"):
        ctx.emit("big", b"x" * (ctx.max_payload_bytes + 1))
    assert sink.events == []


async def test_sync_handler_runs_off_the_loop_and_emits_from_its_thread() -> None:
    """A sync handler runs in a thread (the loop stays free) and its events arrive in order."""
    loop_thread = threading.get_ident()
    gate = threading.Event()

    def blocking(ctx: Context, args: Any) -> int:
        ctx.emit("started")
        if not gate.wait(5):  # would deadlock (and time out) if run on the loop
            raise RuntimeError("the loop never opened the gate")
        ctx.emit("finished", 1)
        return threading.get_ident()

    ctx, sink = make_ctx()
    task = asyncio.create_task(run_handler(blocking, ctx, None))
    await sink.wait_for(lambda events: bool(events))
    gate.set()
    done = await task
    assert done.outcome == "succeeded" and done.result != loop_thread
    assert sink.events == [("started", None, False), ("finished", 1, False)]


async def test_a_handlers_kind_is_asked_once_and_kept() -> None:
    """Whether a handler is async is asked of inspect once per handler, not once per plan (issue #29)."""
    from worker_agent import handlers

    async def fresh(ctx: Context, args: Any) -> Any:
        return args

    assert fresh not in handlers._async_known
    for i in range(3):
        ctx, _ = make_ctx(i)
        assert (await run_handler(fresh, ctx, i)).result == i
    assert handlers._async_known[fresh] is True


async def test_unhashable_and_coroutine_returning_handlers_still_run() -> None:
    """An unhashable async callable is asked every time and runs; a sync one returning a coroutine is awaited."""

    class Unhashable:
        __hash__ = None  # type: ignore[assignment]

        async def __call__(self, ctx: Context, args: Any) -> Any:
            return [args]

    async def later(args: Any) -> Any:
        return {"later": args}

    def sync_returning_coroutine(ctx: Context, args: Any) -> Any:
        return later(args)

    ctx, _ = make_ctx(1)
    assert (await run_handler(Unhashable(), ctx, 1)).result == [1]
    ctx, _ = make_ctx(2)
    assert (await run_handler(sync_returning_coroutine, ctx, 2)).result == {"later": 2}


async def test_cancel_of_sync_handler_reports_cancelled_and_sets_flag() -> None:
    """Cancelling a sync handler reports cancelled at once; the thread sees ctx.cancelled."""
    saw_cancel = threading.Event()

    def polls(ctx: Context, args: Any) -> None:
        ctx.emit("started")
        deadline = time.monotonic() + 5
        while not ctx.cancelled and time.monotonic() < deadline:
            time.sleep(0.01)
        if ctx.cancelled:
            saw_cancel.set()

    ctx, sink = make_ctx()
    task = asyncio.create_task(run_handler(polls, ctx, None))
    await sink.wait_for(lambda events: bool(events))
    task.cancel()
    assert (await task).outcome == "cancelled"
    assert await asyncio.to_thread(saw_cancel.wait, 5)


# --------------------------------------------------------------------------- python op


async def test_python_op_refuses_functions_outside_the_allow_list() -> None:
    """A function not matching any allow-list pattern fails with a message naming the patterns."""
    python = make_python_handler(["math:*"])
    done, _ = await run(python, {"function": "os:system", "args": ["true"]})
    assert done.outcome == "failed" and done.error is not None
    assert done.error.code == "invalid_argument"
    assert "'os:system' is not allowed" in done.error.message and "'math:*'" in done.error.message


async def test_python_op_is_offered_only_with_an_allow_list() -> None:
    """No allow-list, no python op."""
    assert "python" not in builtin_handlers()
    assert "python" in builtin_handlers(python_allow=["math:*"])


async def test_python_op_passes_ctx_and_runs_sync_functions_off_the_loop() -> None:
    """A sync function with a ctx parameter gets the Context and runs in a thread."""
    python = make_python_handler([f"{__name__}:*"])
    done, sink = await run(python, {"function": f"{__name__}:scaled", "args": [21], "kwargs": {"factor": 2}})
    assert done.outcome == "succeeded", done
    assert done.result["value"] == 42 and done.result["thread"] != threading.get_ident()
    assert sink.events == [("progress", {"fraction": 0.5, "message": "half way"}, True)]


async def test_python_op_awaits_coroutine_functions() -> None:
    """A coroutine function is awaited on the loop."""
    python = make_python_handler([f"{__name__}:async_*"])
    done, _ = await run(python, {"function": f"{__name__}:async_add", "args": [2, 3]})
    assert done.result == 5


async def test_python_op_reports_an_allowed_but_missing_function() -> None:
    """An allowed pattern naming a function that does not exist fails with invalid_argument."""
    python = make_python_handler(["math:*"])
    done, _ = await run(python, {"function": "math:no_such_function"})
    assert done.error is not None and done.error.code == "invalid_argument"
    assert "no attribute" in done.error.message


# --------------------------------------------------------------------------- handler specs


def test_load_handler_spec_parses_name_and_function() -> None:
    """'name=module:function' gives the op name and the imported callable."""
    assert load_handler_spec("dump=json:dumps") == ("dump", json.dumps)


@pytest.mark.parametrize(
    ("spec", "why"),
    [
        ("json:dumps", "expected 'name=module:function'"),
        ("=json:dumps", "expected 'name=module:function'"),
        ("dump=json", "not of the form 'module:function'"),
        ("dump=fleetwire_no_such_module:f", "cannot import module"),
        ("dump=json:no_such_function", "has no attribute"),
        ("dump=json:__name__", "not a callable"),
    ],
)
def test_load_handler_spec_rejects_bad_specs(spec: str, why: str) -> None:
    """A bad spec raises ValueError naming the spec and what is wrong."""
    with pytest.raises(ValueError, match="bad handler spec") as info:
        load_handler_spec(spec)
    assert repr(spec) in str(info.value) and why in str(info.value)
