"""A clean stop is not a crash: heartbeat.leaving drains at once, goodbye removes the worker (counted as left)."""

from __future__ import annotations

from structlog.testing import capture_logs

from protocol import errors
from protocol.messages import Assign, DrainWorker, Goodbye, Heartbeat, Ok, UndrainWorker
from tests.unit.test_core import Harness, only
from tests.unit.test_operator import admin, ask


def test_goodbye_removes_the_worker_at_once_counted_as_left_not_reaped() -> None:
    """After goodbye the worker is gone from the registry now; the reaper later finds nothing and warns nothing."""
    h = Harness()
    w = h.worker("w1")
    h.send(w, Goodbye(reason="SIGTERM"))
    assert (w, errors.CLOSE_NORMAL, "goodbye") in h.closes
    assert "w1" not in h.core.registry
    assert h.core.counters["workers_left"] == 1
    with capture_logs() as logs:
        assert h.tick(120.0) == []
    assert h.core.counters["workers_reaped"] == 0
    assert not [e for e in logs if e["log_level"] == "warning"]


def test_leaving_heartbeat_stops_new_plans_before_goodbye() -> None:
    """A heartbeat with leaving=true: the next plan waits for another worker instead of being assigned here."""
    h = Harness()
    w = h.worker("w1", max_concurrency=4)
    c = h.client()
    h.send(w, Heartbeat(leaving=True))
    plan = h.submit(c)
    assert not [m for m in h.take(w) if isinstance(m, Assign)]
    assert h.state(plan) == "queued"
    w2 = h.worker("w2")
    assert only(h.take(w2), Assign).plan_id == plan


def test_a_leaving_worker_that_registers_again_takes_plans() -> None:
    """The drain a worker put on itself with leaving=true ends when it registers again."""
    h = Harness()
    w = h.worker("w1")
    h.send(w, Heartbeat(leaving=True))
    h.close(w)  # it crashed instead of saying goodbye
    w = h.worker("w1")
    c = h.client()
    plan = h.submit(c)
    assert only(h.take(w), Assign).plan_id == plan


def test_an_operator_drain_outlives_the_goodbye() -> None:
    """A worker drained by an operator that restarts (goodbye, hello) comes back still drained; undrain works."""
    h = Harness()
    w = h.worker("w1")
    ask(h, admin(h), DrainWorker(req_id=1, worker_id="w1"), Ok)
    h.send(w, Heartbeat(leaving=True))
    h.send(w, Goodbye(reason="SIGTERM"))
    assert "w1" not in h.core.registry
    w = h.worker("w1")
    assert h.core.registry.get("w1").draining
    c = h.client()
    plan = h.submit(c)
    assert not [m for m in h.take(w) if isinstance(m, Assign)]
    ask(h, admin(h), UndrainWorker(req_id=2, worker_id="w1"), Ok)
    assert only(h.take(w), Assign).plan_id == plan
