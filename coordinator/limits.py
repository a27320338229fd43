"""Limits that keep one peer from taking the coordinator down, and their defaults.

Rules (docs/OPERATIONS.md §Security and §Test matrix rows 15-22):

* **Frame size**, per role: a larger frame closes that connection with 1009 (websockets
  enforces it while reading, before the frame is buffered whole).
* **Compression** is never negotiated, so no frame can inflate (no decompression bombs).
* **Handshake time**: a connection that has not finished its HTTP upgrade within
  ``handshake_timeout_s`` is dropped (slowloris).
* **Connections**: past ``max_connections`` open sessions the upgrade is answered 503.
* **Message rate**, per connection: a token bucket of ``rate`` messages per second with
  room for a ``burst``. A peer over its rate is throttled first (the coordinator stops
  reading from it until the bucket refills, which pushes back through TCP); a peer that
  stays over it for ``flood_grace_s`` without a break is closed with 4429.
* **Unfinished plans per principal**: a ``submit`` past ``max_plans_per_client`` queued,
  leased or running plans, or past ``max_bytes_per_client`` bytes of them (args, requirements
  and a fixed overhead per plan; issue 17 finding 3), is answered ``error(too_many_plans)``
  with a message naming the count or the bytes; nothing is dropped. The core
  enforces it (``PlanQuota``), so that limit is a ``CoreConfig`` field, as are the per-plan
  event bounds ``max_events_per_plan`` and ``max_event_bytes_per_plan``.
* **Outgoing buffer**, per session: messages waiting for a peer that does not read are
  bounded by ``max_pending_messages`` and by about ``max_pending_bytes``; past either the
  session is closed with 4503 and the buffer freed (the peer resumes from its last ``seq``
  after reconnecting). The bytes are measured where they are known: the encoded frames the
  writer has taken and not yet sent and the socket's write buffer, plus an estimate of the
  messages not yet encoded (issue 17 finding 2: a ``plans`` reply used to count as 64 bytes). A
  large replay to a peer that reads is sent in slices (``Streams.pump``), so it is not
  mistaken for one that does not read.
* **Cost per principal** (issue 17 finding 1): every request is charged what it costs, in
  *work units* (one per message and one per KiB of the frame it came in, plus the rows a
  ``list_plans`` or ``subscribe`` scans and the events a replay sends; the core counts those,
  ``Outbox.work``), against a token bucket per
  principal (``cost_rate`` units per second, ``cost_burst`` at once) shared by all its
  connections. A principal over it is throttled: its readers stop reading until the bucket
  refills. Within one frame, once its requests have cost ``frame_cost_budget`` units the rest
  wait for the next loop turn, so one frame of expensive requests never holds the loop.
* **Connections per principal** (finding 4): one principal may hold at most
  ``max_connections_per_principal`` open sessions (default a quarter of ``max_connections``, at least 16),
  and clients may not take the last ``worker_connection_reserve`` slots (default a tenth),
  which only workers may use; past either the upgrade is answered 503.
* **Penalty box**: a peer closed for abuse (1009 oversize frame, 4400 protocol violations,
  4429 flood) is refused at its next upgrades with HTTP 429 and ``Retry-After`` for a
  cool-off of ``penalty_base_s``, doubling with each further offence up to
  ``penalty_max_s``; a peer that stays clean for ``penalty_max_s`` after its last cool-off
  starts from the base again. The key is the token's principal name and the peer's IP
  address (the address only with ``--insecure``), so a hostile reconnect loop costs one
  HTTP answer per attempt instead of a websocket session (docs/OPERATIONS.md §Test matrix row 16). Each 429
  is held ``penalty_hold_s`` before it is sent: a loop that ignores ``Retry-After`` then
  makes one attempt per hold per connection instead of hundreds per second, and a held
  connection costs a timer, not CPU. Open sessions of the same principal are not touched.
* **Origin**: a handshake that carries an ``Origin`` header (a browser) is refused 403
  unless the origin is the coordinator's own (same host and port) or in ``allowed_origins``.
  Non-browser peers send no Origin; Origin is not authentication (RFC 6455 §10.1).
* **Host under --insecure** (DNS rebinding): without tokens, the Origin check alone let a page
  on an attacker's name that resolves to 127.0.0.1 pass (its Origin and Host agree). With
  ``--insecure`` every handshake's ``Host`` must name a loopback address (127.0.0.0/8, ::1,
  ``localhost``) or one of ``allowed_hosts``; otherwise 403 (:func:`host_refused`).
* **Pending handshakes**: at most ``max_pending_handshakes`` TCP connections may be between
  accept and the end of their upgrade; a new one past it evicts the oldest
  (coordinator/io/frontdoor/admission.py). Before that, the kernel holds a new connection until its
  first byte for up to ``defer_accept_s`` (``TCP_DEFER_ACCEPT``), so idle sockets mostly never
  reach the coordinator at all. Refusal warnings are rate-limited per peer address: the
  first ``refusal_log_burst`` per ``refusal_log_interval_s``, then one summary line.

Everything here is plain computation with time passed in, so the sans-I/O core may use it.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field
from typing import Final, Literal
from urllib.parse import urlsplit

__all__ = [
    "PENALIZED_CLOSES", "CostBuckets", "Limits", "PenaltyBox", "PlanQuota", "TokenBucket", "host_refused",
    "origin_refused",
]

Role = Literal["worker", "client"]

#: Close codes that put the peer in the penalty box: 1009 (frame too big), 4400 (protocol
#: violations), 4429 (flood). Literal values: this module must not import the protocol package.
PENALIZED_CLOSES: Final = frozenset({1009, 4400, 4429})


@dataclass(frozen=True)
class Limits:
    """Every limit the coordinator's server enforces, with its default (the core's are ``CoreConfig``'s).

    Attributes:
        max_connections: open websocket sessions (both roles together); 0: no limit.
        handshake_timeout_s: time to finish the HTTP upgrade (TLS included).
        worker_frame_bytes / client_frame_bytes: largest frame per role; None: the
            server's ``max_frame_bytes``.
        worker_rate / client_rate: sustained messages per second per connection; 0: no limit.
        worker_burst / client_burst: messages a connection may send at once above its rate.
        flood_grace_s: how long a connection may stay throttled before it is closed 4429.
        max_pending_messages: messages queued for one peer that is not reading.
        max_pending_bytes: about how many bytes may be queued for it (sizes are estimated).
        max_commit_backlog_bytes: bytes of received frames whose records wait for the store;
            past it every reader stops reading until the writer is back under half (TCP
            holds the senders back); 0: no bound.
        allowed_origins: browser origins accepted besides the coordinator's own
            (``https://dash.example.com``; ``*`` accepts any).
        ping_interval_s / ping_timeout_s: websocket pings; a peer that does not answer
            within the timeout is closed 1011 (half-open TCP, matrix row 22). None: off.
            Only client sessions are pinged unless ``ServerSettings.ping_workers``.
        close_timeout_s: how long a closing connection waits for the peer's side of the
            close before the TCP connection is dropped (a vanished peer never answers).
        penalty_base_s: cool-off after a peer's first abusive close (1009, 4400, 4429):
            its next upgrades get HTTP 429; 0: no penalty box.
        penalty_max_s: the longest cool-off (each further offence doubles it up to this).
        penalty_hold_s: how long a 429 of the penalty box is held before it is answered
            (at most half the handshake timeout is used).
        max_pending_handshakes: TCP connections between accept and the end of their upgrade;
            past it the oldest is dropped; 0: no budget. The server also keeps it to a quarter
            of the process's open-file limit.
        defer_accept_s: how long the kernel may hold a new TCP connection until its first byte
            before the coordinator accepts it (``TCP_DEFER_ACCEPT``, Linux; rounded up to the
            kernel's SYN-ACK retransmit schedule); None: the handshake timeout; 0: off.
        allowed_hosts: with ``--insecure``, ``Host`` names accepted besides loopback ones.
        refusal_log_burst: refusals per peer address and interval logged one by one.
        refusal_log_interval_s: the interval; the rest are summed up in one line at its end.
        max_connections_per_principal: open sessions one client principal may hold; None: a
            quarter of ``max_connections``, at least 16; 0: no limit.
        worker_connection_reserve: of ``max_connections``, slots only workers may take; None:
            a tenth of it; 0: none.
        cost_rate / cost_burst: work units per second a principal may spend, and at once
            (:class:`TokenBucket` without the close); 0 rate: no limit.
        frame_cost_budget: work units one frame's requests may cost before the rest wait for
            the next loop turn.
    """

    max_connections: int = 10_000
    handshake_timeout_s: float = 10.0
    worker_frame_bytes: int | None = None
    client_frame_bytes: int | None = None
    worker_rate: float = 20_000.0
    worker_burst: int = 100_000
    client_rate: float = 5_000.0
    client_burst: int = 50_000
    flood_grace_s: float = 5.0
    max_pending_messages: int = 50_000
    max_pending_bytes: int = 64 << 20
    max_commit_backlog_bytes: int = 64 << 20
    allowed_origins: tuple[str, ...] = ()
    ping_interval_s: float | None = 20.0
    ping_timeout_s: float | None = 20.0
    close_timeout_s: float = 5.0
    penalty_base_s: float = 1.0
    penalty_max_s: float = 60.0
    penalty_hold_s: float = 1.0
    max_pending_handshakes: int = 1024
    defer_accept_s: float | None = None  # None: the handshake timeout; 0: off
    allowed_hosts: tuple[str, ...] = ()
    refusal_log_burst: int = 5
    refusal_log_interval_s: float = 60.0
    max_connections_per_principal: int | None = None  # None: a quarter of max_connections (>= 16); 0: no limit
    worker_connection_reserve: int | None = None  # None: a tenth of max_connections; 0: none
    cost_rate: float = 200_000.0  # work units per second per principal; 0: no limit
    cost_burst: int = 1_000_000
    frame_cost_budget: int = 20_000  # work units of one frame's requests per loop turn

    def check(self) -> None:
        """Raise ``ValueError`` naming the first limit that cannot work."""
        for name in ("max_connections", "max_commit_backlog_bytes", "max_pending_handshakes", "refusal_log_burst",
                     "max_connections_per_principal", "worker_connection_reserve"):
            if getattr(self, name) is None:
                continue
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0 (0: no limit), got {getattr(self, name)}")
        if not self.handshake_timeout_s > 0:
            raise ValueError(f"handshake timeout must be > 0 seconds, got {self.handshake_timeout_s}")
        if self.defer_accept_s is not None and not self.defer_accept_s >= 0:
            raise ValueError(f"defer accept must be >= 0 seconds (0: off), got {self.defer_accept_s}")
        if not self.refusal_log_interval_s > 0:
            raise ValueError(f"refusal log interval must be > 0 seconds, got {self.refusal_log_interval_s}")
        if not self.close_timeout_s > 0:
            raise ValueError(f"close timeout must be > 0 seconds, got {self.close_timeout_s}")
        if not self.cost_rate >= 0:
            raise ValueError(f"cost_rate must be >= 0 work units/s (0: no limit), got {self.cost_rate}")
        for name in ("cost_burst", "frame_cost_budget"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1 work units, got {getattr(self, name)}")
        for name in ("worker_rate", "client_rate"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name} must be >= 0 messages/s (0: no limit), got {getattr(self, name)}")
        for name in ("worker_burst", "client_burst", "max_pending_messages", "max_pending_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("worker_frame_bytes", "client_frame_bytes"):
            value = getattr(self, name)
            if value is not None and value < 1024:
                raise ValueError(f"{name} must be >= 1024 bytes, got {value}")
        if not self.flood_grace_s >= 0:
            raise ValueError(f"flood grace must be >= 0 seconds, got {self.flood_grace_s}")
        if not self.penalty_hold_s >= 0:
            raise ValueError(f"penalty hold must be >= 0 seconds, got {self.penalty_hold_s}")
        if not self.penalty_base_s >= 0:
            raise ValueError(f"penalty base must be >= 0 seconds (0: off), got {self.penalty_base_s}")
        if self.penalty_base_s and not self.penalty_max_s >= self.penalty_base_s:
            raise ValueError(
                f"penalty max ({self.penalty_max_s} s) must be at least the base ({self.penalty_base_s} s)"
            )

    def frame_bytes(self, role: Role, default: int) -> int:
        """The largest frame a ``role`` session may send."""
        value = self.worker_frame_bytes if role == "worker" else self.client_frame_bytes
        return default if value is None else value

    @property
    def principal_connections(self) -> int:
        """Open sessions one principal may hold (0: no limit)."""
        if self.max_connections_per_principal is not None:
            return self.max_connections_per_principal
        # A quarter, but at least 16 (a small --max-connections is a test or a laptop, not a shared fleet).
        return max(self.max_connections // 4, min(self.max_connections, 16)) if self.max_connections else 0

    @property
    def worker_reserve(self) -> int:
        """Of ``max_connections``, the slots only workers may take."""
        if self.worker_connection_reserve is not None:
            return self.worker_connection_reserve
        return self.max_connections // 10

    def connection_refusal(self, role: Role, principal: str, open_sessions: int, held: int) -> str | None:
        """Why a new ``role`` session of ``principal`` is refused (503), or None.

        ``open_sessions``: sessions open now; ``held``: those of ``principal``.
        """
        limit = self.max_connections
        if limit and open_sessions >= limit:
            return f"the coordinator is at its limit of {limit} connections; retry later"
        if role == "client" and limit and open_sessions >= limit - self.worker_reserve:
            return (
                f"the coordinator's last {self.worker_reserve} of {limit} connections are kept for workers "
                "(--worker-connection-reserve); retry later"
            )
        share = self.principal_connections
        if role == "client" and share and held >= share:  # a worker token is often a whole fleet's
            return (
                f"{principal!r} already holds {held} connections, its share of the coordinator's "
                f"(--max-connections-per-principal {share}); close some or retry later"
            )
        return None

    def cost_bucket(self, now: float) -> TokenBucket | None:
        """A principal's cost limiter (throttles only; never closes); None when off."""
        if self.cost_rate <= 0:
            return None
        return TokenBucket(self.cost_rate, self.cost_burst, float("inf"), now)

    def bucket(self, role: Role, now: float) -> TokenBucket | None:
        """A fresh rate limiter for a new ``role`` connection; None when the role has no limit."""
        if role == "worker":
            rate, burst = self.worker_rate, self.worker_burst
        else:
            rate, burst = self.client_rate, self.client_burst
        if rate <= 0:
            return None
        return TokenBucket(rate, burst, self.flood_grace_s, now)


class CostBuckets:
    """Each principal's work-unit bucket (:meth:`Limits.cost_bucket`), shared by all its sessions.

    Made on first use; bounded: past ``max_principals`` all are forgotten (each starts full again).
    """

    def __init__(self, limits: Limits, max_principals: int = 100_000) -> None:
        self.limits = limits
        self.max_principals = max_principals
        self._buckets: dict[str, TokenBucket] = {}

    def get(self, principal: str, now: float) -> TokenBucket | None:
        """The principal's bucket; None when the cost limit is off."""
        bucket = self._buckets.get(principal)
        if bucket is None:
            bucket = self.limits.cost_bucket(now)
            if bucket is None:
                return None
            if len(self._buckets) > self.max_principals:
                self._buckets.clear()
            self._buckets[principal] = bucket
        return bucket


#: A token bucket's break (:class:`TokenBucket`): a message that leaves this many seconds of the rate unused.
#: Module level, not a ClassVar of the dataclass: mypyc's dataclasses took a ClassVar for a field (setup.py).
BREAK_S: Final = 0.05


@dataclass
class TokenBucket:
    """A per-connection message rate limit that throttles first and closes a sustained flood.

    Each message takes a token; tokens come back at ``rate`` per second up to ``burst``.
    :meth:`take` answers how long to stop reading so the peer falls back to its rate, or
    None once the peer has been over its rate for ``grace_s`` without a break (close 4429).
    A break is a message that leaves at least :data:`BREAK_S` worth of the rate unused in the
    bucket, i.e. the peer slowed down below its rate. (Merely finding a token is no break:
    the reader's own pause refills the bucket to about zero, so a flooder that TCP holds
    back would always find one. A peer at 95 % of its rate is forgiven within a second.)
    """

    rate: float
    burst: int
    grace_s: float
    last_s: float
    tokens: float = field(init=False)
    throttled_since: float | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        self.tokens = float(self.burst)
        self.throttled_since = None  # the field's default again: compiled (setup.py), an init=False default is not set

    def take(self, n: int, now: float) -> float | None:
        """Charge ``n`` messages received at ``now``.

        Returns:
            0.0 within the rate; seconds to pause reading when over it; None when the peer
            has stayed over it for longer than the grace (close the connection with 4429).
        """
        self.tokens = min(float(self.burst), self.tokens + (now - self.last_s) * self.rate)
        self.last_s = now
        self.tokens -= n
        if self.tokens >= 0:
            if self.tokens >= min(float(self.burst), self.rate * BREAK_S):
                self.throttled_since = None  # a break: it left some of its rate unused
            return 0.0
        if self.throttled_since is None:
            self.throttled_since = now
        elif now - self.throttled_since > self.grace_s:
            return None
        return -self.tokens / self.rate


class PenaltyBox:
    """Cool-offs for peers closed for abuse, so their reconnect loop costs almost nothing.

    :meth:`offend` records an abusive close; :meth:`refusal` answers, at the next upgrade,
    how long the peer must still wait. The first offence costs ``base_s``, each further one
    twice the last, up to ``max_s``; a peer clean for ``max_s`` after its cool-off ended
    starts again from the base. Memory is bounded: at most ``max_keys`` peers are kept,
    the least recent offender forgotten first.

    Args:
        base_s: the first cool-off; 0 turns the box off.
        max_s: the longest cool-off, and how long strikes are remembered after one ends.
        max_keys: peers remembered at most.
    """

    def __init__(self, base_s: float, max_s: float, max_keys: int = 10_000) -> None:
        self.base_s = base_s
        self.max_s = max_s
        self.max_keys = max_keys
        self._boxed: dict[str, tuple[int, float]] = {}  # key -> (strikes, cool-off end); oldest offence first

    def offend(self, key: str, now: float) -> float:
        """Record an abusive close of ``key`` at ``now``; returns its cool-off (0.0 when off)."""
        if self.base_s <= 0:
            return 0.0
        entry = self._boxed.pop(key, None)
        strikes = 1 if entry is None or now - entry[1] > self.max_s else entry[0] + 1
        cool_s = min(self.max_s, self.base_s * 2.0 ** min(strikes - 1, 60))
        self._boxed[key] = (strikes, now + cool_s)  # re-inserted last: the most recent offender
        while len(self._boxed) > self.max_keys:
            del self._boxed[next(iter(self._boxed))]
        return cool_s

    def refusal(self, key: str, now: float) -> float | None:
        """Seconds ``key`` must still wait before it may connect, or None if it may now."""
        entry = self._boxed.get(key)
        if entry is None:
            return None
        left = entry[1] - now
        if left > 0:
            return left
        if -left > self.max_s:  # clean long enough: forget its strikes
            del self._boxed[key]
        return None

    def boxed(self, now: float) -> int:
        """Peers in a cool-off now (for /metrics; O(peers remembered))."""
        return sum(1 for _, until in self._boxed.values() if until > now)


class PlanQuota:
    """Unfinished plans per principal, by count and by bytes, so one client cannot fill the queue or memory.

    The core adds a plan when it is submitted and releases it when its terminal event is
    emitted; both are O(1) and idempotent. Each plan is counted with its size (its args and
    requirements as the core sizes payloads, and a fixed overhead: issue 17 finding 3).

    Args:
        limit: the most unfinished plans a principal may hold; 0: no limit.
        max_bytes: the most bytes of unfinished plans a principal may hold; 0: no byte limit.
    """

    def __init__(self, limit: int, max_bytes: int = 0) -> None:
        self.limit = limit
        self.max_bytes = max_bytes
        self._open: dict[str, dict[str, int]] = {}  # principal -> plan id -> its size
        self._bytes: dict[str, int] = {}

    def refusal(self, principal: str, size: int = 0) -> str | None:
        """Why ``principal`` may not submit one more plan (of ``size`` bytes) now, or None if it may."""
        if self.limit > 0:
            held = len(self._open.get(principal, ()))
            if held >= self.limit:
                return (
                    f"{principal!r} already has {held} unfinished plans, the limit "
                    f"(coordinator flag --max-plans-per-client); wait for some to finish or cancel them"
                )
        if self.max_bytes > 0:
            held_bytes = self._bytes.get(principal, 0)
            if held_bytes + size > self.max_bytes:
                return (
                    f"{principal!r} holds {held_bytes} bytes of unfinished plans and this one is {size} bytes, past "
                    f"the byte limit of {self.max_bytes} (coordinator flag --max-bytes-per-client); wait for some "
                    "to finish, cancel them, or send smaller args"
                )
        return None

    def add(self, principal: str, plan_id: str, size: int = 0) -> None:
        """Count a new unfinished plan of ``size`` bytes."""
        if self.limit > 0 or self.max_bytes > 0:
            plans = self._open.setdefault(principal, {})
            if plan_id not in plans:
                plans[plan_id] = size
                self._bytes[principal] = self._bytes.get(principal, 0) + size

    def release(self, principal: str, plan_id: str) -> None:
        """The plan finished; a plan not counted is ignored."""
        plans = self._open.get(principal)
        if plans is not None:
            size = plans.pop(plan_id, None)
            if size is not None:
                self._bytes[principal] -= size
            if not plans:
                del self._open[principal]
                self._bytes.pop(principal, None)

    def held(self, principal: str) -> int:
        """Unfinished plans counted for ``principal``."""
        return len(self._open.get(principal, ()))

    def held_bytes(self, principal: str) -> int:
        """Bytes of unfinished plans counted for ``principal``."""
        return self._bytes.get(principal, 0)


def origin_refused(origin: str | None, host: str | None, allowed: tuple[str, ...]) -> str | None:
    """Why a handshake from ``origin`` is refused (cross-site websocket hijacking), or None.

    Args:
        origin: the ``Origin`` header; None for non-browser peers, which pass.
        host: the ``Host`` header, which a browser sets to the coordinator it dials.
        allowed: extra origins accepted (scheme://host[:port]); ``*`` accepts any.
    """
    if origin is None or "*" in allowed:
        return None
    normalized = origin.strip().rstrip("/").lower()
    if normalized in (o.rstrip("/").lower() for o in allowed):
        return None
    parts = urlsplit(normalized)
    if host and parts.scheme in ("http", "https") and parts.netloc == host.strip().lower():
        return None  # the coordinator's own pages (same host and port)
    return f"origin {origin!r} is not allowed; add it with --allowed-origin"


def host_refused(host: str | None, allowed: tuple[str, ...]) -> str | None:
    """With ``--insecure``: why a handshake's ``Host`` header is refused (DNS rebinding), or None.

    A page on ``evil.example`` that resolves to 127.0.0.1 reaches a loopback coordinator with
    its own name in ``Host`` (and a matching ``Origin``). Without tokens, only loopback names
    (127.0.0.0/8, ::1, ``localhost``) and the operator's ``allowed`` names (``--allowed-host``)
    are accepted.

    Args:
        host: the ``Host`` header (``name``, ``name:port``, ``[v6]:port``); None when absent.
        allowed: extra host names accepted (a port in them is ignored).
    """
    name = _host_name(host or "")
    if name:
        if name == "localhost" or name in (_host_name(a) for a in allowed):
            return None
        try:
            if ipaddress.ip_address(name).is_loopback:
                return None
        except ValueError:
            pass
    return (
        f"Host {host!r} is not a loopback address: with --insecure the coordinator answers only "
        "127.0.0.1, ::1 or localhost (a guard against DNS rebinding); add --allowed-host NAME to accept another"
    )


def _host_name(host: str) -> str:
    """``Host`` without its port and brackets, lower-case, without a trailing dot."""
    host = host.strip().lower()
    if host.startswith("["):
        host = host[1:].partition("]")[0]
    elif host.count(":") == 1:
        host = host.partition(":")[0]
    return host.rstrip(".")
