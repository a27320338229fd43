"""The child side of a ``python`` plan that holds devices: import the function, call it, report back.

worker_agent/pyproc.py starts this file as a script (``python .../pychild.py``, not ``-m``: the
``worker_agent`` package imports the whole agent, and a plan's process needs none of it) with
``CUDA_VISIBLE_DEVICES`` already set to the plan's devices, so whatever the function imports (torch,
jax, ...) sees those devices only, numbered from 0. It reads one start message (msgpack) on stdin,
moves its own stdout aside (the function's prints go to stderr; fd 1 at start is the report pipe),
and writes length-prefixed msgpack frames to that pipe:

* ``["event", kind, data, ephemeral]`` — ``ctx.emit``; ``["tokens", n]`` — ``ctx.report_tokens``;
* ``["output", name, bytes | None, path | None]`` — ``ctx.output`` (the worker keeps it; running
  as a plan user, a file is first copied into the output directory the start message names, and
  the path is its name there: the worker reads back only what this process's user could);
* then exactly one of ``["result", value]``, ``["error", code, message, detail]`` (a
  ``HandlerError``), ``["raised", "ExcType: message", traceback]``.

SIGTERM (a cancel or a timeout) sets ``ctx.cancelled`` and raises ``SystemExit`` in the main
thread, so ``finally`` blocks run; the worker sends SIGKILL after its kill grace.

Which functions a plan may call (:func:`resolve_allowed`, the one check of the ``python`` op, here so
this process and the worker's own, worker_agent/handlers.py, apply it alike): the target
``"module:function"`` is a dotted module path and one name, none of them starting with ``__``; it
matches a ``--python-allow`` pattern before anything is imported; then the object it names must be
a plain function (a ``def``, not a built-in, a class, a method or another callable) defined at the
top level of its module, and its own ``"__module__:__qualname__"`` must match a pattern too (or the
target be listed exactly). So ``mymod:os.system`` (an attribute walk), ``mymod:system`` (``os.system``
imported into ``mymod``: a built-in), ``mymod:run`` (``subprocess.run`` imported into ``mymod``:
defined in ``subprocess``) and ``mymod:Klass`` are all refused, naming the target.
"""

from __future__ import annotations

import asyncio
import fnmatch
import importlib
import inspect
import os
import re
import shutil
import signal
import struct
import sys
import threading
import traceback
import types
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any, BinaryIO

import msgspec

_HEADER = struct.Struct(">I")


class ReportPipe:
    """Frames to the worker (length-prefixed msgpack); any thread may write. worker_agent/handler_child.py
    uses it too."""

    def __init__(self, stream: BinaryIO) -> None:
        self._stream = stream
        self._lock = threading.Lock()
        self._encoder = msgspec.msgpack.Encoder()

    def send(self, *frame: Any) -> None:
        body = self._encoder.encode(list(frame))
        with self._lock:
            self._stream.write(_HEADER.pack(len(body)) + body)
            self._stream.flush()


class FileInput:
    """An input of the plan, read from the worker's spool file (``.path``, ``.read``, ``async for``)."""

    def __init__(self, name: str, path: str, size: int, digest: str) -> None:
        self.name, self.path, self.size, self.digest = name, path, size, digest
        self._file: BinaryIO | None = None

    def read(self, n: int = -1) -> bytes:
        """The next ``n`` bytes (all that is left with -1)."""
        if self._file is None:
            self._file = open(self.path, "rb")  # kept open across reads, closed by close()
        return self._file.read(n)

    def chunks(self, size: int = 1 << 20) -> Any:
        """The content from its start, ``size`` bytes at a time."""
        with open(self.path, "rb") as f:
            while chunk := f.read(size):
                yield chunk

    async def __aiter__(self) -> AsyncIterator[bytes]:
        for chunk in self.chunks():
            yield chunk

    def close(self) -> None:
        if self._file is not None:
            self._file.close()


class ProcessContext:
    """The ``ctx`` a function gets in its own process: the same names as the worker's ``Context``."""

    def __init__(self, start: dict[str, Any], pipe: ReportPipe) -> None:
        self.plan_id: str = start["plan_id"]
        self.attempt: int = start["attempt"]
        self.worker_id: str = start["worker_id"]
        self.args: Any = start["op_args"]
        self.kill_grace_s: float = start["kill_grace_s"]
        self.max_payload_bytes: int = start["max_payload_bytes"]
        self.devices: list[str] = list(start["devices"])
        self.cuda_visible_devices: str = ",".join(self.devices)
        self.tokens = 0
        self._reserved = frozenset(start["reserved_kinds"])
        self._has_data: bool = start["has_data"]
        self.inputs = {n: FileInput(n, i["path"], i["size"], i["digest"]) for n, i in start["inputs"].items()}
        self._pipe = pipe
        self._encoder = msgspec.msgpack.Encoder()
        self._cancelled = False
        self._output_dir: str | None = start.get("output_dir")
        self._copies = 0

    @property
    def cancelled(self) -> bool:
        """True once the worker asked this process to stop (cancel or timeout)."""
        return self._cancelled

    def emit(self, kind: str, data: Any = None, *, ephemeral: bool = False) -> None:
        """Send an event of this plan (checked here as the worker's ``Context.emit`` checks it)."""
        if not isinstance(kind, str) or not kind:
            raise ValueError(f"event kind must be a non-empty string, got {kind!r}")
        if kind in self._reserved:
            raise ValueError(f"event kind {kind!r} is reserved for the coordinator's lifecycle events")
        if data is not None:
            try:
                size = len(self._encoder.encode(data))
            except (TypeError, ValueError, OverflowError) as exc:
                raise TypeError(f"data of event {kind!r} is not msgpack-encodable: {exc}") from None
            if size > self.max_payload_bytes:
                limit = self.max_payload_bytes
                raise ValueError(f"data of event {kind!r} is {size} bytes encoded; the limit is {limit}")
        self._pipe.send("event", kind, data, ephemeral)

    def progress(self, fraction: float, message: str = "") -> None:
        """Emit an ephemeral ``progress`` event; ``fraction`` is clamped to [0, 1]."""
        self.emit("progress", {"fraction": min(1.0, max(0.0, float(fraction))), "message": message}, ephemeral=True)

    def report_tokens(self, count: int) -> None:
        """Count ``count`` more generated tokens for this plan (its receipt's energy per token)."""
        if count > 0:
            self.tokens += count
            self._pipe.send("tokens", count)

    def output(self, name: str, value: bytes | memoryview | str | os.PathLike[str]) -> None:
        """Leave an output: bytes, or a file the worker copies (it returns nothing here)."""
        if not self._has_data:
            raise RuntimeError(f"worker {self.worker_id} has no data endpoint (--data-listen): it cannot keep outputs")
        if isinstance(value, bytes | bytearray | memoryview):
            self._pipe.send("output", name, bytes(value), None)
        elif self._output_dir is not None:  # a plan user: the worker reads back a copy this user made
            self._copies += 1
            copy = f"output-{self._copies}"
            shutil.copyfile(os.fspath(value), os.path.join(self._output_dir, copy))
            self._pipe.send("output", name, None, copy)
        else:
            self._pipe.send("output", name, None, os.path.abspath(os.fspath(value)))


def _accepts(fn: Callable[..., Any], parameter: str) -> bool:
    try:
        return parameter in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def allowed_target(target: str, allow: Sequence[str], worker_id: str) -> tuple[str, str]:
    """The module and function a plan's ``"module:function"`` names, checked before anything is imported.

    Raises:
        ValueError: a malformed target (an attribute path, a ``__`` name) or one no pattern of
            ``allow`` matches; the message names the target and the patterns.
    """
    module_name, sep, name = target.partition(":")
    parts = module_name.split(".")
    if not sep or not _NAME.fullmatch(name) or not all(_NAME.fullmatch(part) for part in parts):
        raise ValueError(f"python function {target!r} is not of the form 'module:function' (a module path and one "
                         "function name: attribute paths are refused)")  # fmt: skip
    if any(part.startswith("__") for part in [*parts, name]):
        raise ValueError(f"python function {target!r} is refused: names starting with '__' are never called")
    if not any(fnmatch.fnmatchcase(target, pattern) for pattern in allow):
        allowed = ", ".join(repr(p) for p in allow) or "none"
        raise ValueError(f"python function {target!r} is not allowed on worker {worker_id}; "
                         f"allowed patterns: {allowed}")  # fmt: skip
    return module_name, name


def resolve_allowed(target: str, allow: Sequence[str], worker_id: str) -> Callable[..., Any]:
    """The plain function ``target`` names, imported, when the allow-list lets a plan call it.

    The target must pass :func:`allowed_target`; the object it resolves to must be a plain function
    defined at the top level of a module, whose own ``"__module__:__qualname__"`` matches a pattern
    of ``allow`` (or ``target`` is one of them, written out).

    Raises:
        ValueError: naming the target and why it is refused (or does not import, or does not exist).
    """
    module_name, name = allowed_target(target, allow, worker_id)
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:
        raise ValueError(f"cannot import module {module_name!r}: {type(exc).__name__}: {exc}") from None
    try:
        obj = getattr(module, name)
    except AttributeError:
        raise ValueError(f"module {module_name!r} has no attribute {name!r}") from None
    refused = _refusal(obj, target, allow)
    if refused is not None:
        raise ValueError(f"python function {target!r} is refused on worker {worker_id}: {refused}")
    return obj  # type: ignore[no-any-return]


def _refusal(obj: Any, target: str, allow: Sequence[str]) -> str | None:
    """Why ``obj`` may not run as ``target`` (None: it may)."""
    if not isinstance(obj, types.FunctionType):
        if isinstance(obj, types.BuiltinFunctionType):
            kind = f"a built-in function ({getattr(obj, '__module__', None) or '?'}.{obj.__qualname__})"
        elif isinstance(obj, type):
            kind = f"a class ({obj.__module__}.{obj.__qualname__})"
        elif isinstance(obj, types.ModuleType):
            kind = f"a module ({obj.__name__})"
        elif isinstance(obj, types.MethodType):
            kind = f"a bound method ({obj.__qualname__})"
        else:
            kind = f"a {type(obj).__name__} object"
        return f"it is {kind}, not a plain function defined in an allowed module"
    defined = f"{obj.__module__}:{obj.__qualname__}"
    if not _NAME.fullmatch(obj.__qualname__):
        return f"it is {defined}, defined inside a class or a function, not at the top level of a module"
    if target not in allow and not any(fnmatch.fnmatchcase(defined, pattern) for pattern in allow):
        return (f"it is {defined}, defined in a module the allow-list does not match (imported into "
                f"{target.partition(':')[0]!r}); allow {defined!r}, or list {target!r} exactly")
    return None


def _call(fn: Callable[..., Any], start: dict[str, Any], ctx: ProcessContext) -> Any:
    kwargs = dict(start["kwargs"])
    if _accepts(fn, "ctx"):
        kwargs["ctx"] = ctx
    if start["has_data"] and _accepts(fn, "inputs"):
        kwargs["inputs"] = ctx.inputs
    if _accepts(fn, "devices"):
        kwargs["devices"] = list(ctx.devices)
    result = fn(*start["args"], **kwargs)
    if inspect.isawaitable(result):
        result = asyncio.run(_await(result))
    return result


async def _await(awaitable: Any) -> Any:
    return await awaitable


def main() -> None:
    report = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # the function's prints go to the worker's stderr, never into the report pipe
    sys.stdout = sys.stderr
    pipe = ReportPipe(report)
    start = msgspec.msgpack.decode(sys.stdin.buffer.read())
    ctx = ProcessContext(start, pipe)

    def on_term(signum: int, frame: Any) -> None:
        ctx._cancelled = True
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, on_term)
    try:
        fn = resolve_allowed(start["function"], start["allow"], start["worker_id"])
    except ValueError as exc:
        pipe.send("error", "invalid_argument", str(exc), None)
        return
    try:
        result = _call(fn, start, ctx)
    except BaseException as exc:  # whatever the function raises is the plan's outcome
        if ctx._cancelled:
            raise
        handlers = sys.modules.get("worker_agent.handlers")
        if handlers is not None and isinstance(exc, handlers.HandlerError):
            try:
                pipe.send("error", exc.code, exc.message, exc.detail)
                return
            except (TypeError, ValueError, OverflowError):
                pass  # a detail msgpack cannot carry: report the exception as any other
        pipe.send("raised", f"{type(exc).__name__}: {exc}", "".join(traceback.format_exception(exc)))
        return
    try:
        pipe.send("result", result)
    except (TypeError, ValueError, OverflowError) as exc:
        pipe.send("raised", f"TypeError: the result is not msgpack-encodable: {exc}", "")


if __name__ == "__main__":
    sys.path[:] = os.environ.pop("FLEETWIRE_SYS_PATH", os.pathsep.join(sys.path)).split(os.pathsep)
    main()
