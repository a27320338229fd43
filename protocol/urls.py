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
from urllib.parse import urlsplit, urlunsplit

__all__ = ["CLUSTER_KEEPALIVE", "SINGLE_KEEPALIVE", "BadUrl", "keepalive", "websocket_url"]

# Websocket pings (interval, timeout, close timeout) in seconds. In cluster mode a frozen owner
# (SIGSTOP, a VM pause) loses its shards after the lease TTL (3 s by default) and another
# coordinator serves them; a peer that pings at about the lease renewal, gives up after about the
# TTL and then waits 1 s (not websockets' 10 s) for a close frame that a frozen peer never sends
# finds that out in about 5 s instead of 20 s + 20 s + 10 s (docs/CLUSTER.md §What is promised).
CLUSTER_KEEPALIVE: Final = (1.0, 3.0, 1.0)
SINGLE_KEEPALIVE: Final = (20.0, 20.0, 10.0)  # websockets' defaults: one coordinator, nowhere else to go

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
