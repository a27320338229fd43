"""The Client's verbs past ``submit``: each one request (or a page of them) and its reply.

``ClientCalls`` is a base of ``Client`` (fleetwire/client.py), which drives the session they go
through: ``submit_many`` and ``watch`` (plans), ``get_plan``, ``cancel`` and ``release`` (one plan),
``data_ticket`` (where a plan's bytes are), ``plans``, ``workers`` and ``usage`` (listings), and the
operator's ``drain``, ``undrain``, ``remove_worker`` and ``release_device``. What they need of the
client is declared below (:class:`ClientCalls`'s attributes and abstract methods): the session that
numbers requests, a way to send one and await its reply, and ``submit``'s own internals.
"""

from __future__ import annotations

import abc
import functools
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Literal, get_args

import msgspec

from fleetwire import options, submits
from fleetwire.data import Grant, Transport
from fleetwire.errors import RequestError
from fleetwire.plan import Plan
from fleetwire.relay import RelayTransport
from fleetwire.session import ClientSession
from fleetwire.stream import PlanStream
from fleetwire.tracing import LiveSpan, end_submit_spans
from protocol.messages import (
    Cancel,
    DataGrant,
    DataTicket,
    DrainWorker,
    GetPlan,
    GetUsage,
    ListPlans,
    ListWorkers,
    Ok,
    PlanInfo,
    PlanReply,
    Plans,
    PlanStateName,
    ReleaseDevice,
    ReleasePlan,
    RemoveWorker,
    Requirements,
    UndrainWorker,
    Usage,
    Workers,
)

__all__ = ["ClientCalls"]


class ClientCalls(abc.ABC):
    """The request/reply verbs of ``Client`` other than ``submit`` (the module docstring lists them)."""

    _session: ClientSession
    max_inline_bytes: int
    relay: RelayTransport

    @property
    @abc.abstractmethod
    def transport(self) -> Transport:
        """How plans' inputs and outputs move (fleetwire/data.py)."""

    @abc.abstractmethod
    async def _request(
        self, msg: Any, expect: type[Any], on_reply: Callable[[Any], Any] | None = None, raw: msgspec.Raw | None = None
    ) -> Any:
        """Send ``msg`` and return its reply, an ``expect``; ``on_reply`` runs in the reader as it arrives."""

    @abc.abstractmethod
    def _check_open(self) -> None:
        """Raises the session's end, or RuntimeError before ``connect``."""

    @abc.abstractmethod
    async def _submit(self, requests: list[submits.Request]) -> tuple[list[Plan], RequestError | None]:
        """Send encoded submits and wait for every reply: the accepted plans, the first refusal."""

    @abc.abstractmethod
    async def _replay_duplicates(self, plans: list[Plan]) -> None:
        """Subscribe the duplicates among ``plans`` from their first event."""

    @abc.abstractmethod
    async def _subscribe(self, stream: PlanStream, from_seq: int) -> None:
        """Register ``stream`` and subscribe it from ``from_seq``."""

    async def data_ticket(
        self, plan_id: str, direction: Literal["put", "get"] = "get", *, output: str = "", lost: str = ""
    ) -> Grant:
        """Where a plan's bytes are and a fresh ticket to them (``get``: outputs, ``put``: inputs).

        ``output``: a ``get`` for that output of a succeeded plan, following its lineage: the grant may be to a
        rebuild of the plan, or name one making it again (``Grant.rebuilding``, no ticket). ``lost``: the
        ``plan_id`` of a grant the output could not be fetched with (docs/SEMANTICS.md §Graphs).

        Raises:
            PlanNotFound: no such plan visible to this session.
            InvalidArgument: the plan has not been placed yet, or takes no inputs.
            FleetwireError: ``output_lost``: the output is gone and cannot be made again.
        """
        msg = DataTicket(req_id=self._session.next_req_id(), plan_id=plan_id, direction=direction, output=output,
                         lost=lost)  # fmt: skip
        reply: DataGrant = await self._request(msg, DataGrant)
        refresh = functools.partial(self.data_ticket, plan_id, direction, output=output)  # a fresh one on 401
        return Grant.from_reply(reply, refresh)

    async def submit_many(
        self,
        op: str,
        args: Iterable[Any],
        *,
        tags: Iterable[str] | None = None,
        requirements: Requirements | Mapping[str, Any] | None = None,
        priority: int = 0,
        timeout_s: float | None = None,
        max_attempts: int = 3,
        plan_ids: Iterable[str | None] | None = None,
    ) -> list[Plan]:
        """Submit one plan per item of ``args``, all with the same op and requirements.

        Every ``submit`` is queued at once, so the writer sends thousands of them in a
        few frames (each at most ``COALESCE_LIMIT_BYTES``) instead of one frame per plan.
        The other arguments are those of :meth:`submit`; ``plan_ids``, when given, has
        one idempotency key (or None) per item.

        Returns:
            The plans, in the order of ``args``, each subscribed from its first event.

        Raises:
            RequestError: the coordinator refused a submit (``InvalidArgument``, a limit...):
                the first refusal is raised once every reply is in; the accepted plans stay
                submitted and subscribed.
            ValueError: ``plan_ids`` and ``args`` differ in length, or bad ``requirements``.
        """
        self._check_open()
        reqs = options.requirements(requirements, tags)
        items = list(args)
        ids = list(plan_ids) if plan_ids is not None else [None] * len(items)
        if len(ids) != len(items):
            raise ValueError(f"plan_ids has {len(ids)} ids for {len(items)} args; give one per plan (or None)")
        spans: list[LiveSpan | None] = []
        requests = submits.batch(
            self._session,
            op,
            items,
            ids,
            requirements=reqs,
            priority=priority,
            timeout_s=timeout_s,
            max_attempts=max_attempts,
            max_inline_bytes=self.max_inline_bytes,
            spans=spans,
        )
        plans, refused = await self._submit(requests)
        end_submit_spans(spans, refused.code if refused is not None else "")
        await self._replay_duplicates(plans)
        if refused is not None:
            raise refused
        return plans

    async def watch(self, plan_id: str, *, from_seq: int = 0) -> Plan:
        """Subscribe to an existing plan; its ``events()`` start after ``from_seq``.

        Raises:
            PlanNotFound: no such plan (or not one this client may see).
        """
        stream = PlanStream(plan_id, from_seq=from_seq)
        plan = Plan(stream, self)
        await self._subscribe(stream, from_seq)
        if from_seq > 0 and not stream.done():
            # The replay holds only events after from_seq: when the terminal event is not
            # among them, the plan's record says how it ended.
            info = await self.get_plan(plan_id)
            if stream.state is None:
                stream.state = info.state
            stream.finish_from_info(info)
            if stream.done():
                self._session.remove_stream(stream)
        return plan

    async def get_plan(self, plan_id: str) -> PlanInfo:
        """The plan's current record.

        Raises:
            PlanNotFound: no such plan (or not one this client may see).
        """
        reply: PlanReply = await self._request(GetPlan(req_id=self._session.next_req_id(), plan_id=plan_id), PlanReply)
        return reply.plan

    async def cancel(self, plan_id: str, *, with_dependants: bool = False) -> PlanInfo:
        """Cancel a plan; returns its record after the cancel (a terminal plan is left as is).

        ``with_dependants``: cancel too the unfinished plans that use its outputs or run after it,
        directly or not (without it they fail ``upstream_failed``; docs/SEMANTICS.md §Graphs).

        Raises:
            PlanNotFound: no such plan (or not one this client may see).
        """
        msg = Cancel(req_id=self._session.next_req_id(), plan_id=plan_id, with_dependants=with_dependants)
        reply: PlanReply = await self._request(msg, PlanReply)
        return reply.plan

    async def release(self, plan_id: str) -> PlanInfo:
        """Place a plan held for a greener hour now (``fleetwire release``); returns its record then (a plan
        that was not held is left as it is). Its owner or an admin (docs/SEMANTICS.md §Deadlines).

        Raises:
            PlanNotFound: no such plan (or not one this client may see).
        """
        reply: PlanReply = await self._request(ReleasePlan(req_id=self._session.next_req_id(), plan_id=plan_id),
                                               PlanReply)  # fmt: skip
        return reply.plan

    async def usage(self, *, by: Literal["principal", "team"] = "principal", since: float = 0.0) -> Usage:
        """Usage totals from the coordinator's ledger (``reply.rows``: plans by outcome, slot- and GPU-seconds,
        tokens, joules, gCO2e, preemptions), by ``principal`` or ``team``, from the hour holding ``since`` (Unix
        seconds; 0: all time). An admin token sees everyone's; a client token its own (docs/SEMANTICS.md §Usage).

        Raises:
            ValueError: ``by`` is neither ``principal`` nor ``team``.
        """
        if by not in ("principal", "team"):
            raise ValueError(f"by must be 'principal' or 'team', got {by!r}")
        msg = GetUsage(req_id=self._session.next_req_id(), by=by, since=since)
        reply: Usage = await self._request(msg, Usage)
        return reply

    async def workers(self) -> Workers:
        """The worker registry: ``reply.workers`` (``WorkerInfo`` rows) and ``reply.summary``."""
        reply: Workers = await self._request(ListWorkers(req_id=self._session.next_req_id()), Workers)
        return reply

    async def plans(self, *, states: Iterable[str] = (), limit: int = 200) -> Plans:
        """Plans this client may see, newest first (``reply.plans``), the queue in placement order
        (``reply.queue``) and counts per state (``reply.counts``).

        Args:
            states: only plans in these states (``queued``, ``running``, ...); empty: all.
            limit: at most this many plans and queue entries (1..10000). Rows are summaries: no
                result body (``result_bytes`` is its size; ``get_plan`` fetches it). A long listing
                comes in pages, which this call follows; ``reply.next_cursor`` is set when more
                plans match past ``limit``.

        Raises:
            InvalidArgument: a bad limit.
            ValueError: a state that is not a plan state.
        """
        try:
            wanted = msgspec.convert(list(states), list[PlanStateName])
        except msgspec.ValidationError as exc:
            raise ValueError(f"states must be plan states ({', '.join(get_args(PlanStateName))}): {exc}") from None
        msg = ListPlans(req_id=self._session.next_req_id(), states=wanted, limit=limit)
        reply: Plans = await self._request(msg, Plans)
        # The coordinator pages a long listing (each page stays under the frame limit); follow
        # its cursor until ``limit`` rows are in (queue, counts and total come from the first page).
        while reply.next_cursor and len(reply.plans) < limit:
            msg = ListPlans(req_id=self._session.next_req_id(), states=wanted, limit=limit - len(reply.plans),
                            cursor=reply.next_cursor)  # fmt: skip
            page: Plans = await self._request(msg, Plans)
            reply.plans.extend(page.plans)
            reply.next_cursor = page.next_cursor
        return reply

    async def drain(self, worker_id: str, *, deadline_s: float | None = None) -> None:
        """Stop placing plans on a worker; with ``deadline_s``, plans it still runs then are requeued.

        Raises:
            RequestError: code ``unknown_worker``: no such worker is registered.
            InvalidArgument: a negative deadline.
        """
        msg = DrainWorker(req_id=self._session.next_req_id(), worker_id=worker_id, deadline_s=deadline_s)
        await self._request(msg, Ok)

    async def undrain(self, worker_id: str) -> None:
        """Place plans on a drained worker again.

        Raises:
            RequestError: code ``unknown_worker``: no such worker is registered.
        """
        await self._request(UndrainWorker(req_id=self._session.next_req_id(), worker_id=worker_id), Ok)

    async def remove_worker(self, worker_id: str) -> None:
        """Remove a worker for good, at once: its unfinished plans are requeued (no attempt spent),
        its session is closed 4410 and its id is refused until the coordinator restarts.

        Raises:
            RequestError: code ``unknown_worker``: no such worker is registered; ``forbidden``: not an admin token.
        """
        await self._request(RemoveWorker(req_id=self._session.next_req_id(), worker_id=worker_id), Ok)

    async def release_device(self, worker_id: str, device: int) -> None:
        """Put a quarantined device back in service (docs/OPERATIONS.md §GPU health): the worker ends its
        quarantine and says so in its next load; placement uses the device again.

        Raises:
            RequestError: ``unknown_worker`` (no such worker, or it is not connected), ``invalid_argument``
                (it has no such device), ``forbidden`` (not an admin token).
        """
        msg = ReleaseDevice(req_id=self._session.next_req_id(), worker_id=worker_id, device=device)
        await self._request(msg, Ok)
