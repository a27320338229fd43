"""The two pipes of the SQLite store's writer process, the parent's ends: :class:`RequestWriter`, :class:`ReplyReader`.

What they own: the bytes. The requests not yet written (the pipe had no room) and the replies read
and not yet taken; how each pipe is written or read, blocking (a thread's) or never waiting (the
event loop's, coordinator/io/stores/writer_process.py ``WriterProcess.serve_on``). What they do not:
the groups, their order and their answers, the failure rules (writer_process.py), the requests'
and replies' format (writer_wire.py).

Rules: on the loop nothing here waits (a request the pipe has no room for goes when it has:
``loop.add_writer``; a reply is taken only once it is whole: :meth:`ReplyReader.whole_reply`);
a pipe that closed or broke is reported as such (``EOFError``, ``OSError``), never as a failure
of the store: the caller names it.
"""

from __future__ import annotations

import os
import select
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from coordinator.io.stores.writer_wire import FAILED, REPLY_HEADER

if TYPE_CHECKING:
    import asyncio

__all__ = ["READ_BYTES", "ReplyReader", "RequestWriter"]

READ_BYTES = 1 << 20  # a reply read asks for this much at least: the keys of a busy group come with their header


class RequestWriter:
    """The child's stdin: requests written in order, whatever the pipe's room.

    Args:
        fd: the pipe's write end.
    """

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.unsent = bytearray()  # requests the pipe had no room for yet (in order: they go first)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._on_error: Callable[[OSError], None] | None = None

    def serve_on(self, loop: asyncio.AbstractEventLoop, on_error: Callable[[OSError], None]) -> None:
        """From now on :meth:`write_soon` never waits (the pipe's end non-blocking: the caller's); what the pipe
        has no room for is written by ``loop`` when it has, and a write there that fails calls ``on_error``."""
        self._loop, self._on_error = loop, on_error

    def leave(self) -> None:
        """Undo :meth:`serve_on` (on the loop's thread): what is unsent stays, for the next blocking request."""
        loop, self._loop = self._loop, None
        if loop is not None:
            loop.remove_writer(self.fd)

    def discard(self) -> None:
        """The child is gone: what is unsent is dropped, and the loop no longer waits for room."""
        self.unsent.clear()
        if self._loop is not None:
            self._loop.remove_writer(self.fd)

    def write_soon(self, parts: Sequence[bytes]) -> None:
        """On the loop: ``parts`` written now as far as the pipe has room, the rest kept, in order, for ``add_writer``
        (one ``writev`` either way: no copy of a large body when it fits).

        Raises:
            OSError: the pipe broke (the child is gone).
        """
        if self.unsent:
            self.unsent += b"".join(parts)
            return
        try:
            sent = os.writev(self.fd, parts)
        except BlockingIOError:
            sent = 0
        left = sum(map(len, parts)) - sent
        if left:
            self.unsent += b"".join(parts)[-left:]
            assert self._loop is not None
            self._loop.add_writer(self.fd, self._writable)

    def _writable(self) -> None:
        try:
            sent = os.write(self.fd, self.unsent)
        except BlockingIOError:
            return
        except OSError as exc:
            assert self._on_error is not None
            self._on_error(exc)
            return
        del self.unsent[:sent]
        if not self.unsent and self._loop is not None:
            self._loop.remove_writer(self.fd)

    def take_unsent(self) -> bytes:
        """What is unsent, for a blocking request to write first (and no longer kept here)."""
        unsent = bytes(self.unsent)
        self.unsent.clear()
        return unsent

    def flush(self, timeout_s: float) -> bool:
        """What is unsent written now, waiting up to ``timeout_s`` for room (not on the loop); False: not all of it.

        Raises:
            OSError: the pipe broke.
        """
        deadline = time.monotonic() + timeout_s
        while self.unsent and select.select([], [self.fd], [], max(0.0, deadline - time.monotonic()))[1]:
            try:
                del self.unsent[: os.write(self.fd, self.unsent)]
            except BlockingIOError:
                continue
        if self._loop is not None:
            self._loop.remove_writer(self.fd)
        return not self.unsent


class ReplyReader:
    """The child's stdout: the replies, read in as few ``os.read`` calls as the pipe allows.

    Each read gives the GIL up, and a receiver thread then waits for the busy loop to drop it again (up to a
    switch interval): a header and its keys read apart (and the keys in 64 KiB pieces) made a busy group's reply
    wait ~1 ms a read. So a reply and its keys come in one read when they fit, and the bytes read and not yet
    taken are kept.

    Args:
        fd: the pipe's read end.
    """

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.buffer = b""  # read, not yet taken
        self._poll = select.poll()
        self._poll.register(fd, select.POLLIN)

    def readable(self) -> bool:
        """Bytes read and not taken, or the pipe readable now (never waits)."""
        return bool(self.buffer) or bool(self._poll.poll(0))

    def read_available(self) -> str | None:
        """On the loop (the pipe's end non-blocking): what the pipe holds, read now. None; else the pipe ended:
        ``""`` (closed: the child exited or was killed) or the error's words in brackets, after a space."""
        try:
            while True:
                data = os.read(self.fd, READ_BYTES)
                if not data:
                    return ""
                self.buffer = self.buffer + data if self.buffer else data
                if len(data) < READ_BYTES:
                    return None
        except BlockingIOError:
            return None
        except OSError as exc:
            return f" ({exc})"

    def whole_reply(self) -> bool:
        """Whether the bytes read hold a whole reply (its header, then its keys or its error's text)."""
        buffer = self.buffer
        if len(buffer) < REPLY_HEADER.size:
            return False
        value, count, size = REPLY_HEADER.unpack_from(buffer)
        return len(buffer) >= REPLY_HEADER.size + int(count if value == FAILED else size)

    def next_reply(self, timeout_s: float) -> tuple[int, int, bytes]:
        """The next reply: its value (a generation, BUSY or FAILED), its count and its keys (FAILED: the error's
        text), waiting up to ``timeout_s`` for its start (not on the loop, unless :meth:`whole_reply`).

        Raises:
            TimeoutError: no reply began in time.
            EOFError: the pipe closed before a whole reply.
        """
        if len(self.buffer) < REPLY_HEADER.size and not self._poll.poll(max(0, int(timeout_s * 1000))):
            raise TimeoutError
        value, count, size = REPLY_HEADER.unpack(self._take(REPLY_HEADER.size))
        body = self._take(count if value == FAILED else size) if (value == FAILED or size) else b""
        return int(value), int(count), body

    def _take(self, size: int) -> bytes:
        """The next ``size`` bytes of the replies, read in pieces of what the pipe holds (blocking).

        Raises:
            EOFError: the pipe closed first.
        """
        buffer = self.buffer
        while len(buffer) < size:
            try:
                data = os.read(self.fd, max(size - len(buffer), READ_BYTES))
            except BlockingIOError:  # on the loop (serve_on): a reply waited for in full (write, wait_ready)
                self._poll.poll()
                continue
            if not data:
                self.buffer = buffer
                raise EOFError
            buffer = buffer + data if buffer else data
        self.buffer = buffer[size:]
        return buffer[:size] if len(buffer) > size else buffer
