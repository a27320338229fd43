"""Carbon time shifting across a restart, issue #31's done-when scenario, on the core's fake clock.

tests/e2e/test_carbon_shift.py played it with real processes against the wall clock, where a loaded machine's
slow process starts moved the kill and the restart against the forecast's steps. Here the same scenario drives the
core (coordinator/carbon_holds.py) with a fake clock and a store it restarts from (tests/unit/test_durability_core.py
``Durable``), so it cannot flake; the e2e test keeps only what needs processes (the forecast file, ``kill -9``, the
CLI's ``fleetwire release``), none of it timed.

The forecast says 300 g/kWh now, 200 for one second at T+3 and 50 from T+12. Quantum 1 s, queue margin 1 s,
expected runs 1 s (so a latest start is deadline - 2.2 s). A plan without deadline runs at once; one due at T+60 is
held until T+12; one due at T+7 is held until T+3 (its latest start is T+4.8). The coordinator is killed before T+3
and started again at T+5.5: the short plan runs at once after the restart, the long one still at T+12 and within
its deadline, and its receipt states what the wait avoided; a third held plan released (``release_plan``) runs
before.
"""

from __future__ import annotations

from typing import Any

import pytest

from coordinator.carbon_time import ShiftConfig
from coordinator.carbon_time.forecast import ForecastRow
from protocol.messages import Accept, Assign, Done, Event, Heartbeat, PlanReply, Receipt, ReleasePlan
from tests.unit.test_carbon_holds import reasons, worker
from tests.unit.test_durability_core import Durable

T = 1_591_000_000.0  # T, a whole second (the fake clock's now is Unix time: wall offset 0)
SUBMIT_AT = T - 3  # the plans are submitted a few seconds before T (the e2e test's margin for slow starts)
RESTART_AT = T + 5.5  # down from before T+3 until past the short plan's latest start (T+4.8)
DIP, GREEN = 3, 12  # the 200 g/kWh second and the 50 g/kWh step, in seconds after T
ROWS = [(T - 120, 300.0), (T + DIP, 200.0), (T + DIP + 1, 300.0), (T + GREEN, 50.0), (T + 45, 300.0), (T + 90, 300.0)]
CONFIG: dict[str, Any] = {
    "carbon": ShiftConfig(quantum_s=1.0, queue_margin_s=1.0),  # --carbon-option quantum_s=1, queue_margin_s=1
    "heartbeat_interval_s": 0.2,
    "heartbeat_timeout_s": 3.0,
}
JOULES = 360.0  # the green plan's run, as its worker's receipt says


def feed(h: Durable) -> None:
    """The forecast file read (at start, and again after the restart): the core re-plans what it touches."""
    rows = [ForecastRow("DE", at, value) for at, value in ROWS]
    h.core.forecast_changed(h.core.carbon.book.update(rows, h.now), h.now)
    h._pump()


def assigned(h: Durable, w: int) -> list[str]:
    """The plans assigned to the worker since the last look, each accepted as the agent does."""
    plans = []
    for assign in [m for m in h.take(w) if isinstance(m, Assign)]:
        h.send(w, Accept(plan_id=assign.plan_id, attempt=assign.attempt))
        plans.append(assign.plan_id)
    return plans


def done(h: Durable, w: int, plan_id: str, joules: float = 1.0) -> None:
    attempt = h.core.plans[plan_id].attempt
    h.send(w, Done(plan_id=plan_id, attempt=attempt, outcome="succeeded", receipt=Receipt(joules=joules, run_s=1.0)))


def run_until(h: Durable, until: float, w: int, started: dict[str, float]) -> None:
    """A tick every 0.1 s, the worker beating, up to ``until``: when each plan was assigned."""
    at = h.now
    while at < until:
        at = min(until, round(at + 0.1, 6))
        h.now = at
        h.send(w, Heartbeat())
        h.tick(at)
        for plan_id in assigned(h, w):
            started.setdefault(plan_id, at)


@pytest.fixture
def h() -> Durable:
    harness = Durable(**CONFIG)
    harness.now = SUBMIT_AT - 1
    harness.tick(harness.now)
    harness.core.set_wall_offset(0.0)
    return harness


def test_plans_wait_for_the_greener_step_across_a_restart_and_say_what_they_avoided(h: Durable) -> None:
    """Held until the greener step (across a restart), no deadline at once, a passed latest start at once after the
    restart, release_plan at once, deadlines met, and the receipt's avoided gCO2e."""
    w = worker(h, "w1", slots=4, ops=("sleep",))
    feed(h)
    c = h.client()
    h.now = SUBMIT_AT
    started: dict[str, float] = {}
    at_once = h.submit(c, "sleep", args={"seconds": 0.2})
    assert assigned(h, w) == [at_once]  # no deadline: placed at once
    started[at_once] = h.now
    done(h, w, at_once)
    green = h.submit(c, "sleep", args={"seconds": 0.3}, deadline_at=T + 60, expected_run_s=1)
    short = h.submit(c, "sleep", args={"seconds": 0.2}, deadline_at=T + DIP + 4, expected_run_s=1)
    released = h.submit(c, "sleep", args={"seconds": 0.2}, deadline_at=T + 60, expected_run_s=1)
    said: dict[str, list[str]] = {}
    for event in h.take(c):
        if isinstance(event, Event):
            said.setdefault(event.plan_id, []).extend(reasons([event]))
    assert set(h.core.carbon.held) == {green, short, released} and not assigned(h, w)
    run_until(h, T + DIP - 0.5, w, started)  # the kill came before T+3
    assert not (set(started) - {at_once})
    h.restart(RESTART_AT)  # kill -9, and started again past the short plan's latest start (T+4.8)
    h.core.set_wall_offset(0.0)
    feed(h)
    c = h.client()
    w = worker(h, "w1", slots=4, ops=("sleep",))
    for plan_id in assigned(h, w):  # the short plan's window passed while the coordinator was down: at once
        started.setdefault(plan_id, h.now)
    h.now = RESTART_AT + 0.5
    h.send(c, ReleasePlan(req_id=99, plan_id=released))  # fleetwire release
    assert [m.plan.id for m in h.take(c) if isinstance(m, PlanReply)] == [released]
    for plan_id in assigned(h, w):
        started.setdefault(plan_id, h.now)
    released_by = h.now
    run_until(h, T + GREEN + 1, w, started)
    for plan_id in (short, released):
        done(h, w, plan_id)
    h.now = started[green] + 1
    done(h, w, green, joules=JOULES)
    info = h.core.plans[green]
    assert said[green][0].startswith("deferred for carbon until") and "(50 g/kWh vs 300 now)" in said[green][0]
    assert said[short][0].startswith("deferred for carbon until") and "(200 g/kWh vs 300 now)" in said[short][0]
    assert not said.get(at_once) and started[at_once] < T + DIP
    assert started[short] == RESTART_AT < T + GREEN
    assert released_by <= started[released] < started[green]  # released early
    assert started[green] == T + GREEN  # the greener step, after the restart
    assert info.state == "succeeded" and info.ended_at is not None and info.ended_at <= T + 60
    receipt = info.receipt
    assert receipt is not None and receipt.joules > 0
    assert (receipt.ran_g_per_kwh, receipt.at_submit_g_per_kwh) == (50.0, 300.0)
    assert receipt.avoided_co2e_g == pytest.approx(receipt.joules / 3.6e6 * 250)
