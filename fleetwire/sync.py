"""``SyncClient``: the same verbs as ``Client``, synchronous, for scripts and notebooks.

Usage::

    with SyncClient("ws://127.0.0.1:8765", token=token) as client:
        plan = client.submit("echo", args={"x": 1})
        for event in plan.events():
            print(event.kind, event.data)
        print(plan.result(timeout=60))

The ``Client`` runs on a private event loop in a daemon thread; every call hands a
coroutine to that loop (``asyncio.run_coroutine_threadsafe``) and waits for it. The
caller's thread never needs a loop of its own, and one already running there (Jupyter,
IPython) is never touched, so the same code works in a script and in a notebook.
Calls may come from several threads at once.
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import AsyncIterator, Coroutine, Iterable, Iterator
from pathlib import Path
from types import TracebackType
from typing import Any, Literal, TypeVar, Unpack

from fleetwire.client import DEFAULT_MAX_FRAME_BYTES, Client
from fleetwire.options import SubmitManyOptions, SubmitOptions
from fleetwire.plan import Plan
from protocol.codec import Encoding
from protocol.messages import Event, OutputRef, PlanInfo, Plans, PlanStateName, Receipt, Usage, Workers

__all__ = ["SyncClient", "SyncPlan"]

T = TypeVar("T")


class SyncClient:
    """A blocking session with a fleetwire coordinator; connects on construction.

    Takes the same arguments as ``Client``. Use as a context manager or call ``close()``;
    a client never closed is dropped with the process (its thread is a daemon).

    Raises:
        AuthError: the coordinator refused the token (HTTP 401/403).
        FleetwireConnectionError: the coordinator is unreachable.
    """

    def __init__(
        self,
        url: str | None = None,
        *,
        token: str | None = None,
        encoding: Encoding = "msgpack",
        open_timeout_s: float | None = 10.0,
        max_frame_bytes: int | None = DEFAULT_MAX_FRAME_BYTES,
        ca_file: str | None = None,
    ) -> None:
        client = Client(
            url, token=token, encoding=encoding, open_timeout_s=open_timeout_s, max_frame_bytes=max_frame_bytes,
            ca_file=ca_file,
        )
        self.url = client.url
        self._client = client
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="fleetwire-sync-client", daemon=True)
        self._thread.start()
        self._closed = False
        try:
            self._call(client.connect())
        except BaseException:
            self._stop_loop()
            raise

    def __repr__(self) -> str:
        return f"<SyncClient {self.url}{' closed' if self._closed else ''}>"

    def __enter__(self) -> SyncClient:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def close(self) -> None:
        """Close the session and stop the private loop. Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            self._call(self._client.close())
        finally:
            self._stop_loop()

    # ---- the verbs (see ``Client`` for their arguments and errors)

    def submit(self, op: str, args: Any = None, **options: Unpack[SubmitOptions]) -> SyncPlan:
        """Submit a plan; takes the keyword arguments of ``Client.submit`` (tags, requirements,
        priority, timeout_s, max_attempts, retries, plan_id, hints, session_key, policy, inputs, outputs,
        relay, resources, after, deterministic, preemptible, deadline_s, deadline_at, expected_run_s)."""
        return SyncPlan(self, self._call(self._client.submit(op, args, **options)))

    def submit_many(self, op: str, args: Iterable[Any], **options: Unpack[SubmitManyOptions]) -> list[SyncPlan]:
        """Submit one plan per item of ``args`` in a few frames; takes the keyword arguments of
        ``Client.submit_many`` (tags, requirements, priority, timeout_s, max_attempts, plan_ids)."""
        plans = self._call(self._client.submit_many(op, args, **options))
        return [SyncPlan(self, plan) for plan in plans]

    def watch(self, plan_id: str, *, from_seq: int = 0) -> SyncPlan:
        """Subscribe to an existing plan; see ``Client.watch``."""
        return SyncPlan(self, self._call(self._client.watch(plan_id, from_seq=from_seq)))

    def get_plan(self, plan_id: str) -> PlanInfo:
        """The plan's current record; see ``Client.get_plan``."""
        return self._call(self._client.get_plan(plan_id))

    def cancel(self, plan_id: str, *, with_dependants: bool = False) -> PlanInfo:
        """Cancel a plan; see ``Client.cancel``."""
        return self._call(self._client.cancel(plan_id, with_dependants=with_dependants))

    def release(self, plan_id: str) -> PlanInfo:
        """Place a plan held for a greener hour now; see ``Client.release``."""
        return self._call(self._client.release(plan_id))

    def usage(self, *, by: Literal["principal", "team"] = "principal", since: float = 0.0) -> Usage:
        """Usage totals from the coordinator's ledger; see ``Client.usage``."""
        return self._call(self._client.usage(by=by, since=since))

    def workers(self) -> Workers:
        """The worker registry and cluster summary; see ``Client.workers``."""
        return self._call(self._client.workers())

    def plans(self, *, states: Iterable[str] = (), limit: int = 200) -> Plans:
        """Plans this client may see, the queue and counts per state; see ``Client.plans``."""
        return self._call(self._client.plans(states=states, limit=limit))

    def drain(self, worker_id: str, *, deadline_s: float | None = None) -> None:
        """Stop placing plans on a worker (admin token); see ``Client.drain``."""
        self._call(self._client.drain(worker_id, deadline_s=deadline_s))

    def undrain(self, worker_id: str) -> None:
        """Place plans on a drained worker again (admin token); see ``Client.undrain``."""
        self._call(self._client.undrain(worker_id))

    # ---- the bridge to the loop thread

    def _call(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run ``coro`` on the private loop and wait up to ``timeout`` seconds for it."""
        if threading.current_thread() is self._thread:
            coro.close()
            raise RuntimeError("SyncClient methods cannot be called from its own event loop; use Client there")
        if self._loop.is_closed():
            coro.close()
            raise RuntimeError("this SyncClient is closed")
        future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            return future.result(timeout)
        except TimeoutError:
            if future.done():
                raise  # the coroutine's own TimeoutError
            future.cancel()
            raise TimeoutError(f"no answer within {timeout} s") from None
        except BaseException:
            future.cancel()  # e.g. KeyboardInterrupt in a notebook: stop the wait on the loop too
            raise

    def _stop_loop(self) -> None:
        if self._loop.is_closed():
            return
        self._call(_cancel_other_tasks())
        self._call(self._loop.shutdown_asyncgens())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()


class SyncPlan:
    """A ``Plan`` seen from a ``SyncClient``: ``events()`` is a plain iterator."""

    def __init__(self, client: SyncClient, plan: Plan) -> None:
        self._client = client
        self._plan = plan

    def __repr__(self) -> str:
        return repr(self._plan).replace("<Plan", "<SyncPlan", 1)

    @property
    def id(self) -> str:
        """The plan id."""
        return self._plan.id

    @property
    def state(self) -> PlanStateName | None:
        """The state the plan's latest lifecycle event implies."""
        return self._plan.state

    @property
    def receipt(self) -> Receipt | None:
        """The plan's energy and carbon receipt once it ended (see ``Plan.receipt``)."""
        return self._plan.receipt

    @property
    def duplicate(self) -> bool:
        """Whether ``submit`` found an existing plan with the given ``plan_id``."""
        return self._plan.duplicate

    @property
    def last_seq(self) -> int:
        """The ``seq`` of the latest event received."""
        return self._plan.last_seq

    def done(self) -> bool:
        """Whether the plan reached a terminal state."""
        return self._plan.done()

    def events(self, timeout: float | None = None) -> Iterator[Event]:
        """The plan's events in ``seq`` order, ending after the terminal event.

        Args:
            timeout: the longest wait for any one event, in seconds (None: no limit).
        """
        events = self._plan.events()
        while True:
            event = self._client._call(_next_or_none(events), timeout)
            if event is None:
                return
            yield event

    def result(self, timeout: float | None = None) -> Any:
        """Wait up to ``timeout`` seconds for the plan to end; see ``Plan.result``."""
        return self._client._call(self._plan.result(), timeout)

    def cancel(self, *, with_dependants: bool = False) -> PlanInfo:
        """Cancel the plan; see ``Client.cancel``."""
        return self._client.cancel(self._plan.id, with_dependants=with_dependants)

    def ref(self, name: str) -> OutputRef:
        """Its output ``name``, as another plan's input; see ``Plan.ref``."""
        return self._plan.ref(name)

    def output(self, name: str, timeout: float | None = None) -> bytes:
        """An output's bytes once the plan succeeded; see ``Plan.output``."""
        return self._client._call(self._plan.output(name), timeout)

    def output_to(self, name: str, path: str | os.PathLike[str], timeout: float | None = None) -> Path:
        """Write an output to ``path`` in chunks; see ``Plan.output_to``."""
        return self._client._call(self._plan.output_to(name, path), timeout)

    def output_chunks(self, name: str, timeout: float | None = None) -> Iterator[bytes]:
        """An output's bytes in chunks; ``timeout`` bounds the wait for each chunk."""
        chunks = self._plan.output_chunks(name)
        while True:
            chunk = self._client._call(_next_chunk(chunks), timeout)
            if chunk is None:
                return
            yield chunk


async def _next_chunk(chunks: AsyncIterator[bytes]) -> bytes | None:
    try:
        return await anext(chunks)
    except StopAsyncIteration:
        return None


async def _next_or_none(events: AsyncIterator[Event]) -> Event | None:
    # StopAsyncIteration cannot cross a concurrent future, so the end is None.
    try:
        return await anext(events)
    except StopAsyncIteration:
        return None


async def _cancel_other_tasks() -> None:
    current = asyncio.current_task()
    tasks = [task for task in asyncio.all_tasks() if task is not current]
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
