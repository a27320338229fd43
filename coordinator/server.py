"""The asyncio driver around the sans-I/O ``Coordinator`` core.

Theory of operation: every websocket connection gets a ``conn_id`` and a ``_Session``.
The connection's reader decodes a frame, feeds each message to the core with ``now``
and then *flushes*: the effects the core accumulated (messages per connection, closes)
are appended to each target session's pending list and its writer is woken. One writer
task per connection sends whatever is pending as a single frame, so frames to one
connection are coalesced while a send is in flight. Timers (the reaper) live here, never
in the core. Authentication happens in ``process_request``, before the upgrade
(docs/PROTOCOL.md §Handshake): 401 for a missing or wrong token, 403 for a token of the
other role, 404 for an unknown path.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import hmac
import itertools
import secrets
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal
from urllib.parse import urlsplit

import structlog
from websockets.asyncio.server import Server, ServerConnection, serve
from websockets.datastructures import Headers
from websockets.exceptions import ConnectionClosed
from websockets.http11 import Request, Response
from websockets.typing import Subprotocol

from coordinator.core import Coordinator, CoreConfig
from protocol import SUBPROTOCOL_JSON, SUBPROTOCOL_MSGPACK, SUBPROTOCOLS, Codec, Encoding
from protocol import errors as codes
from protocol.messages import Error, FromClient, FromWorker

log = structlog.get_logger(__name__)

Role = Literal["worker", "client"]
ROLE_PATHS: dict[str, Role] = {"/v1/worker": "worker", "/v1/client": "client"}
LOOPBACK_HOSTS = frozenset({"127.0.0.1", "localhost", "::1"})
# Coalesced frames stay under websockets' default 1 MiB receive limit of our peers.
MAX_OUT_FRAME_BYTES = 512 * 1024


@dataclass(frozen=True)
class ServerSettings:
    """Everything the coordinator process is configured with.

    Attributes:
        host: interface to bind; loopback by default.
        port: TCP port; 0 picks a free one (read ``CoordinatorServer.port`` after start).
        worker_tokens: bearer tokens accepted on ``/v1/worker``.
        client_tokens: bearer tokens accepted on ``/v1/client``.
        insecure: accept connections without tokens (only allowed on loopback).
        heartbeat_interval_s / heartbeat_timeout_s: told to workers in ``welcome``; the
            reaper drops a worker whose last beat is older than the timeout.
        reaper_interval_s: how often the reaper runs; defaults to a tenth of the timeout
            (at most 1 s), so detection takes at most timeout + interval.
        max_frame_bytes: largest accepted frame (larger closes that connection with 1009).
    """

    host: str = "127.0.0.1"
    port: int = 8765
    worker_tokens: tuple[str, ...] = ()
    client_tokens: tuple[str, ...] = ()
    insecure: bool = False
    heartbeat_interval_s: float = 10.0
    heartbeat_timeout_s: float = 30.0
    reaper_interval_s: float | None = None
    max_frame_bytes: int = 1 << 20

    def check(self) -> None:
        """Raise ``ValueError`` with an actionable message when the settings cannot work."""
        if self.heartbeat_interval_s <= 0 or self.heartbeat_timeout_s <= 0:
            raise ValueError("heartbeat interval and timeout must be positive seconds")
        if self.heartbeat_timeout_s < self.heartbeat_interval_s:
            raise ValueError(
                f"heartbeat timeout ({self.heartbeat_timeout_s} s) must be at least the interval "
                f"({self.heartbeat_interval_s} s), or every worker would be reaped between beats"
            )
        if self.insecure:
            if self.host not in LOOPBACK_HOSTS:
                raise ValueError(f"--insecure is only allowed on a loopback address, not {self.host!r}")
        elif not self.worker_tokens or not self.client_tokens:
            raise ValueError(
                "refusing to start without tokens: set FLEETWIRE_WORKER_TOKEN and FLEETWIRE_CLIENT_TOKEN "
                "(or --worker-token/--client-token), or pass --insecure on a loopback address"
            )

    @property
    def reaper_period_s(self) -> float:
        if self.reaper_interval_s is not None:
            return self.reaper_interval_s
        return min(1.0, self.heartbeat_timeout_s / 10)


@dataclass(eq=False)
class _Session:
    """One open websocket: its outgoing queue and the writer that drains it."""

    conn_id: int
    ws: ServerConnection
    codec: Codec
    pending: list[Any] = field(default_factory=list)
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    close_with: tuple[int, str] | None = None

    async def write_loop(self) -> None:
        """Send everything pending as one frame per wake-up; close when the core asked to."""
        ws, codec = self.ws, self.codec
        try:
            while True:
                await self.wake.wait()
                self.wake.clear()
                while self.pending:
                    batch, self.pending = self.pending, []
                    for frame in self._frames(batch):
                        await ws.send(frame, text=codec.text)
                if self.close_with is not None:
                    await ws.close(*self.close_with)
                    return
        except ConnectionClosed:
            return


    def _frames(self, batch: list[Any]) -> list[bytes]:
        """Encode ``batch`` as one frame, split in halves while a frame exceeds what peers accept."""
        frame = self.codec.encode(batch)
        if len(frame) <= MAX_OUT_FRAME_BYTES or len(batch) == 1:
            return [frame]
        half = len(batch) // 2
        return self._frames(batch[:half]) + self._frames(batch[half:])


BEARER_SUBPROTOCOL_PREFIX = "fleetwire.bearer."


def _bearer(headers: Headers) -> str | None:
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


def _matches(token: str, candidates: Sequence[str]) -> bool:
    # Compare against every candidate so timing does not tell which (or how many) exist.
    found = False
    for candidate in candidates:
        found |= hmac.compare_digest(token.encode(), candidate.encode())
    return found


class CoordinatorServer:
    """Serves ``/v1/worker`` and ``/v1/client`` and drives a ``Coordinator`` core.

    Usage::

        server = CoordinatorServer(settings)
        await server.start()
        print(server.url)
        await server.serve_forever()   # or: await server.stop()
    """

    def __init__(self, settings: ServerSettings, *, version: str = "") -> None:
        settings.check()
        self.settings = settings
        self.core = Coordinator(
            CoreConfig(
                heartbeat_interval_s=settings.heartbeat_interval_s,
                heartbeat_timeout_s=settings.heartbeat_timeout_s,
                version=version,
            ),
            new_id=lambda: secrets.token_hex(8),
        )
        self._sessions: dict[int, _Session] = {}
        self._conn_ids = itertools.count(1)
        self._codecs: dict[tuple[Role, Encoding], Codec] = {
            (role, enc): Codec(enc, FromWorker if role == "worker" else FromClient, role)
            for role in ("worker", "client")
            for enc in ("msgpack", "json")
        }
        self._server: Server | None = None
        self._reaper: asyncio.Task[None] | None = None
        self.port: int = settings.port

    @property
    def url(self) -> str:
        host = self.settings.host
        if ":" in host:
            host = f"[{host}]"
        return f"ws://{host}:{self.port}"

    async def start(self) -> None:
        """Bind the port and start the reaper."""
        self._server = await serve(
            self._handle,
            self.settings.host,
            self.settings.port,
            process_request=self._process_request,
            select_subprotocol=self._select_subprotocol,
            subprotocols=[Subprotocol(SUBPROTOCOL_MSGPACK), Subprotocol(SUBPROTOCOL_JSON)],
            # permessage-deflate costs ~3x memory per connection and opens the door to
            # decompression bombs; fleetwire frames are small msgpack (RELIABILITY.md §3).
            compression=None,
            max_size=self.settings.max_frame_bytes,
            server_header=None,
        )
        sockets = list(self._server.sockets)
        if sockets:
            self.port = sockets[0].getsockname()[1]
        self._reaper = asyncio.create_task(self._reap_forever())
        log.info("coordinator listening", url=self.url, insecure=self.settings.insecure)

    async def serve_forever(self) -> None:
        """Serve until cancelled."""
        assert self._server is not None, "call start() first"
        await self._server.serve_forever()

    async def stop(self) -> None:
        """Close every session with 1001 and stop listening."""
        if self._reaper is not None:
            self._reaper.cancel()
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    # ------------------------------------------------------------------ handshake

    def _process_request(self, conn: ServerConnection, request: Request) -> Response | None:
        path = urlsplit(request.path).path
        if path == "/healthz":
            return conn.respond(200, "ok\n")
        role = ROLE_PATHS.get(path)
        if role is None:
            return conn.respond(404, f"unknown path {path}; fleetwire serves /v1/worker and /v1/client\n")
        if self.settings.insecure:
            return None
        token = _bearer(request.headers)
        if token is None:
            return self._unauthorized(conn, "missing 'Authorization: Bearer <token>' header")
        if _matches(token, self.settings.worker_tokens if role == "worker" else self.settings.client_tokens):
            return None
        other: Role = "client" if role == "worker" else "worker"
        if _matches(token, self.settings.client_tokens if role == "worker" else self.settings.worker_tokens):
            log.warning("refused connection", reason="wrong role", path=path, token_role=other)
            return conn.respond(403, f"a {other} token cannot open {path}; use the {role} token\n")
        log.warning("refused connection", reason="invalid token", path=path)
        return self._unauthorized(conn, "invalid token")

    @staticmethod
    def _unauthorized(conn: ServerConnection, why: str) -> Response:
        response = conn.respond(401, why + "\n")
        response.headers["WWW-Authenticate"] = 'Bearer realm="fleetwire"'
        return response

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
        session = _Session(conn_id, ws, codec)
        self._sessions[conn_id] = session
        writer = asyncio.create_task(session.write_loop())
        address = f"{ws.remote_address[0]}:{ws.remote_address[1]}" if ws.remote_address else ""
        core = self.core
        core.open_session(conn_id, role, time.monotonic(), principal=role, address=address)
        self._flush()
        try:
            async for frame in ws:
                now = time.monotonic()
                for msg in codec.decode(frame):
                    self._receive(conn_id, msg, now)
                self._flush()
        except ConnectionClosed:
            pass
        finally:
            self._sessions.pop(conn_id, None)
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
            log.exception("core failed on a message", conn_id=conn_id, type=type(msg).__name__)
            session = self._sessions.get(conn_id)
            if session is not None:
                session.pending.append(Error(code=codes.INTERNAL, message="internal error; see coordinator log"))
                session.wake.set()

    def _flush(self) -> None:
        effects = self.core.take_effects()
        sessions = self._sessions
        for conn_id, msgs in effects.sends.items():
            session = sessions.get(conn_id)
            if session is not None:
                session.pending.extend(msgs)
                session.wake.set()
        for conn_id, code, reason in effects.closes:
            session = sessions.get(conn_id)
            if session is not None:
                session.close_with = (code, reason)
                session.wake.set()

    async def _reap_forever(self) -> None:
        period = self.settings.reaper_period_s
        while True:
            await asyncio.sleep(period)
            try:
                self.core.tick(time.monotonic())
            except Exception:
                log.exception("reaper tick failed")
            self._flush()
