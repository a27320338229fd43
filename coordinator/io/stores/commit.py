"""Group commit: records written off the event loop, replies released only after their commit.

Theory of operation. The server hands each batch of records to :meth:`GroupCommitter.submit`
together with a *payload* (the frames and closes of the same core step) and gets nothing
back: the payload is released (``release(payload)``) once the batch is durable. Payloads
are released strictly in submit order, and a payload with no records (:meth:`after`) waits
behind every batch submitted before it, so no frame ever overtakes a frame that depends on a
record (docs/SEMANTICS.md §Durability: ``accepted`` only after the plan is recorded).

With a blocking store (SQLite) one writer thread takes *every* batch queued since its last
transaction and writes them as one transaction: while a commit is being fsynced, the next
group builds up, so the fsync rate stays at what the disk does whatever the message rate.
With a non-blocking store (memory) ``submit`` writes at once and releases at once.
A store with a ``sender`` (SQLite whose writes were handed to its writer process,
``--store-writer process``, coordinator/io/stores/writer_process.py) has no writer thread: the
loop itself sends each group as it is submitted (encoded and written to the child's pipe,
never waiting: what the pipe has no room for goes when it has), and reads the replies itself
(the pipe's ``add_reader`` while it waits, and a look at the pipe in :meth:`GroupCommitter.reported`
and :meth:`GroupCommitter.reap` while it runs a frame), each commit reported in order
(:meth:`GroupCommitter._sent_done`); the child merges the groups that wait in its pipe into one
transaction. The writer thread's wake-up and the receiver thread's, each waiting up to a switch
interval for the busy loop's GIL, were ~2-3 ms of a part's commit and left the loop asleep with
frames held for a commit (docs/PERFORMANCE.md §D29b). Its inline commits (below) are still the loop's, by the
coordinator's own connection: the store has applied the keys of every group reported before
(writer_process.py), and an inline commit is made only once every earlier group is reported.

Releases between parts (issue 29). A writer thread's commit is reported to the loop with ``call_soon_threadsafe``,
whose callback runs behind everything the loop has queued in its turn: the other sessions' frames,
each a part of up to ``DURABLE_PART_MESSAGES`` (coordinator/io/frontdoor/core_driver.py), 10-20 ms
on a busy coordinator. The reporting thread also notes the newest ticket committed, and
:meth:`GroupCommitter.reap`, which the driver calls at each step's hand-over (and within a part, when
:meth:`GroupCommitter.reported` says a report is in), releases up to it there and then; the callback then
finds it released and does nothing.

Idle writer: commit at once, on the loop. A batch submitted while the writer thread has
nothing in flight, to a store that allows it (one whose abilities have ``try_write``: SQLite, a local file),
is not handed to the thread: the batches of the same loop iteration are gathered
(``call_soon``) and, when they hold at most :data:`INLINE_MAX_RECORDS` records and came from
at most :data:`INLINE_MAX_BYTES` of frames, written by the loop itself, one transaction
(``store.try_write``, which never waits for a lock held by another connection: then the
thread takes the group). A lone request then pays the disk and
nothing else: the hand-over to the thread and back (a thread wake-up, the GIL passed twice,
the loop woken) cost as much as the fsync itself, and more on a machine whose cores are busy
(a woken thread waits for a core). Under
load the writer is busy, or the gathered group is larger, and the thread batches as above,
overlapping the fsync with the loop's work. A group of few records but many bytes (plans with
512 KiB args) goes to the thread too: writing and checksumming its pages held the loop for
milliseconds per commit, which every other peer's round trip waited behind (issue 17, bench
phase ``f3-bytes``). The loop is blocked for one small commit at a
time; when the inline commits' moving average (one fifth weight to the latest) passes
:data:`INLINE_SLOW_S` (a slow or busy disk, not one outlier) the thread takes every commit for
:data:`INLINE_COOLDOWN_S`, so a slow disk never stalls the loop commit after commit. Each commit
counts at most :data:`INLINE_SAMPLE_CAP` times :data:`INLINE_SLOW_S` in that average: one commit of
7-15 ms among ~0.3 ms ones (SQLite's WAL checkpoint, or a busy neighbour's I/O) lifted it past the bound alone and
sent ~1,000 commits (1 s) to the writer (docs/PERFORMANCE.md §P29); now it takes three slow commits in a
row (or one in two, sustained), so a disk at 4 ms a commit or worse still trips it at its third.
After :data:`INLINE_RUN_MAX` inline commits in a row the next group goes to the writer even so: SQLite's WAL
checkpoints are the writer's (the loop's connection commits with them off: coordinator/io/stores/sqlite.py), made
at its first commit past SQLite's bound, and a run of inline commits must not grow the WAL past it for long.

GIL hand-backs. SQLite releases the GIL around every statement's step, and the writer thread
takes it back for the next statement: a group of a busy coordinator runs ~50 multi-row
statements, and each take-back waits until the loop's thread drops the GIL, which CPython forces
only after the switch interval (5 ms by default). While the writer thread runs, the interval is
:data:`WRITER_SWITCH_INTERVAL_S` (set at :meth:`GroupCommitter.start`, the previous value put
back at :meth:`GroupCommitter.close`). bench/throughput.py, 10,000 plans, SQLite, three pairs
alternating on a loaded 2-core VM: a group's wall 116 / 147 / 144 ms at 5 ms -> 98 / 105 / 113 ms
at 1 ms (its CPU 17-19 ms either way), 3,067 / 2,108 / 2,694 -> 3,189 / 2,591 / 2,780 plans/s.

Backpressure. Each batch may carry its size (the bytes of the frames that produced it);
:attr:`backlog_bytes` is the total waiting for a commit, and :meth:`drained` waits until it
is at most half of ``max_backlog_bytes``. The server's readers await it after a frame that
pushed the backlog over the limit, so a peer that sends faster than the disk writes is held
back by TCP instead of growing the coordinator's memory.

A failed write is fatal to the coordinator (``on_failure``): the in-memory state is then ahead
of the store, and carrying on would acknowledge what a restart would lose. Nothing of the
failed group, or after it, is released. The same holds when the store's files were deleted or
replaced under it: a store with the ``check_files`` ability (SQLite: its ``-wal`` and ``-shm``)
is checked on the loop after a commit, before that commit's payloads are released, at most
every :data:`FILE_CHECK_INTERVAL_S`. Two ``os.stat`` after every commit cost +0.15 ms p50 per
round trip in bench/latency.py (each hands the GIL over); once every 10 ms costs nothing
measurable. A commit acknowledged in that window is not silent either: the store's generation
file is then ahead of what a restart finds, and the restart refuses (coordinator/io/stores/integrity.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
import sys
import threading
import time
from collections.abc import Callable, Sequence
from functools import partial
from typing import TypeVar

import structlog

from coordinator.io.stores.abilities import GroupSender
from coordinator.io.stores.backlog import Backlog
from coordinator.io.stores.grace import CLOSE_GRACE_S  # the writer's close waits as long (grace.py)
from coordinator.io.stores.store import Store
from coordinator.records import Record

__all__ = [
    "CLOSE_GRACE_S", "FILE_CHECK_INTERVAL_S", "INLINE_COOLDOWN_S", "INLINE_MAX_BYTES", "INLINE_MAX_RECORDS",
    "INLINE_RUN_MAX", "INLINE_SAMPLE_CAP", "INLINE_SLOW_S", "WRITER_SWITCH_INTERVAL_S", "GroupCommitter",
]

log = structlog.get_logger(__name__)

T = TypeVar("T")

_STOP = object()

FILE_CHECK_INTERVAL_S = 0.01
INLINE_MAX_RECORDS = 64  # a few plans' steps: a commit of a handful of pages
INLINE_MAX_BYTES = 64 << 10  # ... from at most this much of frames (``submit``'s size): else the thread
INLINE_SLOW_S = 0.002  # inline commits slower than this on average ...
INLINE_COOLDOWN_S = 1.0  # ... sends every commit to the writer thread for this long
INLINE_SAMPLE_CAP = 2.0  # one commit counts in that average as at most this many times INLINE_SLOW_S
INLINE_RUN_MAX = 256  # inline commits in a row at most; then one group to the writer (its checkpoints: docstring)
WRITER_SWITCH_INTERVAL_S = 0.001  # the interpreter's switch interval while a writer thread runs (at most)


class GroupCommitter(Backlog[T]):
    """Writes record batches through ``store`` and releases their payloads, in order, once committed.

    Args:
        store: where records go.
        release: called on the event loop with each payload once its batch (and every
            earlier one) is committed.
        on_failure: called on the event loop, once, when a write fails.
        inline_max_records: the most records an idle writer's group may hold to be committed
            on the loop (0: always through the thread); only for a store with the
            ``try_write`` ability (coordinator/io/stores/abilities.py).
        inline_slow_s: the inline commits' average past which the thread takes them all for
            :data:`INLINE_COOLDOWN_S` (each commit counted as at most :data:`INLINE_SAMPLE_CAP` times it).
        inline_max_bytes: the most bytes (``submit``'s sizes) an idle writer's group may hold to be
            committed on the loop.
        inline_run_max: the most inline commits in a row: the next group goes to the writer (module docstring).
        clock: the time, in seconds, that inline commits are timed and the cool-down kept by (a test's own).
    """

    def __init__(
        self,
        store: Store,
        release: Callable[[T], None],
        on_failure: Callable[[BaseException], None],
        *,
        max_backlog_bytes: int = 0,
        file_check_interval_s: float = FILE_CHECK_INTERVAL_S,
        inline_max_records: int = INLINE_MAX_RECORDS,
        inline_slow_s: float = INLINE_SLOW_S,
        inline_max_bytes: int = INLINE_MAX_BYTES,
        inline_run_max: int = INLINE_RUN_MAX,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__(release, on_failure, max_backlog_bytes)
        self.store = store
        self.transactions = 0  # groups committed
        self.batches = 0  # batches submitted
        abilities = store.abilities
        self._check_files: Callable[[], None] | None = abilities.check_files
        self._file_check_interval_s = file_check_interval_s
        self._next_file_check = 0.0
        self._committed = 0  # every ticket up to this one is durable
        self._reported = 0  # the newest ticket the writer's threads reported durable (set there; reap() reads it)
        self._queue: queue.SimpleQueue[object] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._switch_was = 0.0  # the switch interval before start()
        self._try_write: Callable[[Sequence[Record]], bool] | None = abilities.try_write
        self._inline_max = inline_max_records if self._try_write is not None else 0
        self._inline: list[Sequence[Record]] | None = None  # the group gathered for a commit on the loop
        self._inline_size = 0  # its records
        self._inline_bytes = 0  # its sizes
        self._inline_max_bytes = inline_max_bytes
        self._inline_off_until = 0.0  # slow inline commits: the thread only until then
        self._inline_avg_s = 0.0  # the inline commits' moving average
        self._inline_slow_s = inline_slow_s
        self._inline_sample_max_s = inline_slow_s * INLINE_SAMPLE_CAP if inline_slow_s > 0 else float("inf")
        self._clock = clock
        self._inline_run = 0  # inline commits since a group last went to the writer
        self._inline_run_max = inline_run_max
        self.inline_commits = 0  # groups committed on the loop
        self._sender: GroupSender | None = None
        # A writer process's groups sent and answered on the loop (GroupSender.serve_on): no writer thread.
        self._direct = False
        self._sent = 0  # the newest ticket sent to it
        self._polling = False  # in reported()/reap()'s look at its pipe: they release what it found themselves
        self._answered: asyncio.Event | None = None  # close(): set at each answer or failure

    def start(self) -> None:
        """Start the writer thread (a blocking store only); call on the event loop."""
        if self.store.blocking and self._thread is None and not self._direct:
            self._loop = asyncio.get_running_loop()
            self._sender = self.store.abilities.sender  # a writer process: groups sent without waiting
            if self._sender is not None:  # ... by the loop itself, its replies read there (module docstring)
                self._sender.serve_on(self._loop, self._answered_now)
                self._direct = True
                return
            self._switch_was = sys.getswitchinterval()
            sys.setswitchinterval(min(self._switch_was, WRITER_SWITCH_INTERVAL_S))  # module docstring: GIL hand-backs
            self._thread = threading.Thread(target=self._write_forever, name="fleetwire-store-writer", daemon=True)
            self._thread.start()

    def submit(self, records: Sequence[Record], payload: T, size: int = 0) -> None:
        """Write ``records``; release ``payload`` once they (and everything before) are durable.

        ``size`` (bytes) counts toward :attr:`backlog_bytes` until the commit.
        """
        if self.failed is not None:
            return
        self.batches += 1
        if self._thread is None and not self._direct:
            try:
                self.store.write(records)
            except Exception as exc:
                self._fail(exc)
                return
            self.transactions += 1
            self.after(payload)  # nothing ever waits without a writer thread: released at once
            return
        ticket = self.queued(payload, size)
        if self._inline is not None:  # this loop iteration's group for the loop
            self._inline.append(records)
            self._inline_size += len(records)
            self._inline_bytes += size
            return
        if (
            self._committed == ticket - 1  # the writer has nothing in flight
            and len(records) <= self._inline_max
            and size <= self._inline_max_bytes
            and self._loop is not None
            and self._inline_run < self._inline_run_max
            and self._clock() >= self._inline_off_until
        ):
            self._inline = [records]
            self._inline_size = len(records)
            self._inline_bytes = size
            self._loop.call_soon(self._commit_inline)
            return
        self._hand(ticket, records)

    async def close(self) -> None:
        """Write what is queued, release it, and stop the writer thread."""
        if self._direct:
            await self._close_direct()
            return
        thread = self._thread
        if thread is None:
            return
        self._commit_inline(on_loop=False)  # a group gathered for the loop goes first
        self._queue.put(_STOP)
        await asyncio.to_thread(thread.join)
        self._thread = None
        if sys.getswitchinterval() == min(self._switch_was, WRITER_SWITCH_INTERVAL_S):  # nobody changed it since
            sys.setswitchinterval(self._switch_was)
        await asyncio.sleep(0)  # let the last call_soon_threadsafe(_done) run

    async def _close_direct(self) -> None:
        """close() with a writer process served on the loop: what is gathered is sent, every answer awaited for up
        to :data:`CLOSE_GRACE_S`; the groups still out then fail (``GroupSender.abandon``: the child killed)."""
        assert self._sender is not None
        self._commit_inline(on_loop=False)
        self._answered = asyncio.Event()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(CLOSE_GRACE_S):
                while self._reported < self._sent and self.failed is None:
                    self._answered.clear()
                    await self._answered.wait()
        if self._reported < self._sent and self.failed is None:  # stuck: the stop does not wait for it (docstring)
            self._sender.abandon(f"no answer in {CLOSE_GRACE_S:g} s at the stop (groups sent up to ticket "
                                 f"{self._sent}, answered up to {self._reported}; not acknowledged)")  # fmt: skip
        self.reap()
        self._sender.leave_loop()
        self._direct = False

    def _hand(self, ticket: int, records: Sequence[Record]) -> None:
        """A group (every batch up to ``ticket``) to the writer: its thread's queue, or sent to the writer process."""
        self._inline_run = 0
        if not self._direct:
            self._queue.put((ticket, records))
            return
        assert self._sender is not None
        self._sent = ticket
        try:
            self._sender.send(records, partial(self._sent_done, ticket))
        except Exception as exc:
            self._fail(exc)

    # ------------------------------------------------------------------ writer thread

    def _write_forever(self) -> None:
        assert self._loop is not None
        loop, store, q = self._loop, self.store, self._queue
        while True:
            item = q.get()
            stop = item is _STOP
            group: list[Record] = []
            ticket = 0
            while not stop:
                ticket_records = item
                assert isinstance(ticket_records, tuple)
                ticket, records = ticket_records
                group.extend(records)
                try:
                    item = q.get_nowait()
                except queue.Empty:
                    break
                stop = item is _STOP
            if ticket:
                try:
                    store.write(group)
                except Exception as exc:
                    loop.call_soon_threadsafe(self._fail, exc)
                    return
                self._reported = ticket
                loop.call_soon_threadsafe(self._done, ticket)
            if stop:
                return

    # ------------------------------------------------------------------ a writer process, on the loop

    def _sent_done(self, ticket: int, error: BaseException | None) -> None:
        """A group sent to the store's ``sender`` was answered (on the loop: ``GroupSender.serve_on``)."""
        if error is not None:
            self._fail(error)
        elif ticket > self._reported:
            self._reported = ticket

    def _answered_now(self) -> None:
        """The writer process answered groups (its pipe was readable): released now, unless a look of
        :meth:`reported` or :meth:`reap` found them (they release them, or their caller does)."""
        if self._answered is not None:
            self._answered.set()
        if not self._polling:
            self.reap()

    def _look(self) -> None:
        """The writer process's answers read now, without waiting (a system call only while groups are out)."""
        if self._direct and self._sent > self._reported and self.failed is None:
            assert self._sender is not None
            self._polling = True
            try:
                self._sender.poll_commits()
            finally:
                self._polling = False

    # ------------------------------------------------------------------ on the loop

    def _commit_inline(self, *, on_loop: bool = True) -> None:
        """Commit the group gathered since the writer was idle: here when it is small, else by the thread."""
        groups, self._inline = self._inline, None
        if groups is None or self.failed is not None:
            return
        ticket = self.submitted  # every batch since the writer went idle is in the group
        records = groups[0] if len(groups) == 1 else [r for g in groups for r in g]
        if (
            not on_loop or self._inline_size > self._inline_max or self._inline_bytes > self._inline_max_bytes
            or self._try_write is None
        ):
            self._hand(ticket, records)
            return
        started = self._clock()
        try:
            written = self._try_write(records)
        except Exception as exc:
            self._fail(exc)
            return
        if not written:  # another connection holds the database: the thread waits for it, not the loop
            self._inline_off_until = started + INLINE_COOLDOWN_S
            self._hand(ticket, records)
            return
        took = self._clock() - started
        # Capped: one outlier is not a slow disk (module docstring).
        self._inline_avg_s += (min(took, self._inline_sample_max_s) - self._inline_avg_s) * 0.2
        if self._inline_avg_s > self._inline_slow_s:
            self._inline_off_until = started + took + INLINE_COOLDOWN_S
            self._inline_avg_s = 0.0  # after the cool-down, a few commits measure the disk again
        self.inline_commits += 1
        self._inline_run += 1
        self._done(ticket)

    # ------------------------------------------------------------------ back on the loop

    def reported(self) -> bool:
        """Whether the writer reported a commit not yet released (:meth:`reap` would release something)."""
        self._look()
        return self._reported > self._committed

    def reap(self) -> None:
        """Release now what the writer reported committed whose callback has not run yet (module docstring)."""
        self._look()
        reported = self._reported
        if reported > self._committed and self.failed is None:
            self._done(reported)

    def _done(self, ticket: int) -> None:
        if ticket <= self._committed:  # released already (reap)
            return
        if self._check_files is not None and (now := time.monotonic()) >= self._next_file_check:
            self._next_file_check = now + self._file_check_interval_s
            try:
                self._check_files()
            except Exception as exc:
                self._fail(exc)
                return
        self.transactions += 1
        self._committed = ticket
        self.committed(ticket)

    def _fail(self, exc: BaseException) -> None:
        if self._answered is not None:
            self._answered.set()
        self.fail(exc)
