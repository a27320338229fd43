"""The cores of a cluster host's shards: one per shard it serves, started when a round wins the slot, stopped when
the slot is given back, lost, or its core fails (coordinator/io/cluster/host.py decides which; docs/CLUSTER.md).

What it owns: :attr:`ShardCores.servers` (shard -> its core's server, while it serves), their stores, their remote
upstreams' readers (remote_refs.py), their ports of ``--shard-ports``, the slots being started
(:attr:`~ShardCores.starting`) or stopped (:attr:`~ShardCores.moving`), the cores' stops under way, and the slots
whose release a cancelled task left (:attr:`~ShardCores.unreleased`). What it is handed: its host (:class:`Host`):
the settings, the leases, the control connection, the shared keys, the spawn of tasks that the host's stop cancels,
and the ``moved`` check each shard server asks.

Rules:

* **A core per won slot.** A won shard's core opens its store fenced with that slot's epoch, loads the shard's
  plans, listens, and only then publishes its URL (the lease row's ``owner_url``, with a ``NOTIFY`` on
  :data:`URL_CHANNEL` that wakes the other coordinators' rounds). A core that cannot start gives
  its slot back at once; one whose slot was lost while it loaded is stopped, not released.
* **A stop is never cut short.** A shard is out of :attr:`~ShardCores.servers` from the moment its stop begins,
  so nothing else would stop its core: that stop runs in a task of its own, which a cancel of the task that began
  it leaves running, and :meth:`ShardCores.stop_all` (the host's stop) waits for it.
* **Every slot the host's stop cancels is given back.** A release that a cancelled task left (a stop's, a start's,
  a give-back's) is made by :meth:`ShardCores.stop_all`, after the cores' stops, within :data:`~teardown.STOP_DB_S`:
  a slot whose core never served has nothing to flush, and a standby takes it at its next scan, not after the TTL.
* **No store left open.** A store a cancelled start was opening or loading is closed once made (teardown.py).
* **Closed in the host's threads.** Each core's store closes in its host's :attr:`Host.closer` (its stop's last
  step), not in the loop's default executor: against a database that does not answer, a host with more shards than
  that executor's threads closed them in waves (teardown.py, "Off the loop"). Likewise each start's open, load and
  writer hand-over run in its :attr:`Host.opener` (teardown.py, "Started in the host's own threads").
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import socket
import time
from collections.abc import Awaitable, Callable, Coroutine
from concurrent.futures import Executor
from dataclasses import replace
from typing import Any, Protocol
from urllib.parse import quote, urlsplit, urlunsplit

import structlog

from coordinator.io.cluster.doorbell import Doorbell
from coordinator.io.cluster.leases import RELEASE, ShardFenced
from coordinator.io.cluster.metrics import ClusterStats
from coordinator.io.cluster.remote_refs import RemoteRefs
from coordinator.io.cluster.sessions import ViewSessions
from coordinator.io.cluster.teardown import STOP_DB_S, close_after, close_left, opened
from coordinator.io.frontdoor.server import CoordinatorServer, ServerSettings
from coordinator.io.stores.postgres import PgStore
from coordinator.shards import PartialLeases
from protocol.messages import Event, Moved

__all__ = ["URL_CHANNEL", "Host", "ShardCores", "ShardPgStore"]

log = structlog.get_logger(__name__)

URL_CHANNEL = "fleetwire_shard_urls"  # NOTIFY'd (payload: the shard) when a shard's core publishes its URL (_SET_URL)
# Publishes a served shard's URL and says so to every coordinator in the same transaction: their main ports learn it
# at once (host.py ClusterHost._url_known), not at their next scan.
_SET_URL = f"""
WITH served AS (
    UPDATE shard_leases SET owner_url = $1 WHERE shard = $2 AND owner = $3 AND epoch = $4 RETURNING shard
)
SELECT pg_notify('{URL_CHANNEL}', shard::text) FROM served
"""


class ShardPgStore(PgStore):
    """The store of one shard's core: a :class:`PgStore` fenced with that shard's epoch only.

    ``sharded`` is False so its :class:`CoordinatorServer` keeps no leases of its own (the host
    does), and :meth:`PgStore.load` reads only the shard in :attr:`fence`.
    """

    sharded = False
    doorbell: Doorbell | None = None  # rung after every group commit (coordinator/io/cluster/sessions.py)

    def write(self, records: Any) -> None:
        super().write(records)
        self.ring(records)

    async def write_async(self, records: Any) -> None:
        await super().write_async(records)
        self.ring(records)

    def ring(self, records: Any) -> None:
        """At most one doorbell per group commit: the shard and the highest event seq it wrote."""
        bell = self.doorbell
        if bell is not None and records and not bell.unheard():  # no scan of the group while nobody listens
            seq = max((r.seq for r in records if type(r) is Event), default=0)
            for shard in self.fence:
                bell.ring(shard, seq)


class Host(Protocol):
    """What the shard cores read of their cluster host (coordinator/io/cluster/host.py ``ClusterHost``)."""

    settings: ServerSettings
    owner: str
    version: str
    leases: PartialLeases
    stats: ClusterStats
    doorbell: Doorbell
    views: ViewSessions
    loaded: asyncio.Event
    stop_began: bool  # its stop() began
    leftovers: set[asyncio.Future[None]]  # the stores the host's stop waits to see closed (teardown.py)
    closer: Executor  # the threads its stores close in (teardown.py store_closer)
    opener: Executor  # the threads its stores open and its cores load in (teardown.py store_opener)
    shard_ports: tuple[int, int] | None
    failovers: int
    announce: Callable[[str], None]

    def db(self, make: Callable[[Any], Awaitable[Any]]) -> Coroutine[Any, Any, Any]:
        """``make(connection)`` on the control connection."""

    async def shared_keys(self) -> list[tuple[str, bytes]]:
        """The cluster's shared data-plane keys still accepted (read first when none was yet)."""

    def redirect(self, shard: int, role: str, msg: Any) -> Moved | None:
        """A shard server's check: a worker of another pool, or a submit of another shard, is moved."""

    def spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        """Run ``coro`` in a task of the host's (its stop cancels them)."""


class ShardCores:
    """The cores of the shards a cluster host serves (module docstring).

    Args:
        host: the cluster host they serve for.
    """

    def __init__(self, host: Host) -> None:
        self.host = host
        self.servers: dict[int, CoordinatorServer] = {}
        self.refs: dict[int, RemoteRefs] = {}  # each served shard's reader of remote upstreams (remote_refs.py)
        self.moving: set[int] = set()  # held slots being stopped (given back or lost)
        self.starting: set[int] = set()
        self.unreleased: set[int] = set()  # the slots whose release a cancelled task left: stop_all() makes it
        self._stores: dict[int, ShardPgStore] = {}  # each served shard's store (its fence is cleared when it is lost)
        self._ports: dict[int, int] = {}  # shard -> the port of --shard-ports its core took
        # Each shard's core being stopped (_core_stopped) -> its shard: never cancelled, stop_all() waits for them.
        self._shard_stops: dict[asyncio.Future[None], int] = {}

    def serves(self, shard: int) -> CoordinatorServer | None:
        """``shard``'s server while it serves it (neither being stopped nor not yet started)."""
        server = self.servers.get(shard)
        return server if server is not None and shard not in self.moving else None

    async def start(self, shard: int, epoch: int) -> None:
        """Won ``shard``: open its store, load its plans into a new core, listen, publish its URL."""
        host = self.host
        self.starting.add(shard)
        started = time.monotonic()
        try:
            # Its connections say which core they are (pg_stat_activity; bench/cluster_chaos.py's checker).
            dsn = _with_application_name(host.settings.store, f"fw/{shard}/{epoch}/{host.owner}")
            store = await opened(lambda: ShardPgStore(dsn, host.settings.cluster), host.leftovers, host.closer,
                                 host.opener)  # fmt: skip
        except asyncio.CancelledError:
            self._start_cancelled(shard, epoch)
            raise
        except Exception as exc:
            await self._give_back(shard, exc)
            return
        server: CoordinatorServer | None = None
        try:
            store.owner, store.fence = host.owner, {shard: epoch}
            store.doorbell = host.doorbell
            store.threads = host.opener  # its committer's hand-over of the threaded writer (teardown.py)
            # Its core sees only its shard's pools: waiting reasons say so (coordinator/placement/plan_queue.py).
            core = replace(host.settings.core, placement=replace(host.settings.core.placement, cluster=True))
            settings = replace(host.settings, port=self._port(shard), metrics_listen=None, core=core)
            server = CoordinatorServer(settings, version=host.version, store=store, closer=host.closer,
                                       loader=host.opener,
                                       redirect=functools.partial(host.redirect, shard))  # fmt: skip
            server.core.data.set_shared(await host.shared_keys())  # before any worker: its keys include them
            refs = RemoteRefs(server, shard, host.views.conn)  # looks up remote upstreams from its first submit
            await server.start()
        except asyncio.CancelledError:  # stop() while the core starts: its store is closed once the load lets go
            close_after(store, server.loading if server is not None else None, host.leftovers, host.closer)
            self._start_cancelled(shard, epoch)
            raise
        except Exception as exc:
            # Its store is closed, not left open with its connections and thread: the slot is won again next round.
            await close_left(store, host.leftovers, host.closer)
            await self._give_back(shard, exc)
            return
        self.starting.discard(shard)
        self._stores[shard] = store
        if host.leases.held.get(shard) != epoch or host.stop_began:  # lost while loading
            self.servers[shard] = server
            await self.stop(shard, release=False, why="lost while loading")
            return
        self.servers[shard] = server
        self.refs[shard] = refs
        refs.start()  # the loop reads the restored consumers' remote upstreams
        await host.db(lambda conn: conn.execute(_SET_URL, server.url, shard, host.owner, epoch))
        assert server.fatal is not None
        server.fatal.add_done_callback(lambda f: self.failed(shard, f.result()))
        load_s = time.monotonic() - started
        host.stats.takeover.observe(load_s)
        host.loaded.set()
        log.info("serving shard", shard=shard, epoch=epoch, url=server.url, plans=len(server.core.plans),
                 load_s=round(load_s, 3))  # fmt: skip
        host.announce(f"serving shard {shard} (epoch {epoch}) at {server.url}, {len(server.core.plans)} plans "
                      f"loaded in {load_s:.3f} s")  # fmt: skip

    async def _give_back(self, shard: int, exc: Exception) -> None:
        """A won shard's core could not start: its slot is given back."""
        log.error("cannot serve a won shard; giving it back", shard=shard, error=f"{type(exc).__name__}: {exc}")
        self.starting.discard(shard)
        self._ports.pop(shard, None)
        self.host.leases.released([shard])
        try:
            with contextlib.suppress(Exception):
                await self.host.db(lambda conn: conn.fetch(RELEASE, self.host.owner, [shard]))
        except asyncio.CancelledError:
            self.unreleased.add(shard)  # the host's stop makes it (stop_all)
            raise

    def _start_cancelled(self, shard: int, epoch: int) -> None:
        """The host's stop cancelled ``shard``'s start before it served: the slot, still held at ``epoch``, is given
        back by :meth:`stop_all` (its core never served) instead of expiring after the lease's TTL."""
        self.starting.discard(shard)
        self._ports.pop(shard, None)
        held = self.host.leases.held.get(shard) == epoch
        if held:
            self.host.leases.released([shard])
            self.unreleased.add(shard)
        log.warning("a shard's start was cancelled by the host's stop", shard=shard, epoch=epoch,
                    release_left_to_the_stop=held)  # fmt: skip

    def lose(self, shards: list[int], why: str) -> None:
        """``shards``' leases are lost: no commit of theirs may succeed from now on, and their cores stop."""
        for shard in shards:
            store = self._stores.get(shard)
            if store is not None:
                store.fence = {}  # no commit of it may succeed from now on (the database checks too)
            if shard not in self.moving:
                self.moving.add(shard)
                self.host.spawn(self.stop(shard, release=False, why=why))

    def give_back(self, shard: int, why: str) -> None:
        """Stop ``shard``'s core and release its slot (a rebalance), unless it is starting or already stopping."""
        if shard in self.servers and shard not in self.moving and shard not in self.starting:
            self.moving.add(shard)
            self.host.spawn(self.stop(shard, release=True, why=why))

    def failed(self, shard: int, exc: BaseException) -> None:
        """A shard's core stopped on a store failure or a fenced commit: fail-stop for that shard only."""
        if isinstance(exc, ShardFenced):
            self.host.stats.fenced_commits += 1
            log.critical("shard lease lost (fenced): this shard stops here; another coordinator owns it",
                         shard=shard, error=str(exc))  # fmt: skip
        self.host.leases.released([shard])
        if shard not in self.moving:
            self.moving.add(shard)
            self.host.spawn(self.stop(shard, release=not isinstance(exc, ShardFenced), why=str(exc)))

    async def stop(self, shard: int, *, release: bool, why: str) -> None:
        """Stop ``shard``'s core (what is queued is committed first), then give its slot back.

        The shard is out of :attr:`servers` from here on, so nothing else would stop its core: that stop runs in a
        task of its own (:meth:`_core_stopped`), and a host's stop that cancels this (a loss's, a failure's, a
        rebalance's or a start's task) waits for it instead of leaving it cut short, its store open, and then makes
        the slot's release that the cancel left (:attr:`unreleased`; logged).
        """
        host = self.host
        server = self.servers.pop(shard, None)
        self._stores.pop(shard, None)
        refs = self.refs.pop(shard, None)
        try:
            await self._core_stopped(shard, refs, server)
            if release:
                async with asyncio.timeout(STOP_DB_S if host.stop_began else None):
                    await host.db(lambda conn: conn.fetch(RELEASE, host.owner, [shard]))
        except asyncio.CancelledError:
            if release:
                self.unreleased.add(shard)
            log.warning("a shard's stop was cancelled by the host's stop; the host's stop waits for its core's stop",
                        shard=shard, why=why, release_left_to_the_stop=release)  # fmt: skip
            raise
        except Exception as exc:
            log.warning("shard not released cleanly; it expires after the TTL", shard=shard, error=str(exc))
        finally:
            host.leases.released([shard])
            self.moving.discard(shard)
            self._ports.pop(shard, None)
        host.failovers += 0 if release else 1
        log.warning("stopped serving shard", shard=shard, released=release, why=why)
        host.announce(f"{'released' if release else 'lost'} shard {shard}: {why}")

    async def stop_all(self) -> None:
        """The host's stop, once it cancelled its tasks: stop every core (each flushed, then its slot released),
        wait for the cores' stops that the cancelled tasks began, and release the slots that those tasks left.

        The cores stop together, each within its own bounds (its acks' wait for pending commits, its committer's
        close, its release's :data:`~teardown.STOP_DB_S`): against a database that does not answer, N shards' stops
        take about one shard's, not N times it; one that fails is logged and the others' go on."""
        shards = sorted(self.servers)
        stops = [self.stop(shard, release=True, why="shutting down") for shard in shards]
        for shard, failure in zip(shards, await asyncio.gather(*stops, return_exceptions=True), strict=True):
            if isinstance(failure, BaseException):  # stop() logs its own; this one escaped it
                log.warning("a shard's stop failed", shard=shard, error=f"{type(failure).__name__}: {failure}")
        while self._shard_stops:  # each bounded as the stop's own shards' are (CoordinatorServer.stop)
            log.warning("waiting for the shard stops under way", shards=sorted(self._shard_stops.values()))
            await asyncio.wait(list(self._shard_stops))
        if not self.unreleased:
            return
        unreleased, owner = sorted(self.unreleased), self.host.owner  # flushed now: given back, as the stop's own
        try:
            async with asyncio.timeout(STOP_DB_S):
                await self.host.db(lambda conn: conn.fetch(RELEASE, owner, unreleased))
        except Exception as exc:
            log.warning("shards not released cleanly; they expire after the TTL", shards=unreleased,
                        error=f"{type(exc).__name__}: {exc}")  # fmt: skip

    async def _core_stopped(self, shard: int, refs: RemoteRefs | None, server: CoordinatorServer | None) -> None:
        """Stop ``shard``'s remote upstreams' reader and core in a task of its own (in :attr:`_shard_stops` until it
        ends): cancelled meanwhile, that stop goes on and :meth:`stop_all` waits for it."""
        if refs is None and server is None:
            return
        stopping = asyncio.ensure_future(_core_stop(refs, server))
        self._shard_stops[stopping] = shard
        stopping.add_done_callback(self._shard_stops.pop)
        try:
            await asyncio.shield(stopping)
        except asyncio.CancelledError:  # nobody awaits its end now: its failure is logged
            stopping.add_done_callback(functools.partial(_core_failed, shard=shard))
            raise

    def _port(self, shard: int) -> int:
        """The port ``shard``'s core listens on: 0 (any free one) without ``--shard-ports``, else the first
        free one of the range from ``first + shard`` on (a range of ``--shards`` ports: one stable port per shard).
        """
        if self.host.shard_ports is None:
            return 0
        low, high = self.host.shard_ports
        first = low + shard % (high - low + 1)
        taken = set(self._ports.values())  # this host's other shards, maybe not listening yet
        order: list[int] = [*range(first, high + 1), *range(low, first)]
        for port in order:
            if port not in taken and _bindable(self.host.settings.host, port):
                self._ports[shard] = port
                return port
        raise OSError(f"no free port in --shard-ports {low}-{high} for shard {shard}")


async def _core_stop(refs: RemoteRefs | None, server: CoordinatorServer | None) -> None:
    if refs is not None:
        await refs.stop()
    if server is not None:
        await server.stop()


def _core_failed(stopping: asyncio.Future[None], *, shard: int) -> None:
    failure = None if stopping.cancelled() else stopping.exception()
    if failure is not None:
        log.warning("a shard's core failed to stop cleanly", shard=shard, error=f"{type(failure).__name__}: {failure}")


def _with_application_name(dsn: str, name: str) -> str:
    """``dsn`` with ``application_name=name`` (PostgreSQL keeps 63 bytes of it): ``fw/<shard>/<epoch>/<owner>``."""
    parts = urlsplit(dsn)
    query = "&".join(p for p in parts.query.split("&") if p and not p.startswith("application_name="))
    query = "&".join(p for p in (query, "application_name=" + quote(name[:63], safe="")) if p)
    return urlunsplit((parts.scheme, parts.netloc, parts.path, query, parts.fragment))


def _bindable(host: str, port: int) -> bool:
    """Whether ``host:port`` can be listened on now (as asyncio's server binds it: SO_REUSEADDR)."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]  # fmt: skip
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind(address)
    except OSError:
        return False
    return True
