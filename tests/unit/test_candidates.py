"""Bounded placement in large pools: the policy ranks the room index's first K workers (fake clock)."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from coordinator.capacity import Pool
from coordinator.placement.placer import DEFAULT_CANDIDATES, PlacementConfig
from coordinator.placement.plan_queue import Signature
from coordinator.placement.policies import POLICY_NAMES, PolicyKnobs
from coordinator.placement.prefix import PrefixIndex
from fleetwire.cli.main import build_parser
from fleetwire.cli.serve import routing_settings
from protocol.messages import Capabilities, Load
from tests.unit.test_capacity import ENERGY_LOADS, LOADS, WORKERS, Model, figure_load, ops, register

PREFIXES = [(), (11, 12, 13), (11, 12, 14), (21, 22)]
# Every worker reports a µJ/token, most the same one: joule_weighted breaks wide ties by busyness.
TIED_LOADS = [Load(uj_per_token=2.0, queued_tokens=q) for q in (0, 40, 8, 100)] + [Load(uj_per_token=3.0)]
place_prefix = st.tuples(
    st.just("place"),
    st.just(0),
    st.sampled_from(POLICY_NAMES),
    st.sampled_from([0, 0, 40]),
    st.just(False),  # untagged: the one pool of every worker
    st.sampled_from([False, False, True]),  # session key
    st.sampled_from([False, True, True]),  # claim
    st.sampled_from(PREFIXES),
)
bounded_ops = st.one_of(ops, place_prefix, place_prefix)


@settings(max_examples=100, deadline=None)  # was 300: at 100 each of three planted placement bugs still failed it
@given(
    candidates=st.integers(1, 4),
    prefetch=st.integers(0, 1),
    loads=st.one_of(st.sampled_from([LOADS, ENERGY_LOADS, TIED_LOADS]), st.lists(figure_load, min_size=1, max_size=8)),
    first=st.lists(register, max_size=6),
    steps=st.lists(bounded_ops, max_size=80),
)
def test_bounded_choice_equals_brute_force(
    candidates: int, prefetch: int, loads: list[Load], first: list[tuple[Any, ...]], steps: list[tuple[Any, ...]]
) -> None:
    """With K below the pool size, every decision (random figure reports included) equals the brute-force rule."""
    model = Model(prefetch, loads, candidates=candidates)
    for op in [*first, *steps]:
        model.apply(op)
    for policy in POLICY_NAMES:
        for prefix in PREFIXES:
            model.place(policy, 40, False, False, False, prefix)


@settings(max_examples=70, deadline=None)
@given(
    candidates=st.integers(1, 4),
    bound=st.sampled_from([0.0, 0.1, 0.5]),
    window=st.sampled_from([1.0, 4.0, 64.0]),
    first=st.lists(register, max_size=6),
    steps=st.lists(bounded_ops, max_size=80),
)
def test_kv_load_bound_choice_equals_brute_force(
    candidates: int, bound: float, window: float, first: list[tuple[Any, ...]], steps: list[tuple[Any, ...]]
) -> None:
    """kv_aware with a finite kv_load_bound decides from the same candidates in a large pool as the brute-force rule."""
    knobs = PolicyKnobs(kv_load_bound=bound, kv_share_window=window)
    model = Model(0, LOADS, candidates=candidates, knobs=knobs)
    for op in [*first, *steps]:
        model.apply(op)
    for prefix in PREFIXES:
        model.place("kv_aware", 40, False, False, False, prefix)


@settings(max_examples=50, deadline=None)
@given(
    candidates=st.sampled_from([0, len(WORKERS), 64]),
    prefetch=st.integers(0, 1),
    first=st.lists(register, max_size=6),
    steps=st.lists(bounded_ops, max_size=80),
)
def test_no_bound_or_a_small_pool_is_the_full_pass(
    candidates: int, prefetch: int, first: list[tuple[Any, ...]], steps: list[tuple[Any, ...]]
) -> None:
    """K = 0, or a pool of no more than K workers, decides exactly as the pass over every worker."""
    model = Model(prefetch, LOADS, candidates=candidates)
    assert not 0 < model.candidates < len(WORKERS)  # Model compares with the unbounded pass
    for op in [*first, *steps]:
        model.apply(op)
    for policy in POLICY_NAMES:
        for prefix in PREFIXES:
            model.place(policy, 40, False, False, False, prefix)


def fleet(candidates: int, size: int = 20) -> tuple[Model, Pool]:
    """``size`` one-slot workers (w00..), each reporting 100 - i queued tokens: the last is the least busy."""
    model = Model(prefetch=0, candidates=candidates)
    for i in range(size):
        worker_id = f"w{i:02d}"
        record = model.registry.register(worker_id, Capabilities(ops=["x"], max_concurrency=1), model.now)
        model.indexed.registered(record)
        model.registry.heartbeat(worker_id, Load(queued_tokens=100 - i), model.now)
    plan = model.plan("least_busy", 0, False, False)
    signature = Signature.of(plan.op, plan.requirements, plan.avoid)
    pool = model.registry.matching(signature, signature.admits)
    assert isinstance(pool, Pool)
    return model, pool


def test_large_pool_takes_the_best_of_the_first_k() -> None:
    """K=4 of 20: least_busy picks the least busy of the 4 least recently assigned, not the pool's least busy."""
    model, pool = fleet(candidates=4)
    chosen = model.indexed.choose(model.plan("least_busy", 0, False, False), pool, model.now)
    assert chosen is not None and chosen.id == "w03"  # w00..w03 tie on leases; w03 has the fewest tokens of them
    unbounded, pool = fleet(candidates=0)
    chosen = unbounded.indexed.choose(unbounded.plan("least_busy", 0, False, False), pool, unbounded.now)
    assert chosen is not None and chosen.id == "w19"


def test_kv_aware_reaches_a_prefix_holder_outside_the_first_k() -> None:
    """kv_aware with K=4 of 20 still finds the worker holding the longest prefix, far from the index's head."""
    model, pool = fleet(candidates=4)
    model.indexed.prefix.insert("w15", [7, 8, 9], 16)
    model.indexed.prefix.insert("w01", [7], 16)
    plan = model.plan("kv_aware", 0, False, False, prefix=(7, 8, 9))
    chosen = model.indexed.choose(plan, pool, model.now)
    assert chosen is not None and chosen.id == "w15"


def test_sticky_session_outside_the_first_k_is_kept() -> None:
    """A session's worker is kept though the room index would not offer it among the first K."""
    model, pool = fleet(candidates=2)
    plan = model.plan("least_busy", 0, False, True)
    model.indexed._sessions[(plan.owner, "s")] = "w17"
    chosen = model.indexed.choose(plan, pool, model.now)
    assert chosen is not None and chosen.id == "w17"


def test_energy_tie_is_broken_among_the_first_k_tied() -> None:
    """With every worker tied on µJ/token, joule_weighted breaks the tie by busyness among the K least leased."""
    model, pool = fleet(candidates=3)
    for i in range(20):
        model.registry.heartbeat(f"w{i:02d}", Load(uj_per_token=2.0, queued_tokens=100 - i), model.now)
    chosen = model.indexed.choose(model.plan("joule_weighted", 0, False, False), pool, model.now)
    assert chosen is not None and chosen.id == "w02"


def test_negative_candidates_are_refused() -> None:
    """--placement-candidates below 0 is a configuration error that says what is allowed."""
    with pytest.raises(ValueError, match="placement candidates must be >= 0"):
        PlacementConfig(candidates=-1).check()


def test_longer_holders_counts_leading_blocks_only() -> None:
    """The prefix index's holder walk finds the longest leading match above the floor, ties included."""
    index = PrefixIndex()
    for worker_id in ("a", "b", "c", "d"):
        index.set_capacity(worker_id, 1 << 20)
    index.insert("a", [1, 2], 16)
    index.insert("b", [1, 2, 3], 16)
    index.insert("c", [1, 2, 3], 16)
    index.insert("d", [3, 4], 16)  # holds deep blocks but not the first: matches nothing
    assert sorted(index.longer_holders([1, 2, 3, 4], 0, lambda w: True)) == ["b", "c"]
    assert index.longer_holders([1, 2, 3, 4], 0, lambda w: w != "b") == ["c"]
    assert index.longer_holders([1, 2, 3, 4], 3, lambda w: True) == []  # none longer than the floor
    assert index.longer_holders([1, 2, 3, 4], 0, lambda w: w == "a") == ["a"]
    assert index.longer_holders([9, 1], 0, lambda w: True) == []


def test_cli_flag_reaches_the_placement_settings() -> None:
    """`fleetwire coordinator --placement-candidates K` sets the bound; the default is DEFAULT_CANDIDATES."""
    ns = build_parser().parse_args(["coordinator", "--placement-candidates", "0"])
    assert routing_settings(ns)["placement"].candidates == 0
    ns = build_parser().parse_args(["coordinator"])
    assert routing_settings(ns)["placement"].candidates == DEFAULT_CANDIDATES
