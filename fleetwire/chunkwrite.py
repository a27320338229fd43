"""A stream of chunks written to a file and hashed in two threads of their own (a relayed download's writer).

Why: a relayed download (fleetwire/relay.py) arrives on the event loop as 256 KiB chunks.
Written and hashed one after the other in one thread, the slower of the two (the hash: blake3
runs at about the speed a loopback websocket carries) added to the other, and the client fell
behind the coordinator. Here a writer thread (``write``, then the file's write-behind,
fleetwire/writeback.py, so a big download does not pile up in the page cache) and a hasher
thread each take every batch, in the order given; file writes, hashlib and ``sync_file_range``
release the GIL, so the two overlap each other and the loop's reading of the next chunks.

Bounded: at most ``ahead`` batches are handed over and not yet both written and hashed;
:meth:`ChunkWriter.put` waits (on the loop) for the oldest beyond that. Each thread tells the
loop once per batch (``call_soon_threadsafe``) that it is done with it. The first error of
either thread (``ENOSPC``, a hash that raised) stops both and is raised by the next
:meth:`~ChunkWriter.put` or :meth:`~ChunkWriter.finish`.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import queue
import threading
from collections.abc import Callable, Sequence
from typing import IO, Protocol

from fleetwire.writeback import WriteBehind

__all__ = ["ChunkWriter", "Hasher"]

Chunk = bytes | bytearray | memoryview
_Item = tuple[Sequence[Chunk], "asyncio.Future[None]"] | None


class Hasher(Protocol):
    """What checks the bytes (fleetwire/data.py ``OutputCheck``): ``update`` is called from the hasher thread."""

    def update(self, data: bytes | bytearray | memoryview) -> None: ...


class ChunkWriter:
    """Writes batches of chunks to ``file`` from its current position and hashes them into ``check``.

    Use from one event loop: ``put`` each batch in order, then ``finish``; ``close`` (always,
    e.g. in ``finally``) stops the threads, dropping what was not written yet.

    Args:
        file: a binary file open for writing (the chunks go after its current position).
        check: receives every byte in order (None: nothing is hashed, one thread).
        ahead: batches handed over and not yet done before ``put`` waits.
    """

    def __init__(self, file: IO[bytes], check: Hasher | None = None, *, ahead: int = 4) -> None:
        self._file = file
        self._check = check
        self._ahead = max(1, ahead)
        self._loop = asyncio.get_running_loop()
        self._end = 0
        with contextlib.suppress(OSError):  # a pipe: no position (and no write-behind)
            self._end = file.tell()
        self._behind = WriteBehind(file.fileno(), self._end)
        self._stopped = False
        self.error: BaseException | None = None
        """The first error of either thread (raised by ``put`` and ``finish``)."""
        self._pending: collections.deque[list[asyncio.Future[None]]] = collections.deque()
        self._queues: list[queue.SimpleQueue[_Item]] = []
        self._threads: list[threading.Thread] = []
        self._start(self._write, "fleetwire-output-write")
        if check is not None:
            self._start(check.update, "fleetwire-output-hash")

    def _start(self, work: Callable[[Chunk], None], name: str) -> None:
        jobs: queue.SimpleQueue[_Item] = queue.SimpleQueue()
        thread = threading.Thread(target=self._run, args=(jobs, work), name=name, daemon=True)
        self._queues.append(jobs)
        self._threads.append(thread)
        thread.start()

    async def put(self, batch: Sequence[Chunk]) -> None:
        """Hand ``batch`` to the threads; waits while more than ``ahead`` batches are under way.

        Raises:
            OSError, Exception: what a thread failed with.
        """
        self._raise()
        done: list[asyncio.Future[None]] = []
        for jobs in self._queues:
            future = self._loop.create_future()
            done.append(future)
            jobs.put((batch, future))
        self._pending.append(done)
        while len(self._pending) > self._ahead:
            await self._settle_oldest()

    async def finish(self) -> None:
        """Wait until every batch is written and hashed; the threads end.

        Raises:
            OSError, Exception: what a thread failed with.
        """
        while self._pending:
            await self._settle_oldest()
        self.close()
        self._raise()

    def close(self) -> None:
        """Stop the threads (what they have not started on is dropped) and wait for them. Idempotent."""
        self._stopped = True
        for jobs in self._queues:
            jobs.put(None)
        for thread in self._threads:
            thread.join()
        self._queues.clear()
        self._threads.clear()

    async def _settle_oldest(self) -> None:
        for future in self._pending.popleft():
            await future
        self._raise()

    def _raise(self) -> None:
        if self.error is not None:
            raise self.error

    def _write(self, chunk: Chunk) -> None:
        self._file.write(chunk)
        self._end += len(chunk)
        self._behind.wrote(self._end)

    def _run(self, jobs: queue.SimpleQueue[_Item], work: Callable[[Chunk], None]) -> None:
        while (item := jobs.get()) is not None:
            batch, future = item
            try:
                if not self._stopped:
                    for chunk in batch:
                        work(chunk)
            except BaseException as exc:  # reported on the loop by put/finish
                if self.error is None:
                    self.error = exc
                self._stopped = True
            finally:
                with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits any more
                    self._loop.call_soon_threadsafe(_done, future)


def _done(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)
