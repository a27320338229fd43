#!/usr/bin/env python3
"""Carbon-aware time shifting on a year of real grid intensity: what deferring plans saves.

Replays a zone's 2020 carbon intensity (half-hourly for France, quarter-hourly for Germany;
../shared/carbon/, from the data set of Wiesner et al., "Let's Wait Awhile: How Temporal
Workload Shifting Can Reduce Carbon Emissions in the Cloud", Middleware '21, ENTSO-E based)
with a job mix after that paper's two scenarios, and lets coordinator/carbon_time/planner.py
decide when each job starts. Virtual time, no sockets: a year replays in seconds.

**Job mix** (``--jobs``, default ``nightly:40,ml:3387``), in the data file's clock (its times
carry no zone and are read as UTC):

* ``nightly:N``: every day N batch jobs are submitted at 01:00, each expected to run 30, 45, 60,
  75 or 90 min, with the results due at 09:00 (an 8-hour window; the paper's Scenario I runs
  one 30-minute job at 01:00 and lets it move up to 8 h either way);
* ``ml:N``: N machine-learning jobs a year (the paper's 3387), submitted on workdays between
  09:00 and 16:30 at half-hour steps, expected to run 4 to 90 h (half-hour steps), due at 09:00
  on the next workday after they would end if started at once, or at that end when it falls
  in working hours 09:00-17:00 on a workday (the paper's "Next Workday" constraint, Scenario II,
  non-interruptible);
* ``adhoc:N``: N jobs a day without a deadline at random times, 15 min to 2 h: they run at once
  and take slots.

Each job draws 1 kW while it runs; its emissions are the actual intensity over its run. Its
actual run differs from the expected by up to ``--runtime-error`` % (uniform; default 0: run
times known, as in the paper), and the planner's ``run_margin`` is that error (``--run-margin``).
An ml job is due no sooner than 1.25 x its expected run (the paper's rule leaves a job ending
in working hours no slack at all, which no planner can meet once a run is late).

**The fleet**: ``--slots`` jobs run at once (default 48, where running every job at submit
meets every deadline); a job that finds none free waits, least latest start first (the run-at-
submit baseline: first come, first served).

**Forecasts** (``--forecast-model``): ``noisy`` (default): every ``--issue-h`` hours (6) a
forecast covering the next ``--horizon-h`` hours (168: every job's window and run, as the paper's
simulator assumed), each step the actual value x (1 + e), e ~ Normal(0, ``--forecast-error`` %)
(default 10 %, clipped at +-3 sigma), drawn afresh for every step of every issue, so each new
forecast revises the last and the planner re-plans. The paper's error model is the same kind
(Gaussian, independent per step, 5 % and 10 % of the mean), on one forecast. The error does not
grow with lead time here; ``--horizon-h 48`` is closer to what providers publish.
``persistence``: each step is the actual value a whole number of days (1, 2, ...) before it.
``exact``: the actual series.

**Columns** (one JSON line per zone with ``--json``):

* ``savings_pct``: emissions saved against running every job at submit (same slots, first come
  first served), in %; ``deadlines_met``: the fraction of jobs with a deadline that met it;
* ``oracle_savings_pct``: the same planner with perfect knowledge (the actual series as its
  forecast over the whole year, exact run times, no margins, no minimum gain) and the same
  slots; ``share_of_oracle`` = savings / oracle savings;
* ``unbounded_oracle_savings_pct``: perfect knowledge and no slot limit (every job alone at its
  greenest window): the ceiling;
* ``lwa_nightly_pct``: the paper's Scenario I recomputed on this file: one 30-min job a day at
  01:00, moved to the greenest start within ±8 h with perfect knowledge;
* ``avoided_g`` (the receipts' rule, coordinator/carbon_time/accounting.py, summed over held
  jobs) beside ``saved_g`` (baseline emissions minus shifted);
* cost: ``decision_us_p50`` / ``p99`` per submit's decision, ``forecast_update_ms_p50`` / ``p99``
  per new forecast (every held plan re-planned).

``--scaling`` instead times one decision with 100, 1,000, 10,000 and 100,000 plans held.

Usage: ``python bench/carbon_shift.py`` (both zones in ../shared/carbon/), ``--intensity
ZONE_CSV`` (repeatable), ``--days N`` (from ``--start``), ``--json``.
"""

from __future__ import annotations

import argparse
import bisect
import gc
import heapq
import json
import math
import random
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from coordinator.carbon_time import (  # noqa: E402 - after the path tweak above
    Deferrable,
    ForecastBook,
    ForecastRow,
    Hold,
    Run,
    ShiftConfig,
    StepForecast,
    TimeShifter,
    avoided_co2e,
    latest_start_s,
    parse_csv,
)

CARBON = ROOT.parent / "shared" / "carbon"
DEFAULT_FILES = (CARBON / "de_2020_ci.csv", CARBON / "fr_2020_ci.csv")
DEFAULT_JOBS = "nightly:40,ml:3387"
ML_MIN_SLACK = 0.25  # an ml job is due no sooner than 1.25 x its expected run after submit
HOUR = 3600.0
DAY = 86400.0


@dataclass(slots=True)
class Job:
    id: str
    kind: str
    submit_s: float
    expected_run_s: float
    run_s: float  # actual
    deadline_s: float | None
    start_s: float = math.nan
    held: bool = False


@dataclass(slots=True)
class Outcome:
    """One replay: the jobs with their starts, and the planner's counters."""

    jobs: list[Job]
    decision_s: list[float] = field(default_factory=list)  # per submit
    replan_s: list[float] = field(default_factory=list)  # per forecast update (every held plan re-planned)
    held_max: int = 0
    decisions: int = 0
    replans: int = 0
    no_room: int = 0


def zone_of(path: Path) -> str:
    """``de_2020_ci.csv`` -> ``DE``."""
    return path.name.split("_")[0].split(".")[0].upper()


def load_actual(path: Path) -> StepForecast:
    rows = parse_csv(path.read_text(), default_zone=zone_of(path))
    return StepForecast.of_points(sorted({(r.time_s, r.g_per_kwh) for r in rows}))


def parse_jobs(spec: str) -> dict[str, int]:
    kinds: dict[str, int] = {}
    for part in spec.split(","):
        name, _, count = part.strip().partition(":")
        if name not in ("nightly", "ml", "adhoc") or not count.isdigit():
            raise argparse.ArgumentTypeError(f"bad job kind {part!r}: use nightly:N (a night), ml:N (a year), "
                                             "adhoc:N (a day)")
        kinds[name] = int(count)
    return kinds


def _next_workday_9(t: datetime) -> datetime:
    """The deadline of the paper's Next Workday rule for a job that would end at ``t``."""
    hour = t.hour + t.minute / 60
    if t.weekday() < 5 and 9 <= hour <= 17:
        return t
    day = t.replace(hour=9, minute=0, second=0, microsecond=0)
    if t.weekday() < 5 and hour < 9:
        return day
    day += timedelta(days=1)
    while day.weekday() >= 5:
        day += timedelta(days=1)
    return day


def make_jobs(kinds: dict[str, int], start: datetime, days: int, runtime_error: float, seed: int) -> list[Job]:
    rng = random.Random(seed)
    jobs: list[Job] = []

    def add(kind: str, submit: datetime, expected_s: float, deadline: datetime | None) -> None:
        actual = expected_s * (1 + rng.uniform(-runtime_error, runtime_error))
        jobs.append(Job(f"{kind}-{len(jobs)}", kind, submit.timestamp(), expected_s, actual,
                        deadline.timestamp() if deadline else None))

    day_list = [start + timedelta(days=d) for d in range(days)]
    for day in day_list:
        for _ in range(kinds.get("nightly", 0)):
            add("nightly", day + timedelta(hours=1), rng.choice((30, 45, 60, 75, 90)) * 60.0,
                day + timedelta(hours=9))
        for _ in range(kinds.get("adhoc", 0)):
            add("adhoc", day + timedelta(minutes=rng.randrange(0, 1440)), rng.randrange(15, 121, 15) * 60.0, None)
    workdays = [day for day in day_list if day.weekday() < 5]
    n_ml = round(kinds.get("ml", 0) * days / 366)
    if workdays:
        for _ in range(n_ml):
            submit = rng.choice(workdays) + timedelta(minutes=rng.randrange(9 * 60, 17 * 60, 30))
            expected = rng.randrange(4 * 60, 90 * 60 + 1, 30) * 60.0
            due = max(_next_workday_9(submit + timedelta(seconds=expected)),
                      submit + timedelta(seconds=expected * (1 + ML_MIN_SLACK)))
            add("ml", submit, expected, due)
    jobs.sort(key=lambda job: (job.submit_s, job.id))
    return jobs


# ------------------------------------------------------------------------------------------- forecasts

Issuer = Callable[[float], list[ForecastRow]]


def noisy(actual: StepForecast, zone: str, horizon_s: float, error: float, seed: int) -> Issuer:
    """Rows of a forecast issued at ``t``: each step's actual value x (1 + N(0, error)), clipped at 3 sigma."""
    rng = random.Random(seed)

    def issue(t: float) -> list[ForecastRow]:
        rows = []
        j = max(0, bisect.bisect_right(actual.times, t) - 1)
        while j < len(actual.values) and actual.times[j] < t + horizon_s:
            eps = max(-3.0, min(3.0, rng.gauss(0.0, 1.0))) * error
            rows.append(ForecastRow(zone, actual.times[j], max(0.0, actual.values[j] * (1 + eps))))
            j += 1
        return rows
    return issue


def persistence(actual: StepForecast, zone: str, horizon_s: float) -> Issuer:
    """Rows of a forecast issued at ``t``: each step's value the actual one a whole number of days earlier."""

    def issue(t: float) -> list[ForecastRow]:
        rows = []
        j = max(0, bisect.bisect_right(actual.times, t) - 1)
        while j < len(actual.values) and actual.times[j] < t + horizon_s:
            step = actual.times[j]
            lag = DAY * max(1, math.ceil((step - t) / DAY))
            past = actual.value_at(step - lag)
            rows.append(ForecastRow(zone, step, actual.values[j] if past is None else past))
            j += 1
        return rows
    return issue


# ------------------------------------------------------------------------------------------- replay

def replay(jobs: list[Job], zone: str, slots: int | None, *, shifter: TimeShifter | None = None,
           issues: Iterator[tuple[float, list[ForecastRow]]] | None = None, exact_runs: bool = False) -> Outcome:
    """Run ``jobs`` on ``slots``; with a shifter, deferrable jobs start when it says, else at submit."""
    jobs = [Job(j.id, j.kind, j.submit_s, j.run_s if exact_runs else j.expected_run_s, j.run_s, j.deadline_s)
            for j in jobs]
    by_id = {job.id: job for job in jobs}
    out = Outcome(jobs)
    waiting: list[tuple[float, float, str]] = []  # (latest start or inf, submit, id): least laxity first
    running: list[tuple[float, str]] = []  # (end, id)
    free = slots if slots is not None else 1 << 30
    pending_issue = next(issues, None) if issues is not None else None
    submits = iter(jobs)
    next_job = next(submits, None)
    if shifter is not None:
        shifter.set_slots(zone, slots)

    def enqueue(job: Job) -> None:
        if shifter is None:  # first come, first served
            key = job.submit_s
        elif job.deadline_s is None:
            key = math.inf
        else:
            key = latest_start_s(Deferrable(job.id, job.deadline_s, job.expected_run_s, (zone,)), shifter.config)
        heapq.heappush(waiting, (key, job.submit_s, job.id))

    def apply(decisions: list[Hold | Run]) -> None:
        for decision in decisions:
            if isinstance(decision, Run):
                enqueue(by_id[decision.plan_id])
            else:
                by_id[decision.plan_id].held = True

    def timed(into: list[float], call: Callable[..., list[Hold | Run]], *args: Any) -> list[Hold | Run]:
        t0 = time.perf_counter()
        result = call(*args)
        into.append(time.perf_counter() - t0)
        return result

    while True:
        candidates = [running[0][0] if running else math.inf,
                      next_job.submit_s if next_job else math.inf,
                      pending_issue[0] if pending_issue else math.inf]
        if shifter is not None:
            wake = shifter.next_wake_s()
            candidates.append(wake if wake is not None else math.inf)
        now = min(candidates)
        if now == math.inf:
            break
        while running and running[0][0] <= now:
            _, job_id = heapq.heappop(running)
            free += 1
            if shifter is not None:
                shifter.forget(job_id, now)
        while pending_issue is not None and pending_issue[0] <= now:
            if shifter is not None:
                apply(timed(out.replan_s, shifter.update_forecast, pending_issue[1], now))
            pending_issue = next(issues, None) if issues is not None else None
        while next_job is not None and next_job.submit_s <= now:
            job = next_job
            if shifter is None or job.deadline_s is None:
                enqueue(job)
            else:
                plan = Deferrable(job.id, job.deadline_s, job.expected_run_s, (zone,))
                apply(timed(out.decision_s, shifter.submit, plan, now))
            next_job = next(submits, None)
        if shifter is not None:
            apply(shifter.tick(now))
            out.held_max = max(out.held_max, len(shifter.held()))
        while waiting and free > 0:
            _, _, job_id = heapq.heappop(waiting)
            job = by_id[job_id]
            job.start_s = now
            free -= 1
            heapq.heappush(running, (now + job.run_s, job_id))
            if shifter is not None and job.deadline_s is not None:
                shifter.started(job_id, zone, now, job.expected_run_s)
    if shifter is not None:
        out.decisions, out.replans, out.no_room = (shifter.stats.decisions, shifter.stats.replans,
                                                   shifter.stats.no_room)
    return out


def grams(actual: StepForecast, job: Job) -> float:
    """g CO2e of a 1 kW job over its actual run."""
    return actual.integral(job.start_s, job.start_s + job.run_s) / HOUR


def lwa_nightly_pct(actual: StepForecast, start: datetime, days: int) -> float:
    """The paper's Scenario I on this series: a 30-min job at 01:00 moved within +-8 h, perfect knowledge."""
    base = best = 0.0
    for d in range(days):
        t = (start + timedelta(days=d, hours=1)).timestamp()
        base += actual.mean(t, t + 1800)
        best += min(actual.mean(t + k * 1800, t + k * 1800 + 1800) for k in range(-16, 17))
    return 100 * (base - best) / base


def run_zone(path: Path, ns: argparse.Namespace) -> dict[str, Any]:
    wall0 = time.perf_counter()
    zone = zone_of(path)
    actual = load_actual(path)
    start = datetime.fromisoformat(ns.start).replace(tzinfo=UTC)
    days = ns.days
    jobs = make_jobs(ns.jobs, start, days, ns.runtime_error / 100, ns.seed)
    quantum_s = ns.quantum_min * 60.0
    config = ShiftConfig(quantum_s=quantum_s, run_margin=ns.run_margin, queue_margin_s=ns.queue_margin_min * 60,
                         min_gain=ns.min_gain / 100, hold_share=ns.hold_share)
    oracle_config = ShiftConfig(quantum_s=quantum_s, run_margin=0.0, queue_margin_s=0.0, min_gain=0.0,
                                hold_share=ns.hold_share)
    horizon_s, issue_s = ns.horizon_h * HOUR, ns.issue_h * HOUR
    t0 = start.timestamp() - DAY  # forecasts start a day before the first job
    t_end = (start + timedelta(days=days + 5)).timestamp()
    if ns.forecast_model == "exact":
        issuer: Issuer = lambda t: [ForecastRow(zone, s, v) for s, v in actual.points() if t - DAY <= s]  # noqa: E731
        issue_times: list[float] = [t0]
    elif not horizon_s:  # one noisy forecast of the whole series, as the paper's simulator had
        issuer = noisy(actual, zone, math.inf, ns.forecast_error / 100, ns.seed + 1)
        issue_times = [t0]
    else:
        issuer = (noisy(actual, zone, horizon_s, ns.forecast_error / 100, ns.seed + 1)
                  if ns.forecast_model == "noisy" else persistence(actual, zone, horizon_s))
        issue_times = [t0 + k * issue_s for k in range(int((t_end - t0) // issue_s) + 1)]
    issues = ((t, issuer(t)) for t in issue_times)
    everything = [ForecastRow(zone, s, v) for s, v in actual.points()]

    baseline = replay(jobs, zone, ns.slots)
    max_age_s = math.inf if ns.forecast_model == "exact" or not horizon_s else 2 * issue_s + HOUR
    shifted = replay(jobs, zone, ns.slots, shifter=TimeShifter(ForecastBook(max_age_s=max_age_s), config),
                     issues=issues)
    oracle = replay(jobs, zone, ns.slots, shifter=TimeShifter(ForecastBook(max_age_s=math.inf), oracle_config),
                    issues=iter([(t0, everything)]), exact_runs=True)
    unbounded = replay(jobs, zone, None, shifter=TimeShifter(ForecastBook(max_age_s=math.inf), oracle_config),
                       issues=iter([(t0, everything)]), exact_runs=True)

    def total(outcome: Outcome, kind: str | None = None) -> float:
        return sum(grams(actual, job) for job in outcome.jobs if kind is None or job.kind == kind)

    def pct(outcome: Outcome, kind: str | None = None) -> float:
        base = total(baseline, kind)
        return round(100 * (base - total(outcome, kind)) / base, 2) if base else 0.0

    def met(outcome: Outcome) -> tuple[float, int]:
        due = [job for job in outcome.jobs if job.deadline_s is not None]
        missed = sum(job.start_s + job.run_s > job.deadline_s + 1e-6 for job in due)  # type: ignore[operator]
        return (round(1 - missed / len(due), 6) if due else 1.0), missed

    avoided = 0.0
    for job in shifted.jobs:
        if job.held:
            figure = avoided_co2e(actual, job.run_s / HOUR, job.submit_s, job.start_s, job.run_s)
            avoided += figure.avoided_co2e_g if figure else 0.0
    energy_kwh = sum(job.run_s for job in shifted.jobs) / HOUR
    deadlines_met, missed = met(shifted)
    savings, oracle_savings = pct(shifted), pct(oracle)
    micros = sorted(s * 1e6 for s in shifted.decision_s) or [0.0]
    replan_ms = sorted(s * 1e3 for s in shifted.replan_s) or [0.0]
    delays = [job.start_s - job.submit_s for job in shifted.jobs if job.deadline_s is not None]
    return {
        "zone": zone, "intensity": path.name, "start": ns.start, "days": days, "jobs": len(jobs),
        "jobs_by_kind": {kind: sum(job.kind == kind for job in jobs) for kind in ns.jobs},
        "deadlines_met": deadlines_met, "missed": missed, "baseline_deadlines_met": met(baseline)[0],
        "oracle_deadlines_met": met(oracle)[0],
        "savings_pct": savings, "oracle_savings_pct": oracle_savings,
        "share_of_oracle": round(savings / oracle_savings, 3) if oracle_savings > 0 else None,
        "unbounded_oracle_savings_pct": pct(unbounded),
        "by_kind": {kind: {"savings_pct": pct(shifted, kind), "oracle_savings_pct": pct(oracle, kind)}
                    for kind in ns.jobs if kind != "adhoc"},
        "lwa_nightly_pct": round(lwa_nightly_pct(actual, start, days), 2),
        "g_per_kwh": {"baseline": round(total(baseline) / energy_kwh, 2),
                      "shifted": round(total(shifted) / energy_kwh, 2), "oracle": round(total(oracle) / energy_kwh, 2)},
        "saved_g": round(total(baseline) - total(shifted)), "avoided_g": round(avoided),
        "held": sum(job.held for job in shifted.jobs), "held_max": shifted.held_max,
        "mean_delay_h": round(statistics.fmean(delays) / HOUR, 2) if delays else 0.0,
        "decisions": shifted.decisions, "replans": shifted.replans, "no_room": shifted.no_room,
        "decision_us_p50": round(micros[len(micros) // 2], 1),
        "decision_us_p99": round(micros[int(len(micros) * 0.99)], 1),
        "forecast_update_ms_p50": round(replan_ms[len(replan_ms) // 2], 2),
        "forecast_update_ms_p99": round(replan_ms[int(len(replan_ms) * 0.99)], 2),
        "forecast_model": ns.forecast_model, "forecast_error_pct": ns.forecast_error if ns.forecast_model == "noisy"
        else None, "horizon_h": ns.horizon_h, "issue_h": ns.issue_h, "runtime_error_pct": ns.runtime_error,
        "slots": ns.slots, "quantum_min": ns.quantum_min, "run_margin": ns.run_margin,
        "queue_margin_min": ns.queue_margin_min, "min_gain_pct": ns.min_gain, "hold_share": ns.hold_share,
        "seed": ns.seed,
        "wall_s": round(time.perf_counter() - wall0, 1),
    }


def scaling(ns: argparse.Namespace) -> dict[str, Any]:
    """Microseconds per decision with n plans already held (one zone, a 48-hour forecast, 1 h runs, 24 h deadlines)."""
    rng = random.Random(ns.seed)
    now = 1_600_000_000.0
    rows = [ForecastRow("DE", now - HOUR + k * 900.0, 200 + 150 * math.sin(k / 12) + rng.uniform(0, 20))
            for k in range(49 * 4)]
    result: dict[str, Any] = {"scaling": {}}
    for n in (100, 1_000, 10_000, 100_000):
        shifter = TimeShifter(ForecastBook(), ShiftConfig())
        shifter.update_forecast(rows, now)
        for i in range(n):
            shifter.submit(Deferrable(f"held-{i}", now + DAY, HOUR, ("DE",)), now)
        gc.collect()
        gc.freeze()  # the held plans are long-lived: keep the collector's passes over them out of the timing
        samples = []
        for i in range(200):
            plan = Deferrable(f"new-{i}", now + DAY, HOUR, ("DE",))
            t0 = time.perf_counter()
            shifter.submit(plan, now)
            samples.append((time.perf_counter() - t0) * 1e6)
            shifter.forget(plan.plan_id, now)
        gc.unfreeze()
        samples.sort()
        result["scaling"][str(n)] = {"held": len(shifter.held()), "us_p50": round(samples[100], 1),
                                     "us_p99": round(samples[198], 1)}
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--intensity", action="append", type=Path, metavar="ZONE_CSV",
                        help="a zone's intensity CSV (Time,Carbon Intensity or zone,time,gco2_per_kwh; repeatable; "
                             "default: both files in ../shared/carbon)")
    parser.add_argument("--forecast-error", type=float, default=10.0, metavar="PCT",
                        help="noisy forecast's error: sigma of the per-step relative error (default 10)")
    parser.add_argument("--forecast-model", choices=("noisy", "persistence", "exact"), default="noisy")
    parser.add_argument("--horizon-h", type=float, default=168.0,
                        help="hours a forecast covers (default 168: every job's window and run; 0: the whole year)")
    parser.add_argument("--issue-h", type=float, default=6.0, help="hours between forecasts (default 6)")
    parser.add_argument("--jobs", type=parse_jobs, default=parse_jobs(DEFAULT_JOBS), metavar="SPEC",
                        help=f"job mix, e.g. {DEFAULT_JOBS} (nightly:N a night, ml:N a year, adhoc:N a day)")
    parser.add_argument("--slots", type=int, default=48, help="jobs running at once (default 48)")
    parser.add_argument("--runtime-error", type=float, default=0.0, metavar="PCT",
                        help="actual run = expected x (1 + U(-PCT, PCT) %%) (default 0: known, as in the paper)")
    parser.add_argument("--run-margin", type=float, default=None,
                        help="the planner's run_margin (default: the run-time error, as a fraction)")
    parser.add_argument("--queue-margin-min", type=float, default=5.0, help="the planner's queue margin (default 5)")
    parser.add_argument("--min-gain", type=float, default=1.0, metavar="PCT", help="the planner's min_gain (default 1)")
    parser.add_argument("--hold-share", type=float, default=0.8, help="the planner's hold_share (default 0.8)")
    parser.add_argument("--quantum-min", type=float, default=15.0, help="the planner's quantum (default 15)")
    parser.add_argument("--start", default="2020-01-01", help="first day of jobs (default 2020-01-01)")
    parser.add_argument("--days", type=int, default=366, help="days of jobs (default 366: the year 2020)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--scaling", action="store_true", help="time one decision against the number of plans held")
    parser.add_argument("--json", action="store_true", help="one JSON object per zone instead of a table")
    ns = parser.parse_args(argv)
    if ns.run_margin is None:
        ns.run_margin = ns.runtime_error / 100
    if ns.scaling:
        print(json.dumps(scaling(ns)))
        return 0
    files = ns.intensity or list(DEFAULT_FILES)
    missing = [str(path) for path in files if not path.exists()]
    if missing:
        reason = f"skipped: no intensity file {', '.join(missing)} (the shared carbon data sits beside the repository)"
        print(reason, file=sys.stderr)
        if ns.json:
            print(json.dumps({"skipped": reason}))
        return 0
    results = [run_zone(path, ns) for path in files]
    for result in results:
        if ns.json:
            print(json.dumps(result))
        else:
            print(f"{result['zone']}: {result['jobs']} jobs over {result['days']} days, deadlines met "
                  f"{result['deadlines_met']:.2%} (baseline {result['baseline_deadlines_met']:.2%}); savings "
                  f"{result['savings_pct']} % vs oracle {result['oracle_savings_pct']} % "
                  f"(share {result['share_of_oracle']}), unbounded oracle {result['unbounded_oracle_savings_pct']} %, "
                  f"paper's Scenario I {result['lwa_nightly_pct']} %; by kind {result['by_kind']}; "
                  f"decision {result['decision_us_p50']} us p50 / {result['decision_us_p99']} p99; "
                  f"{result['wall_s']} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
