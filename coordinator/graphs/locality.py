"""Where a consumer should run: the worker holding most of its referenced bytes (docs/SEMANTICS.md §Graphs).

Rules:

* A plan's *held bytes* on a worker are the sizes of its referenced inputs whose source
  (coordinator/graphs/lineage.py ``Source``) is on that worker.
* Below ``min_bytes`` held anywhere, locality plays no part: the placement policy chooses as for
  any plan (a fan-out of small outputs is spread, not piled on the producer's worker).
* Otherwise placement chooses among the workers with room that hold the most bytes (the policy
  ranks those equals). When the holder of the most bytes could run the plan but has no room, the
  plan waits for it, at most :func:`wait_bound_s` from when it became ready: about as long as
  copying the bytes would take (``pull_bytes_per_s``), never more than ``max_wait_s``. Past the
  bound it goes to the best worker with room, and the bytes are pulled there.

Pure: the caller hands in how long the plan has waited.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass

from coordinator.graphs.lineage import Source

__all__ = ["LocalityChoice", "LocalityConfig", "choose_holders", "held_bytes", "wait_bound_s"]


@dataclass(frozen=True)
class LocalityConfig:
    """Settings of locality-aware placement."""

    min_bytes: int = 1 << 20  # below this many referenced bytes on any worker, locality plays no part
    max_wait_s: float = 30.0  # the longest a plan waits for a busy holder
    min_wait_s: float = 0.5  # ... and the shortest, for bytes just over min_bytes
    pull_bytes_per_s: float = 200e6  # what a worker-to-worker copy is assumed to take, per second


@dataclass(frozen=True, slots=True)
class LocalityChoice:
    """What locality says about one placement.

    ``among``: choose only among these workers (the policy ranks them); empty: any worker.
    ``wait_for``: a busy holder the plan waits for instead (nothing is placed now), until ``wait_s``
    after it became ready. ``local_bytes``: what the chosen set holds (0: nothing local).
    """

    among: tuple[str, ...] = ()
    wait_for: str = ""
    wait_s: float = 0.0
    local_bytes: int = 0


def held_bytes(sources: Iterable[Source]) -> dict[str, int]:
    """Referenced bytes per worker that holds some."""
    held: dict[str, int] = {}
    for source in sources:
        held[source.worker_id] = held.get(source.worker_id, 0) + max(source.size, 0)
    return held


def wait_bound_s(total_bytes: int, config: LocalityConfig) -> float:
    """How long a plan with ``total_bytes`` held by a busy worker waits for it (module doc)."""
    return min(config.max_wait_s, max(config.min_wait_s, total_bytes / config.pull_bytes_per_s))


def choose_holders(
    held: Mapping[str, int], room: Collection[str], able: Collection[str], waited_s: float, config: LocalityConfig
) -> LocalityChoice:
    """Where a plan whose referenced bytes are ``held`` (worker -> bytes) should go.

    Args:
        held: :func:`held_bytes` of its sources.
        room: the workers that can run it and have room now.
        able: the workers that can run it and are alive, with room or not (a superset of ``room``).
        waited_s: how long it has been ready (0: it just became ready).
        config: the bounds.
    """
    if not held or max(held.values()) < config.min_bytes:
        return LocalityChoice()
    best = max(held.values())
    holders_with_room = [worker for worker in room if held.get(worker, 0) > 0]
    top = max((held[worker] for worker in holders_with_room), default=0)
    if top == best:
        return LocalityChoice(tuple(w for w in holders_with_room if held[w] == top), local_bytes=top)
    busy = sorted(worker for worker, size in held.items() if size == best and worker in able)
    bound = wait_bound_s(best, config)
    if busy and waited_s < bound:
        return LocalityChoice(wait_for=busy[0], wait_s=bound, local_bytes=best)
    if top > 0:
        return LocalityChoice(tuple(w for w in holders_with_room if held[w] == top), local_bytes=top)
    return LocalityChoice()
