"""A request forwarded to the coordinator that serves it, and its answer relayed back. Sans-I/O.

In cluster mode every main port serves the door (docs/OPENAI.md §Cluster mode): a request whose
pool's shard another coordinator owns is sent to that shard's own port and its answer passed
back to the client as it comes, streams included (coordinator/io/cluster/openai_route.py drives
this module).

Rules:

* **The request** (:func:`upstream_request`) is the client's, head and body: the same method,
  path and headers (its key included: the owner authenticates it again), less the hop-by-hop
  ones (``Connection``, ``Keep-Alive``, ``Expect``, ``TE``, ``Upgrade``), with ``Connection:
  close`` (one upstream connection per request: its end is the answer's end) and
  ``X-Forwarded-For``. Heads go through the one head codec (protocol/transfer/http1.py).
* **The answer** (:class:`ResponseRelay`): the head is read whole and written again with the
  client's own ``Connection`` (kept alive unless the client said close); the body is passed on
  byte for byte, never re-framed, while an HTTP parser follows its framing (``Content-Length``
  or chunked) to say when it is complete. A connection that serves another request after the
  answer needs that: the upstream's close alone cannot say whether the body was whole.
* A head that is not HTTP/1.x, or larger than :data:`MAX_HEAD_BYTES`, is a 502. An answer the
  upstream ends before it is complete (:attr:`ResponseRelay.complete` False at its close) is
  the driver's to say: a 502 when nothing was passed on yet, else the client connection is
  closed without the body's end, which every HTTP client reports (never a silent cut).

Pure: no I/O, no clock.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Final

import httptools

from coordinator.openai_api.errors import ApiError
from protocol.transfer.http1 import HeadError, HeadTooLarge, format_request, format_response, head_end, parse_response

__all__ = ["HOP_BY_HOP", "MAX_HEAD_BYTES", "ResponseRelay", "upstream_request"]

MAX_HEAD_BYTES: Final = 64 * 1024
#: Headers that are the connection's, not the request's: never forwarded (RFC 9110 §7.6.1).
HOP_BY_HOP: Final = frozenset({"connection", "keep-alive", "expect", "te", "upgrade", "proxy-connection",
                               "transfer-encoding", "trailer"})  # fmt: skip


def upstream_request(method: str, path: str, headers: Mapping[str, str], body: bytes, *, client: str) -> bytes:
    """The client's request as sent upstream (module docstring); ``client``: its address, for ``X-Forwarded-For``."""
    sent = {name: value for name, value in headers.items() if name not in HOP_BY_HOP}
    sent["content-length"] = str(len(body))
    forwarded = headers.get("x-forwarded-for")
    if client:
        sent["x-forwarded-for"] = f"{forwarded}, {client}" if forwarded else client
    sent["connection"] = "close"
    return format_request(method, path, sent) + body


class _Framing:
    """httptools' callbacks: only the end of the message matters here."""

    __slots__ = ("complete",)

    def __init__(self) -> None:
        self.complete = False

    def on_message_complete(self) -> None:
        self.complete = True


class ResponseRelay:
    """One upstream answer, passed on to the client (module docstring).

    Args:
        keep_alive: the client's connection serves another request after this answer.
    """

    def __init__(self, *, keep_alive: bool) -> None:
        self.keep_alive = keep_alive
        self.status = 0  # the answer's status once its head was read (0: not yet)
        self.relayed = 0  # bytes passed on to the client
        self._head = bytearray()
        self._framing = _Framing()
        self._parser = httptools.HttpResponseParser(self._framing)
        self._until_close = False  # a body with neither length nor chunks: it ends with the connection

    @property
    def complete(self) -> bool:
        """The whole answer was passed on."""
        return self._framing.complete

    def feed(self, data: bytes) -> bytes:
        """Upstream bytes in; what to write to the client out.

        Raises:
            ApiError: 502 for an upstream head that is not HTTP/1.x or is too large (the driver answers it
                when nothing was passed on yet).
        """
        if self.status == 0:
            self._head += data
            try:
                end = head_end(self._head, MAX_HEAD_BYTES)
            except HeadTooLarge:
                raise ApiError(502, f"the shard's owner answered with a head over {MAX_HEAD_BYTES} bytes") from None
            if end < 0:
                return b""
            head, rest = bytes(self._head[:end]), bytes(self._head[end:])
            self._head.clear()
            out = self._rewrite(head) + rest
            self._parse(head + rest)
        else:
            out = data
            self._parse(data)
        self.relayed += len(out)
        return out

    def eof(self) -> None:
        """The upstream closed: an answer delimited by the close is complete now."""
        if self._until_close and self.status:
            self._framing.complete = True

    def _parse(self, data: bytes) -> None:
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as exc:
            raise ApiError(502, f"the shard's owner sent a malformed answer: {exc}") from None

    def _rewrite(self, head: bytes) -> bytes:
        """The head again, with the client's ``Connection`` (module docstring)."""
        try:
            response = parse_response(head)
        except HeadError as exc:
            raise ApiError(502, f"the shard's owner did not answer in HTTP: {exc}") from None
        self.status = response.status
        headers = {name: value for name, value in response.headers.items() if name not in ("connection", "keep-alive")}
        framed = "content-length" in headers or "chunked" in headers.get("transfer-encoding", "").lower()
        if not framed and response.status not in (204, 304) and response.status >= 200:
            self._until_close = True  # the client can only tell its end by the close
            self.keep_alive = False
        if not self.keep_alive:
            headers["connection"] = "close"
        return format_response(response.status, headers, response.reason)
