"""Carbon time shifting in the core (coordinator/carbon_holds.py), driven with a fake clock and forecasts:
held until the greener step, placed at once without a deadline or a usable forecast, released early,
cancelled, re-planned, accounted in the receipt, and kept across a restart."""

from __future__ import annotations

from typing import Any

import pytest
from structlog.testing import capture_logs

from coordinator.carbon_time import ForecastRow, parse_time
from coordinator.records import PlanCreated, PlanStatus
from protocol.messages import (
    Accept,
    Assign,
    Capabilities,
    Done,
    Error,
    Event,
    GetUsage,
    Heartbeat,
    Hello,
    PlanReply,
    Receipt,
    ReleasePlan,
    Usage,
    Welcome,
)
from tests.unit.test_core import Harness, only
from tests.unit.test_durability_core import Durable

T0 = parse_time("2020-06-01T00:00:00Z")  # the fake clock's now is Unix time (wall offset 0)
H = 3600.0
QUIET = {"heartbeat_timeout_s": 30 * 86400.0}  # hours pass in these tests without heartbeats


def forecast(h: Harness, values: list[float], zone: str = "DE", start: float = T0, step: float = H) -> None:
    """Hourly steps of ``zone`` from ``start``, received now; the core re-plans what they touch."""
    rows = [ForecastRow(zone, start + i * step, value) for i, value in enumerate(values)]
    h.core.forecast_changed(h.core.carbon.book.update(rows, h.now), h.now)
    h._pump()


def worker(h: Harness, worker_id: str, zone: str = "DE", slots: int = 4, ops: tuple[str, ...] = ("echo",)) -> int:
    """A worker in ``zone`` with ``slots`` plans at once."""
    conn = next(h._conns)
    h.core.open_session(conn, "worker", h.now)
    caps = Capabilities(cpu_cores=4, ops=list(ops), max_concurrency=slots, carbon_zone=zone)
    h.send(conn, Hello(worker_id=worker_id, capabilities=caps))
    h.inbox[conn] = [m for m in h.inbox.get(conn, []) if not isinstance(m, Welcome)]
    return conn


def reasons(events: list[Any]) -> list[str]:
    return [e.data["reason"] for e in events if isinstance(e, Event) and e.kind == "waiting"]


def beat_and_tick(h: Harness, at: float, *workers: int) -> None:
    """The workers beat at ``at``, then the core ticks."""
    h.now = at
    for conn in workers:
        h.send(conn, Heartbeat())
    h.tick(at)


def start(h: Harness, at: float) -> Harness:
    h.now = at
    h.tick(at)
    return h


# ---------------------------------------------------------------- hold and release


def test_a_plan_with_a_deadline_is_held_until_the_greener_step_then_placed() -> None:
    """Green at 03:00: a plan due by 09:00 is held (its reason says until when) and leased when 03:00 comes."""
    h = start(Harness(**QUIET), T0)
    w = worker(h, "w1")
    forecast(h, [300, 280, 250, 50, 60, 290, 300, 310, 320, 330])
    c = h.client()
    plan_id = h.submit(c, deadline_s=9 * H, expected_run_s=H)
    assert h.state(plan_id) == "queued" and plan_id in h.core.carbon.held
    assert reasons(h.take(c)) == ["deferred for carbon until 03:00 (50 g/kWh vs 300 now)"]
    assert not h.take(w)  # nothing assigned yet
    h.tick(T0 + 3 * H - 1)
    assert not h.take(w)
    h.tick(T0 + 3 * H)
    assert only(h.take(w), Assign).plan_id == plan_id
    assert h.state(plan_id) == "leased" and not h.core.carbon.held
    assert h.core.counters["carbon_held"] == h.core.counters["carbon_released"] == 1


def test_a_plan_without_a_deadline_is_placed_at_once_whatever_the_forecast() -> None:
    """No deadline: leased on submit, as before issue #31, even when a greener hour comes later."""
    h = start(Harness(**QUIET), T0)
    w = worker(h, "w1")
    forecast(h, [300, 50, 300])
    c = h.client()
    plan_id = h.submit(c)
    assert only(h.take(w), Assign).plan_id == plan_id
    assert h.core.counters["carbon_not_held"] == 0 and not h.core.carbon.held


def test_without_a_forecast_a_plan_with_a_deadline_is_placed_at_once_and_why_is_logged() -> None:
    """No forecast for the worker's zone: placed at once, counted, and the reason logged once (not per plan)."""
    h = start(Harness(**QUIET), T0)
    w = worker(h, "w1", slots=4)
    c = h.client()
    with capture_logs() as logs:
        first = h.submit(c, deadline_s=9 * H, expected_run_s=H)
        second = h.submit(c, deadline_s=9 * H, expected_run_s=H)
    assert {a.plan_id for a in h.take(w) if isinstance(a, Assign)} == {first, second}
    said = [e for e in logs if e["event"] == "plan with a deadline placed at once"]
    assert len(said) == 1 and said[0]["reason"] == "no carbon forecast for zone DE"
    assert h.core.counters["carbon_not_held"] == 2


def test_a_plan_whose_op_was_never_seen_and_gives_no_run_time_is_not_held() -> None:
    """No expected_run_s and no observed run of its op: nothing to plan with, placed at once."""
    h = start(Harness(**QUIET), T0)
    w = worker(h, "w1")
    forecast(h, [300, 280, 250, 50, 60, 290, 300, 310, 320, 330])
    c = h.client()
    plan_id = h.submit(c, deadline_s=9 * H)
    assert only(h.take(w), Assign).plan_id == plan_id


def test_the_ops_observed_median_run_is_the_expected_run_of_a_plan_that_gives_none() -> None:
    """After runs of its op are seen, a plan without expected_run_s is held by their median."""
    h = start(Harness(**QUIET), T0)
    w = worker(h, "w1")
    c = h.client()
    for run_s in (100.0, 200.0, 300.0):
        plan_id = h.submit(c)
        attempt = only(h.take(w), Assign).attempt
        h.send(w, Accept(plan_id=plan_id, attempt=attempt))
        h.now += run_s
        h.send(w, Done(plan_id=plan_id, attempt=attempt, outcome="succeeded"))
    assert h.core.carbon.runs.expected("echo") == (200.0, 0.5)
    h.now = T0
    forecast(h, [300, 280, 250, 50, 60, 290, 300, 310, 320, 330])
    held = h.submit(c, deadline_s=9 * H)
    assert held in h.core.carbon.held and not [m for m in h.take(w) if isinstance(m, Assign)]


def test_release_places_a_held_plan_now_for_its_owner_or_an_admin_only() -> None:
    """release_plan: another principal's answer is plan_not_found and nothing moves; the owner's places it."""
    h = start(Harness(**QUIET), T0)
    w = worker(h, "w1")
    forecast(h, [300, 280, 250, 50, 60, 290, 300, 310, 320, 330])
    alice, mallory = h.client("alice"), h.client("mallory")
    plan_id = h.submit(alice, deadline_s=9 * H, expected_run_s=H)
    h.send(mallory, ReleasePlan(req_id=1, plan_id=plan_id))
    assert only(h.take(mallory), Error).code == "plan_not_found" and plan_id in h.core.carbon.held
    h.take(alice)
    h.send(alice, ReleasePlan(req_id=2, plan_id=plan_id))
    assert only(h.take(w), Assign).plan_id == plan_id
    reply = only(h.take(alice), PlanReply)
    assert reply.plan.state == "leased" and not h.core.carbon.held and h.core.carbon.shifter.hold_of(plan_id) is None


def test_a_cancelled_held_plan_leaves_the_planner_and_is_never_placed() -> None:
    """Cancel of a held plan: cancelled, its hold and reservation gone; its start passing places nothing."""
    from protocol.messages import Cancel

    h = start(Harness(**QUIET), T0)
    w = worker(h, "w1")
    forecast(h, [300, 280, 250, 50, 60, 290, 300, 310, 320, 330])
    c = h.client()
    plan_id = h.submit(c, deadline_s=9 * H, expected_run_s=H)
    h.send(c, Cancel(req_id=3, plan_id=plan_id))
    assert h.state(plan_id) == "cancelled" and not h.core.carbon.held
    assert h.core.carbon.shifter.used("DE", T0 + 3 * H) == 0
    h.tick(T0 + 4 * H)
    assert not [m for m in h.take(w) if isinstance(m, Assign)]


def test_a_forecast_that_makes_now_the_greenest_releases_the_held_plan() -> None:
    """A newer forecast in which now is greenest re-plans the held plan: placed at once."""
    h = start(Harness(**QUIET), T0)
    w = worker(h, "w1")
    forecast(h, [300, 280, 250, 50, 60, 290, 300, 310, 320, 330])
    c = h.client()
    plan_id = h.submit(c, deadline_s=9 * H, expected_run_s=H)
    h.now = T0 + 600
    forecast(h, [40, 280, 250, 200, 260, 290, 300, 310, 320, 330])
    assert only(h.take(w), Assign).plan_id == plan_id


def test_a_stale_forecast_releases_the_held_plan_at_the_next_quantum() -> None:
    """The feed stopped: once the forecast is older than the book's max age, the held plan is placed."""
    h = start(Harness(**QUIET), T0)
    w = worker(h, "w1")
    forecast(h, [300] * 24 + [20] * 24, step=H)
    h.core.carbon.book.max_age_s = 2 * H
    c = h.client()
    plan_id = h.submit(c, deadline_s=40 * H, expected_run_s=H)
    assert plan_id in h.core.carbon.held
    h.tick(T0 + 2 * H + 900)
    assert only(h.take(w), Assign).plan_id == plan_id


def test_plans_released_together_are_queued_least_latest_start_first() -> None:
    """Two plans held for the same step and one slot free then: the one with the closer deadline is leased."""
    h = start(Harness(**QUIET), T0)
    w = worker(h, "w1", slots=3)  # held plans may reserve 2 of the 3 slots (hold_share 0.8)
    forecast(h, [300, 280, 250, 50, 60, 290, 300, 310, 320, 330, 330, 330, 330])
    c = h.client()
    loose = h.submit(c, deadline_s=12 * H, expected_run_s=H)
    tight = h.submit(c, deadline_s=6 * H, expected_run_s=H)
    assert {hold.start_s for hold in h.core.carbon.shifter.held()} == {T0 + 3 * H}
    busy = [h.submit(c), h.submit(c)]  # no deadline: placed at once, two slots taken
    assert [m.plan_id for m in h.take(w) if isinstance(m, Assign)] == busy
    h.tick(T0 + 3 * H)
    assert only(h.take(w), Assign).plan_id == tight
    assert h.state(loose) == "queued" and loose in h.core.queue


# ---------------------------------------------------------------- receipts and usage


def test_the_receipt_of_a_held_plan_states_what_it_avoided_and_usage_sums_it() -> None:
    """Held from 300 to 50 g/kWh, 3.6 MJ (1 kWh) over an hour: avoided 250 g, ran at 50; usage sums it."""
    h = start(Harness(**QUIET), T0)
    w = worker(h, "w1")
    forecast(h, [300, 280, 250, 50, 60, 290, 300, 310, 320, 330])
    c = h.client()
    plan_id = h.submit(c, deadline_s=9 * H, expected_run_s=H)
    h.tick(T0 + 3 * H)
    attempt = only(h.take(w), Assign).attempt
    h.send(w, Accept(plan_id=plan_id, attempt=attempt))
    h.now = T0 + 4 * H
    h.send(w, Done(plan_id=plan_id, attempt=attempt, outcome="succeeded", receipt=Receipt(joules=3.6e6, run_s=H)))
    receipt = h.core.plans[plan_id].receipt
    assert receipt is not None
    assert (receipt.avoided_co2e_g, receipt.ran_g_per_kwh, receipt.at_submit_g_per_kwh) == (250.0, 50.0, 300.0)
    succeeded = [e for e in h.take(c) if isinstance(e, Event) and e.kind == "succeeded"]
    assert succeeded[0].data["receipt"].avoided_co2e_g == 250.0
    h.send(c, GetUsage(req_id=4))
    assert only(h.take(c), Usage).rows[0].avoided_co2e_g == 250.0


def test_a_plan_that_was_not_held_avoided_nothing() -> None:
    """A plan with a deadline placed at once (now is greenest): its receipt has no avoided figure."""
    h = start(Harness(**QUIET), T0)
    w = worker(h, "w1")
    forecast(h, [50, 280, 250, 300])
    c = h.client()
    plan_id = h.submit(c, deadline_s=3 * H, expected_run_s=600)
    attempt = only(h.take(w), Assign).attempt
    h.send(w, Accept(plan_id=plan_id, attempt=attempt))
    h.send(w, Done(plan_id=plan_id, attempt=attempt, outcome="succeeded", receipt=Receipt(joules=3.6e6, run_s=60)))
    receipt = h.core.plans[plan_id].receipt
    assert receipt is not None and receipt.avoided_co2e_g is None


# ---------------------------------------------------------------- submit checks and durability


@pytest.mark.parametrize(("fields", "words"), [
    ({"deadline_s": 60.0, "deadline_at": T0 + 60}, "not both"),
    ({"deadline_s": -5.0}, "deadline_s must be a positive number"),
    ({"expected_run_s": float("nan"), "deadline_s": 60.0}, "expected_run_s must be a positive number"),
    ({"deadline_at": (T0 + 3600) * 1000}, "milliseconds?"),
    ({"deadline_s": 400 * 86400.0}, "days away"),
])
def test_a_bad_deadline_is_refused_naming_the_field(fields: dict[str, float], words: str) -> None:
    """Both kinds of deadline, a non-positive or NaN figure, milliseconds or a year away: invalid_argument."""
    h = start(Harness(**QUIET), T0)
    c = h.client()
    h.send(c, __import__("protocol.messages", fromlist=["Submit"]).Submit(req_id=9, op="echo", **fields))
    error = only(h.take(c), Error)
    assert error.code == "invalid_argument" and words in error.message and not h.core.plans


def test_a_relative_deadline_is_recorded_absolute_with_the_submit_time() -> None:
    """deadline_s is stored as deadline_at = submit time + deadline_s; the status keeps the submit time and hold."""
    h = Durable()
    start(h, T0)
    worker(h, "w1")
    forecast(h, [300, 280, 250, 50, 60, 290, 300, 310, 320, 330])
    c = h.client()
    plan_id = h.submit(c, deadline_s=9 * H, expected_run_s=H)
    created = only(h.records, PlanCreated)
    assert (created.submit.deadline_at, created.submit.deadline_s) == (T0 + 9 * H, None)
    status = [r for r in h.records if isinstance(r, PlanStatus) and r.plan_id == plan_id][-1]
    assert (status.submitted_at, status.deferred, status.deferred_until) == (T0, True, T0 + 3 * H)


def test_after_a_restart_a_held_plan_stays_held_and_is_placed_at_its_step() -> None:
    """Restarted before its step: still held (its stored reason kept), decided again, placed when the step comes."""
    h = Durable()
    start(h, T0)
    worker(h, "w1")
    forecast(h, [300, 280, 250, 50, 60, 290, 300, 310, 320, 330])
    c = h.client()
    plan_id = h.submit(c, deadline_s=9 * H, expected_run_s=H)
    h.restart(T0 + H)
    h.core.set_wall_offset(0.0)
    assert h.core.plans[plan_id].waiting_reason.startswith("deferred for carbon until 03:00")
    assert plan_id not in h.core.queue
    w = worker(h, "w1")
    forecast(h, [280, 250, 50, 60, 290, 300, 310, 320, 330], start=T0 + H)
    beat_and_tick(h, T0 + H + 31, w)  # the workers had their heartbeat timeout to come back: decided again
    assert plan_id in h.core.carbon.held and not [m for m in h.take(w) if isinstance(m, Assign)]
    for at in range(int(T0 + H + 60), int(T0 + 3 * H), 20):
        beat_and_tick(h, at, w)
    beat_and_tick(h, T0 + 3 * H, w)
    assert only(h.take(w), Assign).plan_id == plan_id


def test_a_held_plan_whose_latest_start_passed_while_the_coordinator_was_down_runs_at_once() -> None:
    """Down past its latest start (deadline - run x 1.2 - 5 min): queued at restore, leased when a worker comes."""
    h = Durable()
    start(h, T0)
    worker(h, "w1")
    forecast(h, [300, 280, 250, 50, 60, 290, 300, 310, 320, 330])
    c = h.client()
    plan_id = h.submit(c, deadline_s=9 * H, expected_run_s=H)
    h.restart(T0 + 8 * H)
    assert plan_id in h.core.queue and h.core.plans[plan_id].deferred_until is None
    w = worker(h, "w1")
    assert only(h.take(w), Assign).plan_id == plan_id


def test_a_restored_held_plan_is_placed_at_its_stored_step_even_before_the_workers_wait_ends() -> None:
    """Restarted just before its step with a long heartbeat timeout: placed when the step comes, not after the wait."""
    h = Durable(heartbeat_timeout_s=2 * H)
    start(h, T0)
    worker(h, "w1")
    forecast(h, [300, 280, 250, 50, 60, 290, 300, 310, 320, 330])
    c = h.client()
    plan_id = h.submit(c, deadline_s=9 * H, expected_run_s=H)
    h.restart(T0 + 2.5 * H)
    h.core.set_wall_offset(0.0)
    w = worker(h, "w1")
    forecast(h, [250, 50, 60, 290, 300, 310, 320, 330], start=T0 + 2 * H)
    beat_and_tick(h, T0 + 2.5 * H + 60, w)
    assert not [m for m in h.take(w) if isinstance(m, Assign)]
    beat_and_tick(h, T0 + 3 * H, w)
    assert only(h.take(w), Assign).plan_id == plan_id
