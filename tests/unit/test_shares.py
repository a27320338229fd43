"""Recent placement shares (kv_aware's bounded load): decay per placement, claims counted, knobs checked."""

from __future__ import annotations

import math

import pytest

from coordinator.placement.placer import Placement, PlacementConfig
from coordinator.placement.policies import PolicyKnobs
from coordinator.placement.shares import RecentShares
from coordinator.plans import Plan
from coordinator.registry import WorkerRegistry
from fleetwire.cli.main import build_parser
from fleetwire.cli.serve import routing_settings
from protocol.messages import Capabilities, Requirements, RoutingHints


def test_each_placement_fades_every_weight_by_one_step() -> None:
    """A weight is the sum of decay ** (placements since) over the worker's placements."""
    shares = RecentShares(window=4)  # decay 0.75
    shares.add("a")
    shares.add("a")
    shares.add("b")
    assert shares.of("a") == pytest.approx(0.75 + 0.75**2)
    assert shares.of("b") == pytest.approx(1.0) and shares.of("never") == 0.0
    shares.forget("a")
    assert shares.of("a") == 0.0
    with pytest.raises(ValueError, match="window"):
        RecentShares(0.5)


def test_window_of_one_remembers_only_the_last_placement() -> None:
    """With window 1 only the latest placement counts, so the bound compares against nothing older."""
    shares = RecentShares(window=1)
    shares.add("a")
    shares.add("b")
    assert (shares.of("a"), shares.of("b")) == (0.0, 1.0)


def test_placement_counts_each_claim_and_forgets_reaped_workers() -> None:
    """Placement.claimed adds the plan to its worker's share; a reaped worker's share is dropped."""
    registry = WorkerRegistry(30.0)
    placement = Placement(registry, {}, PlacementConfig(knobs=PolicyKnobs(kv_share_window=2)))
    worker = registry.register("w1", Capabilities(ops=["x"], max_concurrency=4), 0.0)
    placement.registered(worker)
    plan = Plan(id="p", op="x", args=None, requirements=Requirements(), priority=0, timeout_s=None, max_attempts=1,
                owner="o", order=0, hints=RoutingHints())
    placement.claimed(plan, worker)
    placement.claimed(plan, worker)
    assert placement.recent_placements(worker) == pytest.approx(1.5)
    placement.forget(["w1"])
    assert placement.recent_placements(worker) == 0.0


def test_bad_knobs_are_refused_by_the_placement_config_and_the_flag_reaches_it() -> None:
    """PlacementConfig.check names a bad kv_load_bound; --policy-option kv_load_bound=0.1 reaches the knobs."""
    with pytest.raises(ValueError, match="kv_load_bound"):
        PlacementConfig(knobs=PolicyKnobs(kv_load_bound=-1)).check()
    ns = build_parser().parse_args(
        ["coordinator", "--policy-option", "kv_load_bound=0.1", "--policy-option", "kv_share_window=512"]
    )
    knobs = routing_settings(ns)["placement"].knobs
    assert (knobs.kv_load_bound, knobs.kv_share_window) == (0.1, 512.0)
    assert math.isinf(routing_settings(build_parser().parse_args(["coordinator"]))["placement"].knobs.kv_load_bound)
