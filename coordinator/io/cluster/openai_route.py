"""The OpenAI door on a cluster's main port: each request goes to the core that serves its pool.

Theory of operation (docs/OPENAI.md §Cluster mode). Every coordinator of a cluster serves the
door on its main port, as a single coordinator serves it on its port (the same divert of a
connection's first bytes, coordinator/io/frontdoor/admission.py; the same connections,
coordinator/io/frontdoor/openai_http.py). The main port admits the request (the key, 401/403;
its request rate, 429) and reads its body (400), then finds the shard its plan belongs to: the
shard of its pool (``x-fleetwire-pool``, else the default pool), in a partitioned pool the
partition of its session key, else of the plan id the main port picks
(coordinator/shards.py ``submit_shard``). Then:

* **This coordinator serves that shard**: the request is handed to that shard's own door in
  this process (:meth:`OpenAIDoor.take`): no hop, no second parse; the plan is that core's, and
  the 404 of a model its workers do not serve is its.
* **Another coordinator serves it**: the request is forwarded to that shard's port (the URL
  the shard's lease row publishes) and its answer relayed back as it comes
  (:class:`Forward`; the pure part: coordinator/openai_api/relay.py). The owner admits the key
  again; a client that goes away aborts the forward, and so cancels the plan there; a client
  that reads slowly stops the forward's reading (its socket buffer's high-water mark), so the
  owner's own slow-consumer rule applies.
* **Nobody serves it yet** (a takeover under way): 503 with ``Retry-After``.

``GET /v1/models`` goes the same way, to the shard of the pool it names (the default pool's
without ``x-fleetwire-pool``).
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from typing import Final, Protocol, cast
from urllib.parse import urlsplit

from coordinator.auth import TokenStore
from coordinator.io.frontdoor.openai_http import OpenAIConnection, OpenAIDoor, OpenAIEntry, route_of
from coordinator.io.frontdoor.settings import ServerSettings
from coordinator.limits import Limits
from coordinator.openai_api import ApiError, HttpRequest, error_response, parse_request
from coordinator.openai_api.limits import RequestRate
from coordinator.openai_api.relay import ResponseRelay, upstream_request
from coordinator.openai_api.request import GENERATE_OP, check_pool
from coordinator.shards import POOL_TAG, ClusterConfig, submit_shard
from protocol.messages import Moved, Requirements, Submit

__all__ = ["FORWARD_CONNECT_S", "ClusterDoor", "DoorShards", "Forward", "cluster_door"]

FORWARD_CONNECT_S: Final = 5.0  # connecting to a shard's owner may take this long, then 502


class DoorShards(Protocol):
    """What the cluster door reads of its host (coordinator/io/cluster/host.py ``ClusterHost``)."""

    config: ClusterConfig
    tokens: TokenStore | None

    def door_of(self, shard: int) -> OpenAIDoor | None:
        """The OpenAI door of ``shard``'s core when this process serves it (None: it does not)."""

    def where(self, shard: int) -> Moved:
        """Where ``shard`` is served (``url`` "" while nobody serves it)."""


class ClusterDoor(OpenAIEntry):
    """The OpenAI routes of a cluster's main port (module docstring).

    Args:
        shards: the cluster host.
        tokens, limits, max_body_bytes, rate: as :class:`OpenAIEntry`'s.
    """

    def __init__(self, shards: DoorShards, tokens: TokenStore | None, limits: Limits, *, max_body_bytes: int,
                 rate: RequestRate | None = None) -> None:  # fmt: skip
        super().__init__(tokens, limits, max_body_bytes=max_body_bytes, rate=rate)
        self.shards = shards

    def serve(self, conn: OpenAIConnection, request: HttpRequest) -> None:
        keep = request.keep_alive
        headers = request.headers
        try:
            kind = route_of(request)
            principal = self.admit(request)
            pool = check_pool(headers.get("x-fleetwire-pool"))
            parsed = None if kind is None else parse_request(kind, request.body, session=headers.get(
                "x-fleetwire-session"), pool=pool, hasher=self.prefixes.hashes)  # fmt: skip
        except ApiError as error:
            conn.answer(error.status, error_response(error, keep_alive=keep), keep)
            return
        config = self.shards.config
        if parsed is None:
            submit = Submit(req_id=0, op=GENERATE_OP, requirements=Requirements(tags=[POOL_TAG + pool] if pool else []))
        else:
            submit = parsed.submit(0)
            submit.plan_id = self.new_plan_id()
        shard = submit_shard(submit, config.shards, config.partitions)
        door = self.shards.door_of(shard)
        if door is not None:  # this process serves it: no hop
            if parsed is None:
                door.list_models(conn, keep, pool if "x-fleetwire-pool" in headers else None)
            else:
                door.take(conn, principal, parsed, keep, len(request.body), submit.plan_id or "")
            return
        target = self.shards.where(shard)
        if not target.url:
            why = f"shard {shard} (the pool's) has no coordinator yet (a takeover?): retry after Retry-After seconds"
            unavailable = ApiError(503, why, code="unavailable", retry_after_s=1.0)
            conn.answer(unavailable.status, error_response(unavailable, keep_alive=keep), keep)
            return
        self.stats.forwarded += 1
        forward = Forward(conn, target.url, shard, request)
        conn.exchange = forward
        forward.start()


def cluster_door(shards: DoorShards, settings: ServerSettings) -> ClusterDoor | None:
    """The main port's door for ``settings`` (None under ``--no-openai``)."""
    if not settings.openai:
        return None
    return ClusterDoor(shards, shards.tokens, settings.limits, rate=RequestRate(settings.openai_rate,
                       settings.openai_burst), max_body_bytes=settings.limits.frame_bytes(
                       "client", settings.max_frame_bytes))  # fmt: skip


class Forward(asyncio.Protocol):
    """One request forwarded to the coordinator that serves its shard, its answer relayed back (module docstring).

    Args:
        conn: the client's connection.
        url: the shard's own port (``ws://host:port``; ``wss://`` is dialled with TLS).
        shard: the shard (for messages).
        request: the client's request.
    """

    def __init__(self, conn: OpenAIConnection, url: str, shard: int, request: HttpRequest) -> None:
        self.conn = conn
        self.url = url
        self.shard = shard
        self.relay = ResponseRelay(keep_alive=request.keep_alive)
        transport = conn.transport
        peer = transport.get_extra_info("peername") if transport is not None else None
        self.data: bytes | None = upstream_request(request.method, request.path, request.headers, request.body,
                                                   client=str(peer[0]) if peer else "")  # fmt: skip
        self.upstream: asyncio.Transport | None = None
        self.done = False
        self.started = conn.door.clock()
        self._dial: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._dial = asyncio.get_running_loop().create_task(self._open())

    async def _open(self) -> None:
        parts = urlsplit(self.url)
        secure = parts.scheme in ("wss", "https")
        context = ssl.create_default_context() if secure else None
        try:
            async with asyncio.timeout(FORWARD_CONNECT_S):
                await asyncio.get_running_loop().create_connection(
                    lambda: self, parts.hostname or "127.0.0.1", parts.port or (443 if secure else 80), ssl=context
                )
        except (OSError, TimeoutError) as exc:
            why = f"{type(exc).__name__}: {exc}"
            self._fail(ApiError(502, f"cannot reach the coordinator serving shard {self.shard} at {self.url}: {why}",
                                code="unavailable", retry_after_s=1.0))  # fmt: skip

    # ------------------------------------------------------------------ the upstream connection

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are no asyncio.Transport subclasses: typed as one, not checked.
        upstream = self.upstream = cast(asyncio.Transport, transport)
        if self.done:
            upstream.abort()
            return
        assert self.data is not None
        upstream.write(self.data)
        self.data = None

    def data_received(self, data: bytes) -> None:
        if self.done:
            return
        try:
            out = self.relay.feed(data)
        except ApiError as error:
            self._fail(error)
            return
        if out:
            if self.relay.relayed == len(out):
                self.conn.door.stats.first_byte.observe(self.conn.door.clock() - self.started)
            if not self.conn.write(out):  # a slow consumer (aborted), or the client is gone
                self.abandon()
                return
        if self.relay.complete:
            self._finish()

    def eof_received(self) -> bool | None:
        return None  # the transport closes itself

    def connection_lost(self, exc: Exception | None) -> None:
        if self.done:
            return
        self.relay.eof()
        if self.relay.complete:
            self._finish()
        else:
            why = f": {exc}" if exc else ""
            self._fail(ApiError(502, f"the coordinator serving shard {self.shard} closed the connection before its "
                                     f"answer was whole{why}", code="unavailable", retry_after_s=1.0))  # fmt: skip

    # ------------------------------------------------------------------ the client's side

    def writable(self, ok: bool) -> None:
        upstream = self.upstream
        if upstream is not None and not self.done:
            with contextlib.suppress(RuntimeError):  # a transport closing meanwhile
                if ok:
                    upstream.resume_reading()
                else:
                    upstream.pause_reading()

    def abandon(self) -> None:
        """The client went away (or read too slowly): drop the upstream, which cancels the plan there."""
        if self.done:
            return
        self.done = True
        if self._dial is not None and not self._dial.done():
            self._dial.cancel()
        if self.upstream is not None:
            self.upstream.abort()

    def _finish(self) -> None:
        self.done = True
        self.conn.door.answered(self.relay.status)
        if self.upstream is not None:
            self.upstream.close()
        if not self.conn.closing:
            self.conn.finished(self.relay.keep_alive)

    def _fail(self, error: ApiError) -> None:
        """Nothing passed on yet: the client gets ``error``; else its connection closes before the body's end."""
        if self.done:
            return
        self.done = True
        if self.upstream is not None:
            self.upstream.abort()
        conn = self.conn
        if conn.closing:
            return
        if self.relay.relayed:
            conn.door.answered(self.relay.status)
            conn.close()  # the client sees the body cut before its end: never a silent truncation
            return
        conn.door.stats.first_byte.observe(conn.door.clock() - self.started)
        conn.door.answered(error.status)
        keep = self.relay.keep_alive
        if conn.write(error_response(error, keep_alive=keep)):
            conn.finished(keep)
