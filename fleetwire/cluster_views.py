"""Cluster mode: plans of every shard from any coordinator's main port (``GET /v1/plans``, docs/CLUSTER.md).

A session's shard core answers ``plans`` for its own shard only; a coordinator's main port reads
every shard's committed rows from PostgreSQL (admin token). ``fleetwire plans`` uses this when it
is given several coordinator URLs (``--url a,b`` or ``FLEETWIRE_URL``).
"""

from __future__ import annotations

import asyncio
import urllib.error
import urllib.request
from collections.abc import Sequence
from urllib.parse import urlencode, urlsplit, urlunsplit

import msgspec

from fleetwire.errors import AuthError, FleetwireConnectionError
from protocol.messages import PlanInfo, Plans

__all__ = ["MAX_LIMIT", "cluster_plans"]

MAX_LIMIT = 1000  # the main port's largest page (coordinator/io/cluster_views.py)


class _Page(msgspec.Struct):
    plans: list[PlanInfo] = []
    total: int = 0
    counts: dict[str, int] = {}


def _http(url: str, query: dict[str, str]) -> str:
    parts = urlsplit(url)
    scheme = "https" if parts.scheme in ("wss", "https") else "http"
    return urlunsplit((scheme, parts.netloc, "/v1/plans", urlencode(query), ""))


def _get(url: str, token: str | None) -> tuple[int, bytes]:
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


async def cluster_plans(urls: Sequence[str], token: str | None, *, states: Sequence[str] = (),
                        limit: int = 200) -> Plans:  # fmt: skip
    """Plans of every shard (newest store keys first), from the first coordinator of ``urls`` that answers.

    Raises:
        AuthError: no admin token (401/403).
        FleetwireConnectionError: no coordinator answered, or one refused the query (its reason).
    """
    query = {"limit": str(max(1, min(limit, MAX_LIMIT)))}
    if states:
        query["state"] = ",".join(states)
    tried: list[str] = []
    for url in urls:
        target = _http(url, query)
        try:
            status, body = await asyncio.to_thread(_get, target, token)
        except OSError as exc:
            tried.append(f"{target}: {exc}")
            continue
        text = body.decode(errors="replace").strip()
        if status in (401, 403):
            raise AuthError(f"{target} refused (HTTP {status}): {text}", status=status)
        if status != 200:
            tried.append(f"{target}: HTTP {status} {text}")
            continue
        page = msgspec.json.decode(body, type=_Page)
        return Plans(req_id=0, plans=page.plans, counts=page.counts, total=page.total)
    raise FleetwireConnectionError(f"no coordinator answered /v1/plans ({'; '.join(tried)})")
