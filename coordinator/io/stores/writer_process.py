"""The SQLite store's writes in a child process (``--store-writer process``): :class:`WriterProcess`.

Why. A group commit's Python (grouping the records, encoding rows, checksums, binding
parameters; coordinator/io/stores/sqlite.py ``SQLiteStore._write``) costs ~20-30 µs of CPU per
plan holding the GIL (bench/store_writer.py). In the coordinator's writer thread it can never run
beside the event loop, which needs the GIL for every message. A child process has its own
interpreter: on a machine with a free core the commit's Python runs in parallel with the loop.

Theory of operation. The parent's :class:`~coordinator.io.stores.sqlite.SQLiteStore` opens,
checks (lock file, ``quick_check``, migrations, generation side file) and loads the file as
always, then hands its writes over (:meth:`SQLiteStore.hand_writes_to_process`): from then on
every group the writer thread takes is a request to the child. The committer
(coordinator/io/stores/commit.py) keeps its ticketing, ordering and inline commits. Its writer
loop *sends* each group (:meth:`WriterProcess.send`, the store's ``sender`` ability, served on
the loop: :meth:`WriterProcess.serve_on`) and goes on at once; the loop reads the replies too
(the pipe's ``add_reader``, or :meth:`WriterProcess.poll` while it runs a frame) and reports
each group's commit, in order. Without ``serve_on`` (a caller off any loop: tests, benches) the
caller's thread sends and a receiver thread reads the replies (``os.read``, the GIL released).
The child commits the requests that waited in its pipe while it committed the last one as one
transaction (group commit where the fsync is), so the next group is already there when a
commit ends: no round trip through the parent between two commits. An idle writer's small group
is still committed on the loop, by the parent's own connection (``try_write``, only while
nothing is in flight): a round trip to the child cost two process wake-ups, ~0.1 ms a commit
(bench/store_split.py, docs/PERFORMANCE.md).

The child (``python -m coordinator.io.stores.writer_child``, coordinator/io/stores/writer_child.py,
a fresh interpreter: nothing of the running loop is forked) opens the same file with a connection of its own and
reads the write-side keys from it (every plan's rowid, the next rowid, the generation; an open
plan's running events checksum is read from its row the first time it is needed), under the
parent's lock file. Two connections commit, one at a time: the child while groups are in flight,
the parent while none is. Each keeps the keys, and each tells the other what its commit changed
(``SQLiteStore.keys_message``, msgpack ``[generation, next rowid, {fresh plan: rowid}, {plan:
events checksum}, [ended], [forgotten]]``): the child in its reply, which the loop (or the receiver
thread) applies (``on_keys``) before it reports the commit, so the loop's next inline commit, made only
once every reply is in, builds on it; the parent in a keys request, written in front of the next
group (:meth:`WriterProcess.send_keys`), which the child applies before it reads that group.
The generation side file is written by whichever side committed.

The wire (requests, replies, the record codes, a group's encoding) is coordinator/io/stores/writer_wire.py; the
two pipes' parent ends (the requests the pipe had no room for, the replies read and not yet taken) writer_pipes.py.

Failure (as the writer thread's, docs in commit.py): a failed commit, a child that exits or is
killed, a reply that is not the next generation or whose keys do not apply, or no reply within
``reply_timeout_s``, raises :class:`~coordinator.io.stores.integrity.StoreError` in the caller
(keys from the parent that do not apply fail the child's next reply): the committer fails the
coordinator, and nothing after it is released. The child never outlives the parent: it closes
the file and exits at the close request (:meth:`WriterProcess.close`); at the end of its stdin
without one (the parent died) it exits at once, the file left as the parent's death left it (no
checkpoint), and Linux sends it SIGKILL when the parent dies (``PR_SET_PDEATHSIG``). It holds
the store's lock file with the parent (the same ``flock``, inherited), so a coordinator
restarted at once cannot open the file before the old writer is gone. Its environment is the
parent's without secrets: only the variables Python and the locale need (``child_process.ENV_KEPT``), no token.

Never waiting on the loop for the child's end (docs/PERFORMANCE.md §R29): a closed or broken pipe fails the groups
out once the exit status is in (a thread reaps the child; a loop timer gives up after :data:`EXIT_WAIT_S`), a
failure the parent finds (stuck, garbled) at once; SIGKILL never waits there (a child it does not end, in
uninterruptible sleep, is logged after :data:`KILL_WAIT_S`). The child's start and end: child_process.py; the parent's
end of it (leave the loop, abandon, close): writer_end.py, a base of :class:`WriterProcess`.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Final, NoReturn

import msgspec
import structlog

from coordinator.io.stores.child_process import ChildProcess
from coordinator.io.stores.integrity import StoreError
from coordinator.io.stores.writer_end import KILL_WAIT_S, WriterEnd
from coordinator.io.stores.writer_pipes import ReplyReader, RequestWriter
from coordinator.io.stores.writer_wire import (
    BUSY,
    FAILED,
    KEYS,
    REQUEST_HEADER,
    encode_group,
    send_all,
    send_request,
)
from coordinator.records import Record

__all__ = ["EXIT_WAIT_S", "KEYS_HELD_BYTES", "KILL_WAIT_S", "REPLY_TIMEOUT_S", "START_TIMEOUT_S", "WriterProcess"]

log = structlog.get_logger(__name__)

REPLY_TIMEOUT_S: Final = 120.0  # a commit that takes longer: the child is stuck (SQLite waits 5 s for a lock)
START_TIMEOUT_S: Final = 60.0  # the child's interpreter start and open
KEYS_HELD_BYTES: Final = 1 << 16  # the parent's keys requests held for the next group at most (~1,000 lone commits)
EXIT_WAIT_S: Final = 1.0  # a closed pipe's exit status awaited this long (a loop timer) before the groups fail


class WriterProcess(WriterEnd):
    """The parent's end of one writer child: :meth:`write` sends a group and waits for its commit.

    Args:
        path: the SQLite file (opened, checked and migrated by the parent already).
        generation: the file's generation now; every commit's reply must be the next one.
        marker_sync_s: the generation side file's fdatasync interval (the child writes it).
        reply_timeout_s: the longest wait for a reply before the child counts as stuck.
        lock_fd: the store's lock file, held by the child too: the lock (``flock``) is released only once
            both processes are gone, so a coordinator started after this one's death never opens the file
            while its writer still lives.
        on_keys: called with each commit's keys (a reply's msgpack, ``SQLiteStore.apply_keys``) before the
            commit is reported: where the replies are read for :meth:`send`'s groups, in the caller's for :meth:`write`.

    Call it on a thread that lives as long as the process (the event loop's): Linux sends the
    parent-death signal when the thread that started the child ends.

    Raises:
        StoreError: the child cannot be started.
    """

    def __init__(
        self,
        path: Path,
        generation: int,
        *,
        marker_sync_s: float = 1.0,
        reply_timeout_s: float = REPLY_TIMEOUT_S,
        lock_fd: int | None = None,
        on_keys: Callable[[bytes], None] | None = None,
    ) -> None:
        self.path = path
        self.generation = generation
        self._started_at = generation  # the file's generation when the child was started
        self.reply_timeout_s = reply_timeout_s
        self.ready = False
        self._failed: str | None = None
        self._on_keys = on_keys
        self._send_lock = threading.Lock()  # one request at a time in the pipe (the loop's keys, the thread's groups)
        self._keys_held: list[bytes] = []  # keys requests not yet sent: they go out with the next group
        self._keys_held_bytes = 0
        self._encoder = msgspec.msgpack.Encoder()
        args = [sys.executable, "-m", "coordinator.io.stores.writer_child", str(path), repr(marker_sync_s),
                str(os.getpid())]  # fmt: skip
        root = str(Path(__file__).resolve().parents[3])  # the tree this coordinator runs from
        try:
            self.child = ChildProcess(args, python_path=root, pass_fds=() if lock_fd is None else (lock_fd,))
        except OSError as exc:
            raise StoreError(f"cannot start the store's writer process: {exc}") from exc
        self._out = self.child.stdin_fd
        self._in = self.child.stdout_fd
        self._requests = RequestWriter(self._out)
        self._replies = ReplyReader(self._in)
        self._cond = threading.Condition()
        self._waiting: deque[Callable[[BaseException | None], None]] = deque()  # sent, not yet answered
        self._receiver: threading.Thread | None = None
        self._closing = False
        # On the loop (serve_on): requests written and replies read by the event loop's thread, no thread of ours.
        self._loop: asyncio.AbstractEventLoop | None = None
        self._notify: Callable[[], None] | None = None  # after replies were handled there (the committer's reap)
        self._overdue: asyncio.TimerHandle | None = None  # the stuck check while groups wait for their reply
        self._answered_at = 0.0  # the last reply's time, or the first send's since nothing waited (monotonic)
        self._abandoned = False  # left with groups out (failed unanswered): the child may still commit them
        self._given_up = 0  # groups failed unanswered (left, abandoned): close() logs them, never as committed
        self._given_up_after = 0  # the last generation answered when the first of them was given up
        self._fds_lock = threading.Lock()  # the pipes closed only once off the loop (leave, close)
        self._fds_orphaned = False  # close() gave up waiting for the loop to leave: leave() closes them
        # On the loop, the pipe closed or broke (_died): why, while the child's exit status is awaited.
        self._dying: str | None = None
        self._exit_timer: asyncio.TimerHandle | None = None  # _died's bound on that wait (EXIT_WAIT_S)

    @property
    def process(self) -> subprocess.Popen[bytes]:
        """The child's ``Popen``."""
        return self.child.process

    def wait_ready(self, timeout_s: float = START_TIMEOUT_S) -> None:
        """Wait for the child's open (its first reply); raises StoreError when it failed or disagrees.

        The coordinator may have committed on its own while the child started (:meth:`send_keys`): the
        child read the file at a generation from the one it was started at to the coordinator's, and
        the keys held for it bring it up to the coordinator's before its first group.
        """
        if self.ready:
            return
        generation, _, _ = self._reply(timeout_s)
        if not self._started_at <= generation <= self.generation:
            self._fail(f"its file is at generation {generation}, the coordinator's at {self.generation}")
        self.ready = True

    def poll_ready(self) -> bool:
        """True once the child has opened the file (never waits: a commit on the loop must not)."""
        if not self.ready and self._replies.readable():
            self.wait_ready()
        return self.ready

    def write(self, records: Sequence[Record], *, wait: bool) -> bool:
        """Commit ``records`` in the child (one transaction) and wait for it; False: ``wait`` off and the database
        was held, or (``wait`` off) a group sent with :meth:`send` is still in flight.

        Raises:
            StoreError: the commit failed, or the child is gone, stuck or garbled (all fatal).
        """
        if self._failed is not None:
            raise StoreError(self._failed)
        if not self.ready:
            self.wait_ready()
        with self._cond:
            if self._waiting:  # the receiver thread (or the loop's reader) reads the replies now
                if not wait:
                    return False
                raise StoreError(f"the store's writer process for {self.path}: a commit is in flight")
            body = encode_group(self._encoder, records)
            self._send(body, int(wait))
            self._requests.flush(self.reply_timeout_s)
            generation, count, keys = self._reply(self.reply_timeout_s)
            if generation == BUSY and not wait:
                return False
            self._check(generation, count, 1, keys)
            return True

    @property
    def unsent_bytes(self) -> int:
        """The requests' bytes the pipe had no room for yet (on the loop: written once it has)."""
        return len(self._requests.unsent)

    @property
    def in_flight(self) -> bool:
        """True while a group sent with :meth:`send` is not yet answered."""
        return bool(self._waiting)

    def send_keys(self, keys: bytes, generation: int) -> None:
        """Tell the child the keys of a commit the parent made itself (``generation`` now the file's).

        Only while nothing is in flight (the committer's inline commit): the child applies them
        before it reads the next group from its pipe, so its next commit builds on the parent's.
        They are held here and written in front of that group, in the same write (or once
        :data:`KEYS_HELD_BYTES` are held): a write of their own after every inline commit woke the
        child for nothing while the loop waited for the disk again, and took the core the lone
        round trip's other processes wanted.

        Raises:
            StoreError: the child is gone or failed before.
        """
        if self._failed is not None:
            raise StoreError(self._failed)
        self.generation = generation
        request = REQUEST_HEADER.pack(len(keys), KEYS) + keys
        with self._send_lock:
            self._keys_held.append(request)
            self._keys_held_bytes += len(request)
            if self._keys_held_bytes < KEYS_HELD_BYTES:
                return
        self._send(b"", -1)  # only what is held

    def send(self, records: Sequence[Record], done: Callable[[BaseException | None], None]) -> None:
        """Send a group and return: ``done(None)`` is called (where the replies are read) once it is committed, or
        ``done(error)`` when it, or one before it, failed. Groups are committed and ``done`` called in send order;
        the child merges the groups waiting in its pipe into one transaction.

        Raises:
            StoreError: the child is gone or failed before.
        """
        if self._failed is not None:
            raise StoreError(self._failed)
        if self._loop is not None:  # on the loop: never waits (its ready reply is read as the replies are)
            body = encode_group(self._encoder, records)
            if not self._waiting:  # the stuck check, from now
                self._answered_at = time.monotonic()
                if self._overdue is not None:
                    self._overdue.cancel()
                self._overdue = self._loop.call_later(self.reply_timeout_s, self._check_overdue)
            self._waiting.append(done)
            self._send(body, 1)
            if self._replies.buffer:  # replies read before this group was sent (a stray one fails it): looked at now
                self._loop.call_soon(self.poll)
            return
        if not self.ready:
            self.wait_ready()
        body = encode_group(self._encoder, records)
        with self._cond:
            self._waiting.append(done)
            if self._receiver is None:
                self._receiver = threading.Thread(target=self._receive_forever, name="fleetwire-store-replies",
                                                  daemon=True)  # fmt: skip
                self._receiver.start()
            self._cond.notify_all()
        self._send(body, 1)

    def _send(self, body: bytes, kind: int) -> None:
        """One request (kind -1: none), after the keys held: one write when it is small."""
        try:
            with self._send_lock:
                held = b""
                if self._keys_held:
                    held = b"".join(self._keys_held)
                    self._keys_held.clear()
                    self._keys_held_bytes = 0
                if self._loop is not None:
                    if self._dying is None:  # a child whose pipe closed gets nothing more (_died)
                        parts = (held,) if kind < 0 else (held + REQUEST_HEADER.pack(len(body), kind), body)
                        self._requests.write_soon(parts)
                    return
                if self._requests.unsent:  # what the loop had no room for (leave() does not wait for room)
                    held = self._requests.take_unsent() + held
                if kind < 0:
                    send_all(self._out, held)
                else:
                    send_request(self._out, body, kind, held)
        except OSError as exc:
            if self._loop is None:
                self._fail(f"{self._exit_status()} ({exc})")
            self._died(f" ({exc})")  # on the loop: the group sent waits for the exit status with the others

    # ------------------------------------------------------------------ on the event loop (serve_on)

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
        self._requests.serve_on(loop, self._broken)
        loop.add_reader(self._in, self.poll)

    def poll(self) -> None:
        """On the loop: read what replies the pipe holds, without waiting, and answer their groups, in order."""
        if self._loop is None or self._dying is not None:
            return
        ended = self._replies.read_available()  # the pipe closed or broke: failed after the replies it holds
        answered = False
        try:
            if not self.ready and self._replies.whole_reply():
                self.wait_ready()
            while self._waiting and self._replies.whole_reply():
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
        if ended is not None:
            self._died(ended)

    def _check_overdue(self) -> None:
        """The stuck check on the loop (the receiver thread's reply timeout): no reply for ``reply_timeout_s``."""
        self._overdue = None
        if not self._waiting or self._loop is None or self._failed is not None or self._dying is not None:
            return
        late_s = time.monotonic() - self._answered_at
        if late_s < self.reply_timeout_s:
            self._overdue = self._loop.call_later(self.reply_timeout_s - late_s, self._check_overdue)
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

    def drain(self) -> None:
        """Wait until every group sent has its reply (its ``done`` called), or the child failed."""
        with self._cond:
            while self._waiting and self._failed is None:
                self._cond.wait()

    def _receive_forever(self) -> None:
        """The receiver thread: the replies to :meth:`send`'s groups, each group's ``done`` called in order."""
        cond, waiting = self._cond, self._waiting
        while True:
            with cond:
                while not waiting and not self._closing:
                    cond.wait()
                if not waiting:
                    return
            try:
                generation, count, keys = self._reply(self.reply_timeout_s)
                with cond:
                    self._check(generation, count, len(waiting), keys)
                    finished = [waiting.popleft() for _ in range(count)]
                    cond.notify_all()
            except StoreError as exc:
                with cond:
                    finished = list(waiting)
                    waiting.clear()
                    cond.notify_all()
                for done in finished:
                    done(exc)
                return
            for done in finished:
                done(None)

    def _check(self, generation: int, count: int, most: int, keys: bytes) -> None:
        """A commit's reply: the next generation, for at least one and at most ``most`` groups; its keys applied."""
        if generation != self.generation + 1 or not 0 < count <= most:
            self._fail(f"it answered generation {generation} for {count} groups to commit {self.generation + 1} "
                       f"of at most {most}")  # fmt: skip
        if self._on_keys is not None:
            try:
                self._on_keys(keys)
            except Exception as exc:  # not the keys this store wrote: its keys can no longer be trusted
                self._fail(f"its keys of generation {generation} cannot be applied: {type(exc).__name__}: {exc}")
        self.generation = generation

    def _reply(self, timeout_s: float) -> tuple[int, int, bytes]:
        """The next reply (:meth:`ReplyReader.next_reply`): its generation (or BUSY), its count and its keys."""
        try:
            value, count, body = self._replies.next_reply(timeout_s)
        except TimeoutError:
            self._fail(f"no answer in {timeout_s:g} s (stuck)")
        except EOFError:
            self._fail(self._exit_status())
        if value == FAILED:
            self._fail(body.decode(errors="replace"), stop=False)
        return value, count, body

    def _broken(self, exc: OSError) -> None:
        """On the loop: a request the pipe had no room for could not be written (the pipe broke)."""
        self._died(f" ({exc})")

    def _died(self, detail: str) -> None:
        """On the loop: the pipe closed or broke (``detail``: the error), so the child exited or was killed. The
        groups out (and those sent meanwhile) fail once its exit status is in, never waiting for it here: a thread
        reaps the child (``ChildProcess.when_ended``), a loop timer gives up after :data:`EXIT_WAIT_S`."""
        loop = self._loop
        if loop is None or self._failed is not None or self._dying is not None:
            return
        self._dying = detail
        with contextlib.suppress(ValueError, OSError):
            loop.remove_reader(self._in)
            self._requests.discard()
        status = self.child.ended()
        if status is not None:
            self._dead(status)
            return
        self._exit_timer = loop.call_later(EXIT_WAIT_S, self._dead, "it closed its pipe")
        self.child.when_ended(loop, self._dead)

    def _dead(self, status: str) -> None:
        """On the loop: the exit status of a child whose pipe closed is in (or :data:`EXIT_WAIT_S` passed)."""
        if self._dying is None or self._failed is not None:
            return
        if self._exit_timer is not None:
            self._exit_timer.cancel()
            self._exit_timer = None
        self._fail_waiting(f"{status}{self._dying}")

    def _exit_status(self) -> str:
        """The child's exit status in words: waited for up to 1 s in a thread, never on the loop."""
        if self._loop is not None:
            return self.child.ended() or "it closed its pipe"
        return self.child.end_status(1.0)

    def _fail(self, why: str, *, stop: bool = True) -> NoReturn:
        self._failed = f"the store's writer process (pid {self.pid}) failed for {self.path}: {why}"
        if stop:
            self._kill()
        raise StoreError(self._failed)

    def _kill(self) -> None:
        """SIGKILL. On the loop never waiting: a thread reaps the child, and one not ended in :data:`KILL_WAIT_S`
        is logged; off it (the receiver thread, a caller's :meth:`write`) it waits that long for the end."""
        self.child.kill()
        loop = self._loop
        if loop is None:
            self.child.wait(KILL_WAIT_S)
        elif self.child.ended() is None:
            self.child.when_ended()
            loop.call_later(KILL_WAIT_S, self._kill_overdue)

    def _kill_overdue(self) -> None:
        if self.child.ended() is None:
            log.error("the store's writer process did not end after SIGKILL (uninterruptible sleep: a disk that "
                      "does not answer?); it holds the store's lock until it ends", pid=self.pid)  # fmt: skip
