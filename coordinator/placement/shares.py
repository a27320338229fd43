"""Each worker's share of recent placements, for ``kv_aware``'s bounded load (docs/ROUTING.md §Synthetic grid).

A placement weighs 1 when it is claimed and ``decay = 1 - 1/window`` less with each later
placement, so a worker's weight is how many of about the last ``window`` placements it took,
recent ones counting more. No clock: the decay is per placement, so the figure means the same
at any request rate. Reading or updating a worker costs O(1); the policy sums its candidates'.

The tracker owns its weights; :class:`~coordinator.placement.placer.Placement` tells it of
each claim and of reaped workers.
"""

from __future__ import annotations

__all__ = ["RecentShares"]


class RecentShares:
    """Per worker, placements decayed by ``1 - 1/window`` per later placement.

    Args:
        window: placements over which weights fade (>= 1).
    """

    def __init__(self, window: float) -> None:
        if not window >= 1:
            raise ValueError(f"the share window must be >= 1 placement, got {window}")
        self.decay = 1.0 - 1.0 / window
        self.placed = 0  # placements counted so far
        self._weights: dict[str, tuple[float, int]] = {}  # worker id -> (weight, ``placed`` when set)

    def of(self, worker_id: str) -> float:
        """The worker's weight now (0 for one never placed on)."""
        entry = self._weights.get(worker_id)
        return 0.0 if entry is None else entry[0] * self.decay ** (self.placed - entry[1])

    def add(self, worker_id: str) -> None:
        """A placement on the worker: every weight fades one step, this worker's gains 1."""
        self.placed = placed = self.placed + 1
        entry = self._weights.get(worker_id)  # of(), inlined: this runs for every placement
        weight = 1.0 if entry is None else entry[0] * self.decay ** (placed - entry[1]) + 1.0
        self._weights[worker_id] = (weight, placed)

    def forget(self, worker_id: str) -> None:
        """The worker is gone."""
        self._weights.pop(worker_id, None)
