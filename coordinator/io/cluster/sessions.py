"""Cluster mode: client sessions on a coordinator's main port see every shard (docs/CLUSTER.md §Cross-shard views).

A client session that reaches a coordinator's main port without naming a pool (``/v1/client``,
no ``?pool=`` or ``?shard=``: the CLI, the dashboard, an SDK ``Client`` given the coordinators'
list) is a **view session**. It is served on the main port, from PostgreSQL's committed rows,
for plans and workers of every shard whoever owns them:

* ``get_plan``, ``list_plans`` (a client token: its own plans; an admin token: all; ``queue``
  is empty: the queue order lives in each shard's core; ``op``, ``owner`` and ``id_contains``
  are filters of the SQL read, their ``total`` a count of its own), ``list_workers`` (each served shard's
  registry as its owner last wrote it, once per ``--lease-renew``);
* ``subscribe`` to plan ids: the events are read from the rows. The session waits on the
  **doorbell**: every shard's core rings it at most once per group commit (coalesced, never
  per event), a PostgreSQL ``NOTIFY`` on :data:`CHANNEL` whose payload is ``"<shard>:<max
  seq>"`` (the highest event seq of the commit). A watcher re-reads its plans of that shard
  and sends the events after the last one it sent (a ``resync`` for a seq the rows never held,
  as a core's replay does). The doorbell is only a wake-up: a watcher also reads again every
  :data:`POLL_S` in case one was lost (a dropped connection). ``subscribe`` with ``all`` (the
  dashboard) follows, from then on, every plan created after it (of the principal; an admin:
  everyone's) on any shard: on each doorbell it reads each shard's plans above the highest key it
  read of that shard (keys only grow within a shard in commit order), at most
  :data:`_ALL_PER_RING` per shard per read (more: it reads again at once), and follows them
  as watched plans (their events from seq 1) until they end, at most :data:`_MAX_ALL` at a time
  (past it, new plans are counted in ``skipped_all`` and not followed). Plans open at the
  ``subscribe`` are not followed (the dashboard's listing shows them);
* ``cancel`` (by the plan's shard, read from the rows) and ``drain_worker``,
  ``undrain_worker``, ``remove_worker`` (by the shard whose registry holds the worker) are
  **forwarded** to that shard's owner: the main port sends the request on a session of its own
  to the owner's core, opened with the caller's own token (so the owner checks it exactly as if
  the caller had come itself), and passes the reply back. Forwarded rather than ``moved``: a
  view session serves every shard, and ``moved`` would pin it to one shard's core, so
  ``fleetwire cancel A B`` (or ``--all``) over plans of two shards, or the dashboard, would then
  find the second plan missing. One forwarding session per owner URL is kept for the session's
  life. When the owner cannot be reached (it is failing over), the caller is ``moved`` there
  instead and the SDK re-sends the request once the shard is served again;
* ``submit`` (by its pool, or its partition), ``data_ticket`` and the relay (by the plan's
  shard) are answered ``moved`` to the owner and the session is closed ``4307``; the SDK re-sends
  the request there. A **browser's** ``submit`` (a session whose handshake sent ``Origin``: the
  dashboard) is forwarded instead, like ``cancel``, and its events followed from the rows when it
  subscribes: a page cannot follow a ``moved`` (its socket may reach only what the page's CSP and
  the owner's origin check allow, and closing it would drop the page's subscriptions), and it
  submits one plan at a time. A submit is moved rather than forwarded so that a client's plans keep the
  owner's fast path (a pipelined ``submit_many``, live events straight from its core): a
  forwarded submit would go one at a time and its events one doorbell late, measured at 100
  plans/s instead of thousands (``bench/cluster_throughput.py``, a client with no pool). Anything
  else is moved to the owner of shard 0 (the default pool).

**Plan ids** are scoped per principal, as in a core (docs/SEMANTICS.md §Client session): a client's look-ups
by id find only its own plans, by the id it submitted (views.py ``plan_shard``, ``plans_by_id``), and
name them by it in every frame (:func:`catch_up`); another principal's plan of that id answers as an unused id
(:meth:`_Session.not_found`). An admin's find plans by key and see each one's owner and name.

**Limits** (coordinator/limits.py): a view session is charged as a core's client session is. Its
connection has the client message rate (``client_rate``/``client_burst``: throttled, then closed
4429 after ``flood_grace_s``), and its principal a work-unit bucket (``cost_rate``/``cost_burst``,
shared by the principal's view sessions on this main port; a core's buckets are its own): one
unit per message plus the rows a request scanned and built, as the core counts them, and the
events a watcher sent. Over it, the session's frames stop being read until the bucket refills.
The counts per state of a ``list_plans`` scan every plan row of the principal, so they are cached
per principal for :data:`COUNTS_TTL_S` (charged only when that scan ran): a flood of listings
costs one count per second or two, not one per request.

The reads use their own small asyncpg pool on the driver's loop (never the lease connection,
so a large listing never delays a renewal) and a doorbell connection that ``LISTEN`` s only
while a watcher waits.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from typing import Any, Final

import msgspec
import structlog
from websockets.asyncio.client import ClientConnection, connect
from websockets.asyncio.server import ServerConnection
from websockets.exceptions import ConnectionClosed, InvalidHandshake
from websockets.typing import Subprotocol

from coordinator.auth import Principal
from coordinator.io.cluster.views import (
    Watched,
    count_matching,
    count_plans,
    list_plans,
    mark_wanted,
    new_plans,
    plan_shard,
    plans_by_id,
    read_watched,
    read_workers,
    shard_tips,
    want_workers,
    workers_summary,
)
from coordinator.io.stores.postgres import SERVER_SETTINGS
from coordinator.limits import CostBuckets, Limits, TokenBucket
from coordinator.operator_requests import MAX_FILTER_CHARS, PAGE_BYTES, page_start
from coordinator.plans import Plan
from protocol import SUBPROTOCOL_MSGPACK, Codec
from protocol import errors as codes
from protocol.codec import DecodeFailure
from protocol.messages import (
    TERMINAL_STATES,
    Accepted,
    Cancel,
    DataChunk,
    DataCredit,
    DataEnd,
    DataOpen,
    DataTicket,
    DrainWorker,
    Error,
    GetPlan,
    ListPlans,
    ListWorkers,
    Moved,
    Ok,
    PlanInfo,
    PlanReply,
    Plans,
    RemoveWorker,
    Resync,
    Submit,
    Subscribe,
    Subscribed,
    ToClient,
    UndrainWorker,
    Unsubscribe,
    WorkerInfo,
    Workers,
)

__all__ = ["CHANNEL", "COUNTS_TTL_S", "POLL_S", "WANTED_S", "WARM_POLL_S", "Doorbell",
           "ViewSessions", "bell_payload", "catch_up", "open_connection", "parse_bell"]

log = structlog.get_logger(__name__)

CHANNEL: Final = "fleetwire_commits"
POLL_S: Final = 5.0  # a watcher reads again this often even without a doorbell (one lost with its connection)
WARM_POLL_S: Final = 0.1  # ... and this often while the owners may not ring yet (Doorbell.poll_s)
WANTED_S: Final = 30.0  # a doorbell marked wanted stays wanted this long (renewed while watchers wait)
_MAX_WATCHED: Final = 1000  # plans one view session may follow by id
_MAX_ALL: Final = 1000  # plans one view session's subscribe to all follows at once
_ALL_PER_RING: Final = 200  # new plans of one shard read per doorbell (more: read again at once)
FORWARD_TIMEOUT_S: Final = 10.0  # a forwarded request's connect, and its reply, each within this
COUNTS_TTL_S: Final = 2.0  # a list_plans' counts per state are reused this long (per principal)
_MAX_PAUSE_S: Final = 5.0  # the longest one throttle pause (as a core's reader)


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


class _Moved(Exception):
    def __init__(self, shard: int) -> None:
        self.shard = shard


class ViewSessions:
    """Serves view sessions (module docstring) on a coordinator's main port.

    Args:
        dsn: the cluster's database.
        shards: the cluster's shard count (a subscribe to all plans reads each shard).
        where: shard -> ``moved`` to its owner (``url`` "" while nobody serves it).
        submit_shard: the shard a ``submit`` belongs to (its pool, or its partition).
        doorbell: the coordinator's doorbell.
        version: told in ``workers``.
        renew_s: ``--lease-renew``: how often owners write their registries while they are wanted.
        limits: the coordinator's limits (the client message rate and the work-unit cost per principal).
    """

    def __init__(self, dsn: str, *, where: Callable[[int], Moved], submit_shard: Callable[[Submit], int],
                 doorbell: Doorbell, version: str = "", renew_s: float = 1.0,
                 limits: Limits | None = None, shards: int = 1) -> None:  # fmt: skip
        self._dsn = dsn
        self.shards = shards
        self.skipped_all = 0  # new plans a subscribe to all did not follow (over _MAX_ALL at once)
        self.limits = limits or Limits()
        self.cost_throttles = 0  # frames after which a principal over its work-unit rate was throttled
        self.rate_closes = 0  # view sessions closed 4429 (message rate)
        self._costs = CostBuckets(self.limits)
        self._counts: dict[str | None, tuple[float, dict[str, int]]] = {}  # owner -> (read at, counts per state)
        self.renew_s = renew_s
        self.where = where
        self.submit_shard = submit_shard
        self.doorbell = doorbell
        self.version = version
        self._pool: Any = None
        self._pool_lock = asyncio.Lock()
        self._open: set[_Session] = set()
        self._closing: set[asyncio.Future[None]] = set()

    def cost_bucket(self, principal: str) -> TokenBucket | None:
        """The principal's work-unit bucket, shared by its view sessions; None when the cost limit is off."""
        return self._costs.get(principal, time.monotonic())

    async def counts(self, conn: Any, owner: str | None) -> tuple[dict[str, int], int]:
        """``(plans per state of owner, rows scanned)``: cached :data:`COUNTS_TTL_S` (0 rows scanned when cached)."""
        now = time.monotonic()
        cached = self._counts.get(owner)
        if cached is not None and now - cached[0] < COUNTS_TTL_S:
            return cached[1], 0
        counts = await count_plans(conn, owner)
        if len(self._counts) > 10_000:
            self._counts.clear()
        self._counts[owner] = (now, counts)
        return counts, sum(counts.values())

    @property
    def sessions(self) -> int:
        """View sessions open now."""
        return len(self._open)

    def revoke(self, still_valid: Callable[[Principal], bool]) -> int:
        """SIGHUP: close (4401) every view session whose principal ``still_valid`` refuses now; how many."""
        gone = [s for s in self._open if not still_valid(s.principal)]
        for session in gone:
            self._closing.add(task := asyncio.ensure_future(session.ws.close(codes.CLOSE_REVOKED, "token revoked")))
            task.add_done_callback(self._closing.discard)
        return len(gone)

    @contextlib.asynccontextmanager
    async def conn(self) -> AsyncIterator[Any]:
        """A connection of the view reads' asyncpg pool (opened on first use)."""
        async with self._pool_lock:
            if self._pool is None:
                import asyncpg  # type: ignore[import-untyped]

                # Planned for their parameters, as the lease connection (stores/postgres.py SERVER_SETTINGS):
                # a generic plan made while the plans table was small would scan it whole later.
                self._pool = await asyncpg.create_pool(self._dsn, min_size=0, max_size=2, timeout=10,
                                                       command_timeout=30, server_settings=SERVER_SETTINGS)  # fmt: skip
        async with self._pool.acquire() as conn:
            yield conn

    async def close(self) -> None:
        pool, self._pool = self._pool, None
        if pool is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(pool.close(), 5)

    async def serve(self, ws: ServerConnection, principal: Principal, codec: Codec, token: str | None) -> None:
        """One view session until it closes, or until a request only an owner can answer moves it.

        ``token``: the caller's bearer token, for the requests forwarded to an owner (None: ``--insecure``).
        """
        session = _Session(self, ws, principal, codec, token)
        self._open.add(session)
        try:
            await session.run()
        finally:
            self._open.discard(session)
            await session.stop()


class _Session:
    def __init__(self, views: ViewSessions, ws: ServerConnection, principal: Principal, codec: Codec,
                 token: str | None) -> None:  # fmt: skip
        self.views = views
        self.token = token
        self.forwards: dict[str, ClientConnection] = {}  # owner core URL -> this session's session there
        self.owner_codec = Codec("msgpack", ToClient, role="coordinator")
        self.ws = ws
        self.principal = principal
        self.owner = None if principal.admin else principal.name
        self.codec = codec
        self.watched: dict[int, Watched] = {}  # plan key -> what was sent of it
        self.tips: dict[int, int] | None = None  # subscribed to all: shard -> highest plan key read
        self.from_all: set[int] = set()  # keys of the watched plans the subscribe to all added
        self.wake = asyncio.Event()
        self.follower: asyncio.Task[None] | None = None
        self.send_lock = asyncio.Lock()
        self.cost = views.cost_bucket(principal.name)
        # A browser (it sends Origin): the dashboard, whose submits are forwarded (module docstring).
        self.browser = ws.request is not None and ws.request.headers.get("Origin") is not None
        self.work = 0  # work units beyond one per message (coordinator/limits.py), as the core's Outbox.work

    def charge(self, units: int) -> None:
        """Count work beyond a request's one message: rows scanned and built, events sent."""
        self.work += units

    async def send(self, msgs: list[Any]) -> None:
        if msgs:
            async with self.send_lock:
                await self.ws.send(self.codec.encode(msgs), text=self.codec.text)

    async def run(self) -> None:
        views = self.views
        bucket = views.limits.bucket("client", time.monotonic())
        try:
            async for frame in self.ws:
                msgs = self.codec.decode(frame)
                pause = 0.0 if bucket is None else bucket.take(len(msgs), time.monotonic())
                if pause is None:  # over the message rate for longer than the grace: as a core's session
                    views.rate_closes += 1
                    log.warning("view session closed: message rate limit exceeded", principal=self.principal.name)
                    await self.ws.close(codes.CLOSE_RATE_LIMITED, "message rate limit exceeded")
                    return
                for msg in msgs:
                    try:
                        await self.answer(msg)
                    except (_Moved, ConnectionClosed):
                        raise
                    except Exception as exc:  # the database is away, or a bug: this request fails, not the session
                        log.warning("view session request failed", request=type(msg).__name__,
                                    error=f"{type(exc).__name__}: {exc}")  # fmt: skip
                        problem = f"the cluster's database could not answer {type(msg).__name__}: {exc}"
                        await self.send([Error(code=codes.INTERNAL, message=problem, req_id=getattr(msg, "req_id", 0))])
                spent, self.work = self.work, 0
                if self.cost is not None:  # the principal's work units: one per message plus what the requests scanned
                    owed = self.cost.take(len(msgs) + spent, time.monotonic())
                    if owed:
                        views.cost_throttles += 1
                        pause = max(pause, min(owed, _MAX_PAUSE_S))
                if pause:
                    await asyncio.sleep(pause)  # throttle: stop reading until the buckets refill
        except _Moved as moved:
            target = self.views.where(moved.shard)
            if not target.url:
                await self.ws.close(1013, f"shard {moved.shard} has no owner yet; try again")
                return
            await self.send([target])
            await self.ws.close(codes.CLOSE_MOVED, f"shard {moved.shard} is served at {target.url}")
        except ConnectionClosed:
            pass

    async def stop(self) -> None:
        self.views.doorbell.forget(self.wake)
        for conn in self.forwards.values():
            with contextlib.suppress(Exception):
                await asyncio.wait_for(conn.close(), 2)
        if self.follower is not None:
            self.follower.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self.follower

    def visible(self, owner: str) -> bool:
        return self.owner is None or owner == self.owner

    def not_found(self, plan_id: str, req_id: int) -> Error:
        """The answer for an id this session knows no plan by: another principal's plan of that id answers alike
        (plan ids are scoped per principal, docs/SEMANTICS.md §Plan ids: the look-ups never find it)."""
        message = f"no plan with id {plan_id!r} in any shard of this cluster"
        return Error(code=codes.PLAN_NOT_FOUND, message=message, req_id=req_id, plan_id=plan_id)

    async def answer(self, msg: Any) -> None:
        match msg:
            case GetPlan():
                await self.get_plan(msg)
            case ListPlans():
                await self.list_plans(msg)
            case ListWorkers():
                shards = await self.registries()
                rows = [w for shard in sorted(shards) for w in shards[shard]]
                self.charge(len(shards) + len(rows))  # registries read, rows sent
                await self.send([Workers(req_id=msg.req_id, workers=rows, summary=workers_summary(rows),
                                         version=self.views.version)])  # fmt: skip
            case Subscribe():
                await self.subscribe(msg)
            case Unsubscribe():
                if msg.all:
                    self.watched.clear()
                    self.tips = None
                    self.from_all.clear()
                gone = set(msg.plan_ids)
                for key in [k for k, w in self.watched.items() if w.plan_id in gone]:
                    del self.watched[key]
                    self.from_all.discard(key)
                await self.send([Ok(req_id=msg.req_id)])
            case Submit() if self.browser:  # a page cannot follow a moved (module docstring): forwarded
                await self.forward_submit(msg)
            case Submit():  # the owner's fast path: its live stream comes straight from its core
                raise _Moved(self.views.submit_shard(msg))
            case Cancel():
                shard = await self.plan_shard(msg.plan_id, msg.req_id)
                if shard is not None:
                    await self.send([await self.forward(shard, msg)])
            case DataTicket() | DataOpen() | DataChunk() | DataCredit() | DataEnd():
                shard = await self.plan_shard(msg.plan_id, getattr(msg, "req_id", 0))
                if shard is not None:
                    raise _Moved(shard)
            case DrainWorker() | UndrainWorker() | RemoveWorker():
                shard = await self.worker_shard(msg.worker_id, msg.req_id)
                if shard is not None:
                    await self.send([await self.forward(shard, msg)])
            case DecodeFailure():
                await self.send([Error(code=msg.code, message=msg.message, req_id=msg.req_id)])
            case _:
                raise _Moved(0)

    async def get_plan(self, msg: GetPlan) -> None:
        async with self.views.conn() as conn:
            found = await plans_by_id(conn, msg.plan_id, self.owner)  # a client's: its own, by the id it gave
        mine = [p for p in found if self.visible(p.owner)]
        if not mine:
            await self.send([self.not_found(msg.plan_id, msg.req_id)])
            return
        await self.send([PlanReply(req_id=msg.req_id, plan=mine[-1].info(self.owner is None))])

    async def list_plans(self, msg: ListPlans) -> None:
        before, problem = page_start(msg)  # the same checks as a core's listing
        if problem is not None:
            await self.send([Error(code=codes.INVALID_ARGUMENT, message=problem, req_id=msg.req_id)])
            return
        if msg.owner and self.owner is not None and msg.owner != self.owner:
            problem = (f"owner {msg.owner[:MAX_FILTER_CHARS]!r}: a client token lists only its own plans "
                       f"({self.owner!r}); another principal's need an admin token")
            await self.send([Error(code=codes.FORBIDDEN, message=problem, req_id=msg.req_id)])
            return
        states: list[str] = list(msg.states)
        owner = self.owner if self.owner is not None else msg.owner or None
        narrowed = {"op": msg.op, "id_contains": msg.id_contains}
        admin = self.owner is None  # a client's id_contains matches the ids it submitted, never a key
        async with self.views.conn() as conn:
            plans, _, _ = await list_plans(conn, states, msg.limit + 1, owner=owner, before=before, counted=False,
                                           admin=admin, **narrowed)  # fmt: skip
            counts, scanned = await self.views.counts(conn, self.owner)
            if owner != self.owner or msg.op or msg.id_contains:  # the cached counts cannot say: counted apart
                total = await count_matching(conn, states, owner=owner, admin=admin, **narrowed)
                scanned += total
            else:
                total = sum(n for state, n in counts.items() if not states or state in states)
        listed: list[PlanInfo] = []
        size = last = 0
        cursor = ""
        for key, plan in plans:
            row = plan.summary_bytes()
            if len(listed) >= msg.limit or (listed and size + row > PAGE_BYTES):  # a page stays under frame limits
                cursor = str(last)
                break
            last = key
            if msg.op and plan.op != msg.op:  # its args held the op's marker (cluster_views.op_marker)
                continue
            listed.append(plan.summary(self.owner is None))
            size += row
        else:
            if len(plans) > msg.limit:  # every row read, one of them not of the op: more may follow
                cursor = str(last)
        self.charge(scanned + len(plans) + 4 * len(listed))  # rows scanned and rows built, as the core's listing
        await self.send([Plans(req_id=msg.req_id, plans=listed, counts=counts, total=total, next_cursor=cursor)])

    async def forward_submit(self, msg: Submit) -> None:
        """A browser's ``submit``: forwarded to its shard's owner; its events followed here when it subscribes."""
        reply = await self.forward(self.views.submit_shard(msg), msgspec.structs.replace(msg, subscribe=False))
        await self.send([reply])
        if not msg.subscribe or type(reply) is not Accepted:
            return
        async with self.views.conn() as conn:
            found = await plan_shard(conn, reply.plan_id, self.owner)  # committed before accepted was sent
        if found is not None and len(self.watched) - len(self.from_all) < _MAX_WATCHED:
            await self.watch([Watched(found[2], reply.plan_id, found[0], 1)])

    async def plan_shard(self, plan_id: str, req_id: int) -> int | None:
        """The shard of a plan this session may see; None after answering ``plan_not_found``."""
        async with self.views.conn() as conn:
            found = await plan_shard(conn, plan_id, self.owner)
        if found is None or not self.visible(found[1]):
            await self.send([self.not_found(plan_id, req_id)])
            return None
        return found[0]

    async def worker_shard(self, worker_id: str, req_id: int) -> int | None:
        """The shard whose registry holds a worker; None after answering ``unknown_worker``."""
        shards = await self.registries()
        for shard, rows in shards.items():
            if any(w.id == worker_id for w in rows):
                return shard
        message = f"no worker {worker_id!r} in any served shard of this cluster (see `fleetwire workers`)"
        await self.send([Error(code=codes.UNKNOWN_WORKER, message=message, req_id=req_id)])
        return None

    async def registries(self) -> dict[int, list[WorkerInfo]]:
        """Every served shard's registry. Owners write them only while wanted: the first look after
        a quiet spell marks them wanted and waits (up to a few lease renewals) for fresh rows."""
        async with self.views.conn() as conn:
            already, marked = await want_workers(conn)
            shards, fresh = await read_workers(conn, None if already else marked)
            deadline = asyncio.get_running_loop().time() + 3 * self.views.renew_s
            while not fresh and asyncio.get_running_loop().time() < deadline:
                await asyncio.sleep(self.views.renew_s / 4)
                shards, fresh = await read_workers(conn, marked)
        return shards

    async def forward(self, shard: int, msg: Any) -> Any:
        """Send ``msg`` to ``shard``'s owner on a session opened with the caller's token; its reply.

        Raises:
            _Moved: the owner cannot be reached now: the caller goes there itself and re-sends.
        """
        target = self.views.where(shard)
        if not target.url:
            raise _Moved(shard)
        codec = self.owner_codec
        try:
            conn = self.forwards.get(target.url)
            if conn is None:
                headers = {"Authorization": f"Bearer {self.token}"} if self.token else {}
                conn = await connect(target.url.rstrip("/") + "/v1/client", additional_headers=headers,
                                     subprotocols=[Subprotocol(SUBPROTOCOL_MSGPACK)], compression=None,
                                     open_timeout=FORWARD_TIMEOUT_S)  # fmt: skip
                self.forwards[target.url] = conn
            await conn.send(codec.encode([msg]))
            async with asyncio.timeout(FORWARD_TIMEOUT_S):
                while True:
                    for reply in codec.decode(await conn.recv()):
                        if type(reply) is Moved:  # the shard moved on since the last scan
                            raise _Moved(shard)
                        if getattr(reply, "req_id", None) == msg.req_id:
                            return reply
        except (OSError, TimeoutError, ConnectionClosed, InvalidHandshake) as exc:
            log.info("forwarding to a shard's owner failed; moving the session there", shard=shard,
                     url=target.url, error=f"{type(exc).__name__}: {exc}")  # fmt: skip
            stale = self.forwards.pop(target.url, None)
            if stale is not None:
                with contextlib.suppress(Exception):
                    await stale.close()
            raise _Moved(shard) from None

    async def subscribe(self, msg: Subscribe) -> None:
        fresh: list[Watched] = []
        if msg.plan_ids:
            self.charge(len(msg.plan_ids))  # one look-up by id each
            async with self.views.conn() as conn:
                found = [await plan_shard(conn, plan_id, self.owner) for plan_id in msg.plan_ids]
            for plan_id, one in zip(msg.plan_ids, found, strict=True):
                if one is None or not self.visible(one[1]):
                    await self.send([self.not_found(plan_id, msg.req_id)])
                    return  # one unknown id and nothing is subscribed
                fresh.append(Watched(one[2], plan_id, one[0], max(0, msg.from_seq) + 1))
        if len(self.watched) - len(self.from_all) + len(fresh) > _MAX_WATCHED:
            problem = f"a view session follows at most {_MAX_WATCHED} plans; subscribe on the shard's owner (?pool=)"
            await self.send([Error(code=codes.INVALID_ARGUMENT, message=problem, req_id=msg.req_id)])
            return
        if msg.all and self.tips is None:  # every plan created from now on (module docstring)
            async with self.views.conn() as conn:
                self.tips = await shard_tips(conn, self.views.shards)
            self.charge(self.views.shards)
        await self.send([Subscribed(req_id=msg.req_id, plan_ids=[w.plan_id for w in fresh])])
        await self.watch(fresh)

    async def watch(self, fresh: list[Watched]) -> None:
        """Follow these plans from their rows, and every new one when subscribed to all (the follower sends)."""
        for w in fresh:
            self.watched.setdefault(w.key, w)
        if fresh or self.tips is not None:
            shards = {w.shard for w in self.watched.values()}
            if self.tips is not None:
                shards = set(range(self.views.shards))
            await self.views.doorbell.wait_on(self.wake, shards)
            self.wake.set()
            if self.follower is None:
                self.follower = asyncio.create_task(self.follow())

    async def discover(self, conn: Any, tips: dict[int, int]) -> bool:
        """Subscribed to all: watch the plans committed since the last read; whether a shard has more to read."""
        rows = await new_plans(conn, tips, _ALL_PER_RING)
        per_shard: dict[int, int] = {}
        for key, plan_id, shard, owner, name in rows:
            tips[shard] = max(tips[shard], key)
            per_shard[shard] = per_shard.get(shard, 0) + 1
            if not self.visible(owner) or key in self.watched:
                continue
            if len(self.from_all) >= _MAX_ALL:
                self.views.skipped_all += 1
                continue
            # a client knows its plan by the id it submitted (name, when that is not the key), an admin by key
            self.watched[key] = Watched(key, plan_id if self.owner is None else name or plan_id, shard, 1)
            self.from_all.add(key)
        if rows and self.cost is not None:  # rows read: charged now, paid by the session's next frames
            self.cost.take(len(rows), time.monotonic())
        return any(n >= _ALL_PER_RING for n in per_shard.values())

    async def follow(self) -> None:
        """Send the watched plans' new events, after every doorbell of their shards (or every POLL_S)."""
        views = self.views
        while self.watched or self.tips is not None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.wake.wait(), views.doorbell.poll_s())
            self.wake.clear()
            await views.doorbell.keep_wanted()
            try:
                async with views.conn() as conn:
                    tips = self.tips
                    if tips is not None and await self.discover(conn, tips):
                        self.wake.set()  # a shard had more new plans than one read takes: read again at once
                    stored = await read_watched(conn, list(self.watched.values())) if self.watched else {}
            except Exception as exc:  # the database is away: try again at the next doorbell or poll
                log.warning("view session cannot read the watched plans", error=f"{type(exc).__name__}: {exc}")
                continue
            sent = 0
            for key, w in list(self.watched.items()):
                plan = stored.get(key)
                if plan is None:
                    if key in self.from_all:  # forgotten at retention, or damaged: not followed any longer
                        self.from_all.discard(key)
                        del self.watched[key]
                    continue
                for msg in catch_up(plan, w):  # a frame each: one result may be most of a frame
                    await self.send([msg])
                    sent += 1
                if plan.state in TERMINAL_STATES and w.expected >= plan.next_seq:
                    del self.watched[key]
                    self.from_all.discard(key)
            if sent and self.cost is not None:  # the events sent: charged now, paid by the session's next frames
                self.cost.take(sent, time.monotonic())
        views.doorbell.forget(self.wake)
        self.follower = None


def catch_up(plan: Plan, w: Watched) -> list[Any]:
    """The events of ``plan`` from ``w.expected`` on, a ``resync`` for each run the rows never held, naming the
    plan as the session knows it (``w.plan_id``: its owner's name for it where that is not its key)."""
    out: list[Any] = []
    shown = w.plan_id
    by_key = shown == plan.id  # an admin's view, or a plan whose name is its key (the same view)
    for event in plan.events:
        if event.seq < w.expected:
            continue
        if event.seq > w.expected:
            out.append(Resync(plan_id=shown, first_seq=w.expected, last_seq=event.seq - 1, plan=plan.info(by_key)))
        out.append(event if by_key else msgspec.structs.replace(event, plan_id=shown))
        w.expected = event.seq + 1
    if plan.state in TERMINAL_STATES and w.expected < plan.next_seq:
        out.append(Resync(plan_id=shown, first_seq=w.expected, last_seq=plan.next_seq - 1, plan=plan.info(by_key)))
        w.expected = plan.next_seq
    # The inline events are re-read whole with the row; events rows from the last one's first seq.
    w.since = max((e.seq for e in plan.events), default=w.since)
    return out
