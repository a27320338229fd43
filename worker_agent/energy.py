"""GPUs and energy through NVML (``nvidia-ml-py``), with a quiet branch for hosts without them.

Theory of operation (docs/OPERATIONS.md §Energy and carbon):

* :class:`Nvml` opens the NVML library once. On a host without the library, the driver or a
  device, :meth:`Nvml.open` returns None and every caller takes the *absent-device branch*:
  no GPUs, no power, energy per token from the configured value. Nothing raises, and the only
  log line is at debug level.
* :meth:`Nvml.gpus` lists physical GPUs (name, memory, UUID, index); a GPU in MIG mode is
  listed as its MIG instances instead (what plans can actually use), each with the memory of the
  instance and a ``parent_uuid`` naming the GPU it is carved from.
* :class:`EnergyMeter` integrates power over time (trapezoids between samples) and splits each
  interval's energy equally among the plans running in it. When a plan ends and its handler
  reported tokens (``ctx.report_tokens``), its energy ÷ tokens updates an exponential moving
  average of micro-joules per token; that average is what the worker reports in ``load``.
  Without NVML, or before any plan reported tokens, the configured value is reported.
* :class:`PowerSampler` reads NVML power in its own thread, so a slow or wedged driver call
  never blocks the event loop that carries heartbeats (docs/OPERATIONS.md §Test matrix row 6).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import structlog

import protocol

log = structlog.get_logger(__name__)

__all__ = ["EnergyMeter", "Nvml", "PlanEnergy", "PowerSampler", "probe_gpus"]


def _text(value: Any) -> str:
    """NVML strings are ``bytes`` in older bindings and ``str`` in newer ones."""
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


def _why(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


class Nvml:
    """An initialised NVML library; build it with :meth:`open`, end it with :meth:`close`."""

    def __init__(self, module: Any) -> None:
        self._nvml = module
        self._handles = [module.nvmlDeviceGetHandleByIndex(i) for i in range(module.nvmlDeviceGetCount())]
        self._closed = False

    @classmethod
    def open(cls) -> Nvml | None:
        """NVML with at least one device, or None (no library, no driver, no device: the absent branch)."""
        try:
            import pynvml  # type: ignore[import-untyped]  # nvidia-ml-py ships no type information
        except Exception as exc:  # ImportError, or a broken install: either way, no GPUs
            log.debug("nvml unavailable", reason=_why(exc))
            return None
        try:
            pynvml.nvmlInit()
        except Exception as exc:  # NVMLError_LibraryNotFound / DriverNotLoaded on CPU hosts
            log.debug("nvml unavailable", reason=_why(exc))
            return None
        try:
            nvml = cls(pynvml)
        except Exception as exc:
            log.debug("nvml device enumeration failed", reason=_why(exc))
            _shutdown(pynvml)
            return None
        if not nvml._handles:
            nvml.close()
            return None
        return nvml

    def close(self) -> None:
        """Shut NVML down; idempotent."""
        if not self._closed:
            self._closed = True
            _shutdown(self._nvml)

    def gpus(self) -> list[protocol.GpuInfo]:
        """Physical GPUs, or their MIG instances when MIG mode is on; a device that fails
        mid-probe is skipped (and logged at debug level), the others are reported."""
        nvml = self._nvml
        out: list[protocol.GpuInfo] = []
        for index, handle in enumerate(self._handles):
            try:
                gpu = protocol.GpuInfo(
                    name=_text(nvml.nvmlDeviceGetName(handle)),
                    memory_bytes=int(nvml.nvmlDeviceGetMemoryInfo(handle).total),
                    uuid=_text(nvml.nvmlDeviceGetUUID(handle)),
                    index=index,
                )
            except Exception as exc:
                log.debug("nvml device query failed", index=index, reason=_why(exc))
                continue
            # A GPU in MIG mode is usable only through its instances: they stand in for it.
            out.extend(self._mig_instances(handle, index, gpu.uuid) or [gpu])
        return out

    def _mig_instances(self, handle: Any, index: int, parent_uuid: str) -> list[protocol.GpuInfo]:
        nvml = self._nvml
        try:
            current, _pending = nvml.nvmlDeviceGetMigMode(handle)
        except Exception:  # NotSupported on GPUs without MIG: the common case
            return []
        if current != nvml.NVML_DEVICE_MIG_ENABLE:
            return []
        out: list[protocol.GpuInfo] = []
        for slot in range(nvml.nvmlDeviceGetMaxMigDeviceCount(handle)):
            try:
                mig = nvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, slot)
            except Exception:  # an empty slot raises NotFound
                continue
            try:
                out.append(
                    protocol.GpuInfo(
                        name=_text(nvml.nvmlDeviceGetName(mig)),
                        memory_bytes=int(nvml.nvmlDeviceGetMemoryInfo(mig).total),
                        uuid=_text(nvml.nvmlDeviceGetUUID(mig)),
                        index=index,
                        parent_uuid=parent_uuid,
                        visible_id=_text(nvml.nvmlDeviceGetUUID(mig)),  # CUDA_VISIBLE_DEVICES names MIG by UUID
                    )
                )
            except Exception as exc:
                log.debug("nvml MIG query failed", index=index, slot=slot, reason=_why(exc))
        return out

    def power_w(self) -> float:
        """Power drawn now by all physical GPUs, in watts (a device that cannot say counts 0)."""
        total_mw = 0
        for handle in self._handles:
            try:
                total_mw += self._nvml.nvmlDeviceGetPowerUsage(handle)
            except Exception as exc:
                log.debug("nvml power query failed", reason=_why(exc))
        return total_mw / 1000.0

    def energy_mj(self) -> list[float | None]:
        """Each physical GPU's energy counter (mJ since the driver loaded); None where it has none."""
        out: list[float | None] = []
        for handle in self._handles:
            try:
                out.append(float(self._nvml.nvmlDeviceGetTotalEnergyConsumption(handle)))
            except Exception as exc:  # NotSupported before Volta, or a failing device
                log.debug("nvml energy counter query failed", reason=_why(exc))
                out.append(None)
        return out


def _shutdown(nvml: Any) -> None:
    try:
        nvml.nvmlShutdown()
    except Exception as exc:  # shutdown failing must not hide what was already read
        log.debug("nvml shutdown failed", reason=_why(exc))


def probe_gpus() -> list[protocol.GpuInfo]:
    """The GPUs (and MIG instances) NVML reports, or ``[]`` when NVML is missing or finds none."""
    nvml = Nvml.open()
    if nvml is None:
        return []
    try:
        return nvml.gpus()
    finally:
        nvml.close()


@dataclass(frozen=True, slots=True)
class PlanEnergy:
    """What one finished plan used: joules over its run, tokens it reported, and their ratio."""

    joules: float
    tokens: int

    @property
    def uj_per_token(self) -> float:
        return self.joules * 1e6 / self.tokens if self.tokens else 0.0


class EnergyMeter:
    """Energy per generated token, measured from power samples or configured.

    Thread-safe: :meth:`sample` runs in the sampler thread, the rest on the event loop.

    Args:
        configured_uj_per_token: reported until a measurement exists (and always without NVML).
        measured: whether power samples will come (an NVML device is present).
        alpha: weight of the newest plan in the moving average (0 < alpha <= 1).
        clock: monotonic seconds.
    """

    def __init__(
        self,
        *,
        configured_uj_per_token: float = 0.0,
        measured: bool = False,
        alpha: float = 0.2,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if configured_uj_per_token < 0:
            raise ValueError(f"configured energy per token must be >= 0 µJ, got {configured_uj_per_token}")
        if not 0.0 < alpha <= 1.0:
            raise ValueError(f"alpha must be in (0, 1], got {alpha}")
        self.configured_uj_per_token = configured_uj_per_token
        self.measured = measured
        self.alpha = alpha
        self._clock = clock
        self._lock = threading.Lock()
        self._power_w = 0.0
        self._last_s: float | None = None  # time of the last integration step
        # Each running plan's share of an interval is the same (energy ÷ plans running), so one
        # running sum of those shares serves every plan: a plan notes the sum when it starts and
        # its energy is the sum at its end minus that note. Start and finish are O(1) however
        # many plans run (looping over them all was most of a busy worker's time).
        self._share_joules = 0.0  # sum over intervals of (interval energy ÷ plans running in it)
        self._started_at: dict[str, float] = {}  # running plan -> _share_joules when it started
        self._ema_uj: float | None = None
        self.total_joules = 0.0

    @property
    def power_w(self) -> float:
        """The latest power sample, watts (0 without NVML)."""
        return self._power_w

    @property
    def uj_per_token(self) -> float:
        """Measured moving average when there is one, else the configured value."""
        return self._ema_uj if self._ema_uj is not None else self.configured_uj_per_token

    def sample(self, power_w: float) -> None:
        """A power reading, now: integrate since the last step (trapezoid) and share it out."""
        with self._lock:
            self._advance(self._clock(), (self._power_w + power_w) / 2)
            self._power_w = power_w

    def _advance(self, now: float, mean_power_w: float) -> None:
        if self._last_s is not None and now > self._last_s:
            joules = mean_power_w * (now - self._last_s)
            self.total_joules += joules
            if self._started_at:
                self._share_joules += joules / len(self._started_at)
        self._last_s = now

    def plan_started(self, plan_id: str) -> None:
        """A plan began; from now on it takes its share of the energy."""
        if not self.measured:
            return  # nothing to share out: no cost on the plan path of a CPU worker
        with self._lock:
            self._advance(self._clock(), self._power_w)  # no NVML read here: the loop never waits on it
            self._started_at[plan_id] = self._share_joules

    def plan_finished(self, plan_id: str, tokens: int) -> PlanEnergy | None:
        """A plan ended having generated ``tokens``; returns its energy when it was measured."""
        if not self.measured:
            return None
        with self._lock:
            self._advance(self._clock(), self._power_w)
            mark = self._started_at.pop(plan_id, None)
            if mark is None or not self.measured:
                return None
            joules = self._share_joules - mark
            used = PlanEnergy(joules, max(0, tokens))
            if used.tokens > 0 and used.joules > 0:
                uj = used.uj_per_token
                self._ema_uj = uj if self._ema_uj is None else self._ema_uj + self.alpha * (uj - self._ema_uj)
            return used


class PowerSampler:
    """Feeds an :class:`EnergyMeter` with NVML power readings from a daemon thread.

    Args:
        read_power_w: returns watts now (e.g. :meth:`Nvml.power_w`).
        meter: receives each reading.
        interval_s: seconds between readings.
        read_energy_mj: returns each GPU's energy counter (e.g. :meth:`Nvml.energy_mj`), kept in
            :attr:`energy_mj` for plan receipts; None: not read.
    """

    def __init__(
        self,
        read_power_w: Callable[[], float],
        meter: EnergyMeter,
        interval_s: float = 0.5,
        read_energy_mj: Callable[[], list[float | None]] | None = None,
    ) -> None:
        if not interval_s > 0:
            raise ValueError(f"power sample interval must be > 0 s, got {interval_s}")
        self._read = read_power_w
        self._read_energy = read_energy_mj
        self.energy_mj: list[float | None] = []  # the latest energy counters, read by worker_agent/receipts.py
        self._meter = meter
        self._interval_s = interval_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Start sampling (the first reading is taken at once)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="fleetwire-power", daemon=True)
            self._thread.start()

    def stop(self, timeout_s: float = 2.0) -> None:
        """Stop sampling and wait up to ``timeout_s`` for the thread (a wedged driver call is left behind)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self._meter.sample(self._read())
                if self._read_energy is not None:
                    self.energy_mj = self._read_energy()  # one assignment: readers see a whole list
            except Exception as exc:  # one failed read must not end sampling
                log.debug("power sample failed", reason=_why(exc))
            self._stop.wait(self._interval_s)
