"""Pools: a signature's matching workers, with an index of those that have room.

The registry caches, per signature, the connected workers that meet it (a :class:`Pool`, which
is a list so callers iterate it as before). Each pool also keeps a heap of the members with
room, ordered by :func:`slot_key` = ``(tier, leases, last_assigned, id)``: tier 0 has a free
slot, tier 1 only prefetch room. The head of that heap, skipping members that cannot take a
plan now (draining, not alive, KV blocks do not fit), is exactly what least-busy placement
picks when no member reports a load figure (busyness is then 4 per lease), so a placement
among 10,000 workers costs O(log W) instead of a pass over the pool (coordinator/placement/placer.py).

The heap is lazy, like the plan queue's: a change to a worker pushes its new key, and an entry
whose key no longer matches its worker (or whose worker left the pool) is dropped when it
surfaces. Entries are checked against the worker's state when they surface, so a lost slot is
never offered even if a change was not reported; a gained slot must be reported (the registry
does so on every claim, release and registration). When stale entries outnumber the members,
the heap is rebuilt from them.

*Plain* workers report no load figure a policy reads (no queued tokens, µJ/token, zone
intensity or latency, and nothing placed since their last report): every policy ranks plain
workers as least busy does. Each pool counts its members that are not plain; placement uses
the index only while that count is 0.

A second heap, built the first time ``joule_weighted`` asks, orders the members with room by
:func:`energy_key` = ``(tier, µJ/token, leases, last_assigned, id)``. While every member
reports a µJ/token (so none is costed at the mean of the others), the least projected energy
is at its head whatever else the workers report, and only the workers tied with it need their
busyness computed (at most ``limit`` of them, least leased first: see :meth:`Pool.least_energy`).

Two more indexes serve the other figure policies the same way, built on first use:
``carbon_weighted`` orders the members with room that report both a µJ/token and a zone
intensity by :func:`carbon_key` = ``(tier, µJ/token * intensity, leases, last_assigned, id)``
(projected grams grow with that product: coordinator/placement/policies.py ``projected_carbon``), and
``latency_weighted`` keeps one heap per ``(tier, leases)`` level of the members that report a
latency, ordered by :func:`latency_key`'s ``(latency, last_assigned, id)``: the least expected
latency (latency * (leases + 1)) is the least of the levels' heads (:meth:`Pool.least_latency`),
so a decision costs O(L log W) for L levels (at most max concurrency + prefetch + 1).

When members are not plain, a policy must score candidates; for a large pool placement takes
them from the head of the room heap (:meth:`Pool.top`): the ``k`` usable members of the best
tier with the fewest leases, least recently assigned first (docs/ROUTING.md §Large pools).

Ownership and invariants:

* A pool owns its member list, its indexes and its counts; only its methods write them. The
  registry (coordinator/registry.py) owns the workers' records and tells each pool of a
  member's change through a named method (:meth:`Pool.add`, :meth:`Pool.remove_member`,
  :meth:`Pool.changed`, :meth:`Pool.figures_changed`, :meth:`Pool.tally`, :meth:`Pool.retire`).
* Each count equals the number of members whose cached flag (``WorkerRecord.plain``,
  ``has_energy``, ``has_carbon``, ``has_latency``: coordinator/workers.py) says so.
* While :attr:`Pool.indexed`, every member with room has an entry with its current key in the
  room heap, and in each figure heap built so far when it reports that figure.
* Dependencies point one way: coordinator/workers.py <- this module <- the registry and placement.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterable

from coordinator.mypyc_compat import mypyc_attr
from coordinator.workers import WorkerRecord, has_carbon, has_energy, has_latency, latency_ms

__all__ = ["Pool", "carbon_key", "energy_key", "latency_key", "slot_key"]

SlotKey = tuple[int, int, int, str]
EnergyKey = tuple[int, float, int, int, str]  # also a carbon key: (tier, figure, leases, last_assigned, id)
LatencyKey = EnergyKey  # (tier, latency, leases, last_assigned, id), one heap per (tier, leases)
Level = tuple[int, int]  # (tier, leases): one latency heap each


def _admit_all(worker: WorkerRecord) -> bool:
    return True


def slot_key(worker: WorkerRecord) -> SlotKey | None:
    """``(tier, leases, last_assigned, id)`` of a worker with room (draining aside); None without room.

    Tier 0: a free slot (``leases < max_concurrency``); tier 1: room only in its prefetch queue.
    """
    limit = worker.capabilities.max_concurrency
    leases = len(worker.leases)
    if limit <= 0 or leases >= limit + worker.prefetch:
        return None
    return (0 if leases < limit else 1, leases, worker.last_assigned, worker.id)


def energy_key(worker: WorkerRecord) -> EnergyKey | None:
    """``(tier, µJ/token, leases, last_assigned, id)`` of a worker with room that reports a µJ/token; else None.

    Lease count and last assignment order the workers tied on energy as the room heap orders
    them, so a bounded tie-break takes the least leased (:meth:`Pool.least_energy`).
    """
    slot = slot_key(worker)
    if slot is None or not has_energy(worker):
        return None
    assert worker.load is not None
    return (slot[0], worker.load.uj_per_token, slot[1], slot[2], worker.id)


def carbon_key(worker: WorkerRecord) -> EnergyKey | None:
    """``(tier, µJ/token * intensity, leases, last_assigned, id)`` of a worker with room and both figures; else None."""
    slot = slot_key(worker)
    if slot is None or not has_carbon(worker):
        return None
    assert worker.load is not None
    return (slot[0], worker.load.uj_per_token * worker.load.zone_intensity_g_per_kwh, slot[1], slot[2], worker.id)


def latency_key(worker: WorkerRecord) -> LatencyKey | None:
    """``(tier, latency, leases, last_assigned, id)`` of a worker with room that reports a latency; else None.

    Its heap is the one of its ``(tier, leases)`` level, where the order is (latency, last assigned, id).
    """
    slot = slot_key(worker)
    if slot is None or not has_latency(worker):
        return None
    return (slot[0], latency_ms(worker), slot[1], slot[2], worker.id)


def _times(factor: int) -> Callable[[float], float]:
    """``x -> x * factor``, made here: compiled (setup.py), a closure in a method of Pool crashes mypyc."""
    return lambda x: x * factor


def _expected_order(w: WorkerRecord) -> tuple[int, float, int, int, str]:
    """A member's (tier, expected latency, leases, last assigned, id): :meth:`Pool.least_latency` without ties."""
    leases = len(w.leases)
    tier = 0 if leases < w.capabilities.max_concurrency else 1
    return tier, latency_ms(w) * (leases + 1), leases, w.last_assigned, w.id


@mypyc_attr(native_class=False)  # compiled (setup.py): a native class cannot derive from list
class Pool(list[WorkerRecord]):
    """The connected workers that meet one cached key, in arrival order, plus their room indexes.

    The pool owns its indexes and its counts (``not_plain``, ``no_energy``, ``no_carbon``,
    ``no_latency``): only its own methods write them. The registry reports each change of a
    member through a named method: :meth:`add` and :meth:`remove_member` (membership),
    :meth:`changed` (room), :meth:`figures_changed` (a report's figures), :meth:`tally` around a
    change of the member's report flags, and :meth:`retire` when it stops maintaining the pool.

    Args:
        members: the workers that meet the key now.
        meets: the test a worker must pass to be a member (applied again when one registers).
    """

    def __init__(self, members: Iterable[WorkerRecord], meets: Callable[[WorkerRecord], bool]) -> None:
        super().__init__()
        self.meets = meets
        self.ids: dict[str, WorkerRecord] = {}
        self.heap: list[SlotKey] = []
        self.energy: list[EnergyKey] | None = None  # built on first use (least_energy)
        self.carbon: list[EnergyKey] | None = None  # built on first use (least_carbon)
        self.latency: dict[Level, list[LatencyKey]] | None = None  # built on first use (least_latency)
        self.latency_entries = 0  # entries in the latency heaps when built, plus those pushed since
        self.not_plain = 0  # members that are not plain
        self.no_energy = 0  # members without a µJ/token (has_energy)
        self.no_carbon = 0  # members without a µJ/token or a zone intensity (has_carbon)
        self.no_latency = 0  # members without a latency (has_latency)
        # False once the registry stopped maintaining the pool (retire), or for an unindexed one:
        # placement then passes over the members instead of asking the indexes.
        self.indexed = True
        for worker in members:
            self.add(worker)

    @classmethod
    def unindexed(cls, workers: Iterable[WorkerRecord]) -> Pool:
        """A fixed set of workers that placement ranks in one pass over them, without indexes.

        Not kept up to date by anyone, so its heaps stay empty and :attr:`indexed` is False
        (tests compare the indexes' answers with this pass; ``meets`` admits everyone).
        """
        pool = cls((), _admit_all)
        pool.indexed = False
        for worker in workers:
            pool.append(worker)
            pool.ids[worker.id] = worker
            pool.tally(worker, 1)
        return pool

    def retire(self) -> None:
        """The registry dropped the pool from its cache: its indexes are no longer kept up to date."""
        self.indexed = False

    def add(self, worker: WorkerRecord) -> None:
        """Make the worker a member (it must not be one)."""
        self.append(worker)
        self.ids[worker.id] = worker
        self.tally(worker, 1)
        self.changed(worker)

    def tally(self, worker: WorkerRecord, sign: int) -> None:
        """Add (``sign`` 1) or take away (-1) a member's report flags in the pool's counts.

        The registry takes a member's flags away before it changes them and adds them back
        after (coordinator/registry.py), so the counts always match the members' flags.
        """
        self.not_plain += sign * (not worker.plain)
        self.no_energy += sign * (not worker.has_energy)
        self.no_carbon += sign * (not worker.has_carbon)
        self.no_latency += sign * (not worker.has_latency)

    def remove_member(self, worker: WorkerRecord) -> None:
        """Stop the worker being a member (its heap entries go stale); a non-member is ignored."""
        if self.ids.get(worker.id) is not worker:
            return
        del self.ids[worker.id]
        self.remove(worker)
        self.tally(worker, -1)

    def changed(self, worker: WorkerRecord) -> None:
        """A member's room changed: index its new keys (rebuilding a heap that is mostly stale)."""
        # slot_key(worker), inlined: twice a plan (a lease's claim and its release)
        limit = worker.capabilities.max_concurrency
        leases = len(worker.leases)
        if limit > 0 and leases < limit + worker.prefetch:
            heap = self.heap  # read once: compiled, Pool is not native and each read is a lookup (twice a plan)
            heapq.heappush(heap, (0 if leases < limit else 1, leases, worker.last_assigned, worker.id))
            if len(heap) > 2 * len(self) + 64:
                self.heap = heap = [k for w in self if (k := slot_key(w)) is not None]
                heapq.heapify(heap)
        if self.energy is not None or self.carbon is not None or self.latency is not None:  # no call per lease
            self.figures_changed(worker)  # without a figure heap built (plain pools never build one) it does nothing

    def figures_changed(self, worker: WorkerRecord) -> None:
        """A member's room, µJ/token, zone intensity or latency changed: index its keys in the heaps built so far.

        A heap that grew past twice the members is dropped, to be rebuilt when next asked.
        """
        if self.energy is None and self.carbon is None and self.latency is None:
            return  # no figure heap built yet (plain pools never build one): nothing to index
        bound = 2 * len(self) + 64
        if self.energy is not None and (energy := energy_key(worker)) is not None:
            heapq.heappush(self.energy, energy)
            if len(self.energy) > bound:
                self.energy = None
        if self.carbon is not None and (carbon := carbon_key(worker)) is not None:
            heapq.heappush(self.carbon, carbon)
            if len(self.carbon) > bound:
                self.carbon = None
        if self.latency is not None and (latency := latency_key(worker)) is not None:
            heapq.heappush(self.latency.setdefault((latency[0], latency[2]), []), latency)
            self.latency_entries += 1
            if self.latency_entries > bound:
                self.latency = None

    def first(self, usable: Callable[[WorkerRecord], bool]) -> WorkerRecord | None:
        """The member with the least :func:`slot_key` for which ``usable`` holds; None if none.

        Members with room that are not usable (draining, not alive, no KV room for this plan)
        are stepped over and stay indexed.
        """
        heap, ids = self.heap, self.ids
        aside: list[SlotKey] = []
        found: WorkerRecord | None = None
        while heap:
            entry = heap[0]
            worker = ids.get(entry[3])
            if worker is None or len(worker.leases) != entry[1] or slot_key(worker) != entry:
                heapq.heappop(heap)  # stale: the worker left, or its room changed since (most often its leases)
                continue
            if usable(worker):
                found = worker
                break
            aside.append(heapq.heappop(heap))
        for entry in aside:
            heapq.heappush(heap, entry)
        return found

    def top(self, usable: Callable[[WorkerRecord], bool], k: int) -> list[WorkerRecord]:
        """Up to ``k`` usable members with the least :func:`slot_key`, all of one tier (the best usable).

        What a least-busy pre-filter picks: free slots before prefetch room, then fewest leases,
        least recently assigned, lowest id. Unusable members are stepped over and stay indexed;
        stale and duplicate entries met on the way are dropped.
        """
        heap, ids, pop = self.heap, self.ids, heapq.heappop
        aside: list[SlotKey] = []
        seen: set[str] = set()
        found: list[WorkerRecord] = []
        tier = -1
        while heap and len(found) < k:
            entry = pop(heap)
            worker_id = entry[3]
            worker = ids.get(worker_id)
            if worker is None or worker_id in seen or slot_key(worker) != entry:
                continue  # stale, or a second equal entry of a worker already met: dropped
            if found and entry[0] != tier:
                aside.append(entry)
                break  # the heap is ordered by tier first: the rest is a worse tier
            aside.append(entry)
            seen.add(worker_id)
            if usable(worker):
                tier = entry[0]
                found.append(worker)
        push = heapq.heappush
        for entry in aside:
            push(heap, entry)
        return found

    def least_energy(
        self,
        usable: Callable[[WorkerRecord], bool],
        tokens: int,
        limit: int = 0,
        *,
        ties: bool = True,
        tier: int | None = None,
    ) -> list[WorkerRecord]:
        """The usable members of the best tier (or ``tier``) whose projected energy (µJ/token * ``tokens``) is least.

        Exact only while every member reports a µJ/token (``no_energy == 0``). The products are
        compared as ``joule_weighted`` compares them, so two figures that round to one energy tie.
        With ``limit`` > 0, at most ``limit`` tied members, in heap order (fewest leases, least
        recently assigned first, within one µJ/token figure). Without ``ties``, the first
        ``limit`` members in heap order, tied or not.
        """
        if self.energy is None:
            self.energy = [k for w in self if (k := energy_key(w)) is not None]
            heapq.heapify(self.energy)
        return self._least(self.energy, energy_key, usable, _times(tokens), limit, ties=ties, tier=tier)

    def least_carbon(
        self,
        usable: Callable[[WorkerRecord], bool],
        score: Callable[[float], float],
        limit: int = 0,
        *,
        ties: bool = True,
        tier: int | None = None,
    ) -> list[WorkerRecord]:
        """Usable members with both figures in :func:`carbon_key` order, of one tier (the best, or ``tier``).

        ``score`` maps µJ/token * intensity to the policy's projected grams (non-decreasing).
        With ``ties``, the members whose score equals the least (exact only while every member
        reports both figures, ``no_carbon == 0``); without, simply the first. ``limit`` > 0 caps
        how many are returned.
        """
        if self.carbon is None:
            self.carbon = [k for w in self if (k := carbon_key(w)) is not None]
            heapq.heapify(self.carbon)
        return self._least(self.carbon, carbon_key, usable, score, limit, ties=ties, tier=tier)

    def _least(
        self,
        heap: list[EnergyKey],
        key_of: Callable[[WorkerRecord], EnergyKey | None],
        usable: Callable[[WorkerRecord], bool],
        score: Callable[[float], float],
        limit: int,
        *,
        ties: bool,
        tier: int | None = None,
    ) -> list[WorkerRecord]:
        """Walk a ``(tier, figure, ...)`` heap in order: see :meth:`least_energy` and :meth:`least_carbon`."""
        ids = self.ids
        aside: list[EnergyKey] = []
        found: dict[str, WorkerRecord] = {}  # a worker may have two equal entries
        first_tier, least = -1, 0.0
        while heap and not (limit > 0 and len(found) >= limit):
            entry = heap[0]
            worker = ids.get(entry[4])
            if worker is None or key_of(worker) != entry:
                heapq.heappop(heap)  # stale: the worker left, or its room or figures changed since
                continue
            if tier is not None and entry[0] > tier:
                break  # ordered by tier first: nothing further is of the asked tier
            if found and (entry[0] != first_tier or (ties and score(entry[1]) != least)):
                break  # the heap is ordered by (tier, figure): nothing further ties
            aside.append(heapq.heappop(heap))
            if usable(worker):
                if not found:
                    first_tier, least = entry[0], score(entry[1])
                found[worker.id] = worker
        for entry in aside:
            heapq.heappush(heap, entry)
        return list(found.values())

    def _walk(
        self, levels: dict[Level, list[LatencyKey]], level: Level, usable: Callable[[WorkerRecord], bool], count: int,
        tied: bool, tier: int | None,
    ) -> list[WorkerRecord]:
        """One level's heap for :meth:`least_latency` (a method, not a closure in it: see :func:`_times`)."""
        return self._least(levels[level], latency_key, usable, _times(level[1] + 1), count, ties=tied, tier=tier)

    def least_latency(
        self, usable: Callable[[WorkerRecord], bool], limit: int = 0, *, ties: bool = True, tier: int | None = None
    ) -> list[WorkerRecord]:
        """Usable members with a latency, least expected latency (latency * (leases + 1)) first, of one tier.

        With ``ties``, the members of the best tier (or ``tier``) whose expected latency equals
        the least, levels of fewer leases first (exact only while every member reports a
        latency, ``no_latency == 0``); without, the first in ``(expected, leases, last_assigned,
        id)`` order. ``limit`` > 0 caps how many are returned.
        """
        levels = self.latency
        if levels is None:
            levels = self.latency = {}
            for worker in self:
                if (key := latency_key(worker)) is not None:
                    levels.setdefault((key[0], key[2]), []).append(key)
            for level_heap in levels.values():
                heapq.heapify(level_heap)
            self.latency_entries = sum(map(len, levels.values()))
        asked = sorted(level for level in levels if tier is None or level[0] == tier)

        found: list[WorkerRecord] = []
        if not ties:  # each level's first ``limit``, merged (only where some members lack a latency)
            for level in asked:
                found += self._walk(levels, level, usable, limit, False, tier)
            order = _expected_order
            found.sort(key=order)
            found = [w for w in found if order(w)[0] == order(found[0])[0]]
            return found[:limit] if limit > 0 else found
        if len(asked) > 1:  # the least (tier, expected) among the levels' heads picks the levels to walk
            heads = {level: head for level in asked if (head := self._walk(levels, level, usable, 1, False, tier))}
            best = min(((level[0], latency_ms(w[0]) * (level[1] + 1)) for level, w in heads.items()), default=None)
            asked = [lv for lv, w in heads.items() if (lv[0], latency_ms(w[0]) * (lv[1] + 1)) == best]
        for level in asked:
            found += self._walk(levels, level, usable, limit - len(found) if limit > 0 else 0, True, tier)
            if limit > 0 and len(found) >= limit:
                break
        for level in [level for level, level_heap in levels.items() if not level_heap]:
            del levels[level]
        return found
