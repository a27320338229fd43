"""Run a ``python`` plan in its own process, with its own ``CUDA_VISIBLE_DEVICES`` (and user).

The ``python`` op (worker_agent/handlers.py) runs a function inside the worker's process, where
``CUDA_VISIBLE_DEVICES`` is one for all plans. On a worker with devices (``--gpus`` or NVML's) a
plan runs instead in a child interpreter started with ``CUDA_VISIBLE_DEVICES`` set to its devices
(none for a plan holding none) before anything is imported (worker_agent/pychild.py), so CUDA
libraries see that plan's devices only; so does every plan on a worker with a plan user
(``--plan-user``), as that user. The child's environment is built (worker_agent/isolation.py: no
token of the worker), it starts in the attempt's scratch directory (or a temporary one), and it
checks the function against the allow-list itself before calling it. Plans on a worker with
neither keep the in-process path: nothing here runs for them.

The child reports over a pipe (its fd 1; its prints go to the worker's stderr): events, token
counts and outputs as they come, then the result or the error. Cancelling the awaiting task (a
cancel, the plan's timeout, the worker leaving) SIGTERMs the child's process group, then
SIGKILLs it after ``ctx.kill_grace_s``. A child that dies without a result (a crash, the OOM
killer) fails the plan with ``handler_error`` naming its exit status.
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
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import msgspec

from protocol import errors
from worker_agent.spool_files import open_confined

__all__ = ["CHILD_SCRIPT", "FunctionFailed", "read_report", "run_in_process", "stop_process_group"]

#: The child's script, run as a file (worker_agent/pychild.py explains why not ``-m``).
CHILD_SCRIPT = str(Path(__file__).with_name("pychild.py"))

_HEADER = struct.Struct(">I")
_MAX_FRAME = 1 << 30  # a report frame larger than this is a broken child, not data


class FunctionFailed(Exception):
    """The function failed in its process: the plan fails with ``code`` (handlers.py makes it a ``HandlerError``)."""

    def __init__(self, code: str, message: str, detail: Any = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.detail = detail


async def run_in_process(
    ctx: Any, target: str, args: list[Any], kwargs: dict[str, Any], *, reserved_kinds: Iterable[str],
    allow: Sequence[str],
) -> Any:
    """Call ``target(*args, **kwargs)`` in a child with the plan's devices visible; return its result.

    ``ctx`` is the plan's ``Context`` (worker_agent/handlers.py): the child's events, tokens and
    outputs go through it. The child passes ``ctx``, ``inputs`` and ``devices`` to a function that
    takes them, as the in-process path does. ``allow``: the ``--python-allow`` patterns, which the
    child applies to what ``target`` resolves to (worker_agent/pychild.py ``resolve_allowed``).

    Raises:
        FunctionFailed: the function raised (``handler_error``, or the code of its ``HandlerError``),
            could not be imported (``invalid_argument``), or its process died without a result.
    """
    isolation = ctx.isolation
    if ctx.data is not None:
        work, temporary = ctx.data.work_dir, False
        isolation.open_to_plan(work.parent)  # a plan user passes through the attempt's directory
    else:
        work, temporary = Path(tempfile.mkdtemp(prefix="fleetwire-plan-")), True
    try:
        return await _run_child(ctx, target, args, kwargs, reserved_kinds, allow, work)
    finally:
        if temporary:
            await asyncio.to_thread(shutil.rmtree, work, True)


async def _run_child(ctx: Any, target: str, args: list[Any], kwargs: dict[str, Any], reserved_kinds: Iterable[str],
                     allow: Sequence[str], work: Path) -> Any:  # fmt: skip
    isolation = ctx.isolation
    isolation.hand_over(work)
    out_dir = None  # a plan user leaves its outputs here, for the worker to read back confined
    if isolation.plan_user is not None:
        out_dir = work / "outputs"
        with contextlib.suppress(FileExistsError):
            out_dir.mkdir(mode=0o700)
        isolation.hand_over(out_dir)
    inputs: dict[str, dict[str, Any]] = {}
    if ctx.data is not None:
        for name, reader in ctx.inputs.items():
            path = await asyncio.to_thread(getattr, reader, "path")  # materialised once, as ``shell`` does
            isolation.hand_over(path)
            inputs[name] = {"path": str(path), "size": reader.size, "digest": reader.digest}
    start = msgspec.msgpack.encode({
        "function": target, "args": args, "kwargs": kwargs, "op_args": ctx.args, "plan_id": ctx.plan_id,
        "attempt": ctx.attempt, "worker_id": ctx.worker_id, "devices": list(ctx.devices),
        "kill_grace_s": ctx.kill_grace_s, "max_payload_bytes": ctx.max_payload_bytes,
        "reserved_kinds": sorted(reserved_kinds), "has_data": ctx.data is not None, "inputs": inputs,
        "allow": list(allow), "output_dir": str(out_dir) if out_dir is not None else None,
    })  # fmt: skip
    visible = ctx.cuda_visible_devices if ctx.cuda_visible_devices is not None else ",".join(ctx.devices) or None
    env = isolation.environment(visible, {"FLEETWIRE_SYS_PATH": _import_path()})
    try:
        with isolation.spawn([sys.executable, "-P", CHILD_SCRIPT], env) as (command, spawn_env, fds):
            proc = await asyncio.create_subprocess_exec(
                *command, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=None,
                env=spawn_env, pass_fds=fds, cwd=work, start_new_session=True,
            )  # fmt: skip
    except OSError as exc:
        raise FunctionFailed(errors.HANDLER_ERROR, f"cannot start the plan's process: {exc.strerror or exc}") from None
    ctx.add_process(proc.pid)  # a preempt SIGTERMs it at once: its SystemExit runs the function's finally blocks
    try:
        assert proc.stdin is not None and proc.stdout is not None
        proc.stdin.write(start)
        with contextlib.suppress(ConnectionError):  # a child that died at once is reported below
            await proc.stdin.drain()
        proc.stdin.close()
        outcome = await _read_reports(ctx, proc.stdout, out_dir)
        if outcome is not None:  # it is done: let it exit, then sweep what it left behind (threads, children)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(proc.wait(), ctx.kill_grace_s)
        await stop_process_group(proc, ctx.kill_grace_s)
        code = proc.returncode if proc.returncode is not None else -signal.SIGKILL
    except BaseException:
        await asyncio.shield(stop_process_group(proc, ctx.kill_grace_s))  # cancel or timeout: the child goes too
        raise
    finally:
        ctx.remove_process(proc.pid)
    if outcome is None:
        hint = ""
        if code == 127 and isolation.plan_user is not None:  # the launcher could not execute the interpreter
            hint = (f" (as --plan-user {isolation.plan_user.name}, who must be able to run {sys.executable} and "
                    "read the worker's modules)")  # fmt: skip
        raise FunctionFailed(errors.HANDLER_ERROR, f"the plan's process {_ended(code)} without a result{hint}",
                             {"exit_code": code})  # fmt: skip
    kind, *rest = outcome
    if kind == "result":
        return rest[0]
    if kind == "error":
        raise FunctionFailed(str(rest[0]), str(rest[1]), rest[2])
    ctx.log.warning("handler raised", error=str(rest[0]).partition(":")[0], exception=rest[1])
    raise FunctionFailed(errors.HANDLER_ERROR, str(rest[0]))


async def read_report(stream: asyncio.StreamReader, who: str) -> Any:
    """A child's next report frame (length-prefixed msgpack), None once it ended; ``who`` names the child
    in the error a broken frame raises (worker_agent/handler_proc.py reads its children's with it too).

    Raises:
        FunctionFailed: a frame past 1 GiB or one that does not decode.
    """
    try:
        (size,) = _HEADER.unpack(await stream.readexactly(_HEADER.size))
        if size > _MAX_FRAME:
            raise FunctionFailed(errors.HANDLER_ERROR, f"{who} sent a {size}-byte report")
        return msgspec.msgpack.decode(await stream.readexactly(size))
    except asyncio.IncompleteReadError:
        return None
    except msgspec.DecodeError as exc:
        raise FunctionFailed(errors.HANDLER_ERROR, f"{who} sent an unreadable report: {exc}") from None


async def _read_reports(ctx: Any, stream: asyncio.StreamReader, out_dir: Path | None) -> list[Any] | None:
    """Deliver the child's events, tokens and outputs; return its final frame (None: it ended without one).

    ``out_dir``: the child runs as a plan user, and an output file is one it copied there, read back
    confined (worker_agent/spool_files.py ``open_confined``: no link, that user's own file); else a path
    the child names is copied as is (it runs as the worker's user: it could read it itself)."""
    while True:
        frame = await read_report(stream, "the plan's process")
        if frame is None:
            return None
        kind = frame[0] if isinstance(frame, list) and frame else None
        if kind == "event":
            ctx.emit(frame[1], frame[2], ephemeral=bool(frame[3]))
        elif kind == "tokens":
            ctx.report_tokens(int(frame[1]))
        elif kind == "output":
            if frame[2] is not None:
                await asyncio.to_thread(ctx.output, frame[1], frame[2])
            elif out_dir is None:
                await asyncio.to_thread(ctx.output, frame[1], frame[3])
            else:
                await asyncio.to_thread(_keep_confined, ctx, frame[1], out_dir, str(frame[3]))
        elif kind in ("result", "error", "raised"):
            return list(frame)
        else:
            raise FunctionFailed(errors.HANDLER_ERROR, f"the plan's process sent an unknown report {kind!r}")


def _import_path() -> str:
    """The worker's import path, its entries absolute (the child starts elsewhere): the same modules are found."""
    cwd = os.getcwd()
    return os.pathsep.join(os.path.join(cwd, p) if not os.path.isabs(p) else p for p in sys.path)


def _keep_confined(ctx: Any, name: str, out_dir: Path, relative: str) -> None:
    try:
        file = open_confined(out_dir, relative, owner=ctx.isolation.owner)
    except (OSError, ValueError) as exc:
        raise FunctionFailed(errors.HANDLER_ERROR, f"output {name!r} refused: {exc}") from None
    with file:
        ctx.output(name, file)


def _ended(code: int) -> str:
    if code >= 0:
        return f"exited with status {code}"
    try:
        return f"was killed by signal {signal.Signals(-code).name}"
    except ValueError:
        return f"was killed by signal {-code}"


def _signal_group(pid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)


async def stop_process_group(proc: asyncio.subprocess.Process, grace_s: float) -> None:
    """SIGTERM the process group, SIGKILL what is left after ``grace_s``, and reap the leader.

    Also sweeps grandchildren that ignored SIGTERM after the leader exited (the shell handler's
    commands and python plans in a child of their own both end this way).
    """
    if proc.returncode is None:
        _signal_group(proc.pid, signal.SIGTERM)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(proc.wait(), grace_s)
    _signal_group(proc.pid, signal.SIGKILL)
    await proc.wait()
