"""Carbon-aware time shifting (coordinator/carbon_time/) with a fake clock: forecasts, the decision, accounting."""

from __future__ import annotations

import heapq
import math
from datetime import UTC, datetime, timedelta, timezone

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from coordinator.carbon_time import (
    Deferrable,
    ForecastBook,
    ForecastError,
    ForecastFeed,
    ForecastRow,
    Hold,
    Run,
    ShiftConfig,
    StepForecast,
    TimeShifter,
    avoided_co2e,
    latest_start_s,
    parse_csv,
    parse_json,
    parse_source,
    parse_time,
)

T0 = parse_time("2020-06-01T00:00:00Z")
H = 3600.0
Q = 900.0  # the default quantum


def hourly(*values: float, zone: str = "DE", start: float = T0) -> list[ForecastRow]:
    return [ForecastRow(zone, start + i * H, v) for i, v in enumerate(values)]


def shifter_with(rows: list[ForecastRow], now: float, config: ShiftConfig | None = None) -> TimeShifter:
    shifter = TimeShifter(ForecastBook(), config or ShiftConfig(queue_margin_s=0.0))
    shifter.update_forecast(rows, now)
    return shifter


def plan(plan_id: str, deadline_s: float, run_s: float = H, zones: tuple[str, ...] = ("DE",)) -> Deferrable:
    return Deferrable(plan_id, deadline_s, run_s, zones)


def only(decisions: list[Hold | Run]) -> Hold | Run:
    assert len(decisions) == 1
    return decisions[0]


# --------------------------------------------------------------------------------------- forecasts


def test_csv_times_are_iso_8601_and_a_time_without_offset_is_utc() -> None:
    """Rows parse with Z, an offset, or none (UTC); the header is optional and zones are upper-cased."""
    rows = parse_csv("zone,time,gco2_per_kwh\nde,2020-06-01T00:00:00Z,300\n"
                     "DE,2020-06-01T03:00:00+02:00,52.5\n# a comment\n\nFR,2020-06-01 01:00:00,40\n")
    assert rows == [ForecastRow("DE", T0, 300.0), ForecastRow("DE", T0 + H, 52.5), ForecastRow("FR", T0 + H, 40.0)]


@pytest.mark.parametrize(("text", "message"), [
    ("DE,2020-06-01T00:00Z,300\nDE,yesterday,3\n", "line 2: time 'yesterday' is not an ISO 8601 time"),
    ("DE,2020-06-01T00:00Z,lots\n", "line 1: gco2_per_kwh 'lots' is not a number"),
    ("DE,2020-06-01T00:00Z,-5\n", "line 1: gco2_per_kwh '-5' must be between 0 and 5000"),
    ("DE,2020-06-01T00:00Z,nan\n", "line 1: gco2_per_kwh 'nan' must be between 0 and 5000"),
    ("DE,2020-06-01T00:00Z\n", "line 1: expected 3 fields zone,time,gco2_per_kwh, got 2"),
    (",2020-06-01T00:00Z,3\n", "line 1: zone '' must be a grid zone name"),
])
def test_a_bad_csv_line_is_refused_naming_the_line_and_the_field(text: str, message: str) -> None:
    """Each kind of bad input gets an error that says where and what."""
    with pytest.raises(ForecastError, match=message.replace("(", r"\(").replace(")", r"\)")):
        parse_csv(text)


def test_a_two_column_file_is_read_as_the_default_zone() -> None:
    """The Let's Wait Awhile files (Time,Carbon Intensity) read as one zone's rows."""
    rows = parse_csv("Time,Carbon Intensity\n2020-06-01 00:00:00,218.3\n2020-06-01 00:15:00,217.9\n", "DE")
    assert rows == [ForecastRow("DE", T0, 218.3), ForecastRow("DE", T0 + 900, 217.9)]


def test_provider_json_in_three_shapes() -> None:
    """Rows, Electricity Maps' forecast, and the GB API (actual where known, else forecast) all parse."""
    assert parse_json('[{"zone": "FR", "time": "2020-06-01T00:00:00Z", "gco2_per_kwh": 41}]') == [
        ForecastRow("FR", T0, 41.0)]
    assert parse_json('{"zone": "DE", "forecast": [{"datetime": "2020-06-01T00:00:00.000Z", "carbonIntensity": 302}]}'
                      ) == [ForecastRow("DE", T0, 302.0)]
    gb = ('{"data": [{"from": "2020-06-01T00:00Z", "to": "2020-06-01T00:30Z", "intensity": {"forecast": 266, '
          '"actual": 263}}, {"from": "2020-06-01T00:30Z", "intensity": {"forecast": 250, "actual": null}}]}')
    assert parse_json(gb, "GB") == [ForecastRow("GB", T0, 263.0), ForecastRow("GB", T0 + 1800, 250.0)]


def test_bad_provider_json_names_its_path() -> None:
    """A missing field is reported with its JSON path; the GB API without a zone says so."""
    with pytest.raises(ForecastError, match=r"\$\.forecast\[1\]: missing field 'carbonIntensity'"):
        parse_json('{"zone": "DE", "forecast": [{"datetime": "2020-06-01T00:00Z", "carbonIntensity": 1}, '
                   '{"datetime": "2020-06-01T01:00Z"}]}')
    with pytest.raises(ForecastError, match="GB API names no zone"):
        parse_json('{"data": []}')


def test_the_last_row_holds_one_step_and_time_past_the_horizon_costs_the_mean() -> None:
    """A step function: values hold until the next row; the horizon is one step past the last row."""
    forecast = StepForecast.of_points([(0.0, 100.0), (H, 300.0)])
    assert forecast.end_s == 2 * H and forecast.value_at(1.5 * H) == 300.0 and forecast.value_at(2 * H) is None
    assert forecast.mean(0.5 * H, 1.5 * H) == pytest.approx(200.0)
    assert forecast.mean(2 * H, 3 * H) == pytest.approx(200.0)  # past the horizon: the forecast's mean


def test_a_newer_forecast_replaces_the_older_from_its_first_row_and_keeps_the_past() -> None:
    """The book holds the latest known value of each time: old values before the new rows stay."""
    book = ForecastBook()
    assert book.update(hourly(300, 310, 320, 330), T0) == {"DE"}
    assert book.update(hourly(50, 60, start=T0 + 2 * H), T0 + 2 * H) == {"DE"}
    forecast = book.forecast("DE")
    assert forecast is not None and forecast.points() == [(T0, 300.0), (T0 + H, 310.0), (T0 + 2 * H, 50.0),
                                                          (T0 + 3 * H, 60.0)]
    assert book.update(hourly(50, 60, start=T0 + 2 * H), T0 + 2 * H) == set()  # the same values: no change


def test_two_values_for_one_time_are_refused_and_nothing_is_merged() -> None:
    """Rows that contradict each other are an error, and the book keeps what it had."""
    book = ForecastBook()
    book.update(hourly(300), T0)
    with pytest.raises(ForecastError, match="zone DE has two values at 2020-06-01T01:00:00Z"):
        book.update([ForecastRow("DE", T0 + H, 1.0), ForecastRow("DE", T0 + H, 2.0)], T0)
    assert book.forecast("DE").points() == [(T0, 300.0)]  # type: ignore[union-attr]


def test_a_forecast_is_unusable_when_old_ended_or_missing_and_says_why() -> None:
    """Staleness: received too long ago, no value for now, or no forecast at all, each with a reason."""
    book = ForecastBook(max_age_s=6 * H)
    book.update(hourly(*[300] * 48), T0)
    assert book.usable("DE", T0 + H)[0] is not None
    assert book.usable("DE", T0 + 7 * H) == (
        None, "the carbon forecast for DE is stale: received 7.0 h ago (limit 6 h)")
    assert book.usable("FR", T0) == (None, "no carbon forecast for zone FR")
    book.update(hourly(300, 300), T0 + 10 * H)
    assert book.usable("DE", T0 + 10 * H) == (None, "the carbon forecast for DE ended at 2020-06-01T02:00:00Z")


# ----------------------------------------------------------------------------------------- sources


def test_a_source_names_a_file_a_command_or_an_http_provider() -> None:
    """--carbon-forecast values: a path (or file:), cmd:COMMAND, an http(s) URL; an empty one is refused."""
    assert (parse_source("forecast.csv").kind, parse_source("file:/x.csv").target) == ("file", "/x.csv")
    assert parse_source("cmd: fetch-ci --zone DE", zone="de").target == "fetch-ci --zone DE"
    assert parse_source("cmd:x", zone="de").zone == "DE"
    assert parse_source("https://api.example/ci").kind == "http"
    with pytest.raises(ValueError, match="needs a file path, cmd:COMMAND or an http"):
        parse_source("  ")
    with pytest.raises(ValueError, match="names no command"):
        parse_source("cmd:")


def test_a_feed_keeps_the_previous_forecast_when_a_fetch_fails_and_retries_sooner() -> None:
    """Bad output is a failure: the book keeps its rows, the retry comes after 30 s, 60 s, ... up to the interval."""
    book = ForecastBook()
    feed = ForecastFeed(parse_source("cmd:x", zone="DE", interval_s=600), book)
    assert feed.due(T0)
    outcome = feed.fetched("DE,2020-06-01T00:00Z,300\n", T0)
    assert outcome.changed == {"DE"} and outcome.rows == 1 and feed.next_s == T0 + 600
    outcome = feed.fetched("DE,noon,300\n", T0 + 600)
    assert "line 1: time 'noon'" in outcome.error and not outcome.changed
    assert book.forecast("DE").points() == [(T0, 300.0)]  # type: ignore[union-attr]
    assert feed.next_s == T0 + 630
    feed.failed("exit status 1", T0 + 630)
    assert feed.next_s == T0 + 690 and feed.failures == 2
    assert feed.fetched("DE,2020-06-01T00:00Z,200\n", T0 + 690).changed == {"DE"} and feed.failures == 0


def test_a_file_is_read_again_only_when_it_changed() -> None:
    """The driver compares (mtime, size) stamps; an unchanged file is not parsed again."""
    feed = ForecastFeed(parse_source("ci.csv"), ForecastBook())
    assert feed.file_changed((1, 10))
    feed.fetched("DE,2020-06-01T00:00Z,300\n", T0, stamp=(1, 10))
    assert not feed.file_changed((1, 10)) and feed.file_changed((2, 10))
    feed.unchanged(T0 + 900)
    assert not feed.due(T0 + 1000) and feed.due(T0 + 1800)


# ---------------------------------------------------------------------------------------- decision


def test_a_plan_is_held_for_the_greenest_window_and_says_so() -> None:
    """The least forecast mean over its run wins; the waiting reason names the time and both figures."""
    now = T0 + 600
    shifter = shifter_with(hourly(300, 310, 52, 320, 330, 340), now)
    decision = only(shifter.submit(plan("p", T0 + 6 * H), now))
    assert isinstance(decision, Hold) and decision.start_s == T0 + 2 * H and decision.zone == "DE"
    assert decision.reason() == "deferred for carbon until 02:00 (52 g/kWh vs 302 now)"
    assert decision.reason(timezone(timedelta(hours=2))) == "deferred for carbon until 04:00 (52 g/kWh vs 302 now)"
    assert shifter.hold_of("p") == decision and shifter.next_wake_s() == T0 + 2 * H


def test_a_start_more_than_a_day_away_shows_its_date() -> None:
    """The reason's time carries the date when the start is not within the next 24 hours."""
    shifter = shifter_with(hourly(*[300] * 30, 40, 300, 300), T0)
    decision = only(shifter.submit(plan("p", T0 + 40 * H), T0))
    assert isinstance(decision, Hold) and decision.reason().startswith("deferred for carbon until 2020-06-02 06:00 ")


def test_a_plan_whose_deadline_leaves_no_slack_runs_now() -> None:
    """Latest start = deadline - run x (1 + run_margin) - queue margin; at or before now, it runs now."""
    config = ShiftConfig(run_margin=0.2, queue_margin_s=300)
    shifter = shifter_with(hourly(300, 310, 52, 320), T0, config)
    assert latest_start_s(plan("p", T0 + 2 * H), config) == T0 + 2 * H - 1.2 * H - 300
    decision = only(shifter.submit(plan("p", T0 + 1.2 * H + 300), T0))
    assert decision == Run("p", "its deadline leaves no time to wait", "DE")
    assert isinstance(only(shifter.submit(Deferrable("q", T0 + 3.2 * H, H, ("DE",), run_margin=0.0), T0)), Hold)


def test_a_plan_never_waits_past_its_latest_start_for_a_greener_hour() -> None:
    """A greener hour after the latest start is not a candidate; the best one before it is."""
    shifter = shifter_with(hourly(300, 200, 310, 10, 10), T0)
    decision = only(shifter.submit(plan("p", T0 + 3 * H), T0))
    assert isinstance(decision, Hold) and decision.start_s == T0 + H


@pytest.mark.parametrize(("book_rows", "now", "reason"), [
    ([], T0, "no carbon forecast for zone DE"),
    (hourly(300, 52), T0 + 3 * H, "the carbon forecast for DE ended at 2020-06-01T02:00:00Z"),
])
def test_no_usable_forecast_means_run_now_with_the_reason(book_rows: list[ForecastRow], now: float,
                                                          reason: str) -> None:
    """Missing or stale forecasts degrade to running at once, never to a wait."""
    shifter = shifter_with(book_rows, T0)
    assert only(shifter.submit(plan("p", now + 10 * H), now)) == Run("p", reason, "DE")


def test_a_gain_below_min_gain_runs_now() -> None:
    """A window 1 % greener is not worth holding for with min_gain 2 %; 5 % is."""
    config = ShiftConfig(queue_margin_s=0, min_gain=0.02)
    assert isinstance(only(shifter_with(hourly(300, 297, 300), T0, config).submit(plan("p", T0 + 3 * H), T0)), Run)
    assert isinstance(only(shifter_with(hourly(300, 285, 300), T0, config).submit(plan("p", T0 + 3 * H), T0)), Hold)


def test_several_zones_pick_the_greener_one_and_name_it() -> None:
    """With workers in two zones the plan is held for the greenest (zone, start) and the reason names the zone."""
    shifter = shifter_with(hourly(300, 300, 300, zone="DE") + hourly(90, 60, 90, zone="FR"), T0)
    decision = only(shifter.submit(plan("p", T0 + 3 * H, zones=("DE", "FR")), T0))
    assert isinstance(decision, Hold) and (decision.zone, decision.start_s) == ("FR", T0 + H)
    assert decision.reason() == "deferred for carbon until 01:00 in FR (60 g/kWh vs 90 now)"


def test_a_new_forecast_in_another_of_its_zones_moves_a_held_plan_there() -> None:
    """A plan held in DE that may also run in FR is re-planned when FR's forecast changes."""
    shifter = shifter_with(hourly(300, 100, 300, zone="DE") + hourly(300, 300, 300, zone="FR"), T0)
    held = only(shifter.submit(plan("p", T0 + 3 * H, zones=("DE", "FR")), T0))
    assert isinstance(held, Hold) and held.zone == "DE"
    moved = only(shifter.update_forecast(hourly(300, 300, 300, 300, zone="FR")[:1] + hourly(20, 300, zone="FR",
                                                                                         start=T0 + H), T0 + 60))
    assert isinstance(moved, Hold) and (moved.zone, moved.start_s) == ("FR", T0 + H)


def test_a_green_hour_takes_only_as_many_plans_as_it_has_slots() -> None:
    """Capacity-aware: with 2 slots (hold share 1) five plans fill the green hour, then the next best, all in time."""
    shifter = shifter_with(hourly(300, 50, 100, 150, 300, 300), T0, ShiftConfig(queue_margin_s=0, hold_share=1.0))
    shifter.set_slots("DE", 2)
    starts = []
    for i in range(5):
        decision = only(shifter.submit(plan(f"p{i}", T0 + 5 * H), T0))
        assert isinstance(decision, Hold)
        starts.append(decision.start_s)
    assert sorted(starts) == [T0 + H, T0 + H, T0 + 2 * H, T0 + 2 * H, T0 + 3 * H]
    assert max(shifter.used("DE", T0 + k * H) for k in range(6)) == 2


def test_held_plans_leave_the_headroom_to_plans_that_need_it() -> None:
    """Holds fill at most hold_share of the slots; a plan with no window within that share may use the rest."""
    shifter = shifter_with(hourly(300, 50, 300, 300), T0, ShiftConfig(queue_margin_s=0, run_margin=0, hold_share=0.5))
    shifter.set_slots("DE", 2)
    first = only(shifter.submit(plan("loose", T0 + 4 * H), T0))
    assert isinstance(first, Hold) and first.start_s == T0 + H
    second = only(shifter.submit(plan("loose2", T0 + 4 * H), T0))
    assert not (isinstance(second, Hold) and second.start_s == T0 + H)  # the green hour's other slot stays free
    assert shifter.used("DE", T0 + H) == 1
    tight = only(shifter.submit(plan("tight", T0 + 3 * H, run_s=2 * H), T0))  # every window overlaps 01:00
    assert isinstance(tight, Run) and shifter.stats.no_room == 0 and shifter.used("DE", T0 + H) == 2


def test_a_tight_plan_takes_the_slot_of_a_looser_hold_which_moves() -> None:
    """No room for a new plan: the held plans of its zone are re-planned with it, tightest latest start first."""
    config = ShiftConfig(queue_margin_s=0, run_margin=0, hold_share=1.0)
    shifter = shifter_with(hourly(300, 50, 100, 300, 300), T0, config)
    shifter.set_slots("DE", 1)
    shifter.started("busy", "DE", T0, H)  # the one slot is taken until 01:00
    assert only(shifter.submit(plan("loose", T0 + 5 * H), T0)).start_s == T0 + H  # type: ignore[union-attr]
    decisions = {d.plan_id: d for d in shifter.submit(plan("tight", T0 + 2 * H), T0)}
    assert next(iter(decisions)) == "tight" and shifter.stats.no_room == 0
    assert isinstance(decisions["tight"], Hold) and decisions["tight"].start_s == T0 + H
    assert isinstance(decisions["loose"], Hold) and decisions["loose"].start_s == T0 + 2 * H


def test_a_changed_forecast_moves_a_held_plan() -> None:
    """Re-plan on forecast change: a new greener hour moves the hold, and the decision says where."""
    shifter = shifter_with(hourly(300, 50, 300, 300, 300), T0)
    assert only(shifter.submit(plan("p", T0 + 5 * H), T0)).start_s == T0 + H  # type: ignore[union-attr]
    moved = only(shifter.update_forecast(hourly(300, 280, 300, 20, 300), T0 + 600))
    assert isinstance(moved, Hold) and moved.start_s == T0 + 3 * H
    assert shifter.tick(T0 + H) == [] and shifter.next_wake_s() == T0 + 3 * H


def test_a_forecast_change_that_makes_now_greenest_releases_the_plan() -> None:
    """When the new forecast puts the greenest window at now, the held plan runs now."""
    shifter = shifter_with(hourly(300, 50, 300), T0)
    shifter.submit(plan("p", T0 + 3 * H), T0)
    released = only(shifter.update_forecast(hourly(20, 300, 300), T0 + 60))
    assert isinstance(released, Run) and shifter.held() == []


def test_a_held_plan_is_released_when_its_start_comes() -> None:
    """tick at the start releases it once; a tick before does nothing."""
    shifter = shifter_with(hourly(300, 50, 300), T0)
    shifter.submit(plan("p", T0 + 3 * H), T0)
    assert shifter.tick(T0 + H - 1) == []
    assert shifter.tick(T0 + H) == [Run("p", "its greener window began", "DE")]
    assert shifter.tick(T0 + H + 1) == [] and shifter.next_wake_s() is None


def test_an_owner_can_release_a_held_plan_early() -> None:
    """release runs it now; its reservation moves to now; a plan not held gives None."""
    shifter = shifter_with(hourly(300, 50, 300), T0)
    shifter.set_slots("DE", 4)
    shifter.submit(plan("p", T0 + 3 * H), T0)
    assert shifter.release("p", T0 + 60) == Run("p", "released early", "DE")
    assert shifter.release("p", T0 + 60) is None and shifter.held() == []
    assert shifter.used("DE", T0 + 60) == 1 and shifter.used("DE", T0 + H + Q) == 0  # 00:01-01:01 reserved


def test_a_forecast_that_goes_stale_while_held_runs_the_plan_at_the_next_quantum() -> None:
    """A provider that stops: at the next quantum start the held plan is re-planned and runs now."""
    shifter = TimeShifter(ForecastBook(max_age_s=H), ShiftConfig(queue_margin_s=0))
    shifter.update_forecast(hourly(*[300] * 5, 10, 300), T0)
    shifter.tick(T0)
    assert isinstance(only(shifter.submit(plan("p", T0 + 7 * H), T0)), Hold)
    assert shifter.tick(T0 + H) == []  # received an hour ago: still usable
    released = only(shifter.tick(T0 + H + Q))
    assert isinstance(released, Run) and "stale" in released.reason


def test_a_slot_freed_early_lets_a_held_plan_move_into_it_at_the_next_quantum() -> None:
    """A plan that ends early frees a full quantum; the zone's holds are re-planned at the next quantum start."""
    shifter = shifter_with(hourly(300, 50, 100, 300), T0, ShiftConfig(queue_margin_s=0, hold_share=1.0))
    shifter.set_slots("DE", 1)
    shifter.tick(T0)
    assert only(shifter.submit(plan("a", T0 + 4 * H), T0)).start_s == T0 + H  # type: ignore[union-attr]
    assert only(shifter.submit(plan("b", T0 + 4 * H), T0)).start_s == T0 + 2 * H  # type: ignore[union-attr]
    assert shifter.tick(T0 + H) == [Run("a", "its greener window began", "DE")]
    shifter.forget("a", T0 + H + 60)  # a ended after a minute
    assert shifter.next_wake_s() == T0 + H + Q
    moved = only(shifter.tick(T0 + H + Q))
    assert isinstance(moved, Hold) is False and moved.plan_id == "b"  # the rest of the green hour: run now


# -------------------------------------------------------------------------------------- properties


def simulate(shifter: TimeShifter, plans: list[tuple[float, Deferrable, float]], slots: int | None,
             quanta: int, updates: dict[int, list[ForecastRow]] | None = None) -> dict[str, tuple[float, float]]:
    """Run plans (submit time, plan, actual run) in quantum steps; start released ones least latest start first."""
    started: dict[str, tuple[float, float]] = {}
    queue: list[tuple[float, str]] = []
    running: list[tuple[float, str]] = []
    by_id = {p.plan_id: (p, run) for _, p, run in plans}

    def enqueue(decisions: list[Hold | Run]) -> None:
        for d in decisions:
            if isinstance(d, Run):
                heapq.heappush(queue, (latest_start_s(by_id[d.plan_id][0], shifter.config), d.plan_id))

    for k in range(quanta):
        now = T0 + k * Q
        while running and running[0][0] <= now:
            shifter.forget(heapq.heappop(running)[1], now)
        if updates and k in updates:
            enqueue(shifter.update_forecast(updates[k], now))
        for submit_s, p, _ in plans:
            if submit_s == now:
                enqueue(shifter.submit(p, now))
        enqueue(shifter.tick(now))
        while queue and (slots is None or len(running) < slots):
            _, plan_id = heapq.heappop(queue)
            p, run = by_id[plan_id]
            started[plan_id] = (now, now + run)
            heapq.heappush(running, (now + run, plan_id))
            assert slots is None or len(running) <= slots
    return started


values = st.lists(st.integers(10, 500), min_size=24, max_size=48)
jobs = st.lists(st.tuples(st.integers(0, 8), st.integers(1, 8), st.integers(0, 24)), min_size=1, max_size=12)


@settings(max_examples=150, deadline=None)
@given(values=values, jobs=jobs, slots=st.integers(1, 4), hold_share=st.sampled_from([0.5, 0.8, 1.0]))
def test_with_exact_forecasts_and_runs_no_plan_misses_its_deadline(values: list[int], jobs: list[tuple[int, int, int]],
                                                                   slots: int, hold_share: float) -> None:
    """Exact forecast, runs as expected, slots enforced: while every decision found room, every deadline is met."""
    config = ShiftConfig(queue_margin_s=0, run_margin=0, min_gain=0, hold_share=hold_share)
    shifter = shifter_with(hourly(*values), T0, config)
    shifter.set_slots("DE", slots)
    plans = []
    for i, (arrive_q, run_q, slack_q) in enumerate(jobs):
        run = run_q * Q
        plans.append((T0 + arrive_q * Q, plan(f"p{i}", T0 + arrive_q * Q + run + slack_q * Q, run), run))
    started = simulate(shifter, plans, slots, quanta=len(values) * 4 + 40)
    if shifter.stats.overbooked == 0:
        for _, p, _ in plans:
            assert started[p.plan_id][1] <= p.deadline_s, (p, started[p.plan_id])


@settings(max_examples=150, deadline=None)
@given(values=values, jobs=jobs, errors=st.lists(st.floats(-0.5, 0.5), min_size=64, max_size=64),  # one an update
       overrun=st.floats(0.0, 1.0), margin=st.sampled_from([0.0, 0.1, 0.5]))
def test_bounded_errors_never_cost_a_deadline(values: list[int], jobs: list[tuple[int, int, int]], errors: list[float],
                                              overrun: float, margin: float) -> None:
    """Forecasts revised by up to ±50 % every quarter, runs up to run_margin longer: every deadline still holds."""
    config = ShiftConfig(queue_margin_s=0, run_margin=margin, min_gain=0)
    shifter = shifter_with(hourly(*values), T0, config)
    plans = []
    for i, (arrive_q, run_q, slack_q) in enumerate(jobs):
        expected = run_q * Q
        deadline = T0 + arrive_q * Q + expected * (1 + margin) + slack_q * Q
        plans.append((T0 + arrive_q * Q, plan(f"p{i}", deadline, expected), expected * (1 + margin * overrun)))
    base = hourly(*values)
    updates = {k: [ForecastRow("DE", r.time_s, r.g_per_kwh * (1 + errors[k // 3])) for r in base]
               for k in range(1, 48 * 4, 3)}  # a revision every third quarter: 64 of them
    started = simulate(shifter, plans, None, quanta=len(values) * 4 + 40, updates=updates)
    for _, p, _ in plans:
        assert started[p.plan_id][0] <= max(latest_start_s(p, config), T0 + math.ceil(
            (latest_start_s(p, config) - T0) / Q) * Q)
        assert started[p.plan_id][1] <= p.deadline_s + 1e-6, (p, started[p.plan_id])


@settings(max_examples=200, deadline=None)
@given(values=values, errors=st.lists(st.floats(-0.2, 0.2), min_size=48, max_size=48), run_q=st.integers(1, 12),
       slack_q=st.integers(0, 40), now_offset=st.integers(0, 899))
def test_a_forecast_within_e_loses_at_most_a_factor_1_plus_e_over_1_minus_e(
        values: list[int], errors: list[float], run_q: int, slack_q: int, now_offset: int) -> None:
    """Forecast values within ±e of the actual: the chosen window's actual mean is within (1+e)/(1-e) of the best."""
    e = 0.2
    now = T0 + now_offset
    actual = StepForecast.of_points([(T0 + i * H, float(v)) for i, v in enumerate(values)])
    rows = [ForecastRow("DE", T0 + i * H, v * (1 + errors[i])) for i, v in enumerate(values)]
    config = ShiftConfig(queue_margin_s=0, run_margin=0, min_gain=0)
    shifter = shifter_with(rows, now, config)
    run = run_q * Q
    p = plan("p", now + run + slack_q * Q, run)
    decision = only(shifter.submit(p, now))
    start = decision.start_s if isinstance(decision, Hold) else now
    latest = min(latest_start_s(p, config), actual.end_s)
    candidates = [now] + [k * Q for k in range(math.floor(now / Q) + 1, math.floor(latest / Q) + 1)
                          if k * Q < actual.end_s]
    best = min(actual.mean(s, s + run) for s in candidates)
    assert actual.mean(start, start + run) <= best * (1 + e) / (1 - e) + 1e-9


# -------------------------------------------------------------------------------------- accounting


def test_avoided_emissions_use_one_source_for_both_windows() -> None:
    """avoided = E x (mean at submit - mean as run), over the same duration, from the same values; not clamped."""
    intensity = StepForecast.of_points([(T0, 300.0), (T0 + H, 50.0), (T0 + 2 * H, 400.0), (T0 + 3 * H, 400.0)])
    moved = avoided_co2e(intensity, 2.0, T0, T0 + H, H)
    assert moved is not None and (moved.avoided_co2e_g, moved.ran_g_per_kwh, moved.at_submit_g_per_kwh) == (
        500.0, 50.0, 300.0)
    worse = avoided_co2e(intensity, 2.0, T0, T0 + 2 * H, H)
    assert worse is not None and worse.avoided_co2e_g == -200.0  # ran dirtier: counts against
    assert avoided_co2e(intensity, 2.0, T0, T0, H).avoided_co2e_g == 0.0  # type: ignore[union-attr]
    assert avoided_co2e(intensity, 2.0, T0, T0 + 3.5 * H, H) is None  # past what the values cover
    assert avoided_co2e(None, 2.0, T0, T0, H) is None


def test_the_reason_uses_the_given_time_zone() -> None:
    """The driver chooses the time zone the waiting reason is written in."""
    hold = Hold("p", datetime(2020, 6, 1, 14, 30, tzinfo=UTC).timestamp(), "DE", 52.0, 310.0, T0, T0 + 20 * H)
    assert hold.reason() == "deferred for carbon until 14:30 (52 g/kWh vs 310 now)"
