"""The writer process's end (``WriterEnd``, a base of :class:`~coordinator.io.stores.writer_process.WriterProcess`).

How the parent's end of a writer child stops: taken off the event loop (:meth:`~WriterEnd.leave`, also from
another thread: ``_leave_from_any_thread``, bounded by :data:`LEAVE_WAIT_S`), its groups failed at a stop that
gave up on it (:meth:`~WriterEnd.abandon`), and the close (:meth:`~WriterEnd.close`: the close request, then the
child killed once :data:`CLOSE_GRACE_S` passed), the groups given up logged, never as committed.
coordinator/io/stores/writer_process.py's docstring says the whole; what this needs of the writer is declared on
:class:`WriterEnd` (``WriterProcess`` sets and defines it).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Final

import structlog

from coordinator.io.stores.child_process import ChildProcess
from coordinator.io.stores.grace import CLOSE_GRACE_S  # the committer's close waits as long (grace.py)
from coordinator.io.stores.integrity import StoreError
from coordinator.io.stores.writer_pipes import RequestWriter
from coordinator.io.stores.writer_wire import CLOSE, REQUEST_HEADER

__all__ = ["CLOSE_GRACE_S", "KILL_WAIT_S", "LEAVE_WAIT_S", "WriterEnd"]

log = structlog.get_logger("coordinator.io.stores.writer_process")  # the writer's log, as before the split

LEAVE_WAIT_S = 5.0  # a close in another thread waits this long for the loop to take the pipes off it
KILL_WAIT_S: Final = 5.0  # a child not ended this long after its SIGKILL is logged (it holds the store's lock)


class WriterEnd:
    """The end of a writer child: leave the loop, abandon, close (the module docstring says how).

    What it needs of the writer (:class:`~coordinator.io.stores.writer_process.WriterProcess` sets and defines
    them): the child and its pipes, the groups waiting, the loop it serves on, the failure and the groups given up,
    and the reading of the replies and failing of the groups on the loop.
    """

    path: Path
    generation: int
    child: ChildProcess
    _out: int
    _in: int
    _requests: RequestWriter
    _cond: threading.Condition
    _send_lock: threading.Lock
    _waiting: deque[Callable[[BaseException | None], None]]
    _receiver: threading.Thread | None
    _closing: bool
    _failed: str | None
    _loop: asyncio.AbstractEventLoop | None
    _notify: Callable[[], None] | None
    _overdue: asyncio.TimerHandle | None
    _abandoned: bool
    _given_up: int
    _given_up_after: int
    _fds_lock: threading.Lock
    _fds_orphaned: bool
    _dying: str | None
    poll: Callable[[], None]  # the replies the pipe holds, read on the loop
    _dead: Callable[[str], None]  # a closed pipe's groups failed, with the child's exit status
    _fail_waiting: Callable[[StoreError | str], None]  # on the loop: every group waiting failed, the loop left

    @property
    def pid(self) -> int:
        return self.child.pid

    def leave(self) -> None:
        """Stop serving on the loop (on its thread), never waiting: the pipes block again, what is unsent goes before
        the next request. The groups still out (the store closed under a running committer) are answered from the
        replies the pipe holds; the rest fail (StoreError; commit-before-send: nothing released). After a close()
        that gave up waiting for this, the pipes are closed here, once off the loop."""
        if self._loop is not None and self._waiting and self._failed is None:
            self.poll()  # the replies in the pipe already, without waiting (a failure leaves: _fail_waiting)
        if self._dying is not None and self._failed is None:  # the pipe closed: they fail, the exit status or not
            self._dead(self.child.ended() or "it closed its pipe")
        with self._fds_lock:  # close() closes the pipes only once they are off the loop
            loop, notify = self._loop, self._notify
            if loop is None:
                return
            if self._overdue is not None:
                self._overdue.cancel()
                self._overdue = None
            with contextlib.suppress(ValueError, OSError):  # the pipe closed already (a failed child)
                loop.remove_reader(self._in)
                self._requests.leave()
            self._loop, self._notify = None, None
            with contextlib.suppress(OSError):
                os.set_blocking(self._out, True)
                os.set_blocking(self._in, True)
            if self._fds_orphaned:
                self.child.close_pipes()
        if self._waiting:
            finished = list(self._waiting)
            self._waiting.clear()
            self._note_given_up(len(finished))
            if self._failed is None:  # the child may still commit them: no later write builds on its keys
                self._abandoned = True
                self._failed = (f"the store's writer process (pid {self.pid}) for {self.path}: left with "
                                f"{len(finished)} groups not answered yet")  # fmt: skip
            error = StoreError(self._failed)
            for done in finished:
                done(error)
            if notify is not None:
                notify()

    def abandon(self, why: str) -> None:
        """On the loop: the groups out fail now with ``why`` (committed or not, as after a crash), the child killed
        without waiting (a stop that gave up on it: commit.py ``CLOSE_GRACE_S``); :meth:`close` then only reaps it."""
        if self._loop is not None and self._failed is None:
            self._note_given_up(len(self._waiting))
            self._fail_waiting(why)  # it leaves the loop; a second leave() does nothing
        self.leave()

    def _note_given_up(self, groups: int) -> None:
        if groups and not self._given_up:
            self._given_up_after = self.generation
        self._given_up += groups

    def _leave_from_any_thread(self) -> bool:
        """:meth:`leave`, on the loop's thread when that loop runs in another one (a store closed in a thread);
        False: that loop did not run it in time (it will later: the pipes are left for it to close)."""
        loop = self._loop
        if loop is None:
            return True
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is loop or loop.is_closed() or not loop.is_running():
            self.leave()
            return True
        left = threading.Event()

        def leave() -> None:
            self.leave()
            left.set()

        try:
            loop.call_soon_threadsafe(leave)
        except RuntimeError:  # closed meanwhile: its selector with it
            self.leave()
            return True
        if left.wait(LEAVE_WAIT_S):
            return True
        with self._fds_lock:
            if self._loop is None:  # left meanwhile
                return True
            self._fds_orphaned = True  # leave() closes them once they are off the loop
        log.error("the store's writer process: its pipes were not taken off the event loop", pid=self.pid)
        return False

    def close(self, timeout_s: float | None = None) -> None:
        """End the child: the close request, then its stdin closed; it closes the file and exits, or is killed once
        ``timeout_s`` (None: :data:`CLOSE_GRACE_S`) passed since the close began. Without the request it would exit
        without closing the file (the parent's death). A loop that does not leave the pipes in time: the child killed,
        the pipes left open for :meth:`leave` to close. Groups given up (out when the store closed, or abandoned at a
        stop) are logged with their count and the generation after which they were sent: never as committed."""
        if not self._leave_from_any_thread():
            self.child.kill()
            self.child.wait(KILL_WAIT_S)
            self._log_given_up(killed=True)
            return
        deadline = time.monotonic() + (CLOSE_GRACE_S if timeout_s is None else timeout_s)
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        if self._failed is None or self._abandoned:
            with self._send_lock, contextlib.suppress(OSError):
                self._requests.unsent += REQUEST_HEADER.pack(0, CLOSE)  # after what the loop had no room for yet
                os.set_blocking(self._out, False)  # a blocking write waits for room for all of it
                self._requests.flush(max(0.0, deadline - time.monotonic()))
        self.child.close_stdin()
        killed = not self.child.wait(max(0.0, deadline - time.monotonic()))
        if killed:
            self.child.kill()
            self.child.wait(KILL_WAIT_S)
        self._log_given_up(killed=killed)
        if self._receiver is not None:
            self._receiver.join()
        self.child.close_pipes()

    def _log_given_up(self, *, killed: bool) -> None:
        """How the child ended, when it was killed or groups were given up (never answered: not acknowledged)."""
        if self._given_up:
            log.error("the store's writer process closed with groups given up: never answered, so not acknowledged "
                      "(committed or not, as after a crash)", pid=self.pid, killed=killed, groups=self._given_up,
                      sent_after_generation=self._given_up_after)  # fmt: skip
        elif killed:
            log.error("the store's writer process did not stop; killed", pid=self.pid)
