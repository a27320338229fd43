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
* **A request is a client session of the core.** Each completion opens a session for the key's
  principal, submits the plan subscribed with an id of the door's making (so a disconnect can
  cancel it before its ``accepted`` arrived), and closes the session when answered. The core's
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
import secrets
import time
from collections import deque
from collections.abc import Callable
from typing import Any, Final, Literal, cast

import structlog

from coordinator.auth import Principal, TokenStore
from coordinator.io.frontdoor.core_driver import CoreDriver
from coordinator.limits import Limits, host_refused
from coordinator.openai_api import (
    PATHS,
    ApiError,
    DoorRequest,
    HttpRequest,
    ModelTable,
    Reply,
    RequestReader,
    error_response,
    json_response,
    parse_request,
    submit_refused,
)
from coordinator.openai_api.intake import MAX_HEAD_BYTES
from protocol.messages import Cancel, Error, Event
from protocol.transfer.http1 import first_line

__all__ = ["CONN_ID_BASE", "OpenAIConnection", "OpenAIDoor"]

log = structlog.get_logger("coordinator.io.frontdoor.openai")

#: The door's core sessions take conn ids from here, far above the websocket sessions' counter.
CONN_ID_BASE: Final = 1 << 48
_MODELS: Final = "/v1/models"
_ROUTES: Final = (*PATHS, _MODELS)
_ROUTE_BYTES: Final = frozenset(route.encode() for route in _ROUTES)
_LONGEST: Final = max(len(path) for path in _ROUTES) + 16  # bytes of a request line that decide
_SUBMIT_REQ: Final = 1
_CANCEL_REQ: Final = 2
_WRITE_HIGH: Final = 256 * 1024  # the transport says "pause" past this (only counted: the cap is the limit's)
# Reading goes on while a request is in flight (a client that goes away is seen at once), unless the client
# pipelined this many requests, or this many bytes, ahead of it.
_MAX_PIPELINED: Final = 4
_MAX_AHEAD: Final = 64 * 1024


class OpenAIDoor:
    """The OpenAI routes of one core's port (module docstring).

    Args:
        driver: the core's driver (its core, its sinks, its flush).
        tokens: the token store (None: ``--insecure``).
        limits: the port's limits (connections, pending bytes, the handshake timeout, allowed hosts).
        max_body_bytes: a request body's limit (413 past it).
        queue_timeout_s: how long a request waits for a worker (503 after).
        clock: monotonic seconds. wall: Unix seconds (OpenAI's ``created``).
    """

    def __init__(
        self, driver: CoreDriver, tokens: TokenStore | None, limits: Limits, *, max_body_bytes: int,
        queue_timeout_s: float, clock: Callable[[], float] = time.monotonic, wall: Callable[[], float] = time.time,
    ) -> None:  # fmt: skip
        self.driver = driver
        self.tokens = tokens
        self.limits = limits
        self.max_body_bytes = max_body_bytes
        self.queue_timeout_s = queue_timeout_s
        self.clock = clock
        self.wall = wall
        self.models = ModelTable(driver.core.registry.iter_alive)
        self.connections: set[OpenAIConnection] = set()
        self.answers: dict[int, int] = {}  # requests answered, by status (/metrics)
        self.slow_consumers = 0
        self.ids = itertools.count(CONN_ID_BASE)

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
        self.answers[status] = self.answers.get(status, 0) + 1

    def admit(self, request: HttpRequest) -> Principal:
        """The principal of the request's key.

        Raises:
            ApiError: 401 without a key or with an unknown one, 403 for a worker's; 403 under
                ``--insecure`` for a Host that is not loopback.
        """
        headers = request.headers
        if self.tokens is None:
            refused = host_refused(headers.get("host"), self.limits.allowed_hosts)
            if refused is not None:
                raise ApiError(403, refused, code="host_not_allowed")
            return Principal("client", "client")
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


def bearer_token_of(headers: dict[str, str]) -> str | None:
    """The key of an ``Authorization: Bearer`` header (lower-cased names), or None."""
    value = headers.get("authorization", "")
    scheme, _, token = value.partition(" ")
    token = token.strip()
    return token if scheme.lower() == "bearer" and token else None


class OpenAIConnection(asyncio.Protocol):
    """One HTTP/1.1 connection of the OpenAI door: its requests, one at a time (module docstring)."""

    def __init__(self, door: OpenAIDoor) -> None:
        self.door = door
        self.reader = RequestReader(MAX_HEAD_BYTES, door.max_body_bytes)
        self.transport: asyncio.Transport | None = None
        self.queue: deque[HttpRequest] = deque()
        self.exchange: Exchange | None = None
        self.closing = False
        self._timer: asyncio.TimerHandle | None = None

    # ------------------------------------------------------------------ asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast("asyncio.Transport", transport)  # uvloop's TCPTransport is no asyncio.Transport subclass
        transport = self.transport
        transport.set_write_buffer_limits(high=_WRITE_HIGH)
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
        pass  # the pending-bytes cap decides (module docstring); asyncio keeps buffering meanwhile

    def resume_writing(self) -> None:
        pass

    # ------------------------------------------------------------------ requests

    def write(self, data: bytes) -> bool:
        """Write ``data``; False (and the connection aborted) when the reader is a slow consumer."""
        transport = self.transport
        if transport is None or self.closing:
            return False
        transport.write(data)
        if transport.get_write_buffer_size() > self.door.limits.max_pending_bytes:
            self.door.slow_consumers += 1
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
        """Each request head and body within the handshake timeout; an idle kept-alive connection closes."""
        if self._timer is not None:
            self._timer.cancel()
        loop = asyncio.get_running_loop()
        self._timer = loop.call_later(self.door.limits.handshake_timeout_s, self._timed_out)

    def _timed_out(self) -> None:
        self._timer = None
        if self.exchange is None and not self.closing:
            if self.reader.buffered or self.queue:
                self.refuse(ApiError(400, "the request was not sent in time"))
            else:
                self.close()

    def next_request(self) -> None:
        """Serve the next whole request; reading pauses while one is in flight."""
        while self.queue and self.exchange is None and not self.closing:
            request = self.queue.popleft()
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
            self.serve(request)
        if self.transport is not None and not self.closing and self.exchange is None:
            self.transport.resume_reading()
            self._idle()

    def serve(self, request: HttpRequest) -> None:
        door = self.door
        keep = request.keep_alive
        kind = PATHS.get(request.path)
        try:
            if kind is None and request.path != _MODELS:
                raise ApiError(404, f"unknown path {request.path}; the OpenAI routes are {', '.join(_ROUTES)}")
            wanted = "GET" if kind is None else "POST"
            if request.method != wanted:
                raise ApiError(405, f"{request.path} takes {wanted}, not {request.method}")
            principal = door.admit(request)
            now = door.clock()
            if kind is None:
                self.answer(200, json_response(200, door.models.listing(now, int(door.wall())), keep_alive=keep), keep)
                return
            parsed = parse_request(kind, request.body, session=request.headers.get("x-fleetwire-session"))
            if not door.models.serves(parsed.model, now):
                raise ApiError(404, f"The model '{parsed.model}' does not exist: no connected worker serves it "
                                    f"(GET /v1/models lists the fleet's)", code="model_not_found", param="model")
        except ApiError as error:
            self.answer(error.status, error_response(error, keep_alive=keep), keep)
            return
        self.exchange = Exchange(self, principal, parsed, keep, len(request.body))
        self.exchange.start()

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


class Exchange:
    """One completion in flight: a core session of its principal, its plan, its :class:`Reply`."""

    __slots__ = ("body_bytes", "conn", "conn_id", "done", "door", "keep_alive", "plan_id", "principal", "reply",
                 "request", "timer")

    def __init__(self, conn: OpenAIConnection, principal: Principal, request: DoorRequest, keep_alive: bool,
                 body_bytes: int) -> None:  # fmt: skip
        self.conn = conn
        self.door = conn.door
        self.principal = principal
        self.request = request
        self.keep_alive = keep_alive
        self.body_bytes = body_bytes
        self.conn_id = next(self.door.ids)
        self.plan_id = f"oai-{secrets.token_hex(8)}"
        self.done = False
        self.timer: asyncio.TimerHandle | None = None
        now = self.door.clock()
        self.reply = Reply(request, created=int(self.door.wall()), now=now, queue_timeout_s=self.door.queue_timeout_s,
                           keep_alive=keep_alive)  # fmt: skip
        self.reply.accepted(self.plan_id)

    def start(self) -> None:
        door, driver = self.door, self.door.driver
        now = door.clock()
        away = driver.away() if driver.away is not None else None
        if away is not None:
            self.finish_now(self.reply.refused(ApiError(503, f"{away}; send the request again", code="unavailable",
                                                        retry_after_s=1.0)).data)
            return
        transport = self.conn.transport
        peer = transport.get_extra_info("peername") if transport is not None else None
        driver.core.open_session(self.conn_id, "client", now, principal=self.principal.name,
                                 address=f"{peer[0]}:{peer[1]}" if peer else "", admin=self.principal.admin)
        driver.sinks[self.conn_id] = self
        submit = self.request.submit(_SUBMIT_REQ)
        submit.plan_id = self.plan_id
        driver.receive(self.conn_id, submit, now)
        driver.flush(self.body_bytes)
        self._schedule()

    def _schedule(self) -> None:
        """The queue timeout's timer, at the reply's deadline (it moves on a requeue)."""
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        deadline = self.reply.deadline
        if deadline is not None and not self.done:
            delay = max(0.0, deadline - self.door.clock())
            self.timer = asyncio.get_running_loop().call_later(delay, self._expire)

    def _expire(self) -> None:
        self.timer = None
        if not self.done:
            out = self.reply.expire(self.door.clock())
            if out.data or out.done:
                self._out(out.data, out.done, out.cancel)
            else:
                self._schedule()

    def deliver(self, msgs: list[Any]) -> None:
        """The core's messages for this session, once committed (CoreDriver.deliver)."""
        if self.done:
            return
        reply, now = self.reply, self.door.clock()
        data = b""
        done = cancel = False
        deadline = reply.deadline
        for msg in msgs:
            kind = type(msg)
            if kind is Event:
                out = reply.event(msg.kind, msg.data, now)
            elif kind is Error and msg.req_id == _SUBMIT_REQ:
                out = reply.refused(submit_refused(msg.code, msg.message, msg.retry_after_s))
            else:
                continue  # accepted, the cancel's reply
            if out.data:
                data += out.data
            if out.done:
                done, cancel = True, out.cancel
                break
        if data or done:
            self._out(data, done, cancel)
        elif reply.deadline != deadline:
            self._schedule()

    def _out(self, data: bytes, done: bool, cancel: bool) -> None:
        if data and not self.conn.write(data):
            done = cancel = True  # a slow consumer (aborted), or the connection is gone
        if done:
            self.done = True
            if self.timer is not None:
                self.timer.cancel()
                self.timer = None
            if self.reply.status:
                self.door.answered(self.reply.status)
            # Not inside the driver's delivery: the cancel and the close are new input to the core.
            asyncio.get_running_loop().call_soon(self._close, cancel)
        elif self.reply.deadline is None and self.timer is not None:
            self.timer.cancel()
            self.timer = None

    def abandon(self) -> None:
        """The connection is gone before the answer was complete: cancel the plan."""
        if not self.done:
            self.done = True
            if self.timer is not None:
                self.timer.cancel()
            self._close(True)

    def finish_now(self, data: bytes) -> None:
        """Answered before the core saw the request."""
        self.done = True
        self.door.answered(self.reply.status)
        if self.conn.write(data):
            self.conn.finished(self.keep_alive)

    def _close(self, cancel: bool) -> None:
        """Cancel the plan if asked, close the core session, and let the connection go on."""
        driver = self.door.driver
        driver.sinks.pop(self.conn_id, None)
        now = self.door.clock()
        if cancel:
            driver.receive(self.conn_id, Cancel(plan_id=self.plan_id, req_id=_CANCEL_REQ), now)
        driver.core.close_session(self.conn_id, now)
        driver.flush()
        if not self.conn.closing:
            self.conn.finished(self.keep_alive)
