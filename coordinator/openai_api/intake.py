"""The HTTP/1.1 requests of one connection to the OpenAI door: heads, bodies, limits. Sans-I/O.

Rules (docs/OPENAI.md §Limits):

* Bytes go in with :meth:`RequestReader.feed`; whole requests come out (:class:`HttpRequest`),
  in order, several when a client pipelines them. Heads are found and parsed by the one head
  codec (protocol/transfer/http1.py: strict, no smuggling).
* A body is read by its ``Content-Length``, which must be at most ``max_body_bytes``: a larger
  one is refused 413 from the head alone, before any of it is read. A body without a length
  (``Transfer-Encoding``) is refused 411: every OpenAI client, curl and httpx send the length.
* ``Expect: 100-continue`` (curl's, for bodies over 1 KiB) gets ``100 Continue`` once the head
  is accepted, so the client sends the body at once instead of after its own timeout.
* A head over ``max_head_bytes`` is 431, a malformed one 400. Any refusal leaves the connection's
  framing unknown: the driver answers it and closes the connection.

Pure: no I/O, no clock.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Final

from coordinator.openai_api.errors import ApiError
from protocol.transfer.http1 import CONTINUE, HeadError, HeadTooLarge, head_end, parse_request

__all__ = ["MAX_BODY_BYTES", "MAX_HEAD_BYTES", "HttpRequest", "RequestReader"]

MAX_HEAD_BYTES: Final = 16 * 1024
MAX_BODY_BYTES: Final = 8 << 20


@dataclass(slots=True)
class HttpRequest:
    """One whole request: method, path (no query), lower-cased headers, body, and whether the
    connection may serve another request after it."""

    method: str
    path: str
    headers: dict[str, str] = field(default_factory=dict)
    body: bytes = b""
    keep_alive: bool = True


class RequestReader:
    """Cuts one connection's bytes into requests (module docstring).

    Args:
        max_head_bytes: a head's limit (431 past it).
        max_body_bytes: a body's limit (413 past it).
    """

    def __init__(self, max_head_bytes: int = MAX_HEAD_BYTES, max_body_bytes: int = MAX_BODY_BYTES) -> None:
        self.max_head_bytes = max_head_bytes
        self.max_body_bytes = max_body_bytes
        self._buf = bytearray()
        self._searched = 0  # bytes of _buf already searched for the head's end
        self._head: HttpRequest | None = None  # a head whose body is still coming
        self._length = 0

    @property
    def buffered(self) -> int:
        """Bytes held that are not yet a whole request."""
        return len(self._buf)

    def feed(self, data: bytes) -> list[HttpRequest | bytes]:
        """The requests ``data`` completes, in order; ``bytes`` among them are interim answers to write
        at once (``100 Continue``).

        Raises:
            ApiError: 400, 411, 413 or 431 (module docstring); the connection must be closed after it.
        """
        self._buf += data
        out: list[HttpRequest | bytes] = []
        while True:
            if self._head is None:
                try:
                    end = head_end(self._buf, self.max_head_bytes, self._searched)
                except HeadTooLarge:
                    raise ApiError(431, f"the request head is over {self.max_head_bytes} bytes") from None
                if end < 0:
                    self._searched = len(self._buf)
                    return out
                self._searched = 0
                head = bytes(self._buf[:end])
                del self._buf[:end]
                request = self._parse(head)
                if self._length and request.headers.get("expect", "").lower() == "100-continue" \
                        and len(self._buf) < self._length:
                    out.append(CONTINUE)
                self._head = request
            if len(self._buf) < self._length:
                return out
            request, self._head = self._head, None
            request.body = bytes(self._buf[:self._length])
            del self._buf[:self._length]
            self._length = 0
            out.append(request)

    def _parse(self, head: bytes) -> HttpRequest:
        try:
            parsed = parse_request(head)
        except HeadError as exc:
            raise ApiError(400, str(exc)) from None
        headers = parsed.headers
        if "transfer-encoding" in headers:
            raise ApiError(411, "send the body with a Content-Length (Transfer-Encoding is not taken here)")
        length_text = headers.get("content-length", "0") or "0"
        if not length_text.isdigit():
            raise ApiError(400, f"Content-Length must be a number of bytes, got {length_text[:40]!r}")
        length = int(length_text)
        if length > self.max_body_bytes:
            raise ApiError(413, f"the request body is {length} bytes; at most {self.max_body_bytes} are taken")
        self._length = length
        keep_alive = parsed.keep_alive
        if parsed.version == "1.0":  # HTTP/1.0 closes unless asked not to
            keep_alive = headers.get("connection", "").lower() == "keep-alive"
        return HttpRequest(parsed.method, parsed.path, headers, b"", keep_alive)
