"""bench/core_per_plan.py runs at its default size, past the core's per-client plan limit; so do its other sides."""

from __future__ import annotations

from types import ModuleType

from tests import bench_scripts


def _bench() -> ModuleType:
    return bench_scripts.load("core_per_plan.py", "core_per_plan_bench")


def test_default_run_drives_more_plans_than_the_per_client_limit_to_their_end() -> None:
    """All 20,000 plans of the default run finish (one client held 10,000 unfinished, the default limit, and stuck)."""
    from coordinator import CoreConfig

    bench = _bench()
    plans = 20_000
    assert plans > CoreConfig().max_plans_per_client
    assert bench.run_plans(plans, 500) > 0  # raises "stuck after N of M plans" or names a refused submit


def test_client_side_runs_every_plan_to_its_result() -> None:
    """The client side submits its plans through a socketless Client and awaits each one's result."""
    assert _bench().run_client(600, 250) > 0  # a plan without its result would wait for ever: the loop would stall


def test_worker_side_runs_every_plan_and_gets_each_message_acked() -> None:
    """The worker side runs its assigns through a socketless Agent to their done, every message acked."""
    assert _bench().run_worker(600, 250) > 0  # raises when messages are left unacked
