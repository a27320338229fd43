"""Which of this worker's devices each running plan holds (docs/SEMANTICS.md §GPU resources).

:class:`DeviceAllocator` is the worker's own account, pure (no I/O, no clock): the runner
allocates when a plan starts and releases when its task ends, whatever ended it (done, failed,
cancelled, timed out, silenced by a lost lease). Two plans never hold one device unless the
operator allowed sharing (``--gpu-share K``: K plans per device).

Devices are the worker's ``capabilities.gpus`` (whole GPUs, or MIG instances when MIG is on),
named by their position in that list, as the coordinator names them in ``assign.devices``. The
coordinator counts the same devices (coordinator/devices.py); it says which ones it counted the
plan on, and the allocator takes those when they are free here, else any free ones that match.

:func:`parse_gpus` reads ``--gpus`` (``0,1,2,3`` or ``0:80GB:H100,1:80GB:H100``): devices declared
where NVML cannot see them (containers) and for tests without a GPU; :func:`contradiction` says
why a declaration disagrees with what NVML sees.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass

import protocol

__all__ = ["DeviceAllocator", "DeviceRequest", "contradiction", "parse_gpus"]

_MEMORY = re.compile(r"^(\d+(?:\.\d+)?)\s*(GB|GIB|G|MB|MIB|M)?$", re.IGNORECASE)


@dataclass(frozen=True, slots=True)
class DeviceRequest:
    """What one plan asks for: ``count`` devices, each with ``min_memory_bytes``, named like ``accelerator``."""

    count: int
    min_memory_bytes: int = 0
    accelerator: str = ""

    @classmethod
    def of(cls, resources: protocol.Resources | None) -> DeviceRequest | None:
        """The request of an ``assign.resources``; None when it asks for no device."""
        if resources is None or not resources.gpus or not resources.gpus > 0 or math.isinf(resources.gpus):
            return None
        return cls(
            count=max(1, int(resources.gpus)),
            min_memory_bytes=int(resources.gpu_memory_gb * 1e9),
            accelerator=resources.accelerator.strip().lower(),
        )

    def matches(self, gpu: protocol.GpuInfo) -> bool:
        """Whether one device is good enough."""
        return gpu.memory_bytes >= self.min_memory_bytes and (
            not self.accelerator or self.accelerator in gpu.name.lower()
        )


class DeviceAllocator:
    """This worker's devices and the plans holding each.

    Args:
        gpus: the devices, as advertised in ``hello`` (positions are their names).
        share: plans one device may hold at once (``--gpu-share``; 1: none shared).

    Raises:
        ValueError: ``share`` below 1.
    """

    def __init__(self, gpus: Sequence[protocol.GpuInfo], share: int = 1) -> None:
        if share < 1:
            raise ValueError(f"gpu share must be >= 1, got {share}")
        self.gpus = list(gpus)
        self.share = share
        self._use = [0] * len(self.gpus)
        self._held: dict[str, tuple[int, ...]] = {}
        # Quarantined devices (worker_agent/gpu_health.py): no new plan gets one until an operator releases it.
        self.blocked: frozenset[int] = frozenset()

    def __len__(self) -> int:
        return len(self.gpus)

    @property
    def free(self) -> int:
        """Devices no plan holds (and not quarantined)."""
        return sum(1 for i, n in enumerate(self._use) if n == 0 and i not in self.blocked)

    def could_allocate(self, request: DeviceRequest) -> bool:
        """Whether the request fits once every plan here has ended (False: too few unquarantined devices match)."""
        fit = sum(1 for i, gpu in enumerate(self.gpus) if i not in self.blocked and request.matches(gpu))
        return fit >= request.count

    def use(self) -> list[int]:
        """How many plans hold each device, by position."""
        return list(self._use)

    def held(self, key: str) -> tuple[int, ...]:
        """The devices ``key`` holds (empty: none)."""
        return self._held.get(key, ())

    def can_allocate(self, request: DeviceRequest) -> bool:
        """Whether :meth:`allocate` would succeed now."""
        return len(self._free_matching(request)) >= request.count

    def allocate(self, key: str, request: DeviceRequest, preferred: Sequence[int] = ()) -> tuple[int, ...] | None:
        """Give ``key`` (a plan attempt) ``request.count`` devices; None when too few are free.

        ``preferred`` (the coordinator's choice) is taken when every one of them is free here and
        matches; otherwise the least-held, smallest matching devices. A key that already holds
        devices keeps them (idempotent).
        """
        if key in self._held:
            return self._held[key]
        free = self._free_matching(request)
        wanted = tuple(sorted(set(preferred)))
        if len(wanted) == request.count and all(i in free for i in wanted):
            chosen = wanted
        elif len(free) >= request.count:
            chosen = tuple(sorted(free[: request.count]))
        else:
            return None
        for i in chosen:
            self._use[i] += 1
        self._held[key] = chosen
        return chosen

    def release(self, key: str) -> tuple[int, ...]:
        """``key``'s plan ended: its devices are free again. Releasing a key that holds none is a no-op."""
        held = self._held.pop(key, ())
        for i in held:
            self._use[i] = max(0, self._use[i] - 1)
        return held

    def visible(self, devices: Sequence[int]) -> str:
        """``CUDA_VISIBLE_DEVICES`` for these devices: their indexes, or MIG instances' UUIDs."""
        return ",".join(self.gpus[i].visible_id or str(self.gpus[i].index) for i in devices)

    def _free_matching(self, request: DeviceRequest) -> list[int]:
        use, gpus, blocked = self._use, self.gpus, self.blocked
        found = [i for i, gpu in enumerate(gpus) if use[i] < self.share and request.matches(gpu) and i not in blocked]
        found.sort(key=lambda i: (use[i], gpus[i].memory_bytes, i))
        return found


def _memory_bytes(text: str, spec: str) -> int:
    match = _MEMORY.match(text.strip())
    if match is None:
        raise ValueError(f"--gpus {spec!r}: memory {text!r} is not a size like 80GB")
    value, unit = float(match.group(1)), (match.group(2) or "GB").upper()
    scale = {"GB": 1e9, "G": 1e9, "GIB": 1 << 30, "MB": 1e6, "M": 1e6, "MIB": 1 << 20}[unit]
    return int(value * scale)


def parse_gpus(spec: str) -> list[protocol.GpuInfo]:
    """The devices a ``--gpus`` declaration names: ``0,1,2,3`` or ``0:80GB:H100,1:80GB:H100``.

    Raises:
        ValueError: a malformed or repeated entry; the message quotes it.
    """
    gpus: list[protocol.GpuInfo] = []
    seen: set[str] = set()
    for entry in (part.strip() for part in spec.split(",")):
        if not entry:
            raise ValueError(f"--gpus {spec!r}: an empty entry (write 0,1,2,3 or 0:80GB:H100,1:80GB:H100)")
        ident, *rest = entry.split(":")
        if len(rest) > 2:
            raise ValueError(f"--gpus {spec!r}: {entry!r} has more than INDEX:MEMORY:MODEL")
        if not ident or ident in seen:
            raise ValueError(f"--gpus {spec!r}: device {ident!r} is {'repeated' if ident else 'empty'}")
        seen.add(ident)
        memory = _memory_bytes(rest[0], spec) if rest and rest[0] else 0
        name = rest[1] if len(rest) > 1 and rest[1] else "declared"
        if ident.isdigit():
            gpus.append(protocol.GpuInfo(name=name, memory_bytes=memory, index=int(ident)))
        else:  # a MIG instance or GPU UUID, e.g. MIG-5c9b...: CUDA_VISIBLE_DEVICES names it so
            gpus.append(protocol.GpuInfo(name=name, memory_bytes=memory, index=len(gpus), uuid=ident, visible_id=ident))
    return gpus


def contradiction(declared: Sequence[protocol.GpuInfo], probed: Sequence[protocol.GpuInfo]) -> str | None:
    """Why a ``--gpus`` declaration disagrees with the devices NVML sees; None when it does not.

    NVML seeing no device is no contradiction (that is what ``--gpus`` is for). Otherwise each
    declared index must be one NVML has (each UUID one it lists), with no more memory than NVML
    reports and, when a model is named, one NVML's name contains.
    """
    if not probed:
        return None
    by_index = {g.index: g for g in probed if not g.parent_uuid}
    by_id = {g.uuid: g for g in probed if g.uuid} | {g.visible_id: g for g in probed if g.visible_id}
    for gpu in declared:
        real = by_id.get(gpu.visible_id) if gpu.visible_id else by_index.get(gpu.index)
        name = gpu.visible_id or str(gpu.index)
        if real is None:
            seen = ", ".join(sorted({g.visible_id or str(g.index) for g in probed}))
            return f"--gpus declares device {name}, which NVML does not see (it sees: {seen})"
        if gpu.memory_bytes > real.memory_bytes > 0:
            return (
                f"--gpus declares device {name} with {gpu.memory_bytes / 1e9:g} GB; "
                f"NVML reports {real.memory_bytes / 1e9:g} GB ({real.name})"
            )
        if gpu.name != "declared" and gpu.name.lower() not in real.name.lower():
            return f"--gpus declares device {name} as {gpu.name!r}; NVML reports {real.name!r}"
    return None
