"""The operator's commands, run detached: the autoscaler's hook (docs/ROUTING.md §Autoscaler) and the
command provider's start and stop commands (coordinator/io/ops/provision.py).

The core decides (coordinator/autoscaler.py) and hands its decisions to the server in
``Effects.decisions``; the server gives each one to :class:`HookRunner`, which runs the
operator's command through the shell with the decision as one JSON object on stdin. The
command starts or stops workers (a cloud API call, ``systemctl``, ``kubectl scale``...).
It runs in its own task: a slow or failing hook never blocks the coordinator, and its
outcome (exit status, the tail of its output) is logged.

How a command runs (:func:`run_detached`), so that one that leaves a process behind (``fleetwire
worker ... &``, ``nohup``, a daemon) neither blocks nor inherits the coordinator:

* in its own session and process group (``setsid``): a terminal's Ctrl-C for the coordinator
  does not reach it, and a command killed at its timeout is killed with its whole group;
* stdin is the given bytes (a file, never a pipe a child could hold), stdout and stderr one
  pipe of its own, and every other descriptor closed (``close_fds``): under uvloop, whose
  spawn closes none, a child used to inherit the coordinator's sockets and the pipes of other
  children;
* spawned, waited for and read by a thread of its own, never on the event loop; the wait ends
  when the *command* exits (or at ``timeout_s``), not when its output pipe closes: a process it
  left running keeps the pipe open, and the thread then reads and drops that process's output
  until it closes it, so the process never writes into a closed pipe.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import selectors
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import structlog

__all__ = ["Finished", "HookRunner", "run_detached"]

log = structlog.get_logger(__name__)

OUTPUT_TAIL_BYTES = 4096  # the end of a command's output kept for its log line and error message
_POLL_S = 0.05  # while the command's output pipe stays open, how often its exit is checked


@dataclass(frozen=True)
class Finished:
    """How a detached command ended."""

    status: int | None  # its exit status; None: it ran past its timeout and was killed with its group
    output: str  # the tail of its stdout and stderr (up to OUTPUT_TAIL_BYTES), decoded


async def run_detached(
    command: str, *, timeout_s: float, env: Mapping[str, str] | None = None, stdin: bytes = b""
) -> Finished:
    """Run ``command`` through the shell, detached (module docstring); returns once the command exits.

    Raises:
        OSError: the command could not be started (no shell, no file descriptors left...).
    """
    loop = asyncio.get_running_loop()
    done: asyncio.Future[Finished] = loop.create_future()

    def deliver(result: Finished | OSError) -> None:
        if done.done():  # the caller stopped waiting (cancelled)
            return
        if isinstance(result, OSError):
            done.set_exception(result)
        else:
            done.set_result(result)

    def report(result: Finished | OSError) -> None:
        with contextlib.suppress(RuntimeError):  # the loop closed: nobody waits any more
            loop.call_soon_threadsafe(deliver, result)

    thread = threading.Thread(
        target=_run, args=(command, dict(env) if env is not None else None, stdin, timeout_s, report),
        name="fleetwire-command", daemon=True,
    )
    thread.start()
    return await done


def _run(
    command: str, env: dict[str, str] | None, stdin: bytes, timeout_s: float,
    report: Callable[[Finished | OSError], None],
) -> None:
    """The thread of one command: spawn, wait (bounded), report, then drain what it left behind."""
    try:
        read_fd, write_fd = os.pipe()  # both close-on-exec: only the child's dup2 copies reach it
    except OSError as exc:
        report(exc)
        return
    try:
        with tempfile.TemporaryFile() as given:
            given.write(stdin)
            given.seek(0)
            proc = subprocess.Popen(  # the operator's own shell command line, by design
                command, shell=True, env=env, stdin=given, stdout=write_fd, stderr=subprocess.STDOUT,
                close_fds=True, start_new_session=True,
            )
    except OSError as exc:
        os.close(read_fd)
        report(exc)
        return
    finally:
        os.close(write_fd)
    tail = bytearray()
    open_ = True  # the pipe has writers: the command, or what it left running
    deadline = time.monotonic() + timeout_s
    with selectors.DefaultSelector() as selector:
        selector.register(read_fd, selectors.EVENT_READ)
        status = proc.poll()
        while status is None:
            left = deadline - time.monotonic()
            if left <= 0:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(proc.pid, signal.SIGKILL)  # its group: the session it leads
                proc.wait()
                break
            if open_ and selector.select(min(left, _POLL_S)):
                open_ = _read_into(read_fd, tail)
            elif not open_:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(min(left, 1.0))
            status = proc.poll()
        while open_ and selector.select(0):  # what it wrote before it exited
            open_ = _read_into(read_fd, tail)
    report(Finished(status, bytes(tail[-OUTPUT_TAIL_BYTES:]).decode(errors="replace").strip()))
    try:
        while open_:  # a process it left running still holds the pipe: drop its output until it closes it
            open_ = bool(os.read(read_fd, 65536))
    except OSError:
        pass
    finally:
        os.close(read_fd)


def _read_into(fd: int, tail: bytearray) -> bool:
    """Read what is there into ``tail`` (keeping its last OUTPUT_TAIL_BYTES); False at end of file."""
    chunk = os.read(fd, 65536)
    tail += chunk
    del tail[:-OUTPUT_TAIL_BYTES]
    return bool(chunk)


class HookRunner:
    """Runs ``command`` once per decision, at most ``timeout_s`` each (then it is killed).

    Args:
        command: a shell command line; it reads the decision JSON on stdin.
        timeout_s: how long one run may take.
    """

    def __init__(self, command: str, timeout_s: float = 60.0) -> None:
        self.command = command
        self.timeout_s = timeout_s
        self.runs = 0
        self.failures = 0
        self._tasks: set[asyncio.Task[None]] = set()

    def run(self, decisions: Iterable[dict[str, Any]]) -> None:
        """Start one run per decision, in the background (call on the event loop)."""
        for decision in decisions:
            task = asyncio.get_running_loop().create_task(self._run(decision))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _run(self, decision: dict[str, Any]) -> None:
        payload = json.dumps(decision).encode() + b"\n"
        try:
            finished = await run_detached(self.command, stdin=payload, timeout_s=self.timeout_s)
        except OSError as exc:
            self.failures += 1
            log.error("autoscale hook could not start", command=self.command, error=str(exc))
            return
        if finished.status is None:
            self.failures += 1
            log.error("autoscale hook timed out and was killed", command=self.command, timeout_s=self.timeout_s,
                      output=finished.output)
            return
        self.runs += 1
        if finished.status == 0:
            log.info("autoscale hook ran", pool=decision.get("pool"), desired=decision.get("desired"),
                     output=finished.output)
        else:
            self.failures += 1
            log.error("autoscale hook failed", command=self.command, status=finished.status, output=finished.output)

    async def close(self) -> None:
        """Wait for the runs in progress (each is bounded by ``timeout_s``)."""
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
