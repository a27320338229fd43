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
  per event), a PostgreSQL ``NOTIFY`` (coordinator/io/cluster/doorbell.py) whose payload is
  ``"<shard>:<max seq>"`` (the highest event seq of the commit). A watcher re-reads its plans of that shard
  and sends the events after the last one it sent (a ``resync`` for a seq the rows never held,
  as a core's replay does). The doorbell is only a wake-up: a watcher also reads again every
  ``POLL_S`` in case one was lost (a dropped connection). ``subscribe`` with ``all`` (the
  dashboard) follows, from then on, every plan created after it (of the principal; an admin:
  everyone's) on any shard: on each doorbell it reads each shard's plans above the highest key it
  read of that shard (keys only grow within a shard in commit order), at most
  ``ALL_PER_RING`` per shard per read (more: it reads again at once), and follows them
  as watched plans (their events from seq 1) until they end, at most ``MAX_ALL`` at a time
  (past it, new plans are counted in ``skipped_all`` and not followed). Plans open at the
  ``subscribe`` are not followed (the dashboard's listing shows them);
* ``cancel`` and ``release_plan`` (by the plan's shard, read from the rows) and ``drain_worker``,
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
name them by it in every frame (coordinator/views.py ``catch_up``); another principal's plan of that id answers
as an unused id (``ViewSession.not_found``). An admin's find plans by key and see each one's owner and name.

**Decisions and driver.** What a view session answers is decided by coordinator/views.py's
``ViewSession``, sans-I/O (rows in, messages out; unit-tested without PostgreSQL). This module is
its asyncio driver: :class:`ViewDriver` (a ``SessionHandler`` of coordinator/io/frontdoor/reader.py,
made by :meth:`ViewSessions.handler` for the main port's router, coordinator/io/cluster/mainport.py)
reads the rows each request needs, forwards or moves what only an owner can do, and runs the
follower that sends the watched plans' events.

**Limits** (coordinator/limits.py): a view session is read by the main port's front door as a core's
client session is by its port's (coordinator/io/frontdoor/reader.py, coordinator/read_policy.py).
Its connection has the client message rate (``client_rate``/``client_burst``: throttled, then
closed 4429 after ``flood_grace_s``, which puts its peer in the penalty box), and its principal a
work-unit bucket (``cost_rate``/``cost_burst``, shared by the principal's view sessions on this
main port; a core's buckets are its own): one unit per message and per KiB of the frame, plus the
rows a request scanned and built, as the core counts them, and the events a watcher sent. Over it,
the session's frames stop being read until the bucket refills.
The counts per state of a ``list_plans`` scan every plan row of the principal, so they are cached
per principal for :data:`COUNTS_TTL_S` (charged only when that scan ran): a flood of listings
costs one count per second or two, not one per request.

The reads use their own small asyncpg pool on the driver's loop (never the lease connection,
so a large listing never delays a renewal) and a doorbell connection that ``LISTEN`` s only
while a watcher waits. The pool has two connections, held for a read only, never across a wait
(``list_workers``' wait for fresh registry rows): one session's wait never takes the others' reads.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any, Final

import msgspec
import structlog
from websockets.asyncio.client import ClientConnection, connect
from websockets.asyncio.server import ServerConnection
from websockets.exceptions import ConnectionClosed, InvalidHandshake
from websockets.typing import Subprotocol

from coordinator.auth import Principal
from coordinator.io.cluster.doorbell import Doorbell
from coordinator.io.cluster.views import (
    count_matching,
    count_plans,
    list_plans,
    new_plans,
    plan_shard,
    plans_by_id,
    read_watched,
    read_workers,
    shard_tips,
    want_workers,
)
from coordinator.io.stores.pg_usage import cluster_totals
from coordinator.io.stores.postgres import SERVER_SETTINGS
from coordinator.limits import Limits, TokenBucket
from coordinator.read_policy import ReadPolicy
from coordinator.views import ALL_PER_RING, Found, ViewSession, Watched
from protocol import SUBPROTOCOL_MSGPACK, Codec
from protocol import errors as codes
from protocol.codec import DecodeFailure
from protocol.messages import (
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
    GetUsage,
    ListPlans,
    ListWorkers,
    Moved,
    ReleasePlan,
    RemoveWorker,
    Submit,
    Subscribe,
    Subscribed,
    ToClient,
    UndrainWorker,
    Unsubscribe,
    Usage,
    UsageTotals,
    WorkerInfo,
)

__all__ = ["COUNTS_TTL_S", "ViewDriver", "ViewSessions"]

log = structlog.get_logger(__name__)

FORWARD_TIMEOUT_S: Final = 10.0  # a forwarded request's connect, and its reply, each within this
COUNTS_TTL_S: Final = 2.0  # a list_plans' counts per state are reused this long (per principal)


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
        read_policy: the main port's read limits (coordinator/read_policy.py): its front door reads view
            sessions within them, and the principals' work-unit buckets are its.
    """

    def __init__(self, dsn: str, *, where: Callable[[int], Moved], submit_shard: Callable[[Submit], int],
                 doorbell: Doorbell, version: str = "", renew_s: float = 1.0,
                 read_policy: ReadPolicy | None = None, shards: int = 1) -> None:  # fmt: skip
        self._dsn = dsn
        self.shards = shards
        self.skipped_all = 0  # new plans a subscribe to all did not follow (over MAX_ALL at once)
        self.read_policy = read_policy or ReadPolicy(Limits())
        self.rate_closes = 0  # view sessions closed 4429 (message rate)
        self._counts: dict[str | None, tuple[float, dict[str, int]]] = {}  # owner -> (read at, counts per state)
        self.renew_s = renew_s
        self.where = where
        self.submit_shard = submit_shard
        self.doorbell = doorbell
        self.version = version
        self._pool: Any = None
        self._pool_lock = asyncio.Lock()
        self._open: set[ViewDriver] = set()
        self._closing: set[asyncio.Future[None]] = set()

    def cost_bucket(self, principal: str) -> TokenBucket | None:
        """The principal's work-unit bucket, shared by its view sessions; None when the cost limit is off."""
        return self.read_policy.costs.get(principal, time.monotonic())

    @property
    def cost_throttles(self) -> int:
        """Frames after which a principal over its work-unit rate was throttled (the main port's read policy)."""
        return self.read_policy.cost_throttles

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
        gone = [s for s in self._open if not still_valid(s.view.principal)]
        for session in gone:
            self._spawn(session.ws.close(codes.CLOSE_REVOKED, "token revoked"))
        return len(gone)

    def _spawn(self, work: Coroutine[Any, Any, Any]) -> None:
        self._closing.add(task := asyncio.ensure_future(work))
        task.add_done_callback(self._closing.discard)

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

    def handler(self, ws: ServerConnection, principal: Principal, codec: Codec, token: str | None,
                cost: TokenBucket | None) -> ViewDriver:  # fmt: skip
        """The :class:`~coordinator.io.frontdoor.reader.SessionHandler` of one view session.

        ``token``: the caller's bearer token, for the requests forwarded to an owner (None:
        ``--insecure``); ``cost``: the principal's work-unit bucket the reader charges (the events
        and rows the follower sends between frames are charged to it as they go; None: no cost limit).
        """
        return ViewDriver(self, ws, principal, codec, token, cost)


class ViewDriver:
    """The asyncio side of one view session: reads the rows a :class:`~coordinator.views.ViewSession` decides on.

    A :class:`~coordinator.io.frontdoor.reader.SessionHandler`: :meth:`received` answers each
    message, reading the rows it needs (a connection of :meth:`ViewSessions.conn`), forwarding to a
    shard's owner what only it can do (:meth:`forward`), or moving the session there (a ``moved``,
    then 4307, and nothing more is read); the follower task sends the watched plans' events after
    every doorbell of their shards.
    """

    def __init__(self, views: ViewSessions, ws: ServerConnection, principal: Principal, codec: Codec,
                 token: str | None, cost: TokenBucket | None) -> None:  # fmt: skip
        self.views = views
        self.ws = ws
        self.codec = codec
        self.token = token
        self.cost = cost
        # A browser (it sends Origin): the dashboard, whose submits are forwarded (module docstring).
        browser = ws.request is not None and ws.request.headers.get("Origin") is not None
        self.view = ViewSession(principal, browser=browser)
        self.forwards: dict[str, ClientConnection] = {}  # owner core URL -> this session's session there
        self.owner_codec = Codec("msgpack", ToClient, role="coordinator")
        self.wake = asyncio.Event()
        self.follower: asyncio.Task[None] | None = None
        self.send_lock = asyncio.Lock()
        self.moved = False  # a moved was sent: what the peer still sends is dropped
        self._stopped = False

    def opened(self, now: float) -> None:
        self.views._open.add(self)

    async def received(self, msgs: list[Any], frame_bytes: int, now: float) -> int:
        """Answer a frame's messages in order; the work units they cost beyond one each."""
        view = self.view
        for msg in msgs:
            if self.moved:
                break
            try:
                await self.answer(msg)
            except _Moved as moved:
                await self.move(moved.shard)
            except ConnectionClosed:
                raise
            except Exception as exc:  # the database is away, or a bug: this request fails, not the session
                log.warning("view session request failed", request=type(msg).__name__,
                            error=f"{type(exc).__name__}: {exc}")  # fmt: skip
                problem = f"the cluster's database could not answer {type(msg).__name__}: {exc}"
                await self.send([Error(code=codes.INTERNAL, message=problem, req_id=getattr(msg, "req_id", 0))])
        return view.take_work()

    def closed(self, now: float, code: int | None) -> None:
        if code == codes.CLOSE_RATE_LIMITED:  # the front door closed it: over the message rate past the grace
            self.views.rate_closes += 1
        self.views._open.discard(self)
        self.views.doorbell.forget(self.wake)
        if not self._stopped:
            self.views._spawn(self.stop())

    async def stop(self) -> None:
        """Close the forwarding sessions and stop the follower (once)."""
        if self._stopped:
            return
        self._stopped = True
        self.views.doorbell.forget(self.wake)
        for conn in self.forwards.values():
            with contextlib.suppress(Exception):
                await asyncio.wait_for(conn.close(), 2)
        if self.follower is not None:
            self.follower.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self.follower

    async def send(self, msgs: list[Any]) -> None:
        if msgs:
            async with self.send_lock:
                await self.ws.send(self.codec.encode(msgs), text=self.codec.text)

    async def move(self, shard: int) -> None:
        """The request belongs to ``shard``'s owner: tell the peer where, then close 4307 (1013: no owner yet)."""
        self.moved = True
        target = self.views.where(shard)
        if not target.url:
            await self.ws.close(1013, f"shard {shard} has no owner yet; try again")
            return
        await self.send([target])
        await self.ws.close(codes.CLOSE_MOVED, f"shard {shard} is served at {target.url}")

    async def answer(self, msg: Any) -> None:
        view, views = self.view, self.views
        match msg:
            case GetPlan():
                async with views.conn() as conn:
                    found = await plans_by_id(conn, msg.plan_id, view.owner)  # a client's: its own, by the id it gave
                await self.send([view.plan_reply(msg, found)])
            case ListPlans():
                await self.list_plans(msg)
            case ListWorkers():
                await self.send([view.workers_reply(msg, await self.registries(), views.version)])
            case GetUsage():  # every shard's ledger rows, summed in the database (pg_usage.py)
                await self.send([await self.usage(msg)])
            case Subscribe():
                await self.subscribe(msg)
            case Unsubscribe():
                await self.send([view.unsubscribe(msg)])
            case Submit() if view.browser:  # a page cannot follow a moved (module docstring): forwarded
                await self.forward_submit(msg)
            case Submit():  # the owner's fast path: its live stream comes straight from its core
                raise _Moved(views.submit_shard(msg))
            case Cancel() | ReleasePlan():  # the plan's shard decides (a held plan is its core's)
                shard = await self.plan_shard(msg.plan_id, msg.req_id)
                if shard is not None:
                    await self.send([await self.forward(shard, msg)])
            case DataTicket() | DataOpen() | DataChunk() | DataCredit() | DataEnd():
                shard = await self.plan_shard(msg.plan_id, getattr(msg, "req_id", 0))
                if shard is not None:
                    raise _Moved(shard)
            case DrainWorker() | UndrainWorker() | RemoveWorker():
                holder = view.worker_shard(msg.worker_id, msg.req_id, await self.registries())
                if isinstance(holder, Error):
                    await self.send([holder])
                else:
                    await self.send([await self.forward(holder, msg)])
            case DecodeFailure():
                await self.send([Error(code=msg.code, message=msg.message, req_id=msg.req_id)])
            case _:
                raise _Moved(0)

    async def list_plans(self, msg: ListPlans) -> None:
        listing = self.view.listing(msg)
        if isinstance(listing, Error):
            await self.send([listing])
            return
        narrowed = {"op": listing.op, "id_contains": listing.id_contains}
        matching = 0
        async with self.views.conn() as conn:
            plans, _, _ = await list_plans(conn, listing.states, listing.limit, owner=listing.owner,
                                           before=listing.before, counted=False, admin=listing.admin,
                                           **narrowed)  # fmt: skip
            counts, scanned = await self.views.counts(conn, self.view.owner)
            if listing.counted_apart:
                matching = await count_matching(conn, listing.states, owner=listing.owner, admin=listing.admin,
                                                **narrowed)  # fmt: skip
        await self.send([self.view.plans_page(msg, listing, plans, counts, scanned, matching)])

    async def usage(self, msg: GetUsage) -> Usage:
        """``get_usage`` across the cluster: an admin's, every principal's; a client's, its own (as a core answers)."""
        owner = self.view.owner
        async with self.views.conn() as conn:
            totals, teams = await cluster_totals(conn, msg.by, since_s=msg.since if msg.since > 0 else None,
                                                 only=None if owner is None else (owner,))  # fmt: skip
        rows = [
            UsageTotals(
                name=name,
                team=teams.get(name, "") if msg.by == "principal" else "",
                succeeded=t.succeeded,
                failed=t.failed,
                cancelled=t.cancelled,
                slot_seconds=t.slot_s,
                gpu_seconds=t.gpu_s,
                tokens=t.tokens,
                joules=t.joules,
                co2e_g=t.co2e_g,
                preemptions=t.preemptions,
                avoided_co2e_g=t.avoided_co2e_g,
            )
            for name, t in sorted(totals.items())
        ]
        return Usage(req_id=msg.req_id, by=msg.by, since=msg.since, rows=rows)

    async def forward_submit(self, msg: Submit) -> None:
        """A browser's ``submit``: forwarded to its shard's owner; its events followed here when it subscribes."""
        reply = await self.forward(self.views.submit_shard(msg), msgspec.structs.replace(msg, subscribe=False))
        await self.send([reply])
        if not msg.subscribe or type(reply) is not Accepted:
            return
        async with self.views.conn() as conn:
            found = await plan_shard(conn, reply.plan_id, self.view.owner)  # committed before accepted was sent
        await self.watch(self.view.accepted(reply, found))

    async def plan_shard(self, plan_id: str, req_id: int) -> int | None:
        """The shard of a plan this session may see; None after answering ``plan_not_found``."""
        async with self.views.conn() as conn:
            found = await plan_shard(conn, plan_id, self.view.owner)
        shard = self.view.plan_shard(plan_id, req_id, found)
        if isinstance(shard, Error):
            await self.send([shard])
            return None
        return shard

    async def registries(self) -> dict[int, list[WorkerInfo]]:
        """Every served shard's registry. Owners write them only while wanted: the first look after
        a quiet spell marks them wanted and waits (up to a few lease renewals) for fresh rows.

        A connection of the reads' pool is held for each read only, never across the wait: the pool has two, and
        two sessions waiting on fresh rows would otherwise stall every view session's reads on this main port."""
        views = self.views
        async with views.conn() as conn:
            already, marked = await want_workers(conn)
            shards, fresh = await read_workers(conn, None if already else marked)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 3 * views.renew_s
        while not fresh and loop.time() < deadline:
            await asyncio.sleep(views.renew_s / 4)
            async with views.conn() as conn:
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
        view, views = self.view, self.views
        found: list[Found] = []
        if msg.plan_ids:
            async with views.conn() as conn:
                found = [await plan_shard(conn, plan_id, view.owner) for plan_id in msg.plan_ids]
        fresh = view.subscribe(msg, found)
        if isinstance(fresh, Error):
            await self.send([fresh])
            return
        if view.wants_tips(msg):  # every plan created from now on (module docstring)
            async with views.conn() as conn:
                view.follow_all(await shard_tips(conn, views.shards))
        await self.send([Subscribed(req_id=msg.req_id, plan_ids=[w.plan_id for w in fresh])])
        await self.watch(fresh)

    async def watch(self, fresh: list[Watched]) -> None:
        """Follow these plans from their rows, and every new one when subscribed to all (the follower sends)."""
        shards = self.view.watch(fresh, self.views.shards)
        if shards is None:
            return
        await self.views.doorbell.wait_on(self.wake, shards)
        self.wake.set()
        if self.follower is None:
            self.follower = asyncio.create_task(self.follow())

    async def follow(self) -> None:
        """Send the watched plans' new events, after every doorbell of their shards (or every POLL_S)."""
        views, view = self.views, self.view
        while view.following:
            with contextlib.suppress(TimeoutError):  # not asyncio.wait_for: on 3.11 it loses a cancel that comes
                async with asyncio.timeout(views.doorbell.poll_s()):  # as the wake-up is set (test_cluster_stop.py)
                    await self.wake.wait()
            self.wake.clear()
            await views.doorbell.keep_wanted()
            try:
                async with views.conn() as conn:
                    if view.tips is not None:
                        rows = await new_plans(conn, view.tips, ALL_PER_RING)
                        more, skipped = view.discover(rows)
                        views.skipped_all += skipped
                        if rows and self.cost is not None:  # rows read: charged now, paid by the next frames
                            self.cost.take(len(rows), time.monotonic())
                        if more:
                            self.wake.set()  # a shard had more new plans than one read takes: read again at once
                    stored = await read_watched(conn, list(view.watched.values())) if view.watched else {}
            except Exception as exc:  # the database is away: try again at the next doorbell or poll
                log.warning("view session cannot read the watched plans", error=f"{type(exc).__name__}: {exc}")
                continue
            sent = view.caught_up(stored)
            for msg in sent:  # a frame each: one result may be most of a frame
                await self.send([msg])
            if sent and self.cost is not None:  # the events sent: charged now, paid by the session's next frames
                self.cost.take(len(sent), time.monotonic())
        views.doorbell.forget(self.wake)
        self.follower = None
