"""The fleetwire coordinator: a sans-I/O core (registry, plans, queue, placement) and its driver."""

from coordinator.core import Coordinator, CoreConfig, Effects
from coordinator.registry import WorkerRegistry

__all__ = ["Coordinator", "CoreConfig", "Effects", "WorkerRegistry"]
