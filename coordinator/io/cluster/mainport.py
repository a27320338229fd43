"""A cluster coordinator's main port: its routes and its per-session router, on the one front door.

The main port is served by the same front door as a single coordinator's port
(coordinator/io/frontdoor/door.py: admission, the penalty box, the caps, the reader and its read
policy); :class:`MainPort` is what it adds there (docs/CLUSTER.md §Shards and pools):

===========================  ============================================================
``/healthz``                 200 ``ok``
``/readyz``                  200 while it serves a shard; 503 while it waits for the
                             database or owns nothing
``/metrics``                 the cluster families (coordinator/io/cluster/metrics.py);
                             ``--metrics-token``; a scrape loop is held
``/v1/topology``             shard -> owner URL, epoch, lease expiry (a database read; a
                             loop of them is held as a scrape loop)
``/v1/plans``                every shard's plans from the database (an admin token)
the dashboard's files        as a core's port serves them; its session is a view session
``/v1/worker``, ``/v1/client``  sessions (503 + Retry-After while the database is away): a
                             client session that names no pool or shard is a **view
                             session** across shards (coordinator/io/cluster/sessions.py);
                             any other is **moved** to its shard's owner (``moved``, then 4307;
                             1013 while the shard has no owner yet)
the OpenAI routes            ``/v1/chat/completions``, ``/v1/completions``, ``/v1/models``:
                             taken from the connection's first bytes, before any of the
                             above, by the cluster's OpenAI door (cluster/openai_route.py)
===========================  ============================================================
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, Final, Protocol
from urllib.parse import parse_qs, urlsplit

from prometheus_client import CollectorRegistry
from websockets.asyncio.server import ServerConnection
from websockets.datastructures import Headers
from websockets.http11 import Request, Response

from coordinator.auth import TokenStore
from coordinator.io.cluster.metrics import CONTENT_TYPE, render
from coordinator.io.cluster.sessions import ViewSessions
from coordinator.io.cluster.views import ViewError, read_plans
from coordinator.io.dashboard.assets import DASHBOARD_FILES
from coordinator.io.frontdoor.connection import Session
from coordinator.io.frontdoor.door import Answer
from coordinator.io.frontdoor.gate import Gatekeeper, bearer_token
from coordinator.io.frontdoor.reader import SessionHandler
from coordinator.io.frontdoor.routes import respond
from coordinator.io.frontdoor.settings import ServerSettings
from coordinator.io.ops.metrics_http import metrics_token_refused
from coordinator.shards import pool_shard, submit_shard, worker_shard
from protocol import Codec
from protocol import errors as codes
from protocol.messages import FromClient, FromWorker, Hello, Moved, Submit

__all__ = ["MAIN_CODECS", "MainPort", "Shards"]

MAIN_CODECS: Final = {(role, enc): Codec(enc, FromWorker if role == "worker" else FromClient, role)
                      for role in ("worker", "client") for enc in ("msgpack", "json")}  # fmt: skip

_TOPOLOGY: Final = """
SELECT shard, owner, owner_url, epoch, expires_at > now() AS live,
       extract(epoch FROM expires_at - now())::float8 AS expires_in_s
FROM shard_leases ORDER BY shard
"""


class Shards(Protocol):
    """What the main port reads of its cluster host (coordinator/io/cluster/host.py ``ClusterHost``)."""

    settings: ServerSettings
    tokens: TokenStore | None
    views: ViewSessions
    metrics_registry: CollectorRegistry
    description: str
    owner: str
    peers: set[str]
    waiting_db: str | None
    db_away: bool

    @property
    def url(self) -> str: ...

    @property
    def serving(self) -> bool:
        """It serves at least one shard."""

    def where(self, shard: int) -> Moved:
        """Where ``shard`` is served (``url`` "" while nobody serves it)."""

    def db(self, make: Callable[[Any], Awaitable[Any]]) -> Coroutine[Any, Any, Any]:
        """``make(connection)`` on the control connection."""


class MainPort:
    """The main port's :class:`~coordinator.io.frontdoor.door.Port` (module docstring).

    Args:
        shards: the cluster host it serves for.
        gate: the port's gate (the scrape and 401 holds).
    """

    def __init__(self, shards: Shards, gate: Gatekeeper) -> None:
        self.shards = shards
        self.gate = gate

    def plain(self, conn: ServerConnection, request: Request, path: str) -> Answer:
        """The main port's own HTTP paths; its 404 names them."""
        gate, shards = self.gate, self.shards
        if path == "/healthz":
            return _text(200, "ok\n")
        if path == "/metrics":  # this coordinator's cluster families (each shard's core has its own)
            refused = metrics_token_refused(request.headers.get("Authorization"), shards.settings.metrics_token)
            if refused is not None:
                return gate.answer(gate.unauthorized(conn, refused), conn)
            metrics = _text(200, render(shards.metrics_registry).decode(), CONTENT_TYPE)
            return gate.hold(metrics, conn) if gate.scrape_held(conn) else metrics  # a scrape loop (issue 17 finding 9)
        if path == "/readyz":
            if shards.serving:
                return _text(200, "ready\n")
            if shards.waiting_db is not None:
                return _text(503, f"not ready: waiting for the database ({shards.waiting_db})\n")
            return _text(503, "not ready: owns no shard yet (the other coordinators own every slot)\n")
        if path == "/v1/topology":  # a database read: a loop of them is held as a scrape loop
            return self._held_after(gate.scrape_held(conn), self._topology())
        if path == "/v1/plans":
            return self._plans(conn, request)
        if path in DASHBOARD_FILES:  # its session is a view session of this port
            return respond(request, ready=lambda: None, metrics=lambda openmetrics: None)
        return _text(404, f"unknown path {path}; a cluster coordinator's main port serves /v1/topology, "
                          "/v1/plans, /healthz, /readyz, /metrics and redirects /v1/worker and /v1/client sessions "
                          "to the shard's owner\n")  # fmt: skip

    def not_now(self, conn: ServerConnection, request: Request) -> Answer:
        """While the database is away (a failover), sessions come back shortly: 503 + Retry-After."""
        if self.shards.db_away:
            return _text(503, f"the cluster's database {self.shards.description} is away (a failover?); "
                              "retry after the Retry-After seconds\n")  # fmt: skip
        return None

    def handler(self, session: Session) -> SessionHandler:
        """The per-session router: a view session, or a session moved to its shard's owner."""
        ws, principal = session.ws, session.principal
        assert ws.request is not None and principal is not None
        shards = self.shards
        query = parse_qs(urlsplit(ws.request.path).query)
        if session.role == "client" and "pool" not in query and "shard" not in query:
            token = None if shards.tokens is None else bearer_token(ws.request.headers)
            cost = shards.views.cost_bucket(principal.name)  # the door's read policy's (host.py hands it to both)
            return shards.views.handler(ws, principal, session.codec, token, cost)
        config = shards.settings.cluster
        shard = pool_shard(query.get("pool", [""])[0], config.shards)
        if "shard" in query:
            with contextlib.suppress(ValueError):
                shard = int(query["shard"][0]) % config.shards
        return _MovedSession(shards, session, shard)

    async def _held_after(self, hold: bool, answer: Coroutine[Any, Any, Response]) -> Response:
        """``answer``, after ``--penalty-hold`` when ``hold``."""
        if hold:
            await asyncio.sleep(self.gate.hold_s)
        return await answer

    async def _topology(self) -> Response:
        shards = self.shards
        try:
            rows = await shards.db(lambda conn: conn.fetch(_TOPOLOGY))
        except Exception as exc:
            return _text(503, f"cannot read the topology from {shards.description}: {exc}\n")
        config = shards.settings.cluster
        body = {
            "cluster": config.name, "shards": config.shards, "coordinator": shards.owner, "url": shards.url,
            "coordinators": sorted(shards.peers),
            "topology": [{"shard": r["shard"], "owner": r["owner"] if r["live"] else "", "url": r["owner_url"],
                          "epoch": r["epoch"], "live": r["live"], "expires_in_s": round(r["expires_in_s"], 3)}
                         for r in rows],
        }  # fmt: skip
        return _text(200, json.dumps(body, indent=1) + "\n", "application/json")

    def _plans(self, conn: ServerConnection, request: Request) -> Answer:
        """``GET /v1/plans``: plans of every shard, read from PostgreSQL (admin token; views.py)."""
        tokens = self.shards.tokens
        if tokens is not None:
            token = bearer_token(request.headers)
            principal = tokens.authenticate(token) if token else None
            if principal is None:
                why = "/v1/plans needs an admin token (Authorization: Bearer TOKEN)"
                return self.gate.answer(self.gate.unauthorized(conn, why), conn)
            if principal.role != "admin":
                return _text(403, f"/v1/plans needs an admin token; this one is a {principal.role} token\n")
        return self._read_plans(request)

    async def _read_plans(self, request: Request) -> Response:
        query = parse_qs(urlsplit(request.path).query)
        try:
            status, body = await self.shards.db(lambda conn: read_plans(conn, query))
        except ViewError as exc:
            return _text(400, f"{exc}\n")
        except Exception as exc:
            return _text(503, f"cannot read the plans from {self.shards.description}: {exc}\n")
        return _text(status, body.decode(), "application/json")


class _MovedSession:
    """A main-port session that names a pool (every worker's): ``moved`` to its shard's owner, then 4307.

    Answered after its first message (a worker's hello, a client's first request), so the peer
    reads the ``moved`` before it writes into a closed connection; in a partitioned pool the hello's
    worker id, or the submit's session key, picks the partition. A peer silent for the handshake
    timeout is moved by its pool. 1013 while the shard has no owner yet.
    """

    def __init__(self, shards: Shards, session: Session, shard: int) -> None:
        self.shards = shards
        self.session = session
        self.shard = shard
        self.timer: asyncio.TimerHandle | None = None

    def opened(self, now: float) -> None:
        timeout_s = self.shards.settings.limits.handshake_timeout_s
        self.timer = asyncio.get_running_loop().call_later(timeout_s, self.answer, None)

    async def received(self, msgs: list[Any], frame_bytes: int, now: float) -> int:
        self.answer(msgs[0] if msgs else None)
        return 0

    def closed(self, now: float, code: int | None) -> None:
        if self.timer is not None:
            self.timer.cancel()

    def answer(self, first: Any) -> None:
        """Move the session by its first message (None: by its pool); once."""
        session = self.session
        if session.killed:
            return
        session.killed = True  # what it still sends is dropped
        if self.timer is not None:
            self.timer.cancel()
        config = self.shards.settings.cluster
        shard = self.shard
        if config.partitions and type(first) is Hello:
            shard = worker_shard(first.capabilities.tags, first.worker_id, config.shards, config.partitions)
        elif config.partitions and type(first) is Submit:
            shard = submit_shard(first, config.shards, config.partitions)
        moved = self.shards.where(shard)
        if not moved.url:
            session.close_with = (1013, f"shard {shard} has no owner yet; try again")
        else:
            session.pending.append(moved)
            session.close_with = (codes.CLOSE_MOVED, f"shard {shard} is served at {moved.url}")
        session.wake.set()


def _text(status: int, body: str, content_type: str = "text/plain; charset=utf-8") -> Response:
    data = body.encode()
    headers = Headers([("Content-Type", content_type), ("Content-Length", str(len(data)))])
    if status == 503:
        headers["Retry-After"] = "1"
    reasons = {200: "OK", 400: "Bad Request", 401: "Unauthorized", 403: "Forbidden", 404: "Not Found",
               503: "Service Unavailable"}  # fmt: skip
    return Response(status, reasons.get(status, ""), headers, data)
