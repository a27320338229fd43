"""Where forecasts come from, and when to ask again: the part of a provider the I/O layer does not do.

``--carbon-forecast SOURCE`` names one of three kinds (:func:`parse_source`):

* a **file** (``PATH`` or ``file:PATH``): CSV ``zone,time,gco2_per_kwh`` or JSON rows. The driver
  looks at the file's ``(mtime, size)`` every ``interval_s`` and reads it again only when that
  changed (:meth:`ForecastFeed.file_changed`);
* a **command** (``cmd:COMMAND``): run every ``interval_s``; its stdout is the same CSV or JSON;
* an **HTTP** provider (``http://...``, ``https://...``): fetched every ``interval_s``; the JSON
  of the rows, Electricity Maps' forecast, or the GB Carbon Intensity API (coordinator/
  carbon_time/forecast.py, :func:`~coordinator.carbon_time.forecast.parse_json`).

Rows without a zone (a two-column CSV, the GB API) are the source's ``zone``.

:class:`ForecastFeed` is the pure half of a provider: it says when a fetch is due, takes what
came back (:meth:`ForecastFeed.fetched`) into the :class:`~coordinator.carbon_time.forecast.
ForecastBook`, and on a failure (:meth:`ForecastFeed.failed`: the command failed, the HTTP
status, a parse error) keeps the previous forecast and retries sooner than the interval, backing
off. A provider that keeps failing lets its forecast go stale, and stale forecasts make plans
run at once (coordinator/carbon_time/planner.py): a broken provider costs savings, never a deadline.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final, Literal

from coordinator.carbon_time.forecast import ForecastBook, ForecastError, parse_rows

__all__ = ["FeedOutcome", "ForecastFeed", "ForecastSource", "parse_source"]

SourceKind = Literal["file", "command", "http"]
MIN_INTERVAL_S: Final = 1.0
FIRST_RETRY_S: Final = 30.0


@dataclass(frozen=True, slots=True)
class ForecastSource:
    """A forecast provider: its kind, the path / command / URL, the zone of rows naming none, how often."""

    kind: SourceKind
    target: str
    zone: str = ""
    interval_s: float = 900.0


def parse_source(spec: str, zone: str = "", interval_s: float = 900.0) -> ForecastSource:
    """The source a ``--carbon-forecast`` value names; ValueError saying what is wrong with it."""
    text = spec.strip()
    if not text:
        raise ValueError("--carbon-forecast needs a file path, cmd:COMMAND or an http(s):// URL")
    if not interval_s >= MIN_INTERVAL_S:
        raise ValueError(f"the forecast interval must be at least {MIN_INTERVAL_S:g} s (got {interval_s})")
    kind: SourceKind
    if text.startswith(("http://", "https://")):
        kind, target = "http", text
    elif text.startswith(("cmd:", "command:")):
        kind, target = "command", text.partition(":")[2].strip()
    else:
        kind, target = "file", text.removeprefix("file:")
    if not target:
        raise ValueError(f"--carbon-forecast {spec!r} names no {kind}")
    return ForecastSource(kind, target, zone.strip().upper(), interval_s)


@dataclass(frozen=True, slots=True)
class FeedOutcome:
    """What one fetch did: the zones whose forecast changed, the rows read, or the error (then nothing changed)."""

    changed: frozenset[str] = frozenset()
    rows: int = 0
    error: str = ""


class ForecastFeed:
    """The schedule and the bookkeeping of one source; the driver runs the fetch itself.

    Drive it so: when :meth:`due` at ``now``, fetch (for a file: only if :meth:`file_changed`
    says so, else :meth:`unchanged`), then hand the text to :meth:`fetched` or the reason to
    :meth:`failed`; both return a :class:`FeedOutcome` and set :attr:`next_s`.
    """

    def __init__(self, source: ForecastSource, book: ForecastBook) -> None:
        self.source = source
        self.book = book
        self.next_s = float("-inf")  # due at once
        self.failures = 0
        self.last_error = ""
        self._stamp: object = None

    def due(self, now: float) -> bool:
        return now >= self.next_s

    def file_changed(self, stamp: object) -> bool:
        """Whether a file whose ``(mtime_ns, size)`` is ``stamp`` must be read again."""
        return stamp != self._stamp

    def unchanged(self, now: float) -> None:
        """The file was looked at and had not changed."""
        self.next_s = now + self.source.interval_s

    def fetched(self, text: str, now: float, stamp: object = None) -> FeedOutcome:
        """Take a fetch's output into the book; a parse error is a failure and keeps the previous forecast."""
        try:
            rows = parse_rows(text, self.source.zone)
            if not rows:
                raise ForecastError("", "no rows")
            changed = self.book.update(rows, now)
        except ForecastError as exc:
            return self.failed(f"{self._name()}: {exc}", now)
        self._stamp = stamp
        self.failures = 0
        self.last_error = ""
        self.next_s = now + self.source.interval_s
        return FeedOutcome(frozenset(changed), len(rows))

    def failed(self, reason: str, now: float) -> FeedOutcome:
        """A fetch failed: keep what the book has, retry after 30 s, 60 s, ... up to the interval."""
        self.failures += 1
        self.last_error = reason
        self.next_s = now + min(self.source.interval_s, FIRST_RETRY_S * 2 ** min(self.failures - 1, 20))
        return FeedOutcome(error=reason)

    def _name(self) -> str:
        return f"carbon forecast {self.source.kind} {self.source.target!r}"
