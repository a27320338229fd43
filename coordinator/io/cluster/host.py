"""Cluster mode, phase 2: several coordinators share the shard slots, one core per owned shard.

Theory of operation (docs/CLUSTER.md §Shards and pools):

* **One core per shard.** Every shard this process owns is served by its own
  :class:`~coordinator.io.frontdoor.server.CoordinatorServer` (its own ``Coordinator`` core, group
  committer, reaper and PostgreSQL store connection fenced with that shard's epoch), listening
  on its own port of the same host. The core is per-shard state (queue, workers of that pool,
  plans), so taking a shard over is exactly a restart of that core: load the shard's plans, give
  its workers one heartbeat timeout to come back. A fenced commit (or any store failure) is
  fail-stop for that shard only: its server stops (sessions closed 1001, clients resume), the
  others keep serving.
* **Partial ownership and rebalance** (pure: :func:`coordinator.shards.plan_round`): every
  round (``--lease-renew`` / 2) the host beats its row in ``fleetwire_coordinators`` (a table of
  the versioned schema, coordinator/io/stores/postgres.py), reads the
  lease rows and the live coordinators, takes orphaned slots up to its fair share
  ``ceil(shards / live)``, renews what it holds (one statement), and gives back a few slots at a
  time (after flushing them) while another live coordinator is under its share.
* **Finding the owner.** The main port answers ``/v1/topology`` (shard -> owner URL, epoch,
  lease expiry, from PostgreSQL), ``/healthz`` and ``/readyz`` (503 while it owns nothing),
  and every websocket session on it that names a pool (``?pool=NAME``; every worker session,
  none: the default pool) gets a ``moved`` to the owner of that pool's shard (in a partitioned
  pool, of the partition its ``hello`` or ``submit`` picks) and a 4307 close. A shard's own
  server sends ``moved`` to a worker whose ``hello`` names another shard's pool and to a client
  whose ``submit`` belongs to another shard, before anything is processed.
* **Cross-shard views** (coordinator/io/cluster/sessions.py): a client session that names no
  pool is served on the main port for every shard from PostgreSQL (get, list, watch through the
  commit doorbell, workers), with ``cancel`` and the worker verbs forwarded to the owner. Every
  shard's store rings the doorbell after its group commits (:class:`~coordinator.io.cluster.cores.ShardPgStore`) while a
  watcher waits on some coordinator (each round reads whether one does), and the
  host writes its shards' registries to ``fleetwire_shard_workers`` while a view wants them.
* **The front door.** The main port is a single coordinator's port with other routes: the same
  front door (coordinator/io/frontdoor/door.py, gate.py; issue 24 part 6, issue #26) with the
  main port's routes and per-session router (coordinator/io/cluster/mainport.py). The
  pending-handshake budget and ``TCP_DEFER_ACCEPT`` from accept, and before any upgrade of
  ``/v1/worker`` or ``/v1/client`` the Origin (and, under ``--insecure``, Host) checks, the
  connection limit and shares, the bearer token (401/403: a worker is checked before it is
  moved) and the penalty box (429 after a session closed 1009 or 4429); each session is read
  within the read policy (coordinator/read_policy.py: the client message rate, 4429 past the
  flood grace; the principal's work units). Repeated 401s, and loops of ``/metrics`` or
  ``/v1/topology`` (a database read), are answered after ``--penalty-hold``.

The lease row's ``owner_url`` is the shard server's URL: empty from the acquisition until the
shard's server listens, so a ``moved`` never points at a port that is not serving yet. The core that
sets it sends a ``NOTIFY`` on :data:`~coordinator.io.cluster.cores.URL_CHANNEL` in the same
transaction; every host ``LISTEN`` s on its control connection (before its first scan, and on each
new control connection before it is used), and a shard of another coordinator's served at a new
URL runs its next round at once: a scan that saw that shard without a URL is followed by one that
sees it (the notification comes after the scan or it was already committed before it).

**Waiting for the database.** A coordinator that cannot reach PostgreSQL at start (refused, no
answer, a login it cannot make yet: :class:`~coordinator.io.stores.integrity.StoreUnreachable`) does not
exit: it listens on its main port, answers ``/readyz`` 503 "waiting for the database" and new
sessions 503 + ``Retry-After``, and dials again with a jittered backoff (1 s doubling to 5 s)
until the database answers, then joins the cluster (issue #25 part 3: the exit status 2 it had
was never restarted by the shipped unit). A database that answers but refuses this coordinator
(another cluster's, another shard count, a newer schema) is a configuration error:
:attr:`ClusterHost.fatal` is set and ``fleetwire coordinator`` exits 2.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import math
import os
import random
import secrets
import socket
import time
from collections.abc import Callable, Coroutine
from typing import Any

import structlog
from websockets.asyncio.server import Server
from websockets.typing import Subprotocol

from coordinator.auth import TokenStore, inline_tokens
from coordinator.io.cluster.cores import URL_CHANNEL, ShardCores
from coordinator.io.cluster.doorbell import Doorbell, open_connection
from coordinator.io.cluster.mainport import MAIN_CODECS, MainPort
from coordinator.io.cluster.metrics import ClusterStats, build_registry
from coordinator.io.cluster.openai_route import cluster_door
from coordinator.io.cluster.sessions import ViewSessions
from coordinator.io.cluster.shared_keys import ClusterSecretMismatch, accepted, key_times, sync
from coordinator.io.cluster.teardown import (
    STOP_DB_S,
    STOP_TASK_S,
    cancelled,
    close_left,
    closed,
    opened,
    settled,
    store_closer,
    store_opener,
)
from coordinator.io.cluster.views import (
    PUT_WORKERS,
    WANTED,
    encode_workers,
)
from coordinator.io.frontdoor.door import FrontDoor
from coordinator.io.frontdoor.gate import Gatekeeper
from coordinator.io.frontdoor.openai_http import OpenAIDoor
from coordinator.io.frontdoor.server import CoordinatorServer, ServerSettings
from coordinator.io.ops.openai_metrics import OpenAICollector
from coordinator.io.stores.integrity import StoreError, StoreUnreachable
from coordinator.io.stores.postgres import PgStore, describe_dsn, ensure_indexes
from coordinator.read_policy import ReadPolicy
from coordinator.shards import LeaseRow, PartialLeases, SubmitShards, plan_round, submit_shard, worker_shard
from protocol import SUBPROTOCOL_JSON, SUBPROTOCOL_MSGPACK
from protocol.messages import Hello, Moved, Submit

__all__ = ["ClusterHost", "next_round_s"]

log = structlog.get_logger(__name__)

DB_RETRY_CAP_S = 5.0  # the longest wait between two tries to reach the database at start
# A round runs this long after another's lease could expire (database clock): its orphaned slot is taken then,
# not up to a scan period later (next_round_s).
EXPIRY_SLACK_S = 0.02
# How soon a round runs again while another coordinator's newly won shard has no URL yet and this host cannot hear
# the URLs published (no LISTEN on its control connection: ClusterHost.hearing_urls); while it can, the NOTIFY that
# publishes one runs the round at once (ClusterHost._url_known).
URL_POLL_S = 0.1

_BEAT = """
INSERT INTO fleetwire_coordinators (owner, url, expires_at) VALUES ($1, $2, now() + make_interval(secs => $3))
ON CONFLICT (owner) DO UPDATE SET url = excluded.url, expires_at = excluded.expires_at
"""
_GONE = "DELETE FROM fleetwire_coordinators WHERE owner = $1 OR expires_at < now() - interval '1 hour'"
_SCAN = """
SELECT shard, owner, epoch, expires_at > now(), owner_url,
       CASE WHEN isfinite(expires_at) THEN extract(epoch FROM expires_at - now())::float8 END
FROM shard_leases ORDER BY shard
"""
_PEERS = "SELECT owner FROM fleetwire_coordinators WHERE expires_at > now()"
# As pg_leases.ACQUIRE, but a renewal keeps the row's owner_url (the shard server's), and an
# acquisition clears it until that shard's server listens.
_ACQUIRE = """
UPDATE shard_leases SET
    epoch = CASE WHEN owner = $1 THEN epoch ELSE epoch + 1 END,
    acquired_at = CASE WHEN owner = $1 THEN acquired_at ELSE now() END,
    owner_url = CASE WHEN owner = $1 THEN owner_url ELSE '' END,
    owner = $1,
    expires_at = now() + make_interval(secs => $2)
WHERE shard = ANY($3::int[]) AND (owner = $1 OR expires_at < now())
RETURNING shard, epoch
"""


class ClusterHost:
    """One coordinator process of a cluster: a main port plus one core per owned shard.

    The same surface as :class:`CoordinatorServer` for ``fleetwire coordinator``: :meth:`start`,
    :meth:`stop`, :attr:`url`, :attr:`fatal`, :attr:`loaded` (set once it serves a shard).

    Args:
        settings: the coordinator's settings (``store`` is the ``postgresql://`` DSN).
        version: told to workers.
        announce: called with one line for each shard won or lost (the CLI prints them).
        shard_ports: the ports (first, last) its shards' cores listen on (``--shard-ports``; None: any free
            port). It holds at least ``shards`` ports; shard ``s`` takes ``first + s`` when it is free.
    """

    def __init__(self, settings: ServerSettings, *, version: str = "",
                 announce: Callable[[str], None] | None = None,
                 shard_ports: tuple[int, int] | None = None,
                 cluster_secret: bytes | None = None) -> None:  # fmt: skip
        settings.check()
        self.settings = settings
        self.config = settings.cluster
        if shard_ports is not None:
            low, high = shard_ports
            if not 0 < low <= high <= 65535 or high - low + 1 < self.config.shards:
                raise ValueError(f"--shard-ports {low}-{high}: a coordinator alone serves all {self.config.shards} "
                                 f"shards, each on its own port: give a range of at least {self.config.shards} ports "
                                 "within 1-65535")  # fmt: skip
        self.shard_ports = shard_ports
        self.version = version
        self.owner = f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(3)}"
        self.description = describe_dsn(settings.store)[0]  # the store, without its password
        self.waiting_db: str | None = None  # why the database could not be reached yet (None: it was)
        self.control: PgStore | None = None  # the lease and topology connection; None until the database answers
        try:
            self.control = PgStore(settings.store, self.config)
            self.control.owner = self.owner
        except StoreUnreachable as exc:  # start anyway: wait for it (see "Waiting for the database" above)
            self.waiting_db = str(exc)
        self.leases = PartialLeases(self.config, self.owner)
        self.cores = ShardCores(self)  # one per served shard: started, stopped, failed (cores.py)
        # The data-plane keys every core shares (shared_keys.py), derived from --cluster-secret-file when given.
        self.cluster_secret = cluster_secret
        self.wall: Callable[[], float] | None = None  # the shared keys' clock; None: the database's (tests: a fake)
        self._shared: list[tuple[str, bytes]] = []  # the shared keys still accepted, the signing one first
        self.rows: list[LeaseRow] = []  # the last scan
        self._round_due = math.inf  # when the last round's rows ask for the next one (next_round_s); inf: none
        self.hearing_urls = False  # its control connection LISTENs for the URLs published: no poll (next_round_s)
        self._wake = asyncio.Event()  # set by a URL published for another's shard: the next round runs now
        self.peers: set[str] = set()
        self.fatal: asyncio.Future[BaseException] | None = None
        self.loaded = asyncio.Event()
        self.port = settings.port
        self.failovers = 0
        # The last round failed, or the database has not answered yet: new sessions get 503 + Retry-After
        # (docs/CLUSTER.md).
        self.db_away = self.control is None
        self.stats = ClusterStats()  # the main port's /metrics (coordinator/io/cluster/metrics.py)
        self.metrics_registry = build_registry(self.stats, lambda: len(self.servers))
        self.announce: Callable[[str], None] = announce or (lambda line: None)
        # The main port's /v1/plans (cross-shard views, coordinator/io/cluster/views.py): admin tokens only.
        tokens = inline_tokens(settings.worker_tokens, settings.client_tokens, settings.admin_tokens)
        self.tokens = None if settings.insecure else TokenStore(settings.token_file, tokens)
        # The main port's front door is a single coordinator's (module docstring, "The front door").
        self._gate = Gatekeeper(self.tokens, settings.limits, max_frame_bytes=settings.max_frame_bytes)
        policy = ReadPolicy(settings.limits)  # the view sessions' work-unit buckets are its too
        self.door = FrontDoor(MainPort(self, self._gate), self._gate, policy, MAIN_CODECS,
                              ping_workers=settings.ping_workers)  # fmt: skip
        self.openai = cluster_door(self, settings)  # each request to its pool's shard's core (cluster/openai_route.py)
        if self.openai is not None:
            self._gate.pending.divert = self.openai.divert
            self.metrics_registry.register(OpenAICollector(self.openai.stats))  # type: ignore[arg-type]
        # Client sessions on the main port that name no pool see every shard (coordinator/io/cluster/sessions.py).
        config = self.config
        # Rings only while a watcher waits somewhere in the cluster (each round reads whether one does).
        self.doorbell = Doorbell(settings.store, open_connection, gated=True, warm_s=1.5 * config.lease_renew_s)
        shard_of = functools.partial(submit_shard, shards=config.shards, partitions=config.partitions)
        self.views = ViewSessions(settings.store, where=self.where, version=version, doorbell=self.doorbell,
                                  renew_s=config.lease_renew_s, read_policy=policy, shards=config.shards,
                                  submit_shard=shard_of)  # fmt: skip
        self._workers_at = 0.0  # when the shards' registries were last written (fleetwire_shard_workers)
        self._submit_shard = SubmitShards(config.shards, config.partitions)  # redirect's, once a submit
        self._tasks: set[asyncio.Task[Any]] = set()
        # Each store a task opened or loaded and then left, cancelled by stop(): done once it is closed (teardown.py).
        self.leftovers: set[asyncio.Future[None]] = set()
        # The threads its stores close in, not the loop's default executor's (teardown.py, "Off the loop"); shut down
        # at the end of stop().
        self.closer = store_closer(self.config.shards)
        # The threads its stores open and its shards' cores load in, not the loop's default executor's either
        # (teardown.py, "Started in the host's own threads"); shut down at the end of stop().
        self.opener = store_opener(self.config.shards)
        self._keeper: asyncio.Task[None] | None = None
        self._server: Server | None = None
        self.stop_began = False
        self._lock = asyncio.Lock()  # one operation at a time on the control connection

    async def db(self, make: Callable[[Any], Any]) -> Any:
        """``make(connection)`` on the control connection, one statement group at a time.

        Raises:
            StoreUnreachable: the database has not answered since the start.
        """
        async with self._lock:
            if self.control is None:
                raise StoreUnreachable(f"waiting for the database: {self.waiting_db}")
            return await self.control.call(make)

    async def sync_shared_keys(self) -> None:
        """Read the cluster's shared data-plane keys (making a new one when due, shared_keys.py) and hand the ones
        still accepted to every core, which tells its workers when they changed. Every round, and at the start."""
        core = self.settings.core
        # A new key signs only once every core that still serves has told its workers, the ones in their reconnect
        # grace included; the one before stays accepted for its tickets' life and the rounds (shared_keys.key_times).
        times = key_times(ticket_ttl_s=core.data_ticket_ttl_s, lease_ttl_s=self.config.lease_ttl_s,
                          scan_s=self.config.scan_s, reconnect_grace_s=core.worker_reconnect_grace_s)  # fmt: skip
        publish_s, keep_s = times.publish_s, times.keep_s
        wall = None if self.wall is None else self.wall()
        secret = self.cluster_secret
        keys, wall = await self.db(lambda conn: sync(conn, secret, wall=wall, rotation_s=core.data_key_rotation_s,
                                                     keep_s=keep_s, publish_s=publish_s))  # fmt: skip
        self._shared = accepted(keys, secret, wall, keep_s, publish_s)
        for server in self.servers.values():
            server.core.data.set_shared(self._shared)
            server.driver.flush()

    async def shared_keys(self) -> list[tuple[str, bytes]]:
        """The shared data-plane keys still accepted, the signing one first: read first when none was yet (the
        first core's start)."""
        if not self._shared:
            await self.sync_shared_keys()
        return self._shared

    @property
    def servers(self) -> dict[int, CoordinatorServer]:
        """Shard -> its core's server, while this process serves it (:attr:`ShardCores.servers`)."""
        return self.cores.servers

    @property
    def url(self) -> str:
        host = self.settings.host
        return f"ws://{f'[{host}]' if ':' in host else host}:{self.port}"

    @property
    def serving(self) -> bool:
        """It serves at least one shard (``/readyz`` 200)."""
        return bool(self.servers)

    # ------------------------------------------------------------------ life cycle

    async def start(self) -> None:
        """Listen on the main port, join the cluster and start the rounds (shards are served as they are won)."""
        self.fatal = asyncio.get_running_loop().create_future()
        self.doorbell.bind(asyncio.get_running_loop())
        if self.control is not None:  # else once the database answers
            self.spawn(self._index_ids())
        if self.cluster_secret is None:
            log.warning("no --cluster-secret-file: the cluster's shared data-plane key is kept in plain text in the "
                        "database, and whoever can read the database can sign data-plane tickets (docs/OPERATIONS.md "
                        "§Data plane)", store=self.description)  # fmt: skip
        if self.control is not None:  # a coordinator with another cluster secret is refused here
            await self.sync_shared_keys()
        self._gate.fit_fd_limit(self.settings.limits.max_connections)  # soft RLIMIT_NOFILE up to the hard one
        self._server = await self._gate.serve(
            self.door.serve, self.settings.host, self.settings.port, process_request=self.door.process_request,
            select_subprotocol=self.door.select_subprotocol,
            subprotocols=[Subprotocol(SUBPROTOCOL_MSGPACK), Subprotocol(SUBPROTOCOL_JSON)],
        )  # fmt: skip
        sockets = list(self._server.sockets)
        if sockets:
            self.port = sockets[0].getsockname()[1]
        if self.control is None:
            log.error("cannot reach the cluster's database; waiting for it (/readyz 503 until it answers)",
                      store=self.description, error=self.waiting_db)  # fmt: skip
            self._keeper = asyncio.create_task(self._wait_for_database())
            return
        self.hearing_urls = await self._hear_urls(self.control)
        await self._round()
        self._keeper = asyncio.create_task(self._keep())

    async def _wait_for_database(self) -> None:
        """Dial the database with a jittered backoff (1 s doubling to 5 s) until it answers, then join the cluster."""
        rng = random.Random()
        ceiling = 1.0
        while self.control is None and not self.stop_began:
            await asyncio.sleep(rng.uniform(ceiling / 2, ceiling))
            ceiling = min(DB_RETRY_CAP_S, 2 * ceiling)
            try:
                control = await opened(lambda: PgStore(self.settings.store, self.config), self.leftovers,
                                       self.closer, self.opener)  # fmt: skip
            except StoreUnreachable as exc:
                self.waiting_db = str(exc)
                log.warning("still waiting for the cluster's database", store=self.description, error=str(exc))
                continue
            except StoreError as exc:  # it answered and refused this coordinator: configuration, not a wait
                log.critical("the cluster's database refused this coordinator", store=self.description, error=str(exc))
                assert self.fatal is not None
                if not self.fatal.done():
                    self.fatal.set_result(exc)
                return
            control.owner = self.owner
            hearing = await self._hear_urls(control)
            async with self._lock:
                self.control, self.hearing_urls = control, hearing
            self.waiting_db = None
            log.warning("reached the cluster's database; joining the cluster", store=self.description)
        if self.stop_began:
            return
        self.spawn(self._index_ids())
        await self._keep()

    async def _index_ids(self) -> None:
        """The indexes of a migrated schema (stores/postgres.py ensure_indexes), built concurrently on a connection of
        their own (commits go on) when they are missing; a fresh database got them with its tables."""
        try:
            conn = await open_connection(self.settings.store)
        except Exception as exc:
            log.warning("cannot index the plans for the cross-shard views", error=f"{type(exc).__name__}: {exc}")
            return
        try:
            built = await ensure_indexes(conn)
            if built:
                log.info("plans' indexes built for the cross-shard views", store=self.description, built=built)
        except Exception as exc:  # another coordinator builds it at the same moment, or the database is away
            log.info("plans' indexes not built here", error=f"{type(exc).__name__}: {exc}")
        finally:
            await conn.close()

    async def stop(self) -> None:
        """SIGTERM: flush and stop every shard's core, give the slots back, leave the cluster.

        Bounded: each task it cancels gets :data:`STOP_TASK_S` to end, the main port's sessions the
        handshake plus close timeouts (:meth:`Gatekeeper.wait_closed`), each release and the row's
        delete :data:`STOP_DB_S`, the control store's close :data:`STOP_DB_S`; the shards' cores stop together, each
        as :meth:`CoordinatorServer.stop` does (its statements have the store's 30 s timeout), the one
        another path was stopping (a loss, a failure: the task it cancels) included, which it waits for
        (:meth:`ShardCores.stop_all`, then that slot's release, if it was to be released). What it leaves
        running is logged. A store that a task it cancelled was opening (or loading) is closed once made (or let go
        of), and the stop waits for that close up to :data:`STOP_TASK_S` + :data:`STOP_DB_S` from its
        start; one still opening or closing then is logged and closed once made. No store is closed on the loop:
        ``PgStore.close`` waits on its database (up to ~25 s against one that does not answer), which would stall
        every other session and shard on this loop meanwhile; nor in the loop's default executor, which closed more
        shards' stores than it has threads in waves: they close together in :attr:`closer`, shut down at the end.
        """
        try:
            await self._stopped()
        finally:  # its threads end once idle; a close (or an open) still running (past its bound, logged) goes on
            self.closer.shutdown(wait=False)
            self.opener.shutdown(wait=False)

    async def _stopped(self) -> None:
        """:meth:`stop`, but for its closer's shutdown."""
        self.stop_began = True
        began = time.monotonic()
        keeper, self._keeper = self._keeper, None
        if keeper is not None:  # bounded: a cancel it lost must not hold the stop (_keep)
            keeper.cancel()
            await cancelled([keeper], "the lease rounds")
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        # A shard's start or the id index may hold a database connection: let it go back first.
        await cancelled(tasks, "a shard's start or stop, or the id index")
        if self._server is not None:
            self._server.close()
            self._gate.close()  # sockets still before their upgrade; the refusal log's summaries
            await self._gate.wait_closed(self._server)  # bounded: a session stuck on the database is cancelled
        await self.cores.stop_all()  # and the ones another path began (a loss, a failure): their tasks were cancelled
        with contextlib.suppress(Exception):  # bounded: the row expires after the TTL anyway
            async with asyncio.timeout(STOP_DB_S):
                await self.db(lambda conn: conn.execute(_GONE, self.owner))
        await self.views.close()  # (bounded: its pool's close, 5 s; the doorbell's connection's, 5 s)
        await self.doorbell.close()
        if self.control is not None:  # in a thread: PgStore.close waits on its database
            await closed(self.control, "the control connection", self.closer)
        await settled(self.leftovers, began + STOP_TASK_S + STOP_DB_S)  # the stores the cancelled tasks left

    def reload_tokens(self) -> list[str]:
        """SIGHUP: every shard's server re-reads the token file."""
        if self.tokens is not None:
            self.tokens.reload()
            tokens = self.tokens
            self.views.revoke(tokens.current)
        return sorted({name for server in self.servers.values() for name in server.reload_tokens()})

    # ------------------------------------------------------------------ rounds

    async def _keep(self) -> None:
        """A round every ``scan_s`` (sooner when the leases would expire first), until :meth:`stop`.

        The round runs in this task under :func:`asyncio.timeout`, not in a task of its own under
        ``asyncio.wait_for``: on Python 3.11 ``wait_for`` returns the round's result when a cancel
        arrives in the loop iteration in which the round ends, and the cancel is lost; :meth:`stop`
        then waited for this loop for ever (the teardown of test_cluster_front_door.py that hung 120 s).
        The loop also ends on ``stop_began``, whatever happened to the cancel.
        """
        period = self.config.scan_s
        while not self.stop_began:
            now = time.monotonic()
            wait = period
            if self.leases.held:
                wait = min(wait, max(0.0, self.leases.valid_until - now))
            wait = min(wait, max(0.0, self._round_due - now))
            with contextlib.suppress(TimeoutError):  # or sooner: a URL published (_url_known)
                async with asyncio.timeout(wait):
                    await self._wake.wait()
            self._wake.clear()  # before the scan: a URL published after it runs the next round at once
            expired = self.leases.check(time.monotonic())
            self.cores.lose(expired, "no lease renewal succeeded before the lease could expire")
            self._round_due = math.inf  # a round that fails asks for nothing: the period again
            try:
                timeout = max(0.05, self.leases.valid_until - time.monotonic()) if self.leases.held else 30.0
                async with asyncio.timeout(timeout):
                    await self._round()
            except TimeoutError:
                self.db_away = True  # new sessions: 503 + Retry-After until a round succeeds
                self.cores.lose(self.leases.check(time.monotonic()), "a lease renewal hung past the lease")
                await self._reconnect()
            except Exception as exc:  # the database is away: judged by the leases' own clock
                self.db_away = True
                log.warning("cluster round failed", store=self.description,
                            error=f"{type(exc).__name__}: {exc}")  # fmt: skip
                await self._reconnect()
            else:
                self.db_away = False

    async def _reconnect(self) -> None:
        """A round failed: open a new control connection (a database failover left the old one dead).

        With a multi-host DSN (``...@h1:p1,h2:p2/db?target_session_attrs=read-write``) the new
        connection reaches whichever host accepts writes now; while none does, this fails and the
        next round tries again. The shards' cores reconnect on their own when they are won again.
        """
        try:
            fresh = await opened(lambda: PgStore(self.settings.store, self.config), self.leftovers, self.closer,
                                 self.opener)  # fmt: skip
        except Exception as exc:
            log.warning("cannot reconnect to PostgreSQL yet", store=self.description, error=str(exc))
            return
        fresh.owner = self.owner
        hearing = await self._hear_urls(fresh)
        async with self._lock:
            old, self.control, self.hearing_urls = self.control, fresh, hearing
        if old is not None:
            await close_left(old, self.leftovers, self.closer)
        log.warning("reconnected to PostgreSQL", store=fresh.description)

    async def _round(self) -> None:
        """Beat, scan, decide (coordinator/shards.py plan_round), acquire and renew; start and stop cores."""
        ttl, owner, url = self.config.lease_ttl_s, self.owner, self.url

        async def scan(conn: Any) -> tuple[list[Any], list[Any], bool]:
            await conn.execute(_BEAT, owner, url, ttl)
            return await conn.fetch(_SCAN), await conn.fetch(_PEERS), await conn.fetchval(WANTED, "doorbell")

        rows, peers, self.doorbell.wanted = await self.db(scan)
        try:
            await self.sync_shared_keys()
        except ClusterSecretMismatch as exc:  # configuration, not a wait: fail-stop
            log.critical("the cluster's shared data-plane key refuses this coordinator", error=str(exc))
            assert self.fatal is not None
            if not self.fatal.done():
                self.fatal.set_result(exc)
            return
        scanned = time.monotonic()
        self.rows = [LeaseRow(r[0], r[1], r[2], r[3], r[4]) for r in rows]
        left = {r[0]: r[5] for r in rows if r[5] is not None}  # a never-held slot's -infinity: none
        self.peers = {r[0] for r in peers}
        decided = plan_round(owner, self.leases.held, self.rows, self.peers, max_moves=2)
        wanted = sorted(set(self.leases.held) | set(decided.acquire))
        sent_at = time.monotonic()
        got = await self.db(lambda conn: conn.fetch(_ACQUIRE, owner, ttl, wanted)) if wanted else []
        won, lost = self.leases.result([(r[0], r[1]) for r in got], sent_at, time.monotonic())
        self.stats.won(self.leases.held[shard] for shard in won)
        self.cores.lose(lost, "lost the lease to another coordinator (or it expired)")
        for shard in won:
            self.spawn(self.cores.start(shard, self.leases.held[shard]))
        missed = bool(set(decided.acquire) - set(won))
        self._round_due = scanned + next_round_s(self.config.scan_s, self.rows, left, self.leases.held, missed,
                                                 hearing=self.hearing_urls)  # fmt: skip
        try:
            await self._write_workers()
        except Exception as exc:  # only the views' registries are late; the round itself succeeded
            log.warning("cannot write the shards' registries for the cross-shard views",
                        error=f"{type(exc).__name__}: {exc}")  # fmt: skip
        for shard in decided.release:
            self.cores.give_back(shard, "rebalance: another coordinator joined")

    async def _write_workers(self) -> None:
        """Every ``--lease-renew`` while a view wants them: the served shards' registries to the database."""
        now = time.monotonic()
        if now - self._workers_at < self.config.lease_renew_s:
            return
        served = [(shard, server) for shard, server in sorted(self.servers.items())
                  if shard not in self.cores.moving and shard in self.leases.held]  # fmt: skip
        if not served or not await self.db(lambda conn: conn.fetchval(WANTED, "workers")):
            return
        self._workers_at = now
        blobs = []
        for _, server in served:
            registry = server.core.registry
            blobs.append(encode_workers([registry.info(r.id, now) for r in registry]))
        shards = [shard for shard, _ in served]
        epochs = [self.leases.held[shard] for shard in shards]
        owners = [self.owner] * len(shards)
        await self.db(lambda conn: conn.execute(PUT_WORKERS, shards, owners, epochs, blobs))

    async def _hear_urls(self, control: PgStore) -> bool:
        """``LISTEN`` for the shards' URLs as they are published (module docstring) on ``control``, a control
        connection not in use yet; whether it does (if not, the rounds poll for a URL: :func:`next_round_s`)."""
        loop = asyncio.get_running_loop()

        def heard(conn: Any, pid: int, channel: str, payload: str) -> None:  # on the control store's own thread
            with contextlib.suppress(RuntimeError):  # the loop closed: nobody waits for rounds any more
                loop.call_soon_threadsafe(self._url_known, payload)

        try:
            await control.call(lambda conn: conn.add_listener(URL_CHANNEL, heard))
        except Exception as exc:
            log.warning("cannot listen for the shards' URLs; rounds poll while one is unknown", store=self.description,
                        error=f"{type(exc).__name__}: {exc}")  # fmt: skip
            return False
        return True

    def _url_known(self, payload: str) -> None:
        """Some core published its shard's URL (``payload``: the shard): unless it is one of this host's own, the next
        round runs now, so the main port's ``moved`` names it (rather than at the next scan)."""
        try:
            shard = int(payload)
        except ValueError:  # a payload this version does not read
            return
        if shard not in self.leases.held:
            self._wake.set()

    def spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        """Run ``coro`` in a task of the host's (:meth:`stop` cancels them)."""
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # ------------------------------------------------------------------ finding the owner

    def door_of(self, shard: int) -> OpenAIDoor | None:
        """The OpenAI door of ``shard``'s core when this process serves it (cluster/openai_route.py)."""
        server = self.cores.serves(shard)
        return server.openai if server is not None else None

    def where(self, shard: int) -> Moved:
        """Where ``shard`` is served, from the last scan (``url`` "" while nobody serves it)."""
        server = self.cores.serves(shard)
        if server is not None:
            return Moved(url=server.url, epoch=self.leases.held.get(shard, 0), shard=shard)
        for row in self.rows:
            if row.shard == shard and row.live:
                return Moved(url=row.url, epoch=row.epoch, shard=shard)
        return Moved(url="", shard=shard)

    def redirect(self, shard: int, role: str, msg: Any) -> Moved | None:
        """A shard server's check: a worker of another pool, or a submit of another shard, is moved."""
        kind = type(msg)
        config = self.config
        if kind is Submit:
            target = self._submit_shard(msg)
        elif kind is Hello:
            target = worker_shard(msg.capabilities.tags, msg.worker_id, config.shards, config.partitions)
        else:
            return None
        return None if target == shard else self.where(target)


def next_round_s(period: float, rows: list[LeaseRow], left: dict[int, float], held: Any, missed: bool = False, *,
                 hearing: bool = False) -> float:  # fmt: skip
    """Seconds from a scan until the next round, as the other coordinators' lease rows ask (pure).

    ``period``: the scan period (``--lease-renew`` / 2), the longest; ``left``: shard -> seconds until its
    lease expires, at the scan (database clock); ``held``: this coordinator's slots. A live owner renews
    every period, so its lease has about the TTL left: one with less than a period left stopped renewing
    (killed, stalled, cut off), and the round runs just after it could expire (:data:`EXPIRY_SLACK_S`)
    rather than up to a period later; whether it expired is still the database's to say (the acquire's
    ``expires_at < now()``: fencing unchanged). A shard another coordinator just won has no URL until its
    core listens. ``hearing`` (this host LISTENs for the URLs published, :attr:`ClusterHost.hearing_urls`): the
    NOTIFY that publishes it runs the round, the period is not shortened for it; not hearing, the round runs
    every :data:`URL_POLL_S` until it has one. Either way the main port's ``moved`` names it soon after.
    ``missed``: this round asked for an orphaned slot that another coordinator won first (both rounds ran at
    its expiry and chose the same one, coordinator/shards.py plan_round): the next round, :data:`URL_POLL_S`
    later, sees which are left, instead of a period later.
    """
    due = URL_POLL_S if missed else period
    for row in rows:
        if row.shard in held or not row.live:
            continue
        if not row.url and not hearing:
            due = min(due, URL_POLL_S)
        ttl_left = left.get(row.shard, period)
        if ttl_left < period:
            due = min(due, max(0.0, ttl_left) + EXPIRY_SLACK_S)
    return due
