"""``ClientSession``: the client side of the protocol, without I/O (docs/PROTOCOL.md §Client session).

Like the protocol objects of ``websockets`` or h11's ``Connection``, a ``ClientSession``
owns the state of one session and never touches a socket, a loop or a clock: its driver
(``fleetwire.client.Client``) feeds it the frames it reads and sends the frames it asks for.

Theory of operation:

* **Requests.** The driver takes a ``req_id`` (``next_req_id``), encodes the request
  (``encode``: an unencodable argument fails there, before anything is queued) and hands
  it over with a *waiter* (``send_request``): anything with ``done``/``set_result``/
  ``set_exception``, an ``asyncio.Future`` in the driver. The reply that echoes the id
  resolves the waiter; an ``error`` reply fails it with ``RequestError``; a reply of
  another type fails it with ``ProtocolError``. A reply may carry a hook that runs before
  the next message of the frame is dispatched: that is how a plan's stream is registered
  the moment its ``accepted`` (or ``subscribed``) arrives, so none of the events that
  follow it can slip past.
* **Streams.** Events and resyncs go to the ``PlanStream`` s registered for their
  ``plan_id`` (fleetwire/stream.py), which keep them in ``seq`` order. A stream is dropped
  once it ends, unless it still waits for its own replay.
* **Outbox.** Encoded requests wait in the outbox; ``next_frame`` takes everything queued
  as one frame, several past ``COALESCE_LIMIT_BYTES`` (one larger message goes alone), so
  batching never trips the coordinator's frame limit. A posted message that goes alone (a
  relayed 256 KiB chunk) is sent as the bytes it was encoded to, not copied into a frame again.
* **Resuming** (fleetwire/resume.py decides when). ``resume`` queues, for the new
  connection, every request still waiting for its reply in ``req_id`` order (a submit
  always carries a plan id, so a re-sent one is idempotent), then a ``subscribe`` of every
  live, unfinished stream from its ``last_seq``. A plan the coordinator no longer knows
  fails its stream, unless this session submitted it: see *Recovery*. A plan whose stream the
  coordinator holds only to an earlier seq (``subscribed.last_seqs``: a store loss took its
  tail) goes on from that seq (``PlanStream.rewind``), and a ``get_plan`` says whether it
  already ended.
* **Recovery** (docs/SEMANTICS.md §Recovery from clients and workers). For every plan it was
  told was accepted and that has not ended, the session keeps the encoded ``submit``. When a
  resubscription after a reconnect finds the plan unknown (a store loss on the coordinator's
  side), the session submits it again with the same id and spec, marked ``recovered``, logs a
  warning, and the plan's stream starts again after a ``recovered`` event (``PlanStream.recover``).
* **End.** ``end`` fails every waiter and every unfinished stream with the same
  ``FleetwireConnectionError``; the session takes nothing more.
"""

from __future__ import annotations

import bisect
import functools
import itertools
import logging
import operator
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Final, Protocol, assert_never

import msgspec

from fleetwire.errors import FleetwireConnectionError, PlanNotFound, ProtocolError, request_error
from fleetwire.stream import PlanStream
from protocol import errors as codes
from protocol.chunkview import with_chunk_views
from protocol.codec import Codec, DecodeFailure, Encoding
from protocol.messages import (
    TERMINAL_STATES,
    Accepted,
    DataChunk,
    DataCredit,
    DataEnd,
    DataGrant,
    Error,
    Event,
    GetPlan,
    Moved,
    Ok,
    PlanReply,
    Plans,
    Resync,
    Submit,
    Subscribe,
    Subscribed,
    ToClient,
    Usage,
    Workers,
    type_name,
)
from protocol.tracecontext import UNSAMPLED, UNSAMPLED_SHORT

__all__ = [
    "COALESCE_LIMIT_BYTES", "RECOVERED_REASON", "UNAVAILABLE_RETRY_S", "ClientSession", "PendingRequest", "Waiter",
]

log = logging.getLogger("fleetwire.client")

# Outgoing frames hold several messages only up to this size: well under the 1 MiB
# frame limit a coordinator is likely to enforce (websockets' default).
COALESCE_LIMIT_BYTES: Final = 256 * 2**10

# A frame holds at most this many messages (each one is longer than 4 bytes): next_frame looks no further.
_MOST_PER_FRAME: Final = COALESCE_LIMIT_BYTES // 4 + 1

# The bytes of ``traceparent: "0"`` in a submit, per encoding (text or not): only a kept submit that holds them is
# decoded and encoded again by ``resume`` for a coordinator that did not say it accepts "0".
_SHORT_FORM: Final = {False: b"\xabtraceparent\xa10", True: b'"traceparent":"0"'}

_REQ_ID_OF, _RAW_OF = operator.itemgetter(0), operator.itemgetter(1)  # of a ``(req_id, raw, own)``

# encode_each encodes requests this many at a time, as one list, and splits it into views of that one buffer: no
# bytes object, and no growth of msgspec's output buffer, per request (a submit of ~85 bytes grew its own 2-3 times).
_GROUP: Final = 64
# ... unless a group encodes larger than this: then each request gets its own bytes. A session keeps a submit's
# encoding until its plan ends (Recovery), and a view keeps its whole group's buffer: at most this much, or 64 small
# requests' worth, for one plan still running.
_SHARED_BYTES: Final = 16 * 2**10

#: The wait before a request answered ``unavailable`` without ``retry_after_s`` is sent again.
UNAVAILABLE_RETRY_S: Final = 1.0

#: The ``reason`` of the ``recovered`` event of a plan the session resubmitted.
RECOVERED_REASON: Final = "coordinator lost the plan; resubmitted by the client"


class Waiter(Protocol):
    """Where a request's reply (or failure) goes: an ``asyncio.Future`` or ``concurrent.futures.Future``."""

    def done(self) -> bool:
        """Whether the outcome is already set (or the caller gave up)."""
        ...

    def set_result(self, result: Any, /) -> None:
        """The reply, or what the request's ``on_reply`` hook made of it."""
        ...

    def set_exception(self, exception: BaseException, /) -> None:
        """Why there is no reply: ``RequestError``, ``ProtocolError``, ``FleetwireConnectionError``."""
        ...


class PendingRequest(msgspec.Struct):
    """A request waiting for the reply that echoes its ``req_id``.

    A ``msgspec.Struct``: made in C, one per request (a batch's submits make thousands at once).

    Attributes:
        request: the request's message class (named in a ``ProtocolError``).
        expect: the reply's message class.
        waiter: receives the reply or the failure.
        on_reply: runs on the reply before the next message is dispatched; its return
            value is the waiter's result.
        raw: the encoded request, sent again after a reconnect; None for the session's
            own resubscriptions, which ``resume`` makes afresh.
    """

    request: type[Any]
    expect: type[Any]
    waiter: Waiter
    on_reply: Callable[[Any], Any] | None = None
    raw: msgspec.Raw | None = None


class ClientSession:
    """The state of one client session: requests, plan streams, outbox (see the module docstring).

    Args:
        encoding: the session's encoding (``msgpack`` or ``json``).

    Attributes:
        text: whether frames are text (JSON) rather than binary.
        ended: why the session ended; None while it goes on.
        resumed: how many times a new connection resumed the session.
        recovered: how many plans the session resubmitted because the coordinator had lost them.
    """

    def __init__(self, encoding: Encoding) -> None:
        # msgpack: relayed chunks decode as views into their frame (protocol/chunkview.py), written to a file uncopied
        self._codec = Codec(encoding, with_chunk_views(ToClient, encoding), role="coordinator")
        self.text = self._codec.text
        self._split = (msgspec.json if self.text else msgspec.msgpack).Decoder(list[msgspec.Raw]).decode  # encode_each
        self.ended: FleetwireConnectionError | None = None
        self.moved: Moved | None = None  # cluster mode: the last ``moved`` (where the next dial goes)
        self.resumed = 0
        self.recovered = 0
        self._encoding: Encoding = encoding
        self._req_ids = itertools.count(1)
        self._pending: dict[int, PendingRequest] = {}
        # A plan's first stream, and its others (rare: a watch of a plan this session submitted too) apart:
        # no list per plan, and an event finds its one stream with one lookup.
        self._streams: dict[str, PlanStream] = {}
        self._more_streams: dict[str, list[PlanStream]] = {}
        # bytes (or a frame's view): a posted message (not re-sent after a reconnect)
        self._outbox: list[msgspec.Raw | bytes | memoryview] = []
        self._posted = 0  # how many of the outbox's messages are posted ones (bytes)
        # Accepted and not ended: plan id -> its encoded submit, to resubmit a plan the coordinator lost.
        self._specs: dict[str, msgspec.Raw] = {}
        self.on_data: Callable[[DataChunk | DataCredit | DataEnd], None] | None = None
        """Receives the relay's messages (fleetwire/relay.py ``RelayTransport.receive``); None: dropped."""
        self.unsampled = UNSAMPLED
        """How this connection's ``submit.traceparent`` says "not sampled": ``"0"`` where the coordinator's upgrade
        said it accepts it, else ``"00"`` (set by the driver at each connect: fleetwire/connection.py
        ``unsampled_form``). :meth:`resume` and a recovery's resubmit send kept submits in this form."""
        self.retry_later: Callable[[int, float], None] | None = None
        """Told ``(req_id, seconds)`` when a request was answered ``unavailable`` (the coordinator's store is
        away): the request stays pending, and the driver calls :meth:`resend` after that long. None: it fails."""

    def __repr__(self) -> str:
        state = f"ended: {self.ended}" if self.ended is not None else "open"
        return f"<ClientSession {state}, {len(self._pending)} pending, {len(self._streams)} plans>"

    # ---- requests

    def next_req_id(self) -> int:
        """The ``req_id`` of the next request (1, 2, ...)."""
        return next(self._req_ids)

    def take_req_ids(self, count: int) -> range:
        """The ``req_id`` s of the next ``count`` requests, consecutive (a batch's)."""
        first = next(self._req_ids)
        self._req_ids = itertools.count(first + count)
        return range(first, first + count)

    def encode(self, msg: Any) -> msgspec.Raw:
        """One request encoded for the outbox.

        Raises:
            TypeError, ValueError, OverflowError: a value this encoding cannot carry.
        """
        return msgspec.Raw(self._codec.encode([msg]))

    def encode_each(self, msgs: Sequence[Any]) -> list[msgspec.Raw]:
        """Requests encoded for the outbox, each as :meth:`encode` encodes it alone (the same bytes), in groups
        (``_GROUP``): each group one list encoded, then split into its items' views (zero-copy ``msgspec.Raw``).

        Raises:
            TypeError, ValueError, OverflowError: a value this encoding cannot carry (nothing is returned).
        """
        encode, split = self._codec.encode_one, self._split
        raws: list[msgspec.Raw] = []
        for start in range(0, len(msgs), _GROUP):
            group = encode(msgs[start : start + _GROUP])
            raws += split(group) if len(group) <= _SHARED_BYTES else map(msgspec.Raw.copy, split(group))
        return raws

    def send_request(
        self,
        req_id: int,
        request: type[Any],
        raw: msgspec.Raw,
        expect: type[Any],
        waiter: Waiter,
        on_reply: Callable[[Any], Any] | None = None,
    ) -> None:
        """Queue an encoded request and wait for its reply in ``waiter``.

        Args:
            req_id: the request's ``req_id`` (from ``next_req_id``).
            request: the request's message class.
            raw: the request, from ``encode``.
            expect: the reply's message class.
            waiter: receives the reply (or ``on_reply``'s result) or the failure.
            on_reply: runs on the reply, before the next message is dispatched.
        """
        self._pending[req_id] = PendingRequest(request, expect, waiter, on_reply, raw)
        self._outbox.append(raw)

    def send_requests(
        self, requests: Iterable[tuple[int, msgspec.Raw, bool]], request: type[Any], expect: type[Any], waiter: Waiter
    ) -> None:
        """Queue encoded requests ``(req_id, raw, own)`` of one kind, as :meth:`send_request` does each, all
        answered to one ``waiter`` (given each reply itself: ``Client.submit_many``'s batch)."""
        requests = list(requests)
        raws = list(map(_RAW_OF, requests))
        # Made and queued in C: no Python step per request.
        made = map(functools.partial(PendingRequest, request, expect, waiter, None), raws)
        self._pending.update(zip(map(_REQ_ID_OF, requests), made, strict=True))
        self._outbox.extend(raws)

    def post(self, msg: Any) -> None:
        """Queue a message that expects no reply (the relay's ``data_*``); it is not re-sent after a reconnect.

        Raises:
            FleetwireConnectionError: the session has ended.
        """
        if self.ended is not None:
            raise self.ended
        self._outbox.append(self._codec.encode([msg]))
        self._posted += 1

    def post_frame(self, frame: memoryview) -> None:
        """Queue one message already encoded in this session's encoding (a relayed upload's chunk, its
        bytes read straight into its frame: protocol/chunkview.py ``frame_into``); sent as is, not re-sent
        after a reconnect. ``frame`` must not change until it was sent.

        Raises:
            FleetwireConnectionError: the session has ended.
        """
        if self.ended is not None:
            raise self.ended
        self._outbox.append(frame)
        self._posted += 1

    def resend(self, req_id: int) -> bool:
        """Queue a pending request again (after an ``unavailable`` answer's wait); False if it is no longer pending."""
        pending = self._pending.get(req_id)
        if pending is None or pending.raw is None or self.ended is not None:
            return False
        self._outbox.append(pending.raw)
        return True

    def forget_request(self, req_id: int) -> None:
        """Stop waiting for a reply (answered, or its caller gave up); a later reply is dropped."""
        self._pending.pop(req_id, None)

    @property
    def pending_requests(self) -> int:
        """How many requests wait for their reply."""
        return len(self._pending)

    # ---- plan streams

    def add_stream(self, stream: PlanStream) -> None:
        """Deliver the events of ``stream.id`` to ``stream`` (once it is live)."""
        if self._streams.setdefault(stream.id, stream) is not stream:
            self._more_streams.setdefault(stream.id, []).append(stream)

    def remove_stream(self, stream: PlanStream) -> None:
        """Deliver nothing more to ``stream``."""
        self._keep_streams(stream.id, [other for other in self.streams_of(stream.id) if other is not stream])

    def _keep_streams(self, plan_id: str, streams: list[PlanStream]) -> None:
        """Deliver the plan's events to ``streams`` only; none: its held submit goes too."""
        self._more_streams.pop(plan_id, None)
        if not streams:
            self._streams.pop(plan_id, None)
            self._specs.pop(plan_id, None)
            return
        self._streams[plan_id] = streams[0]
        if len(streams) > 1:
            self._more_streams[plan_id] = streams[1:]

    @property
    def has_outgoing(self) -> bool:
        """Whether requests wait in the outbox (the driver's writer should run)."""
        return bool(self._outbox) and self.ended is None

    @property
    def held_specs(self) -> int:
        """Plans accepted and not ended whose submit the session keeps (to resubmit them after a store loss)."""
        return len(self._specs)

    def streams_of(self, plan_id: str) -> list[PlanStream]:
        """The streams registered for a plan (a copy)."""
        first = self._streams.get(plan_id)
        return [] if first is None else [first, *self._more_streams.get(plan_id, ())]

    # ---- inbound

    def receive_frame(self, frame: bytes | str) -> None:
        """Dispatch every message of a frame from the coordinator, in order."""
        streams, more, specs = self._streams, self._more_streams, self._specs
        for msg in self._codec.decode(frame):
            if type(msg) is Event:  # as receive(), inline: most messages are events (five of six per plan)
                plan_id = msg.plan_id
                ended = msg.kind in TERMINAL_STATES
                stream = streams.get(plan_id)
                if stream is None:
                    pass
                elif more or stream.final is not None or not stream.live:
                    stream.feed(msg)  # drops what it must
                    for other in more.get(plan_id, ()):
                        other.feed(msg)
                elif (seq := msg.seq) > stream.last_seq or not seq:  # PlanStream.feed, inline: keep the two alike
                    if seq > stream.last_seq:
                        stream.last_seq = seq
                    stream.events.append(msg)
                    if ended:
                        stream.finish(msg)
                    if stream.waker is not None or stream.on_change is not None:
                        stream.changed()
                if ended:
                    if stream is not None and stream.final is not None and not more and streams.get(plan_id) is stream:
                        del streams[plan_id]  # as _ended(), inline: its one stream ended
                        specs.pop(plan_id, None)
                    else:
                        self._ended(plan_id)
            elif type(msg) is Accepted:  # and the sixth
                self._resolve(msg.req_id, msg)
            else:
                self.receive(msg)

    def receive(self, msg: ToClient | DecodeFailure) -> None:
        """Dispatch one decoded message: resolve its request, or feed its plan's streams."""
        match msg:
            case Event():  # receive_frame has its own copy of this case
                for stream in self.streams_of(msg.plan_id):
                    stream.feed(msg)
                if msg.kind in TERMINAL_STATES:
                    self._ended(msg.plan_id)
            case Accepted() | Subscribed() | PlanReply() | Workers() | Plans() | Usage() | Ok() | DataGrant():
                self._resolve(msg.req_id, msg)
            case Error():
                pending = self._pending.pop(msg.req_id, None) if msg.req_id else None
                if (msg.code == codes.UNAVAILABLE and pending is not None and pending.raw is not None
                        and self.retry_later is not None and not pending.waiter.done()):  # fmt: skip
                    self._pending[msg.req_id] = pending  # sent again after the wait, same req_id and plan id
                    self.retry_later(msg.req_id, msg.retry_after_s or UNAVAILABLE_RETRY_S)
                elif pending is None or pending.waiter.done():
                    log.warning("fleetwire client: coordinator error %s: %s", msg.code, msg.message)
                else:
                    pending.waiter.set_exception(
                        request_error(msg.code, msg.message, req_id=msg.req_id, plan_id=msg.plan_id)
                    )
            case Resync():
                for stream in self.streams_of(msg.plan_id):
                    stream.resync(msg)
                if msg.plan is not None and msg.plan.state in TERMINAL_STATES:
                    self._specs.pop(msg.plan_id, None)
            case Moved():  # cluster mode: the coordinator closes 4307 next; the driver dials msg.url
                self.moved = msg
            case DataChunk() | DataCredit() | DataEnd():
                if self.on_data is not None:
                    self.on_data(msg)
            case DecodeFailure():
                log.warning("fleetwire client: undecodable message from the coordinator: %s", msg.message)
            case _:
                assert_never(msg)

    def _resolve(self, req_id: int, reply: Any) -> None:
        pending = self._pending.pop(req_id, None)
        if pending is None or pending.waiter.done():
            return  # its caller gave up (cancelled) before the reply came
        if not isinstance(reply, pending.expect):
            got, want = type_name(type(reply)), type_name(pending.expect)
            pending.waiter.set_exception(
                ProtocolError(
                    f"the coordinator answered {type_name(pending.request)!r} with {got!r}, expected {want!r}"
                )
            )
            return
        raw = pending.raw
        if raw is not None and pending.request is Submit and reply.state not in TERMINAL_STATES:
            self._specs[reply.plan_id] = raw  # kept until the plan ends (see Recovery)
        pending.waiter.set_result(reply if pending.on_reply is None else pending.on_reply(reply))

    def _ended(self, plan_id: str) -> None:
        """The plan's terminal event came: its ended streams go, and so does its held submit."""
        stream = self._streams.get(plan_id)
        if stream is not None:
            if stream.final is not None and plan_id not in self._more_streams:  # the usual case: its one stream
                del self._streams[plan_id]
            else:  # streams still waiting for their own replay stay registered
                self._keep_streams(plan_id, [other for other in self.streams_of(plan_id) if not other.done()])
        self._specs.pop(plan_id, None)

    # ---- outbound

    def next_frame(self) -> bytes | memoryview | None:
        """The next frame to send: the oldest queued requests, at most ``COALESCE_LIMIT_BYTES``
        (one larger request goes alone); None when nothing is queued or the session ended.

        A lone posted message (``post``: kept as the bytes it was encoded to) is its own frame,
        not copied again: a relayed upload's 256 KiB chunks go out with one copy fewer.
        """
        outbox = self._outbox
        if not outbox or self.ended is not None:
            return None
        # As many as fit (their running total at most the limit), at least one: counted in C, not per message.
        ends = list(itertools.accumulate(map(len, itertools.islice(outbox, _MOST_PER_FRAME))))
        count = bisect.bisect_right(ends, COALESCE_LIMIT_BYTES) or 1
        if not self._posted:  # requests only (the hot path): as they were queued
            batch = outbox[:count]
        elif count == 1 and type(outbox[0]) is not msgspec.Raw:
            self._posted -= 1
            return outbox.pop(0)  # type: ignore[return-value]
        else:
            batch = [raw if type(raw) is msgspec.Raw else msgspec.Raw(raw) for raw in outbox[:count]]
            self._posted -= sum(type(raw) is not msgspec.Raw for raw in outbox[:count])
        del outbox[:count]
        return self._codec.encode(batch)

    # ---- the session's life

    def resume(self) -> None:
        """A new connection replaces a dropped one: queue what it must carry, before anything else.

        Every request still waiting for its reply is queued again in ``req_id`` order, then
        a ``subscribe`` of every live, unfinished stream from its ``last_seq``: the replay
        continues its ``events()`` with no gap and no duplicate.
        """
        self.resumed += 1
        outbox: list[msgspec.Raw] = []
        short = self.unsampled == UNSAMPLED_SHORT
        for req_id in sorted(self._pending):
            pending = self._pending[req_id]
            raw = pending.raw
            if raw is None:
                del self._pending[req_id]  # an earlier resubscription: superseded by the ones below
            else:
                if not short and pending.request is Submit and _SHORT_FORM[self.text] in bytes(raw):
                    raw = pending.raw = self._in_long_form(raw)  # sent as "0"; this coordinator may refuse it
                outbox.append(raw)
        self._outbox[:] = outbox
        self._posted = 0  # posted messages are not re-sent on a new connection
        for stream in self._all_streams():
            if stream.live and stream.final is None:
                req_id = next(self._req_ids)
                msg = Subscribe(req_id=req_id, plan_ids=[stream.id], from_seq=stream.last_seq)
                self._outbox.append(self.encode(msg))
                self._pending[req_id] = PendingRequest(Subscribe, Subscribed, _Resubscription(self, stream))

    def _all_streams(self) -> list[PlanStream]:
        """Every registered stream, plan by plan (a copy)."""
        if not self._more_streams:
            return list(self._streams.values())
        return [stream for plan_id in self._streams for stream in self.streams_of(plan_id)]

    def end(self, error: FleetwireConnectionError) -> None:
        """End the session for good: every waiter and unfinished stream fails with ``error``
        (or with the first error the session ended with)."""
        if self.ended is None:
            self.ended = error
        ended = self.ended
        for pending in self._pending.values():
            if not pending.waiter.done():
                pending.waiter.set_exception(ended)
        self._pending.clear()
        for stream in self._all_streams():
            stream.fail(ended)
        self._streams.clear()
        self._more_streams.clear()
        self._specs.clear()
        self._outbox.clear()
        self._posted = 0

    def _resubmit(self, stream: PlanStream) -> bool:
        """Submit again a plan the coordinator forgot, if this session submitted it; False if not."""
        raw = self._specs.get(stream.id)
        if raw is None or self.ended is not None:
            return False
        decode = msgspec.msgpack.decode if self._encoding == "msgpack" else msgspec.json.decode
        spec = decode(raw, type=Submit)
        req_id = next(self._req_ids)
        msg = msgspec.structs.replace(spec, req_id=req_id, plan_id=stream.id, subscribe=True, recovered=True)
        if msg.traceparent == UNSAMPLED_SHORT or msg.traceparent == UNSAMPLED:
            msg.traceparent = self.unsampled  # kept as the earlier connection's form: this one's
        log.warning(
            "fleetwire client: the coordinator no longer knows plan %r after the reconnect (a store loss?); "
            "resubmitting it with the same id and spec",
            stream.id,
        )
        # raw=None: a later reconnect does not re-send it; the resubscription finds the plan or resubmits again.
        self._pending[req_id] = PendingRequest(Submit, Accepted, _Recovery(self, stream))
        self._outbox.append(self.encode(msg))
        return True

    def _in_long_form(self, raw: msgspec.Raw) -> msgspec.Raw:
        """A kept submit ``raw`` with ``traceparent`` ``"0"`` encoded again with ``"00"``, for a coordinator that did
        not say it accepts ``"0"`` (an older one refuses it); ``raw`` itself when it carries another."""
        decode = msgspec.msgpack.decode if self._encoding == "msgpack" else msgspec.json.decode
        msg = decode(raw, type=Submit)
        if msg.traceparent != UNSAMPLED_SHORT:
            return raw  # the bytes were in its args
        msg.traceparent = UNSAMPLED
        return self.encode(msg)

    def _ask_outcome(self, stream: PlanStream) -> None:
        """Ask for the plan's record (``get_plan``): a rewound stream's plan may have ended before the seq it
        goes on from, and its terminal event is then never sent again. Re-sent after a reconnect."""
        req_id = next(self._req_ids)
        raw = self.encode(GetPlan(req_id=req_id, plan_id=stream.id))
        self._pending[req_id] = PendingRequest(GetPlan, PlanReply, _Outcome(self, stream), raw=raw)
        self._outbox.append(raw)

    def _recovered(self, stream: PlanStream) -> None:
        self.recovered += 1
        stream.recover(RECOVERED_REASON)


class _Resubscription:
    """The waiter of a ``subscribe`` that ``resume`` sends: a plan the coordinator forgot fails its stream."""

    __slots__ = ("_session", "_stream")

    def __init__(self, session: ClientSession, stream: PlanStream) -> None:
        self._session = session
        self._stream = stream

    def done(self) -> bool:
        return False

    def set_result(self, result: Any, /) -> None:
        """The replay follows the reply. A stream the coordinator holds only to an earlier seq (a store loss)
        goes on from there, and the plan's record says whether it already ended (``Stream.rewind``)."""
        last_seq = result.last_seqs.get(self._stream.id) if isinstance(result, Subscribed) else None
        if last_seq is not None and self._stream.rewind(last_seq):
            self._session._ask_outcome(self._stream)

    def set_exception(self, exception: BaseException, /) -> None:
        if isinstance(exception, PlanNotFound) and not self._session._resubmit(self._stream):
            self._stream.fail(
                FleetwireConnectionError(
                    f"the coordinator no longer knows plan {self._stream.id!r} after the reconnect "
                    "(was it restarted without a durable store?)"
                )
            )
            self._session.remove_stream(self._stream)


class _Recovery:
    """The waiter of a plan's resubmission (``ClientSession._resubmit``): accepted, its stream starts again."""

    __slots__ = ("_session", "_stream")

    def __init__(self, session: ClientSession, stream: PlanStream) -> None:
        self._session = session
        self._stream = stream

    def done(self) -> bool:
        return False

    def set_result(self, result: Any, /) -> None:
        """Accepted (new, or a duplicate when another session resubmitted it first): the events follow."""
        self._session._recovered(self._stream)

    def set_exception(self, exception: BaseException, /) -> None:
        self._stream.fail(
            FleetwireConnectionError(
                f"the coordinator lost plan {self._stream.id!r} and refused its resubmission: {exception}"
            )
        )
        self._session.remove_stream(self._stream)


class _Outcome:
    """The waiter of the ``get_plan`` that follows a rewind (``ClientSession._ask_outcome``): an ended plan's
    record ends its stream."""

    __slots__ = ("_session", "_stream")

    def __init__(self, session: ClientSession, stream: PlanStream) -> None:
        self._session = session
        self._stream = stream

    def done(self) -> bool:
        return False

    def set_result(self, result: Any, /) -> None:
        self._stream.finish_from_info(result.plan)
        if self._stream.done():
            self._session._specs.pop(self._stream.id, None)
            self._session.remove_stream(self._stream)

    def set_exception(self, exception: BaseException, /) -> None:
        """No record (forgotten meanwhile): the stream goes on as it is."""
