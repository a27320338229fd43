"""The cluster's doorbell: a shard's group commits wake the view sessions that follow its plans (docs/CLUSTER.md).

Every shard's core rings it at most once per group commit (coalesced, never per event): a
PostgreSQL ``NOTIFY`` on :data:`CHANNEL` whose payload is ``"<shard>:<max seq>"`` (the highest
event seq of the commit, :func:`bell_payload`). A view session's follower
(coordinator/io/cluster/sessions.py) waits on the shards of the plans it follows and reads their
rows again when one rings. The doorbell is only a wake-up: a watcher also reads again every
:data:`POLL_S` in case one was lost (a dropped connection).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from typing import Any, Final

import structlog

from coordinator.io.cluster.views import mark_wanted

__all__ = ["CHANNEL", "POLL_S", "WANTED_S", "WARM_POLL_S", "Doorbell", "bell_payload", "open_connection", "parse_bell"]

log = structlog.get_logger(__name__)

CHANNEL: Final = "fleetwire_commits"
POLL_S: Final = 5.0  # a watcher reads again this often even without a doorbell (one lost with its connection)
WARM_POLL_S: Final = 0.1  # ... and this often while the owners may not ring yet (Doorbell.poll_s)
WANTED_S: Final = 30.0  # a doorbell marked wanted stays wanted this long (renewed while watchers wait)


async def open_connection(dsn: str) -> Any:
    """An asyncpg connection on the running loop (the doorbell's)."""
    import asyncpg  # type: ignore[import-untyped]

    return await asyncpg.connect(dsn, timeout=10, command_timeout=30)


def bell_payload(shard: int, max_seq: int) -> str:
    """The doorbell's payload: the shard and the highest event seq of the group commit."""
    return f"{shard}:{max_seq}"


def parse_bell(payload: str) -> tuple[int, int] | None:
    """``(shard, max seq)`` of a doorbell payload; None for one this version does not read."""
    shard, _, seq = payload.partition(":")
    try:
        return int(shard), int(seq or 0)
    except ValueError:
        return None


class Doorbell:
    """The ``NOTIFY`` doorbell of a coordinator: rings for its shards' commits, wakes its watchers.

    :meth:`ring` is called by a shard's store after every group commit (from any thread); it
    coalesces per shard, so at most one notification leaves per group commit (fewer while one
    is in flight). :meth:`wait_on` registers a watcher's wake-up for some shards and ``LISTEN`` s
    while any watcher waits.

    ``gated`` (a cluster host's doorbell): it rings only while some watcher waits, on this
    coordinator (:meth:`wait_on`) or on any other: a coordinator whose watchers wait marks the
    doorbell wanted in ``fleetwire_views`` (key ``doorbell``, for :data:`WANTED_S`, renewed while
    they wait: :meth:`keep_wanted`), and each owner reads that mark every lease round
    (views.py :data:`WANTED` of ``doorbell``, into :attr:`wanted`). So a cluster nobody watches sends no
    ``NOTIFY`` at all (each is a transaction and a wake-up of a PostgreSQL backend per group
    commit). Until the owners' next round has seen a new mark (:attr:`warm_s`), watchers read
    every :data:`WARM_POLL_S` instead of relying on rings (:meth:`poll_s`).
    """

    def __init__(self, dsn: str, connect: Callable[[str], Any], *, gated: bool = False, warm_s: float = 1.0) -> None:
        self._dsn = dsn
        self._connect = connect
        self.gated = gated
        self.warm_s = warm_s
        self.wanted = False  # gated: some coordinator's watchers wait (the owners' rounds set it)
        self._marked_at = -1e18  # monotonic time this doorbell last marked itself wanted in the database
        self._warm_until = 0.0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._conn: Any = None
        self._lock = asyncio.Lock()
        self._pending: dict[int, int] = {}  # shard -> highest seq not rung yet
        self._sender: asyncio.Task[None] | None = None
        self._waiters: dict[int, set[asyncio.Event]] = {}
        self._listening = False
        self.rung = 0  # notifications sent (tests and /metrics-free introspection)
        self.heard = 0  # notifications received
        self._closed = False

    def bind(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop

    def unheard(self) -> bool:
        """Gated and nobody watches anywhere in the cluster: a ring now is dropped (a store need not work one out)."""
        return self.gated and not self.wanted and not self._waiters

    def ring(self, shard: int, max_seq: int) -> None:
        """A group commit of ``shard`` returned (any thread): ring once it is this loop's turn."""
        if self.gated and not self.wanted and not self._waiters:
            return  # nobody watches anywhere in the cluster
        loop = self._loop
        if loop is not None and not self._closed:
            loop.call_soon_threadsafe(self._queue, shard, max_seq)

    def _queue(self, shard: int, max_seq: int) -> None:
        pending = self._pending
        if pending.get(shard, -1) < max_seq:
            pending[shard] = max_seq
        if self._sender is None and not self._closed:
            self._sender = asyncio.ensure_future(self._send())

    async def _send(self) -> None:
        try:
            while self._pending and not self._closed:
                batch, self._pending = self._pending, {}
                payloads = [bell_payload(shard, seq) for shard, seq in batch.items()]
                try:
                    async with self._lock:
                        conn = await self._open()
                        await conn.execute("SELECT pg_notify($1, p) FROM unnest($2::text[]) AS p", CHANNEL, payloads)
                    self.rung += len(payloads)
                except Exception as exc:  # the database is away: watchers read again after POLL_S
                    log.warning("doorbell not rung", error=f"{type(exc).__name__}: {exc}")
                    await self._drop()
                    return
        finally:
            self._sender = None

    async def _open(self) -> Any:
        if self._conn is None or self._conn.is_closed():
            self._conn = await self._connect(self._dsn)
            self._listening = False
            # A NOTIFY's transaction takes an xid and a commit record: not worth a WAL flush (nor a
            # standby's round trip) for a wake-up that watchers back up with a poll anyway.
            await self._conn.execute("SET synchronous_commit = off")
        if self._waiters and not self._listening:
            await self._conn.add_listener(CHANNEL, self._heard)
            self._listening = True
        return self._conn

    async def _drop(self) -> None:
        conn, self._conn, self._listening = self._conn, None, False
        if conn is not None:
            conn.terminate()

    def _heard(self, conn: Any, pid: int, channel: str, payload: str) -> None:
        self.heard += 1
        parsed = parse_bell(payload)
        if parsed is None:
            return
        for wake in self._waiters.get(parsed[0], ()):
            wake.set()

    async def wait_on(self, wake: asyncio.Event, shards: set[int]) -> None:
        """Set ``wake`` on every doorbell of ``shards`` (replacing what it waited on); LISTEN first."""
        self.forget(wake)
        for shard in shards:
            self._waiters.setdefault(shard, set()).add(wake)
        if shards and not self._listening:
            try:
                async with self._lock:
                    await self._open()
            except Exception as exc:
                log.warning("cannot listen for the doorbell; watchers poll", error=f"{type(exc).__name__}: {exc}")
                await self._drop()
        if shards:
            await self.keep_wanted()

    async def keep_wanted(self) -> None:
        """Gated, with watchers waiting: mark the doorbell wanted in the database (again every third of WANTED_S)."""
        if not self.gated or not self._waiters:
            return
        now = time.monotonic()
        if now - self._marked_at < WANTED_S / 3:
            return
        try:
            async with self._lock:
                conn = await self._open()
                already, _ = await mark_wanted(conn, "doorbell", WANTED_S)
        except Exception as exc:  # the database is away: watchers poll meanwhile
            log.warning("cannot mark the doorbell wanted; watchers poll", error=f"{type(exc).__name__}: {exc}")
            await self._drop()
            return
        if not already:  # the owners learn it at their next round: poll until then
            self._warm_until = now + self.warm_s
        self._marked_at = now

    def poll_s(self) -> float:
        """How long a watcher may wait for a ring before it reads anyway."""
        return WARM_POLL_S if time.monotonic() < self._warm_until else POLL_S

    def forget(self, wake: asyncio.Event) -> None:
        for shard in [s for s, waiting in self._waiters.items() if wake in waiting]:
            self._waiters[shard].discard(wake)
            if not self._waiters[shard]:
                del self._waiters[shard]

    async def close(self) -> None:
        self._closed = True
        if self._sender is not None:
            self._sender.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._sender
        async with self._lock:
            conn, self._conn = self._conn, None
            if conn is not None:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(conn.close(), 5)
