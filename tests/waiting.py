"""Waiting in tests for state that another task, process or the database changes, and that has no event; and a probe
of how late the event loop runs (a test that says one peer never stalls the others)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable


async def until(condition: Callable[[], object], timeout_s: float = 30.0, interval_s: float = 0.005) -> None:
    """Wait for ``condition()`` to hold, looking every ``interval_s``; TimeoutError after ``timeout_s``, naming the
    condition, how often it was looked at and its last value.

    For state with no event to wait on (server counters, a store's connection, a lease round's
    result); where an event exists, wait on it instead. A condition that must await (a client's request, a
    database's answer): :func:`until_async`.
    """
    looks, last = 0, None
    try:
        async with asyncio.timeout(timeout_s) as scope:
            while not (last := condition()):
                looks += 1
                await asyncio.sleep(interval_s)
    except TimeoutError:
        if not scope.expired():  # the condition's own (a request's timeout): not ours to rename
            raise
        raise TimeoutError(_why(condition, timeout_s, looks, last)) from None


async def until_async(
    condition: Callable[[], Awaitable[object]], timeout_s: float = 30.0, interval_s: float = 0.005
) -> None:
    """:func:`until` for a condition that awaits (``async def`` or a lambda returning a coroutine): each look
    awaits it, within the same ``timeout_s`` (a look that hangs counts against it), and the TimeoutError says as
    much as :func:`until`'s."""
    looks, last = 0, None
    try:
        async with asyncio.timeout(timeout_s) as scope:
            while True:
                looks += 1
                if last := await condition():
                    return
                await asyncio.sleep(interval_s)
    except TimeoutError:
        if not scope.expired():  # the condition's own (a request's timeout): not ours to rename
            raise
        raise TimeoutError(_why(condition, timeout_s, looks, last)) from None


def _why(condition: Callable[[], object], timeout_s: float, looks: int, last: object) -> str:
    name = getattr(condition, "__qualname__", None) or repr(condition)
    shown = repr(last)
    shown = shown if len(shown) <= 200 else shown[:200] + "..."
    return f"{name} did not hold within {timeout_s:g} s ({looks} looks, the last gave {shown})"


class LagProbe:
    """A 5 ms timer on the running loop: the most it ran late (``worst_s``) until :meth:`stop`."""

    def __init__(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.worst_s = 0.0
        self._due = self.loop.time() + 0.005
        self._timer = self.loop.call_at(self._due, self._tick)

    def _tick(self) -> None:
        self.worst_s = max(self.worst_s, self.loop.time() - self._due)
        self._due = self.loop.time() + 0.005
        self._timer = self.loop.call_at(self._due, self._tick)

    def stop(self) -> float:
        self._timer.cancel()
        return self.worst_s


def alive(pid: int) -> bool:
    """Whether a process has this pid and runs: a zombie (ended, waiting for a reaper that may not be ours) does not."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False
