"""Plain HTTP on the coordinator's own port: health, readiness, metrics and the dashboard.

websockets hands every request to ``process_request`` before the upgrade; the front door
(coordinator/io/frontdoor/door.py) admits the websocket paths and asks :func:`respond` for every
other path of a core's port (docs/OPERATIONS.md §HTTP endpoints):

====================  ===========================================================
``/healthz``          200 ``ok``: the process is up and its event loop answers.
``/readyz``           200 ``ready`` when the listener accepts and the store (if any) is
                      loaded and open; else 503 with the reason (``loading the store``
                      while a restart reads it: the port opens before the load).
``/metrics``          Prometheus text format (coordinator/io/ops/metrics.py); 503 while the
                      store loads.
``/``                 the dashboard page; its files are under ``/dashboard/``.
====================  ===========================================================

These paths carry no plan data, so they need no token; the dashboard's data comes over its
own websocket session, which does (docs/PROTOCOL.md §1, the bearer subprotocol). Files are
read once, at import, from ``coordinator/io/dashboard/`` (coordinator/io/dashboard/assets.py):
nothing is loaded from elsewhere, and a request can never name a file outside that fixed set.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Final
from urllib.parse import urlsplit

from websockets.datastructures import Headers
from websockets.http11 import Request, Response

from coordinator.io.dashboard.assets import STATIC
from coordinator.io.ops.metrics_http import metrics_token_refused, wants_openmetrics

__all__ = ["WEBSOCKET_PATHS", "loading", "respond"]

WEBSOCKET_PATHS: Final = frozenset({"/v1/worker", "/v1/client"})

# The page runs only its own script and style, and talks only to this host's websocket.
_CSP: Final = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "connect-src 'self' ws: wss:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)


def _response(status: int, body: bytes, content_type: str, **extra: str) -> Response:
    headers = Headers(
        [
            ("Content-Type", content_type),
            ("Content-Length", str(len(body))),
            ("Cache-Control", "no-store"),
            ("X-Content-Type-Options", "nosniff"),
            ("Connection", "close"),
        ]
    )
    for name, value in extra.items():
        headers[name.replace("_", "-")] = value
    reason = {200: "OK", 401: "Unauthorized", 404: "Not Found", 503: "Service Unavailable"}.get(status, "")
    return Response(status, reason, headers, body)


def _text(status: int, text: str) -> Response:
    return _response(status, text.encode(), "text/plain; charset=utf-8")


def loading(reason: str) -> Response:
    """503 for a request the coordinator cannot answer until its store is loaded; retry in a second."""
    body = f"not ready: {reason}\n".encode()
    return _response(503, body, "text/plain; charset=utf-8", Retry_After="1")


def respond(
    request: Request,
    *,
    ready: Callable[[], str | None],
    metrics: Callable[[bool], tuple[bytes, str] | None],
    metrics_token: str | None = None,
    metrics_elsewhere: bool = False,
) -> Response:
    """The answer to a plain HTTP request of a path that is not a websocket endpoint (door.py admits those).

    Args:
        request: the parsed request.
        ready: None when the coordinator is ready, else why not.
        metrics: the exposition body and its content type (given whether the scrape asked for OpenMetrics);
            None while the store loads.
        metrics_token: ``/metrics`` needs this bearer token (401 without it); None: open.
        metrics_elsewhere: ``/metrics`` is served on ``--metrics-listen``: 404 here.
    """
    path = urlsplit(request.path).path
    if path == "/healthz":
        return _text(200, "ok\n")
    if path == "/readyz":
        problem = ready()
        return _text(200, "ready\n") if problem is None else _text(503, f"not ready: {problem}\n")
    if path == "/metrics":
        if metrics_elsewhere:
            return _text(404, "/metrics is served on the coordinator's --metrics-listen address\n")
        refused = metrics_token_refused(request.headers.get("Authorization"), metrics_token)
        if refused is not None:
            return _response(401, (refused + "\n").encode(), "text/plain; charset=utf-8",
                             WWW_Authenticate='Bearer realm="fleetwire"')
        exposition = metrics(wants_openmetrics(request.headers.get("Accept")))  # OpenMetrics: with exemplars
        if exposition is None:
            return loading(ready() or "loading the store")
        body, content_type = exposition
        return _response(200, body, content_type)
    static = STATIC.get(path)
    if static is not None:
        body, content_type = static
        return _response(200, body, content_type, Content_Security_Policy=_CSP, X_Frame_Options="DENY")
    known = ", ".join(sorted({*WEBSOCKET_PATHS, "/healthz", "/readyz", "/metrics", "/"}))
    return _text(404, f"unknown path {path}; fleetwire serves {known}\n")

