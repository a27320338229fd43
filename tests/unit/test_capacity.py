"""The pools' room index and the reaper's beat heap answer as the full scans do (fake clock, property-based)."""

from __future__ import annotations

import itertools
import math
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from coordinator.capacity import Pool, carbon_key, energy_key, slot_key
from coordinator.placement.placer import DEFAULT_CANDIDATES, Placement, PlacementConfig, ask_of
from coordinator.placement.plan_queue import Signature
from coordinator.placement.policies import (
    POLICY_NAMES,
    JouleWeighted,
    LatencyWeighted,
    PolicyKnobs,
    projected_carbon,
)
from coordinator.plans import Plan
from coordinator.registry import WorkerRegistry
from coordinator.workers import WorkerRecord, has_carbon, has_energy, has_latency, is_plain, latency_ms
from protocol.messages import Capabilities, Load, Requirements, RoutingHints

TIMEOUT = 30.0
WORKERS = [f"w{i}" for i in range(6)]
LOADS = [Load(), Load(), Load(), Load(uj_per_token=2.5), Load(queued_tokens=40), Load(latency_p50_ms=3.0)]


class Model:
    """A registry, two placements over it (one given the registry's pools, one unindexed pools) and their plans.

    With ``candidates`` smaller than a pool, the pooled placement's answer is compared with
    :meth:`bounded`, a brute-force statement of the rule (docs/ROUTING.md §Large pools).
    """

    def __init__(
        self,
        prefetch: int,
        loads: list[Load] | None = None,
        candidates: int = DEFAULT_CANDIDATES,
        knobs: PolicyKnobs | None = None,
    ) -> None:
        self.loads = loads or LOADS  # what heartbeats carry; with ``loads`` given, each registration beats too
        self.beat_on_register = loads is not None
        self.now = 0.0
        self.registry = WorkerRegistry(TIMEOUT, prefetch=prefetch)
        self.plans: dict[str, Plan] = {}
        self.candidates = candidates
        knobs = knobs or PolicyKnobs()
        self.indexed = Placement(
            self.registry, self.plans, PlacementConfig(prefetch=prefetch, candidates=candidates, knobs=knobs)
        )
        self.scanned = Placement(self.registry, self.plans, PlacementConfig(prefetch=prefetch, knobs=knobs))
        # One placement's claimed() updates the sessions, prefixes and recent shares all read.
        self.scanned._sessions = self.indexed._sessions
        self.scanned.prefix = self.indexed.prefix
        self.scanned.shares = self.indexed.shares
        self.ids = (f"p{i}" for i in itertools.count())
        self.order = itertools.count()

    def plan(self, policy: str, tokens: int, tag: bool, session: bool, prefix: tuple[int, ...] = ()) -> Plan:
        hints = RoutingHints(
            policy=policy,
            prompt_tokens=tokens,
            max_output_tokens=tokens,
            session_key="s" if session else None,
            prefix_hashes=list(prefix),
            prefix_block_tokens=16 if prefix else 0,
        )
        plan_id = next(self.ids)
        plan = Plan(
            id=plan_id,
            op="x",
            args=None,
            requirements=Requirements(tags=["t"] if tag else []),
            priority=0,
            timeout_s=None,
            max_attempts=3,
            owner="alice",
            order=next(self.order),
            hints=hints,
        )
        return plan

    def apply(self, op: tuple[Any, ...]) -> None:
        kind, index, *rest = op
        registry, worker_id = self.registry, WORKERS[index]
        known = worker_id in registry
        if kind == "register":
            limit, kv_blocks, tag = rest
            caps = Capabilities(
                ops=["x"], tags=["t"] if tag else [], max_concurrency=limit, kv_blocks=kv_blocks, kv_block_tokens=16
            )
            record = registry.register(worker_id, caps, self.now)
            self.indexed.registered(record)
            if self.beat_on_register:
                registry.heartbeat(worker_id, self.loads[(index + limit) % len(self.loads)], self.now)
        elif kind == "heartbeat" and known:
            was_alive = registry.is_alive(worker_id, self.now)
            registry.heartbeat(worker_id, self.loads[rest[0] % len(self.loads)], self.now)
            if not was_alive:  # a revival: the core tells placement room may have appeared
                self.indexed.room_may_have_changed()
                self.scanned.room_may_have_changed()
        elif kind == "disconnect" and known:
            registry.disconnect(worker_id)
        elif kind == "drain" and known:
            registry.get(worker_id).draining = rest[0]
            self.indexed.room_may_have_changed()
            self.scanned.room_may_have_changed()
        elif kind == "release" and known and registry.get(worker_id).leases:
            registry.release(worker_id, min(registry.get(worker_id).leases))
        elif kind == "advance":
            self.now += rest[0]
        elif kind == "reap":
            for gone in registry.reap(self.now):
                self.indexed.forget([gone])
        elif kind == "place":
            self.place(*rest)

    def place(
        self, policy: str, tokens: int, tag: bool, session: bool, claim: bool, prefix: tuple[int, ...] = ()
    ) -> None:
        plan = self.plan(policy, tokens, tag, session, prefix)
        signature = Signature.of(plan.op, plan.requirements, plan.avoid)
        pool = self.registry.matching(signature, signature.admits)
        assert isinstance(pool, Pool)
        members = [r for r in self.registry if r.connected and signature.admits(r)]
        assert sorted(r.id for r in pool) == sorted(r.id for r in members)
        assert pool.not_plain == sum(not is_plain(r) for r in members)
        assert pool.no_energy == sum(not has_energy(r) for r in members)
        assert pool.no_carbon == sum(not has_carbon(r) for r in members)
        assert pool.no_latency == sum(not has_latency(r) for r in members)
        got = self.indexed.choose(plan, pool, self.now)
        if 0 < self.candidates < len(pool):
            want = self.bounded(plan, pool)
        else:
            want = self.scanned.choose(plan, Pool.unindexed(pool), self.now)
        assert (got and got.id) == (want and want.id), (policy, tokens, session, prefix)
        if claim and got is not None:
            self.plans[plan.id] = plan
            self.registry.claim(got.id, plan.id)
            if placed := self.indexed.claimed(plan, got):
                self.registry.count_placed_tokens(got.id, placed)

    def bounded(self, plan: Plan, pool: Pool) -> WorkerRecord | None:
        """What placement must pick in a pool larger than ``candidates``, by brute force over the pool."""
        scanned, k = self.scanned, self.candidates
        if not pool.not_plain and scanned._indexable(plan):
            return scanned.choose(plan, Pool.unindexed(pool), self.now)  # the room index is exact: no bound
        scanned._now = self.now
        ok = [w for w in pool if w.has_capacity() and self.registry.is_alive(w.id, self.now) and scanned.fits(plan, w)]
        key = plan.hints.session_key
        held = scanned.session_worker(plan.owner, key) if key is not None else None
        for worker in ok:
            if worker.id == held:
                return worker
        tier = [w for w in ok if w.has_free_slot()] or ok
        if not tier:
            return None
        ask = ask_of(plan)
        figure = scanned._figure(plan)
        score, order = figure_rank(figure, max(ask.tokens, 1))
        known = [w for w in tier if figure in FIGURES and FIGURES[figure](w)]
        if figure is not None and all(FIGURES[figure](w) for w in pool):
            least = min(score(w) for w in tier)
            tied = sorted((w for w in tier if score(w) == least), key=order)[:k]
            return min(tied, key=lambda w: (scanned.busyness(w), w.last_assigned, w.id))
        candidates = sorted(tier, key=lambda w: slot_key(w) or ())[:k]
        if figure is not None:  # some members lack the figure: the K best by it join the K least loaded
            candidates += [w for w in sorted(known, key=lambda w: (score(w), order(w)))[:k] if w not in candidates]
        name = scanned.policy_name(plan)
        if name == "kv_aware" and plan.hints.prefix_hashes:
            matches = scanned.prefix_match(plan.hints.prefix_hashes, tier)
            best = max(matches.values(), default=0)
            if best > max((matches.get(w.id, 0) for w in candidates), default=0):
                candidates += [w for w in tier if matches.get(w.id, 0) == best]
        return scanned.policies[name].choose(ask, candidates, scanned)

    def check_stale(self) -> None:
        registry = self.registry
        brute = sorted(r.id for r in registry if self.now - r.last_beat_s > TIMEOUT)
        assert [r.id for r in registry.stale(self.now)] == brute
        for record in registry:
            assert record.plain == is_plain(record)
            assert record.has_energy == has_energy(record)
            assert record.has_carbon == has_carbon(record)
            assert record.has_latency == has_latency(record)


FIGURES = {"energy": has_energy, "carbon": has_carbon, "latency": has_latency}


def figure_rank(figure: str | None, tokens: int) -> tuple[Any, Any]:
    """The policy's projection of a worker with the figure, and the index's order among equal projections."""
    if figure == "energy":
        return (lambda w: w.load.uj_per_token * tokens), (lambda w: energy_key(w) or ())
    if figure == "carbon":
        return (
            lambda w: projected_carbon(w.load.uj_per_token * w.load.zone_intensity_g_per_kwh, tokens)
        ), lambda w: carbon_key(w) or ()
    return (lambda w: latency_ms(w) * (len(w.leases) + 1)), lambda w: (len(w.leases), w.last_assigned, w.id)


worker_index = st.integers(0, len(WORKERS) - 1)
register = st.tuples(
    st.just("register"), worker_index, st.sampled_from([0, 1, 1, 2, 3]), st.sampled_from([0, 0, 8]), st.booleans()
)
place = st.tuples(
    st.just("place"),
    st.just(0),
    st.sampled_from(POLICY_NAMES),
    st.sampled_from([0, 0, 0, 40]),
    st.sampled_from([False, False, True]),  # tagged
    st.sampled_from([False, False, True]),  # session key
    st.sampled_from([False, True, True]),  # claim the worker chosen
)
ops = st.one_of(
    register,
    place,
    place,
    st.tuples(st.just("release"), worker_index),
    st.tuples(st.just("release"), worker_index),
    st.tuples(st.just("heartbeat"), worker_index, st.integers(0, len(LOADS) - 1)),
    st.tuples(st.just("disconnect"), worker_index),
    st.tuples(st.just("drain"), worker_index, st.booleans()),
    st.tuples(st.just("release"), worker_index),
    st.tuples(st.just("advance"), st.just(0), st.sampled_from([0.5, 5.0, 5.0, 12.0, 12.0, 31.0])),
    st.tuples(st.just("reap"), st.just(0)),
)


@settings(max_examples=300, deadline=None)
@given(prefetch=st.integers(0, 1), first=st.lists(register, max_size=6), steps=st.lists(ops, max_size=80))
def test_index_answers_equal_the_full_scan(
    prefetch: int, first: list[tuple[Any, ...]], steps: list[tuple[Any, ...]]
) -> None:
    """After any mix of register/beat/claim/release/drain/disconnect/reap, pools, choices, stale equal brute force."""
    model = Model(prefetch)
    for op in [*first, *steps]:
        model.apply(op)
        model.check_stale()
    for policy in POLICY_NAMES:
        model.place(policy, 0, False, False, False)


NEXT_2_5 = math.nextafter(2.5, math.inf)  # ties with 2.5 once multiplied by some token counts
ENERGY_LOADS = [
    Load(uj_per_token=1.0),
    Load(uj_per_token=2.5),
    Load(uj_per_token=2.5, queued_tokens=40),
    Load(uj_per_token=NEXT_2_5, queued_tokens=8),
    Load(uj_per_token=2.5),
    Load(queued_tokens=40),  # no µJ/token: the pool is ranked in one pass until it reports one
    Load(uj_per_token=4.0),
]


@settings(max_examples=200, deadline=None)
@given(prefetch=st.integers(0, 1), first=st.lists(register, max_size=6), steps=st.lists(ops, max_size=80))
def test_energy_index_answers_equal_the_full_scan(
    prefetch: int, first: list[tuple[Any, ...]], steps: list[tuple[Any, ...]]
) -> None:
    """With workers reporting µJ/token, joule_weighted's energy index picks what its pass over the pool picks."""
    model = Model(prefetch, ENERGY_LOADS)
    for op in [*first, *steps]:
        if op[0] == "place":
            op = (*op[:2], "joule_weighted", *op[3:])
        model.apply(op)
        model.check_stale()
    model.place("joule_weighted", 40, False, False, False)


# Figures with ties by construction: 2 * 200 == 4 * 100 == 1 * 400 (carbon), 1.0 at 1 lease == 2.0 at
# none (latency), and a neighbour of 2.5 that ties with it once multiplied; 0 is "not reported".
figure_load = st.builds(
    Load,
    uj_per_token=st.sampled_from([0.0, 1.0, 2.0, 2.5, NEXT_2_5, 4.0]),
    zone_intensity_g_per_kwh=st.sampled_from([0.0, 100.0, 200.0, 250.0, 400.0]),
    latency_p50_ms=st.sampled_from([0.0, 0.0, 1.0, 2.0, 2.5, NEXT_2_5, 6.0]),
    latency_ema_ms=st.sampled_from([0.0, 1.0, 3.0]),
    queued_tokens=st.sampled_from([0, 0, 8, 40]),
)
FIGURE_POLICIES = ("joule_weighted", "carbon_weighted", "latency_weighted")


@settings(max_examples=200, deadline=None)
@given(
    prefetch=st.integers(0, 1),
    loads=st.lists(figure_load, min_size=1, max_size=8),
    first=st.lists(register, max_size=6),
    steps=st.lists(ops, max_size=80),
)
def test_figure_indexes_answer_equal_the_full_scan(
    prefetch: int, loads: list[Load], first: list[tuple[Any, ...]], steps: list[tuple[Any, ...]]
) -> None:
    """Under random µJ/token, intensity and latency reports, the three figure indexes pick what the pass picks."""
    model = Model(prefetch, loads)
    for op in [*first, *steps]:
        if op[0] == "place":
            op = (*op[:2], FIGURE_POLICIES[POLICY_NAMES.index(op[2]) % 3], *op[3:])
        model.apply(op)
        model.check_stale()
    for policy in FIGURE_POLICIES:
        for tokens in (0, 40):
            model.place(policy, tokens, False, False, False)


def test_plain_pool_is_answered_without_the_policy() -> None:
    """With plain workers the room index answers: the policy's pass over the candidates is not run."""
    model = Model(prefetch=0)
    for index in range(3):
        model.apply(("register", index, 2, 0, False))
    model.indexed.policies = {}  # any use of a policy would raise KeyError
    model.apply(("place", 0, "joule_weighted", 0, False, False, True))
    model.apply(("place", 0, "joule_weighted", 0, False, False, True))
    assert sorted(len(model.registry.get(w).leases) for w in WORKERS[:3]) == [0, 1, 1]
    model.registry.heartbeat("w0", Load(uj_per_token=2.5), model.now)  # the policy must rank the pool now
    with pytest.raises(KeyError):
        model.apply(("place", 0, "joule_weighted", 0, False, False, True))


def test_one_key_with_two_tests_is_two_pools() -> None:
    """matching() keeps admits and meets of one signature apart: an avoided worker stays out of the admits pool."""
    registry = WorkerRegistry()
    registry.register("a", Capabilities(ops=["x"]), 0.0)
    registry.register("b", Capabilities(ops=["x"]), 0.0)
    signature = Signature.of("x", Requirements(), avoid=["a"])
    assert [r.id for r in registry.matching(signature, signature.meets)] == ["a", "b"]
    again = Signature.of("x", Requirements(), avoid=["a"])  # a new, equal signature finds the cached pool
    assert [r.id for r in registry.matching(again, again.admits)] == ["b"]
    assert registry.matching(again, again.admits) is registry.matching(signature, signature.admits)


def test_stale_holds_an_overdue_worker_until_it_beats_or_is_reaped() -> None:
    """An overdue worker stays stale across ticks (a held-back reap), leaves on a beat, returns when silent again."""
    registry = WorkerRegistry(heartbeat_timeout_s=10.0)
    registry.register("a", Capabilities(ops=["x"]), 0.0)
    registry.register("b", Capabilities(ops=["x"]), 5.0)
    assert [r.id for r in registry.stale(11.0)] == ["a"]
    assert [r.id for r in registry.stale(12.0)] == ["a"]  # not reaped: still stale
    assert registry.stale(9.0) == []  # an earlier clock read: not stale then
    registry.heartbeat("a", Load(), 13.0)
    assert [r.id for r in registry.stale(16.0)] == ["b"]
    assert [r.id for r in registry.stale(24.0)] == ["a", "b"]
    assert registry.reap(24.0, only={"b"}) == ["b"]
    assert [r.id for r in registry.stale(25.0)] == ["a"]


def test_released_workers_are_offered_least_recently_assigned_first() -> None:
    """Two workers back to no lease: the index offers the one assigned longer ago, as the scan does."""
    model = Model(prefetch=0)
    for index in range(3):
        model.apply(("register", index, 1, 0, False))
    for _ in range(3):
        model.apply(("place", 0, "least_busy", 0, False, False, True))
    for index in (1, 0):
        model.apply(("release", index))
    model.apply(("place", 0, "least_busy", 0, False, False, True))  # compares with the scan
    assert model.registry.get("w0").leases and not model.registry.get("w1").leases


def _record(worker_id: str) -> WorkerRecord:
    return WorkerRecord(worker_id, Capabilities(ops=["x"], max_concurrency=1))


def test_first_steps_over_unusable_members_and_keeps_them() -> None:
    """Pool.first skips members the caller cannot use, without dropping them from the index."""
    a, b = _record("a"), _record("b")
    pool = Pool([a, b], lambda w: True)
    assert pool.first(lambda w: w.id != "a") is b
    assert pool.first(lambda w: True) is a
    a.leases.add("p")  # a full worker's entry is stale: never offered, even unreported
    assert pool.first(lambda w: True) is b


class Unranked(JouleWeighted):
    """joule_weighted whose pass over the candidates must not run."""

    def choose(self, ask: Any, candidates: Any, fleet: Any) -> WorkerRecord:
        raise AssertionError("the energy index should have answered")


def test_energy_ties_are_broken_by_busyness() -> None:
    """Among workers tied on least energy, the energy index gives the least busy, as joule_weighted does."""
    model = Model(prefetch=0, loads=[Load(uj_per_token=2.0)])
    for index in range(3):
        model.apply(("register", index, 2, 0, False))
    model.registry.heartbeat("w2", Load(uj_per_token=3.0), model.now)
    model.registry.heartbeat("w0", Load(uj_per_token=2.0, queued_tokens=100), model.now)
    model.indexed.policies = {**model.indexed.policies, "joule_weighted": Unranked()}
    model.apply(("place", 0, "joule_weighted", 0, False, False, True))  # w1: w0 is busier, w2 costs more
    assert model.registry.get("w1").leases and not model.registry.get("w0").leases


def test_energy_index_prefers_a_free_slot_to_a_cheaper_prefetch_queue() -> None:
    """A worker with only prefetch room is not chosen over one with a free slot, however efficient."""
    model = Model(prefetch=1, loads=[Load(uj_per_token=1.0)])
    model.apply(("register", 0, 1, 0, False))
    model.apply(("place", 0, "joule_weighted", 0, False, False, True))  # w0 holds its one slot
    model.apply(("register", 1, 1, 0, False))
    model.registry.heartbeat("w1", Load(uj_per_token=5.0), model.now)
    model.indexed.policies = {**model.indexed.policies, "joule_weighted": Unranked()}
    model.apply(("place", 0, "joule_weighted", 0, False, False, True))
    assert len(model.registry.get("w1").leases) == 1 and len(model.registry.get("w0").leases) == 1


@pytest.mark.parametrize(
    ("policy", "slow", "fast"),
    [
        ("joule_weighted", Load(uj_per_token=3.0), Load(uj_per_token=1.0)),
        (
            "carbon_weighted",
            Load(uj_per_token=1.0, zone_intensity_g_per_kwh=400.0),
            Load(uj_per_token=2.0, zone_intensity_g_per_kwh=50.0),
        ),
        ("latency_weighted", Load(latency_p50_ms=9.0), Load(latency_p50_ms=1.0)),
    ],
)
def test_a_figure_report_rekeys_the_index(policy: str, slow: Load, fast: Load) -> None:
    """A worker whose new report makes it the best is picked at once: its figure index was re-keyed by the report."""
    model = Model(prefetch=0, loads=[fast, slow])  # w0 beats loads[(0 + 2) % 2] = fast, w1 loads[1] = slow
    model.apply(("register", 0, 2, 0, False))
    model.apply(("register", 1, 2, 0, False))
    model.apply(("place", 0, policy, 0, False, False, False))  # builds the index: w0 is the better one
    pool = model.registry.matching(*_key(model, policy))
    assert (model.indexed.choose(model.plan(policy, 0, False, False), pool, model.now) or pool[1]).id == "w0"
    model.registry.heartbeat("w0", slow, model.now)
    model.registry.heartbeat("w1", fast, model.now)
    model.indexed.policies = {**model.indexed.policies, policy: unranked(model.indexed.policies[policy])}
    model.apply(("place", 0, policy, 0, False, False, True))
    assert model.registry.get("w1").leases and not model.registry.get("w0").leases


def unranked(policy: Any) -> Any:
    """A copy of ``policy`` whose pass over the candidates must not run (a figure index must answer)."""

    class Unranked(type(policy)):  # type: ignore[misc]
        def choose(self, ask: Any, candidates: Any, fleet: Any) -> WorkerRecord:
            raise AssertionError(f"the {type(policy).__name__} index should have answered")

    return Unranked()


def _key(model: Model, policy: str) -> tuple[Signature, Any]:
    plan = model.plan(policy, 0, False, False)
    signature = Signature.of(plan.op, plan.requirements, plan.avoid)
    return signature, signature.admits


def test_latency_index_compares_expected_latency_across_lease_levels() -> None:
    """A fast worker holding plans beats an idle slow one until latency * (leases + 1) ties; busyness breaks the tie."""
    model = Model(prefetch=0, loads=[Load(latency_p50_ms=2.0), Load(latency_p50_ms=6.0)])
    model.apply(("register", 0, 4, 0, False))  # beats loads[(0 + 4) % 2]: 2 ms
    model.apply(("register", 1, 3, 0, False))  # beats loads[(1 + 3) % 2]... re-beaten below
    model.registry.heartbeat("w1", Load(latency_p50_ms=6.0), model.now)
    model.indexed.policies = {**model.indexed.policies, "latency_weighted": unranked(LatencyWeighted())}
    for _ in range(2):  # w0 costs 2, then 4; w1 costs 6
        model.apply(("place", 0, "latency_weighted", 0, False, False, True))
    assert len(model.registry.get("w0").leases) == 2 and not model.registry.get("w1").leases
    model.apply(("place", 0, "latency_weighted", 0, False, False, True))  # 2 * 3 == 6 * 1: w1 is less busy
    assert len(model.registry.get("w0").leases) == 2 and len(model.registry.get("w1").leases) == 1


def test_placed_tokens_are_counted_by_the_registry_and_its_pools() -> None:
    """count_placed_tokens makes a plain worker not plain in its record and its pools, until its next report."""
    registry = WorkerRegistry()
    registry.register("a", Capabilities(ops=["x"], max_concurrency=1), 0.0)
    signature = Signature.of("x", Requirements())
    pool = registry.matching(signature, signature.admits)
    assert pool.not_plain == 0
    registry.count_placed_tokens("a", 40)
    assert registry.get("a").pending_tokens == 40 and not registry.get("a").plain and pool.not_plain == 1
    registry.heartbeat("a", Load(), 1.0)  # the report counts what was placed: plain again
    assert registry.get("a").pending_tokens == 0 and registry.get("a").plain and pool.not_plain == 0


def test_a_dropped_pool_is_retired_and_an_unindexed_pool_is_scanned() -> None:
    """Pools the registry stops maintaining say so, and placement passes over an unindexed pool's members."""
    registry = WorkerRegistry()
    registry.register("a", Capabilities(ops=["x"], max_concurrency=1), 0.0)
    pools = [registry.matching(("key", i), lambda w: True) for i in range(65)]
    assert all(pool.indexed for pool in pools)
    registry.register("b", Capabilities(ops=["x"], max_concurrency=1), 0.0)  # past 64 pools: the cache starts over
    assert not any(pool.indexed for pool in pools)
    unindexed = Pool.unindexed([registry.get("a"), registry.get("b")])
    assert not unindexed.indexed and unindexed.heap == [] and [w.id for w in unindexed] == ["a", "b"]
    placement = Placement(registry, {}, PlacementConfig())
    plan = Model(prefetch=0).plan("least_busy", 0, False, False)
    chosen = placement.choose(plan, unindexed, 0.0)
    assert chosen is not None and chosen.id == "a"


def test_avoiding_keeps_the_rest_of_the_signature() -> None:
    """Signature.avoiding changes only the avoided workers, sorted and without repeats."""
    signature = Signature.of("x", Requirements(tags=["t"], model="m"), avoid=["b", "a"])
    assert signature.avoiding(["c", "a", "c"]) == Signature.of("x", Requirements(tags=["t"], model="m"), ["a", "c"])
