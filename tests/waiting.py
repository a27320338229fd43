"""Waiting in tests for state that another task, process or the database changes, and that has no event; and a probe
of how late the event loop runs (a test that says one peer never stalls the others)."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os
import time
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
    """A 5 ms timer on the running loop: the most it ran late (``worst_s``) until :meth:`stop`; and the most it ran
    late with the loop's thread neither waiting for a CPU nor held by the garbage collector (``worst_blocked_s``).

    A test that says the loop never waits on something bounds ``worst_blocked_s``: the loop's thread asleep in a
    blocking call (a ``waitpid``, a lock, the GIL held by another thread) counts; the time it spent runnable but
    without a CPU (Linux's schedstat run delay: a loaded machine's) and the collector's pauses (``gc.callbacks``,
    wall-clock: a full collection of a long-lived pytest worker's heap on a loaded machine) do not. At load 14 a
    whole-suite run failed a 0.5 s bound on ``worst_s`` (1.16 s) for a product that does not wait on its loop.
    Where the kernel keeps no schedstat, only the collector's pauses are taken off.
    """

    def __init__(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.worst_s = 0.0
        self.worst_blocked_s = 0.0
        self._gc_s = 0.0  # the collector's pauses so far, while the probe runs
        self._gc_began = 0.0
        gc.callbacks.append(self._gc)
        try:
            self._schedstat: int | None = os.open("/proc/thread-self/schedstat", os.O_RDONLY)  # this thread's
        except OSError:
            self._schedstat = None
        self._explained_s = self._not_blocked_s()
        self._due = self.loop.time() + 0.005
        self._timer = self.loop.call_at(self._due, self._tick)

    def _gc(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._gc_began = time.perf_counter()
        else:
            self._gc_s += time.perf_counter() - self._gc_began

    def _not_blocked_s(self) -> float:
        """The run delay of the loop's thread (s) plus the collector's pauses so far."""
        delay_s = 0.0
        if self._schedstat is not None:
            with contextlib.suppress(OSError, IndexError, ValueError):
                delay_s = int(os.pread(self._schedstat, 128, 0).split()[1]) / 1e9
        return delay_s + self._gc_s

    def _tick(self) -> None:
        late_s = self.loop.time() - self._due
        explained_s, self._explained_s = self._explained_s, self._not_blocked_s()
        self.worst_s = max(self.worst_s, late_s)
        self.worst_blocked_s = max(self.worst_blocked_s, late_s - (self._explained_s - explained_s))
        self._due = self.loop.time() + 0.005
        self._timer = self.loop.call_at(self._due, self._tick)

    def stop(self) -> float:
        """Stop; ``worst_s``."""
        self._timer.cancel()
        with contextlib.suppress(ValueError):
            gc.callbacks.remove(self._gc)
        if self._schedstat is not None:
            os.close(self._schedstat)
            self._schedstat = None
        return self.worst_s


def alive(pid: int) -> bool:
    """Whether a process has this pid and runs: a zombie (ended, waiting for a reaper that may not be ours) does not."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False
