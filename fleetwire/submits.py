"""Submitting plans: the ``submit`` messages a call makes, and the wait for their ``accepted``.

What it owns: the one path ``Client.submit`` and ``Client.submit_many`` share (fleetwire/client.py):
each ``submit`` built from the caller's options and encoded, then the batch sent and every reply
waited for, each accepted plan's stream registered by the client's hook the moment its
``accepted`` arrives (in the reader, before the events that follow it).

Rules (docs/PROTOCOL.md §Client session):

* Every submit carries a plan id: the caller's idempotency key, else one the SDK makes, so a
  submit re-sent after a reconnect (fleetwire/resume.py) is idempotent. ``""`` is no id (as None:
  the protocol's ``plan_id`` is non-empty or null). The hook is told which (``own``: the SDK made
  the id): a duplicate of an id the SDK made is this client's own submit re-sent, not a duplicate
  to the caller.
* Input and output names ``__args__`` and ``__result__`` are reserved (oversize args and results).
* A submit encoded larger than the client's ``max_inline_bytes`` is never sent inline: ``submit``
  moves its args to the data plane (the input ``__args__``, their msgpack, which the worker
  decodes before calling the handler); ``submit_many`` refuses the batch before anything is sent.
* An argument the encoding cannot carry fails in the caller, before anything is sent.
* A batch waits for every reply: the accepted plans come back with the first refusal, which the
  caller raises once the accepted plans are subscribed; the requests are forgotten whatever
  happens (a caller that gives up leaves no waiter behind).
"""

from __future__ import annotations

import asyncio
import itertools
import operator
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from datetime import datetime
from typing import Any, NamedTuple, NoReturn, Protocol

import msgspec

from fleetwire import options
from fleetwire.errors import RequestError
from fleetwire.inputs import InputSource, prepare_inputs
from fleetwire.plan import Plan
from fleetwire.prompt_hints import fill_hints
from fleetwire.session import ClientSession
from fleetwire.tracing import LiveSpan, start_submit_spans, submit_context
from protocol.messages import Accepted, InputSpec, OutputRef, Requirements, Resources, RoutingHints, Submit
from protocol.relay import ARGS_INPUT, RESERVED_NAMES

__all__ = [
    "AcceptedHook", "Request", "args_by_data_plane", "await_accepted", "batch", "check_names", "new_plan_ids",
    "submit_message",
]


class Request(NamedTuple):
    """One encoded submit to send: its ``req_id``, its bytes, and whether the SDK made its plan id."""

    req_id: int
    raw: msgspec.Raw
    own: bool


_REQ_ID, _OWN = operator.itemgetter(0), operator.itemgetter(2)  # of a Request


class AcceptedHook(Protocol):
    """Makes the plan of an ``accepted`` (in the reader); ``own``: the SDK made its plan id. Called positionally
    (``hook(own, reply)``), once per plan: no keyword dictionary per reply."""

    def __call__(self, own: bool, reply: Accepted, /) -> Plan: ...


def check_names(inputs: Iterable[str], outputs: Iterable[str]) -> None:
    """Refuse the reserved input and output names.

    Raises:
        ValueError: ``__args__`` or ``__result__`` among them.
    """
    reserved = RESERVED_NAMES.intersection(inputs) | RESERVED_NAMES.intersection(outputs)
    if reserved:
        raise ValueError(f"input and output names {sorted(reserved)} are reserved for oversize args and results")


Outputs = Iterable[str] | Mapping[str, Mapping[str, Any] | None]
"""``Client.submit``'s ``outputs``: names, or names with each one's options (``{"y": {"replicas": 2}}``)."""


def output_options(outputs: Outputs) -> tuple[list[str], dict[str, int]]:
    """The output names of ``outputs`` and the copies wanted of each (``replicas``; only those other than 1).

    Raises:
        ValueError: an option other than ``replicas``, or a count that is not an int.
    """
    if not isinstance(outputs, Mapping):
        return list(outputs), {}
    replicas: dict[str, int] = {}
    for name, spec in outputs.items():
        unknown = sorted(set(spec or {}) - {"replicas"})
        if unknown:
            raise ValueError(f"outputs[{name!r}] has unknown options {unknown}; the one an output takes is 'replicas'")
        copies = (spec or {}).get("replicas", 1)
        if isinstance(copies, bool) or not isinstance(copies, int):
            raise ValueError(f"outputs[{name!r}]['replicas'] must be an int (copies of it, its own included), "
                             f"got {copies!r}")
        if copies != 1:
            replicas[name] = copies
    return list(outputs), replicas


def submit_message(
    next_req_id: Callable[[], int],
    op: str,
    args: Any,
    sources: Mapping[str, InputSource],
    *,
    tags: Iterable[str] | None,
    requirements: Requirements | Mapping[str, Any] | None,
    priority: int,
    timeout_s: float | None,
    max_attempts: int,
    retries: int,
    plan_id: str | None,
    hints: RoutingHints | Mapping[str, Any] | None,
    session_key: str | None,
    policy: str | None,
    outputs: Outputs,
    resources: Resources | Mapping[str, Any] | None,
    refs: Mapping[str, OutputRef] | None = None,
    after: Sequence[str] = (),
    deterministic: bool = True,
    preemptible: bool = False,
    deadline_s: float | None = None,
    deadline_at: float | None = None,
    expected_run_s: float | None = None,
) -> Submit:
    """``Client.submit``'s message, subscribed, with a plan id (see ``Client.submit`` for the options); its
    ``req_id`` is drawn once the options are valid. ``refs``: its inputs that are other plans' outputs
    (the reference form, docs/PROTOCOL.md §Plan graphs); ``after``: ids of plans that must succeed first.

    Raises:
        ValueError: ``requirements``, ``hints`` or ``resources`` with an unknown field or a wrong type, or
            ``outputs`` with an unknown option.
    """
    reqs = options.requirements(requirements, tags)
    routing = options.hints(hints, session_key, policy)
    names, replicas = output_options(outputs)
    if op == "generate":  # token estimate and prefix hashes of the prompt (fleetwire/prompt_hints.py)
        routing = fill_hints(routing, args)
    return Submit(
        req_id=next_req_id(),
        op=op,
        args=args,
        requirements=reqs,
        priority=priority,
        timeout_s=timeout_s,
        max_attempts=max_attempts,
        retries=retries,
        plan_id=plan_id or options.new_plan_id(),  # always an id: a submit re-sent after a reconnect is idempotent
        subscribe=True,
        hints=routing,
        inputs=[source.spec() for source in sources.values()]
        + [InputSpec(name, ref=ref) for name, ref in (refs or {}).items()],
        outputs=names,
        replicas=replicas,
        resources=options.resources(resources),
        after=list(after),
        deterministic=deterministic,
        preemptible=preemptible,
        deadline_s=deadline_s,
        deadline_at=deadline_at,
        expected_run_s=expected_run_s,
    )


def new_plan_ids(count: int) -> list[str]:
    """``count`` plan ids as ``options.new_plan_id`` makes them (16 hex digits of ``os.urandom``), from one read:
    a batch's ids were a ``secrets.token_hex`` each, a system call a plan (~60 % of ``batch``'s time, issue #29)."""
    digits = os.urandom(8 * count).hex()
    return [digits[i : i + 16] for i in range(0, 16 * count, 16)]


def unix_time(when: float | datetime | None) -> float | None:
    """A deadline as Unix seconds: a number as is, a timezone-aware ``datetime`` converted.

    Raises:
        ValueError: a naive ``datetime`` (its time zone would be a guess).
    """
    if not isinstance(when, datetime):
        return when
    if when.tzinfo is None:
        raise ValueError(f"deadline_at {when.isoformat()} has no time zone; give one (e.g. datetime.now(UTC) + ...)")
    return when.timestamp()


async def args_by_data_plane(
    msg: Submit, sources: dict[str, InputSource], encode: Callable[[Any], msgspec.Raw]
) -> tuple[Submit, msgspec.Raw]:
    """``msg`` with its args moved to the input ``__args__`` (added to ``sources``), and its encoding."""
    packed = await prepare_inputs({ARGS_INPUT: msgspec.msgpack.encode(msg.args)})
    sources.update(packed)
    msg = msgspec.structs.replace(msg, args=None, inputs=[*msg.inputs, packed[ARGS_INPUT].spec()])
    return msg, encode(msg)


def batch(
    session: ClientSession,
    op: str,
    items: Sequence[Any],
    ids: Sequence[str | None],
    *,
    requirements: Requirements,
    priority: int,
    timeout_s: float | None,
    max_attempts: int,
    max_inline_bytes: int,
    spans: list[LiveSpan | None] | None = None,
) -> list[Request]:
    """``Client.submit_many``'s requests: one subscribed submit per item, each with its plan id or a new one,
    and its caller's trace context (``spans`` gets their submit spans: fleetwire/tracing.py).

    Raises:
        ValueError: an item encoded over ``max_inline_bytes`` (nothing is sent).
        TypeError: an item the encoding cannot carry.
    """
    # One submit made with every option, the others copied from it (in C) with their own id, args and plan id:
    # keyword matching and defaults (new empty lists, a RoutingHints) once per batch, not per plan.
    # The template carries what every plan's traceparent is unless its own span is sampled (fleetwire/tracing.py):
    # set once here, copied with the rest, not set on each plan (at 1 %, 99 of 100 plans' "00").
    context = submit_context(session.unsampled)  # "not sampled" as the session's connection reads it
    template = Submit(req_id=0, op=op, requirements=requirements, priority=priority, timeout_s=timeout_s,
                      max_attempts=max_attempts, subscribe=True, traceparent=context)  # fmt: skip
    replace = msgspec.structs.replace
    req_ids = session.take_req_ids(len(items))
    fresh = iter(new_plan_ids(len(ids) - sum(map(bool, ids))))  # the ids the SDK makes: one read of the randomness
    msgs = [replace(template, req_id=req_id, args=item, plan_id=plan_id or next(fresh))
            for req_id, item, plan_id in zip(req_ids, items, ids, strict=True)]
    started = start_submit_spans(msgs, context)  # the sampled ones' own traceparent
    if started is not None and spans is not None:
        spans.extend(started)
    raws = session.encode_each(msgs)  # an unencodable item fails here, before anything is sent
    if max(map(len, raws), default=0) > max_inline_bytes:  # never a frame the coordinator would close the session for
        _too_large(raws, max_inline_bytes)
    # Requests made in C (NamedTuple's own __new__ is a Python call): (req_id, raw, own: no plan id given, None or
    # "", which the SDK replaced with its own just above: a duplicate of it is this client's own submit re-sent)
    return list(map(tuple.__new__, itertools.repeat(Request), zip(req_ids, raws, map(operator.not_, ids), strict=True)))


def _too_large(raws: Sequence[msgspec.Raw], max_inline_bytes: int) -> NoReturn:
    """``batch``'s refusal of an item over ``max_inline_bytes``: its own function, so that the generator's cell
    (``max_inline_bytes``) is made only then, not at every batch (CPython 3.11 makes cells at each call)."""
    index, size = next((i, len(raw)) for i, raw in enumerate(raws) if len(raw) > max_inline_bytes)
    raise ValueError(f"args[{index}] is {size} bytes encoded, over max_inline_bytes ({max_inline_bytes}); "
                     "submit it with submit(), which moves large args to the data plane")  # fmt: skip


async def await_accepted(
    session: ClientSession,
    requests: Sequence[Request],
    accepted: AcceptedHook,
    wake: Callable[[], None],
) -> tuple[list[Plan], RequestError | None]:
    """Send ``requests`` (``wake``: the writer) and wait for every reply.

    ``accepted(own, reply)`` runs in the reader for each ``accepted`` and makes its plan. Returns
    the accepted plans, in the order of ``requests``, and the first refusal (None: none).
    """
    if not requests:
        return [], None
    waiter = _Batch(requests, accepted, asyncio.get_running_loop().create_future())
    try:
        session.send_requests(requests, Submit, Accepted, waiter)
        wake()
        await waiter.future
    finally:
        if waiter.left:  # gave up (or failed) before every reply: let go the requests still pending
            for request in requests:
                session.forget_request(request.req_id)
            if waiter.future.done() and not waiter.future.cancelled():
                waiter.future.exception()  # after an early exit: no "exception was never retrieved"
            waiter.future.cancel()
    plans = waiter.plans if waiter.refused is None else [plan for plan in waiter.plans if plan is not None]
    return plans, waiter.refused  # type: ignore[return-value]  # every place holds a plan when none was refused


class _Batch:
    """The one waiter of a batch's submits (``await_accepted``), instead of a future per plan: each
    ``accepted`` makes its plan in its place, each refusal is counted, and ``future`` is set once every
    request was answered (or at once by a failure that is not a refusal: the session ended).

    The session resolves it with the reply itself (no ``on_reply``): a reply's ``req_id`` says its place.
    """

    __slots__ = ("_accepted", "_first", "_own", "_places", "done", "future", "left", "plans", "refused", "refused_at")

    def __init__(self, requests: Sequence[Request], accepted: AcceptedHook, future: asyncio.Future[None]) -> None:
        self._accepted = accepted
        self._own = list(map(_OWN, requests))
        first = self._first = requests[0].req_id
        self._places: dict[int, int] | None = None  # None: consecutive ids (a batch's), placed at req_id - first
        if list(map(_REQ_ID, requests)) != list(range(first, first + len(requests))):
            self._places = {r.req_id: i for i, r in enumerate(requests)}
        self.future = future
        self.done = future.done  # the Waiter's done(): the future's own (C) method, asked once per reply
        self.left = len(requests)
        self.plans: list[Plan | None] = [None] * len(requests)
        self.refused: RequestError | None = None
        self.refused_at = len(requests)

    def _place(self, req_id: int) -> int:
        return req_id - self._first if self._places is None else self._places[req_id]

    def set_result(self, reply: Accepted, /) -> None:
        """An ``accepted``: its plan made now, in the reader, before the events that follow it."""
        place = reply.req_id - self._first if self._places is None else self._places[reply.req_id]
        self.plans[place] = self._accepted(self._own[place], reply)
        self.left -= 1
        if not self.left:
            self.future.set_result(None)

    def set_exception(self, exception: BaseException, /) -> None:
        """A refusal (the first, in the order of the requests, is returned), or the end of the session."""
        if not isinstance(exception, RequestError):
            self.future.set_exception(exception)  # the caller raises it; the requests still pending are let go
            return
        place = self._place(exception.req_id) if exception.req_id else self.refused_at - 1
        if place < self.refused_at:
            self.refused, self.refused_at = exception, place
        self.left -= 1
        if not self.left:
            self.future.set_result(None)
