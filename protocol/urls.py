"""Coordinator URLs as people type them: ``ws://``/``wss://``, the dashboard's ``http(s)://``, no scheme.

The client SDK and the worker agent both read a URL from a flag or an environment variable;
this is the one place that says which spellings mean what (docs/OPERATIONS.md §URLs):

* ``ws://host:port`` and ``wss://host:port`` as they are;
* ``http://`` and ``https://`` (the scheme the dashboard's address uses) mean ``ws://`` and
  ``wss://``: the coordinator serves both on one port, so the mapping is unambiguous;
* no scheme (``host:port``) is refused: plain or TLS cannot be told from it;
* an empty path (or ``/``) gets the role's endpoint (``/v1/client``, ``/v1/worker``).
"""

from __future__ import annotations

from typing import Final
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

__all__ = [
    "CLUSTER_KEEPALIVE", "SINGLE_KEEPALIVE", "WORKER_ID_PARAM", "BadUrl", "UrlTurn", "keepalive", "named_worker_id",
    "websocket_url", "with_worker_id",
]

# Websocket pings (interval, timeout, close timeout) in seconds. In cluster mode a frozen owner
# (SIGSTOP, a VM pause) loses its shards after the lease TTL (3 s by default) and another
# coordinator serves them; a peer that pings at about the lease renewal, gives up after about the
# TTL and then waits 1 s (not websockets' 10 s) for a close frame that a frozen peer never sends
# finds that out in about 5 s instead of 20 s + 20 s + 10 s (docs/CLUSTER.md §What is promised).
CLUSTER_KEEPALIVE: Final = (1.0, 3.0, 1.0)
SINGLE_KEEPALIVE: Final = (20.0, 20.0, 10.0)  # websockets' defaults: one coordinator, nowhere else to go

#: The query parameter a worker names its id with in the upgrade request (docs/PROTOCOL.md §1): optional;
#: when given, the reconnect-budget penalty box is keyed by it and ``hello`` must name the same id.
WORKER_ID_PARAM: Final = "worker_id"

_SCHEMES: Final = {"ws": "ws", "wss": "wss", "http": "ws", "https": "wss"}


class BadUrl(ValueError):
    """A coordinator URL that cannot be dialled; the message says what was wrong and how to write it."""


def keepalive(
    interval_s: float | None, timeout_s: float | None, *, cluster: bool
) -> tuple[float | None, float | None, float]:
    """``ping_interval``, ``ping_timeout`` and ``close_timeout`` to dial with.

    The given ping figures (0: no pings), else by mode; ``cluster``: several URLs were given, or a
    ``moved`` was followed.
    """
    default = CLUSTER_KEEPALIVE if cluster else SINGLE_KEEPALIVE
    interval = default[0] if interval_s is None else interval_s
    timeout = default[1] if timeout_s is None else timeout_s
    return interval or None, timeout or None, default[2]


def websocket_url(url: str, path: str) -> str:
    """``url`` as a ``ws://``/``wss://`` URL, with ``path`` when it has none.

    Raises:
        BadUrl: no scheme, another scheme, or no host.
    """
    text = url.strip()
    parts = urlsplit(text)
    scheme = parts.scheme.lower()
    if "://" not in text:
        raise BadUrl(
            f"the coordinator URL {url!r} has no scheme: write ws://{text} (plain) or wss://{text} (TLS)"
        )
    if scheme not in _SCHEMES:
        raise BadUrl(
            f"the coordinator URL {url!r} has scheme {parts.scheme}://; use ws:// (plain) or wss:// (TLS), "
            "or the dashboard's http:// / https://"
        )
    if not parts.hostname:
        raise BadUrl(f"the coordinator URL {url!r} has no host: write ws://host:port")
    try:
        parts.port  # noqa: B018 - raises on a port that is not a number
    except ValueError:
        raise BadUrl(f"the coordinator URL {url!r} has a port that is not a number") from None
    new_path = path if parts.path in ("", "/") else parts.path
    return urlunsplit((_SCHEMES[scheme], parts.netloc, new_path, parts.query, parts.fragment))


def with_worker_id(url: str, worker_id: str) -> str:
    """``url`` with ``?worker_id=<worker_id>`` in its query (replacing one it names: the hello must say the same)."""
    parts = urlsplit(url)
    query = [(name, value) for name, value in parse_qsl(parts.query, keep_blank_values=True) if name != WORKER_ID_PARAM]
    query.append((WORKER_ID_PARAM, worker_id))
    return urlunsplit((parts.scheme, parts.netloc, parts.path, urlencode(query), parts.fragment))


def named_worker_id(target: str) -> str | None:
    """The worker id an upgrade request's target (``/v1/worker?worker_id=w1``) names; None when none.

    An empty value names none; given twice, the last one counts (the driver and the core read the same).
    """
    query = urlsplit(target).query
    if not query:
        return None
    named = None
    for name, value in parse_qsl(query, keep_blank_values=True):
        if name == WORKER_ID_PARAM:
            named = value or None
    return named


class UrlTurn:
    """A list of coordinator URLs dialled in turn (round robin), by the SDK (fleetwire/connection.py ``UrlList``) and
    the worker agent (worker_agent/handshake.py ``Dialer``).

    A URL whose dial timed out (a frozen coordinator: its kernel still completes the TCP handshake from the listen
    backlog, then nothing answers the upgrade; for the worker, also a stuck one that upgrades and never answers its
    ``hello``: its dial ends at ``welcome``) goes to the back: the turn skips it while another URL of the list has
    not timed out since, so a reconnect does not wait on it again while the others answer. A dial to it that was
    answered (a ``moved`` named it) clears it; once every URL timed out, all are dialled in turn again.
    """

    def __init__(self, urls: list[str]) -> None:
        self.urls = urls
        self.timed_out: set[str] = set()  # URLs of the list whose last dial timed out: at the back of the turn
        self._next = 0

    def next(self) -> str:
        """The next URL of the list in turn, skipping those that timed out (unless all did)."""
        urls = self.urls
        if len(self.timed_out) >= len(urls):
            self.timed_out.clear()
        for _ in urls:
            url = urls[self._next % len(urls)]
            self._next += 1
            if url not in self.timed_out:
                break
        return url  # (a list naming one URL twice, all of them timed out: the last one tried)

    def ended(self, url: str, *, timed_out: bool) -> None:
        """The dial to ``url`` timed out with nothing back, or was answered (an upgrade, a refusal)."""
        if not timed_out:
            self.timed_out.discard(url)
        elif url in self.urls:
            self.timed_out.add(url)
