"""Per-plan GPU devices as the coordinator counts them: what a plan needs, which of a worker's
devices match, which are free, and which a lease takes (docs/SEMANTICS.md §GPU resources).

A plan's ``resources`` (protocol ``Resources``) becomes a :class:`GpuNeed`: ``count`` devices,
each with at least ``min_memory_bytes`` and a model name containing ``accelerator``. A worker's
devices are its ``capabilities.gpus`` (whole GPUs, or MIG instances on a MIG host), named on the
wire by their position in that list; each may be held by ``capabilities.gpu_share`` plans at once
(1 unless the worker runs with ``--gpu-share K``). A share plan (``gpus`` a fraction below 1 with
``share``) holds one share of one device, and only on a worker that shares.

The registry (coordinator/registry.py) keeps, per worker, how many plans hold each device and
which devices each lease holds; it takes them when it claims a lease (:func:`pick`) and gives
them back when it releases one, whatever ended the lease. Placement asks :func:`pick` whether a
worker can take a plan now; :func:`largest_free` says why a plan waits.

Pure: no clock, no I/O.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

from protocol.messages import Capabilities, GpuInfo, Resources

__all__ = ["MAX_GPUS", "GpuNeed", "free_matching", "largest_free", "matching", "pick", "resources_problem"]

MAX_GPUS: Final = 64  # more devices than any host has: a typo, refused at submit


def resources_problem(resources: Resources) -> str | None:
    """Why a submit's ``resources`` is invalid, naming the field; None when it is valid."""
    gpus = resources.gpus
    if not isinstance(gpus, (int, float)) or math.isnan(gpus) or gpus < 0:
        return f"resources.gpus must be >= 0 (got {gpus})"
    if gpus > MAX_GPUS:
        return f"resources.gpus must be at most {MAX_GPUS} (got {gpus}); no host has that many devices"
    if gpus != int(gpus):
        if not resources.share:
            return (
                f"resources.gpus must be a whole number of devices (got {gpus}); a fraction below 1 needs "
                "resources.share=true (a worker started with --gpu-share K runs K plans per device)"
            )
        if gpus > 1:
            return f"resources.gpus {gpus} with share: a shared plan takes a fraction below 1 of one device"
    memory = resources.gpu_memory_gb
    if math.isnan(memory) or memory < 0 or memory > 1e6:
        return f"resources.gpu_memory_gb must be between 0 and 1e6 (got {memory})"
    if not gpus and (memory or resources.accelerator):
        return "resources.gpu_memory_gb and resources.accelerator need resources.gpus >= 1"
    if len(resources.accelerator) > 128:
        return "resources.accelerator must be at most 128 characters"
    return None


@dataclass(frozen=True, slots=True)
class GpuNeed:
    """What a plan holds of a worker's devices (hashable: it is part of a placement signature)."""

    count: int  # devices, each held for the plan's whole run
    min_memory_bytes: int = 0
    accelerator: str = ""  # lower case; a device matches when its name contains it ("": any)
    shared: bool = False  # a fraction of one device: only on a worker with gpu_share > 1

    @classmethod
    def of(cls, resources: Resources | None) -> GpuNeed | None:
        """The need of a (valid) ``resources``; None when it asks for no device."""
        if resources is None or not resources.gpus:
            return None
        shared = resources.gpus < 1
        return cls(
            count=1 if shared else int(resources.gpus),
            min_memory_bytes=int(resources.gpu_memory_gb * 1e9),
            accelerator=resources.accelerator.strip().lower(),
            shared=shared,
        )

    def matches(self, gpu: GpuInfo) -> bool:
        """Whether one device is good enough."""
        return gpu.memory_bytes >= self.min_memory_bytes and (
            not self.accelerator or self.accelerator in gpu.name.lower()
        )

    def describe(self, *, free: bool = True) -> str:
        """``2 free GPUs with ≥ 40 GB (H100)``: for waiting reasons."""
        noun = "share of a GPU" if self.shared else ("GPU" if self.count == 1 else "GPUs")
        text = f"{'a' if self.shared else self.count} {'free ' if free else ''}{noun}"
        if self.min_memory_bytes:
            text += f" with ≥ {self.min_memory_bytes / 1e9:g} GB"
        if self.accelerator:
            text += f" ({self.accelerator})"
        return text


def matching(need: GpuNeed, capabilities: Capabilities) -> list[int]:
    """Positions of the worker's devices that meet the need (ignoring who holds them)."""
    if need.shared and capabilities.gpu_share <= 1:
        return []
    return [i for i, gpu in enumerate(capabilities.gpus) if need.matches(gpu)]


def free_matching(need: GpuNeed, capabilities: Capabilities, use: Sequence[int]) -> list[int]:
    """Positions of matching devices with a share free, least held first, then least memory, then position."""
    share = max(1, capabilities.gpu_share)
    gpus = capabilities.gpus
    found = [i for i in matching(need, capabilities) if (use[i] if i < len(use) else 0) < share]
    found.sort(key=lambda i: (use[i] if i < len(use) else 0, gpus[i].memory_bytes, i))
    return found


def pick(need: GpuNeed, capabilities: Capabilities, use: Sequence[int]) -> tuple[int, ...] | None:
    """The devices a lease of the plan would take on this worker now; None when too few are free.

    Least-held devices first (spread plans before stacking them on a shared device), then the
    smallest that match (keep big devices for plans that need them).
    """
    free = free_matching(need, capabilities, use)
    if len(free) < need.count:
        return None
    return tuple(sorted(free[: need.count]))


def largest_free(need: GpuNeed, workers: Sequence[tuple[str, Capabilities, Sequence[int]]]) -> tuple[int, str]:
    """The most free matching devices one worker has, and that worker's id (``(0, "")``: no worker)."""
    best = (0, "")
    for worker_id, capabilities, use in workers:
        free = len(free_matching(need, capabilities, use))
        if free > best[0] or not best[1]:
            best = (free, worker_id)
    return best
