"""GPU health: what the worker samples of each device, and when a device is quarantined.

Theory of operation (docs/OPERATIONS.md §GPU health):

* A :class:`HealthSource` reads one physical GPU at a time (utilisation, memory used, temperature,
  power, the clocks event reasons now active, volatile ECC error counts) and the critical XID
  events since its last call (an NVML event set, polled). :class:`NvmlHealthSource` is NVML's;
  :class:`FakeNvml` is one whose readings and faults a test (or ``bench/gpu_check.py`` on a host
  without a GPU) sets.
* :class:`HealthRules` is pure (no I/O, no clock): it takes each reading, failed probe and XID,
  and keeps each device's state. Rules, in order of weight:

  - **quarantined**: a *fatal* XID (:data:`FATAL_XIDS`: double-bit ECC, fallen off the bus,
    uncontained ECC, row-remap failure, NVLink, GSP; 13, 31, 43, 45 and other application faults are
    not), uncorrectable ECC errors *rising* since the first reading (or since the last release), or
    :attr:`~HealthRules.probe_failures` health probes in a row failing (NVML cannot read the device:
    ``GPU is lost``). A quarantine holds until an operator releases the device
    (``fleetwire device release WORKER DEVICE``), whatever later readings say: a device that threw
    a fatal XID can look healthy a second later.
  - **degraded**: hotter than :attr:`~HealthRules.hot_c`, or clocks held down by hardware
    (:data:`DEGRADING_THROTTLES`: hardware slowdown, thermal or power-brake). Reported (and shown
    on the dashboard), still placed on, cleared by the next normal reading.
  - **ok** otherwise.

* Devices are named by their position in ``capabilities.gpus`` (as in ``assign.devices``). A MIG
  instance is read through its physical GPU: a fault of the GPU is a fault of each of its instances.
* :class:`HealthMonitor` is the asyncio driver: every ``interval_s`` it reads every GPU in a thread
  (a wedged driver never blocks the loop that carries heartbeats), feeds the rules, and calls
  ``changed`` when a device's state moved (the agent sends a load frame at once, so the coordinator
  stops placing on a quarantined device within a sample interval).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, Protocol

import structlog

import protocol

__all__ = [
    "DEGRADING_THROTTLES",
    "FATAL_XIDS",
    "FakeNvml",
    "HealthMonitor",
    "HealthRules",
    "HealthSource",
    "NvmlHealthSource",
    "ProbeFailed",
    "Reading",
    "physical_of",
    "throttle_names",
]

log = structlog.get_logger(__name__)

#: XIDs after which a GPU is not to be trusted with new work until someone looks at it (NVIDIA's XID
#: catalogue: "reset the GPU" actions). 48 double-bit ECC, 61/62 internal micro-controller, 64 row-remap
#: failure, 74 NVLink, 79 fallen off the bus, 95 uncontained ECC, 119/120 GSP, 140 unrecovered ECC.
FATAL_XIDS: Final = frozenset({48, 61, 62, 64, 74, 79, 95, 119, 120, 140})

#: NVML clocks event reasons, by bit (``nvmlClocksEventReason*``).
_THROTTLE_BITS: Final = (
    (0x1, "gpu_idle"), (0x2, "applications_clocks"), (0x4, "sw_power_cap"), (0x8, "hw_slowdown"),
    (0x10, "sync_boost"), (0x20, "sw_thermal_slowdown"), (0x40, "hw_thermal_slowdown"),
    (0x80, "hw_power_brake_slowdown"), (0x100, "display_clock"),
)  # fmt: skip

#: Reasons that mean the device is held below its clocks by heat or by hardware: a degraded device.
#: (A software power cap under load is how a busy GPU normally runs.)
DEGRADING_THROTTLES: Final = frozenset({"hw_slowdown", "sw_thermal_slowdown", "hw_thermal_slowdown",
                                        "hw_power_brake_slowdown"})  # fmt: skip


def throttle_names(mask: int) -> tuple[str, ...]:
    """The reasons an NVML clocks event mask holds, by name."""
    return tuple(name for bit, name in _THROTTLE_BITS if mask & bit)


class ProbeFailed(Exception):
    """A device could not be read (NVML's ``GPU is lost``, ``Unknown Error``, a timeout)."""


@dataclass(frozen=True, slots=True)
class Reading:
    """One physical GPU read once. ECC counts are None where the device has no ECC (or it is off)."""

    utilization_pct: float = 0.0
    memory_used_bytes: int = 0
    temperature_c: float = 0.0
    power_w: float = 0.0
    throttle: tuple[str, ...] = ()
    ecc_corrected: int | None = None
    ecc_uncorrected: int | None = None


class HealthSource(Protocol):
    """What reads the GPUs (NVML, or a fake). Called from a worker thread, never on the event loop."""

    def read(self, physical: int) -> Reading:
        """Read physical GPU ``physical`` (its NVML index). Raises :class:`ProbeFailed`."""

    def xids(self) -> list[tuple[int, int]]:
        """Critical XID events since the last call: ``(physical index, xid)``; never blocks."""

    def close(self) -> None:
        """Release what the source holds."""


@dataclass(slots=True)
class _Device:
    """What the rules keep of one device (a position in ``capabilities.gpus``)."""

    index: int
    state: protocol.DeviceState = "ok"
    reason: str = ""
    reading: Reading = field(default_factory=Reading)
    ecc_baseline: int | None = None  # uncorrectable errors at the first reading (or the last release)
    failures: int = 0  # failed probes in a row
    xid: int = 0
    xid_count: int = 0
    quarantine: str = ""  # why it is quarantined ("": it is not); held until released


class HealthRules:
    """Each device's health from its readings, failed probes and XIDs (module docstring). Pure.

    Args:
        count: devices (positions in ``capabilities.gpus``).
        hot_c: temperature from which a device is degraded.
        probe_failures: failed probes in a row that quarantine a device.
        fatal_xids: XIDs that quarantine a device.

    Raises:
        ValueError: ``probe_failures`` below 1.
    """

    def __init__(self, count: int, *, hot_c: float = 90.0, probe_failures: int = 2,
                 fatal_xids: Iterable[int] = FATAL_XIDS) -> None:  # fmt: skip
        if probe_failures < 1:
            raise ValueError(f"probe_failures must be >= 1, got {probe_failures}")
        self.hot_c = hot_c
        self.probe_failures = probe_failures
        self.fatal_xids = frozenset(fatal_xids)
        self._devices = [_Device(i) for i in range(count)]

    def __len__(self) -> int:
        return len(self._devices)

    def read(self, index: int, reading: Reading) -> bool:
        """A device was read; returns whether its state changed."""
        device = self._devices[index]
        device.reading = reading
        device.failures = 0
        uncorrected = reading.ecc_uncorrected
        if uncorrected is not None:
            if device.ecc_baseline is None or uncorrected < device.ecc_baseline:  # first reading, or a driver reload
                device.ecc_baseline = uncorrected
            elif uncorrected > device.ecc_baseline and not device.quarantine:
                device.quarantine = f"uncorrectable ECC errors rose from {device.ecc_baseline} to {uncorrected}"
        return self._settle(device)

    def probe_failed(self, index: int, why: str) -> bool:
        """A device could not be read; returns whether its state changed."""
        device = self._devices[index]
        device.failures += 1
        if device.failures >= self.probe_failures and not device.quarantine:
            device.quarantine = f"health probe failed {device.failures} times in a row: {why}"
        return self._settle(device)

    def xid(self, index: int, xid: int) -> bool:
        """A critical XID event of a device; returns whether its state changed."""
        device = self._devices[index]
        device.xid = xid
        device.xid_count += 1
        if xid in self.fatal_xids and not device.quarantine:
            device.quarantine = f"fatal XID {xid}{_XID_NAMES.get(xid, '')}"
        return self._settle(device)

    def release(self, index: int) -> bool:
        """An operator released the device: its quarantine ends, its counters are the new baseline.
        Returns whether it was quarantined."""
        device = self._devices[index]
        was = bool(device.quarantine)
        device.quarantine = ""
        device.failures = 0
        device.ecc_baseline = device.reading.ecc_uncorrected
        self._settle(device)
        return was

    @property
    def quarantined(self) -> tuple[int, ...]:
        """Positions of the quarantined devices."""
        return tuple(d.index for d in self._devices if d.quarantine)

    def state(self, index: int) -> tuple[protocol.DeviceState, str]:
        """A device's state and why."""
        device = self._devices[index]
        return device.state, device.reason

    def report(self) -> list[protocol.DeviceHealth]:
        """Every device's health, for the ``load`` frame."""
        out = []
        for d in self._devices:
            r = d.reading
            out.append(protocol.DeviceHealth(
                index=d.index, state=d.state, reason=d.reason, utilization_pct=r.utilization_pct,
                memory_used_bytes=r.memory_used_bytes, temperature_c=r.temperature_c, power_w=r.power_w,
                throttle=list(r.throttle), ecc_corrected=r.ecc_corrected or 0, ecc_uncorrected=r.ecc_uncorrected or 0,
                xid=d.xid, xid_count=d.xid_count,
            ))  # fmt: skip
        return out

    def _settle(self, device: _Device) -> bool:
        """The device's state from what is known now; whether it changed."""
        before = (device.state, device.reason)
        if device.quarantine:
            device.state, device.reason = "quarantined", device.quarantine
        elif device.failures:
            device.state, device.reason = "degraded", f"health probe failed ({device.failures} in a row)"
        else:
            r = device.reading
            hot = r.temperature_c >= self.hot_c
            held = [t for t in r.throttle if t in DEGRADING_THROTTLES]
            why = []
            if hot:
                why.append(f"temperature {r.temperature_c:g} °C >= {self.hot_c:g} °C")
            if held:
                why.append(f"clocks held down: {', '.join(held)}")
            device.state, device.reason = ("degraded", "; ".join(why)) if why else ("ok", "")
        return (device.state, device.reason) != before


_XID_NAMES: Final = {
    48: " (double-bit ECC error)", 61: " (internal micro-controller breakpoint)",
    62: " (internal micro-controller halt)",
    64: " (ECC page retirement or row remapping failure)", 74: " (NVLink error)", 79: " (GPU has fallen off the bus)",
    95: " (uncontained ECC error)", 119: " (GSP RPC timeout)", 120: " (GSP error)", 140: " (unrecovered ECC error)",
}  # fmt: skip


def physical_of(gpus: Sequence[protocol.GpuInfo], uuids: Sequence[str] = ()) -> list[int | None]:
    """The physical GPU (NVML index) each device position is read through: a whole GPU's index, a MIG
    instance's parent (found among ``uuids``, NVML's UUIDs by index); None where it cannot be told."""
    by_uuid = {u: i for i, u in enumerate(uuids) if u}
    out: list[int | None] = []
    for gpu in gpus:
        if gpu.parent_uuid:
            out.append(by_uuid.get(gpu.parent_uuid))
        elif gpu.uuid and gpu.uuid in by_uuid:
            out.append(by_uuid[gpu.uuid])
        elif not gpu.visible_id or gpu.visible_id == str(gpu.index):
            out.append(gpu.index)
        else:
            out.append(None)
    return out


class HealthMonitor:
    """Reads the GPUs every ``interval_s`` and keeps :class:`HealthRules` (module docstring).

    Args:
        source: what reads the devices (its ``read`` and ``xids`` run in a worker thread).
        physical: each device position's physical GPU (:func:`physical_of`; None: not read).
        rules: the rules, sized for ``physical``.
        interval_s: seconds between two rounds.
        changed: called on the event loop when a device's state changed (the agent sends its load).
    """

    def __init__(self, source: HealthSource, physical: Sequence[int | None], rules: HealthRules, interval_s: float,
                 changed: Callable[[], None] = lambda: None) -> None:  # fmt: skip
        if len(rules) != len(physical):
            raise ValueError(f"rules for {len(rules)} devices, {len(physical)} positions")
        self.source = source
        self.physical = list(physical)
        self.rules = rules
        self.interval_s = interval_s
        self.changed = changed
        self.rounds = 0
        self._task: asyncio.Task[None] | None = None
        self._lock = threading.Lock()  # one round at a time (the loop's and one called by a test)

    def start(self) -> None:
        """Run rounds in the background until :meth:`stop`."""
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        """Stop the rounds and close the source."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await asyncio.to_thread(self.source.close)

    async def round(self) -> bool:
        """Read every device once (in a thread) and apply the rules; whether a state changed (then
        ``changed`` was called)."""
        readings = await asyncio.to_thread(self._read_all)
        rules = self.rules
        moved: set[int] = set()
        for index, outcome in readings:
            if isinstance(outcome, Reading):
                changed = rules.read(index, outcome)
            elif isinstance(outcome, str):
                changed = rules.probe_failed(index, outcome)
            else:
                changed = rules.xid(index, outcome)
            if changed:
                moved.add(index)
        for index in sorted(moved):
            state, reason = rules.state(index)
            if state != "ok":
                log.warning(f"gpu {state}", device=index, reason=reason)
        self.rounds += 1
        if moved:
            self.changed()
        return bool(moved)

    def release(self, index: int) -> bool:
        """An operator's release (``release_device``); whether the device was quarantined."""
        was = self.rules.release(index)
        log.warning("gpu released by an operator", device=index, was_quarantined=was)
        self.changed()
        return was

    def _read_all(self) -> list[tuple[int, Reading | str | int]]:
        """(position, a reading, why a probe failed, or an XID), in order: readings, then XIDs."""
        out: list[tuple[int, Reading | str | int]] = []
        with self._lock:
            cache: dict[int, Reading | str] = {}
            for index, physical in enumerate(self.physical):
                if physical is None:
                    continue
                if physical not in cache:
                    try:
                        cache[physical] = self.source.read(physical)
                    except ProbeFailed as exc:
                        cache[physical] = str(exc)
                out.append((index, cache[physical]))
            try:
                xids = self.source.xids()
            except ProbeFailed as exc:
                log.debug("gpu xid poll failed", reason=str(exc))
                xids = []
        for physical, xid in xids:
            out.extend((index, xid) for index, p in enumerate(self.physical) if p == physical)
        return out

    async def _run(self) -> None:
        while True:
            try:
                await self.round()
            except Exception as exc:  # a bug or a driver surprise must not stop the sampling for good
                log.error("gpu health round failed", error=f"{type(exc).__name__}: {exc}")
            await asyncio.sleep(self.interval_s)


class FakeNvml:
    """A :class:`HealthSource` whose devices a test sets: readings, failing probes, XIDs.

    Args:
        count: physical GPUs, all reading ``Reading()`` (idle, cool, no ECC errors) until set.
    """

    def __init__(self, count: int) -> None:
        self.readings = [Reading(ecc_corrected=0, ecc_uncorrected=0) for _ in range(count)]
        self.failing: dict[int, str] = {}  # physical index -> why its probe fails
        self._xids: list[tuple[int, int]] = []
        self._lock = threading.Lock()
        self.closed = False

    def set(self, physical: int, **fields: Any) -> None:
        """Change fields of a device's reading (``temperature_c=95``, ``ecc_uncorrected=2``...)."""
        with self._lock:
            self.readings[physical] = dataclasses.replace(self.readings[physical], **fields)

    def fail(self, physical: int, why: str = "GPU is lost") -> None:
        """Make the device's probes fail (:meth:`heal` ends it)."""
        with self._lock:
            self.failing[physical] = why

    def heal(self, physical: int) -> None:
        """The device reads again."""
        with self._lock:
            self.failing.pop(physical, None)

    def inject_xid(self, physical: int, xid: int) -> None:
        """A critical XID event of the device, seen at the next poll."""
        with self._lock:
            self._xids.append((physical, xid))

    def read(self, physical: int) -> Reading:
        with self._lock:
            if physical in self.failing:
                raise ProbeFailed(self.failing[physical])
            return self.readings[physical]

    def xids(self) -> list[tuple[int, int]]:
        with self._lock:
            out, self._xids = self._xids, []
        return out

    def close(self) -> None:
        self.closed = True


class NvmlHealthSource:
    """NVML's readings and critical XID events (``nvidia-ml-py``). Build it with :meth:`open`."""

    def __init__(self, nvml: Any) -> None:
        self._nvml = nvml
        self._handles = [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(nvml.nvmlDeviceGetCount())]
        self.uuids = [_text(nvml.nvmlDeviceGetUUID(h)) for h in self._handles]
        self._events: Any = None
        try:
            self._events = nvml.nvmlEventSetCreate()
            for handle in self._handles:
                with contextlib.suppress(Exception):  # a device without XID events still gets read
                    nvml.nvmlDeviceRegisterEvents(handle, nvml.nvmlEventTypeXidCriticalError, self._events)
        except Exception as exc:
            log.debug("nvml event set unavailable: no XID events", reason=f"{type(exc).__name__}: {exc}")

    @classmethod
    def open(cls) -> NvmlHealthSource | None:
        """The source, or None where NVML or a device is missing."""
        try:
            import pynvml  # type: ignore[import-untyped]  # nvidia-ml-py ships no type information

            pynvml.nvmlInit()
        except Exception as exc:
            log.debug("nvml unavailable: no gpu health", reason=f"{type(exc).__name__}: {exc}")
            return None
        try:
            source = cls(pynvml)
        except Exception as exc:
            log.debug("nvml device enumeration failed: no gpu health", reason=f"{type(exc).__name__}: {exc}")
            with contextlib.suppress(Exception):
                pynvml.nvmlShutdown()
            return None
        if not source._handles:
            source.close()
            return None
        return source

    def read(self, physical: int) -> Reading:
        nvml = self._nvml
        try:
            handle = self._handles[physical]
            util = nvml.nvmlDeviceGetUtilizationRates(handle)
            memory = nvml.nvmlDeviceGetMemoryInfo(handle)
            temperature = nvml.nvmlDeviceGetTemperature(handle, nvml.NVML_TEMPERATURE_GPU)
        except Exception as exc:  # GPU is lost, unknown error, timeout: the probe failed
            raise ProbeFailed(f"{type(exc).__name__}: {exc}") from None
        power_w = _optional(lambda: nvml.nvmlDeviceGetPowerUsage(handle) / 1000.0, 0.0)
        mask = _optional(lambda: nvml.nvmlDeviceGetCurrentClocksEventReasons(handle), 0)
        corrected = _optional(lambda: int(nvml.nvmlDeviceGetTotalEccErrors(
            handle, nvml.NVML_MEMORY_ERROR_TYPE_CORRECTED, nvml.NVML_VOLATILE_ECC)), None)  # fmt: skip
        uncorrected = _optional(lambda: int(nvml.nvmlDeviceGetTotalEccErrors(
            handle, nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nvml.NVML_VOLATILE_ECC)), None)  # fmt: skip
        return Reading(
            utilization_pct=float(util.gpu),
            memory_used_bytes=int(memory.used),
            temperature_c=float(temperature),
            power_w=power_w,
            throttle=throttle_names(int(mask)),
            ecc_corrected=corrected,
            ecc_uncorrected=uncorrected,
        )

    def xids(self) -> list[tuple[int, int]]:
        if self._events is None:
            return []
        nvml = self._nvml
        out: list[tuple[int, int]] = []
        for _ in range(64):  # what piled up since the last round, bounded
            try:
                data = nvml.nvmlEventSetWait_v2(self._events, 0)
            except Exception:  # NVMLError_Timeout: nothing more
                break
            with contextlib.suppress(Exception):
                out.append((int(nvml.nvmlDeviceGetIndex(data.device)), int(data.eventData)))
        return out

    def close(self) -> None:
        nvml, self._nvml = self._nvml, None
        if nvml is None:
            return
        with contextlib.suppress(Exception):
            if self._events is not None:
                nvml.nvmlEventSetFree(self._events)
        with contextlib.suppress(Exception):
            nvml.nvmlShutdown()


def _optional(read: Callable[[], Any], default: Any) -> Any:
    """A reading a device may not support (power, clocks reasons, ECC): ``default`` when it cannot say."""
    try:
        return read()
    except Exception:
        return default


def _text(value: Any) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)
