"""A stop whose cancel lands as an awaited subprocess call returns: asyncio.wait_for on Python 3.11 lost such a
cancel, and the loop being stopped went on (the carbon feed's, the worker's carbon refresh)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
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
