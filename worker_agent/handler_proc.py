"""Custom handlers in a process of their own, one per device set, reused (``isolation="process"``).

A handler registered with ``@agent.handler("op", isolation="process")`` runs each plan in a child
interpreter (worker_agent/handler_child.py) started with ``CUDA_VISIBLE_DEVICES``,
``NVIDIA_VISIBLE_DEVICES`` and ``ROCR_VISIBLE_DEVICES`` naming only the plan's devices (none for a
plan that holds none; worker_agent/isolation.py builds the environment, without the worker's
tokens, as the plan user when there is one), so torch or jax imported there see those devices only,
as ``cuda:0`` and up. Rules (docs/SEMANTICS.md §GPU resources):

* **Which handlers.** ``isolation="process"``: always, on any worker. ``"auto"`` (the default):
  on a worker that has devices, when the handler is a function defined at the top level of an
  importable module (not a lambda, a closure, a bound method or a worker script's ``__main__``);
  others run in the worker's process as before, seeing ``ctx.devices`` only as data.
  ``"inline"``: never.
* **Reuse.** A child runs one plan at a time; when the plan ends normally it waits for the next plan
  of the same device set (the imports and whatever the handler cached at module level stay warm).
  At most :data:`MAX_IDLE` idle children are kept, the oldest stopped first. A cancel or a timeout
  stops the child's process group (SIGTERM, SIGKILL after ``ctx.kill_grace_s``); a child that dies
  fails its plan ``handler_error`` naming how it ended.
* **Bridged.** ``ctx.emit``, ``ctx.progress``, ``ctx.report_tokens``, ``ctx.output``, ``ctx.inputs``
  (the spool's files by path), ``ctx.devices``, ``ctx.cancelled``, ``ctx.traceparent`` and the args
  as the in-process ``Context`` has them; a ``HandlerError`` keeps its code; the result must be
  msgpack-encodable.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import struct
import sys
import tempfile
import types
from collections import OrderedDict
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Final, Literal

import msgspec

from protocol import errors
from worker_agent.handlers import RESERVED_EVENT_KINDS, Context, Handler, HandlerError, call_handler
from worker_agent.pyproc import FunctionFailed, read_report, stop_process_group

__all__ = ["CHILD_SCRIPT", "MAX_IDLE", "HandlerProcesses", "Isolation", "handler_target", "isolate"]

Isolation = Literal["auto", "process", "inline"]

#: The child's script, run as a file (worker_agent/pychild.py explains why not ``-m``).
CHILD_SCRIPT: Final = str(Path(__file__).with_name("handler_child.py"))
MAX_IDLE: Final = 8  # idle children kept for reuse, all device sets together
_HEADER: Final = struct.Struct(">I")


def handler_target(fn: Any) -> str | None:
    """``module:qualname`` a child can import ``fn`` by (``__main__`` included); None when it cannot."""
    if not isinstance(fn, types.FunctionType):
        return None
    name, qualname, module_name = fn.__name__, fn.__qualname__, fn.__module__
    if "<" in qualname or "." in qualname:
        return None
    module = sys.modules.get(module_name)
    if module is None or getattr(module, name, None) is not fn:
        return None
    if module_name == "__main__" and not getattr(module, "__file__", None):
        return None
    return f"{module_name}:{qualname}"


def isolate(fn: Handler, isolation: Isolation, processes: HandlerProcesses) -> Handler:
    """``fn`` as the runner calls it under ``isolation`` (module docstring): itself, or a handler that runs
    it in a child of the plan's device set.

    Raises:
        ValueError: ``isolation="process"`` for a handler a child cannot import, or an unknown isolation.
    """
    if isolation not in ("auto", "process", "inline"):
        raise ValueError(f"isolation must be 'auto', 'process' or 'inline', got {isolation!r}")
    if isolation == "inline":
        return fn
    target = handler_target(fn)
    if target is None:
        if isolation == "process":
            raise ValueError(f"isolation='process' needs a function defined at the top level of a module (its child "
                             f"process imports it by name); {fn!r} is not one")  # fmt: skip
        return fn

    async def in_process(ctx: Context, args: Any) -> Any:
        if isolation == "auto" and ctx.cuda_visible_devices is None:  # a worker without devices: as before
            return await call_handler(fn, ctx, args)
        try:
            return await processes.run(ctx, target, RESERVED_EVENT_KINDS)
        except FunctionFailed as exc:
            raise HandlerError(exc.code, exc.message, exc.detail) from None

    in_process.__name__ = in_process.__qualname__ = getattr(fn, "__name__", "handler")
    in_process.__wrapped__ = fn  # type: ignore[attr-defined]
    return in_process


class _Child:
    __slots__ = ("proc", "visible")

    def __init__(self, proc: asyncio.subprocess.Process, visible: str) -> None:
        self.proc = proc
        self.visible = visible


class HandlerProcesses:
    """The worker's handler children, by device set (module docstring).

    Attributes:
        started: children started so far (reuse keeps it at one per device set in a steady flow).
    """

    def __init__(self, max_idle: int = MAX_IDLE) -> None:
        self.max_idle = max_idle
        self.started = 0
        self._idle: OrderedDict[int, _Child] = OrderedDict()  # pid -> an idle child, oldest first

    async def run(self, ctx: Any, target: str, reserved_kinds: Iterable[str]) -> Any:
        """Run ``ctx``'s plan with the handler ``target`` in a child of its device set; its result.

        Raises:
            FunctionFailed: the handler raised (``handler_error``, or its ``HandlerError``'s code) or its
                process died without a result.
        """
        isolation = ctx.isolation
        if ctx.data is not None:
            work, temporary = ctx.data.work_dir, False
            isolation.open_to_plan(work.parent)
        else:
            work, temporary = Path(await asyncio.to_thread(tempfile.mkdtemp, prefix="fleetwire-plan-")), True
        try:
            isolation.hand_over(work)
            start = await self._start_frame(ctx, target, reserved_kinds, work)
            visible = ctx.cuda_visible_devices if ctx.cuda_visible_devices is not None else ""
            child = self._take(visible) or await self._spawn(ctx, visible)
            return await self._run_on(child, ctx, start)
        finally:
            if temporary:
                await asyncio.to_thread(shutil.rmtree, work, True)

    async def close(self) -> None:
        """Stop the idle children."""
        idle, self._idle = list(self._idle.values()), OrderedDict()
        for child in idle:
            await _stop(child, 1.0)

    async def _start_frame(self, ctx: Any, target: str, reserved_kinds: Iterable[str], work: Path) -> bytes:
        inputs: dict[str, dict[str, Any]] = {}
        if ctx.data is not None:
            for name, reader in ctx.inputs.items():
                path = await asyncio.to_thread(getattr, reader, "path")
                ctx.isolation.hand_over(path)
                inputs[name] = {"path": str(path), "size": reader.size, "digest": reader.digest}
        main = sys.modules.get("__main__")
        body = msgspec.msgpack.encode({
            "handler": target, "op_args": ctx.args, "plan_id": ctx.plan_id, "attempt": ctx.attempt,
            "worker_id": ctx.worker_id, "devices": list(ctx.devices), "kill_grace_s": ctx.kill_grace_s,
            "max_payload_bytes": ctx.max_payload_bytes, "reserved_kinds": sorted(reserved_kinds),
            "has_data": ctx.data is not None, "inputs": inputs, "output_dir": None, "cwd": str(work),
            "traceparent": ctx.traceparent, "main_file": getattr(main, "__file__", None),
        })  # fmt: skip
        return _HEADER.pack(len(body)) + body

    def _take(self, visible: str) -> _Child | None:
        for pid, child in self._idle.items():
            if child.visible == visible and child.proc.returncode is None:
                del self._idle[pid]
                return child
        return None

    async def _spawn(self, ctx: Any, visible: str) -> _Child:
        isolation = ctx.isolation
        env = isolation.environment(visible if ctx.cuda_visible_devices is not None else None,
                                    {"FLEETWIRE_SYS_PATH": _import_path()})  # fmt: skip
        try:
            with isolation.spawn([sys.executable, "-P", CHILD_SCRIPT], env) as (command, spawn_env, fds):
                proc = await asyncio.create_subprocess_exec(
                    *command, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=None,
                    env=spawn_env, pass_fds=fds, cwd=tempfile.gettempdir(), start_new_session=True,
                )  # fmt: skip
        except OSError as exc:
            raise FunctionFailed(errors.HANDLER_ERROR, f"cannot start the handler's process: {exc.strerror or exc}") \
                from None  # fmt: skip
        self.started += 1
        return _Child(proc, visible)

    async def _run_on(self, child: _Child, ctx: Any, start: bytes) -> Any:
        proc = child.proc
        assert proc.stdin is not None and proc.stdout is not None
        try:
            proc.stdin.write(start)
            with contextlib.suppress(ConnectionError):
                await proc.stdin.drain()
            outcome = await _read_reports(ctx, proc.stdout)
        except BaseException:
            await asyncio.shield(_stop(child, ctx.kill_grace_s))  # cancel or timeout: this child goes
            raise
        if outcome is None:
            await _stop(child, ctx.kill_grace_s)
            code = proc.returncode if proc.returncode is not None else -signal.SIGKILL
            raise FunctionFailed(errors.HANDLER_ERROR, f"the handler's process {_ended(code)} without a result",
                                 {"exit_code": code})  # fmt: skip
        self._idle[proc.pid] = child
        while len(self._idle) > self.max_idle:
            _, oldest = self._idle.popitem(last=False)
            await _stop(oldest, 1.0)
        kind, *rest = outcome
        if kind == "result":
            return rest[0]
        if kind == "error":
            raise FunctionFailed(str(rest[0]), str(rest[1]), rest[2])
        ctx.log.warning("handler raised", error=str(rest[0]).partition(":")[0], exception=rest[1])
        raise FunctionFailed(errors.HANDLER_ERROR, str(rest[0]))


async def _read_reports(ctx: Any, stream: asyncio.StreamReader) -> list[Any] | None:
    """Deliver the child's events, tokens and outputs; its final frame (None: it ended without one)."""
    while True:
        frame = await read_report(stream, "the handler's process")
        if frame is None:
            return None
        kind = frame[0] if isinstance(frame, list) and frame else None
        if kind == "event":
            ctx.emit(frame[1], frame[2], ephemeral=bool(frame[3]))
        elif kind == "tokens":
            ctx.report_tokens(int(frame[1]))
        elif kind == "output":
            if frame[2] is None and ctx.isolation.plan_user is not None:  # a path only the plan user could name
                raise FunctionFailed(errors.HANDLER_ERROR, f"output {frame[1]!r}: a process-isolated handler on a "
                                     "worker with --plan-user leaves outputs as bytes, not paths")  # fmt: skip
            await asyncio.to_thread(ctx.output, frame[1], frame[2] if frame[2] is not None else frame[3])
        elif kind in ("result", "error", "raised"):
            return list(frame)
        else:
            raise FunctionFailed(errors.HANDLER_ERROR, f"the handler's process sent an unknown report {kind!r}")


async def _stop(child: _Child, grace_s: float) -> None:
    proc = child.proc
    if proc.stdin is not None and not proc.stdin.is_closing():
        proc.stdin.close()
    await stop_process_group(proc, grace_s)


def _import_path() -> str:
    cwd = os.getcwd()
    return os.pathsep.join(os.path.join(cwd, p) if not os.path.isabs(p) else p for p in sys.path)


def _ended(code: int) -> str:
    if code >= 0:
        return f"exited with status {code}"
    try:
        return f"was killed by signal {signal.Signals(-code).name}"
    except ValueError:
        return f"was killed by signal {-code}"
