"""The front door of a listening port: its routes, who may open a session, and the sessions it holds.

Both kinds of websocket port go through one :class:`FrontDoor`, with the same code: a core's port
(coordinator/io/frontdoor/server.py ``CoordinatorServer``) and a cluster's main port
(coordinator/io/cluster/host.py ``ClusterHost``). What differs is their :class:`Port`: the plain
HTTP paths each serves, when sessions cannot be opened for a while, and what serves a session once
it is open (the core; or a view session across shards, or a ``moved`` to a shard's owner).

Routes (docs/PROTOCOL.md §1, docs/OPERATIONS.md §HTTP endpoints):

==========================  =================================================================
``/v1/worker``              a websocket session of that role, admitted in this order: the
``/v1/client``              offered subprotocols (400), the port's :meth:`Port.not_now` (503
                            with ``Retry-After`` while a store loads or a database is away),
                            then the gate (coordinator/io/frontdoor/gate.py: with
                            ``--insecure`` a non-loopback Host 403, a foreign Origin 403, the
                            connection limit and shares 503, a worker's client certificate 403,
                            the token 401/403, the penalty box 429; repeated refusals held)
any other path              :meth:`Port.plain`: the port's own table, its 404 included
==========================  =================================================================

Sessions: each admitted one gets a conn id, the principal the gate let in, a writer
(coordinator/io/frontdoor/connection.py), its per-connection read policy
(coordinator/read_policy.py) and a :class:`~coordinator.io.frontdoor.reader.SessionHandler` from
its port; the reader (coordinator/io/frontdoor/reader.py) feeds it frames until the connection
ends. The door counts open sessions (the connection limit) and sessions per principal (its share),
closes sessions from the server's side (:meth:`FrontDoor.kill`: a flood 4429, a slow consumer
4503, a revoked token 4401) and puts the peer of an abusive close in the penalty box
(:func:`coordinator.read_policy.penalty`: 1009, 4400, 4429). Every refusal is counted by its
answer (an HTTP status before the upgrade, a close code after: ``fleetwire_refusals_total``).
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Callable, Coroutine, Mapping, Sequence
from typing import Any, Final, Literal, Protocol
from urllib.parse import urlsplit

import structlog
from websockets.asyncio.server import ServerConnection
from websockets.exceptions import ConnectionClosed
from websockets.http11 import Request, Response
from websockets.typing import Subprotocol

from coordinator.io.frontdoor.connection import Session, close_or_abort
from coordinator.io.frontdoor.gate import Gatekeeper, subprotocol_refused
from coordinator.io.frontdoor.reader import SessionHandler, read_frames
from coordinator.io.stores.backlog import Backlog
from coordinator.read_policy import ReadPolicy, penalty
from coordinator.stats import FrameCounters
from protocol import SUBPROTOCOL_JSON, SUBPROTOCOL_MSGPACK, SUBPROTOCOLS, Codec, Encoding
from protocol import errors as codes

__all__ = ["ROLE_PATHS", "Answer", "FrontDoor", "Port", "Role"]

log = structlog.get_logger("coordinator.io.frontdoor.server")

Role = Literal["worker", "client"]
ROLE_PATHS: Final[dict[str, Role]] = {"/v1/worker": "worker", "/v1/client": "client"}
SUPPORTED: Final = (SUBPROTOCOL_MSGPACK, SUBPROTOCOL_JSON)

#: What a ``process_request`` hook answers: a response, one to be awaited (held, or after a load), or
#: None to go on with the upgrade.
Answer = Response | Coroutine[Any, Any, Response | None] | None


class Port(Protocol):
    """What one kind of port adds to the door (module docstring)."""

    def plain(self, conn: ServerConnection, request: Request, path: str) -> Answer:
        """The answer to a request of any path but the session paths; never None."""

    def not_now(self, conn: ServerConnection, request: Request) -> Answer:
        """Why a session cannot be opened now (a 503, or an answer to await), else None: ask the gate."""

    def handler(self, session: Session) -> SessionHandler:
        """What serves ``session``, whose upgrade the gate admitted (``session.principal`` is set)."""


class FrontDoor:
    """Routes, admission and sessions of one listening port (module docstring).

    Args:
        port: the kind of port: its plain routes, readiness and session handlers.
        gate: the port's admission (coordinator/io/frontdoor/gate.py).
        policy: the port's read limits (coordinator/read_policy.py).
        codecs: the codec of each role and encoding.
        store: the backlog of records readers wait on (None: no store behind the port).
        frames: frame and byte counters per role (None: counted for nobody).
        ping_workers: keep websocket pings on worker sessions (``ServerSettings.ping_workers``).
        clock: monotonic seconds.

    Attributes:
        sessions: open sessions by conn id.
        refusals: refusals by answer (an HTTP status, or a close code), for ``/metrics``.
    """

    def __init__(
        self, port: Port, gate: Gatekeeper, policy: ReadPolicy, codecs: Mapping[tuple[Role, Encoding], Codec], *,
        store: Backlog[Any] | None = None, frames: FrameCounters | None = None, ping_workers: bool = True,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:  # fmt: skip
        self.port = port
        self.gate = gate
        self.policy = policy
        self.codecs = codecs
        self.store = store
        self.frames = frames if frames is not None else FrameCounters()
        self.ping_workers = ping_workers
        self.clock = clock
        self.sessions: dict[int, Session] = {}
        self.refusals: dict[str, int] = {}
        self._held: dict[str, int] = {}  # open sessions per principal (connection shares)
        self._handlers: dict[int, SessionHandler] = {}  # until told closed
        self._conn_ids = itertools.count(1)
        self._background: set[asyncio.Task[None]] = set()  # closes the door started itself

    # ------------------------------------------------------------------ before the upgrade

    def process_request(self, conn: ServerConnection, request: Request) -> Answer:
        """The ``process_request`` hook: a session path's admission, else the port's plain route."""
        path = urlsplit(request.path).path
        role = ROLE_PATHS.get(path)
        if role is None:
            return self.port.plain(conn, request, path)
        refused = subprotocol_refused(request.headers, SUPPORTED)
        if refused is not None:
            self.count(400)
            return conn.respond(400, refused + "\n")
        not_now = self.port.not_now(conn, request)
        if not_now is not None:
            return not_now
        # Origin, connection limit, client certificate, token, penalty box; repeated refusals held (gate.py).
        return self.gate.upgrade(conn, request, path, role, len(self.sessions), self.held_by, self.count)

    def count(self, answer: int) -> None:
        """Count a refusal by its answer (an HTTP status or a close code)."""
        key = str(answer)
        self.refusals[key] = self.refusals.get(key, 0) + 1

    def held_by(self, principal: str) -> int:
        """Open sessions of ``principal`` (its connection share, coordinator/limits.py)."""
        return self._held.get(principal, 0)

    @staticmethod
    def select_subprotocol(conn: ServerConnection, offered: Sequence[Subprotocol]) -> Subprotocol | None:
        """msgpack when offered, else JSON when offered; None (msgpack, the default) when neither is."""
        for name in SUPPORTED:
            if name in offered:
                return Subprotocol(name)
        return None

    # ------------------------------------------------------------------ sessions

    async def serve(self, ws: ServerConnection) -> None:
        """One admitted session, from the upgrade to its end (the handler of ``Gatekeeper.serve``)."""
        assert ws.request is not None
        role = ROLE_PATHS[urlsplit(ws.request.path).path]
        codec = self.codecs[(role, SUBPROTOCOLS.get(ws.subprotocol or "", "msgpack"))]
        principal = self.gate.principal(ws)
        if role == "worker" and not self.ping_workers and ws.keepalive_task is not None:
            # The heartbeat reaper (4408) detects a dead worker; pings would only cost CPU (ServerSettings).
            ws.keepalive_task.cancel()
            ws.keepalive_task = None
        session = Session(next(self._conn_ids), ws, codec, role=role, io=self.frames.of(role), principal=principal)
        self.sessions[session.conn_id] = session
        self._held[principal.name] = self._held.get(principal.name, 0) + 1
        writer = session.writer = asyncio.create_task(session.write_loop())
        try:
            handler = self._handlers[session.conn_id] = self.port.handler(session)
            handler.opened(self.clock())
            policy = self.policy.connection(role, principal.name, self.clock())
            await read_frames(session, handler, policy, kill=self.kill, store=self.store, clock=self.clock)
        except ConnectionClosed:
            pass
        finally:
            self._ended(session)
            if not writer.done():
                writer.cancel()

    def _ended(self, session: Session) -> None:
        """The connection is gone: an oversize frame boxes its peer; the session is forgotten, its handler told."""
        sent = session.ws.protocol.close_sent
        principal = session.principal
        assert principal is not None
        if sent is not None and sent.code == codes.CLOSE_TOO_BIG:  # websockets refused a frame (max_size)
            self.count(codes.CLOSE_TOO_BIG)
            self.gate.offence(principal, session.ws, codes.CLOSE_TOO_BIG)  # penalty box: its reconnects get 429
            log.warning(
                "refused: frame over the size limit", conn_id=session.conn_id, role=session.role,
                principal=principal.name, address=_address(session.ws),
                limit_bytes=session.ws.protocol.max_message_size,
            )
        self.sessions.pop(session.conn_id, None)
        left = self._held.get(principal.name, 0) - 1
        if left > 0:
            self._held[principal.name] = left
        else:
            self._held.pop(principal.name, None)
        handler = self._handlers.pop(session.conn_id, None)
        if handler is not None:
            handler.closed(self.clock(), None)

    def kill(self, session: Session, code: int, reason: str) -> None:
        """Close a session from the server's side at once, dropping what is pending for it.

        Its handler is told now, so nothing more is queued for it and its input is ignored; the
        close handshake gets the close timeout before the TCP connection is aborted (a peer that
        does not read never answers it). An abusive close (4429) puts the peer in the penalty box.
        """
        if session.killed:
            return
        session.killed = True
        session.pending = []
        self.count(code)
        if session.principal is not None and penalty(code) is not None:
            self.gate.offence(session.principal, session.ws, code)  # 4429: penalty box
        log.warning(
            "refused: closing session", code=code, reason=reason, conn_id=session.conn_id, role=session.role,
            principal=session.principal.name if session.principal is not None else "", address=_address(session.ws),
        )
        if session.writer is not None:
            session.writer.cancel()
        handler = self._handlers.pop(session.conn_id, None)
        if handler is not None:
            handler.closed(self.clock(), code)
        task = asyncio.create_task(close_or_abort(session.ws, code, reason, self.gate.limits.close_timeout_s))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def penalize(self, session: Session, code: int) -> None:
        """The core asked to close ``session`` with ``code``: an abusive one boxes the peer (read_policy.py)."""
        verdict = penalty(code, by_core=True)
        if verdict is not None and session.principal is not None:
            self.count(code)
            self.gate.offence(session.principal, session.ws, code, per_worker_id=verdict.per_worker_id)


def _address(ws: ServerConnection) -> str:
    remote = ws.remote_address
    return f"{remote[0]}:{remote[1]}" if remote else ""
