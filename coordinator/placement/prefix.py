"""The coordinator's picture of each worker's prefix (KV) cache, for ``kv_aware`` placement.

Workers do not report what their caches hold: like the SGLang router's approximate radix
tree, the coordinator remembers which prefix blocks it sent to each worker and ages them
out as the worker's own cache would, least recently used first, within the worker's budget
(``kv_blocks`` * ``kv_block_tokens`` tokens).

A hash names a block *and every block before it* (docs/ROUTING.md §kv_aware), so a plan's
blocks are touched deepest first: the first block of a prompt is the most recently used,
and eviction takes a prompt's tail before its head, as vLLM's evictor does. A match is the
number of leading hashes a worker holds.

The index owns its per-worker LRUs and the reverse index of holders: a hash lists a worker
as holder exactly while that worker's LRU holds it, and a worker's used tokens never exceed
its budget after a call returns.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence

__all__ = ["PrefixIndex"]


class PrefixIndex:
    """Per worker, an LRU of prefix-block hashes weighted by the tokens each covers.

    Args:
        max_entries: a bound on the hashes held per worker whatever its budget, so a
            worker advertising a huge cache cannot make the coordinator grow without end.
    """

    def __init__(self, max_entries: int = 1 << 20) -> None:
        self.max_entries = max_entries
        self._caches: dict[str, OrderedDict[int, int]] = {}  # worker -> hash -> tokens
        self._used: dict[str, int] = {}
        self._capacity: dict[str, int] = {}
        self._holders: dict[int, set[str]] = {}

    def set_capacity(self, worker_id: str, tokens: int) -> None:
        """The worker's cache budget in tokens; evicts down to it at once."""
        self._capacity[worker_id] = max(0, tokens)
        self._evict(worker_id)

    def insert(self, worker_id: str, hashes: Sequence[int], block_tokens: int) -> None:
        """The worker now holds these blocks (a prompt it was sent), each ``block_tokens`` long."""
        if not hashes or self._capacity.get(worker_id, 0) <= 0:
            return
        cache = self._caches.setdefault(worker_id, OrderedDict())
        used = self._used.get(worker_id, 0)
        for h in reversed(hashes):
            if h in cache:
                cache.move_to_end(h)
                continue
            cache[h] = block_tokens
            used += block_tokens
            holders = self._holders.get(h)
            if holders is None:
                self._holders[h] = {worker_id}
            else:
                holders.add(worker_id)
        self._used[worker_id] = used
        self._evict(worker_id)

    def _evict(self, worker_id: str) -> None:
        cache = self._caches.get(worker_id)
        if cache is None:
            return
        capacity = self._capacity.get(worker_id, 0)
        used = self._used.get(worker_id, 0)
        while cache and (used > capacity or len(cache) > self.max_entries):
            h, tokens = cache.popitem(last=False)
            used -= tokens
            self._drop_holder(h, worker_id)
        self._used[worker_id] = used

    def _drop_holder(self, h: int, worker_id: str) -> None:
        holders = self._holders.get(h)
        if holders is not None:
            holders.discard(worker_id)
            if not holders:
                del self._holders[h]

    def match(self, hashes: Sequence[int], worker_ids: Iterable[str]) -> dict[str, int]:
        """Per worker id that holds at least the first block, how many leading blocks it holds.

        Cost is one set intersection per matched block, whatever the number of workers.
        """
        result: dict[str, int] = {}
        alive = set(worker_ids)
        for depth, h in enumerate(hashes, 1):
            holders = self._holders.get(h)
            if not holders:
                break
            alive &= holders
            if not alive:
                break
            for worker_id in alive:
                result[worker_id] = depth
        return result

    def longer_holders(self, hashes: Sequence[int], floor: int, eligible: Callable[[str], bool]) -> list[str]:
        """The eligible workers with the longest match of ``hashes``, when it is longer than ``floor``.

        Walks the blocks from the deepest one anybody holds up to ``floor + 1`` and looks only
        at the workers holding them, so the cost follows the holders of blocks deeper than
        ``floor``, not the number of workers. A worker first met at depth d holds no deeper block, so its match is
        at most d, and the walk stops once d is below the best match found.
        """
        best, found = floor, []
        seen: set[str] = set()
        deepest = 0  # no match reaches past the first block nobody holds
        while deepest < len(hashes) and hashes[deepest] in self._holders:
            deepest += 1
        for depth in range(deepest, floor, -1):
            if depth < best:
                break
            for worker_id in self._holders.get(hashes[depth - 1], ()):
                if worker_id in seen:
                    continue
                seen.add(worker_id)
                if not eligible(worker_id):
                    continue
                cache = self._caches[worker_id]  # a holder always has a cache
                held = 0
                while held < depth and hashes[held] in cache:
                    held += 1
                if held > best:
                    best, found = held, [worker_id]
                elif held == best and held > floor:
                    found.append(worker_id)
        return found

    def touch(self, worker_id: str, hashes: Sequence[int]) -> None:
        """Mark blocks the worker already holds as just used (a hit refreshes them)."""
        cache = self._caches.get(worker_id)
        if cache is not None:
            for h in reversed(hashes):
                if h in cache:
                    cache.move_to_end(h)

    def forget(self, worker_id: str) -> None:
        """The worker is gone (reaped): its cache with it."""
        for h in self._caches.pop(worker_id, {}):
            self._drop_holder(h, worker_id)
        self._used.pop(worker_id, None)
        self._capacity.pop(worker_id, None)

    def held(self, worker_id: str) -> int:
        """How many blocks the worker is thought to hold."""
        return len(self._caches.get(worker_id, ()))
