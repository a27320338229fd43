"""Plan handlers: the ``Context`` a handler gets, the built-in ops, and running one plan.

Theory of operation (docs/SEMANTICS.md §Worker session, items 4-5):

* A handler is ``async def f(ctx, args)`` or ``def f(ctx, args)``; sync handlers run in a
  worker thread (``asyncio.to_thread``) so they never block the session's event loop.
  Its return value is the plan's result and must be msgpack-encodable.
* ``ctx.emit`` sends an event of the plan; it is callable from the loop and from any thread.
* ``run_handler`` turns whatever happens into exactly one ``done`` message: a result →
  ``succeeded``; ``HandlerError`` → ``failed`` with its code; any other exception → ``failed``
  with code ``handler_error`` and ``"<ExcType>: <message>"`` (the traceback is logged here,
  never sent); the plan's ``timeout_s`` passing → ``failed`` with code ``timeout``; the task
  being cancelled → ``cancelled``.
* Cancelling a handler cancels its task. Subprocesses started by the built-in ``shell`` op run
  in their own session (process group): they get SIGTERM, then SIGKILL after
  ``ctx.kill_grace_s``. A sync handler's thread cannot be stopped; it may poll ``ctx.cancelled``.
* Preempting a plan (docs/SEMANTICS.md §Preemption) sets ``ctx.preempted`` and sends SIGTERM to its
  processes (``shell`` commands, ``python`` plans in a process of their own) at once; past the
  grace the plan runner cancels it as above.
* What a plan's processes get of the worker (``shell`` commands, ``python`` plans run in a
  process of their own) is ``ctx.isolation``'s to say (worker_agent/isolation.py): an environment
  built from an allow-list (never the worker's tokens), their devices only, a scratch directory of
  their own as the working directory, and optionally another Unix user. Which functions the
  ``python`` op calls is worker_agent/pychild.py ``resolve_allowed``'s to say, in either process.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import importlib
import inspect
import os
import shutil
import signal
import tempfile
import threading
import traceback
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO, TypeVar

import msgspec
import structlog

import protocol
from protocol import errors
from protocol.tracecontext import UNSAMPLED, handler_traceparent
from wireio.spawn import started
from worker_agent.isolation import PlanIsolation
from worker_agent.pychild import allowed_target, resolve_allowed
from worker_agent.pyproc import FunctionFailed, run_in_process, stop_process_group
from worker_agent.spool_files import SpoolError, open_confined

if TYPE_CHECKING:
    from worker_agent.spool import PlanData
    from worker_agent.spool_files import InputReader

log = structlog.get_logger(__name__)

Handler = Callable[["Context", Any], Any]
"""``async def f(ctx, args) -> result`` or ``def f(ctx, args) -> result``."""

EventSink = Callable[[str, Any, bool], None]
"""Receives ``(kind, data, ephemeral)`` on the event loop thread."""

#: Event kinds the coordinator uses for lifecycle events; a worker must not emit them.
RESERVED_EVENT_KINDS = frozenset(
    {"queued", "waiting", "leased", "running", "requeued", "succeeded", "failed", "cancelled", "data_ready",
     "preempted"}
)

#: Largest event data or result, encoded, that a handler may produce (the agent sets its own).
DEFAULT_MAX_PAYLOAD_BYTES = (1 << 20) - 4096

#: How plans' processes are started when the runner says nothing else: the built environment, the worker's user.
DEFAULT_ISOLATION = PlanIsolation()

_payload_encoder = msgspec.msgpack.Encoder()


class HandlerError(Exception):
    """Raise from a handler to fail the plan with a specific wire ``code`` and ``detail``."""

    def __init__(self, code: str, message: str, detail: Any = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.detail = detail


class PayloadTooLarge(ValueError):
    """A payload over the frame's room; ``encoded`` is its msgpack encoding."""

    def __init__(self, message: str, encoded: bytes) -> None:
        super().__init__(message)
        self.encoded = encoded


def _check_payload(what: str, value: Any, limit: int, kind: str = "") -> None:
    """Raise TypeError/ValueError now, in the handler, rather than break a frame later.

    ``what`` names the value in the error; ``{kind!r}`` in it is filled in only then (not once per event).
    """
    try:
        encoded = _payload_encoder.encode(value)
    except (TypeError, ValueError, OverflowError) as exc:
        raise TypeError(f"{what.format(kind=kind)} is not msgpack-encodable: {exc}") from None
    if len(encoded) > limit:
        message = f"{what.format(kind=kind)} is {len(encoded)} bytes encoded; the limit is {limit}"
        raise PayloadTooLarge(message, encoded)


class Context:
    """What a handler knows about its plan, and how it reports progress.

    Build it on the event loop thread; ``emit`` and ``progress`` may then be called from the
    loop or from any other thread.

    Args:
        plan_id: the plan's id.
        attempt: the lease attempt number (fences stale work, see SEMANTICS §Plan lifecycle).
        worker_id: the id of the worker running it.
        args: the plan's arguments as submitted.
        sink: receives each event as ``(kind, data, ephemeral)``, always on the loop thread.
        kill_grace_s: seconds between SIGTERM and SIGKILL for subprocesses on cancel.
        max_payload_bytes: largest encoded event data a handler may emit.
    """

    # What most plans never change is the class's (one object per plan is on the hot path: each attribute stored
    # in ``__init__`` is work per plan); setting one gives that context its own.
    # A plain flag, not a threading.Event: reading or setting one attribute is atomic, which is all a polling sync
    # handler needs.
    _cancelled = False
    _preempted = False
    _closed = False
    _groups: set[int] | None = None  # process groups of the plan's processes (SIGTERM on preempt); None: none yet
    tokens = 0  # generated tokens the handler reported (report_tokens): energy per token
    # Keeps a result over max_payload_bytes (its msgpack) as the output ``__result__`` (the runner
    # sets it when the worker has a spool; docs/PROTOCOL.md §11 Relay); None: such a result fails.
    spill_result: Callable[[bytes], protocol.OutputSpec] | None = None
    # What ``shell`` sets CUDA_VISIBLE_DEVICES to (None: the worker has no devices, the environment is left
    # alone; "": the plan asked for none); ``devices`` and ``gpus`` below are the devices it holds.
    cuda_visible_devices: str | None = None
    # How this plan's processes start (environment, user): the worker's (the runner sets it).
    isolation = DEFAULT_ISOLATION
    # The plan's W3C trace context as a handler passes it on ("": not traced; docs/OPERATIONS.md §Tracing):
    # the handler span's when this worker traces, else the caller's. The inference handler sends it to the engine.
    # ``assigned_traceparent`` is the field behind the ``traceparent`` property: the runner stores an assign's value
    # there without the setter (at 1 % sampling 99 plans in 100 carry "00"); handlers read ``traceparent``.
    assigned_traceparent = ""

    @property
    def traceparent(self) -> str:
        """The caller's "no" without ids ("00"; the runner stores the wire's "0" as "00": protocol/tracecontext.py)
        reads as a fresh unsampled W3C context, drawn at the first read: a plan whose handler never reads it costs no
        ids."""
        text = self.assigned_traceparent
        if text == UNSAMPLED:
            text = self.assigned_traceparent = handler_traceparent(text)
        return text

    @traceparent.setter
    def traceparent(self, value: str) -> None:
        self.assigned_traceparent = value

    def __init__(
        self,
        *,
        plan_id: str,
        attempt: int,
        worker_id: str,
        args: Any,
        sink: EventSink,
        kill_grace_s: float = 5.0,
        max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES,
        loop: asyncio.AbstractEventLoop | None = None,
        data: PlanData | None = None,
    ) -> None:
        self.data = data
        self.plan_id = plan_id
        self.attempt = attempt
        self.worker_id = worker_id
        self.args = args
        self.kill_grace_s = kill_grace_s
        self.max_payload_bytes = max_payload_bytes
        self._sink = sink
        self._loop = loop or asyncio.get_running_loop()
        self._loop_thread = threading.get_ident()
        # The devices this plan holds (worker_agent/devices.py): their CUDA ids ("0", "MIG-...") and records.
        self.devices: list[str] = []
        self.gpus: list[protocol.GpuInfo] = []

    @functools.cached_property
    def log(self) -> Any:
        """A structlog logger bound to this plan's ids (built on first use: most plans never log)."""
        return log.bind(worker_id=self.worker_id, plan_id=self.plan_id, attempt=self.attempt)

    @property
    def inputs(self) -> Mapping[str, InputReader]:
        """The plan's inputs by name (worker_agent/spool_files.py ``InputReader``): ``.size``, ``.digest``,
        ``.read(n)``, ``async for chunk in ...``, ``.path``. Verified before the handler starts."""
        return self.data.inputs if self.data is not None else {}

    def output(self, name: str, value: bytes | memoryview | str | os.PathLike[str] | BinaryIO) -> protocol.OutputSpec:
        """Leave an output (bytes, or a file to copy: a path or an open file) for the client to fetch
        with ``plan.output(name)``.

        Callable from the handler's task or thread. A file is copied and hashed here: from an async
        handler, call it through ``asyncio.to_thread`` for large files.

        Raises:
            ValueError: a bad name; RuntimeError: the worker has no data endpoint (``--data-listen``);
            SpoolError: the worker's disk is full (the plan fails ``worker_disk_full``).
        """
        if self.data is None:
            raise RuntimeError(f"worker {self.worker_id} has no data endpoint (--data-listen): it cannot keep outputs")
        return self.data.output(name, value)

    @property
    def cancelled(self) -> bool:
        """True once the plan was cancelled or timed out; sync handlers should poll it and return."""
        return self._cancelled

    @property
    def preempted(self) -> bool:
        """True once the plan was preempted (docs/SEMANTICS.md §Preemption): another plan needs its slot, or
        this host is going away. Save a checkpoint and end (raise, or return if the work is done) within the
        grace; past it the plan is cancelled. Its processes got SIGTERM. Sync handlers poll it."""
        return self._preempted

    def mark_preempted(self) -> None:
        """The plan is preempted: ``preempted`` turns true and its processes get SIGTERM. Called by the
        plan runner, not by handlers."""
        self._preempted = True
        for group in list(self._groups or ()):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(group, signal.SIGTERM)

    def add_process(self, pid: int) -> None:
        """A process of the plan started in its own session (``pid`` leads its group): a preempt SIGTERMs it.
        One started after the preempt gets it at once."""
        if self._groups is None:
            self._groups = set()
        self._groups.add(pid)
        if self._preempted:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGTERM)

    def remove_process(self, pid: int) -> None:
        """The process (group) ``pid`` ended."""
        if self._groups is not None:
            self._groups.discard(pid)

    def emit(self, kind: str, data: Any = None, *, ephemeral: bool = False) -> None:
        """Send an event of this plan. Thread-safe.

        Args:
            kind: a name of the handler's choosing, not one of ``RESERVED_EVENT_KINDS``.
            data: any msgpack-encodable value.
            ephemeral: high-rate events (progress, tokens) the coordinator may drop from replay.

        Raises:
            ValueError: a reserved or empty kind, or data above the size limit.
            TypeError: data that msgpack cannot encode.
        """
        if not isinstance(kind, str) or not kind:
            raise ValueError(f"event kind must be a non-empty string, got {kind!r}")
        if kind in RESERVED_EVENT_KINDS:
            raise ValueError(f"event kind {kind!r} is reserved for the coordinator's lifecycle events")
        if data is not None:
            _check_payload("data of event {kind!r}", data, self.max_payload_bytes, kind)
        if self._closed:
            return
        if threading.get_ident() == self._loop_thread:
            self._sink(kind, data, ephemeral)  # as _deliver: the plan has not ended (tested above)
        else:
            # A thread that outlives its loop (the worker is exiting) has nowhere to send to.
            with contextlib.suppress(RuntimeError):
                self._loop.call_soon_threadsafe(self._deliver, kind, data, ephemeral)

    def progress(self, fraction: float, message: str = "") -> None:
        """Emit an ephemeral ``progress`` event; ``fraction`` is clamped to [0, 1]. Thread-safe."""
        value = min(1.0, max(0.0, float(fraction)))
        self.emit("progress", {"fraction": value, "message": message}, ephemeral=True)

    def _deliver(self, kind: str, data: Any, ephemeral: bool) -> None:
        if not self._closed:  # events racing the plan's end (from a thread) are dropped
            self._sink(kind, data, ephemeral)

    def report_tokens(self, count: int) -> None:
        """Count ``count`` more generated tokens for this plan; the agent divides the plan's
        measured GPU energy by them (worker_agent/energy.py). Call it from the handler's own
        thread or task only: the count is a plain integer with a single writer."""
        if count > 0:
            self.tokens += count

    def mark_cancelled(self) -> None:
        """The plan is being cancelled or timed out: ``cancelled`` turns true. Called by whoever
        runs the plan (``run_handler``, the agent's plan runner), not by handlers."""
        self._cancelled = True

    def close(self) -> None:
        """The plan ended: later events (from a thread still running) are dropped. Called by
        whoever runs the plan (``run_handler``, the agent's plan runner), not by handlers.

        The sink and ``spill_result`` are let go: they are the runner's bound methods of the plan's
        run, which holds this context, and that cycle would wait for the daemon's rarely run oldest
        collection (fleetwire/cli/main.py), keeping every ended plan's context, task and inputs meanwhile."""
        self._closed = True
        self._cancelled = True
        self._sink = _dropped
        self.spill_result = None


def _dropped(kind: str, data: Any, ephemeral: bool) -> None:
    """The sink of a closed context: nothing more is sent for its plan."""


# --------------------------------------------------------------------------- running a plan


#: Whether each handler seen is async, asked once per handler rather than once per plan (``inspect`` makes several
#: calls of it); at most ``_ASYNC_KNOWN_MAX`` entries, so that handlers made per plan cannot grow it for ever.
_async_known: dict[Any, bool] = {}
_ASYNC_KNOWN_MAX = 1024

#: Types a handler's result has that are never awaitable: ``call_handler`` asks ``inspect.isawaitable`` of no other.
_NEVER_AWAITABLE = frozenset({type(None), bool, int, float, str, bytes, dict, list, tuple})


def _is_async_callable(fn: Any) -> bool:
    try:
        return _async_known[fn]
    except (KeyError, TypeError):  # TypeError: an unhashable callable, asked every time
        pass
    found = inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(getattr(fn, "__call__", None))  # noqa: B004  (async __call__ objects)
    if len(_async_known) < _ASYNC_KNOWN_MAX:
        with contextlib.suppress(TypeError):
            _async_known[fn] = found
    return found


#: The attribute :func:`on_loop` sets on a handler.
_ON_LOOP_MARK = "fleetwire_on_loop"

_H = TypeVar("_H", bound=Handler)


def on_loop(fn: _H) -> _H:
    """Mark a plain-function handler as one that runs on the event loop, in the step that reads its ``assign``.

    For handlers that return at once and never block (the built-in ``echo``): the plan gets no task and
    no thread, and it ends (``accept``, its events, ``done``) before the worker reads its next message. It
    cannot be cancelled, preempted or timed out while it runs (it has ended before any of those can come),
    and structlog's context is not bound to the plan's ids: log through ``ctx.log``. A plan with inputs
    or a sampled trace gets a task as any other, which calls it.

    Raises:
        TypeError: ``fn`` is an ``async def`` function (it would have to be awaited).
    """
    if inspect.iscoroutinefunction(fn):
        raise TypeError(f"on_loop is for plain functions; {fn!r} is async (an async handler runs on the loop anyway)")
    setattr(fn, _ON_LOOP_MARK, True)
    return fn


def runs_on_loop(fn: Any) -> bool:
    """Whether ``fn`` is a handler marked :func:`on_loop`."""
    return getattr(fn, _ON_LOOP_MARK, False) is True


async def call_handler(fn: Handler, ctx: Context, args: Any) -> Any:
    """Call a handler: await it if async, call it if it runs on the loop (:func:`on_loop`), else run it in a
    thread. Returns its result."""
    if _is_async_callable(fn):
        result = await fn(ctx, args)
    elif runs_on_loop(fn):
        result = fn(ctx, args)
    else:
        result = await asyncio.to_thread(fn, ctx, args)
    if type(result) not in _NEVER_AWAITABLE and inspect.isawaitable(result):  # a sync one that returned a coroutine
        result = await result
    return result


def _failed(ctx: Context, code: str, message: str, detail: Any = None) -> protocol.Done:
    return protocol.Done(
        plan_id=ctx.plan_id,
        attempt=ctx.attempt,
        outcome="failed",
        error=protocol.ErrorInfo(code=code, message=message, detail=detail),
    )


async def run_handler(fn: Handler, ctx: Context, args: Any, *, timeout_s: float | None = None) -> protocol.Done:
    """Run one plan's handler to the end and say how it ended, as the ``done`` to send.

    Never raises for anything the handler does; cancelling the calling task yields
    ``outcome="cancelled"``.
    """
    # No timeout, no timeout context: most plans have none and this runs once per plan.
    deadline = asyncio.timeout(timeout_s) if timeout_s is not None else None
    try:
        if deadline is None and _is_async_callable(fn):  # as call_handler, without its coroutine: the usual case
            result = await fn(ctx, args)
            if type(result) not in _NEVER_AWAITABLE and inspect.isawaitable(result):
                result = await result
        elif deadline is None:
            result = await call_handler(fn, ctx, args)
        else:
            async with deadline:
                result = await call_handler(fn, ctx, args)
        _check_payload("the result", result, ctx.max_payload_bytes)
    except asyncio.CancelledError:
        ctx.mark_cancelled()
        return protocol.Done(plan_id=ctx.plan_id, attempt=ctx.attempt, outcome="cancelled")
    except TimeoutError as exc:
        if deadline is None or not deadline.expired():
            return _handler_exception(ctx, exc)
        ctx.mark_cancelled()
        return _failed(ctx, errors.TIMEOUT, f"the plan did not finish within its timeout of {timeout_s:g} s")
    except (Exception, SystemExit) as exc:  # SystemExit from a handler must not stop the worker
        return _raised(ctx, exc)
    finally:
        ctx.close()
    return protocol.Done(plan_id=ctx.plan_id, attempt=ctx.attempt, outcome="succeeded", result=result)


def run_on_loop(fn: Handler, ctx: Context, args: Any) -> protocol.Done:
    """``run_handler`` for a handler that runs on the loop (:func:`on_loop`): called here, its ``done`` returned.

    Never raises for anything the handler does; the outcomes are ``run_handler``'s.
    """
    try:
        result = fn(ctx, args)
        _check_payload("the result", result, ctx.max_payload_bytes)
    except asyncio.CancelledError:
        ctx.mark_cancelled()
        return protocol.Done(plan_id=ctx.plan_id, attempt=ctx.attempt, outcome="cancelled")
    except (Exception, SystemExit) as exc:  # SystemExit from a handler must not stop the worker
        return _raised(ctx, exc)
    finally:
        ctx.close()
    return protocol.Done(plan_id=ctx.plan_id, attempt=ctx.attempt, outcome="succeeded", result=result)


def _raised(ctx: Context, exc: BaseException) -> protocol.Done:
    """The ``done`` of a handler that raised ``exc`` (not cancelled, not its deadline)."""
    if isinstance(exc, HandlerError):
        ctx.log.debug("handler failed", code=exc.code, message=exc.message)
        return _failed(ctx, exc.code, exc.message, exc.detail)
    if isinstance(exc, SpoolError):  # worker_disk_full while keeping an output
        return _failed(ctx, exc.code, exc.message)
    if isinstance(exc, PayloadTooLarge) and ctx.spill_result is not None:
        # A result over the frame limit goes to the data plane as ``__result__``.
        try:
            spec = ctx.spill_result(exc.encoded)
        except SpoolError as err:
            return _failed(ctx, err.code, err.message)
        return protocol.Done(plan_id=ctx.plan_id, attempt=ctx.attempt, outcome="succeeded", outputs=[spec])
    return _handler_exception(ctx, exc)


def _handler_exception(ctx: Context, exc: BaseException) -> protocol.Done:
    # A plain-text traceback, not exc_info: structlog's dict and rich tracebacks show every
    # frame's locals, and the handler's frames hold the plan's args (fleetwire/cli/logs.py).
    ctx.log.warning("handler raised", error=type(exc).__name__, exception="".join(traceback.format_exception(exc)))
    return _failed(ctx, errors.HANDLER_ERROR, f"{type(exc).__name__}: {exc}")


# --------------------------------------------------------------------------- built-in ops


@on_loop
def echo(ctx: Context, args: Any) -> Any:
    """Return ``args`` unchanged, after one ``echo`` event carrying them (on the loop: :func:`on_loop`)."""
    ctx.emit("echo", args)
    return args


async def copy_outputs(ctx: Context, args: Any) -> None:
    """``fleetwire.copy``: keep other plans' outputs here too, each input as the output of its name.

    The coordinator's copy plans of replicated outputs (``submit.replicas``; docs/SEMANTICS.md §Graphs)
    run it: their inputs are the outputs to copy, fetched from their holder as any referenced input.
    """
    for name, reader in ctx.inputs.items():
        await asyncio.to_thread(ctx.output, name, reader.path)


PROGRESS_INTERVAL_S = 1.0


async def sleep(ctx: Context, args: Any) -> dict[str, float]:
    """Sleep ``args["seconds"]``, with a ``progress`` event about once a second; preempted, it stops within a
    second (it has nothing to save)."""
    seconds = args.get("seconds") if isinstance(args, dict) else None
    if isinstance(seconds, bool) or not isinstance(seconds, int | float) or not seconds >= 0:
        raise HandlerError(errors.INVALID_ARGUMENT, f"sleep needs args {{'seconds': number >= 0}}, got {args!r}")
    loop = asyncio.get_running_loop()
    start = loop.time()
    end = start + seconds
    while (remaining := end - loop.time()) > 0:
        if ctx.preempted:
            raise HandlerError(errors.CANCELLED, f"preempted after {loop.time() - start:.1f} of {seconds:g} s")
        step = min(PROGRESS_INTERVAL_S, remaining)
        await asyncio.sleep(step)
        elapsed = loop.time() - start
        if step == PROGRESS_INTERVAL_S and elapsed < seconds:  # not after the last, partial step
            ctx.progress(elapsed / seconds, f"slept {elapsed:.1f} of {seconds:g} s")
    return {"slept_s": round(loop.time() - start, 6)}


async def _stream_lines(ctx: Context, stream: asyncio.StreamReader, kind: str) -> None:
    while True:
        try:
            line = await stream.readline()
        except ValueError:  # a line above the reader's limit: its start was discarded
            ctx.emit(kind, "[line too long; truncated]")
            continue
        if not line:
            return
        text = line.decode(errors="replace")
        if text.endswith("\n"):
            text = text[:-1]
            if text.endswith("\r"):
                text = text[:-1]
        ctx.emit(kind, text)


def _shell_command(args: Any) -> tuple[list[str], str | None, dict[str, str] | None]:
    usage = "shell needs args {'cmd': str or list[str], 'cwd': str or None, 'env': {str: str} or None}"
    if not isinstance(args, dict):
        raise HandlerError(errors.INVALID_ARGUMENT, f"{usage}, got {args!r}")
    cmd, cwd, env = args.get("cmd"), args.get("cwd"), args.get("env")
    if isinstance(cmd, str) and cmd:
        argv = ["/bin/sh", "-c", cmd]
    elif isinstance(cmd, list) and cmd and all(isinstance(part, str) for part in cmd):
        argv = list(cmd)
    else:
        raise HandlerError(errors.INVALID_ARGUMENT, f"{usage}; 'cmd' is {cmd!r}")
    if cwd is not None and not isinstance(cwd, str):
        raise HandlerError(errors.INVALID_ARGUMENT, f"{usage}; 'cwd' is {cwd!r}")
    if env is not None:
        if not isinstance(env, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items()):
            raise HandlerError(errors.INVALID_ARGUMENT, f"{usage}; 'env' is {env!r}")
    return argv, cwd, env  # env: added to the plan's environment (worker_agent/isolation.py), not the worker's


def input_env_name(name: str) -> str:
    """The environment variable holding an input's path for ``shell``: ``FLEETWIRE_INPUT_<NAME>``
    (upper case; every character but letters and digits becomes ``_``)."""
    return "FLEETWIRE_INPUT_" + "".join(c if c.isascii() and c.isalnum() else "_" for c in name).upper()


def _declared_outputs(args: dict[str, Any]) -> dict[str, str] | None:
    """``args["outputs"]``, checked: names to plain relative paths (no ``..``, nothing absolute)."""
    declared = args.get("outputs")
    if declared is None:
        return None
    if not (isinstance(declared, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in declared.items())):
        raise HandlerError(errors.INVALID_ARGUMENT, f"shell 'outputs' must map names to paths, got {declared!r}")
    for name, relative in declared.items():
        parts = relative.split("/")
        if relative.startswith("/") or any(part in ("", ".", "..") for part in parts):
            why = f"{relative!r} is not a plain path relative to $FLEETWIRE_OUTPUT_DIR (no '..', no leading '/')"
            raise HandlerError(errors.INVALID_ARGUMENT, f"declared output {name!r}: {why}")
    return declared


def _keep_output(ctx: Context, name: str, out_dir: Path, relative: str) -> None:
    """Keep ``out_dir/relative`` as output ``name``, read without following a link (spool_files.open_confined)."""
    try:
        file = open_confined(out_dir, relative, owner=ctx.isolation.owner)
    except FileNotFoundError:
        raise HandlerError(errors.HANDLER_ERROR, f"output {name!r}: the command made no file {relative!r}") from None
    except ValueError as exc:
        raise HandlerError(errors.HANDLER_ERROR, f"output {name!r} refused: {exc}") from None
    with file:
        ctx.output(name, file)


def _collect_outputs(ctx: Context, out_dir: Path, declared: dict[str, str] | None) -> None:
    """Keep the shell command's outputs: the declared ``{name: path}`` (relative to the output
    directory), or else every regular file directly in ``$FLEETWIRE_OUTPUT_DIR``. A symbolic link
    where an output is fails the plan, naming it: an output is never read through a link."""
    if declared:
        for name, relative in declared.items():
            _keep_output(ctx, name, out_dir, relative)
        return
    try:
        fd = os.open(out_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        why = f"the command replaced $FLEETWIRE_OUTPUT_DIR by a symbolic link or a file ({exc.strerror})"
        raise HandlerError(errors.HANDLER_ERROR, f"outputs refused: {why}") from None
    try:
        with os.scandir(fd) as entries:
            found = sorted((entry.name, entry.is_symlink(), entry.is_file(follow_symlinks=False)) for entry in entries)
    finally:
        os.close(fd)
    for name, link, regular in found:
        if link:
            raise HandlerError(errors.HANDLER_ERROR, f"output {name!r} refused: it is a symbolic link in "
                               "$FLEETWIRE_OUTPUT_DIR; outputs must be regular files")  # fmt: skip
        if regular:
            _keep_output(ctx, name, out_dir, name)


def _scratch(ctx: Context) -> tuple[Path, bool]:
    """The directory a plan's process starts in, handed to its user: the attempt's ``work/`` in the
    spool, or a new temporary one (True: remove it after)."""
    if ctx.data is not None:
        work = ctx.data.work_dir
        ctx.isolation.open_to_plan(work.parent)  # a plan user passes through the attempt's directory
        ctx.isolation.hand_over(work)
        return work, False
    work = Path(tempfile.mkdtemp(prefix="fleetwire-plan-"))
    ctx.isolation.hand_over(work)
    return work, True


async def _plan_files(ctx: Context, work: Path) -> tuple[dict[str, str], Path | None]:
    """The variables naming a plan's inputs and its output directory, and that directory (None: no data)."""
    if ctx.data is None:
        return {}, None
    env = {}
    for name, source in ctx.inputs.items():
        path = await asyncio.to_thread(getattr, source, "path")  # an in-memory input is written out once
        ctx.isolation.hand_over(path)
        env[input_env_name(name)] = str(path)
    out_dir = work / "outputs"
    with contextlib.suppress(FileExistsError):
        out_dir.mkdir(mode=0o700)
    ctx.isolation.hand_over(out_dir)
    env["FLEETWIRE_OUTPUT_DIR"] = str(out_dir)
    return env, out_dir


async def shell(ctx: Context, args: Any) -> dict[str, int]:
    """Run a command, streaming its output lines as ``stdout``/``stderr`` events.

    A string ``cmd`` runs through ``/bin/sh -c``; a list runs as is. Its environment is built
    (worker_agent/isolation.py: the worker's allowed variables, never its tokens), with ``env``
    added; it runs in ``cwd``, else in a scratch directory of its own, as the plan user when the
    worker has one. Exit status 0 → ``{"exit_code": 0}``; otherwise the plan fails with
    ``handler_error``. The command runs in a new session so cancel reaches its whole group.

    A plan with inputs or outputs (a worker with a data endpoint): each input's file path is in
    ``$FLEETWIRE_INPUT_<NAME>`` (:func:`input_env_name`) and ``$FLEETWIRE_OUTPUT_DIR`` is an empty
    directory (``outputs`` in the scratch directory); after exit 0 the files named by
    ``args["outputs"]`` (``{name: path}``, plain paths relative to that directory) become the
    plan's outputs, or, without ``outputs``, every file in it; none is read through a link.
    """
    argv, cwd, plan_env = _shell_command(args)
    declared = _declared_outputs(args)
    if declared and ctx.data is None:
        raise HandlerError(errors.INVALID_ARGUMENT, f"worker {ctx.worker_id} has no data endpoint for outputs")
    work, temporary = await asyncio.to_thread(_scratch, ctx)
    try:
        files, out_dir = await _plan_files(ctx, work)  # docs/SEMANTICS.md §Data plane
        # The plan's devices only, set last (docs/SEMANTICS.md §GPU resources): its own env cannot widen them.
        env = ctx.isolation.environment(ctx.cuda_visible_devices, {**(plan_env or {}), **files})
        return await _run_command(ctx, argv, cwd or str(work), env, out_dir, declared)
    finally:
        if temporary:
            await asyncio.to_thread(shutil.rmtree, work, True)


async def _run_command(ctx: Context, argv: list[str], cwd: str, env: dict[str, str], out_dir: Path | None,
                       declared: dict[str, str] | None) -> dict[str, int]:  # fmt: skip
    try:
        with ctx.isolation.spawn(argv, env) as (command, spawn_env, fds):  # as the plan user, if any
            start = asyncio.create_subprocess_exec(
                *command,
                cwd=cwd,
                env=spawn_env,
                pass_fds=fds,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                start_new_session=True,
                limit=1 << 20,
            )
            # A cancel or timeout while asyncio starts it stops its group too (asyncio alone would SIGKILL its pid
            # only, and what a script had started by then ran on: wireio/spawn.py).
            proc = await started(start, functools.partial(stop_process_group, grace_s=ctx.kill_grace_s))
    except OSError as exc:
        raise HandlerError(errors.HANDLER_ERROR, f"cannot start {argv[0]!r}: {exc.strerror or exc}") from None
    assert proc.stdout is not None and proc.stderr is not None
    ctx.add_process(proc.pid)  # a preempt SIGTERMs its group at once (docs/SEMANTICS.md §Preemption)
    readers = [
        asyncio.ensure_future(_stream_lines(ctx, proc.stdout, "stdout")),
        asyncio.ensure_future(_stream_lines(ctx, proc.stderr, "stderr")),
    ]
    try:
        await asyncio.gather(*readers)
        code = await proc.wait()
        ctx.remove_process(proc.pid)
    except BaseException:
        ctx.remove_process(proc.pid)
        # Cancel or timeout: stop the group even if this task is cancelled again meanwhile.
        stopping = asyncio.ensure_future(stop_process_group(proc, ctx.kill_grace_s))
        try:
            await asyncio.shield(stopping)
        finally:
            for reader in readers:
                reader.cancel()
        raise
    if code == 0:
        if out_dir is not None:
            await asyncio.to_thread(_collect_outputs, ctx, out_dir, declared)
        return {"exit_code": 0}
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = str(-code)
        raise HandlerError(errors.HANDLER_ERROR, f"command was killed by signal {name}", {"exit_code": code})
    raise HandlerError(errors.HANDLER_ERROR, f"command exited with status {code}", {"exit_code": code})


# --------------------------------------------------------------------------- python op and specs


def resolve_callable(target: str) -> Callable[..., Any]:
    """The callable named by ``"module:attr"`` (``attr`` may be dotted), imported.

    Raises:
        ValueError: a malformed target, a module that does not import, a missing or
            non-callable attribute; the message says which.
    """
    module_name, sep, attr_path = target.partition(":")
    if not sep or not module_name or not attr_path or ":" in attr_path:
        raise ValueError(f"{target!r} is not of the form 'module:function'")
    try:
        obj: Any = importlib.import_module(module_name)
    except Exception as exc:
        raise ValueError(f"cannot import module {module_name!r}: {type(exc).__name__}: {exc}") from None
    for part in attr_path.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise ValueError(f"module {module_name!r} has no attribute {attr_path!r}") from None
    if not callable(obj):
        raise ValueError(f"{target!r} is a {type(obj).__name__}, not a callable")
    return obj  # type: ignore[no-any-return]


def load_handler_spec(spec: str) -> tuple[str, Handler]:
    """Parse ``"name=module:function"`` into the op name and the imported handler.

    Raises:
        ValueError: with a message that names the spec and what is wrong with it.
    """
    name, sep, target = spec.partition("=")
    name = name.strip()
    if not sep or not name or not target.strip():
        raise ValueError(f"bad handler spec {spec!r}: expected 'name=module:function'")
    try:
        fn = resolve_callable(target.strip())
    except ValueError as exc:
        raise ValueError(f"bad handler spec {spec!r}: {exc}") from None
    return name, fn


def _accepts_ctx(fn: Callable[..., Any]) -> bool:
    return _accepts(fn, "ctx")


def _accepts(fn: Callable[..., Any], parameter: str) -> bool:
    try:
        return parameter in inspect.signature(fn).parameters
    except (TypeError, ValueError):  # builtins without a signature
        return False


def make_python_handler(allow: Sequence[str]) -> Handler:
    """The ``python`` op, limited to plain functions ``allow`` lets it call (worker_agent/pychild.py
    ``resolve_allowed``: the target and the function it resolves to must both match; attribute
    paths, built-ins, classes and re-exports from other modules are refused, naming the target).

    Args of the op: ``{"function": "module:function", "args": [...], "kwargs": {...}}``.
    A function with a ``ctx`` parameter gets the Context as that keyword, and one with an
    ``inputs`` parameter gets the plan's inputs (``{name: InputReader}``) as that keyword; it
    leaves outputs with ``ctx.output(name, bytes_or_path)``. Coroutine functions are awaited;
    others run in a thread. A plan that holds devices runs its function in its own process
    instead, started with ``CUDA_VISIBLE_DEVICES`` set to the plan's devices before anything is
    imported (worker_agent/pyproc.py): CUDA libraries there see those devices only, as ``cuda:0``
    and up; cancel and timeout stop that process. So does a plan holding no device on a worker
    that has devices (it sees none), and every plan on a worker with a plan user (it runs as that
    user). A function with a ``devices`` parameter gets the plan's devices (their CUDA ids,
    ``ctx.devices``) as that keyword.
    """
    patterns = tuple(allow)

    async def python(ctx: Context, args: Any) -> Any:
        usage = "python needs args {'function': 'module:function', 'args': [...], 'kwargs': {...}}"
        target = args.get("function") if isinstance(args, dict) else None
        if not isinstance(target, str):
            raise HandlerError(errors.INVALID_ARGUMENT, f"{usage}, got {args!r}")
        try:
            allowed_target(target, patterns, ctx.worker_id)  # before anything is imported or started
        except ValueError as exc:
            raise HandlerError(errors.INVALID_ARGUMENT, str(exc)) from None
        call_args = args.get("args") or []
        call_kwargs = args.get("kwargs") or {}
        if not isinstance(call_args, list) or not isinstance(call_kwargs, dict):
            raise HandlerError(errors.INVALID_ARGUMENT, f"{usage}; 'args' must be a list and 'kwargs' a map")
        if ctx.devices or ctx.cuda_visible_devices is not None or ctx.isolation.plan_user is not None:
            # Its own process: CUDA_VISIBLE_DEVICES set before any import, its user (worker_agent/pyproc.py).
            try:
                return await run_in_process(ctx, target, call_args, call_kwargs, reserved_kinds=RESERVED_EVENT_KINDS,
                                            allow=patterns)  # fmt: skip
            except FunctionFailed as exc:
                raise HandlerError(exc.code, exc.message, exc.detail) from None
        try:
            fn = await asyncio.to_thread(resolve_allowed, target, patterns, ctx.worker_id)  # imports can be slow
        except ValueError as exc:
            raise HandlerError(errors.INVALID_ARGUMENT, str(exc)) from None
        if _accepts_ctx(fn):
            call_kwargs = {**call_kwargs, "ctx": ctx}
        if ctx.data is not None and _accepts(fn, "inputs"):  # the plan's inputs, by name
            call_kwargs = {**call_kwargs, "inputs": ctx.inputs}
        if ctx.cuda_visible_devices is not None and _accepts(fn, "devices"):  # the plan's devices
            call_kwargs = {**call_kwargs, "devices": list(ctx.devices)}
        if _is_async_callable(fn):
            result = await fn(*call_args, **call_kwargs)
        else:
            result = await asyncio.to_thread(fn, *call_args, **call_kwargs)
        if inspect.isawaitable(result):
            result = await result
        return result

    return python


def builtin_handlers(*, allow_shell: bool = False, python_allow: Sequence[str] = ()) -> dict[str, Handler]:
    """The built-in ops this worker offers: ``echo``, ``sleep`` and ``fleetwire.copy`` (the coordinator's copies of
    replicated outputs) always, ``shell`` only when allowed, ``python`` only with a non-empty allow-list."""
    handlers: dict[str, Handler] = {"echo": echo, "sleep": sleep, protocol.messages.COPY_OP: copy_outputs}
    if allow_shell:
        handlers["shell"] = shell
    if python_allow:
        handlers["python"] = make_python_handler(python_allow)
    return handlers


__all__ = [
    "RESERVED_EVENT_KINDS",
    "Context",
    "Handler",
    "HandlerError",
    "builtin_handlers",
    "call_handler",
    "echo",
    "load_handler_spec",
    "make_python_handler",
    "on_loop",
    "resolve_callable",
    "run_handler",
    "run_on_loop",
    "runs_on_loop",
    "shell",
    "sleep",
]
