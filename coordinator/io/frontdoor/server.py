"""The asyncio driver around the sans-I/O ``Coordinator`` core.

Theory of operation: every websocket connection gets a ``conn_id`` and a ``Session``.
The connection's reader decodes a frame, feeds each message to the core with ``now``
and then *flushes*: the effects the core accumulated (messages per connection, closes)
are appended to each target session's pending list and its writer is woken. One writer
task per connection sends whatever is pending as a single frame, so frames to one
connection are coalesced while a send is in flight. Timers (the reaper) live here, never
in the core. Authentication happens in ``process_request``, before the upgrade
(docs/PROTOCOL.md §Handshake): 401 for a missing or wrong token, 403 for a token of the
other role or a foreign browser Origin, 503 at the connection limit, 429 in the penalty
box after an abusive close, 404 for an unknown path (coordinator/auth.py ``Gatekeeper``).
Limits that need a clock or a socket live here (coordinator/limits.py has the rules): each
reader charges its token bucket and pauses or closes 4429; a session whose pending list is
already at the cap when more arrives is closed 4503 (slow consumer); ``reload_tokens``
(SIGHUP) closes revoked tokens' sessions 4401.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import secrets
import socket
import ssl
import time
import traceback
from collections.abc import Callable, Coroutine, Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal
from urllib.parse import urlsplit

import msgspec
import structlog
from websockets.asyncio.server import Server, ServerConnection
from websockets.exceptions import ConnectionClosed
from websockets.http11 import Request, Response
from websockets.typing import Subprotocol

from coordinator.auth import TokenFileError, TokenStore, inline_tokens
from coordinator.core import Coordinator, CoreConfig, Effects
from coordinator.io.cluster.leases import LeaseKeeper, ShardFenced
from coordinator.io.frontdoor import routes as http_routes
from coordinator.io.frontdoor.connection import Session, close_or_abort
from coordinator.io.frontdoor.gate import Gatekeeper, peer_identity, server_tls_context, subprotocol_refused
from coordinator.io.ops.hooks import HookRunner
from coordinator.io.ops.metrics import CONTENT_TYPE, build_registry, render
from coordinator.io.ops.metrics_http import ExpositionCache, MetricsListener, parse_listen
from coordinator.io.ops.provision import Provider, Provisioner
from coordinator.io.stores.commit import GroupCommitter
from coordinator.io.stores.integrity import report_accepted_losses
from coordinator.io.stores.pg_commit import PipelinedCommitter
from coordinator.io.stores.store import Store, open_store
from coordinator.limits import CostBuckets, Limits
from coordinator.records import StoredPlan
from coordinator.shards import ClusterConfig
from coordinator.stats import FrameCounters
from protocol import SUBPROTOCOL_JSON, SUBPROTOCOL_MSGPACK, SUBPROTOCOLS, Codec, Encoding
from protocol import errors as codes
from protocol.chunkview import with_chunk_views
from protocol.messages import Assign, Error, FromClient, FromWorker, Moved, Submit
from protocol.relay import MAX_CHUNK_BYTES
from protocol.urls import named_worker_id

log = structlog.get_logger(__name__)

Role = Literal["worker", "client"]
ROLE_PATHS: dict[str, Role] = {"/v1/worker": "worker", "/v1/client": "client"}
LOOPBACK_HOSTS = frozenset({"127.0.0.1", "localhost", "::1"})
STANDBY = "standby: owns no shard (another coordinator of the cluster serves; this one takes over when its lease ends)"
REPLAY_BACKLOG_BYTES = 1 << 20  # a replay's next slice waits while its subscriber has more than this unsent
UNAVAILABLE_RETRY_S = 1.0  # the retry_after_s of an ``unavailable`` answer (the store is away)
# Closes the core asks for that put the peer in the penalty box (gate.py): repeated protocol errors, and a
# worker id past its reconnect budget (coordinator/reconnects.py), so its reconnect loop costs a 429, not a session.
_CORE_PENALIZED = frozenset({codes.CLOSE_PROTOCOL, codes.CLOSE_RATE_LIMITED})
LOADING = "loading the store"  # /readyz's reason (503) until the store's plans are loaded


@dataclass(frozen=True)
class ServerSettings:
    """Everything the coordinator process is configured with.

    Attributes:
        host: interface to bind; loopback by default.
        port: TCP port; 0 picks a free one (read ``CoordinatorServer.port`` after start).
        worker_tokens: bearer tokens accepted on ``/v1/worker``.
        client_tokens: bearer tokens accepted on ``/v1/client``.
        insecure: accept connections without tokens (only allowed on loopback).
        core: the core's settings (coordinator/core.py ``CoreConfig``): heartbeat interval and
            timeout (told to workers in ``welcome``; the reaper drops a worker whose last beat
            is older than the timeout), the reaper's circuit breaker, the plan quota per client
            principal and the per-plan event bounds, placement, the autoscaler (None: none) and
            plan retention. The server fills in only ``version``.
        reaper_interval_s: how often the reaper runs; defaults to a tenth of the heartbeat
            timeout (at most 1 s), so detection takes at most timeout + interval.
        max_frame_bytes: largest accepted frame (larger closes that connection with 1009).
        admin_tokens: bearer tokens of the ``admin`` role (``/v1/client``, sees every plan).
        token_file: a TOML token file (coordinator/auth.py); reloaded by ``reload_tokens``.
        tls_cert / tls_key: serve ``wss://`` with this PEM certificate chain and key.
        tls_client_ca: require worker client certificates signed by this CA (mTLS).
        limits: rate, size, connection and buffer limits (coordinator/limits.py).
        autoscale_hook: a shell command run with each autoscaler decision as JSON on stdin
            (needs ``core.autoscale``).
        ping_workers: send websocket keepalive pings (``limits.ping_interval_s``) on
            ``/v1/worker`` sessions too. Off by default: a worker heartbeats and the reaper
            closes a silent one 4408 after the heartbeat timeout, which covers a half-open
            worker connection; with 10,000 workers the pings were ~40 % of the steady CPU
            (docs/PERFORMANCE.md). Client sessions are always pinged (docs/OPERATIONS.md §Test matrix row 22).
    """

    host: str = "127.0.0.1"
    port: int = 8765
    worker_tokens: tuple[str, ...] = ()
    client_tokens: tuple[str, ...] = ()
    insecure: bool = False
    core: CoreConfig = field(default_factory=CoreConfig)
    reaper_interval_s: float | None = None
    max_frame_bytes: int = 1 << 20
    store: str = "memory"  # coordinator/io/stores/store.py: "memory", "sqlite" (in data_dir) or "sqlite:PATH"
    data_dir: str | None = None  # where "sqlite" keeps its file; default coordinator.io.stores.store.default_data_dir()
    cluster: ClusterConfig = ClusterConfig()  # noqa: RUF009 - frozen; cluster mode (a postgresql:// store) only
    accept_store_loss: bool = False  # a damaged store starts from what is readable (coordinator/io/stores/integrity.py)
    ping_workers: bool = False
    admin_tokens: tuple[str, ...] = ()
    token_file: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_client_ca: str | None = None
    limits: Limits = Limits()  # noqa: RUF009 - frozen, so one shared default is safe
    autoscale_hook: str | None = None
    autoscale_provider: Provider | None = None  # starts and stops workers (coordinator/io/ops/provision.py)
    metrics_cache_s: float = 2.0  # /metrics is rebuilt at most this often (coordinator/io/ops/metrics_http.py)
    metrics_token: str | None = None  # /metrics needs this bearer token when set
    metrics_listen: str | None = None  # HOST:PORT: /metrics on its own socket (404 on the main port)

    def check(self) -> None:
        """Raise ``ValueError`` with an actionable message when the settings cannot work."""
        core = self.core
        if core.heartbeat_interval_s <= 0 or core.heartbeat_timeout_s <= 0:
            raise ValueError("heartbeat interval and timeout must be positive seconds")
        if core.heartbeat_timeout_s < core.heartbeat_interval_s:
            raise ValueError(
                f"heartbeat timeout ({core.heartbeat_timeout_s} s) must be at least the interval "
                f"({core.heartbeat_interval_s} s), or every worker would be reaped between beats"
            )
        if self.insecure:
            if self.host not in LOOPBACK_HOSTS:
                raise ValueError(f"--insecure is only allowed on a loopback address, not {self.host!r}")
        elif self.token_file is None and (not self.worker_tokens or not (self.client_tokens or self.admin_tokens)):
            raise ValueError(
                "refusing to start without tokens: pass --token-file, or set FLEETWIRE_WORKER_TOKEN and "
                "FLEETWIRE_CLIENT_TOKEN (or --worker-token/--client-token), or pass --insecure on a loopback address"
            )
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("TLS needs both --tls-cert and --tls-key")
        if self.tls_client_ca is not None and self.tls_cert is None:
            raise ValueError("--tls-client-ca (mTLS) needs TLS: pass --tls-cert and --tls-key too")
        self.limits.check()
        for name in ("max_plans_per_client", "max_event_bytes_per_plan"):
            if getattr(core, name) < 0:
                raise ValueError(f"{name} must be >= 0 (0: no limit), got {getattr(core, name)}")
        if core.max_events_per_plan < 1:
            raise ValueError(f"max_events_per_plan must be >= 1, got {core.max_events_per_plan}")
        if not core.worker_reconnect_rate >= 0:
            raise ValueError(f"--worker-reconnect-rate must be >= 0 per second (0: no budget), "
                             f"got {core.worker_reconnect_rate}")
        if core.worker_reconnect_burst < 1:
            raise ValueError(f"--worker-reconnect-burst must be >= 1, got {core.worker_reconnect_burst}")
        if not 0 <= core.worker_reconnect_grace_s < float("inf"):
            raise ValueError(f"--worker-reconnect-grace-s must be >= 0 seconds, got {core.worker_reconnect_grace_s}")
        core.placement.check()
        if core.autoscale is not None:
            core.autoscale.check()
        elif self.autoscale_hook is not None:
            raise ValueError("--autoscale-hook needs the autoscaler: pass --autoscale too")
        elif self.autoscale_provider is not None:
            raise ValueError("--autoscale-provider needs the autoscaler: pass --autoscale too")
        if not self.metrics_cache_s >= 0:
            raise ValueError(f"--metrics-cache must be >= 0 seconds, got {self.metrics_cache_s}")
        if self.metrics_token is not None and len(self.metrics_token) < 16:
            raise ValueError("--metrics-token must be at least 16 characters")
        if self.metrics_listen is not None:
            parse_listen(self.metrics_listen)
        if self.store.startswith("postgresql://"):
            self.cluster.check()
        if not core.plan_retention_s >= 0:  # NaN too
            raise ValueError(f"--plan-retention must be >= 0 seconds (0 keeps every plan), got {core.plan_retention_s}")
        if core.plan_retention_bytes < 0:
            raise ValueError(f"--plan-retention-bytes must be >= 0 (0: no byte bound), got {core.plan_retention_bytes}")
        if core.relay_max_bytes < MAX_CHUNK_BYTES or core.relay_window_bytes < MAX_CHUNK_BYTES:
            raise ValueError(f"--relay-max-bytes (and the relay window) must be at least one chunk, {MAX_CHUNK_BYTES} "
                             f"bytes; got {core.relay_max_bytes}")
        for flag, share in (("--relay-principal-bytes", core.relay_principal_bytes),
                            ("--relay-session-bytes", core.relay_session_bytes)):
            if share and not MAX_CHUNK_BYTES <= share <= core.relay_max_bytes:
                raise ValueError(f"{flag} must be 0 (its default share) or from one chunk, {MAX_CHUNK_BYTES} bytes, "
                                 f"to --relay-max-bytes ({core.relay_max_bytes}); got {share}")
        if not core.relay_idle_s > 0:  # NaN too
            raise ValueError(f"--relay-idle must be > 0 seconds, got {core.relay_idle_s}")

    @property
    def reaper_period_s(self) -> float:
        if self.reaper_interval_s is not None:
            return self.reaper_interval_s
        return min(1.0, self.core.heartbeat_timeout_s / 10)


class CoordinatorServer:
    """Serves ``/v1/worker`` and ``/v1/client`` and drives a ``Coordinator`` core.

    Usage::

        server = CoordinatorServer(settings)
        await server.start()
        print(server.url)
        await server.serve_forever()   # or: await server.stop()
    """

    def __init__(self, settings: ServerSettings, *, version: str = "", store: Store | None = None) -> None:
        settings.check()
        self.settings = settings
        # Raises StoreError for a database that cannot be opened. ``store`` given: used as is (tests
        # hand the same MemoryStore to a second server to restart in-process).
        self.store: Store = store if store is not None else open_store(
            settings.store, settings.data_dir, accept_loss=settings.accept_store_loss, cluster=settings.cluster
        )
        # Cluster mode (a store with shard leases, coordinator/io/cluster/leases.py): serves only while
        # it holds the shards; a standby listens, answers /readyz 503, and takes over later.
        self.cluster: LeaseKeeper | None = None
        self._takeover: asyncio.Task[None] | None = None
        self._acquired = asyncio.Event()  # set when this coordinator holds every shard
        if getattr(self.store, "sharded", False):
            owner = f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(3)}"
            self.cluster = LeaseKeeper(self.store, settings.cluster, owner,  # type: ignore[arg-type]
                                       on_acquired=self._acquired.set, on_fenced=self._store_failed)  # fmt: skip
        # A store whose database can go away for a while (PostgreSQL failover) says why (PgStore.away): new
        # submits are then answered ``unavailable`` (retryable) and new handshakes 503 + Retry-After.
        self._away: Callable[[], str | None] | None = getattr(self.store, "away", None)
        # A store may bring its own committer (PostgreSQL: commits on this loop, coordinator/io/stores/pg_commit.py).
        make_committer = getattr(self.store, "make_committer", None)
        backlog = settings.limits.max_commit_backlog_bytes
        self._committer: GroupCommitter[Effects] | PipelinedCommitter[Effects] = (
            make_committer(self._deliver, self._store_failed, max_backlog_bytes=backlog)
            if make_committer is not None
            else GroupCommitter(self.store, self._deliver, self._store_failed, max_backlog_bytes=backlog)
        )
        self.fatal: asyncio.Future[BaseException] | None = None  # set when the store fails (fail-stop)
        self.core = Coordinator(
            replace(settings.core, version=version), new_id=lambda: secrets.token_hex(8),
            new_secret=lambda: secrets.token_urlsafe(24),  # welcome.session_secret: proof of a worker id
        )
        self._hook = HookRunner(settings.autoscale_hook) if settings.autoscale_hook else None
        self.provisioner: Provisioner | None = None  # acts on autoscaler decisions (coordinator/io/ops/provision.py)
        if settings.autoscale_provider is not None and settings.core.autoscale is not None:
            self.provisioner = Provisioner(
                settings.autoscale_provider, registry=self.core.registry, plans=self.core.plans,
                max_workers=settings.core.autoscale.max_workers, min_workers=settings.core.autoscale.min_workers,
                notify=self._autoscale_note, clock=time.monotonic, autoscaler=self.core.autoscaler,
            )
        # Raises TokenFileError (a ValueError) for a token file that cannot be used.
        tokens = inline_tokens(settings.worker_tokens, settings.client_tokens, settings.admin_tokens)
        self.tokens = None if settings.insecure else TokenStore(settings.token_file, tokens)
        self._tls: ssl.SSLContext | None = None
        if settings.tls_cert is not None and settings.tls_key is not None:
            self._tls = server_tls_context(settings.tls_cert, settings.tls_key, settings.tls_client_ca)
        self._gate = Gatekeeper(
            self.tokens,
            settings.limits,
            max_frame_bytes=settings.max_frame_bytes,
            mtls_workers=settings.tls_client_ca is not None,
        )
        self._background: set[asyncio.Task[None]] = set()  # closes the server started itself
        self._sessions: dict[int, Session] = {}
        self._held: dict[str, int] = {}  # open client sessions per principal (connection shares)
        self._costs = CostBuckets(settings.limits)  # work-unit buckets per principal (coordinator/limits.py)
        self._pumping = False  # a replay pump is scheduled (coordinator/streams.py ``pump``)
        self._conn_ids = itertools.count(1)
        # msgpack sessions decode relayed chunks as views into their frame (protocol/chunkview.py): a chunk
        # is checked and passed on without its bytes copied, and alone in a frame it is sent on as that frame.
        self._codecs: dict[tuple[Role, Encoding], Codec] = {
            (role, enc): Codec(enc, with_chunk_views(FromWorker if role == "worker" else FromClient, enc), role)
            for role in ("worker", "client")
            for enc in ("msgpack", "json")
        }
        self._server: Server | None = None
        self._reaper: asyncio.Task[None] | None = None
        # Set once the port is bound, and once the store's plans are loaded (start()); until then
        # /readyz answers 503 "loading the store" and websocket handshakes wait (_after_load).
        self.listening = asyncio.Event()
        self.loaded = asyncio.Event()
        self._loading: asyncio.Future[None] | None = None
        self.handshakes_waiting = 0  # websocket handshakes waiting for the load now
        self.handshake_waits = asyncio.Event()  # set whenever one starts waiting (tests wait on it)
        self._stopping = False
        self.port: int = settings.port
        # /metrics reads these at scrape time (coordinator/io/ops/metrics.py); see coordinator/io/frontdoor/routes.py.
        self.frames = FrameCounters()
        self.refusals: dict[str, int] = {}  # by answer: HTTP status before the upgrade, close code after
        self.unavailable_answers = 0  # submits answered ``unavailable`` while the store was away
        self.metrics_registry = build_registry(
            self.core, frames=self.frames, sessions=self._session_counts, refusals=self.refusals, version=version,
            gate=self._gate, provision=self.provisioner.status if self.provisioner is not None else None,
        )
        # A scrape walks every worker and plan: rebuilt at most every metrics_cache_s (ops/metrics_http.py).
        self.metrics_cache = ExpositionCache(lambda: render(self.metrics_registry), settings.metrics_cache_s)
        self._metrics_listener: MetricsListener | None = None
        # Cluster mode, one core per shard (coordinator/io/cluster/host.py): called with each
        # session's role and message; a ``Moved`` answer ends the session with it and 4307.
        self.redirect: Callable[[Role, Any], Moved | None] | None = None

    @property
    def url(self) -> str:
        host = self.settings.host
        if ":" in host:
            host = f"[{host}]"
        return f"{'wss' if self._tls is not None else 'ws'}://{host}:{self.port}"

    async def start(self) -> None:
        """Bind the port, load the store's plans, start the reaper; returns once the plans are loaded.

        The port opens first: while the store loads (a thread, off the event loop) ``/healthz``
        answers 200, ``/readyz`` and ``/metrics`` 503 "loading the store", and websocket
        handshakes wait for the load (up to 80 % of the handshake timeout, then 503 + Retry-After).
        A store found damaged while loading closes the port again and raises.
        """
        self.fatal = asyncio.get_running_loop().create_future()
        await self._listen()
        self.listening.set()
        # debug: a store refused while loading must stay the one line it prints (fleetwire/cli/store.py)
        log.debug("coordinator listening; loading the store", url=self.url, store=self.store.description)
        if self.cluster is not None:
            self.cluster.url = self.url
            await self.cluster.attempt()
            self.cluster.start()  # renews (an owner) or keeps trying (a standby) from here on
            if not self.cluster.serving:
                log.info("standby: another coordinator holds the shards; taking over when its lease expires",
                         cluster=self.settings.cluster.name, owner=self.cluster.owner)  # fmt: skip
                self._takeover = asyncio.create_task(self._take_over())
                return
        await self._load_and_serve()

    async def _take_over(self) -> None:
        """A standby: wait until this coordinator holds every shard, then load them and serve."""
        assert self.cluster is not None
        await self._acquired.wait()
        started = time.monotonic()
        try:
            await self._load_and_serve()
        except Exception as exc:  # a damaged store found at takeover: fail-stop, as a failed write
            self._store_failed(exc)
            return
        log.info("took the shards over", cluster=self.settings.cluster.name, owner=self.cluster.owner,
                 load_s=round(time.monotonic() - started, 3))  # fmt: skip

    async def _load_and_serve(self) -> None:
        """Load the store into the core, then commit, tick and admit sessions."""
        try:
            self._loading = asyncio.ensure_future(asyncio.to_thread(self._load))
            await asyncio.shield(self._loading)
        except BaseException:
            assert self._server is not None
            self._server.close()
            await self._server.wait_closed()
            raise
        self.core.counters["store_loss_accepted"] = report_accepted_losses(self.store)
        self._committer.start()
        self.loaded.set()
        self._rotate_data_key()
        self._flush()
        self._reaper = asyncio.create_task(self._reap_forever())
        if self.provisioner is not None:
            self.provisioner.start()  # min_workers, in the background
        log.info(
            "coordinator listening", url=self.url, insecure=self.settings.insecure, plans=len(self.core.plans),
            tokens=0 if self.tokens is None else len(self.tokens), mtls=self.settings.tls_client_ca is not None,
        )

    def _load(self) -> None:
        """Read the store and restore the core (in a thread: no session, tick or commit runs meanwhile)."""
        self.core.set_wall_offset(time.time() - time.monotonic())
        stream = getattr(self.store, "stream", None)  # SQLite: each plan as it is decoded
        if stream is not None:
            # Liveness clocks start now (docs/SEMANTICS.md §Durability): workers of restored leases
            # get one heartbeat timeout from here to reconnect.
            self.core.restore(stream(), time.monotonic())
            return
        stored = self.store.load()
        stored.reverse()

        def one_by_one() -> Iterator[StoredPlan]:
            # Each stored plan is let go as soon as it became a plan: the decoded records of every
            # plan alive at once, then freed all together, left the heap ~20 % larger after a
            # restart than before it for the same plans (bench/restart.py).
            while stored:
                yield stored.pop()

        self.core.restore(one_by_one(), time.monotonic())

    async def _listen(self) -> None:
        limits = self.settings.limits
        self._gate.fit_fd_limit(limits.max_connections)
        if self.settings.metrics_listen is not None:  # capped as the main port (ops/metrics_http.py)
            self._metrics_listener = MetricsListener(self.metrics_exposition, self.settings.metrics_token, self._gate)
            await self._metrics_listener.start(*parse_listen(self.settings.metrics_listen))
        # The gate's front door (gate.py serve): the pending-handshake budget, the handshake timeout,
        # TCP_DEFER_ACCEPT, no compression, the largest per-role frame limit (each connection gets its own).
        self._server = await self._gate.serve(
            self._handle,
            self.settings.host,
            self.settings.port,
            process_request=self._process_request,
            select_subprotocol=self._select_subprotocol,
            subprotocols=[Subprotocol(SUBPROTOCOL_MSGPACK), Subprotocol(SUBPROTOCOL_JSON)],
            ssl=self._tls,
        )
        sockets = list(self._server.sockets)
        if sockets:
            self.port = sockets[0].getsockname()[1]

    async def serve_forever(self) -> None:
        """Serve until cancelled."""
        assert self._server is not None, "call start() first"
        await self._server.serve_forever()

    async def stop(self) -> None:
        """Close every session with 1001 and stop listening."""
        self._stopping = True
        if self._reaper is not None:
            self._reaper.cancel()
        if self._server is not None:
            self._server.close()
            self._gate.pending.close()  # sockets still waiting for their first byte (admission.py)
            await self._server.wait_closed()
        if self._metrics_listener is not None:
            await self._metrics_listener.stop()
        self._gate.refusal_log.close()
        if self._loading is not None and not self._loading.done():  # the loader thread still reads the store
            with contextlib.suppress(Exception):
                await self._loading
        if self._takeover is not None:
            self._takeover.cancel()
        await self._committer.close()  # what the last steps recorded is committed before the store closes
        if self.cluster is not None:  # flushed: give the shards back, so a standby takes over at once
            await self.cluster.stop(release=True)
        if self._hook is not None:
            await self._hook.close()
        if self.provisioner is not None:
            await self.provisioner.close()
        self.store.close()

    # ------------------------------------------------------------------ HTTP (coordinator/io/frontdoor/routes.py)

    def readiness_problem(self) -> str | None:
        """None when ``/readyz`` should answer 200, else why not."""
        if self._stopping:
            return "shutting down"
        if self._server is None or not self._server.is_serving():
            return "not listening yet"
        if self.fatal is not None and self.fatal.done() and isinstance(self.fatal.result(), ShardFenced):
            return "fenced: this coordinator lost its shard lease and is stopping (see its log)"
        if self.cluster is not None and not self.cluster.serving and not self.loaded.is_set():
            return STANDBY
        if not self.loaded.is_set():
            return LOADING
        if self.fatal is not None and self.fatal.done():
            return "the store refused a write; the coordinator is stopping (see its log)"
        if self.store.closed:
            return f"the store {self.store.description} is closed"
        return None

    @property
    def cost_throttles(self) -> int:
        """Frames after which a client principal over its work-unit rate was throttled (/metrics)."""
        return self._gate.cost_throttles

    @property
    def metrics_port(self) -> int | None:
        """The port of the ``--metrics-listen`` socket; None when /metrics is on the main port."""
        return self._metrics_listener.port if self._metrics_listener is not None else None

    def metrics_exposition(self) -> tuple[bytes, str] | None:
        """The ``/metrics`` body and its content type; None while the store loads (the core is being filled)."""
        if not self.loaded.is_set():
            return None
        return self.metrics_cache.get(), CONTENT_TYPE

    def _session_counts(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for session in self._sessions.values():
            counts[session.role] = counts.get(session.role, 0) + 1
        return counts

    # ------------------------------------------------------------------ handshake

    def _process_request(
        self, conn: ServerConnection, request: Request
    ) -> Response | Coroutine[Any, Any, Response | None] | None:
        path = urlsplit(request.path).path
        role = ROLE_PATHS.get(path)
        upgrade = "websocket" in request.headers.get("Upgrade", "").lower()
        if not upgrade or role is not None:  # a websocket upgrade never gets the dashboard page
            response = http_routes.process_request(self, conn, request)  # /healthz /readyz /metrics / (dashboard)
            if response is not None:
                if response.status_code == 404:  # unknown paths are probes too: counted with the refusals
                    self._count_refusal(404)
                elif path == "/metrics" and self._gate.scrape_held(conn):  # a scrape loop (issue 17 finding 9)
                    return self._gate.hold(response)
                return response
        if role is None:
            self._count_refusal(404)
            what = "websocket path" if upgrade else "path"
            served = "fleetwire serves websockets on /v1/worker and /v1/client"
            return conn.respond(404, f"unknown {what} {path}; {served}\n")
        refused_subprotocol = subprotocol_refused(request.headers, (SUBPROTOCOL_MSGPACK, SUBPROTOCOL_JSON))
        if refused_subprotocol is not None:
            self._count_refusal(400)
            return conn.respond(400, refused_subprotocol + "\n")
        if not self.loaded.is_set():
            return self._after_load(conn, request)
        if self._away is not None and (away := self._away()) is not None:
            self._count_refusal(503)
            return http_routes.loading(away)  # 503 + Retry-After: 1
        # Origin, connection limit, client certificate, token, penalty box; repeated refusals held (gate.py).
        return self._gate.upgrade(conn, request, path, role, len(self._sessions), self._held_by, self._count_refusal)

    async def _after_load(self, conn: ServerConnection, request: Request) -> Response | None:
        """A handshake that came while the store loads: admitted once it is loaded, or 503 after a while.

        It waits 80 % of the handshake timeout at most (websockets drops a handshake at the whole
        timeout, and the SDK and agent give up at their own, 10 s by default like the server's);
        then 503 with ``Retry-After: 1``, which workers and clients retry after.
        """
        self.handshakes_waiting += 1
        self.handshake_waits.set()
        try:
            await asyncio.wait_for(self.loaded.wait(), self.settings.limits.handshake_timeout_s * 0.8)
        except TimeoutError:
            self._count_refusal(503)
            return http_routes.loading(self.readiness_problem() or LOADING)
        finally:
            self.handshakes_waiting -= 1
        answer = self._process_request(conn, request)
        if isinstance(answer, Coroutine):
            return await answer
        return answer

    def _count_refusal(self, answer: int) -> None:
        key = str(answer)
        self.refusals[key] = self.refusals.get(key, 0) + 1

    def reload_tokens(self) -> list[str]:
        """Read the token file again (SIGHUP) and close the sessions of revoked tokens with 4401.

        Returns:
            The names of the revoked principals. A file that cannot be used is logged and the
            old tokens stay in force; no session is dropped.
        """
        if self.tokens is None or self.tokens.path is None:
            return []
        try:
            revoked = self.tokens.reload()
        except TokenFileError as exc:
            log.error("token file not reloaded; the old tokens stay in force", error=str(exc))
            return []
        for session in list(self._sessions.values()):
            if session.principal is not None and not self.tokens.current(session.principal):
                self._kill(session, codes.CLOSE_REVOKED, "token revoked")
        names = sorted({p.name for p in revoked})
        log.info("token file reloaded", tokens=len(self.tokens), revoked=names)
        return names

    @staticmethod
    def _select_subprotocol(conn: ServerConnection, offered: Sequence[Subprotocol]) -> Subprotocol | None:
        for name in (SUBPROTOCOL_MSGPACK, SUBPROTOCOL_JSON):
            if name in offered:
                return Subprotocol(name)
        return None  # no subprotocol offered: msgpack, the default

    # ------------------------------------------------------------------ sessions

    async def _handle(self, ws: ServerConnection) -> None:
        assert ws.request is not None
        role = ROLE_PATHS[urlsplit(ws.request.path).path]
        encoding = SUBPROTOCOLS.get(ws.subprotocol or "", "msgpack")
        codec = self._codecs[(role, encoding)]
        conn_id = next(self._conn_ids)
        principal = self._gate.principal(ws)
        if role == "worker" and not self.settings.ping_workers and ws.keepalive_task is not None:
            # The heartbeat reaper (4408) detects a dead worker; pings would only cost CPU (ServerSettings).
            ws.keepalive_task.cancel()
            ws.keepalive_task = None
        session = Session(conn_id, ws, codec, role=role, io=self.frames.of(role), principal=principal)
        io = session.io
        self._sessions[conn_id] = session
        self._held[principal.name] = self._held.get(principal.name, 0) + 1
        writer = session.writer = asyncio.create_task(session.write_loop())
        address = f"{ws.remote_address[0]}:{ws.remote_address[1]}" if ws.remote_address else ""
        core = self.core
        core.open_session(
            conn_id, role, time.monotonic(), principal=principal.name, address=address, admin=principal.admin,
            worker_ids=principal.worker_ids, identity=peer_identity(ws) if role == "worker" else "",
            named_worker_id=named_worker_id(ws.request.path) if role == "worker" else None,
        )
        self._flush()
        limits = self.settings.limits
        bucket = limits.bucket(role, time.monotonic())
        cost = self._costs.get(principal.name, time.monotonic()) if role == "client" else None
        outbox = core.outbox
        frame_budget = limits.frame_cost_budget
        try:
            async for frame in ws:
                io[0] += 1  # FrameCounters.FRAMES_IN, BYTES_IN
                io[1] += len(frame)
                if session.killed:
                    continue  # closing: what it still sends is dropped
                now = time.monotonic()
                msgs = codec.decode(frame)
                pause = 0.0 if bucket is None else bucket.take(len(msgs), now)
                if pause is None:
                    self._kill(session, codes.CLOSE_RATE_LIMITED, "message rate limit exceeded")
                    continue
                redirect = self.redirect
                away = self._away() if self._away is not None else None
                work = outbox.work
                spent = 0
                for msg in msgs:
                    if redirect is not None and (moved := redirect(role, msg)) is not None:
                        self._move(session, moved)
                        break
                    if away is not None and type(msg) is Submit:
                        self._unavailable(session, msg, away)
                        continue
                    self._receive(conn_id, msg, now)
                    if outbox.work - work > frame_budget:
                        # One frame's requests cost more than a turn's budget: what it asked so far goes
                        # out, and the rest waits for the next loop turn (others' frames run meanwhile).
                        spent += outbox.work - work
                        self._flush(len(frame))
                        await asyncio.sleep(0)
                        work = outbox.work
                        if session.killed:
                            break
                        now = time.monotonic()
                spent += outbox.work - work
                self._flush(len(frame))
                if cost is not None:  # the principal's work units: one per message and KiB, plus what the core counted
                    owed = cost.take(len(msgs) + (len(frame) >> 10) + spent, now)
                    if owed:
                        self._gate.cost_throttles += 1
                        pause = max(pause or 0.0, min(owed, 5.0))
                if self._committer.over:  # the disk is behind: stop reading until it catches up
                    await self._committer.drained()
                if pause:
                    await asyncio.sleep(pause)  # throttle: stop reading until its bucket refills
        except ConnectionClosed:
            pass
        finally:
            sent = ws.protocol.close_sent
            if sent is not None and sent.code == codes.CLOSE_TOO_BIG:  # websockets refused a frame (max_size)
                self._count_refusal(codes.CLOSE_TOO_BIG)
                self._gate.offence(principal, ws, codes.CLOSE_TOO_BIG)  # penalty box: its reconnects get 429
                log.warning(
                    "refused: frame over the size limit", conn_id=conn_id, role=role, principal=principal.name,
                    address=address, limit_bytes=ws.protocol.max_message_size,
                )
            self._sessions.pop(conn_id, None)
            left = self._held.get(principal.name, 0) - 1
            if left > 0:
                self._held[principal.name] = left
            else:
                self._held.pop(principal.name, None)
            core.close_session(conn_id, time.monotonic())
            self._flush()
            if not writer.done():
                writer.cancel()

    def _receive(self, conn_id: int, msg: Any, now: float) -> None:
        try:
            self.core.receive(conn_id, msg, now)
        except Exception:
            # A bug in the core must not take the coordinator down, and no traceback
            # reaches the wire: log it here, answer with a bare internal error.
            log.error(
                "core failed on a message", conn_id=conn_id, type=type(msg).__name__,
                exception=traceback.format_exc(),  # never exc_info: frames hold the message (fleetwire/cli/logs.py)
            )
            session = self._sessions.get(conn_id)
            if session is not None:
                session.pending.append(Error(code=codes.INTERNAL, message="internal error; see coordinator log"))
                session.wake.set()

    def _flush(self, size: int = 0) -> None:
        """Hand the core's effects on: records to the committer, frames out once committed.

        ``size``: the bytes of the frame that caused them (the committer's backlog bound).
        """
        effects = self.core.take_effects()
        if effects.decisions and self._hook is not None:
            self._hook.run(effects.decisions)
        if effects.decisions and self.provisioner is not None:
            self.provisioner.decided(effects.decisions)
        # Frames go out only once the records of their step (and of every step before) are committed.
        if effects.records:
            self._committer.submit(effects.records, effects, size)
        elif self._committer.pending:
            self._committer.after(effects)
        else:
            self._deliver(effects)
        if not self._pumping and self.core.streams.replaying:
            self._pumping = True
            asyncio.get_running_loop().call_soon(self._pump)

    def _pump(self) -> None:
        """One slice of the large replays under way, then the loop runs everyone else (issue 17 finding 1).

        A subscriber with more than a slow reader's share unsent waits (its writer catches up first);
        when every one waits, the pump looks again a little later.
        """
        sent = self.core.pump(self.settings.limits.frame_cost_budget // 4, self._busy)
        self._flush()  # _pumping is still set: it schedules nothing
        if not self.core.streams.replaying:
            self._pumping = False
        elif sent:
            asyncio.get_running_loop().call_soon(self._pump)
        else:  # every subscriber still reads its backlog: look again shortly instead of spinning
            asyncio.get_running_loop().call_later(0.005, self._pump)

    def _busy(self, conn_id: int) -> bool:
        session = self._sessions.get(conn_id)
        return session is not None and session.out_bytes() > REPLAY_BACKLOG_BYTES

    def _held_by(self, principal: str) -> int:
        """Open sessions of ``principal`` (its connection share, coordinator/limits.py)."""
        return self._held.get(principal, 0)

    def _deliver(self, effects: Effects) -> None:
        sessions = self._sessions
        cap = self.settings.limits.max_pending_messages
        cap_bytes = self.settings.limits.max_pending_bytes
        slow: list[Session] = []
        sends = effects.sends
        if len(sends) > 2:  # fan-out: one event to many subscribers is encoded once, not per session
            sends = _encode_shared(sends, sessions)
        woken: list[Session] = []
        for conn_id, msgs in sends.items():
            session = sessions.get(conn_id)
            if session is not None and not session.killed:
                # Already at the cap before this batch: the peer is not reading. Bytes are the
                # writer's encoded frames not yet sent and the socket's buffer, measured, plus the
                # messages not yet encoded, estimated (coordinator/io/frontdoor/connection.py ``out_bytes``).
                backlog = len(session.pending)
                if backlog >= cap or (
                    (backlog >= 64 or session.unsent > cap_bytes >> 2) and session.out_bytes() >= cap_bytes
                ):
                    slow.append(session)
                session.pending.extend(msgs)
                # Writers run in the order they are woken. A worker's ``assign`` goes first: it is
                # on the plan's critical path; the client's ``accepted``/``leased`` are not.
                if session.role == "worker" and any(type(m) is Assign for m in msgs):
                    session.wake.set()
                else:
                    woken.append(session)
        for session in woken:
            session.wake.set()
        for conn_id, code, reason in effects.closes:
            session = sessions.get(conn_id)
            if session is not None:
                session.close_with = (code, reason)
                session.wake.set()
                # Repeated violations, or a worker id past its reconnect budget (4429): the penalty box,
                # the latter keyed by the id the upgrade named too (gate.py), so its neighbours get in.
                if code in _CORE_PENALIZED and session.principal is not None:
                    self._count_refusal(code)
                    self._gate.offence(session.principal, session.ws, code,
                                       per_worker_id=code == codes.CLOSE_RATE_LIMITED)  # fmt: skip
        for session in slow:
            self._kill(session, codes.CLOSE_SLOW_CONSUMER, "slow consumer: too much waiting for it to read")

    def _unavailable(self, session: Session, msg: Submit, why: str) -> None:
        """The store is away (a database failover): the submit is not processed; the client sends it again."""
        self.unavailable_answers += 1
        session.pending.append(Error(code=codes.UNAVAILABLE, message=f"{why}; send the submit again",
                                     req_id=msg.req_id, plan_id=msg.plan_id, retry_after_s=UNAVAILABLE_RETRY_S))
        session.wake.set()

    def _move(self, session: Session, moved: Moved) -> None:
        """Cluster mode: the session belongs to another shard; tell it where, then close it 4307."""
        session.killed = True  # what it still sends is dropped
        session.pending.append(moved)
        session.close_with = (codes.CLOSE_MOVED, f"shard {moved.shard} is served elsewhere")
        session.wake.set()

    def _kill(self, session: Session, code: int, reason: str) -> None:
        """Close a session from the server's side at once, dropping what is pending for it.

        The core forgets the session now, so nothing more is queued for it and its input is
        ignored; the close handshake gets the close timeout before the TCP connection is
        aborted (a peer that does not read never answers it).
        """
        if session.killed:
            return
        session.killed = True
        session.pending = []
        self._count_refusal(code)
        if session.principal is not None:
            self._gate.offence(session.principal, session.ws, code)  # 4429: penalty box; others ignored
        log.warning(
            "refused: closing session", code=code, reason=reason, conn_id=session.conn_id, role=session.role,
            principal=session.principal.name if session.principal is not None else "", address=_address(session.ws),
        )
        if session.writer is not None:
            session.writer.cancel()
        self.core.close_session(session.conn_id, time.monotonic())
        # What closing it changed (a worker's plans waiting again) goes out through the usual
        # path, after this delivery has finished.
        asyncio.get_running_loop().call_soon(self._flush)
        task = asyncio.create_task(close_or_abort(session.ws, code, reason, self.settings.limits.close_timeout_s))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def _store_failed(self, exc: BaseException) -> None:
        """Fail-stop: the store refused a write, so memory is ahead of what a restart would load."""
        if isinstance(exc, ShardFenced):  # cluster mode: another coordinator owns the shard now
            if self.fatal is not None and not self.fatal.done():
                log.critical("shard lease lost (fenced): this coordinator stops serving; another one owns the shard",
                             store=self.store.description, error=str(exc))  # fmt: skip
                self.fatal.set_result(exc)
            return
        log.critical("store write failed: stopping the coordinator; restart it once the store works",
                     store=self.store.description, error=f"{type(exc).__name__}: {exc}")  # fmt: skip
        if self.fatal is not None and not self.fatal.done():
            self.fatal.set_result(exc)

    async def _reap_forever(self) -> None:
        period = self.settings.reaper_period_s
        loop = asyncio.get_running_loop()
        while True:
            due = loop.time() + period
            await asyncio.sleep(period)
            late_s = loop.time() - due
            if late_s > self.settings.core.heartbeat_interval_s:
                # The loop itself stalled: the beats that arrived meanwhile still wait in the sockets.
                # Let the readers run before the reaper judges anyone (docs/OPERATIONS.md §Test matrix row 10).
                log.warning("event loop stalled; skipping one reaper tick", stalled_s=round(late_s, 3))
                continue
            try:
                now = time.monotonic()
                self.core.set_wall_offset(time.time() - now)  # follows the wall clock's adjustments
                self.core.tick(now)
                self._rotate_data_key()
                if self.provisioner is not None:
                    self.provisioner.step()
            except Exception:
                log.error("reaper tick failed", exception=traceback.format_exc())
            self._flush()

    def _autoscale_note(self, data: dict[str, Any]) -> None:
        """The provisioner's news for admin followers (a failed provider call); the next flush (at the
        latest the reaper's, within a tick) sends it: this may run inside one."""
        self.core.autoscale_note(data)

    def _rotate_data_key(self) -> None:
        """A new data-plane ticket key when the core says one is due (coordinator/data_plane.py)."""
        now = time.monotonic()
        if self.core.data.rotation_due(now):
            self.core.data.rotate(secrets.token_hex(4), secrets.token_bytes(32), now)


def _encode_shared(sends: dict[int, list[Any]], sessions: dict[int, Session]) -> dict[int, list[Any]]:
    """``sends`` with every message that goes to several sessions encoded once per encoding.

    The core hands the same Struct to every subscriber of a plan; the writers would encode it
    once each. Here each such message becomes a ``msgspec.Raw`` (its encoded bytes, which the
    codec copies into a frame as they are), made once per encoding and shared by all sessions.
    """
    counts: dict[int, int] = {}
    for msgs in sends.values():
        for msg in msgs:
            key = id(msg)
            counts[key] = counts.get(key, 0) + 1
    if len(counts) == sum(counts.values()):
        return sends  # nothing is shared
    raws: dict[tuple[int, str], msgspec.Raw] = {}
    out: dict[int, list[Any]] = {}
    for conn_id, msgs in sends.items():
        session = sessions.get(conn_id)
        if session is None:
            continue
        codec = session.codec
        encoded: list[Any] = []
        for msg in msgs:
            key = id(msg)
            if counts[key] < 2:
                encoded.append(msg)
                continue
            raw = raws.get((key, codec.encoding))
            if raw is None:
                try:
                    raw = raws[(key, codec.encoding)] = codec.encode_raw(msg)
                except Exception:  # left to each session's writer, which closes only that session
                    encoded.append(msg)
                    continue
            encoded.append(raw)
        out[conn_id] = encoded
    return out


def _address(ws: ServerConnection) -> str:
    remote = ws.remote_address
    return f"{remote[0]}:{remote[1]}" if remote else ""
