"""Deadlines kept in the plan rows of both durable stores (SQLite, and PostgreSQL when tests/pg.py finds one):
a plan held for carbon is restored held with its reason, or queued at once when its latest start passed
while the coordinator was down (coordinator/carbon_holds.py, docs/SEMANTICS.md §Deadlines)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from coordinator.io.stores.store import Store, open_store
from protocol.messages import Assign
from tests.unit.test_carbon_holds import T0, H, forecast, start, worker
from tests.unit.test_core import only
from tests.unit.test_durability_core import Durable


@pytest.fixture(params=["sqlite", "postgresql"])
def reopen(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Callable[[], Store]]:
    """Opens the same store again each call (the previous one closed first)."""
    opened: list[Store] = []
    if request.param == "sqlite":
        def make() -> Store:
            return open_store(f"sqlite:{tmp_path / 'coordinator.sqlite3'}")
    else:
        from coordinator.io.stores.postgres import PgStore
        from tests.integration.test_pg_store import CLUSTER, hold

        dsn = request.getfixturevalue("pg_dsn")

        def make() -> Store:
            return hold(PgStore(dsn, CLUSTER))

    def again() -> Store:
        if opened:
            opened[-1].close()
        opened.append(make())
        return opened[-1]

    yield again
    opened[-1].close()


def held_and_stopped(reopen: Callable[[], Store]) -> tuple[Durable, str]:
    """A plan due at T+9 h that runs 1 h, held until the 50 g/kWh step at T+3 h; then the store is reopened."""
    h = Durable()
    h.store = reopen()  # type: ignore[assignment]
    start(h, T0)
    worker(h, "w1")
    forecast(h, [300, 280, 250, 50, 60, 290, 300, 310, 320, 330])
    plan_id = h.submit(h.client(), deadline_s=9 * H, expected_run_s=H)
    assert plan_id in h.core.carbon.held
    h.store = reopen()  # type: ignore[assignment]
    return h, plan_id


def test_a_held_plan_is_restored_held_with_its_deadline_and_reason(reopen: Callable[[], Any]) -> None:
    """Restarted before its step: its absolute deadline, submit time and reason come back from the rows."""
    h, plan_id = held_and_stopped(reopen)
    h.restart(T0 + H)
    plan = h.core.plans[plan_id]
    assert (plan.deadline_at, plan.submitted_at, plan.deferred_until) == (T0 + 9 * H, T0, T0 + 3 * H)
    assert plan.waiting_reason.startswith("deferred for carbon until 03:00") and plan_id not in h.core.queue


def test_a_held_plan_whose_latest_start_passed_during_the_downtime_runs_at_once(reopen: Callable[[], Any]) -> None:
    """Restarted past its latest start (T+9 h - 1.2 h - 5 min): queued at restore, leased by the first worker."""
    h, plan_id = held_and_stopped(reopen)
    h.restart(T0 + 8 * H)
    assert plan_id in h.core.queue
    w = worker(h, "w1")
    assert only(h.take(w), Assign).plan_id == plan_id
