"""The PostgreSQL store of cluster mode (``--store postgresql://USER@HOST:PORT/DB``, docs/CLUSTER.md).

The same :class:`~coordinator.io.stores.store.Store` interface, record formats, group commit and
checksums as the SQLite store: one :meth:`PgStore.write` (or :meth:`PgStore.write_async`) is
one transaction, and the committer releases a group's frames only once it returned, so no frame
leaves before its records are durable (PostgreSQL ``synchronous_commit=on``, its default; with
a synchronous standby, on the standby too). The server's committer is the store's own
(:meth:`PgStore.make_committer`: coordinator/io/stores/pg_commit.py), which commits on the server's
event loop, pipelined, one group in flight at a time.

Driver: asyncpg (binary protocol, prepared statements, array parameters). A group commit is ONE
statement, so one round trip (coordinator/io/stores/pg_schema.py ``commit_statement``): the fence
and the group's deletes, inserts, updates and event upserts as parts of one ``WITH`` query, each
row kind's columns of one type sent as one array parameter (a slice per column, folded into rows of
~sqrt(n) values: pg_rows.py ``grid``) and unnested server-side. Phase 1's BEGIN, fence, one statement per kind and
COMMIT took 4-5 round trips. A big group the committer takes with nothing in flight goes as one
transaction of two statements instead (:meth:`PgStore._send_split`): its first third of plans, encoded
when it is taken, and the rest, encoded while the first is in flight.

Until :meth:`PgStore.open_async` (the committer's start) the
writer connection has its own event loop, run by the thread that calls (the loader, tests,
:meth:`PgStore.write` from a thread: :meth:`PgStore._run`); from then on the writer connection
lives on the server's loop and the threaded one is closed (two connections per store either
way). A thread with a running loop goes through a helper thread instead. The lease connection
lives on a private loop in its own thread (``fleetwire-pg``; :meth:`PgStore.execute`,
:meth:`PgStore.call`), so a long commit never delays a renewal. Both loops are uvloop when it is installed.

The tables, their migrations and indexes, and the commit statement are in
coordinator/io/stores/pg_schema.py.

Fencing: every write's statement starts with :data:`~coordinator.io.cluster.leases.FENCE` over the
shards it writes, with the epochs in :attr:`PgStore.fence` (set by the lease keeper), and each
of its data-modifying parts runs only when every one of them was found held, in the same
transaction; a lease that changed hands or expired fails the write with
:class:`~coordinator.io.cluster.leases.ShardFenced` and nothing of the group is applied.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import operator
import os
import threading
import warnings
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import unquote, urlsplit

import msgspec
import structlog

from coordinator.io.cluster.leases import ShardFenced
from coordinator.io.stores.abilities import StoreAbilities
from coordinator.io.stores.integrity import StoreDamaged, StoreError, StoreUnreachable
from coordinator.io.stores.pg_commit import PipelinedCommitter
from coordinator.io.stores.pg_rows import PgRows, RowGroup, grid, split_group
from coordinator.io.stores.pg_schema import (
    INDEX_VALID,
    INDEXES,
    PART_COLUMNS,
    SELECT_EVENTS,
    SELECT_PLANS,
    commit_statement,
    setup_schema,
)
from coordinator.io.stores.pg_usage import load_usage, usage_params
from coordinator.io.stores.rows import decode_plans, group_records
from coordinator.io.threads import in_thread
from coordinator.ledger import UsageRow
from coordinator.records import Record, StoredPlan, UsageRows
from coordinator.shards import ClusterConfig, SubmitShards
from protocol.messages import TERMINAL_STATES
from wireio.spin import Spin, window_from_env

__all__ = ["CONNECT_TIMEOUT_S", "LONE_SPIN_ENV", "LONE_SPIN_S", "SERVER_SETTINGS", "SPLIT_MIN_PLANS_ENV",
           "WRITER_SETTINGS", "PgStore", "PgStoreDamaged", "describe_dsn", "ensure_indexes", "lone_spin_from_env",
           "new_loop", "split_min_plans_from_env"]  # fmt: skip

log = structlog.get_logger(__name__)

T = TypeVar("T")

_KEY_BLOCK = 1024
_KEY_RESERVE = 16 * _KEY_BLOCK  # new keys taken beyond a group's needs (a few big groups' worth): _take_keys
_SPLIT_MIN_PLANS = 512  # a group the committer takes with nothing in flight, with more plans, goes in two: split_group
SPLIT_MIN_PLANS_ENV = "FLEETWIRE_PG_SPLIT_MIN_PLANS"  # a tuning knob for _SPLIT_MIN_PLANS (0: never split)
CONNECT_TIMEOUT_S = 10.0
COMMAND_TIMEOUT_S = 30.0  # a statement that hangs longer fails the write (fail-stop), never blocks forever
#: The asyncpg releases whose private protocol call ``bind_execute(state, args, portal, limit, return_extra, timeout)``
#: the store makes directly (:meth:`PgStore._fetch_held`); any other release runs its statements through the public
#: ``PreparedStatement.fetch`` (the same statements, ~15,000 more client instructions a lone commit).
PROTOCOL_CALL_RELEASES = ((0, 29), (0, 30), (0, 31), (0, 32))


def protocol_call_known(version: str) -> bool:
    """Whether asyncpg ``version`` (its ``__version__``) is one of :data:`PROTOCOL_CALL_RELEASES`."""
    parts = version.split(".")[:2]
    try:
        return (int(parts[0]), int(parts[1])) in PROTOCOL_CALL_RELEASES
    except (ValueError, IndexError):
        return False


# The lease and view connections plan every statement for its own parameters. Left to itself,
# after five runs PostgreSQL would switch a prepared statement to a generic plan made while
# fleetwire_plans was nearly empty (a hash join over a full scan for the UPDATE of a few plans by
# key) and keep it until an autoanalyze: a plan's terminal commit then cost ~2 ms at 10k plans and
# grew with the table (submit -> result p50 2.85x SQLite's in bench/cluster_throughput.py).
SERVER_SETTINGS = {"plan_cache_mode": "force_custom_plan"}  # PostgreSQL >= 12
# The writer connection runs the same few statements thousands of times a second: planning each
# one again (a custom plan) cost ~0.1-0.4 ms of every group commit's round trip. It keeps one
# generic plan per statement instead, made with sequential scans priced out, so the plan is the
# index one whatever the table held when it was made (every commit statement reaches its rows by
# key; the fence reads the lease rows through their primary key). A shard's load on the same
# connection turns sequential scans back on for its own transaction (it reads whole shards).
WRITER_SETTINGS = {"plan_cache_mode": "force_generic_plan", "enable_seqscan": "off"}

_KEYS = "SELECT nextval('fleetwire_plan_keys') FROM generate_series(1, $1::int)"

# A lone commit's wait (issue #29, docs/PERFORMANCE.md §C29l): after sending a group of one row a part the loop has
# nothing else to do until the reply (~0.2-0.4 ms: the server's executor and its WAL flush), and a loop asleep in
# epoll on a VM whose idle vCPU halts pays the vCPU's wake-up when the reply comes. The store's own busy-poll
# (wireio/spin.py's Spin, its own adaptive counts) polls the socket instead, for at most this window; it backs off
# when the replies come later than that, when the loop was busy anyway, or when others need the core. Off by default
# (0): on the shared 2-vCPU host it was not faster (§C29l: 1,000 µs with the contention back-off ignored, the lone
# commit's p50 +16 to +38 µs in 4 runs of 5 at load 3-12; with the back-off it seldom ran); a quiet host's figure is
# not measured yet.
LONE_SPIN_S = 0.0
LONE_SPIN_ENV = "FLEETWIRE_PG_SPIN_US"  # the window in µs (0: off)


_first = operator.itemgetter(0)  # a lone group's column -> its one value (_commit)


def lone_spin_from_env() -> float:
    """The lone commit's spin window :data:`LONE_SPIN_ENV` asks for, in seconds (:data:`LONE_SPIN_S` when unset; 0,
    with a warning, when it is not a number: wireio/spin.py ``window_from_env``)."""
    return window_from_env(LONE_SPIN_S, LONE_SPIN_ENV)


def split_min_plans_from_env() -> int:
    """The split threshold :data:`SPLIT_MIN_PLANS_ENV` asks for (:data:`_SPLIT_MIN_PLANS` when unset; 0: never split;
    the default, with a warning, when it is not a whole number >= 0)."""
    value = os.environ.get(SPLIT_MIN_PLANS_ENV)
    if value is None or not value.strip():
        return _SPLIT_MIN_PLANS
    try:
        plans = int(value)
    except ValueError:
        plans = -1
    if plans < 0:  # said, not silently dropped: the default, the process goes on
        warnings.warn(f"{SPLIT_MIN_PLANS_ENV}={value!r} is not a whole number of plans >= 0: the default "
                      f"{_SPLIT_MIN_PLANS} is used", stacklevel=2)  # fmt: skip
        return _SPLIT_MIN_PLANS
    return plans


def new_loop() -> asyncio.AbstractEventLoop:
    """The store's private loop: uvloop when installed (asyncpg's own choice; ~2x less CPU per round trip)."""
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a fleetwire dependency (not on Windows)
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


class PgStoreDamaged(StoreDamaged):
    """Plans in the PostgreSQL store fail their checksums (exit 3 like a damaged SQLite file)."""

    def __init__(self, description: str, problem: str) -> None:
        StoreError.__init__(
            self, f"the store {description} is damaged: {problem}; start with --accept-store-loss to serve without "
                  "the damaged plans (they are left in the database)"
        )
        self.path = Path(description)
        self.problem = problem


async def ensure_indexes(conn: Any) -> list[str]:
    """Build versions 3 and 4's :data:`INDEXES` concurrently where missing or invalid; the names of those built.

    ``conn``: an asyncpg connection of its own, outside any transaction (commits go on meanwhile).
    An index left invalid by an interrupted build (``IF NOT EXISTS`` would keep it) is dropped first.
    """
    built = []
    for name, on in INDEXES.items():
        valid = await conn.fetchval(INDEX_VALID, name)
        if valid:
            continue
        if valid is not None:
            await conn.execute(f"DROP INDEX CONCURRENTLY IF EXISTS {name}", timeout=None)
        await conn.execute(f"CREATE INDEX CONCURRENTLY IF NOT EXISTS {name} ON {on}", timeout=None)
        built.append(name)
    return built


def describe_dsn(dsn: str) -> tuple[str, str]:
    """``(description, host:port)`` of a DSN: the description without the password.

    A multi-host DSN (``postgresql://u@h1:p1,h2:p2/db?target_session_attrs=read-write``, what
    a database failover needs: docs/CLUSTER.md) names every host: ``h1:p1,h2:p2``.
    """
    parts = urlsplit(dsn)
    netloc = parts.netloc.rpartition("@")[2]
    places = []
    for item in netloc.split(",") if "," in netloc else [None]:
        one = parts if item is None else urlsplit(f"{parts.scheme}://{item}")
        host = one.hostname or "localhost"
        try:
            port = one.port or 5432
        except ValueError:
            raise StoreError(f"bad PostgreSQL DSN {parts.scheme}://{host}...: the port is not a number") from None
        places.append(f"[{host}]:{port}" if ":" in host else f"{host}:{port}")
    user = f"{unquote(parts.username)}@" if parts.username else ""
    where = ",".join(places)
    return f"postgresql://{user}{where}{parts.path}", where


def _cause(exc: BaseException) -> str:
    """One line saying why a connection failed."""
    if isinstance(exc, ConnectionRefusedError):
        return "connection refused (is PostgreSQL running and listening there?)"
    if isinstance(exc, TimeoutError):
        return f"no answer within {CONNECT_TIMEOUT_S:g} s"
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text[:300]


class PgStore(PgRows):
    """Plans in PostgreSQL, shared by the coordinators of one cluster; one transaction per :meth:`write`.

    Args:
        dsn: ``postgresql://USER[:PASSWORD]@HOST[:PORT]/DB`` (libpq's URI form; ``PGPASSWORD`` and
            ``~/.pgpass`` work as with psql).
        cluster: the cluster's name, shard count and lease timings.
        accept_loss: plans failing their checksums are left out of :meth:`load` (and listed in
            :attr:`losses`) instead of refusing to start.

    Attributes:
        fence: shard -> epoch of every shard this coordinator holds (the lease keeper sets it);
            each write checks the shards it writes against it. Empty: every write is refused.
        owner: the lease owner id the fence is checked for (the lease keeper sets it).
        losses: what ``accept_loss`` left out.

    Raises:
        StoreError: asyncpg is missing, the database cannot be reached or refuses the login
            (one line naming the host and the cause), or it belongs to another cluster, has
            another shard count or a newer schema.
    """

    blocking = True
    sharded = True  # the server keeps this store's shard leases (``abilities.leases``); not a shard's own store
    # The threads open_async closes the threaded writer in (None: the loop's default executor); a cluster host's shard
    # stores: the host's own (coordinator/io/cluster/teardown.py, "Started in the host's own threads").
    threads: concurrent.futures.Executor | None = None
    # The groups apply_committed applied, in order, while a writer child's committer keeps this list (pg_writer.py:
    # each side's keys go to the other); None: not kept.
    applied: list[RowGroup] | None = None

    def __init__(self, dsn: str, cluster: ClusterConfig | None = None, *, accept_loss: bool = False) -> None:
        self.cluster = cluster or ClusterConfig()
        self._submit_shard = SubmitShards(self.cluster.shards, self.cluster.partitions)  # each new row's shard
        self.description, self.where = describe_dsn(dsn)
        self.closed = False
        self.accept_loss = accept_loss
        self.losses: list[str] = []
        self.fence: dict[int, int] = {}
        self._usage: list[UsageRows] = []  # the ledger's rows gathered, for the next whole group's send (pg_usage.py)
        self.owner = ""  # this process run's lease owner id (the lease keeper sets it)
        self.writes = 0
        self.records = 0
        self._encoder = msgspec.msgpack.Encoder()
        self._keys: dict[str, int] = {}  # plan id -> key of every plan held
        self._shards: dict[str, int] = {}  # plan id -> its shard
        self._events_crc: dict[str, int] = {}  # running checksum of each open plan's inline events
        # Taken from the sequence, not used yet: descending, the next key last, so that taking n keys is O(n) (a
        # slice of the ~16,000 left copied them all at each group: ~80 us of a lone commit's CPU; §C29j).
        self._free_keys: list[int] = []
        self._ahead: RowGroup | None = None  # the group encode_ahead made, until its write_async
        self.split_min_plans = split_min_plans_from_env()  # encode_ahead(split=True) splits bigger groups (0: never)
        self.splitting = False  # the group encode_ahead made is split: its rest is encoded in write_async
        self.on_encoded: Callable[[], None] | None = None  # called once a split group's rest is on its way (committer)
        self.lone_spin = Spin(lone_spin_from_env())  # the busy-poll while a lone commit is in flight (LONE_SPIN_S)
        self._prepared: dict[str, tuple[Any, Any]] = {}  # commit statement text -> _prepare's, on _prepared_conn
        self._prepared_conn: Any = None
        self._protocol: Any = None  # _prepared_conn's protocol (None: its statements run as PreparedStatement)
        try:
            import asyncpg  # type: ignore[import-untyped]
        except ImportError:
            raise StoreError(
                "a postgresql:// store needs the asyncpg driver: pip install 'fleetwire[postgres]'"
            ) from None
        self._asyncpg = asyncpg
        self._loop = new_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="fleetwire-pg", daemon=True)
        self._thread.start()
        # The writer connection's own loop, run by whichever thread writes (the committer's writer
        # thread): a group commit is one round trip with no hop to another thread and back.
        self._wloop = new_loop()
        self._wlock = threading.Lock()
        self._writer: Any = None
        self._awriter: Any = None  # the writer connection on the server's loop (open_async)
        self._async = False  # open_async was called: writes go through _awriter from then on
        self._dsn = dsn
        self._leases: Any = None
        try:
            self._writer = self._run(self._connect(dsn, writer=True))
            self._leases = self._sync(self._connect(dsn))
            self._run(self._setup())
        except BaseException:
            self.close()
            raise

    @property
    def dsn(self) -> str:
        """The DSN this store connects with (its writer process connects with it too: pg_writer.py)."""
        return self._dsn

    @property
    def write_keys(self) -> tuple[dict[str, int], dict[str, int], dict[str, int]]:
        """Each plan's key, its shard and its inline events' chained checksum: what a writer child starts with, as
        this store loaded them (pg_writer.py)."""
        return self._keys, self._shards, self._events_crc

    @write_keys.setter
    def write_keys(self, value: tuple[dict[str, int], dict[str, int], dict[str, int]]) -> None:
        self._keys, self._shards, self._events_crc = value

    @property
    def abilities(self) -> StoreAbilities:
        """The losses accepted, a database that can be away, its own committer, and (``sharded``) shard leases."""
        return StoreAbilities(losses=self.losses, away=self.away, make_committer=self.make_committer,
                              leases=self if self.sharded else None, usage=self.load_usage)  # fmt: skip

    # ------------------------------------------------------------------ the private loop

    def _sync(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run ``coro`` on the store's loop and wait for it (from any thread but that loop's)."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run ``coro`` (which uses the writer connection) on the writer's loop, in this thread.

        From a thread that runs a loop of its own (a store opened or closed from a coroutine),
        it runs in a helper thread instead; one thread at a time either way.
        """
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            with self._wlock:
                return self._wloop.run_until_complete(coro)
        with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="fleetwire-pg-writer") as helper:
            return helper.submit(self._run, coro).result()

    def execute(self, make: Callable[[Any], Awaitable[T]]) -> T:
        """``make(lease_connection)`` run on the store's loop; its result (blocks: not from a loop)."""

        async def run() -> T:
            return await make(self._leases)

        return self._sync(run())

    def call(self, make: Callable[[Any], Awaitable[T]]) -> asyncio.Future[T]:
        """``make(lease_connection)`` run on the store's loop, as a future of the calling loop."""

        async def run() -> T:
            return await make(self._leases)

        return asyncio.wrap_future(asyncio.run_coroutine_threadsafe(run(), self._loop))

    async def _connect(self, dsn: str, *, writer: bool = False) -> Any:
        asyncpg = self._asyncpg
        try:
            return await asyncpg.connect(dsn, timeout=CONNECT_TIMEOUT_S, command_timeout=COMMAND_TIMEOUT_S,
                                         server_settings=WRITER_SETTINGS if writer else SERVER_SETTINGS)
        except (OSError, TimeoutError, asyncpg.PostgresError, asyncpg.InterfaceError) as exc:
            raise StoreUnreachable(f"cannot connect to PostgreSQL at {self.where}: {_cause(exc)}") from None

    async def _setup(self) -> None:
        """Create or migrate the schema; check the version, the cluster's name and its shard count (pg_schema.py)."""
        try:
            await setup_schema(self._writer, self.cluster, self.description)
        except self._asyncpg.PostgresError as exc:
            raise StoreError(f"cannot set up the fleetwire schema at {self.description}: {_cause(exc)}") from None

    # ------------------------------------------------------------------ the Store interface

    def load(self) -> list[StoredPlan]:
        """Every plan of the shards in :attr:`fence` (all shards when it is empty), in submit order."""
        shards = sorted(self.fence) or list(range(self.cluster.shards))
        try:
            rows, event_rows = self._run(self._fetch(shards))
        except self._asyncpg.PostgresError as exc:
            raise StoreError(f"cannot read the store {self.description}: {_cause(exc)}") from exc
        plan_rows = [tuple(r)[:11] for r in rows]
        keep: dict[str, int] = {}
        plans, damaged = decode_plans(plan_rows, event_rows, keep_crc=keep)
        if damaged:
            if not self.accept_loss:
                more = f" (and {len(damaged) - 1} more)" if len(damaged) > 1 else ""
                raise PgStoreDamaged(self.description, next(iter(damaged.values())) + more)
            self.losses.extend(f"{self.description}: {what}; the plan was left out" for what in damaged.values())
        bad = set(damaged)
        for r in rows:  # no inline events yet (events_crc NULL): their chain starts at 0, as _new_rows keeps it
            if r[10] is None and r[3] not in TERMINAL_STATES and r[0] not in bad:
                keep[r[1]] = 0
        self._events_crc = keep
        self._ahead, self.splitting = None, False
        self._keys = {r[1]: r[0] for r in rows if r[0] not in bad}
        self._shards = {r[1]: r[11] for r in rows if r[0] not in bad}
        return plans

    def load_usage(self) -> list[UsageRow]:
        """The usage ledger's rows of the shards in :attr:`fence` (its ``usage`` ability; pg_usage.py)."""
        shards = sorted(self.fence) or list(range(self.cluster.shards))
        try:
            return self._run(load_usage(self._writer, shards))
        except self._asyncpg.PostgresError as exc:
            raise StoreError(f"cannot read the usage ledger of {self.description}: {_cause(exc)}") from exc

    async def _fetch(self, shards: list[int]) -> tuple[list[Any], list[Any]]:
        conn = self._writer
        async with conn.transaction(isolation="repeatable_read", readonly=True):
            await conn.execute("SET LOCAL enable_seqscan = on")  # whole shards: see WRITER_SETTINGS
            plans = await conn.fetch(SELECT_PLANS, shards)
            events = await conn.fetch(SELECT_EVENTS, shards)
        return plans, events

    def write(self, records: Sequence[Record]) -> None:
        """Commit ``records`` as one transaction (blocking; the thread committer's path and tests)."""
        if self._writer is None:
            raise StoreError(f"the store {self.description} writes through its async committer now")
        self._run(self._write(self._writer, records))

    async def write_async(self, records: Sequence[Record]) -> None:
        """Commit ``records`` as one transaction on the caller's loop (:meth:`open_async` first).

        The async committer's path (coordinator/io/stores/pg_commit.py): no thread, one round trip.
        """
        assert self._awriter is not None, "open_async() first"
        await self._write(self._awriter, records)

    async def open_async(self, on_lost: Callable[[], None] | None = None) -> None:
        """Open the writer connection on the running loop (the server's) and close the threaded one.

        From then on :meth:`write_async` commits; :meth:`write` is refused. The connection count
        stays two per store (docs/CLUSTER.md, sizing). Called again after :meth:`lost` (the database
        went away: a failover), it opens a new connection; with a multi-host DSN
        (``target_session_attrs=read-write``) that reaches whichever host accepts writes now.
        ``on_lost`` is called (on the loop) when the connection closes under the store.

        Raises:
            StoreError: no host accepts the connection now.
        """
        old = self._awriter
        if old is not None and not old.is_closed():
            return
        conn = await self._connect(self._dsn, writer=True)
        if on_lost is not None:
            conn.add_termination_listener(lambda _conn: on_lost())
        self._awriter, self._async = conn, True
        if old is not None:
            old.terminate()
        threaded, self._writer = self._writer, None
        if threaded is not None:
            await in_thread(self.threads, lambda: self._close_writer(threaded))

    def lost(self) -> bool:
        """Whether the writer connection of :meth:`open_async` closed under the store (reopen it first)."""
        conn = self._awriter
        return self._async and (conn is None or conn.is_closed())

    def away(self) -> str | None:
        """Why this store cannot take a write now (its database connection is lost: a failover), else None.

        The server answers new submits ``unavailable`` and new handshakes 503 + Retry-After meanwhile.
        """
        if not self.lost() or self.closed:
            return None
        return f"the database {self.where} is away (the connection was lost; a failover?); reconnecting"

    async def close_async(self) -> None:
        """Close the writer connection of :meth:`open_async` (on its loop)."""
        conn, self._awriter = self._awriter, None
        if conn is not None:
            try:
                await asyncio.wait_for(conn.close(), 5)
            except Exception:
                conn.terminate()

    async def _write(self, conn: Any, records: Sequence[Record]) -> None:
        try:
            await self._write_group(conn, records)
        except ShardFenced:
            raise
        except (self._asyncpg.PostgresError, self._asyncpg.InterfaceError, OSError, TimeoutError) as exc:
            raise StoreError(f"cannot write the store {self.description}: {_cause(exc)}") from exc

    async def _write_group(self, conn: Any, records: Sequence[Record]) -> None:
        """One group: the rows it touches, :meth:`encode_rows`, the fence, :meth:`_commit`, :meth:`apply_committed`.

        A group :meth:`encode_ahead` made is sent as it is (its keys and checksums already applied);
        any other is encoded now and applied once its commit returned.
        """
        group = self._ahead
        if group is not None and group.records is records:
            self._ahead = None
            if group.rest is None:
                await self._send(conn, group)
            else:
                await self._send_split(conn, group, *group.rest)
            return
        group = self._gather(records)
        keys = await self._take_keys(conn, len(group.fresh_ids)) if group.fresh_ids else []
        if self.encode_rows(group, keys, {}):  # a chained checksum only the database holds: read, encoded again
            await self._encoded(conn, group, keys)
        await self._send(conn, group)
        self.apply_committed(group)

    async def _send_split(self, conn: Any, first: RowGroup, rest: RowGroup, keys: list[int]) -> None:
        """A split group (:meth:`encode_ahead`): ``first`` sent, ``rest`` encoded meanwhile and sent, one transaction.

        Both commit or neither (a failed statement rolls the transaction back; the first one's fence keeps
        its shards' lease rows locked until the commit). ``on_encoded`` is called once ``rest`` is encoded
        and its statement on its way: the committer may then encode the next group ahead.
        """
        loop = asyncio.get_running_loop()
        async with conn.transaction():
            sending = loop.create_task(self._send(conn, first, whole=False))
            try:
                await asyncio.sleep(0)  # the task writes the first statement; the rest is encoded meanwhile
                missing = self.encode_rows(rest, keys, {})
                await sending
                if missing:  # a chained checksum only the database holds: read now, in this transaction
                    await self._encoded(conn, rest, keys)
                self.apply_committed(rest)
                self.splitting = False
                sending = loop.create_task(self._send(conn, rest))
                await asyncio.sleep(0)
                if self.on_encoded is not None:
                    self.on_encoded()
                await sending
            except BaseException:
                self.splitting = False
                if not sending.done():  # the statement in flight ends before the rollback
                    await asyncio.gather(sending, return_exceptions=True)
                raise

    async def _encoded(self, conn: Any, group: RowGroup, fresh_keys: list[int]) -> None:
        """``group``'s rows (:meth:`encode_rows`); encoded again once the chained checksums that only the database
        holds are read (inline runs of plans whose checksum memory does not have)."""
        stored: dict[int, int] = {}
        missing = self.encode_rows(group, fresh_keys, stored)
        if missing:
            for key in missing:
                stored[key] = await self._stored_events_crc(conn, key)
            self.encode_rows(group, fresh_keys, stored)

    def encode_ahead(self, records: Sequence[Record], split: bool = False) -> bool:
        """Encode ``records``' group now, before the group in flight commits; False if it needs a round trip first.

        The pipelined committer's overlap (pg_commit.py, "Encoded ahead"): the group's new keys and
        chained checksums are applied at once, as if the groups before it had committed (any failure
        of theirs stops the committer, which then writes nothing more), so the next group encodes
        as it would after them. The next :meth:`write_async` of these same ``records`` sends it.
        Nothing is changed, and False returned, when the group needs the database first: more new
        keys than are free, or a plan's chained checksum that only the database holds.

        ``split`` (nothing is in flight: the committer's group taken in turn): a group of more than
        :attr:`split_min_plans` plans is split (pg_rows.py ``split_group``); only its first part is encoded now, the
        rest by :meth:`write_async` while the first part's statement is in flight (:meth:`_send_split`),
        and :attr:`splitting` says so until then.
        """
        group = self._gather(records)
        n, free = len(group.fresh_ids), self._free_keys
        if len(free) < n:
            return False
        keys = free[: -n - 1 : -1] if n else []  # the n lowest, ascending
        minimum = self.split_min_plans
        if split and minimum and len(records) > 2 * minimum and len(group.created) + len(group.latest) > minimum:
            (first, first_keys), rest = split_group(group, keys)
            group, keys, first.rest = first, first_keys, rest
        if self.encode_rows(group, keys, {}):
            return False
        if n:
            del free[-n:]
        self.apply_committed(group)
        self._ahead, self.splitting = group, group.rest is not None
        return True

    def _gather(self, records: Sequence[Record]) -> RowGroup:
        """The group's rows by plan, its forgotten plans' keys and shards, and the ids of its new rows."""
        created, latest, runs, forgotten = group_records(records, self._usage)
        keys, shards_of = self._keys, self._shards
        group = RowGroup(records, created, latest, runs, forgotten)
        if forgotten:  # else RowGroup's empty ones (no comprehension's frame for a lone group)
            group.doomed = [keys[p] for p in forgotten if p in keys]
            group.shards = {shards_of[p] for p in forgotten if p in shards_of}
        if created:
            group.fresh_ids = [p for p in created if p not in keys or p in forgotten]
        return group

    async def _send(self, conn: Any, group: RowGroup, *, whole: bool = True) -> None:
        """The group's fence (the shards it writes, against :attr:`fence` now) and its one statement.

        ``whole``: the group is counted in :attr:`writes` (False for a split group's first part).
        """
        touched_shards = group.shards | group.rows[4]
        usage = self._usage if whole and self._usage and self.fence else None
        parts = None  # (no lists made for a group without the ledger's rows)
        if usage is not None:  # the ledger's rows are the core's lowest shard's (pg_usage.py): fenced with it, and
            # the shards it deletes a key's rows from too (a stale owner of one must not delete its new owner's rows)
            parts = usage_params(sorted(self.fence), usage)  # the rows under the lowest shard, shards[0]
            touched_shards = touched_shards | {min(self.fence)}
            if parts[0]:  # usage_gone's shard column
                touched_shards = touched_shards | set(parts[0][0])
        if not touched_shards:
            touched_shards = set(self.fence)  # nothing to write: still proves the lease (no stale replies)
        fence = self.fence
        if not fence or not touched_shards <= fence.keys():  # (no set made when all are held)
            missing = sorted(touched_shards - fence.keys())
            raise ShardFenced(f"this coordinator does not hold shard(s) {missing or 'any'}; the write was refused")
        shards = sorted(touched_shards)
        rows = group.rows
        epochs = list(map(fence.__getitem__, shards))  # (no comprehension's frame)
        if usage is None:
            await self._commit(conn, shards, epochs, group.doomed, rows[0], rows[1], rows[2])
        else:  # at most once a tick: the ledger's rows as parts of the group's one statement, after its fence
            self._usage = []
            try:
                await self._commit(conn, shards, epochs, group.doomed, rows[0], rows[1], rows[2], parts)
            except BaseException:
                self._usage = usage + self._usage  # written by the next group, if the store goes on
                raise
        if whole:
            self.writes += 1
            self.records += len(group.records)

    async def _commit(
        self,
        conn: Any,
        shards: list[int],
        epochs: list[int],
        doomed: list[int],
        new_rows: list[list[Any]],
        upd_rows: list[list[Any]],
        ev_rows: list[list[Any]],
        usage: tuple[list[Any], list[Any]] | None = None,
    ) -> None:
        """The group's one statement (pg_schema.py ``commit_statement``) with these rows; ShardFenced if its fence
        failed (then it wrote nothing). ``usage``: the ledger's parts' parameters (pg_usage.py ``usage_params``),
        written under ``shards[0]``, the lowest of the fence's (:meth:`_send`)."""
        owner = self.owner
        one_shard = len(shards) == 1  # the fence's shard and epoch as scalars (commit_statement's one_shard)
        args: list[Any] = [shards[0], epochs[0], owner] if one_shard else [shards, epochs, owner]
        # Each part's columns of one type as one array parameter, a slice per column (pg_schema.py PART_COLUMNS);
        # a group of one row a part (a lone commit's) as scalar parameters (commit_statement's lone).
        if doomed:
            args.append(doomed)
        lone = len(new_rows[0]) < 2 and len(upd_rows[0]) < 2 and len(ev_rows[0]) < 2
        if lone:
            for rows in (new_rows, upd_rows, ev_rows):
                if rows[0]:
                    args += map(_first, rows)  # each column's one value (no comprehension's frame)
        else:
            for rows, counts in ((new_rows, PART_COLUMNS["created"]), (upd_rows, PART_COLUMNS["changed"]),
                                 (ev_rows, PART_COLUMNS["runs"])):  # fmt: skip
                if rows[0]:
                    start = 0
                    for count in counts:  # one array parameter a run of columns of one type
                        args.append(grid(rows[start : start + count]))
                        start += count
        parts = bool(doomed), bool(new_rows[0]), bool(upd_rows[0]), bool(ev_rows[0])
        if usage is None:
            sql = commit_statement(*parts, lone, one_shard)
        else:
            gone, kept = usage
            args += gone
            args += kept
            sql = commit_statement(*parts, lone, one_shard, bool(gone), bool(kept))
        spin = self.lone_spin
        if lone and spin.window_s:  # nothing else for the loop to do until the reply, most likely: poll awake
            spin.sent()
            try:
                held = await self._fetch_held(conn, sql, args)
            except BaseException:
                spin.stop()
                raise
            spin.received()
        else:
            held = await self._fetch_held(conn, sql, args)
        if len(held) != len(shards):
            lost = sorted(set(shards) - set(held))
            raise ShardFenced(
                f"the lease of shard(s) {lost} is no longer this coordinator's (owner {owner}, epochs "
                f"{sorted(set(epochs))}): another coordinator took it over or it expired; the group commit "
                "was refused"
            )

    async def _fetch_held(self, conn: Any, sql: str, args: list[Any]) -> Any:
        """The commit statement ``sql`` run with ``args`` on ``conn``: the shards its fence found held.

        Through a statement the store prepared itself (:attr:`_prepared`, one set a connection), run by asyncpg's
        protocol directly (``bind_execute``, as ``PreparedStatement`` runs it): ``Connection.fetchval``'s layers above
        it (the statement cache's look-up, the timeout's bookkeeping, three coroutines) and ``PreparedStatement``'s
        guards cost a lone commit ~19,800 instructions of its ~199,000 (docs/PERFORMANCE.md §C29l). The protocol
        still refuses a closed or busy connection (``InterfaceError``) and keeps the command timeout.

        A statement the server no longer holds as prepared (``DISCARD ALL``, ``DEALLOCATE``: a pooler's reset) or
        whose result type changed failed before it changed anything: outside a transaction it is prepared again and
        run once more (asyncpg's own cache retries the second case only); inside one (a split group's) the
        transaction is void, so it is raised, as any failed commit.
        """
        prepared = self._prepared
        if self._prepared_conn is not conn:  # a new connection (open_async, a reconnect): its own statements
            prepared.clear()
            self._prepared_conn = conn
            # asyncpg's protocol object and a statement's state are private to it (as PreparedStatement uses them);
            # read with a default and only for the releases the call is known in (PROTOCOL_CALL_RELEASES), so that
            # with another asyncpg they run through PreparedStatement.fetch instead.
            known = protocol_call_known(getattr(self._asyncpg, "__version__", ""))
            self._protocol = getattr(conn, "_protocol", None) if known else None
        entry = prepared.get(sql)
        if entry is None:
            entry = prepared[sql] = await self._prepare(conn, sql)
        asyncpg = self._asyncpg
        try:
            rows = await self._bind_execute(entry, args)
        except (asyncpg.exceptions.InvalidCachedStatementError, asyncpg.exceptions.InvalidSQLStatementNameError):
            del prepared[sql]
            if conn.is_in_transaction():
                raise
        except asyncpg.exceptions.OutdatedSchemaCacheError:  # a type's codec changed: asyncpg's caches first
            del prepared[sql]
            await conn.reload_schema_state()
            raise
        else:
            return rows[0][0] if rows else None
        entry = prepared[sql] = await self._prepare(conn, sql)
        rows = await self._bind_execute(entry, args)
        return rows[0][0] if rows else None

    async def _prepare(self, conn: Any, sql: str) -> tuple[Any, Any]:
        """``sql`` prepared on ``conn``: the statement and its protocol state (None: run it as PreparedStatement)."""
        stmt = await conn.prepare(sql)
        return stmt, getattr(stmt, "_state", None) if self._protocol is not None else None

    def _bind_execute(self, entry: tuple[Any, Any], args: list[Any]) -> Awaitable[list[Any]]:
        """A statement of :meth:`_prepare` run with ``args``: its rows (the protocol's call, no frame of ours)."""
        stmt, state = entry
        if state is None:
            return stmt.fetch(*args)  # type: ignore[no-any-return]
        return self._protocol.bind_execute(state, args, "", 1, False, COMMAND_TIMEOUT_S)  # type: ignore[no-any-return]

    async def _take_keys(self, conn: Any, n: int) -> list[int]:
        if n == 0:
            return []
        free = self._free_keys
        if len(free) < n:  # blocks for these and a reserve, so the next groups can be encoded ahead (encode_ahead)
            blocks = -(-(n - len(free) + _KEY_RESERVE) // _KEY_BLOCK)
            starts = await conn.fetch(_KEYS, blocks)
            for row in starts:
                free += range(row[0], row[0] + _KEY_BLOCK)
            free.sort(reverse=True)  # the list is descending (the sequence's later blocks are higher anyway)
        taken = free[: -n - 1 : -1]  # the n lowest, ascending
        del free[-n:]
        return taken

    async def _stored_events_crc(self, conn: Any, key: int) -> int:
        value = await conn.fetchval("SELECT events_crc FROM fleetwire_plans WHERE key = $1", key)
        return int(value) if value is not None else 0

    def make_committer(
        self, release: Callable[[T], None], on_failure: Callable[[BaseException], None], *, max_backlog_bytes: int = 0
    ) -> PipelinedCommitter[T]:
        """The server's committer for this store: group commits on the server's own loop (pg_commit.py), or, with
        ``FLEETWIRE_PG_WRITER=process``, in a writer process, lone ones on the loop (pg_writer.py)."""
        from coordinator.io.stores.pg_writer import ProcessCommitter, writer_mode  # it imports this module's types

        if writer_mode() == "process":
            return ProcessCommitter(self, release, on_failure, max_backlog_bytes=max_backlog_bytes)  # type: ignore[return-value]
        return PipelinedCommitter(self, release, on_failure, max_backlog_bytes=max_backlog_bytes)

    def ring(self, records: Sequence[Record]) -> None:
        """Told of each group a writer child committed (pg_writer.py): nothing here; a shard's store rings the
        cluster's doorbell (coordinator/io/cluster/cores.py ``ShardPgStore``)."""

    def apply_committed(self, group: RowGroup) -> None:
        """pg_rows.py's, and the group kept in :attr:`applied` while a writer child's committer reads it."""
        super().apply_committed(group)
        applied = self.applied
        if applied is not None:
            applied.append(group)

    def _close_writer(self, writer: Any) -> None:
        """Close the threaded writer connection (waits for a write in progress, up to 5 s)."""
        if self._wlock.acquire(timeout=5):  # a write in progress (the committer's last group) ends first
            self._wlock.release()
            try:
                self._run(asyncio.wait_for(writer.close(), 5))
            except Exception:
                writer.terminate()
        else:  # a write hangs (the database is away): drop the connection
            writer.terminate()

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        loop = getattr(self, "_loop", None)
        if loop is None:
            return
        writer, leases = self._writer, self._leases
        if leases is not None:
            try:
                self._sync(asyncio.wait_for(leases.close(), 5))
            except Exception:
                leases.terminate()
        loop.call_soon_threadsafe(loop.stop)
        self._thread.join(10)
        if not self._thread.is_alive():
            loop.close()
        if writer is not None:
            self._close_writer(writer)
        if self._awriter is not None:  # the async committer did not close it (a failure): drop it
            self._awriter.terminate()
            self._awriter = None
        if not self._wlock.locked():
            self._wloop.close()
