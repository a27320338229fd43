"""When a deferrable plan should start, and where: the least forecast gCO2e that still meets its deadline.

What it owns: the plans held for a greener time (:class:`TimeShifter`), each zone's slot
calendar, and the decision for each plan, :class:`Hold` (start at ``start_s`` in ``zone``) or
:class:`Run` (start now, with the reason). It reads forecasts from a
:class:`~coordinator.carbon_time.forecast.ForecastBook` it shares with the providers' feeds.

Rules (docs/ROUTING.md §Carbon in time):

1. **Deferrable** = has a deadline. Its *latest start* is ``deadline - expected_run * (1 +
   run_margin) - queue_margin_s``: the run may take ``run_margin`` longer than expected (the
   expected run is itself a forecast; a plan may bring its own margin, e.g. from its op's
   observed spread of run times) and wait ``queue_margin_s`` for a slot, and still finish in
   time. A plan whose latest start is not after ``now`` runs now.
2. **Candidates**: ``now``, and every quantum boundary (``quantum_s``, aligned to the epoch) after
   ``now`` up to the latest start, in each of the plan's zones whose forecast is usable (a value
   for ``now``, received within the book's ``max_age_s``), and before that zone's horizon: a plan
   is held only for a time its forecast covers.
3. **Cost** of a candidate: the zone's mean forecast intensity over ``[start, start +
   expected_run]`` (the forecast's mean where the run passes the horizon). The plan's energy
   does not depend on when it runs, so the least mean is the least gCO2e.
4. **Capacity**: a zone has ``slots`` (None: unbounded). Every plan the shifter decided reserves
   one slot in each quantum its expected run touches, from its start (held ones) or from now
   (those it ran); a candidate touching a quantum with ``hold_share`` of the slots reserved is
   skipped. So a green hour takes only as many plans as it has slots, the rest go to the
   next-best hours that still meet their deadlines, and the other slots stay free for what comes
   later with a closer deadline. Only a plan that finds no such window may use those (the
   *headroom*); re-planning puts the plans of tighter deadlines first (rule 6). When no
   candidate has room even so, the plan runs now (the scheduler queues it as today).
5. **Hold or run**: hold for the cheapest candidate with room when its mean is at least
   ``min_gain`` below running now (the least mean over ``[now, now + expected_run]`` among the
   usable zones), or when now has no free slot (it would queue anyway); otherwise run now. Ties
   go to the earliest start, then the zone listed first.
6. **Re-plan**: when a zone's forecast changes (:meth:`TimeShifter.forecast_changed`), and at a
   quantum's start (:meth:`TimeShifter.tick`) for plans in zones whose slots were freed or whose
   forecast became unusable. Re-planned plans give up their reservations first and choose again
   tightest latest start first; and when a new plan finds no room, together with the plans held
   in its zones. With nothing changed a step start would choose the same (candidate costs do not
   depend on ``now``), so it is skipped.
7. **Release**: a held plan runs when its start comes (:meth:`TimeShifter.tick`), when released
   early (:meth:`TimeShifter.release`), or when a re-plan says run now. A hold is never later
   than the latest start, so a missing or stale forecast costs savings, never a deadline.

Cost per decision: O(Z · (W log S + K)) for Z zones, W candidate starts, S forecast steps and K
quanta of the run; independent of the number of plans held (the release heap adds O(log n)).
Re-planning n plans costs n decisions.

Pure: no clock, no asyncio; ``now`` (Unix seconds, UTC) is handed in.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, tzinfo

from coordinator.carbon_time.forecast import ForecastBook, ForecastRow, StepForecast

__all__ = ["Deferrable", "Hold", "Run", "ShiftConfig", "ShiftStats", "TimeShifter", "latest_start_s"]


@dataclass(frozen=True, slots=True)
class ShiftConfig:
    """The planner's knobs.

    Attributes:
        quantum_s: the grid of candidate starts and of slot reservations.
        run_margin: the fraction an actual run may exceed ``expected_run_s`` and still meet the deadline.
        queue_margin_s: time kept for waiting for a slot and starting, on top of the run.
        min_gain: hold only for a window at least this fraction greener than running now (not
            for a tie or a difference below the forecast's resolution).
        hold_share: the share of a zone's slots that held plans may reserve in any quantum; the
            rest stays for plans that run at once (no deadline, or one too close to wait).
    """

    quantum_s: float = 900.0
    run_margin: float = 0.2
    queue_margin_s: float = 300.0
    min_gain: float = 0.01
    hold_share: float = 0.8

    def __post_init__(self) -> None:
        if not self.quantum_s > 0 or not math.isfinite(self.quantum_s):
            raise ValueError(f"quantum_s must be > 0 (got {self.quantum_s})")
        if not self.run_margin >= 0 or not self.queue_margin_s >= 0 or not 0 <= self.min_gain < 1:
            raise ValueError("run_margin and queue_margin_s must be >= 0 and min_gain in [0, 1)")
        if not 0 < self.hold_share <= 1:
            raise ValueError(f"hold_share must be in (0, 1] (got {self.hold_share})")


@dataclass(frozen=True, slots=True)
class Deferrable:
    """A plan with a deadline: by when it must finish, how long it is expected to run, where it may run."""

    plan_id: str
    deadline_s: float  # Unix seconds
    expected_run_s: float
    zones: tuple[str, ...]  # the grid zones of the workers that can run it
    run_margin: float | None = None  # this plan's own (e.g. its op's observed p95 / median - 1); None: the config's

    def __post_init__(self) -> None:
        if not self.expected_run_s > 0 or not math.isfinite(self.expected_run_s):
            raise ValueError(f"plan {self.plan_id}: expected_run_s must be > 0 (got {self.expected_run_s})")
        if not math.isfinite(self.deadline_s):
            raise ValueError(f"plan {self.plan_id}: deadline_s must be a finite time (got {self.deadline_s})")
        if self.run_margin is not None and not 0 <= self.run_margin < math.inf:
            raise ValueError(f"plan {self.plan_id}: run_margin must be >= 0 (got {self.run_margin})")


def latest_start_s(plan: Deferrable, config: ShiftConfig) -> float:
    """The latest start that still meets the deadline with the run and queue margins (rule 1)."""
    margin = config.run_margin if plan.run_margin is None else plan.run_margin
    return plan.deadline_s - plan.expected_run_s * (1 + margin) - config.queue_margin_s


@dataclass(frozen=True, slots=True)
class Hold:
    """Hold the plan until ``start_s``, then run it in ``zone``."""

    plan_id: str
    start_s: float
    zone: str
    window_g_per_kwh: float  # forecast mean over the run from start_s
    now_g_per_kwh: float  # forecast mean over the run from now (the greenest usable zone)
    decided_s: float
    latest_start_s: float
    several_zones: bool = False

    def reason(self, tz: tzinfo = UTC) -> str:
        """``deferred for carbon until 14:30 (52 g/kWh vs 310 now)``, the start in ``tz``."""
        start = datetime.fromtimestamp(self.start_s, tz)
        when = start.strftime("%H:%M") if self.start_s - self.decided_s < 86400 else start.strftime("%Y-%m-%d %H:%M")
        where = f" in {self.zone}" if self.several_zones else ""
        return (f"deferred for carbon until {when}{where} "
                f"({self.window_g_per_kwh:.0f} g/kWh vs {self.now_g_per_kwh:.0f} now)")


@dataclass(frozen=True, slots=True)
class Run:
    """Run the plan now (give it to the scheduler), in ``zone`` when the shifter had a choice ("": any)."""

    plan_id: str
    reason: str
    zone: str = ""


Decision = Hold | Run


@dataclass(slots=True)
class ShiftStats:
    """Counters: decisions, re-plans among them, holds released, plans with no room in any window, and
    plans sent to run where their zone had no free slot (they queue, and may wait past their plan)."""

    decisions: int = 0
    replans: int = 0
    released: int = 0
    no_room: int = 0
    overbooked: int = 0


@dataclass(slots=True)
class _Reservation:
    zone: str
    first: int  # quanta [first, end)
    end: int


@dataclass(slots=True)
class _Calendar:
    slots: int | None = None  # plans at once (None: unbounded)
    hold_slots: int | None = None  # of which held plans may fill (rule 4)
    used: dict[int, int] = field(default_factory=dict)
    purged_before: int = -(2**62)

    def set_slots(self, slots: int | None, hold_share: float) -> None:
        self.slots = slots
        self.hold_slots = None if slots is None else max(1, math.floor(slots * hold_share + 1e-9))

    def add(self, first: int, end: int, delta: int) -> bool:
        """Add ``delta`` to the quanta ``[first, end)``; whether a quantum full for holds got room."""
        used, full, freed = self.used, self.hold_slots, False
        for cell in range(max(first, self.purged_before), end):
            before = used.get(cell, 0)
            freed = freed or (delta < 0 and full is not None and before >= full)
            if before + delta > 0:
                used[cell] = before + delta
            else:
                used.pop(cell, None)
        return freed

    def limit(self, headroom: bool) -> int | None:
        """The slots a plan may fill: all of them with ``headroom``, else the hold share."""
        return self.slots if headroom else self.hold_slots

    def room(self, first: int, end: int, slots: int | None) -> bool:
        """Whether ``[first, end)`` has fewer than ``slots`` reserved in every quantum."""
        if slots is None:
            return True
        get = self.used.get
        return all(get(cell, 0) < slots for cell in range(first, end))

    def starts_with_room(self, first: int, last: int, width: int, slots: int | None) -> Iterator[int]:
        """Quanta ``i`` in ``[first, last]`` whose ``[i, i + width)`` hold fewer than ``slots`` (sliding max)."""
        if slots is None or not self.used:
            yield from range(first, last + 1)
            return
        get = self.used.get
        window: deque[tuple[int, int]] = deque()  # (cell, used), used decreasing
        pushed = first
        for start in range(first, last + 1):
            while pushed < start + width:
                count = get(pushed, 0)
                while window and window[-1][1] <= count:
                    window.pop()
                window.append((pushed, count))
                pushed += 1
            while window[0][0] < start:
                window.popleft()
            if window[0][1] < slots:
                yield start

    def purge(self, before: int) -> None:
        """Forget the quanta before ``before`` (the past)."""
        span = before - self.purged_before
        if span <= 0:
            return
        if span < len(self.used):
            for cell in range(self.purged_before, before):
                self.used.pop(cell, None)
        else:
            for cell in [cell for cell in self.used if cell < before]:
                del self.used[cell]
        self.purged_before = before


@dataclass(slots=True)
class _Held:
    plan: Deferrable
    hold: Hold


class TimeShifter:
    """The plans held for a greener time, their reservations, and the decisions (see the module's rules)."""

    def __init__(self, book: ForecastBook, config: ShiftConfig | None = None) -> None:
        self.book = book
        self.config = config or ShiftConfig()
        self.stats = ShiftStats()
        self._held: dict[str, _Held] = {}
        self._held_at: dict[str, set[str]] = {}  # zone -> the plans held to run there
        self._may_use: dict[str, set[str]] = {}  # zone -> the held plans that list it
        self._reserved: dict[str, _Reservation] = {}  # held and run plans alike
        self._ends: list[tuple[int, str]] = []  # (end quantum, plan id) of reservations, to forget them
        self._calendars: dict[str, _Calendar] = {}
        self._starts: list[tuple[float, str]] = []  # (start_s, plan id), lazily deleted
        self._dirty: set[str] = set()  # zones whose slots were freed since their plans were planned
        self._quantum = -(2**62)
        self._no_room = False  # the last decision found no slot free in any window

    # ----------------------------------------------------------------------------------- inputs

    def set_slots(self, zone: str, slots: int | None) -> None:
        """How many plans ``zone`` runs at once (None: unbounded); more slots mark its plans for re-planning."""
        calendar = self._calendar(zone)
        if calendar.slots is not None and (slots is None or slots > calendar.slots):
            self._dirty.add(zone)
        calendar.set_slots(slots, self.config.hold_share)

    def submit(self, plan: Deferrable, now: float) -> list[Decision]:
        """Decide a new deferrable plan (a plan id decided before is decided again): its decision first.

        When no window before its deadline has a free slot, the plans held in its zones are
        re-planned together with it, tightest latest start first (rule 6): a plan with a close
        deadline takes the slots a looser one had, which moves; their new decisions follow.
        """
        self.forget(plan.plan_id, now)
        decision = self._decide(plan, now)
        if not self._no_room:
            return [decision]
        crowding = {pid for zone in plan.zones for pid in self._held_in(zone)}
        if not crowding:
            return [decision]
        self._free(plan.plan_id, now, replan=False)
        self.stats.no_room -= 1  # counted again if it still finds none
        self.stats.decisions -= 1
        decisions = self._replan(crowding, now, also=plan)
        decisions.sort(key=lambda decision: decision.plan_id != plan.plan_id)
        return decisions

    def update_forecast(self, rows: Iterable[ForecastRow], now: float) -> list[Decision]:
        """Merge rows into the book and re-plan the plans of the zones that changed."""
        return self.forecast_changed(self.book.update(rows, now), now)

    def forecast_changed(self, zones: Iterable[str], now: float) -> list[Decision]:
        """The book's forecast for ``zones`` changed (a feed fetched): re-plan the plans held there."""
        return self._replan({pid for zone in zones for pid in self._held_in(zone)}, now)

    def tick(self, now: float) -> list[Decision]:
        """Time passed: release the plans whose start came; at a new quantum, re-plan where rule 6 says."""
        decisions: list[Decision] = []
        starts = self._starts
        while starts and starts[0][0] <= now:
            start_s, plan_id = heapq.heappop(starts)
            held = self._held.get(plan_id)
            if held is None or held.hold.start_s != start_s:
                continue  # re-planned or released since
            self._unhold(plan_id)
            self.stats.released += 1
            decisions.append(Run(plan_id, "its greener window began", held.hold.zone))
        quantum = math.floor(now / self.config.quantum_s)
        if quantum > self._quantum:
            self._quantum = quantum
            self._forget_ended(quantum)
            replan = {pid for zone in self._dirty for pid in self._held_in(zone)}
            self._dirty.clear()
            for zone, plan_ids in self._held_at.items():
                if plan_ids and self.book.usable(zone, now)[0] is None:
                    replan |= plan_ids
            decisions += self._replan(replan, now)
        return decisions

    def release(self, plan_id: str, now: float) -> Run | None:
        """Run a held plan now (``fleetwire release``); None when it is not held."""
        held = self._held.get(plan_id)
        if held is None:
            return None
        self.forget(plan_id, now)
        self._reserve(plan_id, held.hold.zone, now, held.plan.expected_run_s)
        self.stats.released += 1
        return Run(plan_id, "released early", held.hold.zone)

    def started(self, plan_id: str, zone: str, now: float, expected_run_s: float) -> None:
        """A plan started in ``zone``: its reservation runs from ``now`` there (freeing any other it had)."""
        quantum_s = self.config.quantum_s
        reservation = self._reserved.get(plan_id)
        if (reservation is not None and plan_id not in self._held and reservation.zone == zone
                and reservation.first == math.floor(now / quantum_s)
                and reservation.end == math.ceil((now + expected_run_s) / quantum_s)):
            return  # it started as reserved
        self.forget(plan_id, now)
        self._reserve(plan_id, zone, now, expected_run_s)

    def forget(self, plan_id: str, now: float) -> None:
        """The plan finished, was cancelled or is decided again: drop its hold and free its slots from now on."""
        self._unhold(plan_id)
        self._free(plan_id, now, replan=True)

    def _free(self, plan_id: str, now: float, replan: bool) -> None:
        reservation = self._reserved.pop(plan_id, None)
        if reservation is not None:
            current = math.floor(now / self.config.quantum_s)
            freed = self._calendar(reservation.zone).add(max(reservation.first, current), reservation.end, -1)
            if freed and replan:  # a full quantum has room again: its zone's plans may move into it
                self._dirty.add(reservation.zone)

    # ---------------------------------------------------------------------------------- queries

    def held(self) -> list[Hold]:
        return [held.hold for held in self._held.values()]

    def hold_of(self, plan_id: str) -> Hold | None:
        held = self._held.get(plan_id)
        return held.hold if held else None

    def next_wake_s(self) -> float | None:
        """When :meth:`tick` has something to do next: the earliest held start, or the next quantum's
        start when freed slots wait for a re-plan (None: nothing held). A driver also ticks every
        quantum or so, for forecasts that go stale."""
        wake = None
        while self._starts:
            start_s, plan_id = self._starts[0]
            held = self._held.get(plan_id)
            if held is not None and held.hold.start_s == start_s:
                wake = start_s
                break
            heapq.heappop(self._starts)
        if wake is not None and any(self._held_in(zone) for zone in self._dirty):
            wake = min(wake, (self._quantum + 1) * self.config.quantum_s)
        return wake

    def used(self, zone: str, time_s: float) -> int:
        """Slots of ``zone`` reserved in the quantum holding ``time_s``."""
        return self._calendar(zone).used.get(math.floor(time_s / self.config.quantum_s), 0)

    # -------------------------------------------------------------------------------- internals

    def _held_in(self, zone: str) -> set[str]:
        """The held plans that ``zone`` may run: a change there may move them."""
        return self._may_use.get(zone, set())

    def _calendar(self, zone: str) -> _Calendar:
        calendar = self._calendars.get(zone)
        if calendar is None:
            calendar = self._calendars[zone] = _Calendar()
        return calendar

    def _reserve(self, plan_id: str, zone: str, start_s: float, run_s: float) -> None:
        quantum_s = self.config.quantum_s
        first, end = math.floor(start_s / quantum_s), math.ceil((start_s + run_s) / quantum_s)
        self._reserved[plan_id] = _Reservation(zone, first, end)
        self._calendar(zone).add(first, end, +1)
        heapq.heappush(self._ends, (end, plan_id))

    def _unhold(self, plan_id: str) -> None:
        held = self._held.pop(plan_id, None)
        if held is not None:
            self._held_at[held.hold.zone].discard(plan_id)
            for zone in held.plan.zones:
                self._may_use[zone].discard(plan_id)

    def _forget_ended(self, quantum: int) -> None:
        ends = self._ends
        while ends and ends[0][0] <= quantum:
            end, plan_id = heapq.heappop(ends)
            reservation = self._reserved.get(plan_id)
            if reservation is not None and reservation.end == end and plan_id not in self._held:
                del self._reserved[plan_id]
        for calendar in self._calendars.values():
            calendar.purge(quantum)

    def _replan(self, plan_ids: set[str], now: float, also: Deferrable | None = None) -> list[Decision]:
        if not plan_ids:
            return []
        plans = [self._held[pid].plan for pid in plan_ids if pid in self._held]
        for plan in plans:  # every one gives its slots up before any chooses again
            self._unhold(plan.plan_id)
            self._free(plan.plan_id, now, replan=False)
        self.stats.replans += len(plans)
        if also is not None:
            plans.append(also)
        plans.sort(key=lambda plan: (latest_start_s(plan, self.config), plan.plan_id))
        return [self._decide(plan, now) for plan in plans]

    def _decide(self, plan: Deferrable, now: float) -> Decision:
        self.stats.decisions += 1
        self._no_room = False
        decision = self._choose(plan, now)
        if isinstance(decision, Hold):
            self._held[plan.plan_id] = _Held(plan, decision)
            self._held_at.setdefault(decision.zone, set()).add(plan.plan_id)
            for zone in plan.zones:
                self._may_use.setdefault(zone, set()).add(plan.plan_id)
            self._reserve(plan.plan_id, decision.zone, decision.start_s, plan.expected_run_s)
            heapq.heappush(self._starts, (decision.start_s, plan.plan_id))
        else:
            zone, quantum_s = decision.zone or (plan.zones[0] if plan.zones else ""), self.config.quantum_s
            calendar = self._calendar(zone)
            if not calendar.room(math.floor(now / quantum_s), math.ceil((now + plan.expected_run_s) / quantum_s),
                                 calendar.slots):
                self.stats.overbooked += 1
            self._reserve(plan.plan_id, zone, now, plan.expected_run_s)
        return decision

    def _choose(self, plan: Deferrable, now: float) -> Decision:
        latest = latest_start_s(plan, self.config)
        if latest <= now:
            return Run(plan.plan_id, "its deadline leaves no time to wait", plan.zones[0] if plan.zones else "")
        usable: list[tuple[str, StepForecast]] = []
        why_not = ""
        for zone in plan.zones:
            forecast, reason = self.book.usable(zone, now)
            if forecast is None:
                why_not = why_not or reason
            else:
                usable.append((zone, forecast))
        if not usable:
            return Run(plan.plan_id, why_not or "it names no grid zone", plan.zones[0] if plan.zones else "")
        run_s, quantum_s = plan.expected_run_s, self.config.quantum_s
        now_mean, now_zone = min((forecast.mean(now, now + run_s), i) for i, (_, forecast) in enumerate(usable))
        now_quanta = math.floor(now / quantum_s), math.ceil((now + run_s) / quantum_s)
        for headroom in (False, True):  # within the hold share first; the headroom only if that has no room
            best: tuple[float, float, int] | None = None  # (mean, start, zone index)
            for i, (zone, forecast) in enumerate(usable):
                calendar = self._calendar(zone)
                found = self._best_start(calendar, calendar.limit(headroom), forecast, now, run_s, latest)
                if found is not None and (best is None or found < best[:2]):
                    best = (*found, i)
            if best is not None:
                break
        if best is None:
            self.stats.no_room += 1
            self._no_room = True
            return Run(plan.plan_id, "no slot is free in any window before its deadline", usable[now_zone][0])
        mean, start, index = best
        now_calendar = self._calendar(usable[now_zone][0])
        now_room = now_calendar.room(*now_quanta, now_calendar.limit(headroom))
        if start <= now or (now_room and mean > now_mean * (1 - self.config.min_gain)):
            return Run(plan.plan_id, f"now is within {self.config.min_gain:.0%} of the greenest window before its "
                                     f"deadline ({now_mean:.0f} g/kWh)", usable[index if start <= now else now_zone][0])
        return Hold(plan.plan_id, start, usable[index][0], mean, now_mean, now, latest, len(plan.zones) > 1)

    def _best_start(self, calendar: _Calendar, slots: int | None, forecast: StepForecast, now: float, run_s: float,
                    latest: float) -> tuple[float, float] | None:
        """The least (mean, start) with room under ``slots`` in one zone: ``now``, then quanta up to ``latest``."""
        quantum_s = self.config.quantum_s
        best: tuple[float, float] | None = None
        if calendar.room(math.floor(now / quantum_s), math.ceil((now + run_s) / quantum_s), slots):
            best = (forecast.mean(now, now + run_s), now)
        first = math.floor(now / quantum_s) + 1
        last = min(math.floor(latest / quantum_s), math.ceil(forecast.end_s / quantum_s) - 1)
        for quantum in calendar.starts_with_room(first, last, math.ceil(run_s / quantum_s), slots):
            start = quantum * quantum_s
            mean = forecast.mean(start, start + run_s)
            if best is None or mean < best[0] * (1 - 1e-12):
                best = (mean, start)
        return best
