"""``Backlog.settled``: an awaitable "every batch submitted so far is durable and released"
(coordinator/io/stores/backlog.py), which a graceful stop awaits before it closes the sessions
(coordinator/io/frontdoor/core_driver.py ``flush_acks``)."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest

from coordinator.io.stores.backlog import Backlog
from coordinator.io.stores.commit import GroupCommitter
from coordinator.io.stores.store import MemoryStore

pytestmark = pytest.mark.timeout(30)


def backlog() -> tuple[Backlog[str], list[str], list[BaseException]]:
    released: list[str] = []
    failures: list[BaseException] = []
    return Backlog(released.append, failures.append), released, failures


async def started(coro: Any) -> asyncio.Task[bool]:
    """``coro`` in a task that has run its first step (its wait is registered)."""
    task = asyncio.ensure_future(coro)
    await asyncio.sleep(0)  # one loop turn: the task just made runs first
    return task


async def test_settled_answers_true_at_once_when_nothing_waits() -> None:
    """No batch waits for a commit: settled() is True without waiting."""
    b, _, _ = backlog()
    assert await asyncio.wait_for(b.settled(), 0.5) is True
    b.queued("a", 0)
    b.committed(1)
    assert await asyncio.wait_for(b.settled(), 0.5) is True


async def test_settled_resolves_when_the_last_batch_submitted_before_it_commits() -> None:
    """settled() waits for the last batch submitted before the call, not an earlier one nor a later one; the
    payloads (after()'s included) are released by the time it answers True."""
    b, released, _ = backlog()
    b.queued("a", 0)
    b.queued("b", 0)
    b.after("c")
    waiting = await started(b.settled())
    b.queued("d", 0)  # after the call: not waited for
    b.committed(1)
    await asyncio.sleep(0)
    assert not waiting.done()
    assert released == ["a"]
    b.committed(2)
    assert await asyncio.wait_for(waiting, 0.5) is True
    assert released == ["a", "b", "c"]
    assert b.pending == 1  # "d" still waits


async def test_settled_does_not_resolve_true_on_a_failed_store() -> None:
    """The store fails while settled() waits: it answers False (nothing more is released), and at once False after."""
    b, released, failures = backlog()
    b.queued("a", 0)
    waiting = await started(b.settled())
    b.fail(OSError("disk gone"))
    assert await asyncio.wait_for(waiting, 0.5) is False
    assert released == [] and len(failures) == 1
    assert await asyncio.wait_for(b.settled(), 0.5) is False


async def test_settled_is_bounded_by_the_callers_timeout() -> None:
    """A commit that never comes: the caller's timeout ends the wait, which is then forgotten (a later commit
    answers nobody and releases as before)."""
    b, released, _ = backlog()
    b.queued("a", 0)
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(0.05):
            await b.settled()
    assert not b._settling
    b.committed(1)
    assert released == ["a"]


class GatedStore(MemoryStore):
    """The memory store written by the committer's writer thread (as a durable store is); writes wait on a gate."""

    blocking = True

    def __init__(self) -> None:
        super().__init__()
        self.gate, self.entered = threading.Event(), threading.Event()

    def write(self, records: Any) -> None:
        self.entered.set()
        self.gate.wait(20)
        super().write(records)


async def test_a_group_committers_settled_resolves_once_its_writer_thread_commits() -> None:
    """A GroupCommitter whose writer thread holds the commit: settled() waits until that commit is reported and the
    payload released."""
    store = GatedStore()
    released: list[str] = []
    committer: GroupCommitter[str] = GroupCommitter(store, released.append, lambda exc: None, inline_max_records=0)
    committer.start()
    try:
        committer.submit([], "step", 0)
        assert await asyncio.to_thread(store.entered.wait, 10)
        waiting = await started(committer.settled())
        assert not waiting.done() and released == []
        store.gate.set()
        assert await asyncio.wait_for(waiting, 10) is True
        assert released == ["step"]
    finally:
        store.gate.set()
        await committer.close()
