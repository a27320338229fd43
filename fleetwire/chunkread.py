"""A relayed upload's chunks read straight into their frames, ahead of the credit, in a thread of its own.

Why: a relayed upload used to read its source a MiB at a time into new ``bytes`` (one hop to
the loop's default executor per MiB), then encode each 256 KiB chunk, i.e. copy its bytes into
a new frame. Here each chunk's frame is laid out in a buffer first (protocol/chunkview.py
``frame_into``: the names and offsets around the data, byte for byte the encoded message) and
the source's bytes are read into the middle of it (``preadv``, up to :data:`GROUP` chunks a
call): the frame goes to the session as it is, and the bytes are copied once, from the page
cache into the frame.

Buffers are reused, and bounded: a frame's buffer is free again once the receiver acknowledged
its last byte (the credit says so: it was sent, so the session no longer holds it). The reader
thread fills free buffers ahead of the credit, at most ``buffers`` of them (a stream's window
and a little more); it waits while none is free. It wakes the loop (``wake``, through
``call_soon_threadsafe``) after each group of frames it filled. An in-memory source is copied
into its frames on the loop instead (a ``memcpy`` per chunk: no thread).

A reader serves one opening of a stream: a stream opened again (resumed) gets a new reader,
and what the old one's frames were is never reused.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import os
import queue
import threading
from collections.abc import Callable
from typing import Any

from fleetwire.data import DataTransferError, Source
from protocol.chunkview import MAX_OVERHEAD, frame_into
from protocol.messages import DataChunk
from protocol.relay import MAX_CHUNK_BYTES

__all__ = ["GROUP", "FrameReader"]

GROUP = 4  # chunks the reader thread reads in one call and hands over at once (1 MiB)


class FrameReader:
    """Frames of ``source``'s chunks from ``offset``, ready to post (see the module docstring).

    Args:
        source: the input.
        key: (plan id, attempt, name): the chunks' fields.
        stream: the stream's id (``data_open.stream``), on every chunk.
        offset: the first byte to send (the worker's acknowledged offset).
        buffers: frames that may exist at once (sent and not acknowledged, or filled and not sent).
        wake: called on the loop when frames were filled (or the reader failed).
        chunk: data bytes per chunk.
    """

    def __init__(self, source: Source, key: tuple[str, int, str], offset: int, *, buffers: int,
                 wake: Callable[[], None], chunk: int = MAX_CHUNK_BYTES, stream: int = 0) -> None:
        self._source = source
        self._key = key
        self._stream = stream
        self._chunk = chunk
        self._buffers = self._initial = max(GROUP + 1, buffers)
        self._made = 0
        self._free: collections.deque[bytearray] = collections.deque()  # the loop's (in-memory sources)
        self._ready: collections.deque[tuple[memoryview, int, bytearray]] = collections.deque()  # frame, end, buffer
        self._sent: collections.deque[tuple[int, bytearray]] = collections.deque()  # end, buffer: awaiting the ack
        self._next = offset  # the first byte not yet in a frame
        self.error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self._returned: queue.SimpleQueue[bytearray | None] = queue.SimpleQueue()  # freed buffers, to the thread
        self._stopped = False
        if source.data is None:
            self._loop = asyncio.get_running_loop()
            self._wake = wake
            self._thread = threading.Thread(target=self._read, name="fleetwire-relay-read", daemon=True)
            self._thread.start()

    def take(self) -> tuple[memoryview, int] | None:
        """The next frame and the offset just past its data; None: not read yet (``wake`` is called when it is).

        The frame is the caller's to send; its buffer is reused once :meth:`acked` passed its end.

        Raises:
            DataTransferError: the source shrank; OSError: it could not be read.
        """
        if self.error is not None:
            raise self.error
        data = self._source.data
        if data is not None and not self._ready and self._next < self._source.size:  # in memory: fill on the loop
            buffer = self._free.popleft() if self._free else bytearray(self._chunk + MAX_OVERHEAD)
            frame, view = self._frame(buffer, self._next)
            view[:] = data[self._next : self._next + len(view)]
            self._next += len(view)
            self._ready.append((frame, self._next, buffer))
        if not self._ready:
            return None
        frame, end, buffer = self._ready.popleft()
        self._sent.append((end, buffer))
        return frame, end

    def acked(self, offset: int) -> None:
        """The receiver holds the bytes before ``offset``: the buffers of frames that end there are free."""
        sent = self._sent
        while sent and sent[0][0] <= offset:
            buffer = sent.popleft()[1]
            if self._thread is None:
                self._free.append(buffer)
            else:
                self._returned.put(buffer)

    def allow(self, buffers: int) -> None:
        """Let ``buffers`` frames exist at once from now on, if that is more than before (the window grew)."""
        extra = buffers - self._buffers
        if extra > 0:
            self._buffers = buffers
            if self._thread is not None:  # the thread may be waiting for a free buffer: hand it new ones
                for _ in range(extra):
                    self._returned.put(bytearray(self._chunk + MAX_OVERHEAD))

    def close(self) -> None:
        """Stop reading (the thread ends on its own, closing the file); no frame of this reader is reused."""
        self._stopped = True
        self._returned.put(None)
        self._ready.clear()
        self._sent.clear()
        self._free.clear()

    # ------------------------------------------------------------------ the reader thread

    def _frame(self, buffer: bytearray, offset: int) -> tuple[memoryview, memoryview]:
        size = min(self._chunk, self._source.size - offset)
        plan_id, attempt, name = self._key
        msg = DataChunk(plan_id=plan_id, attempt=attempt, name=name, offset=offset, direction="put",
                        last=offset + size >= self._source.size, stream=self._stream)
        return frame_into(buffer, msg, size)

    def _buffer(self, block: bool) -> bytearray | None:
        """A free buffer (a new one while fewer than allowed exist); None: stopped, or none free and not ``block``."""
        with contextlib.suppress(queue.Empty):
            return self._returned.get_nowait()
        if self._made < self._initial:
            self._made += 1
            return bytearray(self._chunk + MAX_OVERHEAD)
        return self._returned.get() if block else None

    def _read(self) -> None:
        path = self._source.path
        try:
            assert path is not None
            fd = os.open(path, os.O_RDONLY)
        except BaseException as exc:
            self._fail(exc)
            return
        try:
            if hasattr(os, "posix_fadvise"):
                os.posix_fadvise(fd, self._next, 0, os.POSIX_FADV_SEQUENTIAL)
            size = self._source.size
            while self._next < size and not self._stopped:
                group: list[tuple[memoryview, memoryview, bytearray]] = []
                offset = self._next
                while len(group) < GROUP and offset < size:
                    buffer = self._buffer(block=not group)
                    if buffer is None or self._stopped:
                        break
                    frame, view = self._frame(buffer, offset)
                    group.append((frame, view, buffer))
                    offset += len(view)
                if not group or self._stopped:
                    return
                _read_fully(fd, [view for _, view, _ in group], self._next, self._source.name)
                filled = [(frame, self._next + _ends(group, i), buffer) for i, (frame, _, buffer) in enumerate(group)]
                self._next = offset
                with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits any more
                    self._loop.call_soon_threadsafe(self._deliver, filled)
        except BaseException as exc:
            self._fail(exc)
        finally:
            os.close(fd)

    def _deliver(self, filled: list[tuple[memoryview, int, bytearray]]) -> None:
        if not self._stopped:
            self._ready.extend(filled)
            self._wake()

    def _fail(self, exc: BaseException) -> None:
        def report() -> None:
            if self.error is None:
                self.error = exc
            self._wake()

        with contextlib.suppress(RuntimeError):
            self._loop.call_soon_threadsafe(report)


def _ends(group: list[tuple[memoryview, memoryview, Any]], index: int) -> int:
    """Bytes of the group's data up to and including frame ``index``."""
    return sum(len(view) for _, view, _ in group[: index + 1])


def _read_fully(fd: int, views: list[memoryview], offset: int, name: str) -> None:
    """Fill ``views`` with the file's bytes from ``offset`` (``preadv``: one call, more only after a short read)."""
    while views:
        got = os.preadv(fd, views, offset)
        if got == 0:
            raise DataTransferError(f"input {name!r}: the file shrank while uploading")
        offset += got
        while views and got >= len(views[0]):
            got -= len(views[0])
            views = views[1:]
        if views and got:
            views[0] = views[0][got:]
