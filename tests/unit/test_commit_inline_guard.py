"""Which lone commits run on the loop (commit.py): the guard (``INLINE_SLOW_S``) keeps them there through one slow
commit among fast ones, and still sends them to the writer thread within a few commits of a disk slow commit after
commit; a long run of them ends with a group for the writer (``INLINE_RUN_MAX``: SQLite's checkpoints are its).

A fake store whose ``try_write`` takes the time the test says, on the committer's own (fake) clock.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator, Sequence

from coordinator.io.stores.abilities import StoreAbilities
from coordinator.io.stores.commit import (
    INLINE_COOLDOWN_S,
    INLINE_RUN_MAX,
    INLINE_SAMPLE_CAP,
    INLINE_SLOW_S,
    GroupCommitter,
)
from coordinator.records import PlanCreated, Record, StoredPlan
from protocol.messages import Submit


class Clock:
    """The committer's clock: moves only when the fake store's commits take time."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class TimedStore:
    """A blocking store whose loop commits (``try_write``) take the times of ``durations_s``, one each."""

    blocking = True
    closed = False
    description = "timed"

    def __init__(self, clock: Clock, durations_s: Iterator[float]) -> None:
        self.clock = clock
        self.durations_s = durations_s
        self.inline: list[Sequence[Record]] = []  # committed on the loop
        self.handed: list[Sequence[Record]] = []  # committed by the writer thread

    @property
    def abilities(self) -> StoreAbilities:
        return StoreAbilities(try_write=self.try_write)

    def try_write(self, records: Sequence[Record]) -> bool:
        self.clock.now += next(self.durations_s)
        self.inline.append(records)
        return True

    def write(self, records: Sequence[Record]) -> None:
        self.handed.append(records)

    def load(self) -> list[StoredPlan]:
        return []

    def close(self) -> None:
        pass


async def commit_lone_groups(store: TimedStore, clock: Clock, count: int, gap_s: float = 0.0005) -> list[int]:
    """``count`` lone groups, each submitted once the one before is released (a sequential client); their payloads
    in release order."""
    released: list[int] = []
    done = asyncio.Event()

    def release(payload: int) -> None:
        released.append(payload)
        done.set()

    committer: GroupCommitter[int] = GroupCommitter(store, release, lambda exc: None, clock=clock)
    committer.start()
    for n in range(count):
        clock.now += gap_s  # the round trip between two commits
        done.clear()
        submit = Submit(req_id=n, op="echo", args=None, plan_id=f"p{n}")
        committer.submit([PlanCreated(f"p{n}", "alice", n, submit)], n)
        await asyncio.wait_for(done.wait(), 10)
    await committer.close()
    return released


def durations(*parts: tuple[float, int]) -> Iterator[float]:
    """(duration, count) runs, then fast commits for ever."""
    for duration_s, count in parts:
        yield from [duration_s] * count
    while True:
        yield 0.0003


async def test_one_slow_commit_among_fast_ones_keeps_the_next_commits_on_the_loop() -> None:
    """A 15 ms commit (docs/PERFORMANCE.md §P29) after fast ones: no cool-down, every commit stays on the loop."""
    clock = Clock()
    store = TimedStore(clock, durations((0.0003, 50), (0.015, 1)))
    released = await commit_lone_groups(store, clock, 100)
    assert released == list(range(100))
    assert len(store.inline) == 100 and store.handed == []


async def test_two_slow_commits_in_a_row_keep_the_commits_on_the_loop() -> None:
    """Two outliers back to back (each counted as at most twice the bound) are not yet a slow disk."""
    clock = Clock()
    store = TimedStore(clock, durations((0.0003, 50), (0.012, 2)))
    await commit_lone_groups(store, clock, 100)
    assert len(store.inline) == 100 and store.handed == []


async def test_a_disk_slow_commit_after_commit_hands_commits_to_the_thread_at_the_third() -> None:
    """Every commit 10 ms: the third trips the guard; the thread takes every commit for the cool-down, in order."""
    clock = Clock()
    store = TimedStore(clock, durations((0.0003, 20), (0.010, 1000)))
    released = await commit_lone_groups(store, clock, 40)
    assert released == list(range(40))
    assert len(store.inline) == 23 and len(store.handed) == 17  # 20 fast, 3 slow; the rest within the cool-down


async def test_a_disk_just_past_the_bound_trips_the_guard_and_inline_commits_resume_after_the_cool_down() -> None:
    """Commits at 1.5x the bound trip it at the fifth; after the cool-down a commit runs on the loop again."""
    clock = Clock()
    store = TimedStore(clock, durations((INLINE_SLOW_S * 1.5, 1000)))
    released = await commit_lone_groups(store, clock, 40, gap_s=INLINE_COOLDOWN_S / 16)
    assert released == list(range(40))
    inline = [int(records[0].plan_id[1:]) for records in store.inline]  # type: ignore[union-attr]
    handed = [int(records[0].plan_id[1:]) for records in store.handed]  # type: ignore[union-attr]
    assert inline[:5] == [0, 1, 2, 3, 4] and handed[0] == 5
    assert any(n > handed[0] for n in inline)  # back on the loop once the cool-down is over


def test_one_capped_sample_or_two_stay_under_the_bound_and_three_pass_it() -> None:
    """The figures the guard's docstring gives: from fast commits, one or two outliers in a row stay under the bound,
    the third passes it."""
    average = 0.0003
    passed = []
    for _ in range(3):
        average += (INLINE_SLOW_S * INLINE_SAMPLE_CAP - average) * 0.2
        passed.append(average > INLINE_SLOW_S)
    assert passed == [False, False, True]


async def test_a_long_run_of_inline_commits_hands_one_group_to_the_writer_each_run() -> None:
    """Fast commits only: one group in every INLINE_RUN_MAX + 1 goes to the writer (whose connection checkpoints the
    WAL: coordinator/io/stores/sqlite.py), in order, the rest stay on the loop."""
    clock = Clock()
    store = TimedStore(clock, durations())
    released = await commit_lone_groups(store, clock, 2 * INLINE_RUN_MAX + 10)
    assert released == list(range(2 * INLINE_RUN_MAX + 10))
    handed = [int(records[0].plan_id[1:]) for records in store.handed]  # type: ignore[union-attr]
    assert handed == [INLINE_RUN_MAX, 2 * INLINE_RUN_MAX + 1]
