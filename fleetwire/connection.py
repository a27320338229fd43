"""The client's websocket: the URL to dial, the handshake, TLS, and what a close means.

Split out of fleetwire/client.py: these are the parts of a session that talk about the
connection itself (dialling, refusals, close codes), not about requests and plans.
"""

from __future__ import annotations

import asyncio
import os
import ssl
from collections.abc import Sequence
from typing import Any, Final
from urllib.parse import parse_qs, urlencode, urlsplit

import msgspec
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import InvalidHandshake, InvalidStatus, InvalidURI
from websockets.frames import CloseCode
from websockets.typing import Subprotocol

from fleetwire.errors import AuthError, FleetwireConnectionError
from protocol import errors as codes
from protocol.codec import ENCODING_SUBPROTOCOL, Encoding
from protocol.messages import Unsubscribe
from protocol.tracecontext import ACCEPTS_HEADER, ACCEPTS_SHORT_UNSAMPLED, UNSAMPLED, UNSAMPLED_SHORT
from protocol.transfer import http1
from protocol.urls import SINGLE_KEEPALIVE, UrlTurn, websocket_url
from wireio.frame_sink import FrameSink, SinkConnection

__all__ = [
    "CLIENT_PATH",
    "DEFAULT_MAX_FRAME_BYTES",
    "RECONNECT_DIAL_TIMEOUT_S",
    "FirstReply",
    "UrlList",
    "dial",
    "ending_error",
    "first_probe",
    "keepalive_gave_up",
    "resolve_url",
    "resolve_urls",
    "serves_plain_http",
    "unsampled_form",
]

CLIENT_PATH: Final = "/v1/client"
DEFAULT_MAX_FRAME_BYTES: Final = 16 * 2**20
#: A cluster reconnect's dial to one URL, at most (``Client(reconnect_dial_timeout_s=)``): the upgrade's round trip
#: takes milliseconds; a frozen coordinator (SIGSTOP, a hung host) accepts the TCP connection and answers nothing.
RECONNECT_DIAL_TIMEOUT_S: Final = 3.0
# The probe that goes first on a connection (first_probe): an ``unsubscribe`` of nothing changes nothing, and every
# coordinator answers it ``ok`` (req_id 0: the session drops it); a core's port ahead of its commit queue
# (coordinator/io/frontdoor/core_driver.py CoreSession), a view session at once, from no rows.
_PROBES: Final = {False: msgspec.msgpack.encode([Unsubscribe()]), True: msgspec.json.encode([Unsubscribe()])}

_CLOSE_MEANINGS: Final[dict[int, str]] = {
    codes.CLOSE_NORMAL: "normal closure",
    codes.CLOSE_GOING_AWAY: "the coordinator is shutting down",
    codes.CLOSE_TOO_BIG: "a frame was over the coordinator's size limit",
    codes.CLOSE_INTERNAL: "internal error in the coordinator",
    codes.CLOSE_PROTOCOL: "too many protocol errors on this session",
    codes.CLOSE_FORBIDDEN: "a message this role may not send",
    codes.CLOSE_MOVED: "another coordinator of the cluster owns this shard",
}


def resolve_url(url: str | None) -> str:
    """The websocket URL to dial: ``url`` or ``$FLEETWIRE_URL``, with ``/v1/client`` when it has no path."""
    if url is None:
        url = os.environ.get("FLEETWIRE_URL")
    if not url:
        raise ValueError("no coordinator URL: pass url='ws://host:port' or set FLEETWIRE_URL")
    # http(s):// (the dashboard's address) means ws(s)://; no scheme is refused (protocol/urls.py).
    return websocket_url(url, CLIENT_PATH)


def resolve_urls(url: str | Sequence[str] | None, *, pool: str = "") -> list[str]:
    """Every coordinator URL to try: a list, or ``a,b,c`` (``url`` or ``$FLEETWIRE_URL``), each resolved.

    ``pool``: the worker pool the session is for (cluster mode); sent as ``?pool=NAME`` so a
    coordinator that does not own its shard answers ``moved`` at once.
    """
    if url is None:
        url = os.environ.get("FLEETWIRE_URL")
    items = [u.strip() for u in url.split(",")] if isinstance(url, str) else [u.strip() for u in url or ()]
    items = [u for u in items if u]
    if not items:
        raise ValueError("no coordinator URL: pass url='ws://host:port' (or a list) or set FLEETWIRE_URL")
    resolved = [resolve_url(u) for u in items]
    if pool:
        resolved = [u if urlsplit(u).query else f"{u}?{urlencode({'pool': pool})}" for u in resolved]
    return resolved


class UrlList:
    """Which URL to dial next: the one a ``moved`` named, else the next of the list in turn (protocol/urls.py
    :class:`~protocol.urls.UrlTurn`: a URL whose dial timed out, or whose connection then heard nothing, goes to the
    back).

    ``tried`` keeps the URLs of the dials that failed since the last success (for the error
    that names them).
    """

    def __init__(self, urls: list[str]) -> None:
        self.urls = urls
        self.tried: list[str] = []
        self._turn = UrlTurn(urls)
        self._moved: str | None = None
        self.current = urls[0]

    def move_to(self, url: str) -> None:
        """A ``moved`` named ``url`` (empty: none known; go on with the list)."""
        self._moved = resolve_url(url) if url else None

    def pick(self) -> str:
        if self._moved is not None:
            self.current, self._moved = self._moved, None
        else:
            self.current = self._turn.next()
        return self.current

    def failed(self, url: str, *, timed_out: bool = False) -> str:
        """Note a failed dial (``timed_out``: nothing answered within the dial's timeout); the URLs tried so far,
        for the error."""
        if url not in self.tried:
            self.tried.append(url)
        if timed_out:
            self._turn.ended(url, timed_out=True)
        return ", ".join(self.tried)

    def succeeded(self) -> None:
        self.tried = []
        self._turn.ended(self.current, timed_out=False)

    def went_silent(self, url: str) -> None:
        """The connection to ``url`` upgraded and then ended with nothing back (no frame, no pong, no close): to the
        back of the turn, as a dial that timed out (a coordinator whose loop is wedged)."""
        self._turn.ended(url, timed_out=True)


async def dial(
    url: str,
    *,
    encoding: Encoding,
    token: str | None,
    open_timeout_s: float | None,
    max_frame_bytes: int | None,
    ca_file: str | None,
    ping_interval_s: float | None = SINGLE_KEEPALIVE[0],
    ping_timeout_s: float | None = SINGLE_KEEPALIVE[1],
    close_timeout_s: float = SINGLE_KEEPALIVE[2],
) -> ClientConnection:
    """A new websocket to the coordinator (the first one, or one that resumes the session).

    ``ping_interval_s``/``ping_timeout_s``: websocket pings; a coordinator that answers none
    within the timeout (frozen, partitioned) ends the session. None: no pings.
    ``close_timeout_s``: how long a closing connection waits for the coordinator's close frame.

    Raises:
        AuthError: HTTP 401 or 403 at the handshake.
        FleetwireConnectionError: unreachable, another refusal, or the encoding was not accepted.
        ValueError: a bad URL or CA file.
    """
    subprotocol = Subprotocol(ENCODING_SUBPROTOCOL[encoding])
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    try:
        ws = await connect(
            url,
            subprotocols=[subprotocol],
            additional_headers=headers,
            compression=None,
            open_timeout=open_timeout_s,
            max_size=max_frame_bytes,
            proxy=None,
            ping_interval=ping_interval_s,
            ping_timeout=ping_timeout_s,
            close_timeout=close_timeout_s,
            create_connection=SinkConnection,  # relayed chunks past the library's copies; frames to the reader's sink
            **_tls(url, ca_file),
        )
    except InvalidStatus as exc:
        wait_s = codes.retry_after_seconds(exc.response.headers.get("Retry-After"))
        body = exc.response.body.decode("utf-8", "replace").strip().splitlines()
        raise _handshake_refused(url, token, exc.response.status_code, wait_s, body[0] if body else "") from exc
    except InvalidURI as exc:
        raise ValueError(f"invalid coordinator URL {url!r}: {exc}") from exc
    except (OSError, InvalidHandshake) as exc:
        why = f"{exc}" or type(exc).__name__
        if url.startswith("wss://") and isinstance(exc, (ConnectionResetError, ssl.SSLError)):
            if await serves_plain_http(url, open_timeout_s):
                why = "this coordinator does not serve TLS (it answered plain HTTP); use ws://"
        raise FleetwireConnectionError(f"cannot connect to the coordinator at {url}: {why}") from exc
    if ws.subprotocol not in (subprotocol, None) or (ws.subprotocol is None and encoding != "msgpack"):
        await ws.close()
        raise FleetwireConnectionError(
            f"the coordinator at {url} did not accept subprotocol {subprotocol!r} (it selected {ws.subprotocol!r})",
            answered=True,
        )
    return ws


def unsampled_form(ws: ClientConnection) -> str:
    """How ``submit.traceparent`` says "not sampled" on this connection: ``"0"`` when the coordinator's upgrade
    answer says it accepts it (:data:`~protocol.tracecontext.ACCEPTS_HEADER`, docs/PROTOCOL.md §1), else ``"00"``,
    which every coordinator accepts (one before the header refuses ``"0"``)."""
    response = ws.response
    said = response.headers.get(ACCEPTS_HEADER, "") if response is not None else ""
    return UNSAMPLED_SHORT if ACCEPTS_SHORT_UNSAMPLED in map(str.strip, said.split(",")) else UNSAMPLED


async def serves_plain_http(url: str, timeout_s: float | None) -> bool:
    """Whether ``url``'s host and port answer a plain-HTTP request (a ``wss://`` dial that failed at TLS)."""
    parts = urlsplit(url)
    try:
        async with asyncio.timeout(timeout_s or 5.0):
            reader, writer = await asyncio.open_connection(parts.hostname, parts.port or 443)
            try:
                writer.write(http1.format_request("GET", "/healthz", {"Host": parts.netloc, "Connection": "close"}))
                await writer.drain()
                return http1.is_response(await reader.read(5))
            finally:
                writer.close()
    except (OSError, TimeoutError):
        return False


def _tls(url: str, ca_file: str | None) -> dict[str, Any]:
    """``connect`` arguments for ``wss://``: the system CAs, or only ``ca_file`` when given."""
    if not url.startswith("wss://") or ca_file is None:
        return {}
    try:
        return {"ssl": ssl.create_default_context(cafile=ca_file)}
    except (OSError, ssl.SSLError) as exc:
        raise ValueError(f"cannot load the CA file {ca_file}: {exc}") from exc


def _handshake_refused(
    url: str, token: str | None, status: int, wait_s: float | None = None, said: str = ""
) -> Exception:
    """The error of an HTTP answer to the upgrade: a coordinator answered (``answered``, protocol/backoff.py)."""
    where = f"the coordinator at {url}"
    if status == 401:
        if token is None:
            why = "no token was sent; pass token= or set FLEETWIRE_TOKEN to a client token"
        else:
            why = "the token is not one of its tokens; check token= / FLEETWIRE_TOKEN"
        return AuthError(f"{where} refused the connection (HTTP 401): {why}", status=status)
    if status == 403:
        return AuthError(
            f"{where} refused the connection (HTTP 403): the token is valid but its role may not "
            f"use {CLIENT_PATH} (a worker token?); use a client or admin token",
            status=status,
        )
    if status == 404:
        return FleetwireConnectionError(
            f"{where} has no fleetwire endpoint at this path (HTTP 404); give ws://host:port "
            f"and the SDK appends {CLIENT_PATH}",
            answered=True,
        )
    if status in (429, 503):
        why = (
            "a session of this token from this address was just closed for abuse (penalty box)"
            if status == 429
            else said[:200] or "it is at its connection limit"  # a cluster coordinator says why (database away)
        )
        after = f"; retry after {wait_s:g} s" if wait_s is not None else ""
        return FleetwireConnectionError(
            f"{where} refused the connection (HTTP {status}): {why}{after}", retry_after_s=wait_s, answered=True
        )
    return FleetwireConnectionError(f"{where} refused the websocket upgrade (HTTP {status})", answered=True)


class FirstReply:
    """A connection's first reply, bounded by its dial's timeout (docs/OPERATIONS.md §Reconnects).

    A coordinator can upgrade and then answer keepalive pings and nothing else (its loop's protocol side stuck, a
    proxy that holds the websocket up with nothing behind it): the pings keep the connection up for ever and every
    request on it waits. So the first request sent on a connection (a resume's re-sent requests and resubscriptions,
    or the first call after a connect) must be answered, by any frame, within the bound its dial had (the cluster
    reconnect's ``reconnect_dial_timeout_s``, else ``open_timeout_s``); else the connection is ``silent``: it is
    dropped, and the session resumes at the next URL, this one at the back of the turn, as a dial that timed out.
    Only the first request is bounded: once a frame came, the coordinator is known to serve.

    A coordinator that serves may still take longer than the bound over a request: every reply of a core leaves
    after its step's commit (a store slower than the bound: a frozen PostgreSQL, a loaded disk, a coordinator under
    valgrind), and a cluster's view session answers ``list_workers`` and the worker requests once the owners wrote
    fresh registry rows (up to 3 x ``--lease-renew``), ``cancel`` and ``release_plan`` once the shard's owner answered
    the forward, in the order they came. Bounding those replies would leave a healthy coordinator, and re-send its
    requests to the next, adding load where it hurts. So the first frame on a connection is :func:`first_probe`'s,
    which a core answers ahead of its commit queue and a view session at once: the bound is for that answer, one
    frame a connection; the requests behind it take as long as they take (the keepalive still watches the
    connection). A URL naming a pool or shard gets no probe: its first request's answer is bounded instead.
    """

    __slots__ = ("_timer", "_ws", "asked", "bound_s", "silent", "sink")

    def __init__(self, ws: ClientConnection, sink: FrameSink, bound_s: float | None) -> None:
        self.sink = sink
        self.bound_s = bound_s
        self.asked = False  # a request went out on the connection: the bound is armed
        self.silent = False  # nothing came within bound_s of the first request: the connection was dropped
        self._ws = ws
        self._timer: asyncio.TimerHandle | None = None

    def ask(self) -> None:
        """A request goes out on the connection (the client's writer, before the frame): the first one arms the
        bound."""
        self.asked = True
        if self.bound_s is not None and not self.sink.answered:
            self._timer = asyncio.get_running_loop().call_later(self.bound_s, self._due)

    def cancel(self) -> None:
        """The connection ended."""
        if self._timer is not None:
            self._timer.cancel()

    def error(self, url: str) -> FleetwireConnectionError:
        """Why a silent connection ended (resumable: no close code)."""
        return FleetwireConnectionError(
            f"the coordinator at {url} answered no request within {self.bound_s:g} s of the first one on this "
            "connection (the dial's bound)"
        )

    def _due(self) -> None:
        # A frame read in the loop's turn that ran this timer is handed to the reader task only in the next turn (a
        # text frame is counted there, not in the socket's read): look once more after it, so a loop that was busy
        # past the bound does not leave a coordinator whose answer came in time.
        if not self.sink.answered:
            self._timer = None
            asyncio.get_running_loop().call_soon(self._recheck)

    def _recheck(self) -> None:
        if not self.sink.answered:
            self.silent = True
            self._ws.transport.abort()  # no close handshake: it would wait close_timeout for a peer that answers none


def first_probe(url: str, text: bool) -> bytes | None:
    """The frame to send first on a connection to ``url``, whose answer the first reply's bound is for
    (:class:`FirstReply`); None for a URL naming a pool or shard (a main port moves such a session by its first
    message, a submit by its partition: the probe must not be that first message); ``text``: the connection's frames
    are JSON."""
    query = parse_qs(urlsplit(url).query)
    return None if "pool" in query or "shard" in query else _PROBES[text]


def keepalive_gave_up(ws: ClientConnection) -> bool:
    """Whether the connection ended because its keepalive ping went unanswered (websockets fails it with 1011) and
    the coordinator sent no close: it went silent, as opposed to a drop or a close it chose."""
    sent = ws.protocol.close_sent
    return ws.protocol.close_rcvd is None and sent is not None and sent.code == CloseCode.INTERNAL_ERROR


def ending_error(ws: ClientConnection, url: str, *, closing: bool) -> FleetwireConnectionError:
    """Why a session's websocket ended: closed by us, lost, or closed by the coordinator with a code."""
    if closing:
        return FleetwireConnectionError("the client was closed")
    rcvd = ws.protocol.close_rcvd
    if rcvd is None:
        return FleetwireConnectionError(f"lost the connection to the coordinator at {url}")
    meaning = _CLOSE_MEANINGS.get(rcvd.code, "")
    text = f"the coordinator closed the session with code {rcvd.code}"
    text += f" ({meaning})" if meaning else ""
    text += f": {rcvd.reason}" if rcvd.reason else ""
    return FleetwireConnectionError(text, close_code=rcvd.code, close_reason=rcvd.reason)
