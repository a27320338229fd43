"""wireio/spawn.py with real processes: a caller cancelled while asyncio starts its process (the shell forked and
running, its pipes being connected) has the process stopped by its own ``stop``, once or cancelled twice."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.integration.test_carbon_feed import forking_command
from tests.lost_cancel import act_as_the_start_ends
from tests.waiting import alive, until
from wireio.spawn import started

pytestmark = pytest.mark.timeout(30)


@pytest.mark.parametrize("cancels", [1, 2])
async def test_a_start_cancelled_as_its_last_pipe_connects_is_stopped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cancels: int
) -> None:
    """The caller's cancel lands after the shell's child wrote its pid and the last pipe was connected, before
    create_subprocess_shell returned (asyncio alone would SIGKILL the shell's pid, not its child): ``stop`` gets the
    process and kills its session; a second cancel ends the wait at once, the stop still done."""
    pid_file = tmp_path / "pid"
    caller: list[asyncio.Task[Any]] = []
    stopped: list[int] = []

    async def kill_session(proc: asyncio.subprocess.Process) -> None:
        os.killpg(proc.pid, signal.SIGKILL)
        await proc.wait()
        stopped.append(proc.pid)

    async def start() -> asyncio.subprocess.Process:
        shell = asyncio.create_subprocess_shell(
            forking_command(pid_file), stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, start_new_session=True,
        )  # fmt: skip
        return await started(shell, kill_session)

    act_as_the_start_ends(monkeypatch, pid_file, lambda: [caller[0].cancel() for _ in range(cancels)])
    caller.append(asyncio.ensure_future(start()))
    with pytest.raises(asyncio.CancelledError):
        await caller[0]
    pid = int(await asyncio.to_thread(pid_file.read_text))
    try:
        await until(lambda: bool(stopped), timeout_s=10)
        await until(lambda: not alive(pid), timeout_s=5)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


async def test_a_stop_whose_process_fills_its_unread_pipes_still_reaps_it(tmp_path: Path) -> None:
    """Nobody reads a process handed to ``stop``: one that writes on (a command that ignores the SIGTERM of its grace)
    filled its stdout past twice the reader's limit, which pauses the pipe, and on 3.11 ``proc.wait()`` waits for
    every pipe's EOF, which a paused pipe never sees: the stop's wait, and the cancelled caller, hung for ever."""
    progress = tmp_path / "progress"
    caller: list[asyncio.Task[Any]] = []
    stopped: list[int] = []
    writer = (
        "import os, sys\n"
        f"out, mark = sys.stdout.buffer, os.open({str(progress)!r}, os.O_WRONLY | os.O_CREAT | os.O_APPEND)\n"
        "while True:\n"
        "    out.write(b'x' * 65536); out.flush(); os.write(mark, b'.')\n"
    )

    async def kill_after_the_pipe_filled(proc: asyncio.subprocess.Process) -> None:
        # 2 x 64 KiB written: at least 64 KiB read past the pipe's 64 KiB, more than the 32 KiB that pause the reader
        await until(lambda: progress.exists() and progress.stat().st_size >= 2, timeout_s=10)
        os.killpg(proc.pid, signal.SIGKILL)
        await proc.wait()
        stopped.append(proc.pid)

    async def start_then_cancel() -> asyncio.subprocess.Process:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-c", writer, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE, start_new_session=True, limit=16384,
        )  # fmt: skip
        caller[0].cancel()  # the caller is cancelled before its start returned
        return proc

    async def start() -> asyncio.subprocess.Process:
        return await started(start_then_cancel(), kill_after_the_pipe_filled)

    caller.append(asyncio.ensure_future(start()))
    with pytest.raises(asyncio.CancelledError):
        async with asyncio.timeout(15):
            await caller[0]
    assert stopped
