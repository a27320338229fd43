"""The worker's handshake, sans-I/O: where a dial goes, the ``hello`` it opens with, what the answer means.

What it owns: the rules of a worker session's opening (docs/PROTOCOL.md §1 and §Worker session),
as plain values in and out; worker_agent/agent.py dials, sends and reads around them.

Rules:

* **Where.** ``--url`` names one coordinator or, in cluster mode, a list (``a,b,c``); in cluster
  mode (or with a ``pool:NAME`` tag) each URL asks for the worker's pool (``?pool=NAME``: a
  ``pool:NAME`` tag, else its first tag, as coordinator/shards.py ``pool_of``) unless it has a
  query of its own (:func:`worker_urls`). A dial goes where the last ``moved`` said (and the
  session counts as cluster mode from then on: faster pings, protocol/urls.py ``keepalive``),
  else to the next URL of the list, in turn (:class:`Dialer`).
* **How long a dial may take.** The first dial, and every dial to a lone coordinator, may take
  ``handshake_timeout_s``; in cluster mode a later one (a reconnect) at most
  ``reconnect_dial_timeout_s`` (3 s): a frozen coordinator (SIGSTOP, a hung host) completes the TCP
  handshake from its listen backlog and answers nothing, while the next URL may answer at once.
  The wait for ``welcome`` after ``hello`` gets the same bound: a coordinator that upgrades and then
  answers nothing (stuck) is a dial that timed out too.
  A URL whose dial timed out goes to the back: the turn skips it while another URL of the list has
  not timed out since (all did: every one in turn again; one a ``moved`` named and that answered:
  back in turn).
* **A refused upgrade.** HTTP 401 and 403 are fatal: retrying cannot fix a token, a role or a
  missing client certificate, so :func:`upgrade_refusal` names what to change
  (:class:`~worker_agent.session.AuthError`). Any other status is the agent's backoff's to wait
  out (its Retry-After included).
* **The hello** (:func:`hello`) lists the plans the worker still runs or holds an unsent ``done``
  for, then the newest acknowledged ones that a coordinator's store loss may have taken
  (worker_agent/outbox.py), each once; it carries the ``session_secret`` of this process's last
  ``welcome``, which proves the id on a reconnect (docs/SEMANTICS.md §Worker identity). The secret
  lives in memory only: a restarted process waits until its old session closes or stays silent.
* **The answer** (:class:`Answer`). Frames are read until one message decides: ``welcome`` (the
  messages that came before it, then those after it in its frame, are dispatched after it, in
  order), ``error`` (the hello was refused: its ``retry_after_s`` is the least wait before the
  next dial) or ``moved`` (the next dial goes to its URL, at once).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from urllib.parse import urlencode, urlsplit

from protocol import DecodeFailure
from protocol.messages import Capabilities, Error, Hello, Moved, RunningPlan, ToWorker, Welcome
from protocol.urls import UrlTurn
from worker_agent.session import AuthError, version, worker_url

__all__ = ["Answer", "Dialer", "Welcomed", "hello", "upgrade_refusal", "worker_urls"]


def worker_urls(url: str, tags: Sequence[str]) -> list[str]:
    """The worker endpoints ``--url`` names (``a,b,c``: a cluster's coordinators), with the pool asked for.

    Raises:
        ValueError: (``protocol.urls.BadUrl``) a URL without a host or of another scheme than ws(s)/http(s).
    """
    urls = [worker_url(u.strip()) for u in url.split(",") if u.strip()] or [worker_url(url)]
    pool = _pool_of(tags)
    if pool and (len(urls) > 1 or any(t.startswith("pool:") for t in tags)):
        urls = [u if urlsplit(u).query else f"{u}?{urlencode({'pool': pool})}" for u in urls]
    return urls


def _pool_of(tags: Sequence[str]) -> str:
    """The worker's pool: a ``pool:NAME`` tag, else its first tag (as coordinator/shards.py ``pool_of``)."""
    for tag in tags:
        if tag.startswith("pool:"):
            return tag[5:]
    return tags[0] if tags else ""


class Dialer:
    """Where the next dial goes: where the last ``moved`` said, else the list's next URL in turn.

    Args:
        urls: the coordinators' worker endpoints, tried in turn (one, or a cluster's list).

    Attributes:
        cluster: several URLs, or a ``moved`` was followed: the session pings as in cluster mode.
    """

    def __init__(self, urls: Sequence[str]) -> None:
        self._turn = UrlTurn(list(urls))  # the list in turn, a URL that timed out at the back (protocol/urls.py)
        self.dialled = False  # a dial was made: the next is a reconnect
        self._moved_to: str | None = None  # where the last ``moved`` said this worker's shard is served
        self.cluster = len(self._turn.urls) > 1

    @property
    def moved(self) -> bool:
        """A ``moved`` named where to go: the next dial goes there, without a backoff."""
        return self._moved_to is not None

    def next_url(self) -> str:
        """The URL to dial now."""
        if self._moved_to is not None:
            self.cluster = True
            url, self._moved_to = self._moved_to, None
            return url
        return self._turn.next()

    def timeout_s(self, handshake_timeout_s: float, reconnect_dial_timeout_s: float) -> float:
        """How long the dial now may take: the first one and a lone coordinator's ``handshake_timeout_s``, a cluster
        reconnect's at most ``reconnect_dial_timeout_s``."""
        first, self.dialled = not self.dialled, True
        if first or not self.cluster:
            return handshake_timeout_s
        return min(handshake_timeout_s, reconnect_dial_timeout_s)

    def dial_ended(self, url: str, *, timed_out: bool) -> None:
        """The dial to ``url`` was answered (an upgrade, a refusal) or timed out with nothing back."""
        self._turn.ended(url, timed_out=timed_out)

    def follow(self, moved: Moved) -> None:
        """Cluster mode: the shard of this worker's pool is served at ``moved.url`` ("": try the list)."""
        self._moved_to = worker_url(moved.url) if moved.url else None


def upgrade_refusal(url: str, status: int, body: bytes | bytearray) -> AuthError | None:
    """What an HTTP refusal of the upgrade at ``url`` means: an ``AuthError`` (fatal) for 401 and 403, else None."""
    if status == 401:
        return AuthError(
            f"coordinator at {url} refused the worker token (HTTP 401): "
            "pass a valid worker token with --token or FLEETWIRE_WORKER_TOKEN",
            status=status,
        )
    if status != 403:
        return None
    reason = body.decode("utf-8", "replace").strip()
    if "client certificate" in reason:  # mTLS: the token may be fine; the certificate is missing
        return AuthError(
            f"coordinator at {url} requires a client certificate (mTLS, HTTP 403): pass the "
            "worker's certificate and key with --tls-cert and --tls-key",
            status=status,
        )
    return AuthError(
        f"coordinator at {url} accepted the token but not for a worker (HTTP 403): "
        f"use a token with the worker role ({reason or 'no reason given'})",
        status=status,
    )


def hello(
    worker_id: str,
    capabilities: Capabilities,
    *,
    running: list[RunningPlan],
    recent: Callable[[set[str]], list[RunningPlan]],
    session_secret: str,
    data_url: str,
) -> Hello:
    """The ``hello`` a session opens with.

    Args:
        worker_id: the id to register.
        capabilities: what this worker offers now (its ops included).
        running: the plans it runs or holds an unsent ``done`` for.
        recent: the newest acknowledged results, but those of the plan ids given
            (worker_agent/outbox.py ``recent_done``).
        session_secret: from the last ``welcome`` ("" before any).
        data_url: its data endpoint ("" without one).
    """
    listed = running + recent({r.plan_id for r in running})
    return Hello(
        worker_id=worker_id, capabilities=capabilities, running=listed, version=version(),
        session_secret=session_secret, data_url=data_url,
    )


@dataclass(frozen=True)
class Welcomed:
    """The coordinator welcomed the worker; ``early``: the messages to dispatch after the welcome, in order."""

    welcome: Welcome
    early: list[ToWorker | DecodeFailure]


class Answer:
    """The coordinator's frames after ``hello``, read until one of them decides the handshake."""

    def __init__(self) -> None:
        self._early: list[ToWorker | DecodeFailure] = []

    def feed(self, msgs: Sequence[ToWorker | DecodeFailure]) -> Welcomed | Error | Moved | None:
        """One frame's messages: the ``welcome``, the refusal (``error``) or the ``moved``, or None to read on."""
        for index, msg in enumerate(msgs):
            if isinstance(msg, Welcome):
                return Welcomed(msg, self._early + list(msgs[index + 1 :]))
            if isinstance(msg, Error | Moved):
                return msg
            self._early.append(msg)
        return None
