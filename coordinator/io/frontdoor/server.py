"""A coordinator's port: the wiring of the parts that drive one sans-I/O ``Coordinator`` core.

Theory of operation: the port's front door (coordinator/io/frontdoor/door.py) answers plain HTTP
(routes.py: /healthz, /readyz, /metrics, the dashboard) and admits websocket sessions before the
upgrade (docs/PROTOCOL.md §Handshake: 401 for a missing or wrong token, 403 for a token of the
other role or a foreign browser Origin, 503 at the connection limit or while the store is away,
429 in the penalty box after an abusive close, 404 for an unknown path; gate.py). Each session's
reader (reader.py) decodes its frames within the read policy (coordinator/read_policy.py: the
message rate, pause or close 4429; the principal's work units; the store's backlog) and hands the
messages to the core's driver (core_driver.py), which feeds the core with ``now`` and *flushes*:
records to the committer, then the frames of each committed step to the sessions' writers
(connection.py), coalesced per connection; a session already at its pending cap is closed 4503
(slow consumer). The OpenAI-compatible routes (openai_http.py, docs/OPENAI.md) take the
connections whose first bytes ask for them, and feed the same core through the same driver.
Timers (the reaper, the data-plane key's rotation) live here, never in the core;
``reload_tokens`` (SIGHUP) closes revoked tokens' sessions 4401. In cluster mode a server is one
shard's core (coordinator/io/cluster/host.py) or keeps the shard leases itself
(coordinator/io/cluster/leases.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import socket
import time
import traceback
from collections.abc import Callable, Coroutine, Iterator
from concurrent.futures import Executor
from dataclasses import replace
from typing import Any, Final

import structlog
from websockets.asyncio.server import Server, ServerConnection
from websockets.http11 import Request, Response
from websockets.typing import Subprotocol

from coordinator.auth import TokenFileError, TokenStore, inline_tokens
from coordinator.core import Coordinator, Effects
from coordinator.io.cluster.leases import LeaseKeeper, ShardFenced
from coordinator.io.frontdoor import routes as http_routes
from coordinator.io.frontdoor.connection import Session
from coordinator.io.frontdoor.core_driver import Committer, CoreDriver, CoreSession, Redirect
from coordinator.io.frontdoor.door import ROLE_PATHS, Answer, FrontDoor, Role
from coordinator.io.frontdoor.gate import Gatekeeper, server_tls_context
from coordinator.io.frontdoor.openai_http import OpenAIDoor
from coordinator.io.frontdoor.settings import ServerSettings
from coordinator.io.ops.carbon_feed import CarbonFeed
from coordinator.io.ops.hooks import HookRunner
from coordinator.io.ops.metrics import (
    CONTENT_TYPE,
    OPENMETRICS_CONTENT_TYPE,
    build_registry,
    render,
    render_openmetrics,
)
from coordinator.io.ops.metrics_http import ExpositionCache, MetricsListener, parse_listen
from coordinator.io.ops.provision import Provisioner
from coordinator.io.ops.tracing import PlanSpans
from coordinator.io.stores.commit import GroupCommitter
from coordinator.io.stores.integrity import report_accepted_losses
from coordinator.io.stores.store import Store, open_store
from coordinator.io.threads import in_thread
from coordinator.openai_api.limits import RequestRate
from coordinator.read_policy import ReadPolicy
from coordinator.records import StoredPlan
from coordinator.stats import FrameCounters
from protocol import SUBPROTOCOL_JSON, SUBPROTOCOL_MSGPACK, Codec, Encoding
from protocol import errors as codes
from protocol.chunkview import with_chunk_views
from protocol.messages import FromClient, FromWorker
from wireio.tracing import SERVICE_COORDINATOR, Tracing

__all__ = ["ROLE_PATHS", "CoordinatorServer", "Role", "ServerSettings"]

log = structlog.get_logger(__name__)

STANDBY = "standby: owns no shard (another coordinator of the cluster serves; this one takes over when its lease ends)"
LOADING = "loading the store"  # /readyz's reason (503) until the store's plans are loaded
# msgpack sessions decode relayed chunks as views into their frame (protocol/chunkview.py): a chunk
# is checked and passed on without its bytes copied, and alone in a frame it is sent on as that frame.
CORE_CODECS: Final[dict[tuple[Role, Encoding], Codec]] = {
    (role, enc): Codec(enc, with_chunk_views(FromWorker if role == "worker" else FromClient, enc), role)
    for role in ("worker", "client")
    for enc in ("msgpack", "json")
}


class CoordinatorServer:
    """Serves ``/v1/worker`` and ``/v1/client`` and drives a ``Coordinator`` core: the wiring of the parts.

    The front door (door.py: routes, admission, sessions), the core's driver (core_driver.py:
    messages in, effects to the committer and the writers), the store and its committer, the
    reaper, ``/metrics`` and, in cluster mode, the shard leases. This class is the core's
    :class:`~coordinator.io.frontdoor.door.Port`: its plain HTTP paths (routes.py), sessions waiting
    for the store's load, and a :class:`~coordinator.io.frontdoor.core_driver.CoreSession` per session.

    Usage::

        server = CoordinatorServer(settings)
        await server.start()
        print(server.url)
        await server.serve_forever()   # or: await server.stop()

    Args:
        settings: the coordinator's settings.
        version: told to workers.
        store: used as is (tests hand the same MemoryStore to a second server to restart in-process);
            None: opened from ``settings.store`` (raises StoreError for a database that cannot be opened).
        redirect: cluster mode, one core per shard (coordinator/io/cluster/host.py): called with each
            session's role and message; a ``Moved`` answer ends the session with it and 4307.
        closer: the threads :meth:`stop` closes the store and shuts tracing down in (None: the loop's default
            executor); a cluster host gives its shards' cores its own (coordinator/io/cluster/teardown.py, "Off the
            loop").
        loader: the thread :meth:`start` loads the store's plans in (None: the loop's default executor); a cluster
            host gives its shards' cores its own (coordinator/io/cluster/teardown.py, "Started in the host's own
            threads").
    """

    def __init__(self, settings: ServerSettings, *, version: str = "", store: Store | None = None,
                 redirect: Redirect | None = None, closer: Executor | None = None,
                 loader: Executor | None = None) -> None:  # fmt: skip
        settings.check()
        self.settings = settings
        self._closer = closer
        self._loader = loader
        self.store: Store = store if store is not None else open_store(
            settings.store, settings.data_dir, accept_loss=settings.accept_store_loss, cluster=settings.cluster
        )
        self.fatal: asyncio.Future[BaseException] | None = None  # set when the store fails (fail-stop)
        self.cluster = self._lease_keeper()
        self.core = Coordinator(
            replace(settings.core, version=version), new_id=lambda: secrets.token_hex(8),
            new_secret=lambda: secrets.token_urlsafe(24),  # welcome.session_secret: proof of a worker id
        )
        self.provisioner = self._provisioner()
        # Raises TokenFileError (a ValueError) for a token file that cannot be used.
        tokens = inline_tokens(settings.worker_tokens, settings.client_tokens, settings.admin_tokens)
        self.tokens = None if settings.insecure else TokenStore(settings.token_file, tokens)
        if self.tokens is not None:  # teams, weights and quotas for fair share (coordinator/sharing.py)
            self.core.set_teams(self.tokens.teams, time.monotonic())
        self._tls = None if settings.tls_cert is None or settings.tls_key is None else server_tls_context(
            settings.tls_cert, settings.tls_key, settings.tls_client_ca)  # fmt: skip
        self._gate = Gatekeeper(self.tokens, settings.limits, max_frame_bytes=settings.max_frame_bytes,
                                mtls_workers=settings.tls_client_ca is not None)  # fmt: skip
        self.frames = FrameCounters()
        self.door = FrontDoor(self, self._gate, ReadPolicy(settings.limits), CORE_CODECS, frames=self.frames,
                              ping_workers=settings.ping_workers)  # fmt: skip
        self.refusals = self.door.refusals  # by answer: HTTP status before the upgrade, close code after
        self.driver = CoreDriver(
            self.core, self.door, settings.limits, self._committer_for, redirect=redirect,
            hook=HookRunner(settings.autoscale_hook) if settings.autoscale_hook else None, provisioner=self.provisioner,
            away=self.store.abilities.away,  # PgStore: new submits ``unavailable`` and handshakes 503 meanwhile
        )
        self.door.store = self._committer = self.driver.committer
        # The OpenAI-compatible routes on this same port and TLS (docs/OPENAI.md; --no-openai: none).
        self.openai = OpenAIDoor(
            self.driver, self.tokens, settings.limits, queue_timeout_s=settings.openai_queue_timeout_s,
            durable=settings.openai_durable,
            max_body_bytes=settings.limits.frame_bytes("client", settings.max_frame_bytes),
            rate=RequestRate(settings.openai_rate, settings.openai_burst),
        ) if settings.openai else None
        if self.openai is not None:
            self._gate.pending.divert = self.openai.divert  # the first bytes of each connection decide (admission.py)
        # Traces (docs/OPERATIONS.md §Tracing): the core notes traced plans' steps, the driver makes their spans.
        self.tracing = Tracing.from_env(SERVICE_COORDINATOR, endpoint=settings.otlp_endpoint or None,
                                        export_process=True)  # the SDK's encoder off this process (§Tracing)
        if self.tracing is not None:
            self.driver.spans = PlanSpans(self.tracing)
            self.core.streams.tracing = True
        self._server: Server | None = None
        self._reaper: asyncio.Task[None] | None = None
        self._life_cycle()
        self._metrics(version)
        self.core.carbon.book.max_age_s = settings.carbon_forecast_max_age_s
        # Grid forecasts for carbon time shifting (docs/ROUTING.md §Carbon in time), fetched once the store is loaded.
        self.carbon_feed = None if settings.carbon_forecast is None else CarbonFeed(
            settings.carbon_forecast, self.core, self.driver.flush)  # fmt: skip

    def _life_cycle(self) -> None:
        """The life-cycle state: listening, loading, stopping."""
        # Set once the port is bound, and once the store's plans are loaded (start()); until then
        # /readyz answers 503 "loading the store" and websocket handshakes wait (_after_load).
        self.listening = asyncio.Event()
        self.loaded = asyncio.Event()
        self._loading: asyncio.Future[None] | None = None
        self.handshakes_waiting = 0  # websocket handshakes waiting for the load now
        self.handshake_waits = asyncio.Event()  # set whenever one starts waiting (tests wait on it)
        self._stopping = False
        self.port: int = self.settings.port

    def _lease_keeper(self) -> LeaseKeeper | None:
        """Cluster mode (a store with shard leases, coordinator/io/cluster/leases.py): serves only while it
        holds the shards; a standby listens, answers /readyz 503, and takes over later."""
        self._takeover: asyncio.Task[None] | None = None
        self._acquired = asyncio.Event()  # set when this coordinator holds every shard
        leases = self.store.abilities.leases
        if leases is None:
            return None
        owner = f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(3)}"
        return LeaseKeeper(leases, self.settings.cluster, owner, on_acquired=self._acquired.set,
                           on_fenced=self._store_failed)  # fmt: skip

    def _committer_for(self, release: Callable[[Effects], None]) -> Committer:
        """The store's own committer (PostgreSQL: commits on this loop, coordinator/io/stores/pg_commit.py), else
        a ``GroupCommitter``; either hands each step's effects to ``release`` once its records are committed."""
        backlog = self.settings.limits.max_commit_backlog_bytes
        make_committer = self.store.abilities.make_committer
        if make_committer is not None:
            committer: Committer = make_committer(release, self._store_failed, max_backlog_bytes=backlog)
            return committer
        return GroupCommitter(self.store, release, self._store_failed, max_backlog_bytes=backlog)

    def _provisioner(self) -> Provisioner | None:
        """What acts on the autoscaler's decisions (coordinator/io/ops/provision.py); None without a provider."""
        settings = self.settings
        if settings.autoscale_provider is None or settings.core.autoscale is None:
            return None
        return Provisioner(
            settings.autoscale_provider, registry=self.core.registry, plans=self.core.plans,
            max_workers=settings.core.autoscale.max_workers, min_workers=settings.core.autoscale.min_workers,
            notify=self._autoscale_note, clock=time.monotonic, autoscaler=self.core.autoscaler,
        )

    def _metrics(self, version: str) -> None:
        """/metrics reads the core and these counters at scrape time (coordinator/io/ops/metrics.py)."""
        self.metrics_registry = build_registry(
            self.core, frames=self.frames, sessions=self._session_counts, refusals=self.refusals, version=version,
            gate=self._gate, read_policy=self.door.policy,
            provision=self.provisioner.status if self.provisioner is not None else None,
            openai=self.openai.stats if self.openai is not None else None,
        )
        # A scrape walks every worker and plan: rebuilt at most every metrics_cache_s (ops/metrics_http.py).
        self.metrics_cache = ExpositionCache(lambda: render(self.metrics_registry), self.settings.metrics_cache_s)
        self.openmetrics_cache = ExpositionCache(lambda: render_openmetrics(self.metrics_registry),
                                                 self.settings.metrics_cache_s)  # fmt: skip
        self._metrics_listener: MetricsListener | None = None

    @property
    def loading(self) -> asyncio.Future[None] | None:
        """The loader thread reading the store's plans (start()); None before it starts. Done once it lets go."""
        return self._loading

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
            self._loading = in_thread(self._loader, self._load)
            await asyncio.shield(self._loading)
            hand_over = self.store.abilities.writer_process
            if self.settings.store_writer == "process" and hand_over is not None:
                hand_over()  # SQLite: commits in a child process from now on (coordinator/io/stores/writer_process.py)
        except BaseException:
            assert self._server is not None
            self._server.close()
            await self._server.wait_closed()
            raise
        self.core.counters["store_loss_accepted"] = report_accepted_losses(self.store)
        self._committer.start()
        self.loaded.set()
        self._rotate_data_key()
        self.driver.flush()
        self._reaper = asyncio.create_task(self._reap_forever())
        if self.provisioner is not None:
            self.provisioner.start()  # min_workers, in the background
        if self.carbon_feed is not None:
            self.carbon_feed.start()  # the first fetch at once (coordinator/io/ops/carbon_feed.py)
        log.info(
            "coordinator listening", url=self.url, insecure=self.settings.insecure, plans=len(self.core.plans),
            tokens=0 if self.tokens is None else len(self.tokens), mtls=self.settings.tls_client_ca is not None,
        )

    def _load(self) -> None:
        """Read the store and restore the core (in a thread: no session, tick or commit runs meanwhile)."""
        self.core.set_wall_offset(time.time() - time.monotonic())
        stream = self.store.abilities.stream  # SQLite: each plan as it is decoded
        if stream is not None:
            # Liveness clocks start now (docs/SEMANTICS.md §Durability): workers of restored leases
            # get one heartbeat timeout from here to reconnect.
            self.core.restore(stream(), time.monotonic())
            self._load_usage()
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
        self._load_usage()

    def _load_usage(self) -> None:
        """The usage ledger's rows, from a store that keeps them (coordinator/ledger.py; SQLite and memory)."""
        usage = self.store.abilities.usage
        if usage is not None:
            self.core.restore_usage(usage())

    async def _listen(self) -> None:
        limits = self.settings.limits
        self._gate.fit_fd_limit(limits.max_connections)
        if self.settings.metrics_listen is not None:  # capped as the main port (ops/metrics_http.py)
            self._metrics_listener = MetricsListener(self.metrics_exposition, self.settings.metrics_token, self._gate)
            await self._metrics_listener.start(*parse_listen(self.settings.metrics_listen))
        # The gate's front door (gate.py serve): the pending-handshake budget, the handshake timeout,
        # TCP_DEFER_ACCEPT, no compression, the largest per-role frame limit (each connection gets its own).
        self._server = await self._gate.serve(
            self.door.serve,
            self.settings.host,
            self.settings.port,
            process_request=self.door.process_request,
            select_subprotocol=self.door.select_subprotocol,
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
            # No new session during the acks' wait below (up to ACK_FLUSH_WAIT_S): the listening sockets close
            # first, the open sessions stay until the close after it.
            self._server.server.close()
            await self.driver.flush_acks()  # workers' held acks leave before the close (core_driver.py §Acks)
            self._server.close()
            self._gate.pending.close()  # sockets still waiting for their first byte (admission.py)
            await self._gate.wait_closed(self._server)  # bounded: a session stuck past the close is cancelled
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
        if self.driver.hook is not None:
            await self.driver.hook.close()
        if self.provisioner is not None:
            await self.provisioner.close()
        if self.carbon_feed is not None:
            await self.carbon_feed.close()
        if self.tracing is not None:  # the spans still queued go to the collector
            # In the closer's threads too: against a collector that does not answer, the exporter child's close waits
            # up to its EXIT_WAIT_S (15 s), which in the loop's default executor held a thread that every shard's
            # shutdown, and the loop's getaddrinfo, share (a cluster host's N shards: N of them at once).
            await in_thread(self._closer, self.tracing.shutdown)
        # In a thread, not on the loop: a store's close waits on its database or writer (PgStore: up to ~25 s
        # against a database that does not answer), and the loop serves other shards' cores in a cluster host,
        # which hands its cores threads of their own for it (coordinator/io/cluster/teardown.py, "Off the loop").
        await in_thread(self._closer, self.store.close)

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
        return self.door.policy.cost_throttles

    @property
    def unavailable_answers(self) -> int:
        """Submits answered ``unavailable`` while the store was away."""
        return self.driver.unavailable_answers

    @property
    def metrics_port(self) -> int | None:
        """The port of the ``--metrics-listen`` socket; None when /metrics is on the main port."""
        return self._metrics_listener.port if self._metrics_listener is not None else None

    def metrics_exposition(self, openmetrics: bool = False) -> tuple[bytes, str] | None:
        """The ``/metrics`` body and its content type (``openmetrics``: that format, with the latency histograms'
        trace exemplars); None while the store loads (the core is being filled)."""
        if not self.loaded.is_set():
            return None
        if openmetrics:
            return self.openmetrics_cache.get(), OPENMETRICS_CONTENT_TYPE
        return self.metrics_cache.get(), CONTENT_TYPE

    def _session_counts(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for session in self.door.sessions.values():
            counts[session.role] = counts.get(session.role, 0) + 1
        return counts

    # ------------------------------------------------------------------ the core's port (door.py Port)

    def plain(self, conn: ServerConnection, request: Request, path: str) -> Answer:
        """/healthz /readyz /metrics and the dashboard (routes.py); a websocket upgrade of another path is a 404."""
        if "websocket" not in request.headers.get("Upgrade", "").lower():  # never the dashboard page to an upgrade
            settings = self.settings
            response = http_routes.respond(
                request, ready=self.readiness_problem, metrics=self.metrics_exposition,
                metrics_token=settings.metrics_token, metrics_elsewhere=settings.metrics_listen is not None,
            )
            if response.status_code == 404:  # unknown paths are probes too: counted with the refusals
                self.door.count(404)
            elif path == "/metrics" and self._gate.scrape_held(conn):  # a scrape loop (issue 17 finding 9)
                return self._gate.hold(response, conn)
            return response
        self.door.count(404)
        return conn.respond(404, f"unknown websocket path {path}; fleetwire serves websockets on /v1/worker and "
                                 "/v1/client\n")  # fmt: skip

    def not_now(self, conn: ServerConnection, request: Request) -> Answer:
        """While the store loads a handshake waits (:meth:`_after_load`); while it is away, 503 + Retry-After."""
        if not self.loaded.is_set():
            return self._after_load(conn, request)
        away = self.driver.away
        if away is not None and (why := away()) is not None:
            self.door.count(503)
            return http_routes.loading(why)  # 503 + Retry-After: 1
        return None

    def handler(self, session: Session) -> CoreSession:
        """Every session of this port is the core's."""
        return CoreSession(self.driver, session)

    async def _after_load(self, conn: ServerConnection, request: Request) -> Response | None:
        """A handshake that came while the store loads: admitted once it is loaded, or 503 after a while.

        It waits 80 % of the handshake timeout at most (websockets drops a handshake at the whole
        timeout, and the SDK and agent give up at their own, 10 s by default like the server's);
        then 503 with ``Retry-After: 1``, which workers and clients retry after. The wait runs under
        :func:`asyncio.timeout`, not ``asyncio.wait_for``: on Python 3.11 ``wait_for`` returns when a
        cancel (a stop's, of a handler past its bound) arrives in the loop iteration in which the load
        ends, and the cancelled handshake was admitted.
        """
        self.handshakes_waiting += 1
        self.handshake_waits.set()
        try:
            async with asyncio.timeout(self.settings.limits.handshake_timeout_s * 0.8):
                await self.loaded.wait()
        except TimeoutError:
            self.door.count(503)
            return http_routes.loading(self.readiness_problem() or LOADING)
        finally:
            self.handshakes_waiting -= 1
        answer = self.door.process_request(conn, request)
        if isinstance(answer, Coroutine):
            return await answer
        return answer

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
        self.core.set_teams(self.tokens.teams, time.monotonic())  # a changed team or weight moves shares at once
        for session in list(self.door.sessions.values()):
            if session.principal is not None and not self.tokens.current(session.principal):
                self.door.kill(session, codes.CLOSE_REVOKED, "token revoked")
        names = sorted({p.name for p in revoked})
        log.info("token file reloaded", tokens=len(self.tokens), revoked=names)
        return names

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
            self.driver.flush()

    def _autoscale_note(self, data: dict[str, Any]) -> None:
        """The provisioner's news for admin followers (a failed provider call); the next flush (at the
        latest the reaper's, within a tick) sends it: this may run inside one."""
        self.core.autoscale_note(data)

    def _rotate_data_key(self) -> None:
        """A new data-plane ticket key when the core says one is due (coordinator/data_plane.py)."""
        now = time.monotonic()
        if self.core.data.rotation_due(now):
            self.core.data.rotate(secrets.token_hex(4), secrets.token_bytes(32), now)

