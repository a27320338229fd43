"""Which models the fleet serves: ``GET /v1/models``, and the 404 of a request for one it does not.

Rules (docs/OPENAI.md §Models):

* A model is served when an alive worker (connected, beating: coordinator/registry.py) has op
  ``generate`` (its inference engine, worker_agent/inference.py) and lists the model in its
  ``capabilities.models`` (the engine's own models, and ``--model``). ``workers`` counts them;
  ``available`` those of them not drained by an operator (the others take no new plans).
* A request for a model no such worker serves is answered 404 ``model_not_found``; one whose
  workers are all busy is submitted and waits (coordinator/openai_api/reply.py, queue timeout).
* :class:`ModelTable` is rebuilt from the registry at most every :data:`REFRESH_S` (a scan of
  every worker per request would cost more than the request), and at once on a miss older than
  :data:`MISS_REFRESH_S`, so a worker that just connected is found and a client asking for
  unknown models in a loop costs one scan per that interval, not one per request.
* A request naming a pool (``x-fleetwire-pool``) is served only by that pool's workers: the 404
  and the listing look at them alone (a worker's pool: coordinator/shards.py ``pool_of``).

Pure: the registry's records and ``now`` come in.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Final

from coordinator.openai_api.request import GENERATE_OP
from coordinator.shards import pool_of
from coordinator.workers import WorkerRecord

__all__ = ["MISS_REFRESH_S", "REFRESH_S", "ModelTable", "Served", "served_models"]

REFRESH_S: Final = 1.0
MISS_REFRESH_S: Final = 0.1


@dataclass(slots=True)
class Served:
    """One model: alive workers that serve it, those of them not drained, and their pools."""

    workers: int = 0
    available: int = 0
    pools: frozenset[str] = frozenset()


def served_models(workers: Iterable[WorkerRecord]) -> dict[str, Served]:
    """The models ``workers`` (the alive ones: the caller's filter) serve, by name."""
    served: dict[str, Served] = {}
    for worker in workers:
        capabilities = worker.capabilities
        if GENERATE_OP not in capabilities.ops:
            continue
        for model in dict.fromkeys(capabilities.models):
            entry = served.get(model)
            if entry is None:
                entry = served[model] = Served()
            entry.workers += 1
            pool = pool_of(capabilities.tags)
            if pool not in entry.pools:
                entry.pools = entry.pools | {pool}
            if not worker.draining:
                entry.available += 1
    return served


class ModelTable:
    """The served models, rebuilt from the alive workers now and then (module docstring).

    Args:
        alive: the alive workers at ``now`` (``WorkerRegistry.iter_alive``).
    """

    def __init__(self, alive: Callable[[float], Iterable[WorkerRecord]]) -> None:
        self.alive = alive
        self.built_at: float | None = None
        self.models: dict[str, Served] = {}
        self.scans = 0  # rebuilds so far (tests, /metrics)

    def _fresh(self, now: float, max_age_s: float) -> dict[str, Served]:
        if self.built_at is None or now - self.built_at >= max_age_s or now < self.built_at:
            self.models = served_models(self.alive(now))
            self.built_at = now
            self.scans += 1
        return self.models

    def serves(self, model: str, now: float, pool: str | None = None) -> bool:
        """Whether an alive worker (of ``pool``, when given) serves ``model`` (a miss looks again after
        :data:`MISS_REFRESH_S`)."""
        entry = self._fresh(now, REFRESH_S).get(model)
        if entry is None or (pool is not None and pool not in entry.pools):
            entry = self._fresh(now, MISS_REFRESH_S).get(model)
        return entry is not None and (pool is None or pool in entry.pools)

    def listing(self, now: float, created: int = 0, pool: str | None = None) -> dict[str, Any]:
        """``GET /v1/models``: OpenAI's model list (of ``pool``'s workers, when given), with the fleet's counts
        in a ``fleetwire`` field."""
        models = self._fresh(now, MISS_REFRESH_S)
        return {
            "object": "list",
            "data": [
                {"id": name, "object": "model", "created": created, "owned_by": "fleetwire",
                 "fleetwire": {"workers": entry.workers, "available": entry.available}}
                for name, entry in sorted(models.items()) if pool is None or pool in entry.pools
            ],
        }
