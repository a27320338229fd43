"""Pools: a signature's matching workers, with an index of those that have room.

The registry caches, per signature, the connected workers that meet it (a :class:`Pool`, which
is a list so callers iterate it as before). Each pool also keeps a heap of the members with
room, ordered by :func:`slot_key` = ``(tier, leases, last_assigned, id)``: tier 0 has a free
slot, tier 1 only prefetch room. The head of that heap, skipping members that cannot take a
plan now (draining, not alive, KV blocks do not fit), is exactly what least-busy placement
picks when no member reports a load figure (busyness is then 4 per lease), so a placement
among 10,000 workers costs O(log W) instead of a pass over the pool (coordinator/placement.py).

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

When members are not plain, a policy must score candidates; for a large pool placement takes
them from the head of the room heap (:meth:`Pool.top`): the ``k`` usable members of the best
tier with the fewest leases, least recently assigned first (docs/ROUTING.md §Large pools).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from coordinator.registry import WorkerRecord

__all__ = ["Pool", "energy_key", "has_energy", "is_plain", "slot_key"]

SlotKey = tuple[int, int, int, str]
EnergyKey = tuple[int, float, int, int, str]


def slot_key(worker: WorkerRecord) -> SlotKey | None:
    """``(tier, leases, last_assigned, id)`` of a worker with room (draining aside); None without room.

    Tier 0: a free slot (``leases < max_concurrency``); tier 1: room only in its prefetch queue.
    """
    limit = worker.capabilities.max_concurrency
    leases = len(worker.leases)
    if limit <= 0 or leases >= limit + worker.prefetch:
        return None
    return (0 if leases < limit else 1, leases, worker.last_assigned, worker.id)


def is_plain(worker: WorkerRecord) -> bool:
    """Whether no policy can tell the worker from another with the same lease count (see module doc)."""
    if worker.pending_tokens:
        return False
    load = worker.load
    return load is None or not (
        load.queued_tokens
        or load.uj_per_token
        or load.zone_intensity_g_per_kwh
        or load.latency_p50_ms
        or load.latency_ema_ms
    )


def has_energy(worker: WorkerRecord) -> bool:
    """Whether the worker reports a µJ/token that ``joule_weighted`` uses as is (finite and > 0)."""
    load = worker.load
    return load is not None and 0 < load.uj_per_token < math.inf


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


class Pool(list["WorkerRecord"]):
    """The connected workers that meet one cached key, in arrival order, plus their room indexes.

    Args:
        members: the workers that meet the key now.
        meets: the test a worker must pass to be a member (applied again when one registers).
    """

    def __init__(self, members: Iterable[WorkerRecord], meets: Callable[[WorkerRecord], bool]) -> None:
        super().__init__()
        self.meets = meets
        self.ids: dict[str, WorkerRecord] = {}
        self.heap: list[SlotKey] = []
        self.energy: list[EnergyKey] | None = None  # built on first use (energy_heap)
        self.not_plain = 0  # members that are not plain
        self.no_energy = 0  # members without a µJ/token (has_energy)
        self.live = True  # False once the registry dropped this pool from its cache
        for worker in members:
            self.add(worker)

    def add(self, worker: WorkerRecord) -> None:
        """Make the worker a member (it must not be one)."""
        self.append(worker)
        self.ids[worker.id] = worker
        self.not_plain += not worker.plain
        self.no_energy += not worker.has_energy
        self.changed(worker)

    def remove_member(self, worker: WorkerRecord) -> None:
        """Stop the worker being a member (its heap entries go stale); a non-member is ignored."""
        if self.ids.get(worker.id) is not worker:
            return
        del self.ids[worker.id]
        self.remove(worker)
        self.not_plain -= not worker.plain
        self.no_energy -= not worker.has_energy

    def changed(self, worker: WorkerRecord) -> None:
        """A member's room or µJ/token changed: index its new keys (rebuilding a heap that is mostly stale)."""
        key = slot_key(worker)
        if key is not None:
            heapq.heappush(self.heap, key)
            if len(self.heap) > 2 * len(self) + 64:
                self.heap = [k for w in self if (k := slot_key(w)) is not None]
                heapq.heapify(self.heap)
        if self.energy is not None:
            self.energy_changed(worker)

    def energy_changed(self, worker: WorkerRecord) -> None:
        """A member's µJ/token (or room) changed: index its energy key, once that heap is built."""
        if self.energy is not None and (energy := energy_key(worker)) is not None:
            heapq.heappush(self.energy, energy)
            if len(self.energy) > 2 * len(self) + 64:
                self.energy = None  # rebuilt when next asked

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
            if worker is None or slot_key(worker) != entry:
                heapq.heappop(heap)  # stale: the worker left, or its room changed since
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

    def least_energy(self, usable: Callable[[WorkerRecord], bool], tokens: int, limit: int = 0) -> list[WorkerRecord]:
        """The usable members of the best tier whose projected energy (µJ/token * ``tokens``) is least.

        Exact only while every member reports a µJ/token (``no_energy == 0``). The products are
        compared as ``joule_weighted`` compares them, so two figures that round to one energy tie.
        With ``limit`` > 0, at most ``limit`` tied members, in heap order (fewest leases, least
        recently assigned first, within one µJ/token figure).
        """
        heap = self.energy
        if heap is None:
            heap = self.energy = [k for w in self if (k := energy_key(w)) is not None]
            heapq.heapify(heap)
        ids = self.ids
        aside: list[EnergyKey] = []
        tied: dict[str, WorkerRecord] = {}  # a worker may have two equal entries
        tier, least = -1, 0.0
        while heap and not (limit > 0 and len(tied) >= limit):
            entry = heap[0]
            worker = ids.get(entry[4])
            if worker is None or energy_key(worker) != entry:
                heapq.heappop(heap)
                continue
            if tied and (entry[0] != tier or entry[1] * tokens != least):
                break  # the heap is ordered by (tier, µJ/token): nothing further ties
            aside.append(heapq.heappop(heap))
            if usable(worker):
                if not tied:
                    tier, least = entry[0], entry[1] * tokens
                tied[worker.id] = worker
        for entry in aside:
            heapq.heappush(heap, entry)
        return list(tied.values())
