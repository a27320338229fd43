"""The child side of a custom handler run in a process of its own (``isolation="process"``).

worker_agent/handler_proc.py starts this file as a script (like worker_agent/pychild.py, whose
``ProcessContext`` and report pipe it loads by path: the ``worker_agent`` package imports the
whole agent) with ``CUDA_VISIBLE_DEVICES`` already set to one device set. It then runs plans of
that device set one after the other: it reads a start frame (length-prefixed msgpack) on stdin,
changes to the plan's scratch directory, imports the handler (``module:qualname``; a worker
script's ``__main__`` is loaded from its file as ``__mp_main__``, as multiprocessing does), calls
``handler(ctx, args)`` (a coroutine is run to its end), and reports on its fd 1 as pychild does:
events, tokens, outputs, then one of ``result`` / ``error`` / ``raised``. Then the next start
frame, until stdin closes. SIGTERM (cancel, timeout) ends the process; it is not reused.
"""

from __future__ import annotations

import asyncio
import importlib
import importlib.util
import inspect
import os
import signal
import struct
import sys
import traceback
from typing import Any

import msgspec

_HEADER = struct.Struct(">I")


def _load_pychild() -> Any:
    spec = importlib.util.spec_from_file_location("_fleetwire_pychild", os.path.join(os.path.dirname(__file__),
                                                                                      "pychild.py"))  # fmt: skip
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# The worker script's module, loaded once by file. Not looked up as sys.modules["__mp_main__"] again: a
# library a handler imports may put its own module there (after a handler that imported torch, the next
# handler of the script was "not found" in the same child on a GPU host).
_MAIN: dict[str, Any] = {}


def _resolve(target: str, main_file: str | None) -> Any:
    module_name, _, qualname = target.partition(":")
    if module_name == "__main__":
        assert main_file is not None, "a handler of __main__ needs the worker script's file"
        module = _MAIN.get(main_file)
        if module is None:
            spec = importlib.util.spec_from_file_location("__mp_main__", main_file)
            assert spec is not None and spec.loader is not None
            module = _MAIN[main_file] = importlib.util.module_from_spec(spec)
            sys.modules["__mp_main__"] = module  # pickle finds the script's classes by this name, as multiprocessing
            spec.loader.exec_module(module)
    else:
        module = importlib.import_module(module_name)
    obj: Any = module
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def _read(stream: Any) -> Any:
    head = stream.read(_HEADER.size)
    if len(head) < _HEADER.size:
        return None
    (size,) = _HEADER.unpack(head)
    return msgspec.msgpack.decode(stream.read(size))


def main() -> None:
    pychild = _load_pychild()
    report = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # the handler's prints go to the worker's stderr, never into the report pipe
    sys.stdout = sys.stderr
    pipe = pychild.ReportPipe(report)
    handlers: dict[str, Any] = {}
    terminated = False

    def on_term(signum: int, frame: Any) -> None:
        nonlocal terminated
        terminated = True
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, on_term)
    while (start := _read(sys.stdin.buffer)) is not None:
        os.chdir(start["cwd"])
        ctx = pychild.ProcessContext(start, pipe)
        ctx.traceparent = start.get("traceparent", "")
        try:
            fn = handlers.get(start["handler"])
            if fn is None:
                fn = handlers[start["handler"]] = _resolve(start["handler"], start.get("main_file"))
            result = fn(ctx, start["op_args"])
            if inspect.isawaitable(result):
                result = asyncio.run(_await(result))
        except BaseException as exc:  # whatever the handler raises is the plan's outcome
            if terminated:  # cancelled or timed out: this process ends (the worker starts another)
                raise
            handlers_module = sys.modules.get("worker_agent.handlers")
            if handlers_module is not None and isinstance(exc, handlers_module.HandlerError):
                try:
                    pipe.send("error", exc.code, exc.message, exc.detail)
                    continue
                except (TypeError, ValueError, OverflowError):
                    pass
            pipe.send("raised", f"{type(exc).__name__}: {exc}", "".join(traceback.format_exception(exc)))
            continue
        try:
            pipe.send("result", result)
        except (TypeError, ValueError, OverflowError) as exc:
            pipe.send("raised", f"TypeError: the result is not msgpack-encodable: {exc}", "")


async def _await(awaitable: Any) -> Any:
    return await awaitable


if __name__ == "__main__":
    sys.path[:] = os.environ.pop("FLEETWIRE_SYS_PATH", os.pathsep.join(sys.path)).split(os.pathsep)
    main()
