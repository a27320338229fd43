"""``Plan``: the user's handle on one plan: its events, its outcome, and cancelling it.

A ``Plan`` does no I/O and holds no protocol state of its own: its ``PlanStream``
(fleetwire/stream.py), fed by the client's session, buffers the events in ``seq`` order and
fixes the outcome. The handle adds the waiting: ``events()`` and ``result()`` sleep on a future of
the ``_Changed`` that they leave as the stream's ``waker``, which the stream's next change sets.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any, Literal, Protocol

import msgspec

from fleetwire.data import DataTransferError, Grant, OutputCheck, OutputMismatch, Transport, Uploads
from fleetwire.direct import fetch_to
from fleetwire.errors import PlanError, RequestError
from fleetwire.relay import AutoTransport, OutputGone, RelayTransport
from fleetwire.stream import PlanStream
from protocol.errors import OUTPUT_LOST, UNAVAILABLE
from protocol.messages import Event, OutputRef, PlanInfo, PlanStateName, Receipt
from protocol.relay import RESULT_OUTPUT

__all__ = ["Plan", "PlanCanceller"]

READY_GRANT_MARGIN_S = 60.0  # a data_ready get ticket this close to its expiry is not used: a fresh one is asked for
LINEAGE_TRIES = 5  # grants asked for one output: a refused or gone copy, then each rebuild (at most 3) waited for
GONE_STATUS = 404  # a copy that is gone (the direct path's 404, the relay's output_gone)

log = logging.getLogger("fleetwire.data")


class PlanCanceller(Protocol):
    """What a ``Plan`` needs of its client: a way to cancel it (``Client.cancel``), and for outputs
    a ticket to them (``Client.data_ticket``) and a transport (``Client.transport``)."""

    async def cancel(self, plan_id: str, *, with_dependants: bool = False) -> PlanInfo:
        """Cancel the plan (and the plans that use its outputs or run after it); its record after the cancel."""
        ...

    async def data_ticket(
        self, plan_id: str, direction: Literal["put", "get"] = "get", *, output: str = "", lost: str = ""
    ) -> Grant:
        """Where the plan's bytes are, with a fresh ticket (``output``, ``lost``: follow its lineage)."""
        ...

    async def watch(self, plan_id: str, *, from_seq: int = 0) -> Plan:
        """Subscribe to a plan (a rebuild making a lost output again)."""
        ...

    @property
    def transport(self) -> Transport:
        """How bytes move (fleetwire/data.py)."""
        ...

    @property
    def relay(self) -> Transport:
        """Bytes through the coordinator (fleetwire/relay.py)."""
        ...


class Plan:
    """A submitted or watched plan: its event stream, state and outcome.

    Made by ``Client.submit`` and ``Client.watch``, never directly. Attributes reflect
    the events received so far: ``state`` (``None`` until the first lifecycle event of
    a watched plan), ``attempt``, ``worker_id``, ``last_seq``, ``resyncs``, ``recovered``;
    ``duplicate`` is true when ``submit`` found an existing plan with the given ``plan_id``.

    Args:
        stream: the plan's stream, registered with the client's session.
        client: cancels the plan for ``cancel()``.
        duplicate: ``submit`` found an existing plan with the given ``plan_id``.
    """

    # Set on the few plans that have them; the class holds the defaults, so a plan of a large batch sets none.
    uploads: Uploads | None = None
    """Its inputs' uploads (fleetwire/data.py), when it was submitted with inputs."""
    relay: bool = False
    """Its inputs and outputs go through the coordinator (``submit(relay=True)``; fleetwire/relay.py)."""
    _big_result: tuple[Any] | None = None  # a result fetched from the output ``__result__``

    def __init__(self, stream: PlanStream, client: PlanCanceller, *, duplicate: bool = False) -> None:
        self.id = stream.id
        self.duplicate = duplicate
        self._stream = stream
        self._client = client

    def __repr__(self) -> str:
        return f"<Plan {self.id} {self.state or 'unknown'} seq={self.last_seq}>"

    @property
    def stream(self) -> PlanStream:
        """What the client's session received for this plan (read it; the session feeds it)."""
        return self._stream

    @property
    def state(self) -> PlanStateName | None:
        """The state the latest lifecycle event (or the plan's record) implies; None while unknown."""
        return self._stream.state

    @property
    def attempt(self) -> int:
        """The attempt the latest lifecycle event names (0 before the first lease)."""
        return self._stream.attempt

    @property
    def worker_id(self) -> str | None:
        """The worker of the latest attempt, once leased."""
        return self._stream.worker_id

    @property
    def last_seq(self) -> int:
        """The ``seq`` of the latest event received."""
        return self._stream.last_seq

    @property
    def resyncs(self) -> int:
        """Runs of events the coordinator could no longer replay (each is a ``resync`` event)."""
        return self._stream.resyncs

    @property
    def recovered(self) -> bool:
        """Whether the coordinator lost this plan (a store loss) and the client resubmitted it with the
        same id and spec; its ``events()`` then hold a ``recovered`` event where the new stream begins."""
        return self._stream.recovered > 0

    def done(self) -> bool:
        """Whether the plan reached a terminal state (succeeded, failed or cancelled)."""
        return self._stream.final is not None

    @property
    def receipt(self) -> Receipt | None:
        """Once the plan ended: the energy (J) and emissions (gCO2e) of its last attempt, measured or
        ``estimated``, with what placement projected (docs/PROTOCOL.md §Receipt); None before, or
        when its worker sent none (it measured nothing)."""
        return self._stream.receipt

    def events(self) -> AsyncIterator[Event]:
        """Every event received for this plan, in ``seq`` order, from the first.

        Ends after the terminal event (``succeeded``, ``failed`` or ``cancelled``).
        Each call starts a new iterator from the beginning of the buffer.

        Raises:
            FleetwireConnectionError: the session ended before the terminal event
                (after yielding every event received until then).
        """
        return _PlanEvents(self._stream, self._changed_event)

    async def result(self) -> Any:
        """Wait for the plan to end and return its result.

        Raises:
            PlanFailed: the plan failed; ``code``, ``message`` and ``detail`` say why.
            PlanCancelled: the plan was cancelled.
            FleetwireConnectionError: the session ended before the plan did.
        """
        stream = self._stream
        while stream.final is None:  # as _outcome(), inline: no coroutine of its own on a lone caller's path
            if stream.lost is not None:
                raise stream.lost
            await self._changed_event().wait()
        result = stream.outcome()
        if result is None and self._stream.final == "succeeded" and self._result_output():
            # The handler's result was over the frame limit: the worker kept it as an output.
            if self._big_result is None:
                encoded = await self.output(RESULT_OUTPUT)
                self._big_result = (msgspec.msgpack.decode(encoded),)
            return self._big_result[0]
        return result

    async def _outcome(self) -> Any:
        stream = self._stream
        while stream.final is None:
            if stream.lost is not None:
                raise stream.lost
            await self._changed_event().wait()
        return stream.outcome()

    def _output_check(self, name: str) -> OutputCheck:
        """What an output's bytes must hash to: the digest its worker reported in ``succeeded`` ("" when none)."""
        for event in reversed(self._stream.events):
            if event.kind == "succeeded":
                data = event.data if isinstance(event.data, dict) else {}
                outputs = data.get("outputs")
                spec = outputs.get(name) if isinstance(outputs, dict) else None
                if isinstance(spec, list | tuple) and len(spec) >= 2 and isinstance(spec[1], str):
                    return OutputCheck(name, spec[1])
                break
        return OutputCheck(name, "")

    def _result_output(self) -> bool:
        """Whether the ``succeeded`` event lists the output ``__result__`` (an oversize result)."""
        for event in reversed(self._stream.events):
            if event.kind == "succeeded":
                data = event.data if isinstance(event.data, dict) else {}
                outputs = data.get("outputs")
                return isinstance(outputs, dict) and RESULT_OUTPUT in outputs
        return False

    @property
    def transfers(self) -> dict[tuple[str, str], str]:
        """``(direction, name) -> "direct" | "relay"``: the path that carried each finished transfer of this
        plan's latest attempt as this client made them ("put": inputs, "get": outputs)."""
        found: dict[tuple[str, str], str] = {}
        for transport in (self._client.relay, self._client.transport):
            paths = getattr(transport, "paths", {})
            for (plan_id, _attempt, direction, name), via in sorted(paths.items()):
                if plan_id == self.id:
                    found[(direction, name)] = via
        return found

    def _transport(self) -> Transport:
        return self._client.relay if self.relay else self._client.transport

    async def cancel(self, *, with_dependants: bool = False) -> PlanInfo:
        """Cancel the plan; same as ``client.cancel(plan.id, with_dependants=...)``."""
        return await self._client.cancel(self.id, with_dependants=with_dependants)

    def ref(self, name: str) -> OutputRef:
        """Its output ``name``, as another plan's input: ``client.submit("b", inputs={"x": plan.ref("y")})``.

        The other plan waits until this one succeeded with that output, and is placed where the bytes
        are when it can be (docs/SEMANTICS.md §Graphs). Nothing is fetched to this client.
        """
        return OutputRef(self.id, name)

    async def output_chunks(self, name: str) -> AsyncIterator[bytes]:
        """An output's bytes in chunks, fetched from its worker once the plan succeeded.

        The bytes are hashed as they come: when the last chunk was taken, a digest other than the
        one the worker reported raises :class:`~fleetwire.data.OutputMismatch` (the chunks already
        yielded are not to be trusted then).

        An output whose copies are gone (its worker died, or dropped it) is made again when its plan can be
        run again (docs/SEMANTICS.md §Graphs): this waits for that rebuild and yields its bytes.

        Raises:
            PlanFailed, PlanCancelled: the plan did not succeed.
            OutputGone: the output is gone and cannot be made again (``output_lost``: the message says why).
            DataTransferError: its worker cannot be reached now.
            OutputMismatch: the bytes do not have the reported digest.
        """
        await self._outcome()
        tries = _Tries(self, name)
        while True:
            grant = await tries.next()
            check = tries.check
            yielded = False
            try:
                async for chunk in self._transport().download(grant, name):
                    check.update(chunk)
                    yielded = True
                    yield chunk
                check.verify()
                return
            except DataTransferError as exc:
                tries.refused(exc, delivered=yielded)

    async def output(self, name: str) -> bytes:
        """An output's bytes, whole (for small outputs; see :meth:`output_to` and :meth:`output_chunks`)."""
        parts = [chunk async for chunk in self.output_chunks(name)]
        return b"".join(parts)

    async def output_to(self, name: str, path: str | os.PathLike[str]) -> Path:
        """Write an output to ``path`` in chunks (bounded memory); returns the path.

        Raises:
            OutputMismatch: the bytes do not have the digest the worker reported (``path`` is not written).
        """
        await self._outcome()
        transport = self._transport()
        tries = _Tries(self, name)
        while True:
            grant = await tries.next()
            try:
                return await self._fetch_to(transport, grant, name, path, tries.check)
            except DataTransferError as exc:
                tries.refused(exc, delivered=isinstance(exc, OutputMismatch))

    async def _lineage_grant(self, name: str, gone: _Gone | None) -> Grant:
        """A fresh grant to a copy of output ``name``: this plan's, or a rebuild's (``data_ticket`` with ``output``;
        ``gone``: the copy just found gone). While a rebuild makes it again, waits for that plan.

        Raises:
            OutputGone: it is gone and cannot be made again (the coordinator's ``output_lost`` says why).
        """
        lost = gone.plan_id if gone is not None else ""
        for _ in range(LINEAGE_TRIES):
            try:
                grant = await self._client.data_ticket(self.id, "get", output=name, lost=lost)
            except RequestError as exc:
                cause = f"{gone}; and " if gone is not None else f"output {name!r}: "
                if exc.code == UNAVAILABLE:  # its holder may come back (a coordinator restart): not gone yet
                    raise DataTransferError(f"{cause}{exc}", 503) from exc
                if exc.code != OUTPUT_LOST:
                    raise
                raise OutputGone(f"{cause}{exc}", GONE_STATUS) from exc
            if not grant.rebuilding:
                return grant
            log.info("fleetwire: output %r of plan %s was lost; waiting for plan %s, which makes it again",
                     name, self.id, grant.rebuilding)
            rebuild = await self._client.watch(grant.rebuilding)
            with contextlib.suppress(PlanError):  # a failed rebuild: the next answer says output_lost, and why
                await rebuild._outcome()
            lost = ""
        raise OutputGone(f"output {name!r} of plan {self.id}: still being made again after {LINEAGE_TRIES} tries",
                         GONE_STATUS)

    def _check_for(self, grant: Grant, name: str, check: OutputCheck) -> OutputCheck:
        """The digest a copy's bytes must have: a rebuild's own (as its grant says), else this plan's."""
        if grant.plan_id == self.id:
            check.restart()
            return check
        return OutputCheck(name, dict(grant.digests).get(name, ""))

    @staticmethod
    async def _fetch_to(transport: Transport, grant: Grant, name: str, path: str | os.PathLike[str],
                        check: OutputCheck) -> Path:
        if isinstance(transport, AutoTransport | RelayTransport):
            return await transport.fetch_to(grant, name, path, check)
        return await fetch_to(transport, grant, name, path, check)

    def _ready_grant(self, name: str) -> Grant | None:
        """The ``get`` ticket the succeeded attempt's ``data_ready`` brought, while it is valid a while more.

        Fetching with it saves asking the coordinator (``data_ticket``) for one. It names the
        outputs declared at submit (``outputs=``): for another output the worker answers 403 from
        the request's head, and the caller asks for a fresh ticket then (and on 401: expired). Never
        for an oversize result (``__result__``: not declared, so never in it).
        """
        if name == RESULT_OUTPUT:
            return None
        attempt = None
        for event in reversed(self._stream.events):
            if event.kind == "succeeded":
                attempt = event.attempt
            elif event.kind == "data_ready" and attempt is not None:
                data = event.data if isinstance(event.data, dict) else {}
                grant = Grant.from_event(event, lambda: self._client.data_ticket(self.id, "get"))  # for a 401
                expires_at = data.get("expires_at")
                if (grant.attempt != attempt or not grant.get_ticket or not isinstance(expires_at, int | float)
                        or expires_at - time.time() < READY_GRANT_MARGIN_S):
                    return None
                return grant
        return None

    def _changed_event(self) -> _Changed:
        """The ``_Changed`` the stream's next change sets (its ``waker``, made by the first waiter).

        One per generation: the stream sets it and drops it, so every waiter of this
        generation wakes and later waiters wait on the next one (any number of iterators). Most
        plans of a large batch are never waited on while they run: they never get one. The stream
        holds it, not this handle, so a plan makes no reference cycle.
        """
        stream = self._stream
        changed = stream.waker
        if type(changed) is not _Changed:
            changed = stream.waker = _Changed()
        return changed


class _Changed:
    """A stream's waker (``PlanStream.waker``): each waiter's future, all set at the stream's next change.

    What ``asyncio.Event`` did here, less what this use never needs (a set state to read, a waiter taken out of a
    deque, the loop looked up under a lock): ``wait`` is a future of the caller's own, awaited without a coroutine,
    so a cancelled waiter cancels only its own and the others still wake.
    """

    __slots__ = ("_futures",)

    def __init__(self) -> None:
        self._futures: list[asyncio.Future[None]] = []

    def wait(self) -> asyncio.Future[None]:
        """A future set at the stream's next change (await it)."""
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._futures.append(future)
        return future

    def set(self) -> None:
        for future in self._futures:
            if not future.done():
                future.set_result(None)


class _Gone(OutputGone):
    """A copy of an output found gone (404, ``output_gone``): the grant's ``plan_id`` and what was said."""

    def __init__(self, plan_id: str, exc: DataTransferError) -> None:
        super().__init__(str(exc), exc.status)
        self.plan_id = plan_id


def _after_refusal(exc: DataTransferError, grant: Grant, *, fresh: bool, delivered: bool) -> _Gone | None:
    """A fetch refused from its request's head: the copy found gone (404: ask for another, kept as the
    returned ``_Gone``) or None (401, 403: ask for a fresh ticket, unless this grant was fresh). Raises
    ``exc`` for anything else, or once bytes were delivered (a stream cannot restart under its reader)."""
    if exc.status not in (401, 403, GONE_STATUS) or delivered or (exc.status != GONE_STATUS and fresh):
        raise exc
    return _Gone(grant.plan_id, exc) if exc.status == GONE_STATUS else None


class _Tries:
    """The tries at fetching one output (:meth:`Plan.output_chunks`, :meth:`Plan.output_to`): the grant in hand
    first, then fresh ones (a rebuild's when the copy was found gone), at most :data:`LINEAGE_TRIES`."""

    def __init__(self, plan: Plan, name: str) -> None:
        self.plan = plan
        self.name = name
        self.check = plan._output_check(name)
        self.grant: Grant | None = plan._ready_grant(name)
        self.gone: _Gone | None = None
        self.fresh = False
        self.left = LINEAGE_TRIES

    async def next(self) -> Grant:
        """The grant to try next. Raises the last copy found gone, or OutputGone, once the tries are spent."""
        if self.left == 0:
            raise self.gone or OutputGone(
                f"output {self.name!r} of plan {self.plan.id}: no copy after {LINEAGE_TRIES} tries", 404)
        self.left -= 1
        self.fresh = self.grant is None  # a fresh grant refused (401, 403) is not asked for again
        if self.grant is None:
            self.grant = await self.plan._lineage_grant(self.name, self.gone)
            self.check = self.plan._check_for(self.grant, self.name, self.check)
        return self.grant

    def refused(self, exc: DataTransferError, *, delivered: bool) -> None:
        """The fetch with the current grant failed: ask for another (raises ``exc`` when it must not, see
        :func:`_after_refusal`)."""
        assert self.grant is not None
        self.gone = _after_refusal(exc, self.grant, fresh=self.fresh, delivered=delivered)
        self.grant = None


class _PlanEvents(AsyncIterator[Event]):
    """An iterator over one plan's buffered and future events."""

    def __init__(self, stream: PlanStream, changed: Callable[[], _Changed]) -> None:
        self._stream = stream
        self._changed = changed
        self._index = 0

    async def __anext__(self) -> Event:
        stream = self._stream
        while True:
            if self._index < len(stream.events):
                event = stream.events[self._index]
                self._index += 1
                return event
            if stream.final is not None:
                raise StopAsyncIteration
            if stream.lost is not None:
                raise stream.lost
            await self._changed().wait()
