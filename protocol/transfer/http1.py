"""HTTP/1.1 heads: the one place fleetwire reads or writes them (docs/PROTOCOL.md §Data plane).

Every part that speaks plain HTTP/1.1 (the worker's data endpoint and the SDK's direct
transport, the coordinator's ``--metrics-listen`` listener, the SDK's plain-HTTP probe of a
``wss://`` address, and the bulk-frame reader's look at a websocket handshake) finds, parses and
writes heads here; bodies never pass through this module (they go from the socket into the
caller's buffers, or by ``sendfile``).

Rules:

* :func:`head_end` finds the blank line that ends a head; past ``limit`` bytes without one the
  head is refused (:class:`HeadTooLarge`: 431 on a server). A head ends at ``CRLF CRLF`` only: a
  head with bare line feeds never ends, and is refused by its size or its deadline.
* :func:`parse_request` and :func:`parse_response` parse one whole head with ``httptools``
  (llhttp, the parser of Node.js): strict where our hand parsers were lenient, so a head with a
  space before a colon, two ``Content-Length`` s, an obsolete line folding or both
  ``Transfer-Encoding`` and ``Content-Length`` raises :class:`HeadError` (400 on a server; a
  request smuggled past a proxy that reads such a head otherwise). Header names are lower-cased;
  a repeated header keeps its last value. The version must be 1.x.
* :func:`format_request` and :func:`format_response` write heads (latin-1, ``CRLF``); a
  header value with a line break is refused (``ValueError``): no caller can inject a header.
* :func:`format_chunk` and :data:`LAST_CHUNK` frame a chunked body (the OpenAI door's event
  streams); :func:`first_line` peeks at a request line before its head is whole.
* No I/O: bytes in, values out.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Final

import httptools

__all__ = [
    "CONTINUE",
    "LAST_CHUNK",
    "REASONS",
    "HeadError",
    "HeadTooLarge",
    "Request",
    "Response",
    "first_line",
    "format_chunk",
    "format_request",
    "format_response",
    "head_end",
    "is_response",
    "parse_request",
    "parse_response",
]

_END: Final = b"\r\n\r\n"
REASONS: Final = {
    100: "Continue", 200: "OK", 201: "Created", 204: "No Content", 206: "Partial Content", 400: "Bad Request",
    401: "Unauthorized", 403: "Forbidden", 404: "Not Found", 405: "Method Not Allowed", 409: "Conflict",
    410: "Gone", 411: "Length Required", 413: "Content Too Large", 416: "Range Not Satisfiable",
    422: "Unprocessable Content", 431: "Request Header Fields Too Large", 503: "Service Unavailable",
    507: "Insufficient Storage",
}


class HeadError(ValueError):
    """A head that is not well-formed HTTP/1.x; the message says what is wrong (a server answers 400)."""


class HeadTooLarge(HeadError):
    """No blank line within the head limit (a server answers 431)."""


@dataclass(slots=True)
class Request:
    """A request head: method, target (as sent, percent-encoded), lower-cased header names."""

    method: str
    target: str
    headers: dict[str, str] = field(default_factory=dict)
    version: str = "1.1"

    @property
    def path(self) -> str:
        """The target without its query."""
        return self.target.split("?", 1)[0]

    @property
    def keep_alive(self) -> bool:
        """Whether the client lets the connection serve another request (no ``Connection: close``)."""
        return self.headers.get("connection", "").lower() != "close"


@dataclass(slots=True)
class Response:
    """A response head: status, reason, lower-cased header names."""

    status: int
    reason: str = ""
    headers: dict[str, str] = field(default_factory=dict)

    @property
    def content_length(self) -> int:
        """The body's length (0 when not said)."""
        return int(self.headers.get("content-length", "0") or 0)

    @property
    def keep_alive(self) -> bool:
        """Whether the server lets the connection serve another request (no ``Connection: close``)."""
        return self.headers.get("connection", "").lower() != "close"


def head_end(buf: bytes | bytearray, limit: int, searched: int = 0) -> int:
    """Where the head at the start of ``buf`` ends (the index just past its blank line); -1: not whole yet.

    ``searched``: how many bytes of ``buf`` were searched by an earlier call (they are not again).

    Raises:
        HeadTooLarge: more than ``limit`` bytes and no blank line.
    """
    end = buf.find(_END, max(0, searched - 3))
    if end >= 0:
        return end + 4
    if len(buf) > limit:
        raise HeadTooLarge(f"no end of the head within {limit} bytes")
    return -1


class _Head:
    """httptools' callbacks: what a head says."""

    __slots__ = ("done", "headers", "reason", "url")

    def __init__(self) -> None:
        self.url = b""
        self.reason = b""
        self.headers: dict[str, str] = {}
        self.done = False

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_status(self, reason: bytes) -> None:
        self.reason += reason

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers[name.decode("latin-1").lower()] = value.decode("latin-1")

    def on_headers_complete(self) -> None:
        self.done = True


def parse_request(head: bytes | bytearray) -> Request:
    """A whole request head (through its blank line, as :func:`head_end` found it).

    Raises:
        HeadError: not a well-formed HTTP/1.x request head; the message says why.
    """
    seen = _Head()
    parser = httptools.HttpRequestParser(seen)
    try:
        parser.feed_data(bytes(head))
    except httptools.HttpParserUpgrade:
        pass  # an Upgrade or CONNECT head: whole all the same (what it asks is the caller's to refuse)
    except httptools.HttpParserError as exc:
        raise HeadError(f"malformed HTTP request head: {exc}") from None
    version = parser.get_http_version()
    if not seen.done or not version.startswith("1."):
        raise HeadError("not an HTTP/1.1 request")
    return Request(parser.get_method().decode("latin-1"), seen.url.decode("latin-1"), seen.headers, version)


def parse_response(head: bytes | bytearray) -> Response:
    """A whole response head (through its blank line).

    Raises:
        HeadError: not a well-formed HTTP/1.x response head; the message says why.
    """
    seen = _Head()
    parser = httptools.HttpResponseParser(seen)
    try:
        parser.feed_data(bytes(head))
    except httptools.HttpParserError as exc:
        if not (seen.done and parser.get_status_code() == 101):  # a 101 pauses the parser: whole all the same
            raise HeadError(f"not an HTTP answer ({exc}): {bytes(head[:80])!r}") from None
    if not seen.done or not parser.get_http_version().startswith("1."):
        raise HeadError(f"not an HTTP/1.1 answer: {bytes(head[:80])!r}")
    return Response(parser.get_status_code(), seen.reason.decode("latin-1"), seen.headers)


def is_response(first: bytes) -> bool:
    """Whether the first bytes a server sent back look like an HTTP answer's (at least 5 of them)."""
    return first[:5] == b"HTTP/"


def _lines(first: str, headers: Mapping[str, str]) -> bytes:
    lines = [first]
    for name, value in headers.items():
        text = f"{name}: {value}"
        if "\r" in text or "\n" in text:
            raise ValueError(f"header {name!r} has a line break in it")
        lines.append(text)
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


def format_request(method: str, target: str, headers: Mapping[str, str]) -> bytes:
    """A request head: ``METHOD target HTTP/1.1``, the headers in order, the blank line."""
    return _lines(f"{method} {target} HTTP/1.1", headers)


def format_response(status: int, headers: Mapping[str, str] | None = None, reason: str = "") -> bytes:
    """A response head: ``HTTP/1.1 status reason`` (:data:`REASONS`' by default), the headers, the blank line."""
    return _lines(f"HTTP/1.1 {status} {reason or REASONS.get(status, 'Status')}", headers or {})


#: The interim answer to ``Expect: 100-continue``: the body may come.
CONTINUE: Final = format_response(100)


#: The end of a chunked body (no trailers).
LAST_CHUNK: Final = b"0\r\n\r\n"


def format_chunk(data: bytes) -> bytes:
    """``data`` as one chunk of a chunked body; empty ``data`` would end the body, so callers skip it."""
    return b"%x\r\n%b\r\n" % (len(data), data)


def first_line(buf: bytes | bytearray, limit: int) -> bytes | None:
    """The line at the start of ``buf`` without its ``CRLF``, if one ends within ``limit`` bytes; else None."""
    end = buf.find(b"\r\n", 0, limit)
    return bytes(buf[:end]) if end >= 0 else None
