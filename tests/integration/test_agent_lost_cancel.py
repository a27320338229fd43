"""A worker agent's background loops end when they are cancelled, whenever the cancel comes (worker_agent/agent.py).

On Python 3.11 ``asyncio.wait_for`` returns its awaitable's result when the cancel of the task that awaits it
arrives in the loop iteration in which the awaitable finishes: the cancel is lost, and a loop around it goes on.
These tests start the cancel from inside the awaited operation as it returns (deterministic; no sleeps).
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from tests.waiting import until
from worker_agent.agent import Agent

pytestmark = pytest.mark.timeout(20)


async def test_the_interruption_watch_cancelled_as_its_command_ends_ends(monkeypatch: pytest.MonkeyPatch) -> None:
    """The --interruption-command watch cancelled in the loop iteration in which the command's output is read ends,
    instead of running the command on after the agent stopped."""
    agent = Agent("ws://127.0.0.1:9", "t", worker_id="w-lost-cancel", interruption_command="exit 1",
                  interruption_poll_s=0.1, reconnect_base_s=5.0, reconnect_cap_s=5.0)  # fmt: skip
    cancelled: list[asyncio.Task[Any]] = []
    communicate = asyncio.subprocess.Process.communicate

    async def communicate_then_cancel(proc: asyncio.subprocess.Process, input: bytes | None = None) -> Any:
        """The real communicate; as it returns, the watch's task is cancelled (as run()'s end does)."""
        result = await communicate(proc, input)
        if not cancelled:
            watch = [t for t in asyncio.all_tasks() if "_watch_interruption" in t.get_coro().__qualname__]
            assert len(watch) == 1
            watch[0].cancel()
            cancelled.append(watch[0])
        return result

    monkeypatch.setattr(asyncio.subprocess.Process, "communicate", communicate_then_cancel)
    run = asyncio.create_task(agent.run())
    try:
        await until(lambda: bool(cancelled), timeout_s=10)
        (watch,) = cancelled
        done, _ = await asyncio.wait([watch], timeout=2)
        if not done:  # the bug: end it with a second cancel (it reaches its sleep), so nothing is left running
            watch.cancel()
            await asyncio.wait([watch], timeout=2)
        assert done, "the interruption watch went on after it was cancelled"
    finally:
        agent.stop()
        agent.stop()
        await asyncio.wait_for(run, 10)
