"""One HTTP/1.1 connection of the worker's data endpoint (worker_agent/dataplane.py), as a ``BufferedProtocol``.

Theory of operation: the transport reads straight into buffers this protocol hands it
(``recv_into``), so a request body is never copied on the event loop.

* *Head mode*: bytes land in a scratch buffer and gather in :attr:`HttpConnection.pending`
  until :meth:`read_head` finds the blank line (protocol/transfer/http1.py ``head_end``); past
  ``head_limit`` bytes without one the head is refused. Bytes after the head stay pending (the
  start of a body, or a pipelined request).
  The scratch buffer is the server's, one for all its connections (a :class:`Scratch`): the
  transport fills it and hands it back in one synchronous step (``get_buffer``, ``recv_into``,
  ``buffer_updated``: asyncio's socket and TLS transports and uvloop's alike), and its bytes are
  copied to ``pending`` at once. A 64 KiB buffer per connection made 1,200 idle sockets cost the
  worker 75 MiB of RSS. Head-mode reads are small (:data:`SCRATCH_BYTES`): what follows a head is
  best read in body mode, and not at all when the request is refused from its head.
* *Body mode* (:meth:`body`): the socket fills large preallocated buffers (``chunk`` bytes each,
  ``buffers`` of them; anonymous maps, so page-aligned: the spool may write them with
  ``O_DIRECT``, worker_agent/spool_files.py), each handed over whole to the caller, who stores it (in a thread) while
  the next one fills, then gives it back (:meth:`release`). The protocol never takes a byte past
  the body's length (the next request's bytes stay for the next head). When every buffer is
  full and not given back, reading pauses: memory stays ``buffers * chunk`` per upload, and a
  slow disk slows only its own uploader.
* Writing: :meth:`write` and :meth:`drain` (paused while the transport's buffer is over its
  high-water mark); outputs go with ``loop.sendfile(conn.transport, ...)``.
* Idle connections (accepted, or between keep-alive requests, waiting for a request head) hold
  a file descriptor and no ticket yet: :class:`IdleBudget` keeps at most ``limit`` of them, a
  new one past it aborting the *oldest* (the coordinator's pending-handshake discipline,
  coordinator/io/frontdoor/admission.py, which the worker cannot import). A real client sends its head
  at once, so it is almost never the oldest; an idle socket always becomes it.
* Before any of that, :func:`defer_accept` has the kernel hold a new connection until its first
  byte (``TCP_DEFER_ACCEPT``, as the coordinator's listeners do): an idle socket is not accepted
  at all for a while, so a loop that keeps many open costs the worker nothing and is not evicted
  (and reopened) over and over.
* Refusals repeated by one host (:class:`Repeats`): past a burst, the server holds each further
  refusal's answer for a while with reading paused (worker_agent/dataplane.py), so a loop of
  refused requests goes at the pace of the hold, not of the worker's answers.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import mmap
import resource
from collections.abc import AsyncGenerator, Callable
from typing import Any, Final

from protocol.transfer.http1 import head_end
from wireio.listening import LISTEN_BACKLOG, Repeats, defer_accept, raise_fd_limit

__all__ = ["LISTEN_BACKLOG", "HttpConnection", "IdleBudget", "Repeats", "Scratch", "defer_accept",
           "idle_budget", "raise_fd_limit"]

#: What one read takes in head mode: a request head with its ticket is well under this, and bytes read
#: past a head are copied twice (into ``pending``, then into a body buffer) where a body's are read
#: into its buffer directly. A refused request is answered from its head: with 64 KiB reads its
#: body was read, 64 KiB or more of it, only to be dropped (about a fifth of a refusal's cost).
SCRATCH_BYTES: Final = 4 << 10
FD_RESERVE: Final = 64  # fds kept free for the spool, the session, the log and the process's own needs


def idle_budget(configured: int) -> int:
    """The idle-connection budget: ``configured``, but at most a quarter of the fds the process may open (>= 8)."""
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    usable = (1 << 20) if soft == resource.RLIM_INFINITY else soft
    return max(8, min(configured, (usable - FD_RESERVE) // 4))


class Scratch:
    """The buffer head-mode reads land in, shared by every connection of one server (see the module docstring)."""

    __slots__ = ("view",)

    def __init__(self, size: int = SCRATCH_BYTES) -> None:
        self.view = memoryview(bytearray(size))


class HttpConnection(asyncio.BufferedProtocol):
    """One connection's reads and writes (see the module docstring).

    Args:
        on_open: called with the connection once it is made (the server starts its task there).
        head_limit: the largest request head accepted.
        scratch: where head-mode reads land (the server's, shared); None: one of its own.
    """

    def __init__(self, on_open: Callable[[HttpConnection], None], head_limit: int,
                 scratch: Scratch | None = None) -> None:
        self.transport: asyncio.Transport | None = None
        self.pending = bytearray()  # head mode: bytes read and not yet taken
        self._on_open = on_open
        self._head_limit = head_limit
        self._scratch = (scratch or Scratch()).view
        self._eof = False
        self._lost: BaseException | None = None
        self._wakeup: asyncio.Future[None] | None = None
        self._paused = False  # reading paused (buffers full, or a backlog of pending bytes)
        self._write_paused = False
        self._drains: collections.deque[asyncio.Future[None]] = collections.deque()
        self._loop = asyncio.get_running_loop()
        self._closed = self._loop.create_future()
        self.last_read = 0.0  # loop time of the last body bytes (or of reading resumed)
        # body mode
        self._body_left = 0  # body bytes still to read from the socket
        self._filling: mmap.mmap | None = None
        self._filled = 0
        self._ready: collections.deque[memoryview] = collections.deque()
        self._free: list[mmap.mmap] = []
        self._chunk = 0

    # ------------------------------------------------------------------ protocol callbacks

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # a stream transport (asyncio's or uvloop's)
        self._on_open(self)

    def get_buffer(self, sizehint: int) -> memoryview:
        if self._body_left:
            if self._filling is None:  # a read after reading paused: one more buffer
                self._filling = self._free.pop() if self._free else _buffer(self._chunk)
                self._filled = 0
            end = min(len(self._filling), self._filled + self._body_left)
            return memoryview(self._filling)[self._filled : end]
        return self._scratch

    def buffer_updated(self, nbytes: int) -> None:
        if self._body_left:
            self.last_read = self._loop.time()
            self._filled += nbytes
            self._body_left -= nbytes
            assert self._filling is not None
            if self._filled == len(self._filling) or not self._body_left:
                self._ready.append(memoryview(self._filling)[: self._filled])
                self._filling = None
                if self._body_left and not self._free:
                    self._pause()
                self._wake()
            return
        self.pending += self._scratch[:nbytes]  # copied at once: the scratch is every connection's
        if len(self.pending) > self._head_limit + SCRATCH_BYTES:
            self._pause()  # nobody is taking them now: wait for the next read_head
        self._wake()

    def eof_received(self) -> bool:
        self._eof = True
        self._wake()
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self._lost = exc or ConnectionResetError("the connection closed")
        self._eof = True
        self._wake()
        while self._drains:
            waiter = self._drains.popleft()
            if not waiter.done():
                waiter.set_exception(ConnectionResetError("the connection closed"))
        if not self._closed.done():
            self._closed.set_result(None)

    def pause_writing(self) -> None:
        self._write_paused = True

    def resume_writing(self) -> None:
        self._write_paused = False
        while self._drains:
            waiter = self._drains.popleft()
            if not waiter.done():
                waiter.set_result(None)

    # ------------------------------------------------------------------ reading

    async def read_head(self) -> bytes | None:
        """The next request head (through its blank line); None at a clean end of the connection.

        Raises:
            HeadTooLarge: no blank line within the limit (protocol/transfer/http1.py).
            asyncio.IncompleteReadError: the peer ended mid-head.
        """
        searched = 0
        while True:
            end = head_end(self.pending, self._head_limit, searched)
            if end >= 0:
                head = bytes(self.pending[:end])
                del self.pending[:end]
                self._resume()
                return head
            searched = len(self.pending)
            if self._eof:
                if not self.pending:
                    return None
                raise asyncio.IncompleteReadError(bytes(self.pending), None)
            self._resume()
            await self._wait()

    async def body(
        self, length: int, chunk: int, stall_timeout_s: float, buffers: int = 3
    ) -> AsyncGenerator[memoryview, None]:
        """The next ``length`` bytes in chunks of ``chunk`` (the last one shorter); give each back with :meth:`release`.

        A chunk is a view of a reused buffer: store it before releasing it. When the connection
        ends early, or sends nothing for ``stall_timeout_s`` (time spent with reading paused,
        waiting for the caller, does not count), the bytes that did arrive come as a last,
        short chunk, then ``ConnectionError`` or ``TimeoutError``.
        """
        loop = asyncio.get_running_loop()
        self._chunk = chunk
        self._free = [_buffer(chunk) for _ in range(buffers - 1)]
        self._ready.clear()
        first = _buffer(chunk)  # the bytes that came with the head go first
        taken = min(len(self.pending), length)
        first[:taken] = self.pending[:taken]
        del self.pending[:taken]
        self._filling, self._filled = first, taken
        if taken == len(first) or taken == length:
            self._ready.append(memoryview(first)[:taken])
            self._filling = None
        self._body_left = length - taken
        self.last_read = loop.time()
        self._resume()
        try:
            delivered = 0
            while delivered < length:
                if self._ready:
                    view = self._ready.popleft()
                    delivered += len(view)
                    yield view
                    continue
                stalled: BaseException | None = None
                if self._eof:
                    stalled = ConnectionResetError("the client closed the upload early")
                else:
                    left = self.last_read + stall_timeout_s - loop.time()
                    if left > 0:
                        with contextlib.suppress(TimeoutError):
                            async with asyncio.timeout(left):
                                await self._wait()
                        continue
                    stalled = TimeoutError(f"the upload sent nothing for {stall_timeout_s:g} s")
                self._body_left = 0  # later bytes are not taken
                if self._filling is not None and self._filled:  # what arrived before the drop
                    view = memoryview(self._filling)[: self._filled]
                    self._filling = None
                    yield view
                raise stalled
        finally:
            self._body_left = 0  # any later bytes are the next request's
            self._filling = None
            self._ready.clear()
            self._free = []

    def release(self, view: memoryview) -> None:
        """A chunk from :meth:`body` was stored: its buffer is free again."""
        buffer = view.obj
        if self._body_left and isinstance(buffer, mmap.mmap) and len(buffer) == self._chunk:
            self._free.append(buffer)
            self._resume()

    # ------------------------------------------------------------------ writing

    def write(self, data: bytes | bytearray | memoryview) -> None:
        assert self.transport is not None
        self.transport.write(data)

    async def drain(self) -> None:
        if self._lost is not None:
            raise ConnectionResetError("the connection closed")
        if not self._write_paused:
            return
        waiter = asyncio.get_running_loop().create_future()
        self._drains.append(waiter)
        await waiter

    def pause_reading(self) -> None:
        """Take nothing more from the socket until the next :meth:`read_head` or :meth:`body` (a held refusal)."""
        self._pause()

    @property
    def peer_host(self) -> str:
        """The peer's address without its port ("" when unknown: a Unix socket, or gone)."""
        if self.transport is None:
            return ""
        peer = self.transport.get_extra_info("peername")
        return str(peer[0]) if isinstance(peer, tuple) and peer else ""

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()

    def abort(self) -> None:
        """Drop the connection at once (nothing more is sent)."""
        if self.transport is not None:
            self.transport.abort()

    async def wait_closed(self) -> None:
        await asyncio.shield(self._closed)

    # ------------------------------------------------------------------ helpers

    async def _wait(self) -> None:
        waiter: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._wakeup = waiter
        try:
            await waiter
        finally:
            self._wakeup = None

    def _wake(self) -> None:
        waiter = self._wakeup
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _pause(self) -> None:
        if not self._paused and self.transport is not None and not self._eof:
            self._paused = True
            with contextlib.suppress(RuntimeError):
                self.transport.pause_reading()

    def _resume(self) -> None:
        if self._paused and self.transport is not None and not self._eof:
            self._paused = False
            self.last_read = self._loop.time()  # paused time is the caller's, not a stall
            with contextlib.suppress(RuntimeError):
                self.transport.resume_reading()


def _buffer(size: int) -> mmap.mmap:
    """A body buffer: an anonymous map, so it starts on a page boundary (``O_DIRECT`` writes need that)."""
    return mmap.mmap(-1, size)


class IdleBudget:
    """At most ``limit`` connections waiting for a request head at once; one more aborts the oldest.

    A connection counts from :meth:`waiting` (accepted, or its last answer sent on a keep-alive
    connection) until :meth:`serving` (a whole head arrived) or :meth:`gone`. No clock: each is
    also bounded in time by the server's head deadline.

    Args:
        limit: the budget; 0: no budget.
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.evicted = 0  # idle connections aborted to admit newer ones (tests, metrics)
        self._idle: dict[HttpConnection, None] = {}  # insertion order: the oldest first

    def __len__(self) -> int:
        return len(self._idle)

    def waiting(self, conn: HttpConnection) -> None:
        """``conn`` waits for a request head now: counted, the oldest idle one aborted past the budget."""
        idle = self._idle
        if conn in idle:
            return
        if self.limit and len(idle) >= self.limit:
            self.evict_oldest()
        idle[conn] = None

    def evict_oldest(self) -> bool:
        """Abort the connection idle the longest; False when none is idle."""
        if not self._idle:
            return False
        oldest = next(iter(self._idle))
        del self._idle[oldest]
        self.evicted += 1
        oldest.abort()
        return True

    def serving(self, conn: HttpConnection) -> None:
        """``conn`` sent a whole request head (or went away): no longer counted (idempotent)."""
        self._idle.pop(conn, None)

    gone = serving

    def close(self) -> None:
        """The server stops: abort every idle connection."""
        for conn in list(self._idle):
            conn.abort()
        self._idle.clear()
