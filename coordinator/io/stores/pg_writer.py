"""The PostgreSQL store's group commits in a child process, a lone commit on the loop: :class:`ProcessCommitter`.

Why. A PostgreSQL coordinator's loop spends ~15-20 µs a plan making each group's rows (msgpack, CRC-32, the
statement's parameters: pg_rows.py) and in asyncpg (docs/PERFORMANCE.md §C29e, §C29j). The child
(coordinator/io/stores/pg_writer_child.py) does both on a core of its own; the loop encodes each group once
(coordinator/io/stores/writer_wire.py ``encode_group``, as for the SQLite writer child), writes it to the pipe and
reads "committed" / "failed" back. But the child adds two pipe hops and two process wake-ups to every commit, which
a lone round trip pays twice (§C29e: its p50). So, as the SQLite store does (writer_process.py), a **lone commit
when the child is idle is made inline**: on the loop's own connection, as :class:`~coordinator.io.stores.pg_commit.
PipelinedCommitter` makes it (docs/PERFORMANCE.md §C29k).

Theory of operation. The committers' contract (``submit``, ``after``, ``drained``, ``close``): payloads are released
in submit order once their batch and every earlier one committed. Each batch goes one of two ways:

* **to the child**: one request, written at once (what the pipe has no room for goes by ``add_writer``, in order:
  writer_pipes.py ``RequestWriter``); the child commits them in order through its own PipelinedCommitter (grouped,
  encoded ahead, one statement a group) and answers each commit with how many batches it held; the loop reads the
  replies (``add_reader``) and releases.
* **inline**: when nothing is in flight at the child and the batch is small (at most ``inline_max_records``
  records: one plan's), the commit task (``fleetwire-pg-inline``) commits it on the store's own connection
  (``PgStore.write_async``). Batches submitted while it is in flight wait for it and then go inline as one group
  if they are small, else to the child.

Start: the child starts with the first batch submitted (not with the committer): a cluster host has a store, and
so a committer, for each shard it serves (16 by default), and a shard that never commits needs no child (16 Python
children and 32 connections started at once held a loaded host's registrations past a minute: docs/PERFORMANCE.md
§C29k, "Later"). Until the store's own connection is open every batch waits for the inline task, which then commits
it inline or sends it to the child by the rules above: a lone commit never waits for the child's start.

Order: never both at once. A batch goes inline only when every batch sent to the child was answered, and no batch
goes to the child while an inline commit is in flight (it waits behind it): a later group never overtakes an
earlier one, and each side encodes with the other's rows committed.

The write-side keys (each plan's key and shard, its inline events' chained checksum: pg_rows.py) are kept on both
sides, alike: the child's start carries the store's, each child reply carries what its groups applied, and each
inline commit's are sent to the child (a :data:`~coordinator.io.stores.writer_wire.KEYS` request) before the next
group. Each side takes its new keys from the database's sequence itself.

Fencing is the database's, as before: each group's statement checks the fence's epochs in its transaction. The fence
the child uses is the store's (:attr:`PgStore.fence`, :attr:`PgStore.owner`), sent to it when it changes, before the
next batch (a cleared fence: every later group is refused). A refused group fails the committer with
:class:`~coordinator.io.cluster.leases.ShardFenced`; any other failure, a child that exits or a garbled reply with
:class:`~coordinator.io.stores.integrity.StoreError`: nothing after it is released.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
from array import array
from collections import deque
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Final, Protocol, TypeVar

import msgspec
import structlog

from coordinator.io.cluster.leases import ShardFenced
from coordinator.io.stores.backlog import Backlog
from coordinator.io.stores.child_process import ChildProcess
from coordinator.io.stores.integrity import StoreError
from coordinator.io.stores.pg_commit import reopen
from coordinator.io.stores.pg_rows import RowGroup
from coordinator.io.stores.writer_pipes import ReplyReader, RequestWriter
from coordinator.io.stores.writer_wire import CLOSE, FAILED, KEYS, REQUEST_HEADER, encode_group
from coordinator.records import Record
from coordinator.shards import ClusterConfig

__all__ = ["FENCE", "FENCED", "GROUP", "INLINE_MAX_RECORDS", "MODE_ENV", "ProcessCommitter", "apply_deltas",
           "deltas_of", "writer_mode"]  # fmt: skip

log = structlog.get_logger(__name__)

T = TypeVar("T")

GROUP: Final = 1  # a request's kind: a group of records (the first request: the setup)
FENCE: Final = 4  # a request's kind: the fence now, msgpack ``[owner, [[shard, epoch], ...]]``
FENCED: Final = -3  # a reply's value: the group was refused by the fence (ShardFenced); its text follows
INLINE_MAX_RECORDS: Final = 32  # a batch this small goes inline when the child is idle (one plan's records)
CLOSE_TIMEOUT_S: Final = 10.0
MODE_ENV: Final = "FLEETWIRE_PG_WRITER"  # process: this committer (postgres.py PgStore.make_committer)

# One group's write-side keys as it applied them (pg_rows.py PgRows.apply_committed), compact: the new plans, their
# keys and shards (int64 arrays in their order), the forgotten plans, the plans whose chained checksum moved and the
# checksums (an int64 array), the plans ended. The arrays cost the reader one object each, not one a plan
# (docs/PERFORMANCE.md §C29k, "Later").
_Delta = tuple[list[str], bytes, bytes, list[str], list[str], bytes, list[str]]
_decode_deltas = msgspec.msgpack.Decoder(list[_Delta]).decode


def deltas_of(groups: Sequence[RowGroup]) -> list[_Delta]:
    """What ``groups`` applied to the write-side keys, in order (the other side applies it: :func:`apply_deltas`)."""
    out: list[_Delta] = []
    for g in groups:
        fresh, chained = g.fresh, g.rows[3]
        fresh_ids = list(fresh)
        out.append((fresh_ids, array("q", fresh.values()).tobytes(),
                    array("q", map(g.fresh_shards.__getitem__, fresh_ids)).tobytes(), list(g.forgotten),
                    list(chained), array("q", chained.values()).tobytes(), list(g.rows[5])))  # fmt: skip
    return out


class _Keyed(Protocol):
    """A store's write-side keys (postgres.py ``PgStore.write_keys``)."""

    @property
    def write_keys(self) -> tuple[dict[str, int], dict[str, int], dict[str, int]]: ...


def apply_deltas(store: _Keyed, body: bytes) -> None:
    """The other side's groups' keys (msgpack of :func:`deltas_of`) applied as its commits applied them (in the
    order of pg_rows.py ``PgRows.apply_committed``; not recorded in postgres.py ``PgStore.applied``)."""
    keys, shards_of, chained = store.write_keys
    for fresh, fresh_keys, fresh_shards, forgotten, moved, checksums, ended in _decode_deltas(body):
        for plan_id in forgotten:
            keys.pop(plan_id, None)
            shards_of.pop(plan_id, None)
            chained.pop(plan_id, None)
        if moved:
            chained.update(zip(moved, array("q", checksums), strict=True))
        for plan_id in ended:
            chained.pop(plan_id, None)
        if fresh:
            keys.update(zip(fresh, array("q", fresh_keys), strict=True))
            shards_of.update(zip(fresh, array("q", fresh_shards), strict=True))


class WriterSource(Protocol):
    """What the committer reads and drives of the coordinator's store (postgres.py ``PgStore``)."""

    description: str
    cluster: ClusterConfig
    fence: dict[int, int]
    owner: str
    applied: list[RowGroup] | None
    write_keys: tuple[dict[str, int], dict[str, int], dict[str, int]]

    @property
    def dsn(self) -> str: ...

    async def open_async(self, on_lost: Callable[[], None] | None = None) -> None: ...

    def lost(self) -> bool: ...

    async def write_async(self, records: Sequence[Record]) -> None: ...

    def ring(self, records: Sequence[Record]) -> None: ...

    async def close_async(self) -> None: ...


class ProcessCommitter(Backlog[T]):
    """Commits record batches in the store's writer child, a lone one inline; releases in order (module docstring).

    Args:
        store: the coordinator's store (its DSN, cluster, fence, owner and keys; its writer connection for the
            inline commits).
        release: called on the loop with each payload once its batch (and every earlier one) committed.
        on_failure: called on the loop, once, when a commit fails or the child is lost.
        max_backlog_bytes: :attr:`over` past this many bytes waiting for a commit (0: no bound).
        inline_max_records: the largest batch committed inline when the child is idle (0: never inline).
    """

    def __init__(self, store: WriterSource, release: Callable[[T], None], on_failure: Callable[[BaseException], None],
                 *, max_backlog_bytes: int = 0, inline_max_records: int = INLINE_MAX_RECORDS) -> None:  # fmt: skip
        super().__init__(release, on_failure, max_backlog_bytes)
        self.store = store
        self.transactions = 0  # the child's replies read (its commits)
        self.inline = 0  # inline commits
        self.batches = 0
        self.child: ChildProcess | None = None
        self._inline_max = inline_max_records
        self._encoder = msgspec.msgpack.Encoder()
        self._sent: deque[tuple[int, Sequence[Record]]] = deque()  # (ticket, records) at the child, not answered
        self._held: deque[tuple[int, Sequence[Record]]] = deque()  # (ticket, records) for the inline task, in order
        self._held_records = 0
        self._busy = False  # the inline task holds batches: every submit waits behind them
        self._inline_ok = False  # the store's own connection is open (inline commits may go)
        self._fence: tuple[str, dict[int, int]] | None = None  # the fence last sent to the child
        self._requests: RequestWriter | None = None
        self._replies: ReplyReader | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ready = False  # the child's first reply (its store opened) was read
        self._idle: asyncio.Future[None] | None = None  # close() waits for every batch's reply
        self._wake: asyncio.Future[None] | None = None  # the inline task waits on it while nothing is held
        self._task: asyncio.Task[None] | None = None
        self._closing = False
        # A shard's store rings the cluster's doorbell after each commit (coordinator/io/cluster/cores.py ShardPgStore;
        # PgStore's does nothing): the child's groups do not pass through its write_async, so the committer rings.
        self._ring: Callable[[Sequence[Record]], None] = store.ring
        store.applied = []  # the inline commits' keys, for the child (postgres.py PgStore.apply_committed)

    def start(self) -> None:
        """Start the inline commit task; the child starts with the first batch (module docstring, "Start")."""
        if self._loop is not None or self.failed is not None:
            return
        self._loop = asyncio.get_running_loop()
        self._busy = True  # until the store's own connection is open, batches wait for the inline task
        self._task = self._loop.create_task(self._inline_forever(), name="fleetwire-pg-inline")

    def _spawn(self) -> bool:
        """Start the child (its setup: the store's DSN, cluster, fence and keys now); False: it could not start."""
        loop = self._loop
        assert loop is not None
        try:
            child = self.child = ChildProcess(
                [sys.executable, "-m", "coordinator.io.stores.pg_writer_child", str(os.getpid())],
                python_path=str(Path(__file__).resolve().parents[3]),
            )
        except OSError as exc:
            self._fail(StoreError(f"cannot start the store's writer process: {exc}"))
            return False
        os.set_blocking(child.stdin_fd, False)
        os.set_blocking(child.stdout_fd, False)
        self._requests, self._replies = RequestWriter(child.stdin_fd), ReplyReader(child.stdout_fd)
        self._requests.serve_on(loop, lambda exc: self._lost(f"its pipe: {exc}"))
        store, cluster = self.store, self.store.cluster
        # The libpq variables the DSN may lean on (a password file): the child's environment holds none of ours.
        pg_env = {k: v for k, v in os.environ.items() if k.startswith("PG")}
        setup = msgspec.msgpack.encode([store.dsn, cluster.name, cluster.shards, list(cluster.partitions), store.owner,
                                        sorted(store.fence.items()), *store.write_keys,
                                        pg_env])  # fmt: skip
        store.applied = []  # the inline commits' keys so far are in the setup's
        self._fence = store.owner, store.fence
        self._write([REQUEST_HEADER.pack(len(setup), GROUP), setup])
        loop.add_reader(child.stdout_fd, self._readable)
        return True

    # ------------------------------------------------------------------ submit: inline or to the child

    def submit(self, records: Sequence[Record], payload: T, size: int = 0) -> None:
        """Commit ``records``; release ``payload`` once they (and everything before) are durable."""
        if self.failed is not None:
            return
        if self.child is None and self._loop is not None and not self._spawn():
            return
        self.batches += 1
        ticket = self.queued(payload, size)
        if self._busy:  # an inline commit in flight: behind it (module docstring, "Order")
            self._held.append((ticket, records))
            self._held_records += len(records)
            return
        if self._sent or len(records) > self._inline_max or not self._inline_ok:
            self._to_child(ticket, records)
            return
        self._busy = True
        self._held.append((ticket, records))
        self._held_records = len(records)
        self._kick()

    def _to_child(self, ticket: int, records: Sequence[Record]) -> None:
        store = self.store
        fence = self._fence
        if fence is None or fence[1] is not store.fence or fence[0] != store.owner:
            self._fence = store.owner, store.fence
            body = msgspec.msgpack.encode([store.owner, sorted(store.fence.items())])
            self._write([REQUEST_HEADER.pack(len(body), FENCE), body])
        body = encode_group(self._encoder, records)
        self._sent.append((ticket, records))
        self._write([REQUEST_HEADER.pack(len(body), GROUP), body])

    def _write(self, parts: list[bytes]) -> None:
        requests = self._requests
        if requests is None or self.failed is not None:
            return
        try:
            requests.write_soon(parts)
        except OSError as exc:
            self._lost(f"its pipe: {exc}")

    # ------------------------------------------------------------------ the inline commits

    async def _inline_forever(self) -> None:
        store = self.store
        try:
            await store.open_async(self._kick)
        except Exception as exc:
            self._fail(exc)
            return
        self._inline_ok = True
        loop = asyncio.get_running_loop()
        while self.failed is None:
            held = self._held
            if not held:
                self._busy = False
                if store.lost():  # the database went away between commits (a failover): reopen, the child meanwhile
                    self._inline_ok = False
                    if not await self._reopen():
                        return
                    self._inline_ok = True
                    continue
                if self._closing:
                    return
                self._wake = loop.create_future()
                await self._wake
                continue
            if self._sent or self._held_records > self._inline_max or store.lost():
                while held:  # to the child, in order (nothing overtakes them: submit waits while _busy)
                    self._to_child(*held.popleft())
                self._held_records = 0
                continue
            ticket, group = held.popleft()
            if held:
                group = list(group)
                while held:
                    ticket, records = held.popleft()
                    group += records
            self._held_records = 0
            try:
                await store.write_async(group)
            except Exception as exc:
                self._fail(exc)
                return
            self.inline += 1
            applied = store.applied
            if applied:  # its keys reach the child before any later group (module docstring)
                store.applied = []
                if self._requests is not None:  # else no child yet: it starts with the store's keys
                    body = self._encoder.encode(deltas_of(applied))
                    self._write([REQUEST_HEADER.pack(len(body), KEYS), body])
            self.committed(ticket)

    def _kick(self) -> None:
        """Wake the inline task: a batch to commit inline (:meth:`submit`), or the store's connection closed under it
        (the task reopens it)."""
        wake = self._wake
        if wake is not None:
            self._wake = None
            if not wake.done():
                wake.set_result(None)

    async def _reopen(self) -> bool:
        """The store's connection was lost with no inline commit in flight: open a new one (batches go to the child
        meanwhile; as pg_commit.py ``PipelinedCommitter._reopen``)."""
        return await reopen(self.store, self._kick, lambda: self._closing or self.failed is not None)

    # ------------------------------------------------------------------ the child's replies

    def _readable(self) -> None:
        replies = self._replies
        if replies is None:
            return
        ended = replies.read_available()
        while replies.whole_reply():
            value, count, body = replies.next_reply(0)
            if value == FAILED or value == FENCED:
                text = body.decode(errors="replace")
                self._stop_serving()
                self._fail(ShardFenced(text) if value == FENCED else StoreError(
                    f"cannot write the store {self.store.description}: {text}"))  # fmt: skip
                return
            if not self._ready:
                self._ready = True
                continue
            if body:
                try:
                    apply_deltas(self.store, body)
                except (msgspec.DecodeError, ValueError, TypeError) as exc:
                    self._lost(f"a garbled reply: {exc}")
                    return
            self._answered(count)
            if self.failed is not None:
                return
        if ended is not None:
            self._lost(f"it closed its pipe{ended}")

    def _answered(self, count: int) -> None:
        sent, ring = self._sent, self._ring
        if count > len(sent):
            self._stop_serving()
            self._fail(StoreError(f"the store's writer process for {self.store.description} answered {count} "
                                  f"commits, {len(sent)} were sent"))  # fmt: skip
            return
        ticket = 0
        for _ in range(count):
            ticket, records = sent.popleft()
            ring(records)
        self.transactions += 1
        if ticket:
            self.committed(ticket)
        if not sent and self._idle is not None and not self._idle.done():
            self._idle.set_result(None)

    def _lost(self, why: str) -> None:
        self._stop_serving()
        child = self.child
        if child is not None:
            child.when_ended()  # reaped once it ends (a failed committer may never be closed)
        status = child.ended() if child is not None else None
        self._fail(StoreError(f"the store's writer process for {self.store.description} was lost ({why}; "
                              f"{status or 'still running'})"))  # fmt: skip

    def _stop_serving(self) -> None:
        loop, child = self._loop, self.child
        if loop is not None and child is not None and self._replies is not None:
            loop.remove_reader(child.stdout_fd)
            self._replies = None
        if self._requests is not None:
            self._requests.discard()
        if self._idle is not None and not self._idle.done():
            self._idle.set_result(None)

    def _fail(self, exc: BaseException) -> None:
        self._sent.clear()
        self._held.clear()
        self._held_records = 0
        self._kick()
        self.fail(exc)

    # ------------------------------------------------------------------ close

    async def close(self) -> None:
        """Wait for every batch's commit, then close the child (SIGKILL after :data:`CLOSE_TIMEOUT_S`) and the
        store's own connection."""
        if self._loop is None:
            return
        self._closing = True
        self._kick()
        task, self._task = self._task, None
        if task is not None:
            await task
        if self.failed is None and self._sent:
            self._idle = asyncio.get_running_loop().create_future()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._idle, CLOSE_TIMEOUT_S)
        if self.failed is None and self._requests is not None:
            self._write([REQUEST_HEADER.pack(0, CLOSE)])
            with contextlib.suppress(OSError):
                await asyncio.to_thread(self._requests.flush, CLOSE_TIMEOUT_S)
        self._stop_serving()
        child, self.child, self._loop = self.child, None, None
        if child is not None:
            if not await asyncio.to_thread(child.wait, CLOSE_TIMEOUT_S):
                child.kill()
                await asyncio.to_thread(child.wait, CLOSE_TIMEOUT_S)
            child.close_pipes()
        self.store.applied = None
        await self.store.close_async()

    @property
    def ready(self) -> bool:
        """The store's own connection is open (inline commits may go); the child, if started, answered ready."""
        return self._inline_ok and (self.child is None or self._ready)

    @property
    def pid(self) -> int | None:
        return None if self.child is None else self.child.pid

    def reported(self) -> bool:
        """Never: each reply is released as it is read (the driver's reap has nothing to do)."""
        return False

    def reap(self) -> None:
        """Nothing waits for a callback here (pg_commit.py's ``reap``)."""

    def __repr__(self) -> str:
        return f"ProcessCommitter({self.store.description})"


def writer_mode() -> str:
    """``process`` (this committer) or ``loop`` (pg_commit.py's), from :data:`MODE_ENV`."""
    return "process" if os.environ.get(MODE_ENV) == "process" else "loop"
