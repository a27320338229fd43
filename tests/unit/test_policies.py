"""Placement policies and their derived figures, each driven directly (no core, no clock)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from coordinator.placement.policies import (
    DEFAULT_POLICY,
    POLICY_NAMES,
    Ask,
    CarbonWeighted,
    JouleWeighted,
    KvAware,
    LatencyWeighted,
    LeastBusy,
    PolicyKnobs,
    RoundRobin,
    _mean_known,
    busyness,
    make_policies,
    projected_g,
    projected_uj,
)
from coordinator.workers import WorkerRecord
from protocol.messages import Capabilities, Load


class Fleet:
    """A FleetView with fixed busyness and prefix matches per worker id."""

    def __init__(
        self,
        busy: dict[str, float] | None = None,
        matches: dict[str, int] | None = None,
        shares: dict[str, float] | None = None,
    ) -> None:
        self.busy = busy or {}
        self.matches = matches or {}
        self.shares = shares or {}

    def busyness(self, worker: WorkerRecord) -> float:
        return self.busy.get(worker.id, 0.0)

    def prefix_match(self, hashes: Sequence[int], workers: Sequence[WorkerRecord]) -> dict[str, int]:
        return {w.id: self.matches[w.id] for w in workers if self.matches.get(w.id)}

    def recent_placements(self, worker: WorkerRecord) -> float:
        return self.shares.get(worker.id, 0.0)


def worker(worker_id: str, *, leases: int = 0, last_assigned: int = 0, **load: float) -> WorkerRecord:
    record = WorkerRecord(worker_id, Capabilities(max_concurrency=8), last_assigned=last_assigned)
    record.leases = {f"{worker_id}-p{i}" for i in range(leases)}
    record.load = Load(**load) if load else None  # type: ignore[arg-type]
    return record


# ---------------------------------------------------------------- derived figures


def test_busyness_formula() -> None:
    """busyness = 4 * in_flight + 0.1 * queued_tokens."""
    assert busyness(0, 0) == 0
    assert busyness(3, 0) == 12
    assert busyness(0, 1000) == pytest.approx(100)
    assert busyness(2, 50) == pytest.approx(13)


@pytest.mark.parametrize(("a", "b"), [((1, 0), (2, 0)), ((1, 100), (1, 101)), ((0, 0), (0, 1))])
def test_busyness_is_monotone(a: tuple[int, int], b: tuple[int, int]) -> None:
    """More in flight or more queued tokens never makes a worker less busy."""
    assert busyness(*a) < busyness(*b)


def test_projected_energy_is_linear_in_tokens() -> None:
    """Projected µJ for n tokens is µJ/token * n: doubling n doubles it, zero tokens cost zero."""
    assert projected_uj(2.5e6, 0) == 0
    assert projected_uj(2.5e6, 100) == pytest.approx(2.5e8)
    assert projected_uj(2.5e6, 200) == pytest.approx(2 * projected_uj(2.5e6, 100))


def test_projected_emissions_convert_uj_to_kwh() -> None:
    """1 kWh is 3.6e12 µJ: at 400 g/kWh it emits 400 g; the figure is linear in both factors."""
    assert projected_g(3.6e12, 400) == pytest.approx(400)
    assert projected_g(1.8e12, 400) == pytest.approx(200)
    assert projected_g(3.6e12, 0) == 0


def test_every_policy_is_built_and_the_default_is_joule() -> None:
    """make_policies builds one instance per name; the default policy is joule_weighted."""
    policies = make_policies()
    assert set(policies) == set(POLICY_NAMES) == {
        "round_robin", "least_busy", "latency_weighted", "joule_weighted", "carbon_weighted", "kv_aware"
    }
    assert DEFAULT_POLICY == "joule_weighted"


# ---------------------------------------------------------------- policies


def test_round_robin_cycles_in_id_order_across_membership_changes() -> None:
    """round_robin takes the next id after its last choice, wrapping; a worker leaving does not reset it."""
    rr = RoundRobin()
    a, b, c = worker("a"), worker("b"), worker("c")
    picks = [rr.choose(Ask(), [c, a, b], Fleet()).id for _ in range(4)]
    assert picks == ["a", "b", "c", "a"]
    assert rr.choose(Ask(), [a, c], Fleet()).id == "c"  # b left: after a comes c
    assert rr.choose(Ask(), [a, c], Fleet()).id == "a"


def test_least_busy_then_least_recent_then_id() -> None:
    """least_busy takes the smallest busyness; ties go to the least recently assigned, then the lowest id."""
    a, b, c = worker("a", last_assigned=5), worker("b", last_assigned=2), worker("c", last_assigned=2)
    assert LeastBusy().choose(Ask(), [a, b, c], Fleet({"a": 1, "b": 3, "c": 3})).id == "a"
    assert LeastBusy().choose(Ask(), [a, b, c], Fleet({"a": 3, "b": 3, "c": 3})).id == "b"


def test_latency_weighted_is_latency_times_outstanding() -> None:
    """latency_weighted costs p50 * (leases + 1): a fast worker wins until its queue outweighs its speed."""
    fast = worker("fast", leases=2, latency_p50_ms=100.0)  # 300
    slow = worker("slow", leases=0, latency_p50_ms=250.0)  # 250
    assert LatencyWeighted().choose(Ask(), [fast, slow], Fleet()).id == "slow"
    fast.leases = {"x"}  # 200
    assert LatencyWeighted().choose(Ask(), [fast, slow], Fleet()).id == "fast"


def test_latency_weighted_costs_an_unreported_worker_at_the_mean() -> None:
    """A worker without a latency report is costed at the mean of the others, so it is neither starved nor flooded."""
    new = worker("new", leases=1)  # the mean, 200, * 2 = 400
    a = worker("a", leases=0, latency_p50_ms=100.0)  # 100
    b = worker("b", leases=0, latency_p50_ms=300.0)  # 300
    assert LatencyWeighted().choose(Ask(), [new, a, b], Fleet()).id == "a"
    new.leases = set()  # 200
    a.leases = {"x", "y", "z"}  # 400
    assert LatencyWeighted().choose(Ask(), [new, a, b], Fleet()).id == "new"


def test_joule_weighted_picks_least_energy() -> None:
    """joule_weighted picks the least µJ/token, whatever the busyness, by default."""
    h100 = worker("h100", uj_per_token=3.6e6)
    a100 = worker("a100", uj_per_token=5.9e6)
    assert JouleWeighted().choose(Ask(tokens=300), [a100, h100], Fleet({"h100": 50, "a100": 0})).id == "h100"


def test_joule_weighted_max_gap_keeps_to_the_near_least_busy() -> None:
    """With max_gap, only workers within that busyness of the least busy are considered."""
    h100 = worker("h100", uj_per_token=3.6e6)
    a100 = worker("a100", uj_per_token=5.9e6)
    fleet = Fleet({"h100": 50, "a100": 0})
    assert JouleWeighted(max_gap=10).choose(Ask(tokens=300), [a100, h100], fleet).id == "a100"
    assert JouleWeighted(max_gap=60).choose(Ask(tokens=300), [a100, h100], fleet).id == "h100"


def test_joule_weighted_costs_unreported_workers_at_the_mean() -> None:
    """A worker with no µJ/token report is costed at the mean; with no reports at all it is least busy."""
    good, bad, unknown = worker("good", uj_per_token=1.0), worker("bad", uj_per_token=5.0), worker("unknown")
    assert JouleWeighted().choose(Ask(), [unknown, good, bad], Fleet()).id == "good"
    # The unreported worker is costed at the mean of the reports, 3 µJ/token.
    assert _mean_known([unknown, good, bad], lambda w: w.load.uj_per_token if w.load else 0.0) == 3.0
    idle, busy = worker("idle"), worker("busy")
    assert JouleWeighted().choose(Ask(), [busy, idle], Fleet({"busy": 8, "idle": 0})).id == "idle"


def test_carbon_weighted_weighs_energy_by_zone_intensity() -> None:
    """carbon_weighted minimises µJ * intensity: an efficient worker on a dirty grid loses to a clean one."""
    h100_pl = worker("h100-pl", uj_per_token=3.6e6, zone_intensity_g_per_kwh=662)
    a100_se = worker("a100-se", uj_per_token=5.9e6, zone_intensity_g_per_kwh=41)
    candidates = [h100_pl, a100_se]
    assert JouleWeighted().choose(Ask(tokens=100), candidates, Fleet()).id == "h100-pl"
    assert CarbonWeighted().choose(Ask(tokens=100), candidates, Fleet()).id == "a100-se"


def test_carbon_weighted_costs_unreported_intensity_at_the_mean() -> None:
    """A worker without a zone intensity is costed at the mean intensity of the others."""
    clean_but_wasteful = worker("clean", uj_per_token=10.0, zone_intensity_g_per_kwh=50)  # 500
    dirty = worker("dirty", uj_per_token=1.0, zone_intensity_g_per_kwh=650)  # 650
    unknown = worker("unknown", uj_per_token=1.0)  # costed at the mean intensity, 350
    assert CarbonWeighted().choose(Ask(), [unknown, dirty, clean_but_wasteful], Fleet()).id == "unknown"


def test_kv_aware_takes_the_longest_prefix_match() -> None:
    """kv_aware sends a plan to the worker holding the longest run of its leading prefix blocks."""
    a, b, c = worker("a"), worker("b"), worker("c")
    fleet = Fleet({"a": 0, "b": 5, "c": 1}, matches={"a": 2, "b": 6, "c": 3})
    assert KvAware().choose(Ask(prefix_hashes=(1, 2, 3, 4, 5, 6)), [a, b, c], fleet).id == "b"


def test_kv_aware_breaks_equal_matches_by_load() -> None:
    """Among equally long matches, the least busy worker wins."""
    a, b = worker("a"), worker("b")
    fleet = Fleet({"a": 7, "b": 2}, matches={"a": 4, "b": 4})
    assert KvAware().choose(Ask(prefix_hashes=(1, 2, 3, 4)), [a, b], fleet).id == "b"


def test_kv_aware_falls_back_to_least_busy_on_a_short_match() -> None:
    """A match shorter than min_match_blocks (a shared system prompt) says nothing: least busy wins."""
    a, b = worker("a"), worker("b")
    fleet = Fleet({"a": 9, "b": 1}, matches={"a": 1})
    assert KvAware(min_match_blocks=2).choose(Ask(prefix_hashes=(0, 7, 8)), [a, b], fleet).id == "b"
    assert KvAware(min_match_blocks=1).choose(Ask(prefix_hashes=(0, 7, 8)), [a, b], fleet).id == "a"


def test_kv_aware_load_guard_falls_back_when_imbalanced() -> None:
    """When the busiest candidate is both balance_gap above and balance_ratio times the least busy, least busy wins."""
    hot, cold = worker("hot"), worker("cold")
    ask = Ask(prefix_hashes=(1, 2, 3))
    matches = {"hot": 3}
    policy = KvAware(balance_gap=100, balance_ratio=1.5)
    assert policy.choose(ask, [hot, cold], Fleet({"hot": 90, "cold": 0}, matches)).id == "hot"  # gap 90 <= 100
    assert policy.choose(ask, [hot, cold], Fleet({"hot": 150, "cold": 0}, matches)).id == "cold"  # gap 150
    # A large gap between two heavily loaded workers is not an imbalance: 1100 < 1.5 * 1000.
    assert policy.choose(ask, [hot, cold], Fleet({"hot": 1100, "cold": 1000}, matches)).id == "hot"


def test_kv_aware_without_hashes_is_least_busy() -> None:
    """A plan with no prefix hashes goes to the least busy worker."""
    a, b = worker("a"), worker("b")
    assert KvAware().choose(Ask(), [a, b], Fleet({"a": 3, "b": 1}, {"a": 5})).id == "b"


# ---------------------------------------------------------------- kv_aware with a load bound


def _old_kv_rule(policy: KvAware, ask: Ask, candidates: list[WorkerRecord], fleet: Fleet) -> WorkerRecord:
    """kv_aware as it was before kv_load_bound: guards, then the longest match, least busy among ties."""
    least = LeastBusy()
    loads = [fleet.busyness(w) for w in candidates]
    if max(loads) - min(loads) > policy.balance_gap and max(loads) > policy.balance_ratio * min(loads):
        return least.choose(ask, candidates, fleet)
    matches = fleet.prefix_match(ask.prefix_hashes, candidates)
    best = max(matches.values(), default=0)
    if best < max(1, policy.min_match_blocks):
        return least.choose(ask, candidates, fleet)
    return least.choose(ask, [w for w in candidates if matches.get(w.id, 0) == best], fleet)


fleet_state = st.lists(
    st.tuples(st.integers(0, 60), st.integers(0, 8), st.floats(0, 50)), min_size=1, max_size=8
)  # per worker: busyness, prefix match, recent share


@settings(max_examples=300, deadline=None)
@given(state=fleet_state, bound=st.sampled_from([0.0, 0.1, 0.5, math.inf]), min_match=st.integers(1, 3))
def test_kv_load_bound_invariants(state: list[tuple[int, int, float]], bound: float, min_match: int) -> None:
    """Unbounded kv_aware is the old rule; bounded, a worker over (1 + 2ε) x the mean share wins only as least busy."""
    candidates = [worker(f"w{i}") for i in range(len(state))]
    fleet = Fleet(
        {f"w{i}": b for i, (b, _, _) in enumerate(state)},
        {f"w{i}": m for i, (_, m, _) in enumerate(state)},
        {f"w{i}": sh for i, (_, _, sh) in enumerate(state)},
    )
    ask = Ask(prefix_hashes=tuple(range(8)))
    policy = KvAware(min_match_blocks=min_match, load_bound=bound)
    chosen = policy.choose(ask, candidates, fleet)
    if bound == math.inf:
        assert chosen is _old_kv_rule(policy, ask, candidates, fleet)
        return
    shares = [sh for _, _, sh in state]
    per_worker = (math.fsum(shares) + 1) / len(shares)
    some_under = any(sh + 1 <= (1 + bound) * per_worker for sh in shares)
    over_hard = fleet.shares[chosen.id] + 1 > (1 + 2 * bound) * per_worker
    if some_under and over_hard:
        assert chosen is LeastBusy().choose(ask, candidates, fleet)


def test_kv_load_bound_moves_a_hot_prefix_to_a_worker_under_the_bound() -> None:
    """A holder over the bound loses a plan whose match another worker nearly has: the prefix is copied there."""
    hot, warm, cold = worker("hot"), worker("warm"), worker("cold")
    shares = {"hot": 30.0, "warm": 10.0, "cold": 5.0}  # mean (45 + 1) / 3 = 15.3; bound 1.1 x that = 16.9
    ask = Ask(prefix_hashes=tuple(range(20)))
    # A new session of a hot group: 16 shared blocks on hot and warm, 17 (one of its own) on hot only.
    fleet = Fleet({"hot": 0, "warm": 8, "cold": 0}, {"hot": 17, "warm": 16}, shares)
    assert KvAware(load_bound=0.1).choose(ask, [hot, warm, cold], fleet).id == "warm"
    assert KvAware().choose(ask, [hot, warm, cold], fleet).id == "hot"  # no bound: the longest match
    # Nobody else holds it: the least busy worker under the bound takes it (and holds a copy from then on).
    fleet = Fleet({"hot": 6, "warm": 8, "cold": 4}, {"hot": 16}, shares)
    assert KvAware(load_bound=0.1).choose(ask, [hot, warm, cold], fleet).id == "cold"


def test_kv_load_bound_keeps_a_long_conversation_until_the_hard_bound() -> None:
    """Diverting a plan that would lose most of its match waits until its worker is past (1 + 2ε) x the mean."""
    home, other = worker("home"), worker("other")
    ask = Ask(prefix_hashes=tuple(range(30)))
    matches = {"home": 30, "other": 2}
    # Mean (20 + 10 + 1) / 2 = 15.5: soft bound 17.05, hard bound (1 + 0.2) x 15.5 = 18.6.
    between = Fleet({}, matches, {"home": 17.5, "other": 12.5})  # home + 1 = 18.5: over soft, under hard
    assert KvAware(load_bound=0.1).choose(ask, [home, other], between).id == "home"
    past = Fleet({}, matches, {"home": 20.0, "other": 10.0})  # home + 1 = 21 > 18.6
    assert KvAware(load_bound=0.1).choose(ask, [home, other], past).id == "other"


def test_kv_load_bound_breaks_equal_matches_by_recent_share() -> None:
    """Among equally long matches, the worker with the smaller recent share wins, then the least busy."""
    a, b = worker("a"), worker("b")
    fleet = Fleet({"a": 0, "b": 9}, {"a": 4, "b": 4}, {"a": 6.0, "b": 5.0})
    assert KvAware(load_bound=1.0).choose(Ask(prefix_hashes=(1, 2, 3, 4)), [a, b], fleet).id == "b"
    assert KvAware().choose(Ask(prefix_hashes=(1, 2, 3, 4)), [a, b], fleet).id == "a"


def test_policy_knobs_reject_a_bad_load_bound_or_window() -> None:
    """kv_load_bound must be >= 0 and kv_share_window a finite count >= 1; the error names the knob."""
    with pytest.raises(ValueError, match="kv_load_bound"):
        PolicyKnobs(kv_load_bound=-0.1).check()
    with pytest.raises(ValueError, match="kv_share_window"):
        PolicyKnobs(kv_share_window=0.5).check()
    with pytest.raises(ValueError, match="kv_share_window"):
        PolicyKnobs(kv_share_window=math.inf).check()
    PolicyKnobs(kv_load_bound=math.inf).check()
