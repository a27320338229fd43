"""tests/waiting.py's waits: ``until`` (a synchronous condition) and ``until_async`` (one that awaits), both bounded
by ``timeout_s`` and saying, when it passed, which condition did not hold and what it gave last; and ``LagProbe``'s
two figures (the loop late, and late with its thread blocked)."""

from __future__ import annotations

import asyncio
import gc
import time

import pytest

from tests.waiting import LagProbe, until, until_async


async def test_until_async_awaits_each_look_and_returns_once_it_holds() -> None:
    """A coroutine condition is awaited at each look (not taken as true for being a coroutine object) until it
    gives a true value."""
    looks: list[int] = []

    async def third_time() -> bool:
        await asyncio.sleep(0)
        looks.append(len(looks))
        return len(looks) >= 3

    await until_async(third_time, timeout_s=5, interval_s=0)
    assert len(looks) == 3


async def test_until_async_times_out_naming_the_condition_and_its_last_value() -> None:
    """A condition that never holds: TimeoutError after timeout_s, naming the condition, its looks and last value."""

    async def usage_rows() -> list[str]:
        return []

    with pytest.raises(TimeoutError, match=r"usage_rows did not hold within 0.05 s \(\d+ looks, the last gave \[\]\)"):
        await until_async(usage_rows, timeout_s=0.05, interval_s=0.01)


async def test_until_async_bounds_a_look_that_hangs() -> None:
    """A look that never answers (a request to a peer that is gone) counts against the same timeout."""
    never: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
    with pytest.raises(TimeoutError, match=r"did not hold within 0.05 s \(1 looks, the last gave None\)"):
        await until_async(lambda: never, timeout_s=0.05)


async def test_until_times_out_with_the_same_diagnostics() -> None:
    """The synchronous form says as much: the condition's name, its looks and what it gave last."""
    with pytest.raises(TimeoutError, match=r"<lambda> did not hold within 0.05 s \(\d+ looks, the last gave 0\)"):
        await until(lambda: 0, timeout_s=0.05, interval_s=0.01)


async def test_until_async_lets_the_conditions_own_timeout_through() -> None:
    """A TimeoutError the condition raises itself (its request's own timeout) comes out as it was, not as a
    condition that did not hold within timeout_s."""

    async def request() -> bool:
        raise TimeoutError("the peer did not answer in 1 s")

    with pytest.raises(TimeoutError, match="the peer did not answer"):
        await until_async(request, timeout_s=5)


async def test_lag_probe_counts_a_blocking_wait_on_the_loop_as_blocked() -> None:
    """A callback that sleeps 0.3 s on the loop: the probe's timer runs that late, and all of it blocked."""
    probe = LagProbe()
    await asyncio.sleep(0.02)
    time.sleep(0.3)  # noqa: ASYNC251  (the point: the loop's thread blocked, as by a waitpid on the loop)
    await asyncio.sleep(0.02)
    probe.stop()
    assert probe.worst_s >= 0.29 and probe.worst_blocked_s >= 0.25, (probe.worst_s, probe.worst_blocked_s)


async def test_lag_probe_does_not_count_the_collectors_pause_as_blocked() -> None:
    """A collection that holds the loop 0.3 s (gc.callbacks told of its start and stop around it): late, not
    blocked."""
    probe = LagProbe()
    await asyncio.sleep(0.02)
    info = {"generation": 2, "collected": 0, "uncollectable": 0}
    for callback in list(gc.callbacks):
        callback("start", info)
    time.sleep(0.3)  # noqa: ASYNC251  (the pause on the loop's thread, a fixed length whatever the heap)
    for callback in list(gc.callbacks):
        callback("stop", info)
    await asyncio.sleep(0.02)
    probe.stop()
    assert probe.worst_s >= 0.29 and probe.worst_blocked_s < 0.1, (probe.worst_s, probe.worst_blocked_s)
