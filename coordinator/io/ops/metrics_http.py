"""What ``/metrics`` costs and who may read it: a cached exposition, an optional token, a separate bind.

A scrape walks every worker and plan (coordinator/io/ops/metrics.py): O(workers) on the event loop
every session shares. Six scrape loops against 1,501 workers took a full core and raised other
peers' p50 from 2 ms to 208 ms. So (docs/OPERATIONS.md §Metrics):

* :class:`ExpositionCache` rebuilds the exposition at most once per ``--metrics-cache`` seconds
  (default 2); scrapes in between get the same bytes. Prometheus scrapes every 15-60 s, so the
  figures are at most that much older than the scrape.
* ``--metrics-token``: when set, ``/metrics`` answers 401 without ``Authorization: Bearer <token>``.
* ``--metrics-listen HOST:PORT``: ``/metrics`` (and ``/healthz``) are served by
  :class:`MetricsListener` on their own socket, e.g. an interface only the monitoring network
  reaches, and the main port answers 404 for ``/metrics``. It is plain HTTP/1.1, one request per
  connection, the request head bounded (8 KiB, ``--handshake-timeout``; parsed and answered by
  protocol/transfer/http1.py: a malformed head gets 400), and capped as the main port is
  (:class:`MetricsListener`): idle sockets there must not take the fds the main port needs.
"""

from __future__ import annotations

import asyncio
import hmac
import math
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Final

import structlog

from coordinator.io.frontdoor.admission import LISTEN_BACKLOG, ConnectionBudget, defer_accept
from protocol.transfer import http1

if TYPE_CHECKING:
    from coordinator.io.frontdoor.gate import Gatekeeper

__all__ = ["MAX_CONNECTIONS", "ExpositionCache", "MetricsListener", "metrics_token_refused", "parse_listen"]

log = structlog.get_logger(__name__)

_MAX_HEAD_BYTES: Final = 8192
_TEXT: Final = "text/plain; charset=utf-8"
#: Connections ``--metrics-listen`` holds open at once; past it the oldest is aborted. Kept small, so
#: sockets there never take the file descriptors the main port needs.
MAX_CONNECTIONS: Final = 64


class ExpositionCache:
    """The exposition, rebuilt at most every ``max_age_s`` seconds (0: on every scrape).

    Args:
        build: renders the exposition (the expensive part).
        max_age_s: how old the cached bytes may be.
        clock: monotonic seconds.
    """

    def __init__(self, build: Callable[[], bytes], max_age_s: float, clock: Callable[[], float] = time.monotonic):
        self.build = build
        self.max_age_s = max_age_s
        self.builds = 0  # how many times the exposition was rendered (tests, /metrics itself)
        self._clock = clock
        self._body: bytes | None = None
        self._at = 0.0

    def get(self) -> bytes:
        """The cached exposition, rebuilt first when it is older than ``max_age_s``."""
        now = self._clock()
        if self._body is None or now - self._at >= self.max_age_s:
            self._body = self.build()
            self._at = now
            self.builds += 1
        return self._body


def metrics_token_refused(authorization: str | None, token: str | None) -> str | None:
    """Why a ``/metrics`` request with this ``Authorization`` header is refused (401), or None."""
    if token is None:
        return None
    scheme, _, given = (authorization or "").partition(" ")
    if scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), token.encode()):
        return None
    return "/metrics needs 'Authorization: Bearer <token>' with the coordinator's --metrics-token"


def wants_openmetrics(accept: str | None) -> bool:
    """Whether a scrape's ``Accept`` asks for OpenMetrics (Prometheus does when it keeps exemplars: the latency
    histograms' buckets then carry trace ids, docs/OPERATIONS.md §Tracing)."""
    return accept is not None and "application/openmetrics-text" in accept


def parse_listen(text: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[v6]:PORT`` for IPv6) as (host, port).

    Raises:
        ValueError: not of that form.
    """
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or not host or int(port) > 65535:
        raise ValueError(f"--metrics-listen needs HOST:PORT (e.g. 127.0.0.1:9464), got {text!r}")
    return host.strip("[]"), int(port)


class MetricsListener:
    """A plain HTTP listener for ``/metrics`` and ``/healthz`` only (``--metrics-listen``), capped as the main port.

    It shares the process's file descriptors with the main port, so it gets the main port's
    admission (coordinator/io/frontdoor/admission.py, issue 24 part 5): ``TCP_DEFER_ACCEPT`` (idle sockets
    wait in the kernel), a :class:`~coordinator.io.frontdoor.admission.ConnectionBudget` of
    ``max_connections`` open at once (past it the oldest is aborted: a scrape takes
    milliseconds, an idle socket becomes the oldest), a deadline for the request head from
    accept (``--handshake-timeout``) and again for the answer to be read, and the gate's
    repeat counts: scrapes or failed ``--metrics-token`` checks from one address past their
    burst are answered after ``--penalty-hold``. Each connection is a small asyncio protocol
    with a timer, no task. One request per connection, its head at most 8 KiB (431 past it).

    Args:
        exposition: the body and content type; None while the coordinator cannot answer (503).
        token: the ``--metrics-token``, if any.
        gate: the main port's gatekeeper: its limits, refusal log, repeat counts and hold.
        max_connections: connections held at once (a Prometheus server needs one at a time), at
            most the main port's pending-handshake budget.
    """

    def __init__(self, exposition: Callable[[bool], tuple[bytes, str] | None], token: str | None, gate: Gatekeeper,
                 max_connections: int = MAX_CONNECTIONS) -> None:  # fmt: skip
        self._exposition = exposition
        self._token = token
        self._gate = gate
        if gate.pending.limit:  # never above the main port's own budget (fitted to the open-file limit)
            max_connections = min(max_connections, gate.pending.limit)
        self.budget = ConnectionBudget(max_connections, gate.refusal_log, "metrics-listener connection budget")
        self.deadline_s = gate.limits.handshake_timeout_s
        self.idle_dropped = 0  # connections aborted at the deadline (no request head, or the answer not read)
        self.defer_accept_s = 0  # TCP_DEFER_ACCEPT seconds in force (frontdoor/admission.py defer_accept)
        self._server: asyncio.Server | None = None
        self.port = 0

    async def start(self, host: str, port: int) -> None:
        """Bind ``host:port`` (0: a free port, then read :attr:`port`)."""
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(lambda: _Scrape(self), host, port, backlog=LISTEN_BACKLOG)
        limits = self._gate.limits
        wanted = limits.handshake_timeout_s if limits.defer_accept_s is None else limits.defer_accept_s
        self.defer_accept_s = defer_accept(self._server.sockets, wanted)
        self.port = self._server.sockets[0].getsockname()[1]
        log.info("metrics listening", host=host, port=self.port, max_connections=self.budget.limit)

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            self.budget.close()
            await self._server.wait_closed()

    def respond(self, conn: _Scrape, head: bytes) -> None:
        """Answer ``conn``'s request ``head``: at once, or after the hold for a repeat past its burst."""
        extra: dict[str, str] = {}
        try:
            request = http1.parse_request(head)
        except http1.HeadError as exc:
            status, body, content_type = 400, f"{exc}\n".encode(), _TEXT
            path = ""
        else:
            path = request.path
            status, body, content_type, extra = self._answer(path, request.headers.get("authorization"),
                                                             request.headers.get("accept"))  # fmt: skip
        gate = self._gate
        held = False
        if status == 401:
            held = gate.auth_failed(conn)
            if held:
                extra["Retry-After"] = str(max(1, math.ceil(gate.hold_s)))
        elif path == "/metrics":
            held = gate.scrape_held(conn)
        headers = {"Content-Type": content_type, "Content-Length": str(len(body)), "Cache-Control": "no-store",
                   "Connection": "close", **extra}
        data = http1.format_response(status, headers) + body
        if held:
            asyncio.get_running_loop().call_later(gate.hold_s, conn.send, data)
        else:
            conn.send(data)

    def _answer(self, path: str, authorization: str | None,
                accept: str | None = None) -> tuple[int, bytes, str, dict[str, str]]:  # fmt: skip
        if path == "/healthz":
            return 200, b"ok\n", _TEXT, {}
        if path != "/metrics":
            return 404, b"this listener serves /metrics and /healthz\n", _TEXT, {}
        refused = metrics_token_refused(authorization, self._token)
        if refused is not None:
            return 401, (refused + "\n").encode(), _TEXT, {"WWW-Authenticate": 'Bearer realm="fleetwire"'}
        exposition = self._exposition(wants_openmetrics(accept))
        if exposition is None:
            return 503, b"not ready: loading the store\n", _TEXT, {"Retry-After": "1"}
        body, content_type = exposition
        return 200, body, content_type, {}


class _Scrape(asyncio.Protocol):
    """One connection of :class:`MetricsListener`: its request head, then its answer, under one deadline each."""

    __slots__ = ("_head", "_listener", "_timer", "remote_address", "transport")

    def __init__(self, listener: MetricsListener) -> None:
        self._listener = listener
        self._head: bytes | None = b""  # None once the head is complete
        self._timer: asyncio.TimerHandle | None = None
        self.transport: Any = None
        self.remote_address: Any = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport
        self.remote_address = transport.get_extra_info("peername")
        self._listener.budget.opened(self)
        self._timer = asyncio.get_running_loop().call_later(self._listener.deadline_s, self._expired)

    def data_received(self, data: bytes) -> None:
        if self._head is None:
            return  # one request per connection: what follows it is ignored
        head = self._head + data
        try:
            end = http1.head_end(head, _MAX_HEAD_BYTES)
        except http1.HeadTooLarge:
            self._head = None
            self.send(http1.format_response(431, {"Content-Length": "0", "Connection": "close"}))
            return
        if end < 0:
            self._head = head
            return
        self._head = None
        self.transport.pause_reading()
        self._listener.respond(self, head[:end])

    def send(self, data: bytes) -> None:
        """Write the answer and close; the peer gets a fresh deadline to read it."""
        transport = self.transport
        if transport.is_closing():
            return
        transport.write(data)
        transport.close()
        if self._timer is not None:
            self._timer.cancel()
        self._timer = asyncio.get_running_loop().call_later(self._listener.deadline_s, self._expired)

    def _expired(self) -> None:
        self._timer = None
        self._listener.idle_dropped += 1
        self.transport.abort()

    def eof_received(self) -> bool:
        return self._head is None  # a half-closed peer with its request in still gets the answer

    def connection_lost(self, exc: Exception | None) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._listener.budget.finished(self)

