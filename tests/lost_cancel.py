"""Cancels that land at the two edges of a subprocess call, where Python 3.11's asyncio went wrong: as an awaited
call returns (asyncio.wait_for lost such a cancel, and the loop being stopped went on: the carbon feed's, the worker's
carbon refresh), and while ``create_subprocess_*`` is still starting a command (asyncio then SIGKILLs its pid alone:
wireio/spawn.py)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

import pytest

from tests.waiting import until


def stop_as_communicate_returns(
    monkeypatch: pytest.MonkeyPatch, stop: Callable[[], Coroutine[Any, Any, object]]
) -> list[asyncio.Future[Any]]:
    """Patch ``Process.communicate``: as the real one first returns, ``stop()`` starts (its future, in the list)."""
    stopping: list[asyncio.Future[Any]] = []
    communicate = asyncio.subprocess.Process.communicate

    async def communicate_then_stop(proc: asyncio.subprocess.Process, input: bytes | None = None) -> Any:
        result = await communicate(proc, input)
        if not stopping:
            stopping.append(asyncio.ensure_future(stop()))
        return result

    monkeypatch.setattr(asyncio.subprocess.Process, "communicate", communicate_then_stop)
    return stopping


async def stopped(stopping: list[asyncio.Future[Any]], loop_task: asyncio.Task[Any]) -> bool:
    """Whether the stop :func:`stop_as_communicate_returns` started returned within 3 s and ended ``loop_task``. With
    the bug the loop is ended by a second cancel (it reaches its sleep), so nothing is left running after the test."""
    await until(lambda: bool(stopping), timeout_s=10)
    done, _ = await asyncio.wait(stopping, timeout=3)
    if not done:
        loop_task.cancel()
        await asyncio.wait([*stopping, loop_task], timeout=3)
    return bool(done) and loop_task.done()


def act_as_the_start_ends(monkeypatch: pytest.MonkeyPatch, pid_file: Path, act: Callable[[], object]) -> None:
    """Patch the running loop's ``connect_read_pipe``: once a started command's second pipe (stderr, its last) is
    connected and the command wrote its pid to ``pid_file``, ``act()`` runs (a cancel, a close): it reaches the
    caller before ``create_subprocess_*`` returns in the caller's next step."""
    loop = asyncio.get_running_loop()
    connect = loop.connect_read_pipe
    pipes = 0

    async def connect_then_act(factory: Any, pipe: Any) -> Any:
        nonlocal pipes
        connected = await connect(factory, pipe)
        pipes += 1
        if pipes == 2:
            await until(lambda: pid_file.exists() and pid_file.stat().st_size > 0, timeout_s=10)
            act()
        return connected

    monkeypatch.setattr(loop, "connect_read_pipe", connect_then_act)
