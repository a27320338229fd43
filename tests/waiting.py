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
