"""The bounded ends of a cluster host's stop (coordinator/io/cluster/host.py): the tasks it cancels, the stores it
closes.

Rules:

* **Bounded.** Each task the stop cancels gets :data:`STOP_TASK_S` to end (:func:`cancelled`), each statement and
  the control store's close :data:`STOP_DB_S` (:func:`closed`); past them the stop goes on and logs what it left.
* **Off the loop, in the host's own threads.** No store is closed on the event loop: ``PgStore.close`` waits on its
  database (up to ~25 s against one that does not answer), which would stall every other session and shard on this
  loop meanwhile. Nor in the loop's default executor (``min(32, cpus + 4)`` threads, shared with every
  ``asyncio.to_thread``): a host with more shards than that closed its shards' stores in waves, each wave one close's
  wait long. They close in the host's :func:`store_closer`, a thread for each of its stores (its shards', the
  control connection's, a reconnect's), shut down at the end of the host's stop; a close that a store left after it
  (one still being made) runs in the loop's default executor.
* **Started in the host's own threads too.** A shard's start opens its store (a connection and the schema's check:
  round trips), loads its plans and hands its committer's threaded writer over, each in a thread; the control
  connection's reopens too. Those run in the host's :func:`store_opener` (a thread for each shard, and the control
  connection's), not the loop's default executor: against a slow database, a host winning more shards than that
  executor's threads started them in waves, each wave an open's (then a load's) wait long.
* **Nothing left open.** A store that a cancelled task was opening (:func:`opened`) or loading
  (:func:`close_after`), or that it was closing (:func:`close_left`), is closed once made (or let go of); that
  close is tracked in the host's set of leftovers until it is done, and the stop waits for them (:func:`settled`).
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Callable
from concurrent.futures import Executor, ThreadPoolExecutor
from typing import Any, TypeVar

import structlog

from coordinator.io.stores.postgres import PgStore
from coordinator.io.threads import in_thread

__all__ = [
    "CLOSER_THREADS",
    "OPENER_THREADS",
    "STOP_DB_S",
    "STOP_TASK_S",
    "cancelled",
    "close_after",
    "close_left",
    "closed",
    "opened",
    "settled",
    "store_closer",
    "store_opener",
]

log = structlog.get_logger(__name__)

STOP_TASK_S = 5.0  # the longest the stop waits for a task of its own to end once it is cancelled
# The longest the stop waits for one statement (a shard's release, the coordinator's row): past it the lease
# expires after its TTL instead (not the statement's 30 s timeout, once per shard).
STOP_DB_S = 5.0
CLOSER_THREADS = "fleetwire-store-close"  # the names of store_closer()'s threads
OPENER_THREADS = "fleetwire-store-open"  # the names of store_opener()'s threads


_Store = TypeVar("_Store", bound=PgStore)


def store_closer(shards: int) -> ThreadPoolExecutor:
    """The threads a cluster host closes its stores in: one for each shard it may serve, the control connection's
    and a reconnect's old one (module docstring, "Off the loop"); none is started before a close needs it."""
    return ThreadPoolExecutor(max_workers=shards + 2, thread_name_prefix=CLOSER_THREADS)


def store_opener(shards: int) -> ThreadPoolExecutor:
    """The threads a cluster host starts its stores in (module docstring, "Started in the host's own threads"): one
    for each shard it may serve (its start's open, load and writer hand-over run one after the other) and the
    control connection's reopen; none is started before a start needs it."""
    return ThreadPoolExecutor(max_workers=shards + 1, thread_name_prefix=OPENER_THREADS)


async def opened(
    make: Callable[[], _Store], left: set[asyncio.Future[None]], closer: Executor, opener: Executor
) -> _Store:
    """``make()`` (a store's constructor: it connects) in ``opener``. Cancelled meanwhile (a stop), the store it
    makes is closed once made, in ``closer``, instead of being left open with its connections and thread
    (an interrupted stop's unclosed connections, finalized later, are what broke ast.parse in the next test); that
    close is in ``left`` until it is done (the host's stop waits for it, :func:`settled`)."""
    opening = in_thread(opener, make)
    try:
        return await asyncio.shield(opening)
    except asyncio.CancelledError:
        done = opening.get_loop().create_future()
        opening.add_done_callback(functools.partial(_close_made, closed=done, closer=closer))
        _track(left, done)
        raise


async def close_left(store: PgStore, left: set[asyncio.Future[None]], closer: Executor) -> None:
    """Close ``store`` in ``closer``; cancelled meanwhile (a stop), the close goes on, in ``left`` until it
    is done (the host's stop waits for it; a failure is logged)."""
    done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    _close_into(store, done, closer)
    _track(left, done)
    await asyncio.shield(done)


def close_after(
    store: PgStore, loading: asyncio.Future[Any] | None, left: set[asyncio.Future[None]], closer: Executor
) -> None:
    """Close ``store`` in ``closer`` once ``loading`` (a core's loader thread reading it) is done; that
    close is in ``left`` until it is done."""
    done: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def close(loaded: asyncio.Future[Any] | None = None) -> None:
        if loaded is not None:
            _retrieved(loaded)  # the load's failure does not matter any more
        _close_into(store, done, closer)

    if loading is None or loading.done():
        close(loading)
    else:
        loading.add_done_callback(close)
    _track(left, done)


async def settled(left: set[asyncio.Future[None]], deadline: float) -> None:
    """Wait until ``deadline`` (:func:`time.monotonic`) for the closes in ``left``: the stores that the tasks
    the host's stop cancelled were opening or loading. One still opening or closing then is logged and
    left (it is closed once made: no store is used after the stop)."""
    if not left:
        return
    waited_s = max(0.0, deadline - time.monotonic())
    _, running = await asyncio.wait(list(left), timeout=waited_s)
    if running:
        log.error("a store still opening or closing after the stop; it is closed once made, without the stop",
                  stores=len(running), waited_s=round(waited_s, 3))  # fmt: skip


async def closed(store: PgStore, what: str, closer: Executor) -> None:
    """Close ``store`` in ``closer``, waiting at most :data:`STOP_DB_S`: past it the close goes on in its thread (its
    own waits are bounded) and the stop goes on; a failure is logged (the stop is ending anyway)."""
    closing = in_thread(closer, store.close)
    try:
        async with asyncio.timeout(STOP_DB_S):
            await asyncio.shield(closing)
    except TimeoutError:
        closing.add_done_callback(_retrieved)
        log.error("a store still closing; the stop goes on without it", store=what, waited_s=STOP_DB_S)
    except Exception as exc:
        log.warning("a store failed to close", store=what, error=f"{type(exc).__name__}: {exc}")


async def cancelled(tasks: list[asyncio.Task[Any]], what: str) -> None:
    """Wait up to :data:`STOP_TASK_S` for ``tasks``, which the host's stop cancelled; a failure is logged,
    and one still running is logged and left (the stop goes on: it is bounded)."""
    if not tasks:
        return
    done, running = await asyncio.wait(tasks, timeout=STOP_TASK_S)
    for task in done:
        failure = None if task.cancelled() else task.exception()
        if failure is not None:
            log.warning("a task failed before the stop", task=what, error=f"{type(failure).__name__}: {failure}")
    if running:
        log.error("still running after it was cancelled; the stop goes on without it", task=what,
                  running=len(running), waited_s=STOP_TASK_S)  # fmt: skip


def _close_made(opening: asyncio.Future[Any], *, closed: asyncio.Future[None], closer: Executor) -> None:
    """``opening`` made a store that nobody uses: close it (``closed`` is done once it is; at once when none was)."""
    if opening.cancelled() or opening.exception() is not None:
        closed.set_result(None)
    else:
        _close_into(opening.result(), closed, closer)


def _close_into(store: PgStore, closed: asyncio.Future[None], closer: Executor) -> None:
    """Close ``store`` in ``closer``; ``closed`` is done once it is (a failure is logged)."""

    def ended(closing: asyncio.Future[Any]) -> None:
        failure = None if closing.cancelled() else closing.exception()
        if failure is not None:
            log.warning("a store failed to close", store=store.description,
                        error=f"{type(failure).__name__}: {failure}")  # fmt: skip
        if not closed.done():
            closed.set_result(None)

    in_thread(closer, store.close, closed.get_loop()).add_done_callback(ended)


def _track(left: set[asyncio.Future[None]], closed: asyncio.Future[None]) -> None:
    left.add(closed)
    closed.add_done_callback(left.discard)


def _retrieved(done: asyncio.Future[Any]) -> None:
    if not done.cancelled():
        done.exception()  # retrieved: a close that failed after the stop went on is not "never retrieved"
