"""Admission before the handshake: the pending-handshake budget, the fd limit, rate-limited refusal logs.

What the gatekeeper (coordinator/io/frontdoor/gate.py) needs that is about sockets and clocks rather than
tokens (docs/OPERATIONS.md §Security). Every listener of the process applies it: the main port,
``--metrics-listen`` (coordinator/io/ops/metrics_http.py) and a cluster's main port
(coordinator/io/cluster/host.py), since they share the process's file descriptors: 1,100 idle
sockets at ``--metrics-listen`` alone used to make the main port's connects fail (issue 24).

* **Pending handshakes.** A TCP connection that has not finished its websocket upgrade costs a
  file descriptor and holds no token yet. ``--max-connections`` counts finished upgrades only,
  so idle token-less sockets were bounded by nothing but the process's fd limit: at a
  shell's 1,024 fds, 1,100 idle sockets made legitimate connects fail. :class:`PendingHandshakes`
  (a :class:`ConnectionBudget`: each listener keeps one) keeps at most ``max_pending_handshakes``
  of them; a new connection past the budget evicts the *oldest* pending one (its TCP
  connection is aborted). A real handshake takes milliseconds, so it is almost never the
  oldest; an idle socket always becomes it. Each is also bounded in time by
  ``--handshake-timeout``. Evictions are counted (``fleetwire_handshakes_evicted_total``) and
  logged through :class:`RefusalLog`. (With TLS, asyncio runs the TLS handshake before the
  connection object exists: those sockets are bounded by ``--handshake-timeout`` only.)
* **Deferred accept.** Each idle socket the coordinator accepts costs it an accept, an asyncio
  transport, websockets' protocol object and a timer, and a reopen loop replaces every one it
  drops at once: 2,000 idle sockets made ~2,200 accepts a second (~75 µs each) and doubled a
  legitimate client's p99 on two cores. :func:`defer_accept` sets ``TCP_DEFER_ACCEPT`` on the
  listening sockets (Linux; what nginx's ``deferred`` and HAProxy's ``defer-accept`` do): the
  kernel completes the TCP handshake but hands the connection to ``accept`` only once its
  first byte arrives, or after about ``--defer-accept`` seconds (rounded up to its SYN-ACK
  retransmit schedule: 1, 3, 7, 15 s). Every real peer sends first (an HTTP upgrade, a TLS
  ClientHello), so it is accepted at once; an idle socket waits in the kernel's SYN queue,
  costing the coordinator nothing, and then the handshake timeout as before, so a reopen loop
  cycles once per defer + timeout instead of once per accept. The listen backlog
  (:data:`LISTEN_BACKLOG`, capped by ``net.core.somaxconn``) bounds that queue; SYNs past it
  get SYN cookies (accepted without deferral, so the pending budget still applies).
  Connections per address are not capped: peers behind one NAT address share it.
* **The fd limit.** :func:`raise_fd_limit` raises the soft ``RLIMIT_NOFILE`` to the hard limit
  at start (a shell's 1,024 is the usual soft default), and :func:`pending_budget` keeps the
  budget to a quarter of what the process may open, so pending handshakes alone never exhaust it.
* **Refusal logs.** One warning per refused connection let a single host write ~3,000 lines/s.
  :class:`RefusalLog` logs the first ``burst`` refusals per peer address per ``interval_s`` in
  full, counts the rest, and at the end of the interval writes one summary line per address:
  ``refused 2,931 connections from 10.0.0.5 in the last 60 s (invalid token: 2,931)``.
  /metrics still counts every refusal (``fleetwire_refusals_total``).
* **Repeats from one address.** A loop of upgrades with a wrong token (about 1,100 401s a second
  from one process) or of ``/metrics`` scrapes (about 1,900 a second) cost the coordinator a
  third to a half of a core in HTTP handling. :class:`Repeats` counts them per peer address in
  windows of ``interval_s``; past ``burst`` in a window, each further one is answered only after
  ``--penalty-hold`` (a 401 then carries ``Retry-After``), so a loop makes one attempt per hold
  per connection and a held connection costs a timer, not CPU (issue 17 findings 9 and 10).
  A Prometheus server scraping every 15 s or a person mistyping a token never gets there.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal, cast

import structlog
from websockets.asyncio.server import ServerConnection

from coordinator.io.frontdoor.connection import FailFastConnection
from wireio.listening import LISTEN_BACKLOG, defer_accept, raise_fd_limit
from wireio.listening import Repeats as HostRepeats

__all__ = ["LISTEN_BACKLOG", "ConnectionBudget", "PendingHandshakes", "RefusalLog", "Repeats", "defer_accept",
           "pending_budget", "raise_fd_limit"]

log = structlog.get_logger("coordinator.auth")

#: fds kept free for the store, the log, the listener and the process's own needs.
FD_RESERVE = 64


def pending_budget(configured: int, fd_limit: int) -> int:
    """The pending-handshake budget: ``configured``, but at most a quarter of the usable fds (and >= 8)."""
    return max(8, min(configured, (fd_limit - FD_RESERVE) // 4))


class ConnectionBudget:
    """At most ``limit`` connections at once in an early phase of their life; past it the oldest is aborted.

    The piece every listener shares (the main port's handshakes, ``--metrics-listen``, the
    cluster's main port): a connection is counted from :meth:`opened` (its accept) until
    :meth:`finished`; one opened past the limit aborts the *oldest* counted one. A real peer
    finishes its phase in milliseconds, so it is almost never the oldest; an idle socket always
    becomes it. One budget for every address: peers behind one NAT address are never refused
    for their neighbours' idle sockets (a per-address cap would refuse them). No I/O and no
    clock: a counted connection is anything with ``transport.abort()`` and ``remote_address``
    (``(host, port)`` or None).

    Args:
        limit: the budget; 0: no budget.
        refusals: where evictions are logged (rate-limited per address).
        reason: the refusal's reason in that log.
    """

    def __init__(self, limit: int, refusals: RefusalLog, reason: str = "pending-handshake budget") -> None:
        self.limit = limit
        self.reason = reason
        self.evicted = 0  # counted connections aborted to admit newer ones (for /metrics)
        self.accepted = 0  # connections opened (for /metrics)
        self._refusals = refusals
        self._pending: dict[Any, None] = {}  # insertion order: the oldest first

    def __len__(self) -> int:
        return len(self._pending)

    def opened(self, conn: Any) -> None:
        """A TCP connection was accepted: count it, evicting the oldest counted one past the budget."""
        pending = self._pending
        self.accepted += 1
        if self.limit and len(pending) >= self.limit:
            oldest = next(iter(pending))
            del pending[oldest]
            self.evicted += 1
            remote = oldest.remote_address
            address = f"{remote[0]}:{remote[1]}" if remote else ""
            self._refusals.refused(address, self.reason, limit=self.limit)
            oldest.transport.abort()
        pending[conn] = None

    def finished(self, conn: Any) -> None:
        """``conn`` is past the counted phase, or went away (idempotent)."""
        self._pending.pop(conn, None)

    def close(self) -> None:
        """The listener stops: abort every connection still counted."""
        for conn in list(self._pending):
            if conn.transport is not None:
                conn.transport.abort()
        self._pending.clear()


class PendingHandshakes(ConnectionBudget):
    """At most ``limit`` connections between TCP accept and the end of the websocket upgrade.

    :meth:`connection_class` is the ``create_connection`` of ``websockets.serve``. An accepted
    TCP connection starts as a :class:`_Accepted`, a bare asyncio protocol with a timer: the
    websocket connection (its object, its handler task, its handshake timeout) is built only
    when the peer's first byte arrives. An idle socket that never sends one, and that a reopen
    loop replaces as soon as it is evicted, therefore costs an accept, a small object and a
    timer handle instead of websockets' connection setup (about 10 µs instead of 110-160 µs,
    issue 17 finding 6). Either form counts against the budget (:class:`ConnectionBudget`) from
    accept until its handshake ends (upgraded, answered, timed out) or the connection is lost;
    a connection past the budget evicts the oldest pending one.

    Args:
        limit: the budget; 0: no budget.
        refusals: where evictions are logged.
        timeout_s: how long an accepted connection may wait for its first byte
            (``--handshake-timeout``; the handshake then gets its own timeout).
    """

    def __init__(self, limit: int, refusals: RefusalLog, timeout_s: float = 10.0) -> None:
        super().__init__(limit, refusals)
        self.timeout_s = timeout_s
        self.idle_dropped = 0  # accepted ones dropped at the timeout before their first byte (for /metrics)
        self.built = 0  # pending connections that sent a first byte and got a websocket connection
        # Shown a connection's first bytes: the protocol that takes it instead of a websocket connection (the
        # OpenAI door's routes, coordinator/io/frontdoor/openai_http.py), False: not its, None: too few to tell.
        self.divert: Callable[[bytes], asyncio.BaseProtocol | Literal[False] | None] | None = None

    def connection_class(self, base: type[FailFastConnection] = FailFastConnection) -> type[ServerConnection]:
        """The ``create_connection`` of ``websockets.serve``: accepted connections counted against this budget."""
        budget = self

        class Budgeted(base):  # type: ignore[valid-type,misc]
            accepted: _Accepted | None = None

            def connection_lost(self, exc: Exception | None) -> None:
                if self.accepted is not None:
                    budget.finished(self.accepted)
                super().connection_lost(exc)

            async def handshake(self, *args: Any, **kwargs: Any) -> None:
                try:
                    await super().handshake(*args, **kwargs)
                finally:
                    if self.accepted is not None:
                        budget.finished(self.accepted)

        def create_connection(protocol: Any, server: Any, **kwargs: Any) -> _Accepted:
            return _Accepted(budget, Budgeted, protocol, server, kwargs)

        # websockets calls ``create_connection`` like a class and uses what it returns as the asyncio protocol.
        return cast("type[ServerConnection]", create_connection)


class _Accepted(asyncio.Protocol):
    """An accepted TCP connection before its first byte: the websocket connection is built on it."""

    __slots__ = ("_budget", "_cls", "_first", "_kwargs", "_server", "_timer", "protocol", "transport")

    def __init__(self, budget: PendingHandshakes, cls: type[ServerConnection], protocol: Any, server: Any,
                 kwargs: dict[str, Any]) -> None:  # fmt: skip
        self._budget = budget
        self._cls = cls
        self._server = server
        self._kwargs = kwargs
        self._timer: asyncio.TimerHandle | None = None
        self._first = b""  # bytes shown to the budget's divert that could not tell yet
        self.protocol = protocol  # websockets' select_subprotocol closure checks ``connection.protocol``
        self.transport: Any = None

    @property
    def remote_address(self) -> Any:
        return self.transport.get_extra_info("peername") if self.transport is not None else None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport
        self._budget.opened(self)
        self._timer = asyncio.get_running_loop().call_later(self._budget.timeout_s, self._silent)

    def _silent(self) -> None:
        """No first byte within the timeout: drop it."""
        self._timer = None
        self._budget.idle_dropped += 1
        self.transport.abort()

    def data_received(self, data: bytes) -> None:
        """The first byte: hand the transport to a websocket connection, which goes on with the handshake;
        or to the protocol the budget's ``divert`` returns for the first bytes."""
        divert = self._budget.divert
        claimed: asyncio.BaseProtocol | Literal[False] | None = False
        if divert is not None:
            data = self._first + data
            claimed = divert(data)
            if claimed is None:  # too few bytes to tell: the first-byte timer still runs
                self._first = data
                return
            self._first = b""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        transport = self.transport
        if claimed:  # a protocol (None returned above, False: a websocket connection)
            self._budget.finished(self)  # no longer a pending handshake: the protocol bounds it now
            transport.set_protocol(claimed)
            claimed.connection_made(transport)
            cast("asyncio.Protocol", claimed).data_received(data)
            return
        conn = self._cls(self.protocol, self._server, **self._kwargs)
        conn.accepted = self  # type: ignore[attr-defined]
        self._budget.built += 1
        transport.set_protocol(conn)
        conn.connection_made(transport)
        conn.data_received(data)

    def eof_received(self) -> bool | None:
        return None  # the transport closes itself

    def connection_lost(self, exc: Exception | None) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._budget.finished(self)


class Repeats(HostRepeats):
    """Events per peer address (``host:port``, counted by its host) in windows of ``interval_s``: which
    ones are past ``burst`` (wireio/repeats.py; ``max_addresses``: hosts tracked at once).
    """

    def __init__(
        self, *, burst: int, interval_s: float, max_addresses: int = 10_000,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:  # fmt: skip
        super().__init__(burst=burst, interval_s=interval_s, max_hosts=max_addresses, clock=clock)

    def over(self, address: str) -> bool:
        """Count one event from ``address`` (``host:port``); whether it is past the burst of its window."""
        return super().over(_host(address))


@dataclass
class _Window:
    start_s: float
    logged: int = 0
    suppressed: dict[str, int] = field(default_factory=dict)  # reason -> refusals not logged one by one


class RefusalLog:
    """Refusal warnings, at most ``burst`` per peer address per ``interval_s``, the rest summed up.

    Args:
        burst: refusals per address and interval logged one by one.
        interval_s: the interval; its summary line is written when it ends.
        max_addresses: addresses tracked at once; past it new ones share one entry.
        clock: monotonic seconds.
    """

    OTHERS = "other addresses"

    def __init__(
        self, *, burst: int = 5, interval_s: float = 60.0, max_addresses: int = 10_000,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.burst = burst
        self.interval_s = interval_s
        self.max_addresses = max_addresses
        self.suppressed = 0  # refusals counted but not logged one by one (for /metrics)
        self._clock = clock
        self._windows: dict[str, _Window] = {}
        self._timer: asyncio.TimerHandle | None = None

    def refused(self, address: str, reason: str, **fields: Any) -> None:
        """One refused connection from ``address`` (``host:port``) for ``reason``."""
        now = self._clock()
        host = _host(address)
        windows = self._windows
        window = windows.get(host)
        if window is not None and now - window.start_s >= self.interval_s:
            self._summarize(host, window, now)
            window = None
        if window is None:
            if len(windows) >= self.max_addresses:
                self.flush()
                if len(windows) >= self.max_addresses:
                    host = self.OTHERS
            window = windows.get(host)
            if window is None:
                window = windows[host] = _Window(now)
        if window.logged < self.burst:
            window.logged += 1
            if window.logged == self.burst:
                fields["next"] = f"further refusals from this address are summed up every {self.interval_s:g} s"
            log.warning("refused connection", reason=reason, address=address, **fields)
            return
        window.suppressed[reason] = window.suppressed.get(reason, 0) + 1
        self.suppressed += 1
        self._schedule(window.start_s + self.interval_s - now)

    def flush(self) -> None:
        """Write the summary of every interval that has ended, and forget those addresses."""
        now = self._clock()
        for host, window in list(self._windows.items()):
            if now - window.start_s >= self.interval_s:
                self._summarize(host, window, now)

    def close(self) -> None:
        """Write the summaries still open (the coordinator stops) and cancel the timer."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        now = self._clock()
        for host, window in list(self._windows.items()):
            self._summarize(host, window, now)

    def _summarize(self, host: str, window: _Window, now: float) -> None:
        del self._windows[host]
        if not window.suppressed:
            return
        total = window.logged + sum(window.suppressed.values())
        reasons = ", ".join(f"{reason}: {n:,}" for reason, n in sorted(window.suppressed.items(), key=lambda x: -x[1]))
        seconds = max(1, round(min(now - window.start_s, self.interval_s)))
        log.warning(
            f"refused {total:,} connections from {host} in the last {seconds} s ({reasons}; "
            f"the first {window.logged} logged above)",
            address=host, refused=total,
        )

    def _schedule(self, delay_s: float) -> None:
        if self._timer is not None:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # no loop (a unit test): flush() is called by hand
            return
        self._timer = loop.call_later(max(0.0, delay_s), self._due)

    def _due(self) -> None:
        self._timer = None
        self.flush()
        pending = [w for w in self._windows.values() if w.suppressed]
        if pending:
            first = min(w.start_s for w in pending)
            self._schedule(first + self.interval_s - self._clock())


def _host(address: str) -> str:
    """``host:port`` (IPv6 ``::1:5555`` too) without its port."""
    host, sep, port = address.rpartition(":")
    return host if sep and port.isdigit() else address
