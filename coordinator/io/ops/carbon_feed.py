"""The ``--carbon-forecast`` driver: fetches a forecast source on its schedule and tells the core.

The pure half is coordinator/carbon_time/sources.py's :class:`~coordinator.carbon_time.ForecastFeed`
(when a fetch is due, what a fetch or a failure does to the book, the back-off); this module does
the I/O, never on the event loop's critical path:

* a **file** is looked at (``os.stat`` off the loop) every interval and read again only when its
  ``(mtime, size)`` changed;
* a **command** (``cmd:COMMAND``) runs through the shell as a subprocess (in a session of its own) every
  interval; its stdout is the rows. Past :data:`FETCH_TIMEOUT_S` its process group is killed and the
  fetch counts as failed;
* an **HTTP** provider is fetched in a daemon thread of its own (``urllib``, :data:`FETCH_TIMEOUT_S`), not
  the loop's executor, whose shutdown waits for its threads: a provider that never answers must not hold
  up the coordinator's stop. A status other than 2xx is a failure naming it. A provider that needs a
  token is a command (``cmd:curl -H ...``).

After each fetch the book's changed zones go to ``Coordinator.forecast_changed`` (the plans that may
run there are decided again) and the driver's ``flush`` sends what that decided. A failed fetch keeps
the previous forecast and is logged (warning) and counted (``carbon_forecast_failures``); the feed
retries sooner, backing off to the interval. A provider that keeps failing lets the forecast go stale
(``ForecastBook.max_age_s``) and held plans are then placed: never a missed deadline.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import TYPE_CHECKING, Final

import structlog

from coordinator.carbon_time import FeedOutcome, ForecastFeed, ForecastSource
from wireio.spawn import kill_group, kill_session, started

if TYPE_CHECKING:
    from coordinator.core import Coordinator

__all__ = ["FETCH_TIMEOUT_S", "CarbonFeed"]

log = structlog.get_logger(__name__)

FETCH_TIMEOUT_S: Final = 30.0  # a command or HTTP fetch that takes longer fails
MAX_BYTES: Final = 16 << 20  # a forecast larger than this is refused (a year of half-hours for 100 zones is ~10 MiB)


class CarbonFeed:
    """Runs one forecast source for a core (module docstring).

    Args:
        source: the parsed ``--carbon-forecast``.
        core: the core whose ``carbon.book`` it fills.
        flush: sends the effects of a re-plan (the server's ``CoreDriver.flush``).
        wall: Unix time (the feed and the book count in it); ``clock``: the core's monotonic ``now``.
        timeout_s: a command or HTTP fetch taking longer fails.
    """

    def __init__(
        self,
        source: ForecastSource,
        core: Coordinator,
        flush: Callable[[], None],
        *,
        wall: Callable[[], float] = time.time,
        clock: Callable[[], float] = time.monotonic,
        timeout_s: float = FETCH_TIMEOUT_S,
    ) -> None:
        self.source = source
        self.feed = ForecastFeed(source, core.carbon.book)
        self._core = core
        self._flush = flush
        self._wall = wall
        self._clock = clock
        self.timeout_s = timeout_s
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def _run(self) -> None:
        while True:
            now = self._wall()
            if self.feed.due(now):
                try:
                    await self.fetch_once()
                except Exception as exc:  # never let the feed die: its forecast goes stale, plans are placed
                    self._tell(self.feed.failed(f"{type(exc).__name__}: {exc}", self._wall()))
            await asyncio.sleep(max(0.05, min(self.feed.next_s - self._wall(), self.source.interval_s)))

    async def fetch_once(self) -> FeedOutcome:
        """Fetch the source now, merge what came back, tell the core; what it did."""
        source, feed = self.source, self.feed
        if source.kind == "file":
            try:
                stamp, text = await asyncio.to_thread(_read_if_changed, source.target, feed)
            except OSError as exc:
                return self._tell(feed.failed(f"carbon forecast file {source.target!r}: {exc.strerror or exc}",
                                              self._wall()))  # fmt: skip
            if text is None:
                feed.unchanged(self._wall())
                return FeedOutcome()
            return self._tell(feed.fetched(text, self._wall(), stamp))
        if source.kind == "command":
            body, error = await _run_command(source.target, self.timeout_s)
        else:
            body, error = await _in_daemon_thread(_get, source.target, self.timeout_s)
        if error:
            return self._tell(feed.failed(error, self._wall()))
        return self._tell(feed.fetched(body, self._wall()))

    def _tell(self, outcome: FeedOutcome) -> FeedOutcome:
        counters = self._core.counters
        if outcome.error:
            counters["carbon_forecast_failures"] = counters.get("carbon_forecast_failures", 0) + 1
            log.warning("carbon forecast not updated; the previous one stays", error=outcome.error,
                        retry_in_s=round(self.feed.next_s - self._wall(), 1))  # fmt: skip
        else:
            counters["carbon_forecast_fetches"] = counters.get("carbon_forecast_fetches", 0) + 1
            if outcome.changed:
                log.info("carbon forecast updated", zones=sorted(outcome.changed), rows=outcome.rows)
                self._core.forecast_changed(outcome.changed, self._clock())
                self._flush()
        return outcome


def _read_if_changed(path: str, feed: ForecastFeed) -> tuple[object, str | None]:
    """(the file's stamp, its text when it changed since the last read, else None); in a thread."""
    info = os.stat(path)
    stamp = (info.st_mtime_ns, info.st_size)
    if not feed.file_changed(stamp):
        return stamp, None
    if info.st_size > MAX_BYTES:
        raise OSError(0, f"{info.st_size} bytes, more than {MAX_BYTES}")
    with open(path, encoding="utf-8") as f:
        return stamp, f.read()


async def _run_command(command: str, timeout_s: float) -> tuple[str, str]:
    """(stdout, "") of a command that exited 0, else ("", why)."""
    proc = await _start_shell(command)
    try:  # not asyncio.wait_for: on 3.11 it loses the close's cancel that comes as the command ends (the feed's
        async with asyncio.timeout(timeout_s):  # loop then went on and close() waited for it for ever)
            out, err = await proc.communicate()
    except TimeoutError:
        kill_group(proc.pid)
        await proc.communicate()  # the pipes are drained and closed: their writers are dead
        return "", f"carbon forecast command {command!r} took more than {timeout_s:g} s; killed"
    except asyncio.CancelledError:  # the coordinator stops: the command does not outlive it
        await kill_session(proc)
        raise
    if proc.returncode != 0:
        tail = err.decode(errors="replace").strip()[-300:]
        return "", f"carbon forecast command {command!r} exited {proc.returncode}" + (f": {tail}" if tail else "")
    if len(out) > MAX_BYTES:
        return "", f"carbon forecast command {command!r} printed more than {MAX_BYTES} bytes"
    return out.decode(errors="replace"), ""


async def _start_shell(command: str) -> asyncio.subprocess.Process:
    """The command's shell started in a session of its own; a cancel while it starts kills that session.

    Cancelled inside ``create_subprocess_shell``, asyncio (3.11) SIGKILLs the shell's pid alone: what the shell had
    started (``sh -c``'s child, a pipeline) ran on past the feed's close (CI on d0d9d30; wireio/spawn.py).
    """
    start = asyncio.create_subprocess_shell(
        command,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        start_new_session=True,  # a timeout kills what the shell started too (curl, a script's children)
    )
    return await started(start, kill_session)


async def _in_daemon_thread(
    fetch: Callable[[str, float], tuple[str, str]], url: str, timeout_s: float
) -> tuple[str, str]:
    """``fetch(url, timeout_s)`` in a daemon thread; cancelling the caller abandons the thread to its timeout."""
    loop = asyncio.get_running_loop()
    answer: asyncio.Future[tuple[str, str]] = loop.create_future()

    def deliver(result: tuple[str, str]) -> None:
        if not answer.done():
            answer.set_result(result)

    def run() -> None:
        try:
            result = fetch(url, timeout_s)
        except Exception as exc:  # told to the caller as a failed fetch
            result = ("", f"carbon forecast {url}: {type(exc).__name__}: {exc}")
        with contextlib.suppress(RuntimeError):  # the loop closed meanwhile: nobody waits
            loop.call_soon_threadsafe(deliver, result)

    threading.Thread(target=run, name="carbon-forecast-http", daemon=True).start()
    return await answer


def _get(url: str, timeout_s: float) -> tuple[str, str]:
    """(body, "") of a 2xx answer, else ("", why); in a thread."""
    request = urllib.request.Request(url, headers={"Accept": "application/json, text/csv"})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as answer:  # the operator's own URL
            body = answer.read(MAX_BYTES + 1)
    except urllib.error.HTTPError as exc:
        return "", f"carbon forecast {url}: HTTP {exc.code} {exc.reason}"
    except (urllib.error.URLError, OSError) as exc:
        return "", f"carbon forecast {url}: {getattr(exc, 'reason', exc)}"
    if len(body) > MAX_BYTES:
        return "", f"carbon forecast {url}: more than {MAX_BYTES} bytes"
    return body.decode(errors="replace"), ""
