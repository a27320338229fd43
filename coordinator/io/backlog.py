"""Backpressure from the store: the bytes of received frames waiting for their commit.

The server's readers await :meth:`Backlog.drained` after a frame that left :attr:`Backlog.over`
true, so a peer streaming faster than the disk is held back by TCP instead of growing the
coordinator (docs/OPERATIONS.md, ``--max-commit-backlog-bytes``). Both committers keep one:
coordinator/io/commit.py (SQLite, memory) and coordinator/io/pg_commit.py (PostgreSQL).
"""

from __future__ import annotations

import asyncio
from collections import deque

__all__ = ["Backlog"]


class Backlog:
    """The bytes of received frames waiting for their commit, and the readers held back by them.

    Shared by the committers (this module's, coordinator/io/pg_commit.py's): :meth:`added` when a
    batch is submitted, :meth:`committed` when every batch up to a ticket is durable,
    :meth:`wake_all` when the store failed (nobody waits on a failed store: the core stops).
    """

    def __init__(self, max_backlog_bytes: int = 0) -> None:
        self.max_backlog_bytes = max_backlog_bytes  # 0: no bound
        self.backlog_bytes = 0  # sizes given to submit() still waiting for their commit
        self.held_back = 0  # times a reader waited in drained()
        self.failed: BaseException | None = None
        self._sizes: deque[tuple[int, int]] = deque()  # (ticket, size) of sized batches
        self._below: asyncio.Event | None = None

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

    def added(self, ticket: int, size: int) -> None:
        """Batch ``ticket`` brought ``size`` bytes of frames."""
        if size:
            self.backlog_bytes += size
            self._sizes.append((ticket, size))

    def committed(self, ticket: int) -> None:
        """Every batch up to ``ticket`` is durable: their bytes leave the backlog."""
        sizes = self._sizes
        while sizes and sizes[0][0] <= ticket:
            self.backlog_bytes -= sizes.popleft()[1]
        if self._below is not None and self.backlog_bytes <= self.max_backlog_bytes // 2:
            self._below.set()

    def wake_all(self) -> None:
        """The store failed: readers waiting in :meth:`drained` return."""
        if self._below is not None:
            self._below.set()
