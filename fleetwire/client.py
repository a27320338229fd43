"""The asyncio client SDK: one websocket session with the coordinator.

Usage::

    async with Client("ws://127.0.0.1:8765", token=token) as client:
        plan = await client.submit("echo", args={"x": 1}, tags=["cpu"])
        async for event in plan.events():
            print(event.seq, event.kind, event.data)
        print(await plan.result())

Theory of operation (docs/PROTOCOL.md §Client session):

* ``Client`` is the asyncio *driver* of a sans-I/O ``ClientSession`` (fleetwire/session.py),
  which owns the session's state: requests waiting for replies, the plans' streams, the
  outbox. Two tasks drive one websocket and nothing else does I/O: the *reader* hands each
  frame to the session, which dispatches every message synchronously, in order; the
  *writer* sends what the session queued since its last send as one frame (several past
  ``COALESCE_LIMIT_BYTES``). Callers never touch the socket, so any number of coroutines
  may call at once.
* A request gets the next ``req_id`` and an ``asyncio.Future``, which the session resolves
  with the reply that echoes the id or fails with ``RequestError``. A reply may carry a
  hook that runs *in the reader*, before the next message of the frame is dispatched:
  that is how a plan's stream is registered the moment its ``accepted`` (or
  ``subscribed``) arrives, so none of the events that follow it can slip past.
* Events go to the ``PlanStream`` s registered for their ``plan_id`` (fleetwire/stream.py);
  each buffers its events in ``seq`` order and drops any ``seq`` it already holds, so
  ``Plan.events()`` can start late and ``result()`` works without ``events()``.
* A stream takes events only once it is *live*: from its ``accepted`` (a new plan's
  stream starts after it) or from its own ``subscribed`` (whose replay starts the
  stream from ``from_seq``). Events that reach it earlier belong to another
  subscription of this session and could arrive ahead of the replay.
* A dropped connection is resumed (fleetwire/resume.py): the client dials again with
  backoff, re-sends the requests still waiting for a reply (a submit always carries a plan
  id, so a re-sent one is idempotent) and re-subscribes every unfinished plan from its last
  ``seq``; ``events()`` continues without a gap or a duplicate, and a ``resync`` marker
  stands in for events the coordinator no longer holds (a ``rewound`` one where a store loss
  took the stream's latest events: ``subscribed.last_seqs``, fleetwire/session.py).
* When the session ends for good (closed, a close the coordinator meant, the reconnect
  deadline), every pending call and every unfinished plan fails with
  ``FleetwireConnectionError``.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import operator
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from datetime import datetime
from types import TracebackType
from typing import Any

import msgspec
from websockets.asyncio.client import ClientConnection
from websockets.exceptions import ConnectionClosed

from fleetwire import submits
from fleetwire.calls import ClientCalls
from fleetwire.connection import (
    CLIENT_PATH,
    DEFAULT_MAX_FRAME_BYTES,
    RECONNECT_DIAL_TIMEOUT_S,
    FirstReply,
    UrlList,
    dial,
    ending_error,
    first_probe,
    keepalive_gave_up,
    resolve_url,
    resolve_urls,
    unsampled_form,
)
from fleetwire.data import Transport, Uploads
from fleetwire.direct import DirectTransport
from fleetwire.errors import FleetwireConnectionError, RequestError
from fleetwire.inputs import InputSource, InputValue, prepare_inputs
from fleetwire.memtune import tune_allocator
from fleetwire.plan import Plan
from fleetwire.relay import AutoTransport, RelayTransport
from fleetwire.resume import Resumer
from fleetwire.session import COALESCE_LIMIT_BYTES, ClientSession
from fleetwire.stream import PlanStream
from fleetwire.tracing import end_submit_spans, start_submit_spans
from protocol import errors as codes
from protocol.codec import ENCODING_SUBPROTOCOL, Encoding
from protocol.messages import (
    Accepted,
    OutputRef,
    Requirements,
    Resources,
    RoutingHints,
    Submit,
    Subscribe,
    Subscribed,
)
from protocol.urls import keepalive
from wireio.frame_sink import FrameSink
from wireio.spin import SPIN
from wireio.wsbulk import send_frame, takes_frame_now, write_frame

__all__ = ["CLIENT_PATH", "COALESCE_LIMIT_BYTES", "DEFAULT_MAX_FRAME_BYTES", "Client", "Plan", "resolve_url"]

log = logging.getLogger("fleetwire.client")

_DUPLICATE = operator.attrgetter("duplicate")  # of a Plan

#: A submit encoded larger than this moves its args to the data plane: under the coordinator's 1 MiB frame limit.
MAX_INLINE_BYTES = (1 << 20) - (64 << 10)


class Client(ClientCalls):
    """An asyncio session with a fleetwire coordinator (docs/PROTOCOL.md §Client session).

    Args:
        url: ``ws://host:port`` (``/v1/client`` is appended when there is no path);
            default ``$FLEETWIRE_URL``. Cluster mode: a list of coordinators (or ``"a,b,c"``,
            ``FLEETWIRE_URL=ws://a:8765,ws://b:8765``): the session dials them in turn until one
            answers, follows ``moved`` to the shard's owner, and fails over to the next one
            with the jittered reconnect backoff (docs/CLUSTER.md).
        pool: cluster mode: the worker pool this client's plans go to (``?pool=NAME``), so the
            first coordinator reached redirects it to that shard's owner at once.
        token: the client (or admin) bearer token; default ``$FLEETWIRE_TOKEN``. None
            sends no ``Authorization`` header (a coordinator run with ``--insecure``).
        encoding: ``"msgpack"`` (binary frames, the default) or ``"json"`` (text frames).
        open_timeout_s: how long the TCP connect and websocket handshake may take; also how long the first
            request on a connection may wait for an answer (fleetwire/connection.py ``FirstReply``), unless
            ``reconnect_dial_timeout_s`` bounded its dial.
        reconnect_dial_timeout_s: in cluster mode (several URLs, or after a ``moved``), how long a
            reconnect's dial to one URL may take (at most ``open_timeout_s``): a frozen coordinator
            completes the TCP handshake and answers nothing, and the next URL may answer. A URL that
            timed out goes to the back of the turn (docs/OPERATIONS.md §Reconnects), and so does one
            whose first request on the new connection got no answer within it (it answers pings and no
            request). The first connect keeps ``open_timeout_s``. None: ``open_timeout_s``.
        max_frame_bytes: the largest frame accepted from the coordinator.
        ca_file: CA certificate (PEM) to trust for a ``wss://`` coordinator whose certificate
            is not signed by a system CA; default ``$FLEETWIRE_CA_FILE``.
        reconnect: resume the session after a dropped connection (fleetwire/resume.py);
            False: a dropped connection ends it.
        reconnect_base_s, reconnect_cap_s: the reconnect backoff's first ceiling and its cap.
        reconnect_give_up_s: how long without a connection before the session ends; None: never.
        ping_interval_s, ping_timeout_s: websocket pings to the coordinator; one unanswered for
            ``ping_timeout_s`` ends the connection (and the session resumes elsewhere). None:
            1 s / 3 s in cluster mode (several URLs, or after a ``moved``: about the lease renewal
            and TTL, so a frozen shard owner is left within seconds), else 20 s / 20 s. 0: no pings.

    Use as ``async with Client(...) as client:``, or ``await client.connect()`` and
    ``await client.close()``.
    """

    def __init__(
        self,
        url: str | Sequence[str] | None = None,
        *,
        token: str | None = None,
        pool: str = "",
        encoding: Encoding = "msgpack",
        open_timeout_s: float | None = 10.0,
        reconnect_dial_timeout_s: float | None = RECONNECT_DIAL_TIMEOUT_S,
        max_frame_bytes: int | None = DEFAULT_MAX_FRAME_BYTES,
        ca_file: str | None = None,
        reconnect: bool = True,
        reconnect_base_s: float = 0.5,
        reconnect_cap_s: float = 30.0,
        reconnect_give_up_s: float | None = 120.0,
        ping_interval_s: float | None = None,
        ping_timeout_s: float | None = None,
    ) -> None:
        if encoding not in ENCODING_SUBPROTOCOL:
            raise ValueError(f"encoding must be 'msgpack' or 'json', got {encoding!r}")
        if reconnect_dial_timeout_s is not None and not reconnect_dial_timeout_s > 0:
            raise ValueError(f"reconnect_dial_timeout_s must be > 0 or None, got {reconnect_dial_timeout_s}")
        tune_allocator()  # once per process; FLEETWIRE_MALLOC_TOP_PAD=0 leaves it (fleetwire/memtune.py)
        self._urls = UrlList(resolve_urls(url, pool=pool))
        self.url = self._urls.current
        self._ca_file = ca_file or os.environ.get("FLEETWIRE_CA_FILE") or None
        self.encoding: Encoding = encoding
        self._token = (token if token is not None else os.environ.get("FLEETWIRE_TOKEN")) or None
        self._open_timeout_s = open_timeout_s
        self._reconnect_dial_timeout_s = reconnect_dial_timeout_s
        self._max_frame_bytes = max_frame_bytes
        self._ping = (ping_interval_s, ping_timeout_s)
        self._cluster = len(self._urls.urls) > 1  # or once a ``moved`` was followed
        self._session = ClientSession(encoding)
        self._ws: ClientConnection | None = None
        self._dial_bound_s: float | None = None  # the last dial's timeout: its connection's first reply's bound too
        self._first_reply: FirstReply | None = None  # the connection's (fleetwire/connection.py)
        self._reader: asyncio.Task[None] | None = None
        self._writer: asyncio.Task[None] | None = None
        self._outbox_ready = asyncio.Event()
        self._parked = False  # the writer waits on _outbox_ready with nothing queued (_send_now may write instead)
        self._flushing = False  # _flush is scheduled: submits of this loop turn go in its frame
        self.writer_rounds = 0  # times the session's writer task was woken (a lone submit's frame needs none)
        self._closing = False
        self._transport: Transport | None = None  # made on first use (fleetwire/data.py)
        self._uploads: set[Uploads] = set()
        self.max_inline_bytes = MAX_INLINE_BYTES
        """A submit encoded larger than this moves its ``args`` to the data plane (input ``__args__``)."""
        self.relay = RelayTransport(self)  # inputs and outputs through the coordinator (fleetwire/relay.py)
        self._session.on_data = self.relay.receive
        self._session.retry_later = self._retry_later  # ``unavailable`` (store away): send again after the wait
        self._resumer: Resumer[ClientConnection] = Resumer(
            self._session,
            dial=self._dial,
            attach=self._attach,
            end=self._end,
            enabled=reconnect,
            base_s=reconnect_base_s,
            cap_s=reconnect_cap_s,
            give_up_s=reconnect_give_up_s,
            urls=len(self._urls.urls),
        )

    def __repr__(self) -> str:
        return f"<Client {self.url} {self.encoding}{' closed' if self.closed else ''}>"

    @property
    def closed(self) -> bool:
        """Whether the session has ended (closed by either side or lost)."""
        return self._session.ended is not None

    @property
    def session(self) -> ClientSession:
        """The sans-I/O session state this client drives (pending requests, plan streams, resumes)."""
        return self._session

    # ---- connection

    async def connect(self) -> Client:
        """Open the websocket session and start the reader and writer.

        Raises:
            AuthError: HTTP 401 (missing or wrong token) or 403 (not a client token).
            FleetwireConnectionError: the coordinator is unreachable or refused the upgrade.
        """
        if self._ws is not None:
            raise RuntimeError("this Client is already connected; make a new Client per session")
        self._attach(await self._dial())
        return self

    async def _dial(self) -> ClientConnection:
        """A new websocket to the coordinator (the first one, or one that resumes the session)."""
        urls = self._urls
        moved = self._session.moved
        if moved is not None:
            urls.move_to(moved.url)
            self._session.moved = None
            self._cluster = True
        ping_interval_s, ping_timeout_s, close_timeout_s = keepalive(*self._ping, cluster=self._cluster)
        error = FleetwireConnectionError("no coordinator URL")
        tried = ""
        answered = False  # some coordinator of the list answered (an HTTP refusal): protocol/backoff.py
        # A first connect tries each URL of the list once; a reconnect one URL per backoff step.
        first = self._ws is None
        timeout_s = self._open_timeout_s if first or not self._cluster else self._reconnect_timeout_s()
        for _ in range(len(urls.urls) if first else 1):
            url = self.url = urls.pick()
            try:
                ws = await dial(
                    url,
                    encoding=self.encoding,
                    token=self._token,
                    open_timeout_s=timeout_s,
                    max_frame_bytes=self._max_frame_bytes,
                    ca_file=self._ca_file,
                    ping_interval_s=ping_interval_s,
                    ping_timeout_s=ping_timeout_s,
                    close_timeout_s=close_timeout_s,
                )
            except FleetwireConnectionError as exc:
                tried = urls.failed(url, timed_out=isinstance(exc.__cause__, TimeoutError))
                if len(urls.urls) == 1:
                    raise
                error = exc
                answered = answered or exc.answered
                continue
            urls.succeeded()
            self._dial_bound_s = timeout_s
            # Before the session's resume re-queues its requests: they go out in this connection's form.
            self._session.unsampled = unsampled_form(ws)
            return ws
        raise FleetwireConnectionError(
            f"no coordinator of the list answered (tried {tried}): {error}", retry_after_s=error.retry_after_s,
            answered=answered,
        )

    def _reconnect_timeout_s(self) -> float | None:
        """A cluster reconnect's dial timeout: the shorter of ``reconnect_dial_timeout_s`` and ``open_timeout_s``."""
        short, full = self._reconnect_dial_timeout_s, self._open_timeout_s
        return full if short is None else short if full is None else min(short, full)

    def _attach(self, ws: ClientConnection) -> None:
        self._ws = ws
        # A coordinator that answers keepalive pings and no request is left after the dial's bound (connection.py).
        first_reply = self._first_reply = FirstReply(ws, FrameSink(self._receive_frame, text=self._session.text),
                                                     self._dial_bound_s)  # fmt: skip
        self._reader = asyncio.create_task(self._read_loop(ws, first_reply), name="fleetwire-client-reader")
        self._writer = asyncio.create_task(self._write_loop(ws), name="fleetwire-client-writer")
        self._outbox_ready.set()  # requests queued while no session was up
        self.relay.reset()  # streams opened while no session was up were not carried: open them again

    async def close(self) -> None:
        """Close the session; pending calls and unfinished plans fail with ``FleetwireConnectionError``."""
        if self._ws is None:
            return
        self._closing = True
        if self._resumer.resuming:
            self._resumer.cancel()
            self._end(FleetwireConnectionError("the client was closed"))
        await self._ws.close()
        # return_exceptions: a writer cancelled when its connection dropped (fleetwire/resume.py)
        tasks = [task for task in (self._reader, self._writer) if task is not None]
        await asyncio.gather(*tasks, return_exceptions=True)
        for uploads in list(self._uploads):
            uploads.cancel()
        await asyncio.gather(*(u.task for u in self._uploads), return_exceptions=True)
        if self._transport is not None:
            await self._transport.aclose()
            self._transport = None

    @property
    def transport(self) -> Transport:
        """How plans' inputs and outputs move: direct to the worker when it can be dialled, else through
        the coordinator (fleetwire/relay.py ``AutoTransport``)."""
        if self._transport is None:
            self._transport = AutoTransport(DirectTransport(ca_file=self._ca_file), self.relay)
        return self._transport

    @transport.setter
    def transport(self, value: Transport) -> None:
        self._transport = value

    def post(self, msg: Any) -> None:
        """Queue a message that expects no reply (the relay's ``data_*``) and wake the writer.

        Raises:
            FleetwireConnectionError: the session has ended.
        """
        self._session.post(msg)
        self._outbox_ready.set()

    def post_frame(self, frame: memoryview) -> None:
        """Queue a message already encoded in :attr:`encoding` (the relay's chunks, read into their frames).

        Raises:
            FleetwireConnectionError: the session has ended.
        """
        self._session.post_frame(frame)
        self._outbox_ready.set()

    async def __aenter__(self) -> Client:
        return await self.connect()

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    # ---- requests

    async def submit(
        self,
        op: str,
        args: Any = None,
        *,
        tags: Iterable[str] | None = None,
        requirements: Requirements | Mapping[str, Any] | None = None,
        priority: int = 0,
        timeout_s: float | None = None,
        max_attempts: int = 3,
        retries: int = 0,
        plan_id: str | None = None,
        hints: RoutingHints | Mapping[str, Any] | None = None,
        session_key: str | None = None,
        policy: str | None = None,
        inputs: Mapping[str, InputValue | OutputRef] | None = None,
        outputs: submits.Outputs = (),
        relay: bool = False,
        resources: Resources | Mapping[str, Any] | None = None,
        after: Iterable[Plan | str] = (),
        deterministic: bool = True,
        preemptible: bool = False,
        deadline_s: float | None = None,
        deadline_at: float | datetime | None = None,
        expected_run_s: float | None = None,
    ) -> Plan:
        """Submit a plan and return it, subscribed from its first event.

        Args:
            op: the handler name on the worker (``echo``, ``shell``, ...).
            args: the handler's arguments: any msgpack value (with JSON encoding, bytes
                travel as base64 strings).
            tags: tags a worker must all have; added to ``requirements.tags``.
            requirements: a ``protocol.Requirements`` or a dict of its fields.
            priority: higher runs first.
            timeout_s: how long one attempt may run; None for no limit.
            max_attempts: how many leases lost to dead workers it may use (>= 1).
            retries: how many times a handler failure is retried on a new attempt (>= 0).
            plan_id: an idempotency key: submitting it again returns the existing plan
                (``plan.duplicate`` is true) and changes nothing.
            hints: a ``protocol.RoutingHints`` or a dict of its fields (docs/ROUTING.md):
                prefix hashes and token estimates for KV-aware placement and admission. For op
                ``generate`` the fields left empty are computed from ``args`` (its ``messages`` or
                ``prompt`` and ``max_tokens``; fleetwire/prompt_hints.py).
            session_key: plans with the same key go to the same worker while it has room.
            policy: the placement policy for this plan (else the coordinator's default).
            inputs: named inputs (``bytes``, ``memoryview``, ``pathlib.Path`` or a binary file),
                uploaded straight to the plan's worker once it is placed, and again to a new
                attempt's worker; the handler sees them as ``ctx.inputs`` (fleetwire/data.py).
            outputs: names of outputs the handler will leave, fetched with ``plan.output(name)``; or a dict
                of names to their options: ``{"y": {"replicas": 2}}`` has ``y`` copied to another worker
                before the plan is reported succeeded, so losing its worker costs no rebuild
                (docs/SEMANTICS.md §Graphs).
            relay: carry the inputs and outputs through the coordinator even when the worker could
                be dialled (fleetwire/relay.py); otherwise the relay is used only when it cannot.
            resources: devices the plan holds while it runs, a ``protocol.Resources`` or a dict of
                its fields: ``{"gpus": 2, "gpu_memory_gb": 40, "accelerator": "H100"}``. It is placed
                only where that many matching devices are free, and sees only those
                (``CUDA_VISIBLE_DEVICES``; docs/SEMANTICS.md §GPU resources).
            after: plans (or their ids) that must succeed before this one is placed; if one fails or
                is cancelled, this one fails ``upstream_failed`` (docs/SEMANTICS.md §Graphs).
            deterministic: running the plan again gives the same outputs, so an output of it that
                another plan needs, or that ``plan.output()`` fetches, and that was lost may be made
                again by running it again.
            preemptible: the plan may be stopped so that another team's plan (or a higher-priority plan
                of yours) can run: its handler sees ``ctx.preempted`` (its processes get SIGTERM) and has
                the coordinator's grace to checkpoint; it is then queued again without using an attempt
                (docs/SEMANTICS.md §Preemption).
            deadline_s: the plan may finish any time within this many seconds, so the coordinator may
                hold it for a greener hour (``waiting``: ``deferred for carbon until 02:00 (52 g/kWh vs 302
                now)``; docs/SEMANTICS.md §Deadlines); its receipt then says what waiting avoided.
            deadline_at: the same as a time (a timezone-aware ``datetime`` or Unix seconds); one of the two.
            expected_run_s: how long it runs, for that decision (else its op's observed median run time).

        An input may be another plan's output, ``other.ref("y")`` (or ``OutputRef(plan_id, "y")``): the
        plan waits until that output exists, and is placed on the worker that holds it when it can be;
        its bytes never pass through this client or the coordinator (docs/SEMANTICS.md §Graphs).

        Args over ``max_inline_bytes`` encoded move to the data plane as the input ``__args__``
        (their msgpack), which the worker decodes before calling the handler.

        Raises:
            InvalidArgument: the coordinator refused the arguments.
            ValueError: ``requirements`` or ``hints`` has an unknown field or a wrong type, or a bad
                input name (``__args__`` and ``__result__`` are reserved).
        """
        submits.check_names(inputs or (), outputs)
        refs = {name: value for name, value in (inputs or {}).items() if isinstance(value, OutputRef)}
        uploads = {name: value for name, value in (inputs or {}).items() if not isinstance(value, OutputRef)}
        sources = await prepare_inputs(uploads) if uploads else {}
        msg = submits.submit_message(
            self._session.next_req_id, op, args, sources, tags=tags, requirements=requirements, priority=priority,
            timeout_s=timeout_s, max_attempts=max_attempts, retries=retries, plan_id=plan_id, hints=hints,
            session_key=session_key, policy=policy, outputs=outputs, resources=resources, refs=refs,
            after=[item if isinstance(item, str) else item.id for item in after], deterministic=deterministic,
            preemptible=preemptible, deadline_s=deadline_s, deadline_at=submits.unix_time(deadline_at),
            expected_run_s=expected_run_s,
        )
        # The caller's trace context rides with the plan, "not sampled" as this connection reads it (tracing.py)
        spans = start_submit_spans([msg], None, self._session.unsampled)
        raw = self._session.encode(msg)  # an unencodable argument fails here, in the caller
        if len(raw) > self.max_inline_bytes and args is not None:  # over the frame limit: args go by the data plane
            msg, raw = await submits.args_by_data_plane(msg, sources, self._session.encode)
        plans, refused = await self._submit_one(msg.req_id, raw, not plan_id)  # "": no id
        end_submit_spans(spans, refused.code if refused is not None else "")
        if refused is not None:
            raise refused
        plan = plans[0]
        plan.relay = relay
        if sources:  # uploaded to each attempt's worker on its data_ready, until the plan ends
            self._upload(plan, sources)
        if plan.duplicate:  # most plans are not: no coroutine for them
            await self._replay_duplicates(plans)
        return plan

    # ---- internals: requests and plans

    async def _request(
        self, msg: Any, expect: type[Any], on_reply: Callable[[Any], Any] | None = None, raw: msgspec.Raw | None = None
    ) -> Any:
        self._check_open()
        session = self._session
        if raw is None:
            raw = session.encode(msg)  # an unencodable argument fails here, in the caller
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        session.send_request(msg.req_id, type(msg), raw, expect, future, on_reply)
        try:
            self._outbox_ready.set()
            return await future
        finally:
            session.forget_request(msg.req_id)

    def _check_open(self) -> None:
        """Raises the session's end, or RuntimeError before ``connect``."""
        if self._session.ended is not None:
            raise self._session.ended
        if self._ws is None:
            raise RuntimeError("the Client is not connected: use 'async with Client(...)' or await connect()")

    async def _submit(self, requests: list[submits.Request]) -> tuple[list[Plan], RequestError | None]:
        """Send encoded submits and wait for every reply (fleetwire/submits.py): the accepted plans, the first
        refusal."""
        self._check_open()
        return await submits.await_accepted(self._session, requests, self._on_accepted, self._send_now)

    async def _submit_one(self, req_id: int, raw: msgspec.Raw, own: bool) -> tuple[list[Plan], RequestError | None]:
        """:meth:`_submit` of one request (``submit``'s), with no batch's waiter: the session's request with a
        future of its own, the plan made by ``on_reply`` in the reader (before the events of its frame).
        ``own``: the SDK made the plan id (see ``_on_accepted``)."""
        self._check_open()
        session = self._session
        future: asyncio.Future[Plan] = asyncio.get_running_loop().create_future()
        session.send_request(req_id, Submit, raw, Accepted, future, functools.partial(self._on_accepted, own))
        self._send_now()
        try:
            return [await future], None
        except RequestError as refused:
            return [], refused
        finally:
            session.forget_request(req_id)

    def _send_now(self) -> None:
        """Submits queued: sent at the end of this loop turn by :meth:`_flush`, or by the writer woken for them.

        While the writer is parked with nothing queued before (so nothing is overtaken) the frame is written by a
        callback of this turn instead of the writer's task: every submit made in the same turn goes in it, as the
        writer would have coalesced them, without the writer's wake-up (an event, a task step) and the library's
        send context on a sequential caller's path (issue #29).
        """
        if self._flushing:
            return  # the flush this turn takes them too
        if not self._parked or self._outbox_ready.is_set():
            self._outbox_ready.set()
            return
        self._flushing = True
        asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        """What was queued since :meth:`_send_now`, as the writer would send it: written now when the connection
        takes it without waiting (open, not paused over its high-water mark, no send under way), else by the
        writer."""
        self._flushing = False
        ws = self._ws
        if not self._parked or ws is None or self._outbox_ready.is_set():
            self._outbox_ready.set()
            return
        if not takes_frame_now(ws):
            self._outbox_ready.set()
            return
        session = self._session
        frame = session.next_frame()
        if frame is None:
            return
        first_reply = self._first_reply
        if first_reply is not None and not first_reply.asked and session.pending_requests:
            probe = self._ask_first(first_reply)
            if probe is not None:
                write_frame(ws, session.text, probe)
        write_frame(ws, session.text, frame)  # a broken transport: the reader sees it end, requests resent
        SPIN.sent()  # a lone submit's answer: the loop polls for it a while before it sleeps (wireio/spin.py)
        if session.has_outgoing:  # more than one frame's worth: the writer sends the rest
            self._outbox_ready.set()

    def _upload(self, plan: Plan, sources: dict[str, InputSource]) -> None:
        """Start the uploads of a plan's inputs (fleetwire/data.py ``Uploads``): to each attempt's worker."""
        transport: Transport = self.relay if plan.relay else self.transport
        uploads = Uploads(
            plan.id, sources, plan.events(), transport, functools.partial(self.data_ticket, plan.id, "put")
        )
        plan.uploads = uploads
        self._uploads.add(uploads)
        uploads.task.add_done_callback(lambda _task: self._uploads.discard(uploads))

    async def _replay_duplicates(self, plans: list[Plan]) -> None:
        """A duplicate's events were emitted before this session subscribed: replay them (a coordinator that
        replays them after ``accepted`` too costs only duplicates, which the plan drops by seq)."""
        for plan in filter(_DUPLICATE, plans):  # filtered in C: most batches have none
            await self._subscribe(plan.stream, 0)

    async def _subscribe(self, stream: PlanStream, from_seq: int) -> None:
        self._session.add_stream(stream)
        msg = Subscribe(req_id=self._session.next_req_id(), plan_ids=[stream.id], from_seq=from_seq)
        try:
            await self._request(msg, Subscribed, lambda _reply: stream.go_live())
        except BaseException:
            self._session.remove_stream(stream)
            raise

    def _on_accepted(self, own: bool, reply: Accepted, /) -> Plan:
        # Runs in the reader: registered before the events that follow ``accepted``.
        # A duplicate's stream began before this session subscribed, so it goes live
        # only with the replay of its own ``subscribe`` (see ``submit``). A duplicate of an
        # id the SDK made (``own``) is this client's submit re-sent after a reconnect: not a
        # duplicate to the caller, and live at once (the coordinator replays its stream).
        duplicate = reply.duplicate and not own
        stream = PlanStream(reply.plan_id, state=reply.state, live=not duplicate)
        if not duplicate:  # a duplicate's is registered by its own subscribe
            self._session.add_stream(stream)
        return Plan(stream, self, duplicate=duplicate)

    # ---- internals: the reader and the writer

    async def _read_loop(self, ws: ClientConnection, first_reply: FirstReply) -> None:
        # The session's frames dispatched in the connection's process_event, past websockets' queue (issue #29).
        sink = first_reply.sink
        try:
            await sink.read(ws)
        except ConnectionClosed:
            pass
        except Exception:
            log.exception("fleetwire client: dispatch failed; closing the session")
            await ws.close(codes.CLOSE_INTERNAL, "client error")
        finally:
            first_reply.cancel()
            if ws is self._ws:  # resume, or end the session; a keepalive's pong counts as an answer too
                # Pongs and no reply to the first request within the dial's bound (connection.py FirstReply), or
                # nothing at all until the keepalive gave up: a coordinator that upgraded and went silent, left as
                # a dial that timed out is (to the back of the turn: protocol/urls.py; unanswered for the backoff).
                unanswered = first_reply.silent and not self._closing
                served = not unanswered and (sink.answered or ws.latency > 0)  # protocol/backoff.py
                silent = unanswered or (not served and keepalive_gave_up(ws))
                if silent:
                    self._urls.went_silent(self.url)
                error = ending_error(ws, self.url, closing=self._closing)
                self._connection_lost(first_reply.error(self.url) if unanswered else error, served=served,
                                      timed_out=silent)  # fmt: skip

    def _receive_frame(self, frame: bytes | str) -> None:
        """A frame from the coordinator, in the connection's ``process_event`` (never awaits)."""
        SPIN.received()
        session = self._session
        session.receive_frame(frame)
        if session.has_outgoing:  # the session queued requests of its own (a resubmission)
            self._outbox_ready.set()

    def _retry_later(self, req_id: int, delay_s: float) -> None:
        """A request answered ``unavailable`` goes out again after ``delay_s`` (same req_id and plan id)."""
        asyncio.get_running_loop().call_later(delay_s, self._resend, req_id)

    def _resend(self, req_id: int) -> None:
        if self._session.resend(req_id):
            self._outbox_ready.set()

    def _connection_lost(
        self, error: FleetwireConnectionError, *, served: bool = True, timed_out: bool = False
    ) -> None:
        """``served``: the coordinator answered on the connection (a frame, a pong); else it closed it unserved, or
        (``timed_out``) went silent on it: the backoff takes that as a dial that timed out (protocol/backoff.py)."""
        if self._closing or not self._resumer.can_resume(error):
            self._end(error)
            return
        if self._writer is not None:  # it may hold a batch for the dead socket: pending requests are re-sent
            self._writer.cancel()
        self.relay.reset()  # relayed streams are opened again on the next connection
        self._resumer.start(error, served=served, timed_out=timed_out)

    def _ask_first(self, first_reply: FirstReply) -> bytes | None:
        """The first request goes out on the connection: its reply's bound starts (connection.py ``FirstReply``).
        Returns the probe to send before it, which a core answers ahead of its commit queue and a view session at
        once, so the bound is for that answer, not for a reply behind a slow store or others' rows (None: none, a
        URL naming a pool or shard, or no bound)."""
        first_reply.ask()
        if first_reply.bound_s is None:
            return None
        return first_probe(self.url, self._session.text)

    async def _write_loop(self, ws: ClientConnection) -> None:
        session = self._session
        try:
            while True:
                self._parked = True
                try:
                    await self._outbox_ready.wait()
                finally:
                    self._parked = False
                self._outbox_ready.clear()
                self.writer_rounds += 1
                first_reply = self._first_reply
                if first_reply is not None and not first_reply.asked and session.pending_requests:
                    # Before the frame: a send held by a peer that reads nothing counts too.
                    probe = self._ask_first(first_reply)
                    if probe is not None:
                        await send_frame(ws, probe, session.text)
                # Everything queued while the previous send was in flight goes out coalesced.
                while (frame := session.next_frame()) is not None:
                    await send_frame(ws, frame, session.text)  # big ones without the library's copies
                if session.ended is not None:
                    return
        except ConnectionClosed:
            return  # the reader sees the same close and reports it
        except Exception:
            log.exception("fleetwire client: send failed; closing the session")
            await ws.close(codes.CLOSE_INTERNAL, "client error")

    def _end(self, error: FleetwireConnectionError) -> None:
        self._session.end(error)
        self._outbox_ready.set()  # lets the writer see the end and return
        self.relay.reset()  # relayed transfers wake, and fail on the ended session
