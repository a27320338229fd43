"""Waiting in tests for state that another task, process or the database changes, and that has no event."""

from __future__ import annotations

import asyncio
from collections.abc import Callable


async def until(condition: Callable[[], object], timeout_s: float = 30.0, interval_s: float = 0.005) -> None:
    """Wait for ``condition()`` to hold, looking every ``interval_s``; TimeoutError after ``timeout_s``.

    For state with no event to wait on (server counters, a store's connection, a lease round's
    result); where an event exists, wait on it instead.
    """
    async with asyncio.timeout(timeout_s):
        while not condition():  # noqa: ASYNC110 - the callers' state has no event to wait on
            await asyncio.sleep(interval_s)


def alive(pid: int) -> bool:
    """Whether a process has this pid and runs: a zombie (ended, waiting for a reaper that may not be ours) does not."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False
