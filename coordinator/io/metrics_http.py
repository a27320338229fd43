"""What ``/metrics`` costs and who may read it: a cached exposition, an optional token, a separate bind.

A scrape walks every worker and plan (coordinator/io/metrics.py): O(workers) on the event loop
every session shares. Six scrape loops against 1,501 workers took a full core and raised other
peers' p50 from 2 ms to 208 ms. So (docs/OPERATIONS.md §Metrics):

* :class:`ExpositionCache` rebuilds the exposition at most once per ``--metrics-cache`` seconds
  (default 2); scrapes in between get the same bytes. Prometheus scrapes every 15-60 s, so the
  figures are at most that much older than the scrape.
* ``--metrics-token``: when set, ``/metrics`` answers 401 without ``Authorization: Bearer <token>``.
* ``--metrics-listen HOST:PORT``: ``/metrics`` (and ``/healthz``) are served by
  :class:`MetricsListener` on their own socket, e.g. an interface only the monitoring network
  reaches, and the main port answers 404 for ``/metrics``. It is plain HTTP/1.1, one request per
  connection, the request head bounded (8 KiB, 5 s).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import time
from collections.abc import Callable
from typing import Final

import structlog

__all__ = ["ExpositionCache", "MetricsListener", "metrics_token_refused", "parse_listen"]

log = structlog.get_logger(__name__)

_MAX_HEAD_BYTES: Final = 8192
_HEAD_TIMEOUT_S: Final = 5.0


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
    """A plain HTTP listener for ``/metrics`` and ``/healthz`` only (``--metrics-listen``).

    Args:
        exposition: the body and content type; None while the coordinator cannot answer (503).
        token: the ``--metrics-token``, if any.
    """

    def __init__(self, exposition: Callable[[], tuple[bytes, str] | None], token: str | None) -> None:
        self._exposition = exposition
        self._token = token
        self._server: asyncio.Server | None = None
        self.port = 0

    async def start(self, host: str, port: int) -> None:
        """Bind ``host:port`` (0: a free port, then read :attr:`port`)."""
        self._server = await asyncio.start_server(self._serve, host, port, limit=_MAX_HEAD_BYTES)
        self.port = self._server.sockets[0].getsockname()[1]
        log.info("metrics listening", host=host, port=self.port)

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            async with asyncio.timeout(_HEAD_TIMEOUT_S):
                head = await reader.readuntil(b"\r\n\r\n")
            status, body, content_type, extra = self._answer(head)
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, TimeoutError, ConnectionError):
            writer.close()
            return
        lines = [f"HTTP/1.1 {status}", f"Content-Type: {content_type}", f"Content-Length: {len(body)}",
                 "Cache-Control: no-store", "Connection: close", *extra]
        try:
            writer.write(("\r\n".join(lines) + "\r\n\r\n").encode() + body)
            await writer.drain()
        except ConnectionError:
            pass
        finally:
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()

    def _answer(self, head: bytes) -> tuple[str, bytes, str, list[str]]:
        text = "text/plain; charset=utf-8"
        request_line, *header_lines = head.decode("latin-1").split("\r\n")
        parts = request_line.split(" ")
        path = parts[1].split("?", 1)[0] if len(parts) == 3 else ""
        if path == "/healthz":
            return "200 OK", b"ok\n", text, []
        if path != "/metrics":
            return "404 Not Found", b"this listener serves /metrics and /healthz\n", text, []
        authorization = None
        for line in header_lines:
            name, _, value = line.partition(":")
            if name.strip().lower() == "authorization":
                authorization = value.strip()
        refused = metrics_token_refused(authorization, self._token)
        if refused is not None:
            return "401 Unauthorized", (refused + "\n").encode(), text, ['WWW-Authenticate: Bearer realm="fleetwire"']
        exposition = self._exposition()
        if exposition is None:
            return "503 Service Unavailable", b"not ready: loading the store\n", text, ["Retry-After: 1"]
        body, content_type = exposition
        return "200 OK", body, content_type, []
