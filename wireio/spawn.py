"""A child process started so that a cancel during its start never leaves it, or what it started, running.

``asyncio.create_subprocess_exec`` and ``_shell`` fork the child first, then connect its pipes over a few loop
iterations before they return. A cancel in those iterations (CPython 3.11's ``_make_subprocess_transport``) closes
the transport, which SIGKILLs the child's pid alone, and the caller never gets the process: what the child had
started by then (a shell's own child, a pipeline, a script's background job) runs on in its session. The carbon
feed's ``sh -c`` child outlived the coordinator's stop this way (CI on d0d9d30).

:func:`started` lets the start finish (shielded) and hands a process started for a caller cancelled meanwhile to the
caller's ``stop`` (for a child in a session of its own: its group killed, at once or after a grace), then lets the
cancel go on. The caller still stops the process itself for a cancel that comes after :func:`started` returned.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

__all__ = ["kill_group", "kill_session", "started"]

Process = asyncio.subprocess.Process
Stop = Callable[[Process], Awaitable[object]]

_stopping: set[asyncio.Task[None]] = set()  # a stop that outlives its caller's second cancel runs on, referenced


async def started(start: Coroutine[Any, Any, Process], stop: Stop) -> Process:
    """``await start`` (a ``create_subprocess_*`` call); cancelled meanwhile, the process is given to ``stop``.

    The cancel is raised once ``stop`` returned (a second cancel meanwhile: at once, the stop going on in its own
    task). A start that fails started nothing: its error is dropped with the cancel.
    """
    starting = asyncio.ensure_future(start)
    try:
        return await asyncio.shield(starting)
    except asyncio.CancelledError:
        stopping = asyncio.ensure_future(_stop_when_started(starting, stop))
        _stopping.add(stopping)
        stopping.add_done_callback(_stopping.discard)
        await asyncio.shield(stopping)
        raise


async def _stop_when_started(starting: asyncio.Future[Process], stop: Stop) -> None:
    try:
        proc = await starting
    except Exception:  # it started nothing (the caller's cancel stands)
        return
    # Its pipes are read to their end meanwhile (nobody else reads them now): a child that writes on would block,
    # and on 3.11 a pipe with more than twice its reader's limit unread is paused, never sees its EOF, and
    # proc.wait() (which waits for every pipe's EOF) never returns once the child was killed.
    drains = [asyncio.ensure_future(_drain(out)) for out in (proc.stdout, proc.stderr) if out is not None]
    try:
        with contextlib.suppress(Exception):
            await stop(proc)
    finally:
        for drain in drains:
            drain.cancel()


async def _drain(out: asyncio.StreamReader) -> None:
    with contextlib.suppress(Exception):
        while await out.read(1 << 16):
            pass


def kill_group(pid: int) -> None:
    """SIGKILL the process group ``pid`` leads (a child started with ``start_new_session``: it and all it started)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGKILL)


async def kill_session(proc: Process) -> None:
    """:func:`kill_group` of the process, then reap it."""
    kill_group(proc.pid)
    with contextlib.suppress(Exception):
        await proc.wait()
