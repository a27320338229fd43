"""Submitting plans: the ``submit`` messages a call makes, and the wait for their ``accepted``.

What it owns: the one path ``Client.submit`` and ``Client.submit_many`` share (fleetwire/client.py):
each ``submit`` built from the caller's options and encoded, then the batch sent and every reply
waited for, each accepted plan's stream registered by the client's hook the moment its
``accepted`` arrives (in the reader, before the events that follow it).

Rules (docs/PROTOCOL.md §Client session):

* Every submit carries a plan id: the caller's idempotency key, else one the SDK makes, so a
  submit re-sent after a reconnect (fleetwire/resume.py) is idempotent. The hook is told which
  (``own``: the SDK made the id): a duplicate of an id the SDK made is this client's own submit
  re-sent, not a duplicate to the caller.
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
import functools
from collections.abc import Callable, Iterable, Mapping, Sequence
from datetime import datetime
from typing import Any, NamedTuple, Protocol

import msgspec

from fleetwire import options
from fleetwire.errors import RequestError
from fleetwire.inputs import InputSource, prepare_inputs
from fleetwire.plan import Plan
from fleetwire.prompt_hints import fill_hints
from fleetwire.session import ClientSession
from fleetwire.tracing import LiveSpan, start_submit_spans
from protocol.messages import Accepted, InputSpec, OutputRef, Requirements, Resources, RoutingHints, Submit
from protocol.relay import ARGS_INPUT, RESERVED_NAMES

__all__ = ["AcceptedHook", "Request", "args_by_data_plane", "await_accepted", "batch", "check_names", "submit_message"]


class Request(NamedTuple):
    """One encoded submit to send: its ``req_id``, its bytes, and whether the SDK made its plan id."""

    req_id: int
    raw: msgspec.Raw
    own: bool


class AcceptedHook(Protocol):
    """Makes the plan of an ``accepted`` (in the reader); ``own``: the SDK made its plan id. ``own`` comes first:
    ``functools.partial(hook, own)`` then calls it without a keyword dictionary per reply."""

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
    encode = session.encode
    requests: list[Request] = []
    msgs = [
        Submit(
            req_id=session.next_req_id(), op=op, args=item, requirements=requirements, priority=priority,
            timeout_s=timeout_s, max_attempts=max_attempts, plan_id=plan_id or options.new_plan_id(), subscribe=True,
        )
        for item, plan_id in zip(items, ids, strict=True)
    ]
    started = start_submit_spans(msgs)
    if started is not None and spans is not None:
        spans.extend(started)
    for msg, plan_id in zip(msgs, ids, strict=True):
        req_id = msg.req_id
        raw = encode(msg)  # an unencodable item fails here, before anything is sent
        if len(raw) > max_inline_bytes:  # never a frame the coordinator would close the session for
            raise ValueError(f"args[{len(requests)}] is {len(raw)} bytes encoded, over max_inline_bytes "
                             f"({max_inline_bytes}); submit it with submit(), which moves large args "
                             "to the data plane")  # fmt: skip
        requests.append(Request(req_id, raw, plan_id is None))
    return requests


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
    loop = asyncio.get_running_loop()
    hooks = {own: functools.partial(accepted, own) for own in (False, True)}  # not one per plan
    futures: list[asyncio.Future[Any]] = []
    for request in requests:
        future: asyncio.Future[Any] = loop.create_future()
        session.send_request(request.req_id, Submit, request.raw, Accepted, future, hooks[request.own])
        futures.append(future)
    plans: list[Plan] = []
    refused: RequestError | None = None
    try:
        wake()
        for future in futures:
            try:
                plans.append(await future)
            except RequestError as exc:
                refused = refused or exc
    finally:
        for request, future in zip(requests, futures, strict=False):  # futures: fewer after a failed send_request
            if future.done() and not future.cancelled():  # answered: the session let its request go then
                future.exception()  # after an early exit: no "exception was never retrieved"
            else:
                session.forget_request(request.req_id)
                future.cancel()
        for request in requests[len(futures):]:  # never sent: send_request failed
            session.forget_request(request.req_id)
    return plans, refused
