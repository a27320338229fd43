"""Group commit with an idle writer: a small group is committed on the loop, durable before release; else the thread.

Real SQLite files; "durable before release" is read back through a second connection from the
release callback itself.
"""

from __future__ import annotations

import asyncio
import sqlite3
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from coordinator.io.stores.commit import (
    INLINE_MAX_BYTES,
    INLINE_MAX_RECORDS,
    WRITER_SWITCH_INTERVAL_S,
    GroupCommitter,
)
from coordinator.io.stores.sqlite import SQLiteStore
from coordinator.io.stores.store import DB_FILE
from coordinator.records import PlanCreated
from protocol.messages import Submit


def created(plan_id: str, order: int = 1) -> PlanCreated:
    return PlanCreated(plan_id, "alice", order, Submit(req_id=1, op="echo", args=None, plan_id=plan_id))


@pytest.fixture
def db(tmp_path: Path) -> Iterator[SQLiteStore]:
    store = SQLiteStore(tmp_path / DB_FILE)
    yield store
    store.close()


def in_file(path: Path) -> int:
    """Plans committed in the file, as another process would see them."""
    check = sqlite3.connect(path)
    try:
        return int(check.execute("SELECT COUNT(*) FROM plans").fetchone()[0])
    finally:
        check.close()


class Released(list[Any]):
    """A committer's release callback: the payloads it released, in order, and an event set at each."""

    def __init__(self) -> None:
        super().__init__()
        self.done = asyncio.Event()

    def __call__(self, payload: Any) -> None:
        self.append(payload)
        self.done.set()


async def test_a_lone_group_is_committed_on_the_loop_and_released_once_durable(db: SQLiteStore) -> None:
    """An idle writer: the group is written by the loop (no thread hand-over); its release sees it in the file."""
    seen: list[tuple[Any, int]] = []
    done = asyncio.Event()

    def release(payload: Any) -> None:
        seen.append((payload, in_file(db.path)))
        done.set()

    # A slow shared disk must not turn the inline path off here (that guard has its own test).
    committer: GroupCommitter[Any] = GroupCommitter(db, release, lambda exc: None, inline_slow_s=60)
    committer.start()
    for n in range(1, 4):
        done.clear()
        committer.submit([created(f"p{n}", n)], n)
        assert seen[-1:] != [(n, n)]  # released only after the commit, never inside submit
        await asyncio.wait_for(done.wait(), 10)
    await committer.close()
    assert seen == [(1, 1), (2, 2), (3, 3)] and committer.inline_commits == 3 == committer.transactions


async def test_batches_of_one_loop_iteration_share_one_inline_commit_in_order(db: SQLiteStore) -> None:
    """Batches submitted in the same loop iteration (several peers' frames) are one transaction, released in order."""
    released = Released()
    done = released.done
    committer: GroupCommitter[Any] = GroupCommitter(db, released, lambda exc: None, inline_slow_s=60)
    committer.start()
    committer.submit([created("a", 1)], "a")
    committer.after("after-a")
    committer.submit([created("b", 2)], "b")
    await asyncio.wait_for(done.wait(), 10)
    await committer.close()
    assert released == ["a", "after-a", "b"] and committer.inline_commits == 1 == committer.transactions


async def test_the_writer_thread_runs_with_a_short_switch_interval_and_puts_it_back(db: SQLiteStore) -> None:
    """While the writer thread runs the interpreter switches every WRITER_SWITCH_INTERVAL_S at most; close restores."""
    before = sys.getswitchinterval()
    committer: GroupCommitter[Any] = GroupCommitter(db, lambda payload: None, lambda exc: None)
    committer.start()
    try:
        assert sys.getswitchinterval() == min(before, WRITER_SWITCH_INTERVAL_S)
    finally:
        await committer.close()
    assert sys.getswitchinterval() == before


async def test_a_large_group_goes_to_the_writer_thread(db: SQLiteStore) -> None:
    """More than INLINE_MAX_RECORDS records (load): the thread commits it, not the loop."""
    released: list[Any] = []
    committer: GroupCommitter[Any] = GroupCommitter(db, released.append, lambda exc: None)
    committer.start()
    committer.submit([created(f"p{n}", n) for n in range(INLINE_MAX_RECORDS + 1)], "big")
    await committer.close()
    assert released == ["big"] and committer.inline_commits == 0 and in_file(db.path) == INLINE_MAX_RECORDS + 1


async def test_a_group_of_few_records_but_many_bytes_goes_to_the_writer_thread(db: SQLiteStore) -> None:
    """One plan from a frame past INLINE_MAX_BYTES (512 KiB args): the thread commits it; a small one stays inline."""
    released = Released()
    done = released.done
    committer: GroupCommitter[Any] = GroupCommitter(db, released, lambda exc: None, inline_slow_s=60)
    committer.start()
    committer.submit([created("big")], "big", INLINE_MAX_BYTES + 1)
    await asyncio.wait_for(done.wait(), 10)
    assert released == ["big"] and committer.inline_commits == 0
    done.clear()
    committer.submit([created("small", 2)], "small", 200)
    await asyncio.wait_for(done.wait(), 10)
    await committer.close()
    assert released == ["big", "small"] and committer.inline_commits == 1 and in_file(db.path) == 2


async def test_a_database_held_by_another_connection_never_blocks_the_loop(db: SQLiteStore, tmp_path: Path) -> None:
    """Another writer holds the file: the loop does not wait for it (the thread does), and nothing is lost."""
    released = Released()
    done = released.done
    committer: GroupCommitter[Any] = GroupCommitter(db, released, lambda exc: None)
    committer.start()
    blocker = sqlite3.connect(tmp_path / DB_FILE, isolation_level=None)
    blocker.execute("BEGIN IMMEDIATE")
    committer.submit([created("p", 1)], "p")
    started = time.monotonic()
    for _ in range(3):
        await asyncio.sleep(0)  # the inline attempt runs here and must give up at once (busy timeout 5 s)
    assert time.monotonic() - started < 1.0 and released == [] and committer.inline_commits == 0
    blocker.execute("ROLLBACK")
    blocker.close()
    await asyncio.wait_for(done.wait(), 10)
    await committer.close()
    assert released == ["p"] and in_file(db.path) == 1


async def test_inline_commits_off_commits_everything_through_the_thread(db: SQLiteStore) -> None:
    """inline_max_records=0: every group goes through the writer thread, as before."""
    released: list[Any] = []
    committer: GroupCommitter[Any] = GroupCommitter(db, released.append, lambda exc: None, inline_max_records=0)
    committer.start()
    committer.submit([created("p", 1)], "p")
    await committer.close()
    assert released == ["p"] and committer.inline_commits == 0 and committer.transactions == 1


async def test_slow_inline_commits_hand_every_commit_to_the_thread_for_a_while(db: SQLiteStore) -> None:
    """Inline commits slower than inline_slow_s on average: the next groups go through the thread, still in order."""
    released = Released()
    done = released.done
    committer: GroupCommitter[Any] = GroupCommitter(db, released, lambda exc: None, inline_slow_s=0)
    committer.start()
    for n in range(1, 4):
        done.clear()
        committer.submit([created(f"p{n}", n)], n)
        await asyncio.wait_for(done.wait(), 10)
    await committer.close()
    assert released == [1, 2, 3] and committer.inline_commits == 1 and committer.transactions == 3


def test_commits_of_one_mode_run_no_busy_timeout_pragma_each(db: SQLiteStore) -> None:
    """Inline (no-wait) commits in a row, or thread (waiting) commits in a row, switch the busy timeout only once."""
    statements: list[str] = []
    db._db.set_trace_callback(statements.append)
    for n in range(1, 4):
        assert db.try_write([created(f"i{n}", n)])
    for n in range(4, 7):
        db.write([created(f"t{n}", n)])
    db._db.set_trace_callback(None)
    pragmas = [s for s in statements if "busy_timeout" in s]
    assert pragmas == ["PRAGMA busy_timeout = 0", "PRAGMA busy_timeout = 5000"] and in_file(db.path) == 6


def test_switching_modes_keeps_try_write_non_blocking_and_write_waiting(db: SQLiteStore, tmp_path: Path) -> None:
    """After a waiting write, try_write still gives up at once on a held database; after it, write still waits."""
    blocker = sqlite3.connect(tmp_path / DB_FILE, isolation_level=None, check_same_thread=False)
    db.write([created("a", 1)])
    blocker.execute("BEGIN IMMEDIATE")
    started = time.monotonic()
    assert not db.try_write([created("b", 2)])  # busy timeout 5 s: must not be waited for
    assert time.monotonic() - started < 1.0
    blocker.execute("ROLLBACK")
    assert db.try_write([created("b", 2)])
    blocker.execute("BEGIN IMMEDIATE")
    released = threading.Timer(0.2, blocker.execute, ("ROLLBACK",))  # the writer must wait for the lock, not fail
    released.start()
    db.write([created("c", 3)])
    released.join()
    blocker.close()
    assert in_file(db.path) == 3
