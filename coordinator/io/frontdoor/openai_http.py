"""The OpenAI-compatible routes of a core's port: their asyncio driver (docs/OPENAI.md).

Theory of operation. The port's accept layer (coordinator/io/frontdoor/admission.py) shows the
first bytes of every new connection to :meth:`OpenAIDoor.divert`: a request line for
``/v1/chat/completions``, ``/v1/completions`` or ``/v1/models`` hands the connection to an
:class:`OpenAIConnection` (plain HTTP/1.1, keep-alive, on the same port and TLS as the
websocket sessions); anything else goes on to the websocket handshake. The decisions are the
pure part's (coordinator/openai_api/): the connection's bytes become requests (``intake``), a
body becomes a plan (``request``), the plan's events become the answer (``reply``).

* **Admission.** ``Authorization: Bearer <key>`` is a client or admin token of the token file
  (401 without one or with an unknown one, 403 for a worker's); under ``--insecure`` every
  request is the principal ``client``, from a loopback Host only. Open HTTP connections count
  against ``--max-connections`` with the websocket sessions' own count beside them (503 past it).
* **A request is a client session of the core** (its :class:`Exchange`, openai_exchange.py). Each
  completion opens a session for the key's principal, submits the plan subscribed with an id of
  the door's making (so a disconnect can cancel it before its ``accepted`` arrived), and closes
  the session when answered. The core's
  effects for it reach it through the driver (:attr:`CoreDriver.sinks`), committed first like
  any client's (``accepted`` only once the plan is recorded). Quotas, fair share and receipts
  apply as to any plan; a plan over the principal's limit is 429.
* **Backpressure.** The answer is written as the events come; a reader that lets more than
  ``--max-pending-bytes`` wait in its socket buffer is a slow consumer, as a websocket client
  is (4503 there): its plan is cancelled and the connection aborted. Requests are answered one
  at a time; reading goes on meanwhile (so a disconnect is seen at once), paused only for a
  client that pipelined several requests or 64 KiB ahead.
* **Disconnect.** A client that goes away before its answer is complete cancels its plan.
* **Timeouts.** A connection has ``--handshake-timeout`` to send each request head and body;
  a kept-alive idle connection is closed after the same. A request waits for a worker at most
  ``--openai-queue-timeout`` (coordinator/openai_api/reply.py).

Hot path (a token event): one ``Reply.event`` (a prefix, the text encoded, a suffix) and one
``transport.write`` per delivered batch. No logging there.
"""

from __future__ import annotations

import asyncio
import itertools
import math
import secrets
import time
import traceback
from collections import deque
from collections.abc import Callable
from typing import Final, Literal, Protocol, cast

import structlog

from coordinator.auth import Principal, TokenStore
from coordinator.io.frontdoor.core_driver import CoreDriver, Redirect
from coordinator.io.frontdoor.openai_exchange import SUBMIT_REQ, Exchange
from coordinator.limits import Limits, host_refused
from coordinator.openai_api import (
    PATHS,
    ApiError,
    DoorRequest,
    HttpRequest,
    Kind,
    ModelTable,
    RequestReader,
    error_response,
    json_response,
    parse_request,
)
from coordinator.openai_api.intake import MAX_HEAD_BYTES
from coordinator.openai_api.limits import DoorStats, RequestRate
from coordinator.openai_api.request import check_pool
from protocol.prompts import PrefixMemo
from protocol.transfer.http1 import first_line

__all__ = ["CONN_ID_BASE", "InFlight", "OpenAIConnection", "OpenAIDoor", "OpenAIEntry", "bearer_token_of", "route_of"]

log = structlog.get_logger("coordinator.io.frontdoor.openai")

#: The door's core sessions take conn ids from here, far above the websocket sessions' counter.
CONN_ID_BASE: Final = 1 << 48
_MODELS: Final = "/v1/models"
_ROUTES: Final = (*PATHS, _MODELS)
_ROUTE_BYTES: Final = frozenset(route.encode() for route in _ROUTES)
_LONGEST: Final = max(len(path) for path in _ROUTES) + 16  # bytes of a request line that decide
_WRITE_HIGH: Final = 256 * 1024  # the transport says "pause" past this (only counted: the cap is the limit's)
# Reading goes on while a request is in flight (a client that goes away is seen at once), unless the client
# pipelined this many requests, or this many bytes, ahead of it.
_MAX_PIPELINED: Final = 4
_MAX_AHEAD: Final = 64 * 1024
# Plan ids tried for a request with no session key to a partitioned pool on a shard's own port: a random id
# lands in one of K partitions, so 1 - (1 - 1/K) ** 64 of them find this shard's (K = 8: 99.98 %).
_PLACE_TRIES: Final = 64
_MAX_HOSTS: Final = 1024  # Host headers whose --insecure check is remembered
_INSECURE: Final = Principal("client", "client")  # every request's principal under --insecure


class OpenAIEntry:
    """The OpenAI routes of one port as its connections see them: admission, limits, counts.

    A core's port serves each request itself (:class:`OpenAIDoor`); a cluster's main port sends
    each to the core that serves its pool (coordinator/io/cluster/openai_route.py). Either way
    the request is admitted (key, request rate) and counted by the port it came in by.

    Args:
        tokens: the token store (None: ``--insecure``).
        limits: the port's limits (connections, pending bytes, the handshake timeout, allowed hosts).
        max_body_bytes: a request body's limit (413 past it).
        rate: the request rate per principal (None: no limit).
        clock: monotonic seconds. wall: Unix seconds (OpenAI's ``created``).
    """

    def __init__(
        self, tokens: TokenStore | None, limits: Limits, *, max_body_bytes: int, rate: RequestRate | None = None,
        clock: Callable[[], float] = time.monotonic, wall: Callable[[], float] = time.time,
    ) -> None:  # fmt: skip
        self.tokens = tokens
        self.limits = limits
        self.max_body_bytes = max_body_bytes
        self.rate = rate if rate is not None else RequestRate(0.0)
        self.clock = clock
        self.wall = wall
        self.connections: set[OpenAIConnection] = set()
        self.stats = DoorStats()
        self.prefixes = PrefixMemo()  # chats' next turns hash only their new blocks (protocol/prompts.py)
        self._hosts: dict[str | None, str | None] = {}  # --insecure: Host header -> why refused (a parse each)
        # Plan ids: a random prefix per door and a counter (no urandom per request); unique per process run.
        self._plan_ids = map(f"oai-{secrets.token_hex(6)}{{:x}}".format, itertools.count(1))

    def new_plan_id(self) -> str:
        """A plan id of this door's making (``oai-`` and 12 random hex digits per door, then a counter)."""
        return next(self._plan_ids)

    def divert(self, first: bytes) -> OpenAIConnection | Literal[False] | None:
        """The connection's protocol when its first bytes ask for an OpenAI route; False: not ours
        (the websocket handshake goes on); None: too few bytes to tell yet."""
        whole = first_line(first, _LONGEST)
        line = first[:_LONGEST] if whole is None else whole
        parts = line.split(b" ", 2)
        if len(parts) < 2:  # the method is not whole yet (methods are short)
            return None if whole is None and len(line) < 16 else False
        target = parts[1]
        path = target.split(b"?", 1)[0]
        if len(parts) > 2 or whole is not None or b"?" in target:  # the path is whole
            return OpenAIConnection(self) if path in _ROUTE_BYTES else False
        if len(line) < _LONGEST and any(route.startswith(path) for route in _ROUTE_BYTES):
            return None  # it may still become a route
        return False

    def answered(self, status: int) -> None:
        self.stats.answered(status)

    def admit(self, request: HttpRequest) -> Principal:
        """The principal of the request's key, within its request rate.

        Raises:
            ApiError: 401 without a key or with an unknown one, 403 for a worker's; 403 under
                ``--insecure`` for a Host that is not loopback; 429 past the principal's request rate.
        """
        principal = self._principal(request.headers)
        wait_s = self.rate.admit(principal.name, self.clock())
        if wait_s > 0:
            self.stats.rate_limited += 1
            raise ApiError(429, f"{principal.name!r} is over its rate of {self.rate.rate:g} requests per second to "
                                "this coordinator (--openai-rate); retry after the Retry-After seconds",
                           code="rate_limit_exceeded", retry_after_s=float(math.ceil(wait_s)))  # fmt: skip
        return principal

    def _principal(self, headers: dict[str, str]) -> Principal:
        if self.tokens is None:
            host = headers.get("host")
            refused = self._hosts.get(host, "")
            if refused == "":
                if len(self._hosts) >= _MAX_HOSTS:
                    self._hosts.clear()
                refused = self._hosts[host] = host_refused(host, self.limits.allowed_hosts)
            if refused is not None:
                raise ApiError(403, refused, code="host_not_allowed")
            return _INSECURE
        token = bearer_token_of(headers)
        if token is None:
            raise ApiError(401, "You didn't provide an API key: send 'Authorization: Bearer <client token>'",
                           code="invalid_api_key")  # fmt: skip
        principal = self.tokens.authenticate(token)
        if principal is None:
            raise ApiError(401, "Incorrect API key provided: it is no client token of this coordinator",
                           code="invalid_api_key")  # fmt: skip
        if principal.role == "worker":
            raise ApiError(403, "a worker token cannot make requests: use a client or admin token",
                           code="permission_denied")  # fmt: skip
        return principal

    def serve(self, conn: OpenAIConnection, request: HttpRequest) -> None:
        """Answer ``request``, whole or through an exchange set on ``conn`` (each port's own)."""
        raise NotImplementedError


def route_of(request: HttpRequest) -> Kind | None:
    """The completion kind of the request's path; None for ``/v1/models``.

    Raises:
        ApiError: 404 for another path, 405 for a method the path does not take.
    """
    kind = PATHS.get(request.path)
    if kind is None and request.path != _MODELS:
        raise ApiError(404, f"unknown path {request.path}; the OpenAI routes are {', '.join(_ROUTES)}")
    wanted = "GET" if kind is None else "POST"
    if request.method != wanted:
        raise ApiError(405, f"{request.path} takes {wanted}, not {request.method}")
    return kind


class OpenAIDoor(OpenAIEntry):
    """The OpenAI routes of one core's port (module docstring).

    Args:
        driver: the core's driver (its core, its sinks, its flush, cluster mode's redirect).
        tokens, limits, max_body_bytes, rate, clock, wall: as :class:`OpenAIEntry`'s.
        queue_timeout_s: how long a request waits for a worker (503 after).
        durable: False (``--openai-durable off``): the requests' plans are never written to the store
            (``CoreDriver.volatile``), so no step of theirs waits for a commit (docs/OPENAI.md §Durability).
    """

    def __init__(
        self, driver: CoreDriver, tokens: TokenStore | None, limits: Limits, *, max_body_bytes: int,
        queue_timeout_s: float, rate: RequestRate | None = None, clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time, durable: bool = True,
    ) -> None:  # fmt: skip
        super().__init__(tokens, limits, max_body_bytes=max_body_bytes, rate=rate, clock=clock, wall=wall)
        self.driver = driver
        self.queue_timeout_s = queue_timeout_s
        self.durable = durable
        self.models = ModelTable(driver.core.registry.iter_alive)
        self.ids = itertools.count(CONN_ID_BASE)

    def serve(self, conn: OpenAIConnection, request: HttpRequest) -> None:
        keep = request.keep_alive
        try:
            kind = route_of(request)
            principal = self.admit(request)
            pool = request.headers.get("x-fleetwire-pool")
            if kind is None:
                self.list_models(conn, keep, check_pool(pool) if pool is not None else None)
                return
            parsed = parse_request(kind, request.body, session=request.headers.get("x-fleetwire-session"), pool=pool,
                                   hasher=self.prefixes.hashes)  # fmt: skip
        except ApiError as error:
            conn.answer(error.status, error_response(error, keep_alive=keep), keep)
            return
        self.take(conn, principal, parsed, keep, len(request.body))

    def list_models(self, conn: OpenAIConnection, keep: bool, pool: str | None) -> None:
        """``GET /v1/models`` answered on ``conn`` (of ``pool``'s workers when the request named one)."""
        listing = self.models.listing(self.clock(), int(self.wall()), pool)
        conn.answer(200, json_response(200, listing, keep_alive=keep), keep)

    def take(self, conn: OpenAIConnection, principal: Principal, request: DoorRequest, keep: bool, body_bytes: int,
             plan_id: str = "") -> None:  # fmt: skip
        """Submit an admitted, parsed request's plan and answer it on ``conn`` as its events come.

        ``plan_id``: the one a cluster's main port picked its shard by ("": a new one).
        """
        try:
            if self.driver.redirect is not None:
                plan_id = self._plan_id_here(request, plan_id or self.new_plan_id(), self.driver.redirect)
            if not self.models.serves(request.model, self.clock(), request.pool or None):
                in_pool = f" of pool {request.pool!r}" if request.pool else ""
                raise ApiError(404, f"The model '{request.model}' does not exist: no connected worker{in_pool} serves "
                                    "it (GET /v1/models lists the fleet's)", code="model_not_found", param="model")
        except ApiError as error:
            conn.answer(error.status, error_response(error, keep_alive=keep), keep)
            return
        exchange = Exchange(self, conn, principal, request, keep, body_bytes, plan_id)
        conn.exchange = exchange
        exchange.start()

    def _plan_id_here(self, request: DoorRequest, plan_id: str, redirect: Redirect) -> str:
        """Cluster mode, a shard's own port: the plan must belong to this core's shard, whose store alone it
        may be written to. A request with no session key to a partitioned pool takes a plan id of a partition
        here.

        Raises:
            ApiError: 421 for a request of another shard, naming where that shard is served.
        """
        submit = request.submit(SUBMIT_REQ)
        submit.plan_id = plan_id
        moved = redirect("client", submit)
        tries = 1
        while moved is not None and not submit.hints.session_key and tries < _PLACE_TRIES:
            submit.plan_id = self.new_plan_id()
            moved = redirect("client", submit)
            tries += 1
        if moved is not None:
            where = f" (served at {moved.url})" if moved.url else " (no coordinator serves it now)"
            raise ApiError(421, f"this port serves another shard than the request's, shard {moved.shard}{where}: "
                                "send OpenAI requests to a cluster coordinator's main port", code="misdirected")
        return submit.plan_id


def bearer_token_of(headers: dict[str, str]) -> str | None:
    """The key of an ``Authorization: Bearer`` header (lower-cased names), or None."""
    value = headers.get("authorization", "")
    scheme, _, token = value.partition(" ")
    token = token.strip()
    return token if scheme.lower() == "bearer" and token else None


class InFlight(Protocol):
    """A request a connection is answering: its exchange with a core, or its forward to another coordinator."""

    def abandon(self) -> None:
        """The client went away before the answer was complete."""

    def writable(self, ok: bool) -> None:
        """The client's socket buffer went over its high-water mark (False), or back under it (True)."""


class OpenAIConnection(asyncio.Protocol):
    """One HTTP/1.1 connection of the OpenAI door: its requests, one at a time (module docstring)."""

    def __init__(self, door: OpenAIEntry) -> None:
        self.door = door
        self.reader = RequestReader(MAX_HEAD_BYTES, door.max_body_bytes)
        self.transport: asyncio.Transport | None = None
        self.queue: deque[HttpRequest] = deque()
        self.exchange: InFlight | None = None
        self.closing = False
        self.address = ""  # the client's host:port, for the core's sessions
        self._timer: asyncio.TimerHandle | None = None
        self._idle_until: float | None = None  # loop time the next request must be whole by (None: one is served)

    # ------------------------------------------------------------------ asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast("asyncio.Transport", transport)  # uvloop's TCPTransport is no asyncio.Transport subclass
        transport = self.transport
        transport.set_write_buffer_limits(high=_WRITE_HIGH)
        peer = transport.get_extra_info("peername")
        self.address = f"{peer[0]}:{peer[1]}" if peer else ""
        door = self.door
        door.connections.add(self)
        limit = door.limits.max_connections
        if limit and len(door.connections) > limit:
            self.refuse(ApiError(503, f"the coordinator is at its limit of {limit} connections; retry later",
                                 retry_after_s=1.0))  # fmt: skip
            return
        self._idle()

    def data_received(self, data: bytes) -> None:
        if self.closing:
            return
        try:
            items = self.reader.feed(data)
        except ApiError as error:
            self.refuse(error)
            return
        for item in items:
            if isinstance(item, bytes):
                self.write(item)
            else:
                self.queue.append(item)
        if self.queue and self.exchange is None:
            self.next_request()
        elif self.transport is not None and (len(self.queue) >= _MAX_PIPELINED or self.reader.buffered > _MAX_AHEAD):
            self.transport.pause_reading()  # a pipeliner far ahead: it waits in the kernel, not here

    def connection_lost(self, exc: Exception | None) -> None:
        self.closing = True
        self.door.connections.discard(self)
        if self._timer is not None:
            self._timer.cancel()
        if self.exchange is not None:
            self.exchange.abandon()  # the client went away: its plan is cancelled

    def pause_writing(self) -> None:
        # An exchange's cap is the pending bytes' (module docstring): asyncio keeps buffering meanwhile; a
        # forward stops reading its upstream.
        if self.exchange is not None:
            self.exchange.writable(False)

    def resume_writing(self) -> None:
        if self.exchange is not None:
            self.exchange.writable(True)

    # ------------------------------------------------------------------ requests

    def write(self, data: bytes) -> bool:
        """Write ``data``; False (and the connection aborted) when the reader is a slow consumer."""
        transport = self.transport
        if transport is None or self.closing:
            return False
        transport.write(data)
        if transport.get_write_buffer_size() > self.door.limits.max_pending_bytes:
            self.door.stats.slow_consumers += 1
            self.closing = True
            transport.abort()
            return False
        return True

    def refuse(self, error: ApiError) -> None:
        """Answer ``error`` and close: the connection's framing is lost, or it may not stay."""
        self.door.answered(error.status)
        self.write(error_response(error, keep_alive=False))
        self.close()

    def close(self) -> None:
        self.closing = True
        if self.transport is not None:
            self.transport.close()

    def _idle(self) -> None:
        """Each request head and body within the handshake timeout; an idle kept-alive connection closes.

        One timer per connection, moved lazily: when it fires early (a request was served since it was
        set) it is set again for what is left, so a request costs no new timer (a hot path).
        """
        loop = asyncio.get_running_loop()
        self._idle_until = loop.time() + self.door.limits.handshake_timeout_s
        if self._timer is None:
            self._timer = loop.call_at(self._idle_until, self._timed_out)

    def _timed_out(self) -> None:
        self._timer = None
        if self._idle_until is None:
            return  # a request is served: the timer is set again once the connection is idle
        loop = asyncio.get_running_loop()
        if loop.time() < self._idle_until:
            self._timer = loop.call_at(self._idle_until, self._timed_out)
            return
        if self.exchange is None and not self.closing:
            if self.reader.buffered or self.queue:
                self.refuse(ApiError(400, "the request was not sent in time"))
            else:
                self.close()

    def next_request(self) -> None:
        """Serve the next whole request; reading pauses while one is in flight."""
        while self.queue and self.exchange is None and not self.closing:
            request = self.queue.popleft()
            self._idle_until = None  # the timer, when it fires, leaves the connection be (_timed_out)
            try:
                self.door.serve(self, request)
            except Exception:  # a bug costs this request a 500 and its connection, never the port
                log.error("the OpenAI door failed on a request", path=request.path, exception=traceback.format_exc())
                self.refuse(ApiError(500, "internal error; see the coordinator's log"))
        if self.transport is not None and not self.closing and self.exchange is None:
            self.transport.resume_reading()
            self._idle()

    def answer(self, status: int, data: bytes, keep_alive: bool) -> None:
        """A whole answer written at once; the connection goes on or closes."""
        self.door.answered(status)
        if self.write(data) and not keep_alive:
            self.close()

    def finished(self, keep_alive: bool) -> None:
        """The exchange in flight is answered."""
        self.exchange = None
        if not keep_alive:
            self.close()
            return
        self.next_request()
