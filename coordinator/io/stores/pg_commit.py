"""The PostgreSQL store's group committer: commits on the server's own event loop, pipelined.

Theory of operation. The same contract as :class:`~coordinator.io.stores.commit.GroupCommitter`
(``submit``, ``after``, ``drained``, ``close``): each batch of records comes with a *payload*
(the frames and closes of one core step), and payloads are released strictly in submit order
once their batch (and every earlier one) has committed. Frames therefore leave only after the
commit that holds their records, as with SQLite (docs/SEMANTICS.md §Durability).

What differs is where the commit runs. A PostgreSQL commit is a network round trip, not a
disk write: the coordinator waits on a socket, it does not burn a thread. So one task on the
server's loop (``fleetwire-pg-commit``) drives the store's writer connection (asyncpg) itself:

* **No thread hop.** ``submit`` appends to the group being gathered and wakes the task; the
  task builds the group's one statement (coordinator/io/stores/postgres.py: the fence and every row,
  one round trip) and awaits it on this loop. No hand-over to a writer thread and back (a
  thread wake-up, the GIL passed twice, the loop woken from outside).
* **Pipelined.** While one group's transaction is in flight, the batches submitted meanwhile
  gather into the next group, which is sent the moment the first commit returns: before the
  first group's payloads are released (they go a callback later, once the next statement is on
  its way), so the database does not wait while the loop hands a group's frames to their
  sessions; with nothing gathered they are released at once. That callback waits for the loop's
  next turn, behind the frames read meanwhile (a worker's frame of a thousand results is a core
  step of tens of ms): the driver releases such a payload sooner, within the frame it is reading
  (:meth:`PipelinedCommitter.reported` and :meth:`PipelinedCommitter.reap`, as for the SQLite
  writer's reports: coordinator/io/frontdoor/core_driver.py §Parts), so a worker's next leases do
  not wait for the core to finish another frame. At most one transaction is in
  flight per store (per shard's core), so groups commit in submit order and each sees the rows
  of the one before. Under load the group grows to what one round trip carries; an idle core's
  lone request pays one round trip and nothing else.
* **Encoded ahead.** A group's encoding (its rows as array parameters: PgRows.encode_rows, pg_rows.py) is
  loop work while the database waits, as long as the round trip for a big group. So while one
  group's statement is in flight, a big gathered group (at least :data:`AHEAD_MIN_RECORDS`
  records) is taken and encoded at once (``PgStore.encode_ahead``, a callback once the statement
  is on its way, or once such a batch is submitted), and goes the moment the first commit
  returns; batches submitted after it go to the group after. Its new keys and chained checksums
  are applied when it is encoded, before the commits ahead of it return: safe, because a failed
  commit stops the committer and nothing after it is sent or released. A group that needs a
  round trip to encode (a block of new keys, a plan's stored checksum) is encoded in turn, after
  the commit before it, as are small groups (small batches still merge while one is in flight).
* **Split when nothing is in flight.** A big group taken with nothing in flight (the first of a
  burst) would be encoded whole while the database idles. The store may encode only its first
  part then (``encode_ahead(..., split=True)``, :attr:`AsyncStore.splitting`): the rest is encoded
  while that part's statement is in flight, both in one transaction (PgStore._send_split), and the
  store calls :meth:`PipelinedCommitter.rest_encoded` once the rest's statement is on its way; only
  then may the next group be encoded ahead.
* **Bounded groups.** A group takes whole batches up to :data:`MAX_GROUP_RECORDS` records (a
  batch is never split: one core step's records commit together); the rest wait for the next
  group. Each group's fence holds its shards' lease rows ``FOR SHARE`` until it commits, and the
  host's lease renewal (an ``UPDATE`` of those rows) waits behind it: under load on a 2-core
  machine unbounded groups reached 20,000 records and 0.9 s a commit, and renewals then missed
  their lease (bench/cluster_throughput.py lost every shard and reloaded one mid-run). The
  group's encoding also runs on the loop, so the bound caps that stall as well.
* **Fencing unchanged.** Every group commit checks its shards' epochs in the same statement
  (:data:`~coordinator.io.cluster.leases.FENCE`); a fenced group changes no row and fails with
  :class:`~coordinator.io.cluster.leases.ShardFenced`.

A failed commit is fatal to the core (``on_failure``), as with SQLite: nothing of the failed
group, or after it, is released. A connection lost while no group is in flight (the database
primary went away between commits) is not a failure: nothing is uncertain, so the task opens a
new connection (:meth:`PipelinedCommitter._reopen`; with a multi-host DSN, to the promoted
standby) and carries on, while the server answers new submits ``unavailable`` (retryable) and
new handshakes 503 + ``Retry-After`` (``PgStore.away``).

Backpressure is the same byte count: :attr:`backlog_bytes` waits for a commit, and
:meth:`drained` returns once it is at most half of ``max_backlog_bytes``.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable, Sequence
from typing import Protocol, TypeVar

import structlog

from coordinator.io.stores.backlog import Backlog
from coordinator.records import Record

__all__ = ["AHEAD_MIN_RECORDS", "MAX_GROUP_RECORDS", "RECONNECT_CAP_S", "RECONNECT_FIRST_S", "AsyncStore",
           "PipelinedCommitter"]

log = structlog.get_logger(__name__)

T = TypeVar("T")

RECONNECT_FIRST_S = 0.05  # the first retry after a lost connection; doubling ...
RECONNECT_CAP_S = 1.0  # ... up to this
MAX_GROUP_RECORDS = 4096  # the most records one group takes (more only in one batch): module docstring
AHEAD_MIN_RECORDS = 2048  # a gathered group this big is encoded while the one before is in flight: module docstring


class AsyncStore(Protocol):
    """What the committer needs: a writer connection opened on the loop, and one commit per group."""

    description: str
    splitting: bool  # the group encode_ahead took last is split: its rest is encoded in write_async
    on_encoded: Callable[[], None] | None  # called once a split group's rest is encoded and on its way

    async def open_async(self, on_lost: Callable[[], None] | None = None) -> None: ...

    def lost(self) -> bool: ...

    async def write_async(self, records: Sequence[Record]) -> None: ...

    def encode_ahead(self, records: Sequence[Record], split: bool = False) -> bool: ...

    async def close_async(self) -> None: ...


class Reopened(Protocol):
    """What :func:`reopen` uses of a store."""

    description: str

    async def open_async(self, on_lost: Callable[[], None] | None = None) -> None: ...


async def reopen(store: Reopened, on_lost: Callable[[], None], stopped: Callable[[], bool]) -> bool:
    """Open ``store``'s connection again (``on_lost`` told when it closes), retrying from :data:`RECONNECT_FIRST_S`,
    doubling up to :data:`RECONNECT_CAP_S`, until it opens (True) or ``stopped()`` (False). One warning when the
    first try fails and one when it opens (the committers' ``_reopen``: this module's and pg_writer.py's)."""
    delay, logged = RECONNECT_FIRST_S, False
    while not stopped():
        try:
            await store.open_async(on_lost)
        except Exception as exc:
            if not logged:
                log.warning("store connection lost; reconnecting", store=store.description, error=str(exc))
                logged = True
            await asyncio.sleep(delay)
            delay = min(RECONNECT_CAP_S, delay * 2)
            continue
        log.warning("store connection reopened", store=store.description)
        return True
    return False


class PipelinedCommitter(Backlog[T]):
    """Commits record batches through ``store`` on the running loop, one group in flight at a time.

    Args:
        store: a store with :class:`AsyncStore`'s methods (coordinator/io/stores/postgres.py).
        release: called on the loop with each payload once its batch (and every earlier one) committed.
        on_failure: called on the loop, once, when a commit fails.
        max_backlog_bytes: :attr:`over` past this many bytes waiting for a commit (0: no bound).
        max_group_records: the most records one group takes, in whole batches (a larger batch
            goes alone).
    """

    def __init__(
        self,
        store: AsyncStore,
        release: Callable[[T], None],
        on_failure: Callable[[BaseException], None],
        *,
        max_backlog_bytes: int = 0,
        max_group_records: int = MAX_GROUP_RECORDS,
    ) -> None:
        super().__init__(release, on_failure, max_backlog_bytes)
        self.store = store
        self.transactions = 0  # groups committed
        self.batches = 0  # batches submitted
        self.reconnects = 0  # connections reopened after a loss (database failovers ridden through)
        self._batches: deque[tuple[int, Sequence[Record]]] = deque()  # (ticket, records) not yet sent
        self._next: tuple[Sequence[Record], int, bool] | None = None  # a group taken (encoded ahead?) not sent yet
        self._ahead_ok = False  # the group in flight was encoded ahead: the next one may be (module docstring)
        self._ahead_due = False  # an _encode_next callback is scheduled
        self.ahead = 0  # groups encoded ahead
        self._max_group = max_group_records
        self._wake: asyncio.Future[None] | None = None  # the task waits on it while nothing is gathered
        self._task: asyncio.Task[None] | None = None
        self._closing = False
        self._due = 0  # the last ticket committed (its release may wait for a callback: reap releases it sooner)
        self._released = 0  # the last ticket released
        store.on_encoded = self.rest_encoded

    def start(self) -> None:
        """Start the commit task on the running loop (it first opens the store's writer connection there)."""
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._commit_forever(), name="fleetwire-pg-commit")

    def submit(self, records: Sequence[Record], payload: T, size: int = 0) -> None:
        """Commit ``records``; release ``payload`` once they (and everything before) are durable."""
        if self.failed is not None:
            return
        self.batches += 1
        self._batches.append((self.queued(payload, size), records))
        if self._ahead_ok and not self._ahead_due and self._next is None and len(records) >= AHEAD_MIN_RECORDS:
            self._ahead_due = True
            asyncio.get_running_loop().call_soon(self._encode_next)
        wake = self._wake
        if wake is not None:
            self._wake = None
            if not wake.done():
                wake.set_result(None)

    async def close(self) -> None:
        """Commit what is gathered, release it, and close the store's writer connection."""
        task = self._task
        if task is None:
            return
        self._closing = True
        wake = self._wake
        if wake is not None:
            self._wake = None
            if not wake.done():
                wake.set_result(None)
        try:
            await task
        finally:
            self._task = None
            await self.store.close_async()

    # ------------------------------------------------------------------ the commit task

    async def _commit_forever(self) -> None:
        try:
            await self.store.open_async(self._kick)
        except Exception as exc:
            self._fail(exc)
            return
        loop = asyncio.get_running_loop()
        while True:
            if self.store.lost() and not await self._reopen():
                return
            taken = self._next
            if taken is not None:
                self._next = None
                group, ticket, ahead = taken
            elif not self._batches:
                if self._closing:
                    return
                self._wake = loop.create_future()
                await self._wake
                continue
            else:
                group, ticket = self._take()
                ahead = self._encode_ahead(group, split=True)  # nothing in flight: the store may split it
            self._ahead_ok = ahead and not self.store.splitting
            if ahead and self._batches and not self._ahead_due:
                self._ahead_due = True
                loop.call_soon(self._encode_next)  # runs once the statement below is on its way
            try:
                await self.store.write_async(group)
            except Exception as exc:
                self._fail(exc)
                return
            finally:
                self._ahead_ok = False
            self.transactions += 1
            self._due = ticket
            if (self._batches or self._next is not None) and not self.store.lost():
                # The next group is gathered: it is encoded and sent first, and this one's payloads are released
                # once it is in flight (a callback runs before the task resumes), so the database is not idle
                # while the loop hands this group's frames to their sessions (module docstring, "Pipelined").
                loop.call_soon(self._done, ticket)
            else:
                self._done(ticket)

    def _take(self) -> tuple[Sequence[Record], int]:
        """The next group: whole batches, in order, up to ``max_group_records`` records (at least one batch)."""
        batches, room = self._batches, self._max_group
        ticket, group = batches.popleft()
        if not batches or len(group) + len(batches[0][1]) > room:
            return group, ticket  # one batch: as it is, no copy
        group = list(group)
        while batches and len(group) + len(batches[0][1]) <= room:
            ticket, records = batches.popleft()
            group += records
        return group, ticket

    def rest_encoded(self) -> None:
        """The store: the group in flight, split, is encoded whole now; the next one may be encoded ahead."""
        self._ahead_ok = True
        if self._batches and not self._ahead_due and self._next is None:
            self._ahead_due = True
            asyncio.get_running_loop().call_soon(self._encode_next)

    def _encode_ahead(self, group: Sequence[Record], split: bool = False) -> bool:
        """The store encodes ``group`` now (True), or it will when it is sent (False: it needs a round trip)."""
        try:
            ahead = self.store.encode_ahead(group, split)
        except Exception:
            return False  # encoded again when sent, where the error fails the committer in order
        self.ahead += ahead
        return ahead

    def _encode_next(self) -> None:
        """While an encoded-ahead group is in flight: take the next group and encode it, if it is big enough."""
        self._ahead_due = False
        if not self._ahead_ok or self._next is not None or self.failed is not None:
            return
        gathered, room = 0, self._max_group
        for _, records in self._batches:
            gathered += len(records)
            if gathered >= AHEAD_MIN_RECORDS or gathered > room:
                break
        if gathered < AHEAD_MIN_RECORDS:
            return
        group, ticket = self._take()
        self._next = group, ticket, self._encode_ahead(group)

    def _kick(self) -> None:
        """The connection closed under the store: wake the task, which reopens it."""
        wake = self._wake
        if wake is not None:
            self._wake = None
            if not wake.done():
                wake.set_result(None)

    async def _reopen(self) -> bool:
        """The connection was lost with no group in flight (a database failover): open a new one.

        Safe to carry on: every group sent before has committed (else the committer failed), so
        memory and the store agree, and the next group's fence still checks the lease. Batches
        submitted meanwhile wait (their frames with them). Tries until a host accepts the
        connection or the core stops (its lease lapsed: the cluster host stops it).
        """
        if await reopen(self.store, self._kick, lambda: self._closing):
            self.reconnects += 1
            return True
        if self._batches or self._next is not None:  # closing with batches that could not be written
            self._fail(ConnectionError(f"the store {self.store.description} stayed away; {self.pending} "
                                       "replies were never sent"))  # fmt: skip
        return False

    def reported(self) -> bool:
        """Whether a committed group's payloads wait for their release callback (:meth:`reap` would release them)."""
        return self._due > self._released

    def reap(self) -> None:
        """Release now what committed and waits for its callback (the driver, between two messages of a frame).

        Only once the commit has returned, and in order: the callback finds it released and does nothing.
        """
        if self._due > self._released and self.failed is None:
            self._done(self._due)

    def _done(self, ticket: int) -> None:
        if ticket <= self._released:  # released already (reap)
            return
        self._released = ticket
        self.committed(ticket)

    def _fail(self, exc: BaseException) -> None:
        if self.failed is None:
            self._batches.clear()
            self._next = None
        self.fail(exc)
