"""What both committers keep while batches wait for their commit: the payloads to release in
order once durable, and the backpressure of the bytes of frames behind them.

The server's readers await :meth:`Backlog.drained` after a frame that left :attr:`Backlog.over`
true, so a peer streaming faster than the disk is held back by TCP instead of growing the
coordinator (docs/OPERATIONS.md, ``--max-commit-backlog-bytes``). Both committers keep one:
coordinator/io/stores/commit.py (SQLite, memory) and coordinator/io/stores/pg_commit.py (PostgreSQL).

A graceful stop awaits :meth:`Backlog.settled` (bounded by its own timeout) before it closes the sessions, so
that the frames of the steps whose commit was pending (workers' acks among them) go out first
(coordinator/io/frontdoor/core_driver.py ``flush_acks``).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import Callable
from typing import Generic, TypeVar

__all__ = ["Backlog"]

T = TypeVar("T")


class Backlog(Generic[T]):
    """Batches waiting for their commit: their payloads, released in order once durable, and their bytes.

    Shared by the committers (coordinator/io/stores/commit.py, coordinator/io/stores/pg_commit.py): :meth:`queued`
    when a batch is submitted, :meth:`after` for a payload that needs no records, :meth:`committed`
    when every batch up to a ticket is durable, :meth:`fail` when the store failed (nothing more
    is released, readers waiting in :meth:`drained` return, :meth:`settled` answers False: the core stops).

    Args:
        release: called on the event loop with each payload once its batch (and every earlier one)
            is committed.
        on_failure: called on the event loop, once, when the store failed.
        max_backlog_bytes: :attr:`over` past this many bytes waiting for a commit (0: no bound).
    """

    def __init__(self, release: Callable[[T], None], on_failure: Callable[[BaseException], None],
                 max_backlog_bytes: int = 0) -> None:
        self.max_backlog_bytes = max_backlog_bytes  # 0: no bound
        self.backlog_bytes = 0  # sizes given to submit() still waiting for their commit
        self.held_back = 0  # times a reader waited in drained()
        self.failed: BaseException | None = None
        self.submitted = 0  # ticket of the latest batch
        self._release = release
        self._on_failure = on_failure
        self._waiting: deque[tuple[int, T]] = deque()  # (ticket, payload) not yet released
        self._sizes: deque[tuple[int, int]] = deque()  # (ticket, size) of sized batches
        self._below: asyncio.Event | None = None
        self._settling: deque[tuple[int, asyncio.Future[bool]]] = deque()  # settled()'s waits: (ticket, answer)

    @property
    def pending(self) -> int:
        """Payloads waiting for a commit."""
        return len(self._waiting)

    @property
    def over(self) -> bool:
        """Whether the backlog is past ``max_backlog_bytes`` (readers should await :meth:`drained`)."""
        return bool(self.max_backlog_bytes) and self.backlog_bytes > self.max_backlog_bytes

    async def drained(self) -> None:
        """Return once the backlog is at most half of ``max_backlog_bytes`` (at once if it is)."""
        if not self.over:
            return
        self.held_back += 1
        if self._below is None:
            self._below = asyncio.Event()
        while self.backlog_bytes > self.max_backlog_bytes // 2 and self.failed is None:
            self._below.clear()
            await self._below.wait()

    async def settled(self) -> bool:
        """Wait until every batch submitted so far is durable and its payload released (at once if none waits).

        True once they are (the payloads released before it returns, :meth:`after`'s included); False when the
        store failed first (nothing more is ever released). Unbounded itself: the caller bounds it (its
        ``asyncio.timeout``; a wait cancelled so is forgotten).
        """
        if self.failed is not None:
            return False
        if not self._waiting:
            return True
        answer: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        wait = (self.submitted, answer)
        self._settling.append(wait)
        try:
            return await answer
        except asyncio.CancelledError:  # the caller's timeout: this wait is not answered later
            with contextlib.suppress(ValueError):
                self._settling.remove(wait)
            raise

    def queued(self, payload: T, size: int) -> int:
        """A batch of ``size`` bytes of frames was submitted; ``payload`` goes once it is durable. Its ticket."""
        self.submitted += 1
        ticket = self.submitted
        if size:
            self.backlog_bytes += size
            self._sizes.append((ticket, size))
        self._waiting.append((ticket, payload))
        return ticket

    def after(self, payload: T) -> None:
        """Release ``payload`` once every batch submitted so far is durable (at once if none waits)."""
        if self.failed is not None:
            return
        if not self._waiting:
            self._release(payload)
        else:
            self._waiting.append((self.submitted, payload))

    def committed(self, ticket: int) -> None:
        """Every batch up to ``ticket`` is durable: their bytes leave the backlog, their payloads go."""
        sizes = self._sizes
        while sizes and sizes[0][0] <= ticket:
            self.backlog_bytes -= sizes.popleft()[1]
        if self._below is not None and self.backlog_bytes <= self.max_backlog_bytes // 2:
            self._below.set()
        waiting = self._waiting
        while waiting and waiting[0][0] <= ticket and self.failed is None:
            self._release(waiting.popleft()[1])
        if self._settling:
            self._settle(ticket)

    def _settle(self, ticket: int) -> None:
        """Answer the :meth:`settled` waits up to ``ticket`` (released by now): True, or False once the store failed."""
        settling, ok = self._settling, self.failed is None
        while settling and (settling[0][0] <= ticket or not ok):
            answer = settling.popleft()[1]
            if not answer.done():
                answer.set_result(ok)

    def fail(self, exc: BaseException) -> None:
        """The store failed: nothing more is released; the first failure is reported."""
        if self._below is not None:
            self._below.set()  # nobody waits on a store that failed: the core stops
        if self.failed is None:
            self.failed = exc
            self._waiting.clear()
            self._settle(0)  # every wait answered False: nothing more is released
            self._on_failure(exc)
