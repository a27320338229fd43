"""Grid carbon-intensity forecasts per zone: the rows, the step function, the latest known values.

What it owns:

* **Rows** (:class:`ForecastRow`): ``zone, time, gco2_per_kwh``, parsed from the CSV a
  ``--carbon-forecast`` file holds (:func:`parse_csv`) or from the JSON a command or HTTP
  provider returns (:func:`parse_json`: rows, or the shapes of two common grid-intensity APIs).
  Times are ISO 8601; one without an offset is UTC. Bad input raises :class:`ForecastError`
  naming the line (or JSON path) and the field.
* **A step function per zone** (:class:`StepForecast`): each row's value holds from its time
  until the next row's; the last row holds for as long as the step before it (one hour when it
  is alone). That end is the forecast's *horizon*. Beyond it the forecast knows nothing, and
  the planner costs that time at the forecast's mean (:attr:`StepForecast.fill_g_per_kwh`),
  which is the same for every candidate start, so only the known part tells them apart.
* **The latest known values** (:class:`ForecastBook`): a newer forecast for a zone replaces the
  older one from its first row on and keeps what the older one said before that, so the book
  also holds the recent past (the values the accounting rule reads, coordinator/carbon_time/
  accounting.py); history older than ``retain_s`` is dropped. A zone's forecast is *usable* at
  ``now`` when it has a value for ``now`` and was received within ``max_age_s``; otherwise
  :meth:`ForecastBook.usable` says why not, and the planner runs the plan at once.

Pure: no clock, no I/O; times are Unix seconds (UTC), handed in.
"""

from __future__ import annotations

import bisect
import itertools
import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Final

__all__ = [
    "MAX_G_PER_KWH", "ForecastBook", "ForecastError", "ForecastRow", "StepForecast", "format_utc", "parse_csv",
    "parse_json", "parse_rows", "parse_time",
]

MAX_G_PER_KWH: Final = 5000.0  # no grid emits more (lignite is about 1100): a unit mistake, refused
LONE_STEP_S: Final = 3600.0  # how long a zone's only row holds
DAY_S: Final = 86400.0
CSV_HEADER: Final = ("zone", "time", "gco2_per_kwh")


class ForecastError(ValueError):
    """Forecast input that cannot be used, with where it went wrong.

    Attributes:
        where: ``line N`` of a CSV or a JSON path like ``$.forecast[3].datetime``; "" for the whole input.
    """

    def __init__(self, where: str, message: str) -> None:
        super().__init__(f"{where}: {message}" if where else message)
        self.where = where


@dataclass(frozen=True, slots=True)
class ForecastRow:
    """One forecast value: ``g_per_kwh`` in ``zone`` from ``time_s`` (Unix seconds) until the next row."""

    zone: str
    time_s: float
    g_per_kwh: float


def parse_time(text: str, where: str = "") -> float:
    """Unix seconds of an ISO 8601 time (``2020-06-01T14:30:00Z``, ``+02:00``, or no offset: UTC)."""
    try:
        stamp = datetime.fromisoformat(text.strip())
    except ValueError:
        raise ForecastError(where, f"time {text!r} is not an ISO 8601 time (e.g. 2020-06-01T14:30:00Z)") from None
    if stamp.tzinfo is None:
        stamp = stamp.replace(tzinfo=UTC)
    return stamp.timestamp()


def format_utc(time_s: float) -> str:
    """``2020-06-01T14:30:00Z``: a time as the rows write it."""
    return datetime.fromtimestamp(time_s, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _intensity(value: object, where: str) -> float:
    try:
        grams = float(value)  # type: ignore[arg-type] # a str or a JSON number; anything else is reported below
    except (TypeError, ValueError):
        raise ForecastError(where, f"gco2_per_kwh {value!r} is not a number") from None
    if not 0 <= grams <= MAX_G_PER_KWH:  # NaN fails both comparisons
        raise ForecastError(where, f"gco2_per_kwh {value!r} must be between 0 and {MAX_G_PER_KWH:g}")
    return grams


def _zone(value: object, where: str) -> str:
    if not isinstance(value, str) or not value.strip() or len(value) > 64:
        raise ForecastError(where, f"zone {value!r} must be a grid zone name of 1 to 64 characters (e.g. DE, FR)")
    return value.strip().upper()


def parse_csv(text: str, default_zone: str = "") -> list[ForecastRow]:
    """Rows of a ``zone,time,gco2_per_kwh`` CSV (a header line is optional; blank and ``#`` lines are skipped).

    With ``default_zone``, two-column lines ``time,gco2_per_kwh`` are read as that zone's (the
    shape of the Let's Wait Awhile data set's ``Time,Carbon Intensity`` files), and their header
    is any line whose second field is not a number.
    """
    rows: list[ForecastRow] = []
    for number, line in enumerate(text.splitlines(), start=1):
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            continue
        fields = [field.strip() for field in stripped.split(",")]
        where = f"line {number}"
        if number == 1 or not rows:
            if tuple(f.lower() for f in fields) == CSV_HEADER:
                continue
            if default_zone and len(fields) == 2 and not _is_number(fields[1]):
                continue
        if len(fields) == 3:
            zone, time_text, value = fields
        elif len(fields) == 2 and default_zone:
            zone, (time_text, value) = default_zone, fields
        else:
            raise ForecastError(where, f"expected 3 fields zone,time,gco2_per_kwh, got {len(fields)}: "
                                       f"{stripped[:80]!r}")
        rows.append(ForecastRow(_zone(zone, where), parse_time(time_text, where), _intensity(value, where)))
    return rows


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def parse_json(text: str, default_zone: str = "") -> list[ForecastRow]:
    """Rows of a provider's JSON answer, in one of three shapes.

    * rows: ``[{"zone": "DE", "time": "...", "gco2_per_kwh": 302}, ...]`` (or ``{"rows": [...]}``);
    * Electricity Maps' forecast and history: ``{"zone": "DE", "forecast": [{"datetime": "...",
      "carbonIntensity": 302}, ...]}`` (``history`` in place of ``forecast`` too);
    * the GB Carbon Intensity API: ``{"data": [{"from": "...", "intensity": {"forecast": 266,
      "actual": 263}}, ...]}``, zone ``default_zone``; ``actual`` where it is known, else ``forecast``.
    """
    try:
        doc = json.loads(text)
    except ValueError as exc:
        raise ForecastError("", f"not JSON: {exc}") from None
    if isinstance(doc, list):
        return _json_rows(doc, "$", default_zone)
    if not isinstance(doc, dict):
        raise ForecastError("$", "expected a list of rows or an object")
    if "rows" in doc:
        return _json_rows(_list(doc["rows"], "$.rows"), "$.rows", default_zone)
    for key in ("forecast", "history"):
        if key in doc:
            zone = _zone(doc.get("zone", default_zone), "$.zone")
            rows = []
            for i, item in enumerate(_list(doc[key], f"$.{key}")):
                where = f"$.{key}[{i}]"
                time_s = parse_time(_str(_field(item, "datetime", where), f"{where}.datetime"), f"{where}.datetime")
                rows.append(ForecastRow(zone, time_s, _intensity(_field(item, "carbonIntensity", where),
                                                                 f"{where}.carbonIntensity")))
            return rows
    if "data" in doc:
        zone = _zone(default_zone, "$ (the GB API names no zone: give the source one)")
        rows = []
        for i, item in enumerate(_list(doc["data"], "$.data")):
            where = f"$.data[{i}]"
            intensity = _field(item, "intensity", where)
            if not isinstance(intensity, dict):
                raise ForecastError(f"{where}.intensity", "expected an object with forecast and actual")
            value = intensity.get("actual")
            if value is None:
                value = _field(intensity, "forecast", f"{where}.intensity")
            time_s = parse_time(_str(_field(item, "from", where), f"{where}.from"), f"{where}.from")
            rows.append(ForecastRow(zone, time_s, _intensity(value, f"{where}.intensity")))
        return rows
    raise ForecastError("$", "expected rows, {'forecast': [...]} (Electricity Maps) or {'data': [...]} (GB API)")


def _json_rows(items: list[Any], path: str, default_zone: str) -> list[ForecastRow]:
    rows = []
    for i, item in enumerate(items):
        where = f"{path}[{i}]"
        zone = item.get("zone", default_zone) if isinstance(item, dict) else None
        rows.append(ForecastRow(_zone(zone, f"{where}.zone"),
                                parse_time(_str(_field(item, "time", where), f"{where}.time"), f"{where}.time"),
                                _intensity(_field(item, "gco2_per_kwh", where), f"{where}.gco2_per_kwh")))
    return rows


def _list(value: object, where: str) -> list[Any]:
    if not isinstance(value, list):
        raise ForecastError(where, "expected a list")
    return value


def _field(item: object, name: str, where: str) -> object:
    if not isinstance(item, dict) or name not in item:
        raise ForecastError(where, f"missing field {name!r}")
    return item[name]


def _str(value: object, where: str) -> str:
    if not isinstance(value, str):
        raise ForecastError(where, f"expected an ISO 8601 time string, got {value!r}")
    return value


def parse_rows(text: str, default_zone: str = "") -> list[ForecastRow]:
    """Rows of a source's output, JSON (it starts with ``[`` or ``{``) or CSV."""
    return parse_json(text, default_zone) if text.lstrip()[:1] in ("[", "{") else parse_csv(text, default_zone)


class StepForecast:
    """One zone's intensity as a step function of time, with its running integral.

    ``times`` has one more entry than ``values``: step ``j`` holds ``values[j]`` over
    ``[times[j], times[j + 1])``. Lookups are O(log steps).
    """

    __slots__ = ("_cum", "_last_day", "fill_g_per_kwh", "times", "values")
    repeat_last_day = True

    def __init__(self, times: Sequence[float], values: Sequence[float]) -> None:
        if len(times) != len(values) + 1 or not values:
            raise ValueError("a step forecast needs n values and n + 1 step bounds")
        self.times = list(times)
        self.values = list(values)
        cum = [0.0]
        for j, value in enumerate(self.values):
            cum.append(cum[-1] + value * (self.times[j + 1] - self.times[j]))
        self._cum = cum
        span = self.times[-1] - self.times[0]
        self.fill_g_per_kwh = cum[-1] / span if span > 0 else self.values[0]
        self._last_day = 0.0
        if span >= DAY_S:
            self._last_day = cum[-1] - self._cum_at(self.times[-1] - DAY_S)
            if self.repeat_last_day:
                self.fill_g_per_kwh = self._last_day / DAY_S

    @classmethod
    def of_points(cls, points: Sequence[tuple[float, float]]) -> StepForecast:
        """The step function of ``(time_s, g_per_kwh)`` points sorted by time, no time twice."""
        times = [t for t, _ in points]
        last_step = times[-1] - times[-2] if len(times) > 1 else LONE_STEP_S
        return cls([*times, times[-1] + last_step], [v for _, v in points])

    @property
    def start_s(self) -> float:
        return self.times[0]

    @property
    def end_s(self) -> float:
        """The horizon: the end of the last step."""
        return self.times[-1]

    def value_at(self, time_s: float) -> float | None:
        """The value at ``time_s``; None outside the forecast."""
        if not self.times[0] <= time_s < self.times[-1]:
            return None
        return self.values[bisect.bisect_right(self.times, time_s) - 1]

    def _cum_at(self, time_s: float) -> float:
        times = self.times
        if time_s <= times[0]:
            return self.fill_g_per_kwh * (time_s - times[0])
        if time_s < times[-1]:
            j = bisect.bisect_right(times, time_s) - 1
            return self._cum[j] + self.values[j] * (time_s - times[j])
        beyond = time_s - times[-1]
        if times[-1] - times[0] < DAY_S or not self.repeat_last_day:
            return self._cum[-1] + self.fill_g_per_kwh * beyond
        days, rest = divmod(beyond, DAY_S)  # the last day again, and again
        last_day = times[-1] - DAY_S
        return self._cum[-1] + days * self._last_day + self._cum_at(last_day + rest) - self._cum_at(last_day)

    def integral(self, start_s: float, end_s: float) -> float:
        """∫ intensity dt over ``[start_s, end_s]`` in g/kWh·s; time outside the forecast counts at its mean."""
        return self._cum_at(end_s) - self._cum_at(start_s)

    def mean(self, start_s: float, end_s: float) -> float:
        """The mean intensity over ``[start_s, end_s]`` (the value at ``start_s`` for an empty interval)."""
        if end_s <= start_s:
            value = self.value_at(start_s)
            return self.fill_g_per_kwh if value is None else value
        return self.integral(start_s, end_s) / (end_s - start_s)

    def points(self) -> list[tuple[float, float]]:
        return list(zip(self.times, self.values, strict=False))


@dataclass(slots=True)
class _Zone:
    forecast: StepForecast
    received_s: float


class ForecastBook:
    """The latest known intensity of every zone: newer forecasts over older ones, with recent history.

    Args:
        max_age_s: a forecast received longer ago than this is stale (the provider stopped).
        retain_s: how much past a zone's step function keeps (for the accounting rule).
    """

    def __init__(self, max_age_s: float = 24 * 3600.0, retain_s: float = 8 * 86400.0) -> None:
        self.max_age_s = max_age_s
        self.retain_s = retain_s
        self._zones: dict[str, _Zone] = {}

    def zones(self) -> list[str]:
        return sorted(self._zones)

    def forecast(self, zone: str) -> StepForecast | None:
        entry = self._zones.get(zone)
        return entry.forecast if entry else None

    def update(self, rows: Iterable[ForecastRow], now: float) -> set[str]:
        """Merge ``rows`` received at ``now``; the zones whose values changed.

        Per zone the new rows replace every older value from their first time on. Two rows of
        one zone at the same time are refused (:class:`ForecastError`), and nothing is merged.
        """
        by_zone: dict[str, list[tuple[float, float]]] = {}
        for row in rows:
            by_zone.setdefault(row.zone, []).append((row.time_s, row.g_per_kwh))
        merged: dict[str, StepForecast] = {}
        for zone, points in by_zone.items():
            points.sort()
            for (t0, _), (t1, _) in itertools.pairwise(points):
                if t0 == t1:
                    raise ForecastError("", f"zone {zone} has two values at {format_utc(t0)}")
            old = self._zones.get(zone)
            if old is not None:
                points = self._kept(old.forecast, points[0][0], now - self.retain_s) + points
            merged[zone] = StepForecast.of_points(points)
        changed = set()
        for zone, forecast in merged.items():
            old = self._zones.get(zone)
            if old is None or old.forecast.points() != forecast.points():
                changed.add(zone)
            self._zones[zone] = _Zone(forecast, now)
        return changed

    @staticmethod
    def _kept(old: StepForecast, first_s: float, keep_from_s: float) -> list[tuple[float, float]]:
        """The old steps before ``first_s`` and not wholly before ``keep_from_s`` (the first cut at it)."""
        kept = []
        for j, value in enumerate(old.values):
            start, end = old.times[j], old.times[j + 1]
            if start >= first_s:
                break
            if end > keep_from_s and max(start, keep_from_s) < first_s:
                kept.append((max(start, keep_from_s), value))
        return kept

    def usable(self, zone: str, now: float) -> tuple[StepForecast | None, str]:
        """The zone's forecast when it can be planned with at ``now``, else None and why not."""
        entry = self._zones.get(zone)
        if entry is None:
            return None, f"no carbon forecast for zone {zone or '(none)'}"
        age_s = now - entry.received_s
        if age_s > self.max_age_s:
            return None, (f"the carbon forecast for {zone} is stale: received {age_s / 3600:.1f} h ago "
                          f"(limit {self.max_age_s / 3600:g} h)")
        forecast = entry.forecast
        if forecast.value_at(now) is None:
            if now >= forecast.end_s:
                return None, f"the carbon forecast for {zone} ended at {format_utc(forecast.end_s)}"
            return None, f"the carbon forecast for {zone} starts only at {format_utc(forecast.start_s)}"
        return forecast, ""

    def received_s(self) -> Mapping[str, float]:
        return {zone: entry.received_s for zone, entry in self._zones.items()}
