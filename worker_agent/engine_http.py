"""The inference handler's HTTP/1.1 client: streamed requests to the engine this worker fronts.

Why not httpx (which the rest of worker_agent/inference.py keeps: model discovery, metrics
scrapes). A streamed ``generate`` through httpx's ``AsyncClient.stream`` cost the handler 1.5 ms
from its start to the first text chunk on loopback against an engine that answers in 0.2 ms
(bench/openai_door.py): five layers (httpx, httpcore, h11, anyio, asyncio streams) each with its
own buffers, locks and cancel scopes, per request and per chunk. This client is one
``asyncio.Protocol`` per kept-alive connection: the request head is written by the one head codec
(protocol/transfer/http1.py), the response is parsed by ``httptools`` (llhttp, as the head codec),
and body bytes are handed to the reader as they arrive, de-chunked.

Rules:

* **Connections.** One request at a time per connection. After a response read to its end, on a
  connection neither side asked to close, the connection goes back to the client's idle list and
  the next request takes the most recent one. An idle connection is dropped after
  :data:`IDLE_S` (uvicorn, vLLM's server, closes idle ones after 5 s: reusing one at that moment
  would race its close), and when the engine closes it.
* **A reused connection the engine closed** before a byte of the answer came (that race, or a
  restarted engine) is retried once on a new connection; a new connection's failure is the
  caller's. Each asyncio transport sets ``TCP_NODELAY``: a chunk goes out at once.
* **Timeouts.** ``connect_timeout_s`` to connect (and to write the request); ``read_timeout_s`` the
  longest silence between two pieces of the answer (:class:`EngineTimeout`).
* **Giving up.** A response left before its end (the plan was cancelled: the handler's task is
  cancelled inside the ``async with``), or any error, aborts its connection: the engine sees the
  disconnect and stops generating.
* **Backpressure.** Reading pauses while more than :data:`READ_AHEAD_BYTES` wait for the reader.

Errors: :class:`EngineUnreachable` (connect), :class:`EngineTimeout` (silence), and
:class:`EngineProtocolError` (a malformed answer, or a connection closed mid-answer), all
``EngineHttpError``.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
import time
from collections import deque
from collections.abc import AsyncIterator, Mapping
from typing import Final
from urllib.parse import urlsplit

import httptools

from protocol.transfer.http1 import format_request

__all__ = ["IDLE_S", "READ_AHEAD_BYTES", "EngineClient", "EngineHttpError", "EngineProtocolError", "EngineResponse",
           "EngineTimeout", "EngineUnreachable"]  # fmt: skip

IDLE_S: Final = 4.0  # an idle kept-alive connection is dropped after this (engines close theirs after 5 s)
READ_AHEAD_BYTES: Final = 1 << 20  # body bytes received and not yet read, past which reading pauses
MAX_IDLE: Final = 64  # idle connections kept at most


class EngineHttpError(Exception):
    """A request to the engine failed (the message says how)."""


class EngineUnreachable(EngineHttpError):
    """The engine could not be connected to."""


class EngineTimeout(EngineHttpError):
    """The engine was silent for longer than the read timeout."""


class EngineProtocolError(EngineHttpError):
    """A malformed answer, or the connection closed before the answer's end."""


class _Connection(asyncio.Protocol):
    """One kept-alive connection and the response being read on it (module docstring)."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.idle_since = 0.0
        self._reset()

    def _reset(self) -> None:
        self.parser = httptools.HttpResponseParser(self)
        self.status = 0
        self.headers: dict[str, str] = {}
        self.head_done = False
        self.complete = False
        self.received = 0  # answer bytes received on this request
        self.keep_alive = True
        self.error: BaseException | None = None
        self.pieces: deque[bytes] = deque()
        self.buffered = 0
        self.paused = False
        self.waiter: asyncio.Future[None] | None = None

    # ------------------------------------------------------------------ httptools' callbacks

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers[name.decode("latin-1").lower()] = value.decode("latin-1")

    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()
        self.keep_alive = self.parser.should_keep_alive()
        self.head_done = True
        self._wake()

    def on_body(self, body: bytes) -> None:
        self.pieces.append(body)
        self.buffered += len(body)
        if self.buffered > READ_AHEAD_BYTES and not self.paused and self.transport is not None:
            self.paused = True
            self.transport.pause_reading()
        self._wake()

    def on_message_complete(self) -> None:
        self.complete = True
        self._wake()

    # ------------------------------------------------------------------ asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.received += len(data)
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self.error = EngineProtocolError(f"a malformed answer: {exc}")
            self.abort()
            self._wake()

    def eof_received(self) -> bool | None:
        return None  # the transport closes itself

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if not self.complete and self.error is None:
            why = f": {exc}" if exc else ""
            self.error = EngineProtocolError(f"the engine closed the connection before its answer's end{why}")
        self._wake()

    # ------------------------------------------------------------------ the reader's side

    def _wake(self) -> None:
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def wait(self, timeout_s: float) -> None:
        """Until something new arrived (or an error): at most ``timeout_s``."""
        self.waiter = asyncio.get_running_loop().create_future()
        try:
            async with asyncio.timeout(timeout_s):
                await self.waiter
        except TimeoutError:
            raise EngineTimeout(f"the engine sent nothing for {timeout_s:g} s") from None
        finally:
            self.waiter = None

    def take(self) -> bytes:
        """The body bytes received and not read yet."""
        pieces = self.pieces
        data = pieces.popleft() if len(pieces) == 1 else b"".join(pieces)
        pieces.clear()
        self.buffered = 0
        if self.paused and self.transport is not None:
            self.paused = False
            self.transport.resume_reading()
        return data

    def abort(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.abort()


class EngineResponse:
    """A response being read: its status and headers, then its body as it comes (:meth:`chunks`)."""

    def __init__(self, conn: _Connection, read_timeout_s: float) -> None:
        self._conn = conn
        self._read_timeout_s = read_timeout_s

    @property
    def status(self) -> int:
        return self._conn.status

    @property
    def headers(self) -> dict[str, str]:
        """Lower-cased names."""
        return self._conn.headers

    async def chunks(self) -> AsyncIterator[bytes]:
        """The body's bytes as they arrive, de-chunked, until its end.

        Raises:
            EngineTimeout: silent past the read timeout.
            EngineProtocolError: a malformed answer, or closed before its end.
        """
        conn = self._conn
        while True:
            if conn.pieces:
                yield conn.take()
                continue
            if conn.complete:
                return
            if conn.error is not None:
                raise conn.error
            await conn.wait(self._read_timeout_s)

    async def read(self, limit: int = 1 << 20) -> bytes:
        """The body (at most ``limit`` bytes are kept)."""
        data = bytearray()
        async for piece in self.chunks():
            if len(data) < limit:
                data += piece[: limit - len(data)]
        return bytes(data)


class EngineClient:
    """Streamed requests to one engine over kept-alive connections (module docstring).

    Args:
        base_url: ``http://host:port`` or ``https://...``; a path is put before each request's.
        headers: sent with every request (``Authorization``).
        connect_timeout_s: how long connecting and writing the request may take.
        read_timeout_s: the longest silence between two pieces of an answer.
    """

    def __init__(self, base_url: str, *, headers: Mapping[str, str] | None = None, connect_timeout_s: float = 5.0,
                 read_timeout_s: float = 300.0) -> None:  # fmt: skip
        parts = urlsplit(base_url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"engine URL must look like http://host:port, got {base_url!r}")
        self.host = parts.hostname
        self.prefix = parts.path.rstrip("/")  # an engine behind a path (http://proxy/engine-3)
        self.port = parts.port or (443 if parts.scheme == "https" else 80)
        self._ssl = ssl.create_default_context() if parts.scheme == "https" else None
        self._headers = {"host": parts.netloc, **{name.lower(): value for name, value in (headers or {}).items()}}
        self.connect_timeout_s = connect_timeout_s
        self.read_timeout_s = read_timeout_s
        self._idle: list[_Connection] = []
        self.connections_made = 0  # (tests: a kept-alive connection is reused)

    @contextlib.asynccontextmanager
    async def post(self, path: str, body: bytes, headers: Mapping[str, str] | None = None,
                   ) -> AsyncIterator[EngineResponse]:  # fmt: skip
        """``POST path`` with ``body`` (JSON); yields the response once its head arrived.

        Raises:
            EngineHttpError: (module docstring).
        """
        head = {**self._headers, "content-type": "application/json", "accept": "text/event-stream",
                "content-length": str(len(body)), **(headers or {})}  # fmt: skip
        request = format_request("POST", self.prefix + path, head) + body
        conn = await self._send(request)
        try:
            yield EngineResponse(conn, self.read_timeout_s)
        except BaseException:
            conn.abort()
            raise
        if conn.complete and conn.keep_alive and not conn.closed and len(self._idle) < MAX_IDLE:
            conn.idle_since = time.monotonic()
            self._idle.append(conn)
        else:
            conn.abort()

    async def _send(self, request: bytes) -> _Connection:
        """Write ``request`` on an idle connection (retried once on a new one: module docstring), or a new one;
        returns it once the answer's head arrived."""
        conn = self._reuse()
        if conn is not None:
            conn._reset()
            try:
                return await self._exchange(conn, request)
            except EngineProtocolError:
                if conn.received:  # the engine answered something: not the idle race
                    raise
                conn.abort()
        return await self._exchange(await self._connect(), request)

    def _reuse(self) -> _Connection | None:
        now = time.monotonic()
        while self._idle:
            conn = self._idle.pop()
            if not conn.closed and now - conn.idle_since < IDLE_S:
                return conn
            conn.abort()
        return None

    async def _connect(self) -> _Connection:
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self.connect_timeout_s):
                _, conn = await loop.create_connection(_Connection, self.host, self.port, ssl=self._ssl)
        except TimeoutError:
            raise EngineUnreachable(f"no connection within {self.connect_timeout_s:g} s") from None
        except OSError as exc:
            raise EngineUnreachable(f"{type(exc).__name__}: {exc}") from None
        self.connections_made += 1
        return conn

    async def _exchange(self, conn: _Connection, request: bytes) -> _Connection:
        """Write the request; wait for the answer's head (or the connection's end)."""
        assert conn.transport is not None
        conn.transport.write(request)
        try:
            while not conn.head_done:
                if conn.error is not None:
                    raise conn.error
                await conn.wait(self.read_timeout_s)
        except BaseException:
            conn.abort()
            raise
        return conn

    def close(self) -> None:
        """Drop the idle connections."""
        for conn in self._idle:
            conn.abort()
        self._idle.clear()
