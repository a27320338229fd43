"""Placement policies: which of the workers that can take a plan gets it (docs/ROUTING.md).

A policy is one small class with one method, :meth:`Policy.choose`. Placement
(``coordinator/placement/placer.py``) has already filtered the candidates (alive, not draining,
requirements met, room left, KV blocks fit) and handled sticky sessions; a policy only ranks
what is left and never returns None. Every ranking ends with the same tie-break, least
recently assigned and then the lowest id, so a decision is deterministic; for a plan with inputs
or outputs a worker with a data endpoint comes before both (its bytes go direct, not through the
coordinator's relay).

Derived figures, shared by the policies and the trace simulator:

* busyness = 4 · in_flight + 0.1 · queued_tokens (:func:`busyness`): one more running plan
  weighs as much as 40 queued prompt tokens;
* projected energy for n tokens = µJ/token · n (:func:`projected_uj`);
* projected emissions = energy in kWh * zone intensity in gCO2e/kWh (:func:`projected_g`);
  ``carbon_weighted`` computes it as (µJ/token * intensity) * tokens / µJ per kWh
  (:func:`projected_carbon`), so its ranking follows the product µJ/token * intensity that the
  pool's carbon index is ordered by (coordinator/capacity.py).

The load a policy sees is the coordinator's own (:class:`FleetView`): its lease counts and
the prompt tokens it placed since the worker's last report, so a load report that is
seconds old never sends a burst of plans to one worker.

A policy owns only its own state (round robin's cursor); it reads the candidates' records
and never changes them.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Final, Protocol

from coordinator.workers import WorkerRecord, latency_ms

__all__ = [
    "DEFAULT_POLICY",
    "POLICY_NAMES",
    "Ask",
    "CarbonWeighted",
    "FleetView",
    "JouleWeighted",
    "KvAware",
    "LatencyWeighted",
    "LeastBusy",
    "Policy",
    "PolicyKnobs",
    "RoundRobin",
    "busyness",
    "make_policies",
    "projected_carbon",
    "projected_g",
    "projected_uj",
]

BUSY_PER_IN_FLIGHT: Final = 4.0
BUSY_PER_QUEUED_TOKEN: Final = 0.1
UJ_PER_KWH: Final = 3.6e12  # 1 kWh = 3.6e6 J = 3.6e12 µJ
DEFAULT_POLICY: Final = "joule_weighted"
HARD_BOUND_FACTOR: Final = 2.0  # kv_aware's bound for diversions that lose most of a match: (1 + 2ε)


def busyness(in_flight: int, queued_tokens: float) -> float:
    """How busy a worker is: 4 per plan in flight plus 0.1 per queued token (monotone in both)."""
    return BUSY_PER_IN_FLIGHT * in_flight + BUSY_PER_QUEUED_TOKEN * queued_tokens


def projected_uj(uj_per_token: float, tokens: int) -> float:
    """Energy, in µJ, of ``tokens`` tokens on a worker spending ``uj_per_token`` each."""
    return uj_per_token * tokens


def projected_g(uj: float, intensity_g_per_kwh: float) -> float:
    """Emissions, in gCO2e, of ``uj`` µJ drawn from a grid at ``intensity_g_per_kwh``."""
    return uj / UJ_PER_KWH * intensity_g_per_kwh


def projected_carbon(uj_g_per_token_kwh: float, tokens: int) -> float:
    """Emissions, in gCO2e, of ``tokens`` tokens on a worker whose µJ/token * zone intensity is the first argument.

    :func:`projected_g` of :func:`projected_uj`, multiplied in another order: this one is
    non-decreasing in its first argument for a given ``tokens`` (each step is a multiplication
    or division by a positive number), so the least product is the least emissions exactly.
    """
    return uj_g_per_token_kwh * tokens / UJ_PER_KWH


@dataclass(frozen=True, slots=True)
class Ask:
    """What a policy knows of the plan it places (from its routing hints)."""

    tokens: int = 0  # prompt + maximum output tokens (0: unknown)
    prompt_tokens: int = 0
    prefix_hashes: tuple[int, ...] = ()
    data: bool = False  # the plan has inputs or outputs: of tied workers, one with a data endpoint first


class FleetView(Protocol):
    """The coordinator-side load of candidates, as policies may read it."""

    def busyness(self, worker: WorkerRecord) -> float:
        """:func:`busyness` of the worker, from the coordinator's own counts."""
        ...

    def prefix_match(self, hashes: Sequence[int], workers: Sequence[WorkerRecord]) -> dict[str, int]:
        """Per worker id, how many leading ``hashes`` its prefix cache holds (absent: 0)."""
        ...

    def recent_placements(self, worker: WorkerRecord) -> float:
        """The worker's recent placements: each counts 1, decaying by ``1 - 1/window`` per later placement."""
        ...


class Policy(Protocol):
    """Chooses one of ``candidates`` (never empty) for the plan described by ``ask``."""

    def choose(self, ask: Ask, candidates: Sequence[WorkerRecord], fleet: FleetView) -> WorkerRecord: ...


def _tie(worker: WorkerRecord, ask: Ask) -> tuple[bool, int, str]:
    """The last keys of every ranking: for a plan with inputs or outputs a worker with a data endpoint
    (its bytes go direct, not relayed through the coordinator), then the least recently assigned, the lowest id."""
    return ask.data and not worker.data_url, worker.last_assigned, worker.id


def _least_busy(candidates: Sequence[WorkerRecord], fleet: FleetView, ask: Ask) -> WorkerRecord:
    return min(candidates, key=lambda w: (fleet.busyness(w), *_tie(w, ask)))


def _near_least_busy(candidates: Sequence[WorkerRecord], fleet: FleetView, max_gap: float) -> list[WorkerRecord]:
    """The candidates whose busyness is within ``max_gap`` of the least busy one."""
    loads = [(fleet.busyness(w), w) for w in candidates]
    floor = min(load for load, _ in loads)
    return [w for load, w in loads if load <= floor + max_gap]


@dataclass
class RoundRobin:
    """Each plan to the next candidate in id order after the previous choice.

    The cursor is a worker id, not an index, so workers joining or leaving do not make
    it skip or repeat anyone.
    """

    cursor: str = ""

    def choose(self, ask: Ask, candidates: Sequence[WorkerRecord], fleet: FleetView) -> WorkerRecord:
        after = [w for w in candidates if w.id > self.cursor]
        chosen = min(after or candidates, key=lambda w: w.id)
        self.cursor = chosen.id
        return chosen


@dataclass
class LeastBusy:
    """The candidate with the least busyness."""

    def choose(self, ask: Ask, candidates: Sequence[WorkerRecord], fleet: FleetView) -> WorkerRecord:
        return _least_busy(candidates, fleet, ask)


@dataclass
class LatencyWeighted:
    """The least expected latency: reported p50 latency * (leases + 1), Finagle's "peak EWMA" cost.

    Multiplying by the outstanding count makes a fast worker take more plans, but not all
    of them: its cost grows with every plan it holds. A worker that has not reported a
    latency yet is costed at the mean of those that have (1 ms when none has), so a new
    worker is tried rather than starved.
    """

    def choose(self, ask: Ask, candidates: Sequence[WorkerRecord], fleet: FleetView) -> WorkerRecord:
        fallback = _mean_known(candidates, _latency_ms)

        def expected(w: WorkerRecord) -> float:
            return (_latency_ms(w) or fallback) * (len(w.leases) + 1)

        return min(candidates, key=lambda w: (expected(w), fleet.busyness(w), *_tie(w, ask)))


def _mean_known(candidates: Sequence[WorkerRecord], figure: Callable[[WorkerRecord], float]) -> float:
    """The mean of a reported figure over the candidates that report it (> 0); 1.0 when none does.

    The sum is exact (``math.fsum``), so the mean does not depend on the candidates' order.
    """
    known = [value for w in candidates if (value := figure(w)) > 0]
    return math.fsum(known) / len(known) if known else 1.0


_latency_ms: Final = latency_ms  # the figure the pool's latency index keys on (coordinator/workers.py)


def _uj_per_token(worker: WorkerRecord) -> float:
    return worker.load.uj_per_token if worker.load is not None else 0.0


def _intensity(worker: WorkerRecord) -> float:
    return worker.load.zone_intensity_g_per_kwh if worker.load is not None else 0.0


@dataclass
class JouleWeighted:
    """The least projected energy (µJ/token * the plan's tokens) among the near-least-busy.

    A worker that has not reported its µJ/token (no heartbeat yet, or no power probe) is
    costed at the mean of those that have, so it is neither preferred nor starved; when
    none reports one, this is least busy. ``max_gap`` (busyness units) keeps the choice
    among workers nearly as idle as the least busy one: inf lets efficient workers fill
    every free slot, 0 makes it least busy with energy as the tie-break.
    """

    max_gap: float = float("inf")

    def choose(self, ask: Ask, candidates: Sequence[WorkerRecord], fleet: FleetView) -> WorkerRecord:
        # With no gap limit every candidate is near enough: skip a busyness() per candidate.
        pool = candidates if self.max_gap == math.inf else _near_least_busy(candidates, fleet, self.max_gap)
        fallback = _mean_known(pool, _uj_per_token)
        tokens = max(ask.tokens, 1)
        # min by (energy, busyness, tie) without busyness() for all: only the least-energy ones need it.
        costs = [(projected_uj(_uj_per_token(w) or fallback, tokens), w) for w in pool]
        least = min(cost for cost, _ in costs)
        tied = [w for cost, w in costs if cost == least] or pool  # a NaN figure ties with nothing
        return min(tied, key=lambda w: (fleet.busyness(w), *_tie(w, ask)))


@dataclass
class CarbonWeighted:
    """The least projected emissions (energy * zone intensity) among the near-least-busy.

    A worker that has not reported its µJ/token or its zone intensity is costed at the
    mean of the workers that have. ``max_gap`` as for :class:`JouleWeighted`.
    """

    max_gap: float = float("inf")

    def choose(self, ask: Ask, candidates: Sequence[WorkerRecord], fleet: FleetView) -> WorkerRecord:
        pool = _near_least_busy(candidates, fleet, self.max_gap)
        uj_fallback = _mean_known(pool, _uj_per_token)
        intensity_fallback = _mean_known(pool, _intensity)
        tokens = max(ask.tokens, 1)

        def score(w: WorkerRecord) -> tuple[float, float, bool, int, str]:
            per_token = (_uj_per_token(w) or uj_fallback) * (_intensity(w) or intensity_fallback)
            return projected_carbon(per_token, tokens), fleet.busyness(w), *_tie(w, ask)

        return min(pool, key=score)


@dataclass
class KvAware:
    """Longest prefix-block match, guarded by load (the SGLang router's rule), optionally with bounded load.

    Falls back to least busy when the match is shorter than ``min_match_blocks``
    (a prefix every request shares, such as a system prompt, says nothing about where
    the rest is cached) or when the fleet is imbalanced: the busiest candidate is more
    than ``balance_gap`` busyness units above the least busy one *and* more than
    ``balance_ratio`` times it. Among equally long matches, the least busy wins.

    With a finite ``load_bound`` ε (consistent hashing with bounded loads, Mirrokni et al.),
    the load is each candidate's share of recent placements (:meth:`FleetView.recent_placements`)
    and a candidate is *over* when its share + 1 exceeds (1 + ε) · (the candidates' total + 1) / n.
    An over candidate loses its prefix preference, so a hot prefix is copied to the best
    match among the others (often a worker that already holds it); except when diverting
    the plan would lose more than half of its matched blocks (a long conversation), which
    only happens past (1 + 2ε). Among equally long matches the least recent share wins
    (then the least busy). Cost: one pass over the candidates.
    """

    min_match_blocks: int = 2
    balance_gap: float = 20_000.0
    balance_ratio: float = 1.5
    load_bound: float = math.inf

    def choose(self, ask: Ask, candidates: Sequence[WorkerRecord], fleet: FleetView) -> WorkerRecord:
        if not ask.prefix_hashes:
            return _least_busy(candidates, fleet, ask)
        loads = [fleet.busyness(w) for w in candidates]
        low, high = min(loads), max(loads)
        if high - low > self.balance_gap and high > self.balance_ratio * low:
            return _least_busy(candidates, fleet, ask)
        matches = fleet.prefix_match(ask.prefix_hashes, candidates)
        if self.load_bound != math.inf and matches:
            return self._bounded(ask, candidates, matches, fleet)
        best = max(matches.values(), default=0)
        if best < max(1, self.min_match_blocks):
            return _least_busy(candidates, fleet, ask)
        return _least_busy([w for w in candidates if matches.get(w.id, 0) == best], fleet, ask)

    def _bounded(
        self, ask: Ask, candidates: Sequence[WorkerRecord], matches: dict[str, int], fleet: FleetView
    ) -> WorkerRecord:
        """The longest match among the candidates under the bound (class doc); least recent share breaks ties."""
        shares = {w.id: fleet.recent_placements(w) for w in candidates}
        per_worker = (math.fsum(shares.values()) + 1.0) / len(candidates)
        soft = (1.0 + self.load_bound) * per_worker
        under = matches
        if any(share + 1.0 <= soft for share in shares.values()):  # else nobody is under it: no bound yet
            full = max(matches.values())
            kept = max((m for i, m in matches.items() if shares[i] + 1.0 <= soft), default=0)
            # Diverting loses most of the hit (a conversation's own blocks): only past the hard bound.
            cap = soft if full - kept <= full / 2 else (1.0 + HARD_BOUND_FACTOR * self.load_bound) * per_worker
            if any(share + 1.0 <= cap for share in shares.values()):
                under = {i: m for i, m in matches.items() if shares[i] + 1.0 <= cap}
        best = max(under.values(), default=0)
        if best < max(1, self.min_match_blocks):
            return _least_busy(candidates, fleet, ask)
        tied = [w for w in candidates if under.get(w.id, 0) == best]
        return min(tied, key=lambda w: (shares[w.id], fleet.busyness(w), *_tie(w, ask)))


@dataclass(frozen=True)
class PolicyKnobs:
    """The tunable numbers of the policies (``fleetwire coordinator --policy-option``)."""

    energy_max_gap: float = float("inf")
    kv_min_match_blocks: int = 2
    kv_balance_gap: float = 20_000.0
    kv_balance_ratio: float = 1.5
    kv_load_bound: float = math.inf  # kv_aware's ε; inf: no bound (docs/ROUTING.md §Synthetic grid)
    kv_share_window: float = 1024.0  # placements over which recent shares decay (1 - 1/window each)

    def check(self) -> None:
        """Raise ``ValueError`` naming a knob whose value cannot work."""
        if not self.kv_load_bound >= 0:
            raise ValueError(f"kv_load_bound must be >= 0 (inf: no bound), got {self.kv_load_bound}")
        if not (self.kv_share_window >= 1 and math.isfinite(self.kv_share_window)):
            raise ValueError(f"kv_share_window must be a finite number of placements >= 1, got {self.kv_share_window}")


_FACTORIES: Final[dict[str, Callable[[PolicyKnobs], Policy]]] = {
    "round_robin": lambda k: RoundRobin(),
    "least_busy": lambda k: LeastBusy(),
    "latency_weighted": lambda k: LatencyWeighted(),
    "joule_weighted": lambda k: JouleWeighted(max_gap=k.energy_max_gap),
    "carbon_weighted": lambda k: CarbonWeighted(max_gap=k.energy_max_gap),
    "kv_aware": lambda k: KvAware(
        min_match_blocks=k.kv_min_match_blocks,
        balance_gap=k.kv_balance_gap,
        balance_ratio=k.kv_balance_ratio,
        load_bound=k.kv_load_bound,
    ),
}

POLICY_NAMES: Final = tuple(_FACTORIES)


def make_policies(knobs: PolicyKnobs | None = None) -> dict[str, Policy]:
    """One instance of every policy, by name (round robin keeps its cursor in its instance)."""
    knobs = knobs or PolicyKnobs()
    return {name: factory(knobs) for name, factory in _FACTORIES.items()}
