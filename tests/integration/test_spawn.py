"""wireio/spawn.py with real processes: a caller cancelled while asyncio starts its process (the shell forked and
running, its pipes being connected) has the process stopped by its own ``stop``, once or cancelled twice."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from pathlib import Path
from typing import Any

import pytest

from tests.waiting import until
from wireio.spawn import started

pytestmark = pytest.mark.timeout(30)


def alive(pid: int) -> bool:
    """Whether the process runs (a zombie counts as ended)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.parametrize("cancels", [1, 2])
async def test_a_start_cancelled_as_its_last_pipe_connects_is_stopped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cancels: int
) -> None:
    """The caller's cancel lands after the shell's child wrote its pid and the last pipe was connected, before
    create_subprocess_shell returned (asyncio alone would SIGKILL the shell's pid, not its child): ``stop`` gets the
    process and kills its session; a second cancel ends the wait at once, the stop still done."""
    pid_file = tmp_path / "pid"
    loop = asyncio.get_running_loop()
    connect = loop.connect_read_pipe
    caller: list[asyncio.Task[Any]] = []
    stopped: list[int] = []
    pipes = 0

    async def connect_then_cancel(factory: Any, pipe: Any) -> Any:
        nonlocal pipes
        connected = await connect(factory, pipe)
        pipes += 1
        if pipes == 2:  # stderr, the last: create_subprocess_shell returns in the caller's next step
            await until(lambda: pid_file.exists() and pid_file.stat().st_size > 0, timeout_s=10)
            for _ in range(cancels):
                caller[0].cancel()
        return connected

    async def kill_session(proc: asyncio.subprocess.Process) -> None:
        os.killpg(proc.pid, signal.SIGKILL)
        await proc.wait()
        stopped.append(proc.pid)

    async def start() -> asyncio.subprocess.Process:
        shell = asyncio.create_subprocess_shell(
            f"sh -c 'echo $$ > {pid_file}; exec sleep 30'", stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, start_new_session=True,
        )  # fmt: skip
        return await started(shell, kill_session)

    monkeypatch.setattr(loop, "connect_read_pipe", connect_then_cancel)
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
