"""The socket side of admission: TLS contexts, reading a handshake's bearer token, the gatekeeper.

Who may connect (tokens, roles, the token file) is decided by the pure coordinator/auth.py;
this module applies it to websocket handshakes before the upgrade (docs/PROTOCOL.md §1).

Every websocket listener of a coordinator process has one :class:`Gatekeeper`, with the same
code: a single coordinator's port (coordinator/io/frontdoor/server.py) and a cluster's main port
(coordinator/io/cluster/host.py) each listen through :meth:`Gatekeeper.serve` (the pending
budget, the handshake timeout, ``TCP_DEFER_ACCEPT``), and their front door
(coordinator/io/frontdoor/door.py) decides each upgrade with :meth:`Gatekeeper.upgrade` (Origin,
limits, token, penalty box; refusals held when repeated).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import hashlib
import math
import ssl
import time
import weakref
from collections.abc import Callable, Coroutine, Iterable
from typing import Any, Final, Literal, Protocol

import structlog
from websockets.asyncio.server import Server, ServerConnection, serve
from websockets.datastructures import Headers
from websockets.http11 import Request, Response

from coordinator.auth import Principal, TokenStore
from coordinator.io.frontdoor.admission import (
    LISTEN_BACKLOG,
    PendingHandshakes,
    RefusalLog,
    Repeats,
    defer_accept,
    pending_budget,
    raise_fd_limit,
)
from coordinator.io.frontdoor.connection import FailFastConnection
from coordinator.limits import PENALIZED_CLOSES, Limits, PenaltyBox, host_refused, origin_refused
from protocol import caps
from protocol.tracecontext import ACCEPTS_HEADER, ACCEPTS_SHORT_UNSAMPLED
from protocol.urls import WORKER_ID_PARAM, named_worker_id

__all__ = [
    "BEARER_SUBPROTOCOL_PREFIX", "Gatekeeper", "bearer_token", "peer_identity", "server_tls_context",
    "subprotocol_refused",
]

log = structlog.get_logger("coordinator.auth")

#: Failed authentications (401) or /metrics scrapes per peer address and window answered at once;
#: past it each further one is held ``--penalty-hold`` (coordinator/io/frontdoor/admission.py ``Repeats``).
REPEAT_BURST: Final = 100
REPEAT_INTERVAL_S: Final = 10.0


class Peer(Protocol):
    """A connection the gate counts repeats of: a websocket connection, or a plain HTTP one (ops/metrics_http.py)."""

    @property
    def remote_address(self) -> Any: ...


def server_tls_context(cert_file: str, key_file: str, client_ca_file: str | None = None) -> ssl.SSLContext:
    """The coordinator's TLS context: TLS 1.2 or later, and client certificates when asked.

    With ``client_ca_file`` a presented client certificate must chain to that CA; the
    server then requires one on ``/v1/worker`` (mTLS for workers) and leaves clients and
    browsers, which cannot easily hold one, to their tokens.

    Raises:
        ValueError: a file is missing or is not a PEM certificate/key.
    """
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        context.load_cert_chain(cert_file, key_file)
    except (OSError, ssl.SSLError) as exc:
        raise ValueError(f"cannot load TLS certificate {cert_file} / key {key_file}: {exc}") from None
    if client_ca_file is not None:
        try:
            context.load_verify_locations(cafile=client_ca_file)
        except (OSError, ssl.SSLError) as exc:
            raise ValueError(f"cannot load the client CA file {client_ca_file}: {exc}") from None
        context.verify_mode = ssl.CERT_OPTIONAL
    return context



BEARER_SUBPROTOCOL_PREFIX: Final = "fleetwire.bearer."


def bearer_token(headers: Headers) -> str | None:
    """The bearer token of a handshake: the Authorization header, else an offered subprotocol.

    Browsers cannot set headers, so they offer ``fleetwire.bearer.<base64url token>`` as a
    subprotocol (docs/PROTOCOL.md §1); the server never selects or echoes it.
    """
    value = headers.get("Authorization")
    if value:
        scheme, _, token = value.partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            return None
        return token.strip()
    for header in headers.get_all("Sec-WebSocket-Protocol"):
        for offered in header.split(","):
            offered = offered.strip()
            if offered.startswith(BEARER_SUBPROTOCOL_PREFIX):
                encoded = offered[len(BEARER_SUBPROTOCOL_PREFIX):]
                try:
                    return base64.urlsafe_b64decode(encoded + "=" * (-len(encoded) % 4)).decode()
                except (binascii.Error, UnicodeDecodeError):
                    return None
    return None


_BASE64URL: Final = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_")


def subprotocol_refused(headers: Headers, supported: tuple[str, ...]) -> str | None:
    """Why the subprotocols a handshake offers are refused (HTTP 400), or None.

    Offering nothing, or only ``fleetwire.bearer.<token>``, is fine (msgpack, the default).
    Names other than the bearer one must include a supported subprotocol: a peer that offers
    only ``fleetwire.v2.json`` would otherwise get a session in an encoding it never asked for.
    The bearer token must be unpadded base64url: ``=`` is not allowed in a subprotocol name
    (RFC 6455 §4.1: an HTTP token), and browsers refuse it too (docs/PROTOCOL.md §1).
    """
    others: list[str] = []
    for header in headers.get_all("Sec-WebSocket-Protocol"):
        for offered in header.split(","):
            offered = offered.strip()
            if not offered:
                continue
            if offered.startswith(BEARER_SUBPROTOCOL_PREFIX):
                encoded = offered[len(BEARER_SUBPROTOCOL_PREFIX):]
                if not encoded or not _BASE64URL.issuperset(encoded):
                    return (
                        f"the subprotocol {BEARER_SUBPROTOCOL_PREFIX}<token> must carry the token as unpadded "
                        "base64url (A-Z a-z 0-9 - _, no '='): a subprotocol name may not hold '='"
                    )
            else:
                others.append(offered)
    if others and not any(name in supported for name in others):
        shown = ", ".join(others)[:200]
        return f"unsupported subprotocol {shown}; this coordinator speaks {' or '.join(supported)}"
    return None


def peer_identity(conn: ServerConnection) -> str:
    """The SHA-256 (hex) of the peer's verified client certificate; "" without TLS or a certificate.

    A worker session with the same identity as the live holder of a worker id may take that id
    over (coordinator/worker_sessions/registration.py): the certificate's private key is the proof.
    """
    ssl_object = conn.transport.get_extra_info("ssl_object")
    if ssl_object is None:
        return ""
    der = ssl_object.getpeercert(binary_form=True)
    return hashlib.sha256(der).hexdigest() if der else ""


class Gatekeeper:
    """Admits or refuses a websocket upgrade, before it happens (docs/PROTOCOL.md §1).

    In order: with ``--insecure`` a ``Host`` that is not loopback (403, DNS rebinding), a
    browser's Origin (403), the connection limit (503), a worker's client
    certificate when mTLS is on (403), the bearer token (401 missing or unknown, 403 for a
    role that may not open the path), the penalty box (429 with ``Retry-After`` while the
    principal, from that address, is cooling off after an abusive close: :meth:`offence`).
    Refusals are logged with the peer's address, the path and, when the token was known, its
    principal's name; never the token. The log is rate-limited per address (:class:`RefusalLog`:
    the first few per interval, then one summary line), and 429s once per cool-off, so a
    reconnect loop does not turn into a log flood; /metrics counts every one.

    Before the handshake, :attr:`pending` bounds the connections still in it
    (coordinator/io/frontdoor/admission.py); :meth:`fit_fd_limit` sizes it at start.

    The penalty box is keyed by principal name *and* peer IP address (IP only with
    ``--insecure``): a worker token is often shared by a whole fleet, and one host that
    misbehaves must not keep the others from reconnecting. A worker id past its reconnect
    budget (the core's 4429, coordinator/reconnects.py) whose upgrade named the id
    (``?worker_id=``) is boxed under principal, address *and* that id: its neighbours on the
    same host and token, with other ids, are let in at once; an upgrade that names no id
    keeps the principal-and-address key.

    Args:
        tokens: the tokens in force; None accepts everyone (``--insecure``).
        limits: the server's limits.
        max_frame_bytes: the default frame limit, per role overridden by ``limits``.
        mtls_workers: whether ``/v1/worker`` requires a verified client certificate.
    """

    def __init__(
        self, tokens: TokenStore | None, limits: Limits, *, max_frame_bytes: int, mtls_workers: bool = False
    ) -> None:
        self.tokens = tokens
        self.limits = limits
        self.max_frame_bytes = max_frame_bytes
        self.mtls_workers = mtls_workers
        self._admitted: weakref.WeakKeyDictionary[ServerConnection, Principal] = weakref.WeakKeyDictionary()
        self.penalty = PenaltyBox(limits.penalty_base_s, limits.penalty_max_s)
        self.hold_s = min(limits.penalty_hold_s, limits.handshake_timeout_s / 2)
        self.penalties: dict[str, int] = {}  # cool-offs imposed, by the close code that caused them
        self._cooling_logged: set[str] = set()  # keys whose 429 was logged in their current cool-off
        self.refusal_log = RefusalLog(burst=limits.refusal_log_burst, interval_s=limits.refusal_log_interval_s)
        self.pending = PendingHandshakes(limits.max_pending_handshakes, self.refusal_log, limits.handshake_timeout_s)
        self.defer_accept_s = 0  # TCP_DEFER_ACCEPT seconds in force on the listening sockets (defer_accept)
        # Repeated 401s and /metrics scrapes from one address are answered after a hold (admission.py).
        self.auth_failures = Repeats(burst=REPEAT_BURST, interval_s=REPEAT_INTERVAL_S)
        self.scrapes = Repeats(burst=REPEAT_BURST, interval_s=REPEAT_INTERVAL_S)
        # What a client session's 101 says this coordinator accepts (docs/PROTOCOL.md §1); "": nothing said.
        self.accepts = ACCEPTS_SHORT_UNSAMPLED

    def fit_fd_limit(self, reserved: int) -> None:
        """At start: raise the soft open-file limit to the hard one and fit the pending budget to it.

        ``reserved``: fds the open sessions may take (``--max-connections``); a limit below them
        plus the budget is logged, since connections past it would fail in ``accept``.
        """
        before, soft = raise_fd_limit()
        if soft > before:
            log.info("raised the open-file limit", soft_before=before, soft=soft)
        configured = self.limits.max_pending_handshakes
        if configured:
            self.pending.limit = pending_budget(configured, soft)
            if self.pending.limit < configured:
                log.warning("pending-handshake budget lowered to fit the open-file limit", configured=configured,
                            budget=self.pending.limit, fd_limit=soft)  # fmt: skip
        if reserved + self.pending.limit + 64 > soft:
            log.warning("the open-file limit is below --max-connections plus the pending-handshake budget; "
                        "connections past it will fail (raise the hard limit: ulimit -Hn, LimitNOFILE=)",
                        fd_limit=soft, max_connections=reserved, pending_budget=self.pending.limit)  # fmt: skip

    def defer_accept(self, sockets: Iterable[Any]) -> int:
        """At start: the kernel holds new connections on ``sockets`` until their first byte (admission.py).

        Returns the seconds in force (0: off or unavailable); ``self.defer_accept_s`` keeps them for /metrics.
        """
        wanted = self.limits.defer_accept_s
        wanted = self.limits.handshake_timeout_s if wanted is None else wanted
        self.defer_accept_s = defer_accept(sockets, wanted)
        if wanted and not self.defer_accept_s:
            log.info("TCP_DEFER_ACCEPT is unavailable here: idle sockets are accepted at once and bounded by the "
                     "pending-handshake budget and the handshake timeout only")  # fmt: skip
        return self.defer_accept_s

    def admit(
        self,
        conn: ServerConnection,
        request: Request,
        path: str,
        role: Literal["worker", "client"],
        open_sessions: int,
        held: Callable[[str], int] | None = None,
    ) -> Response | None:
        """None to go on with the upgrade (the principal is kept for :meth:`principal`), else the refusal.

        ``held``: open sessions of a principal, for its connection share (coordinator/limits.py).
        """
        address = _address(conn)
        headers = request.headers
        refusal = self.refusal_log.refused
        if self.tokens is None:  # --insecure: only loopback names (DNS rebinding)
            refused = host_refused(headers.get("Host"), self.limits.allowed_hosts)
            if refused is not None:
                refusal(address, "host not loopback", host=headers.get("Host"), path=path)
                return conn.respond(403, refused + "\n")
        refused = origin_refused(headers.get("Origin"), headers.get("Host"), self.limits.allowed_origins)
        if refused is not None:
            refusal(address, "origin", origin=headers.get("Origin"), path=path)
            return conn.respond(403, refused + "\n")
        limit = self.limits.max_connections
        if limit and open_sessions >= limit:
            refusal(address, "connection limit", limit=limit, path=path)
            return conn.respond(503, f"the coordinator is at its limit of {limit} connections; retry later\n")
        if role == "worker" and self.mtls_workers and not conn.transport.get_extra_info("peercert"):
            refusal(address, "no client certificate", path=path)
            return conn.respond(
                403, "a client certificate is required: this coordinator requires mTLS for workers "
                     "(--tls-client-ca) and none was presented; the token was not checked\n",
            )
        if self.tokens is None:
            principal = Principal(role, role)
        else:
            token = bearer_token(headers)
            if token is None:
                refusal(address, "missing token", path=path)
                return self._throttled(_unauthorized(conn, "missing 'Authorization: Bearer <token>' header"), address)
            found = self.tokens.authenticate(token)
            if found is None:
                refusal(address, "invalid token", path=path)
                return self._throttled(_unauthorized(conn, "invalid token"), address)
            if found.path_role != role:
                refusal(address, "wrong role", principal=found.name, token_role=found.role, path=path)
                return conn.respond(403, f"a {found.role} token cannot open {path}; use a {role} token\n")
            principal = found
        # Connection shares (issue 17 finding 4): a client principal's share, and the workers' reserve.
        # Without tokens every client is one principal: only the reserve applies.
        count = held(principal.name) if held is not None and self.tokens is not None else 0
        shared = self.limits.connection_refusal(role, principal.name, open_sessions, count)
        if shared is not None:
            refusal(address, "connection share", principal=principal.name, held=count, path=path)
            return conn.respond(503, shared + "\n")
        named = named_worker_id(request.path) if role == "worker" else None
        if named is not None and (too_long := caps.too_long(WORKER_ID_PARAM, named, caps.MAX_WORKER_ID_BYTES)):
            refusal(address, "worker id too long", principal=principal.name, path=path)
            return conn.respond(400, f"the upgrade's query parameter {too_long}\n")
        now = time.monotonic()
        key = self._penalty_key(principal, conn)
        left = self.penalty.refusal(key, now)
        if left is not None:
            return self._cooling(conn, principal, key, left, path, address)
        if named is not None:  # this id's own cool-off (its reconnect budget): its neighbours are not held
            key = self._penalty_key(principal, conn, named)
            left = self.penalty.refusal(key, now)
            if left is not None:
                return self._cooling(conn, principal, key, left, path, address, named)
        # Set before the upgrade completes, so the limit applies from the session's first frame.
        conn.protocol.max_message_size = self.limits.frame_bytes(role, self.max_frame_bytes)
        self._admitted[conn] = principal
        return None

    def offence(self, principal: Principal, conn: ServerConnection, code: int, *, per_worker_id: bool = False) -> None:
        """``conn`` of ``principal`` was closed with ``code``: an abusive close starts a cool-off.

        Codes outside :data:`~coordinator.limits.PENALIZED_CLOSES` are ignored. ``per_worker_id``
        (a worker id past its reconnect budget): keyed by the id the upgrade named too, when it named one.
        """
        if code not in PENALIZED_CLOSES or self.penalty.base_s <= 0:
            return
        request = conn.request
        named = named_worker_id(request.path) if per_worker_id and request is not None else None
        key = self._penalty_key(principal, conn, named)
        cool_s = self.penalty.offend(key, time.monotonic())
        self._cooling_logged.discard(key)
        name = str(code)
        self.penalties[name] = self.penalties.get(name, 0) + 1
        log.warning("penalty box: new connections refused (HTTP 429) for a while", principal=principal.name,
                    address=_address(conn), worker_id=named, code=code, cooloff_s=round(cool_s, 3))

    def _cooling(
        self, conn: ServerConnection, principal: Principal, key: str, left_s: float, path: str, address: str,
        worker_id: str | None = None,
    ) -> Response:
        if key not in self._cooling_logged:
            if len(self._cooling_logged) > 10_000:
                self._cooling_logged.clear()  # bounded; at worst a 429 is logged twice
            self._cooling_logged.add(key)
            log.warning("refused connection", reason="penalty box", principal=principal.name, path=path,
                        address=address, worker_id=worker_id, retry_after_s=round(left_s, 3))
        wait_s = max(1, math.ceil(left_s - self.hold_s))
        if worker_id is not None:
            why = (f"worker id {worker_id!r} of {principal.name!r} reconnected more often than its reconnect budget "
                   f"allows; retry in {wait_s} s")  # fmt: skip
        else:
            why = (f"{principal.name!r} was recently closed for abuse (an oversize frame, protocol violations or "
                   f"flooding); retry in {wait_s} s")  # fmt: skip
        response = conn.respond(429, why + "\n")
        response.headers["Retry-After"] = str(wait_s)
        return response

    def _throttled(self, response: Response, address: str) -> Response:
        """A 401 past the address's burst of failures carries ``Retry-After`` and is held (:meth:`should_hold`)."""
        if self.hold_s > 0 and self.auth_failures.over(address):
            response.headers["Retry-After"] = str(max(1, math.ceil(self.hold_s)))
        return response

    def unauthorized(self, conn: ServerConnection, why: str) -> Response:
        """A 401 (``why``) for a plain HTTP request that needs a token, counted as the upgrades' failures are."""
        return self._throttled(_unauthorized(conn, why), _address(conn))

    def auth_failed(self, conn: Peer) -> bool:
        """Count a failed authentication from ``conn``'s address; whether it is past the burst (hold the 401)."""
        return self.hold_s > 0 and self.auth_failures.over(_address(conn))

    def should_hold(self, response: Response) -> bool:
        """Whether a refusal is answered only after :meth:`hold`: a penalty-box 429, or a 401 past its
        address's burst of failed authentications."""
        return response.status_code == 429 or (response.status_code == 401 and "Retry-After" in response.headers)

    def scrape_held(self, conn: Peer) -> bool:
        """Count a ``/metrics`` answer to ``conn``'s address; whether it is past the burst (hold it)."""
        return self.hold_s > 0 and self.scrapes.over(_address(conn))

    async def hold(self, response: Response, conn: ServerConnection | None = None) -> Response:
        """``response`` (a penalty-box 429, a repeated 401 or scrape) after ``penalty_hold_s`` (limits.py), or as
        soon as ``conn`` is gone: a peer that dropped its connection does not keep its handler for the rest."""
        if conn is None:
            await asyncio.sleep(self.hold_s)
        else:
            await asyncio.wait([conn.connection_lost_waiter], timeout=self.hold_s)
        return response

    def answer(
        self, response: Response, conn: ServerConnection | None = None
    ) -> Response | Coroutine[Any, Any, Response]:
        """``response`` as a ``process_request`` hook returns it: after :meth:`hold` when :meth:`should_hold`."""
        return self.hold(response, conn) if self.should_hold(response) else response

    def upgrade(
        self,
        conn: ServerConnection,
        request: Request,
        path: str,
        role: Literal["worker", "client"],
        open_sessions: int,
        held: Callable[[str], int] | None = None,
        count: Callable[[int], None] | None = None,
    ) -> Response | Coroutine[Any, Any, Response] | None:
        """The gate's answer to a websocket upgrade of ``path``, as a ``process_request`` hook returns it.

        :meth:`admit`; a refusal is passed to ``count`` (its HTTP status) and, a penalty-box 429
        or a repeated 401, answered after :meth:`hold`. None: the upgrade goes on.
        """
        refused = self.admit(conn, request, path, role, open_sessions, held)
        if refused is None:
            return None
        if count is not None:
            count(refused.status_code)
        return self.answer(refused, conn)

    async def serve(
        self, handler: Callable[[ServerConnection], Coroutine[Any, Any, None]], host: str | None, port: int,
        **options: Any,
    ) -> Server:
        """``websockets.serve`` behind this gate; ``options`` (``process_request``, ``ssl``, ...) are passed on.

        Connections are counted from their accept against :attr:`pending` (oldest evicted, no
        websocket connection until their first byte), the kernel holds them until that byte
        (:meth:`defer_accept`), the handshake has ``--handshake-timeout``, frames the largest
        per-role limit (:meth:`admit` sets each connection's own), and no compression is
        negotiated (decompression bombs; fleetwire frames are small msgpack).
        """
        limits = self.limits
        server = await serve(
            handler, host, port,
            compression=None,
            server_header=None,
            max_size=max(self.max_frame_bytes, limits.frame_bytes("worker", self.max_frame_bytes),
                         limits.frame_bytes("client", self.max_frame_bytes)),
            open_timeout=limits.handshake_timeout_s,  # slowloris: unfinished handshakes are dropped
            ping_interval=limits.ping_interval_s,
            ping_timeout=limits.ping_timeout_s,
            close_timeout=limits.close_timeout_s,
            # A 1009 stops reading that peer at once (coordinator/io/frontdoor/connection.py).
            create_connection=self.pending.connection_class(FailFastConnection),
            backlog=LISTEN_BACKLOG,  # room for the connections TCP_DEFER_ACCEPT holds back
            process_response=self.announce,
            **options,
        )  # fmt: skip
        self.defer_accept(server.sockets)  # idle sockets wait in the kernel, not here (admission.py)
        return server

    def announce(self, conn: ServerConnection, request: Request, response: Response) -> None:
        """The ``process_response`` hook: a client session's ``101`` names what this coordinator accepts
        (:data:`~protocol.tracecontext.ACCEPTS_HEADER`; its session has no ``welcome`` to say it)."""
        if response.status_code == 101 and self.accepts and request.path.startswith("/v1/client"):
            response.headers[ACCEPTS_HEADER] = self.accepts

    def close(self) -> None:
        """The listener stopped: abort the connections still before their upgrade, write the refusal summaries."""
        self.pending.close()
        self.refusal_log.close()

    async def wait_closed(self, server: Server) -> int:
        """Wait for the handlers of ``server`` (of :meth:`serve`, closed), within a bound; how many were cancelled.

        A handshake ends within ``--handshake-timeout`` (a held answer's hold included), and a session
        whose connection is closed within the close timeout: past both, a handler still running waits
        on something else (a database that does not answer) and is cancelled, so that a stop never
        waits for ever (``websockets``' own ``wait_closed`` has no bound).
        """
        grace_s = self.limits.handshake_timeout_s + self.limits.close_timeout_s
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(grace_s):
                await server.wait_closed()
                return 0
        running = [task for task in server.handler_tasks if not task.done()]
        log.error("sessions still running after the listener closed; cancelling them", running=len(running),
                  waited_s=grace_s)  # fmt: skip
        for task in running:
            task.cancel()
        with contextlib.suppress(TimeoutError):  # a cancelled handler ends its connection within the close timeout
            async with asyncio.timeout(self.limits.close_timeout_s + 1.0):
                await server.wait_closed()
        return len(running)

    def _penalty_key(self, principal: Principal, conn: ServerConnection, worker_id: str | None = None) -> str:
        remote = conn.remote_address
        host = str(remote[0]) if remote else ""
        key = host if self.tokens is None else f"{principal.name}@{host}"
        return key if worker_id is None else f"{key}#{worker_id}"  # "#" is in no address nor principal name

    def principal(self, conn: ServerConnection) -> Principal:
        """The principal :meth:`admit` let in on ``conn``.

        Raises:
            KeyError: ``conn`` was not admitted (a driver bug; the connection is dropped).
        """
        return self._admitted.pop(conn)


def _unauthorized(conn: ServerConnection, why: str) -> Response:
    response = conn.respond(401, why + "\n")
    response.headers["WWW-Authenticate"] = 'Bearer realm="fleetwire"'
    return response


def _address(conn: Peer) -> str:
    remote = conn.remote_address
    return f"{remote[0]}:{remote[1]}" if remote else ""
