"""The writer child's pipes served by the event loop (``WriterProcess.serve_on``): :class:`ServedOnLoop`.

What it owns. Once the committer serves the child on the loop (coordinator/io/stores/commit.py), no thread of
ours touches the pipes: the loop's thread writes each request and reads each reply. This module is that part of
:class:`~coordinator.io.stores.writer_process.WriterProcess`, a base class of it (one object, two files):

* the non-blocking send queue: a request written now as far as the pipe has room (:meth:`write_soon`), the rest
  kept in order (``_unsent``) and written by ``loop.add_writer`` when there is room (:meth:`flush_unsent` waits
  for room instead, for the blocking paths);
* the reply reader: ``loop.add_reader`` (or the committer's :meth:`poll` while it runs a frame) reads what the pipe
  holds without waiting and answers the groups in order, then ``notify()``;
* the stuck check on the loop (:meth:`check_overdue`: no reply within ``reply_timeout_s``);
* the way off the loop: :meth:`leave` (never waits: the groups still out are answered from the replies the pipe
  holds, the rest fail) and :meth:`_fail_waiting` (a failed child: every group waiting fails, the loop left).

Rules. Everything here runs on the loop's thread and never waits for the child, but :meth:`flush_unsent` (called
by ``write``, which waits for its reply next anyway) and a failed child's exit status (``_exit_status``, 1 s at
most). The child's start, the blocking paths (``write``, the receiver thread, ``wait_ready``), the replies' parsing
and checks, failure and ``close`` (a close from another thread asks the loop to :meth:`leave`) are
writer_process.py's; its members used here are declared below (mypy checks both sides against them). Why the loop
serves the child: docs/PERFORMANCE.md §D29b.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import select
import subprocess
import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Final, NoReturn

from coordinator.io.stores.integrity import StoreError
from coordinator.io.stores.writer_wire import FAILED, REPLY_HEADER, REQUEST_HEADER

__all__ = ["READ_BYTES", "ServedOnLoop"]

READ_BYTES: Final = 1 << 20  # a reply read asks for this much at least: the keys of a busy group come with their header


class ServedOnLoop:
    """The loop's side of :class:`~coordinator.io.stores.writer_process.WriterProcess` (module docstring)."""

    # Set by WriterProcess.__init__: the state the loop's side keeps (and the blocking paths read).
    _loop: asyncio.AbstractEventLoop | None  # the loop serving the child (serve_on), None off it
    _notify: Callable[[], None] | None  # after replies were handled there (the committer's reap)
    _unsent: bytearray  # requests the pipe had no room for yet (loop.add_writer sends them)
    _overdue: asyncio.TimerHandle | None  # the stuck check while groups wait for their reply
    _answered_at: float  # the last reply's time, or the first send's since nothing waited (monotonic)
    _abandoned: bool  # left with groups out (failed unanswered): the child may still commit them
    _fds_lock: threading.Lock  # the pipes closed only once off the loop (leave, close)
    _fds_orphaned: bool  # close() gave up waiting for the loop to leave: leave() closes them
    # WriterProcess's own, used here.
    path: Path
    process: subprocess.Popen[bytes]
    reply_timeout_s: float
    ready: bool
    _failed: str | None
    _out: int  # the child's stdin (our end)
    _in: int  # the child's stdout (our end)
    _buffer: bytes  # the replies' bytes read and not yet taken
    _waiting: deque[Callable[[BaseException | None], None]]  # sent, not yet answered

    if TYPE_CHECKING:  # WriterProcess's methods, used here

        def wait_ready(self, timeout_s: float = ...) -> None: ...
        def _reply(self, timeout_s: float) -> tuple[int, int, bytes]: ...
        def _check(self, generation: int, count: int, most: int, keys: bytes) -> None: ...
        def _exit_status(self) -> str: ...
        def _fail(self, why: str, *, stop: bool = True) -> NoReturn: ...
        def _close_pipes(self) -> None: ...

    def serve_on(self, loop: asyncio.AbstractEventLoop, notify: Callable[[], None]) -> None:
        """From now on :meth:`send` writes on ``loop``'s thread and the replies are read there: no thread of ours.

        A group's request is written by the caller (the pipe's end non-blocking; what it has no room for goes
        when it has, ``loop.add_writer``) and its reply read when the pipe is readable (``loop.add_reader``) or
        when :meth:`poll` is called; each ``done`` runs on the loop, then ``notify()``. The writer thread's
        hand-over (its wake-up, ~1 ms waiting for the busy loop's GIL) and the receiver thread's (the same, and
        the loop woken again by ``call_soon_threadsafe``) are gone from a group's commit (docs/PERFORMANCE.md
        §D29b). Call on ``loop``'s thread, before any :meth:`send`; :meth:`leave` undoes it.
        """
        self._loop, self._notify = loop, notify
        os.set_blocking(self._out, False)
        os.set_blocking(self._in, False)
        loop.add_reader(self._in, self.poll)

    def leave(self) -> None:
        """Stop serving on the loop (on its thread), never waiting: the pipes block again, what is unsent goes before
        the next request. The groups still out (the store closed under a running committer) are answered from the
        replies the pipe holds; the rest fail (StoreError; commit-before-send: nothing released). After a close()
        that gave up waiting for this, the pipes are closed here, once off the loop."""
        if self._loop is not None and self._waiting and self._failed is None:
            self.poll()  # the replies in the pipe already, without waiting (a failure leaves: _fail_waiting)
        with self._fds_lock:  # close() closes the pipes only once they are off the loop
            loop, notify = self._loop, self._notify
            if loop is None:
                return
            if self._overdue is not None:
                self._overdue.cancel()
                self._overdue = None
            with contextlib.suppress(ValueError, OSError):  # the pipe closed already (a failed child)
                loop.remove_reader(self._in)
                loop.remove_writer(self._out)
            self._loop, self._notify = None, None
            with contextlib.suppress(OSError):
                os.set_blocking(self._out, True)
                os.set_blocking(self._in, True)
            if self._fds_orphaned:
                self._close_pipes()
        if self._waiting:
            finished = list(self._waiting)
            self._waiting.clear()
            if self._failed is None:  # the child may still commit them: no later write builds on its keys
                self._abandoned = True
                self._failed = (f"the store's writer process (pid {self.process.pid}) for {self.path}: left with "
                                f"{len(finished)} groups not answered yet")  # fmt: skip
            error = StoreError(self._failed)
            for done in finished:
                done(error)
            if notify is not None:
                notify()

    def write_soon(self, held: bytes, body: bytes, kind: int) -> None:
        """On the loop: ``held`` and one request (kind -1: none) written now as far as the pipe has room, the rest
        kept in order for ``add_writer`` (one ``writev`` either way: no copy of a large body when it fits)."""
        parts = (held,) if kind < 0 else (held + REQUEST_HEADER.pack(len(body), kind), body)
        if self._unsent:
            self._unsent += b"".join(parts)
            return
        try:
            sent = os.writev(self._out, parts)
        except BlockingIOError:
            sent = 0
        left = sum(map(len, parts)) - sent
        if left:
            self._unsent += b"".join(parts)[-left:]
            assert self._loop is not None
            self._loop.add_writer(self._out, self._writable)

    def flush_unsent(self) -> None:
        """What the pipe had no room for, written now, waiting for room (:meth:`write` waits for its reply next)."""
        while self._unsent:
            select.select([], [self._out], [], self.reply_timeout_s)
            with contextlib.suppress(BlockingIOError):
                del self._unsent[: os.write(self._out, self._unsent)]
        if self._loop is not None:
            self._loop.remove_writer(self._out)

    def _writable(self) -> None:
        try:
            sent = os.write(self._out, self._unsent)
        except BlockingIOError:
            return
        except OSError as exc:
            self._fail_waiting(f"{self._exit_status()} ({exc})")
            return
        del self._unsent[:sent]
        if not self._unsent and self._loop is not None:
            self._loop.remove_writer(self._out)

    def poll(self) -> None:
        """On the loop: read what replies the pipe holds, without waiting, and answer their groups, in order."""
        if self._loop is None:
            return
        try:
            while True:
                data = os.read(self._in, READ_BYTES)
                if not data:  # the child closed its end: exited or killed
                    self._fail(self._exit_status())
                self._buffer = self._buffer + data if self._buffer else data
                if len(data) < READ_BYTES:
                    break
        except BlockingIOError:
            pass
        except StoreError as exc:
            self._fail_waiting(exc)
            return
        except OSError as exc:
            self._fail_waiting(f"{self._exit_status()} ({exc})")
            return
        answered = False
        try:
            if not self.ready and self._whole_reply():
                self.wait_ready()
            while self._waiting and self._whole_reply():
                generation, count, keys = self._reply(0)
                self._check(generation, count, len(self._waiting), keys)
                for _ in range(count):
                    self._waiting.popleft()(None)
                answered = True
        except StoreError as exc:
            self._fail_waiting(exc)
            return
        if answered:
            self._answered_at = time.monotonic()
            assert self._notify is not None
            self._notify()

    def _whole_reply(self) -> bool:
        """Whether the bytes read hold a whole reply (its header, then its keys or its error's text)."""
        buffer = self._buffer
        if len(buffer) < REPLY_HEADER.size:
            return False
        value, count, size = REPLY_HEADER.unpack_from(buffer)
        return len(buffer) >= REPLY_HEADER.size + int(count if value == FAILED else size)

    def check_overdue(self) -> None:
        """The stuck check on the loop (the receiver thread's reply timeout): no reply for ``reply_timeout_s``."""
        self._overdue = None
        if not self._waiting or self._loop is None or self._failed is not None:
            return
        late_s = time.monotonic() - self._answered_at
        if late_s < self.reply_timeout_s:
            self._overdue = self._loop.call_later(self.reply_timeout_s - late_s, self.check_overdue)
            return
        try:
            self._fail(f"no answer in {self.reply_timeout_s:g} s (stuck)")
        except StoreError as exc:
            self._fail_waiting(exc)

    def _fail_waiting(self, error: StoreError | str) -> None:
        """On the loop: the child failed; every group waiting is answered with the error, the pipe no longer read."""
        if isinstance(error, str):
            try:
                self._fail(error)
            except StoreError as exc:
                error = exc
        assert isinstance(error, StoreError)
        finished = list(self._waiting)
        self._waiting.clear()
        self.leave()
        for done in finished:
            done(error)
