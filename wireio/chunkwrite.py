"""A stream of chunks written to a file and hashed in two threads of their own (the SDK's download writers).

:class:`ChunkWriter` takes batches from the event loop (a relayed download); :class:`BufferWriter`
takes buffers a transfer thread fills from its socket (a direct download, fleetwire/direct.py).

Why: a relayed download (fleetwire/relay.py) arrives on the event loop as 256 KiB chunks.
Written and hashed one after the other in one thread, the slower of the two (the hash: blake3
runs at about the speed a loopback websocket carries) added to the other, and the client fell
behind the coordinator. Here a writer thread (``write``, then the file's write-behind,
wireio/writeback.py, so a big download does not pile up in the page cache) and a hasher
thread each take every batch, in the order given; file writes, hashlib and ``sync_file_range``
release the GIL, so the two overlap each other and the loop's reading of the next chunks.

With ``direct_io`` (a fresh file on Linux), the writer copies the chunks into a page-aligned 4 MiB
staging buffer and writes each full one with ``O_DIRECT``: the disk reads it from there, with no
page-cache copy and nothing to write back. Measured on the 2-core VM: ~0.1 CPU s per GiB (copy and
write) where paced buffered writes cost ~0.28, and no page-cache pages to fault in; the relay
carries ~0.6 GB/s there, well below the disk's 1.5 GB/s of ``O_DIRECT`` writes, so the wait for
the disk costs no speed. The last, partial buffer is written through the page cache (``O_DIRECT``
is cleared for it). A file system that refuses ``O_DIRECT`` (tmpfs on older kernels) is written
as without it.

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
import mmap
import os
import queue
import stat
import threading
from collections.abc import Callable, Sequence
from typing import IO, Protocol

from wireio.writeback import DIRECT_ALIGN, O_DIRECT, WriteBehind, pwrite_all

__all__ = ["STAGE_BYTES", "WRITE_BUFFERS", "WRITE_BUFFER_BYTES", "BufferWriter", "ChunkWriter", "Hasher"]

STAGE_BYTES = 4 << 20  # the O_DIRECT staging buffer: a whole number of pages
WRITE_BUFFERS = 8  # BufferWriter's buffers: some filling, some written and hashed, some spare
WRITE_BUFFER_BYTES = 1 << 20  # small: what is left to write and hash once the last byte arrived is small too

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
        direct_io: write through an aligned staging buffer with ``O_DIRECT`` where the file takes it.
    """

    def __init__(self, file: IO[bytes], check: Hasher | None = None, *, ahead: int = 4,
                 direct_io: bool = False) -> None:
        self._file = file
        self._check = check
        self._ahead = max(1, ahead)
        self._loop = asyncio.get_running_loop()
        self._end = 0
        with contextlib.suppress(OSError):  # a pipe: no position (and no write-behind)
            self._end = file.tell()
        self._behind = WriteBehind(file.fileno(), self._end)
        self._stage: mmap.mmap | None = None  # O_DIRECT: the bytes not written yet (a page-aligned map)
        self._staged = 0
        if direct_io and O_DIRECT and not self._end % DIRECT_ALIGN and _regular(file) and _set_direct(file, True):
            self._stage = mmap.mmap(-1, STAGE_BYTES)
        self.direct_bytes = 0
        """Of what was written, the bytes that went by ``O_DIRECT``."""
        self._finishing = False
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
        self._finishing = True  # the writer thread writes what is staged before it ends
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
        stage = self._stage
        if stage is None:
            self._file.write(chunk)
            self._end += len(chunk)
            self._behind.wrote(self._end)
            return
        view = memoryview(chunk).cast("B")
        taken = 0
        while taken < view.nbytes:
            count = min(STAGE_BYTES - self._staged, view.nbytes - taken)
            stage[self._staged : self._staged + count] = view[taken : taken + count]
            self._staged += count
            taken += count
            if self._staged == STAGE_BYTES:
                self._write_stage(STAGE_BYTES)

    def _write_stage(self, length: int) -> None:
        """Write the first ``length`` staged bytes (a multiple of the alignment) with O_DIRECT at the end."""
        assert self._stage is not None
        with memoryview(self._stage) as view, view[:length] as staged:
            pwrite_all(self._file.fileno(), staged, self._end)
        self._end += length
        self.direct_bytes += length
        self._staged -= length
        if self._staged:
            self._stage.move(0, length, self._staged)

    def _drain_stage(self) -> None:
        """The end: the aligned part of what is staged by O_DIRECT, the rest through the page cache."""
        if self._stage is None:
            return
        aligned = self._staged - self._staged % DIRECT_ALIGN
        if aligned:
            self._write_stage(aligned)
        if self._staged:
            _set_direct(self._file, False)
            self._file.seek(self._end)
            self._file.write(self._stage[: self._staged])
            self._file.flush()
            self._end += self._staged
            self._staged = 0
        self._file.seek(self._end)

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
        if work == self._write and self._finishing and self.error is None:
            try:
                self._drain_stage()  # finish(): every batch is written; what is staged goes now
            except BaseException as exc:  # raised by finish() once the threads ended
                self.error = exc


def _regular(file: IO[bytes]) -> bool:
    """Whether ``file`` is a regular file (``O_DIRECT`` on a pipe means packet mode, not this)."""
    try:
        return stat.S_ISREG(os.fstat(file.fileno()).st_mode)
    except (OSError, ValueError):
        return False


def _set_direct(file: IO[bytes], on: bool) -> bool:
    """Turn ``O_DIRECT`` on or off for ``file``'s descriptor (Linux lets ``F_SETFL`` change it): whether it took."""
    import fcntl

    try:
        fd = file.fileno()
        flags = fcntl.fcntl(fd, fcntl.F_GETFL)
        fcntl.fcntl(fd, fcntl.F_SETFL, (flags | O_DIRECT) if on else (flags & ~O_DIRECT))
        return bool(fcntl.fcntl(fd, fcntl.F_GETFL) & O_DIRECT) == on
    except (OSError, ValueError, AttributeError):
        return False


def _done(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


class BufferWriter:
    """Writes buffers to a file and hashes them, in two threads of their own, while the caller fills the next
    (the SDK's direct downloads, fleetwire/direct.py: a transfer thread fills them from its socket).

    A filled buffer goes to the writer thread (``write``, then the file's write-behind,
    wireio/writeback.py) and to the hasher thread (``check``) at once, and is free again once
    both are done with it: the write and the hash of one buffer and the filling of the next
    overlap (file writes, hashlib and ``recv_into`` all release the GIL). At most
    :data:`WRITE_BUFFERS` buffers of :data:`WRITE_BUFFER_BYTES` in all; small buffers keep what is
    left to do after the last byte arrived (the fixed cost at the end of a download) small.
    """

    def __init__(self, file: IO[bytes], check: Hasher | None = None) -> None:
        self._file = file
        self._check = check
        self._end = file.tell()  # where the next write lands
        self._behind = WriteBehind(file.fileno(), self._end)  # a big download does not pile up in the page cache
        self._free: queue.Queue[memoryview] = queue.Queue()
        for _ in range(WRITE_BUFFERS):
            self._free.put(memoryview(bytearray(WRITE_BUFFER_BYTES)))
        self._full: queue.Queue[memoryview | None] = queue.Queue()  # to write
        self._to_hash: queue.Queue[memoryview | None] = queue.Queue()
        self._written: queue.Queue[memoryview | None] = queue.Queue()  # written (the hasher frees them, in order)
        self._error: BaseException | None = None
        self._threads = [threading.Thread(target=self._write, name="fleetwire-data-write", daemon=True)]
        if check is not None:
            self._threads.append(threading.Thread(target=self._hash, name="fleetwire-data-hash", daemon=True))

    def __enter__(self) -> BufferWriter:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._full.put(None)
        self._to_hash.put(None)
        for thread in self._threads:
            thread.join()
        if self._error is not None and exc[0] is None:
            raise self._error

    def buffer(self) -> memoryview:
        """A free buffer (waits while all are being written or hashed)."""
        if self._error is not None:
            raise self._error
        return self._free.get()

    def write(self, part: memoryview) -> None:
        self._full.put(part)
        if self._check is not None:
            self._to_hash.put(part)

    def _write(self) -> None:
        while (part := self._full.get()) is not None:
            try:
                if self._error is None:
                    self._file.write(part)
                    self._end += len(part)
                    self._behind.wrote(self._end)
            except BaseException as exc:  # reported to the filling thread
                self._error = exc
            finally:
                if self._check is not None:
                    self._written.put(part)
                else:
                    self._free.put(memoryview(part.obj))  # type: ignore[arg-type]
        self._written.put(None)

    def _hash(self) -> None:
        assert self._check is not None
        while (part := self._to_hash.get()) is not None:
            try:
                if self._error is None:
                    self._check.update(part)
            except BaseException as exc:  # reported to the filling thread
                self._error = exc
            finally:
                self._written.get()  # the writer is done with it too (both take the buffers in the same order)
                self._free.put(memoryview(part.obj))  # type: ignore[arg-type]
