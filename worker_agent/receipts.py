"""Each finished plan's energy and carbon receipt, as the worker measures or estimates it.

Theory of operation (docs/OPERATIONS.md §Energy and carbon, docs/PROTOCOL.md §Receipt):

* **Measured** (``estimated: false``), on a host with NVML:

  - ``nvml_counter``: the plan held whole GPUs: the delta of their NVML energy counters
    (``nvmlDeviceGetTotalEnergyConsumption``, mJ since driver load) between its start and end.
    The counters are read in the power sampler's thread (worker_agent/energy.py), so the figure
    is as fresh as the last sample (``--power-sample-interval``); nothing here calls NVML.
  - ``nvml_power``: the plan held no GPU of its own (or a MIG instance, whose energy NVML does not
    count apart): its share of the worker's sampled power (:class:`~worker_agent.energy.EnergyMeter`).

* **Estimated** (``estimated: true``), on a host without NVML:

  - ``power_model``: the worker's ``--power-watts`` * run time, split equally among the plans
    running in each interval (the same running-sum trick as the energy meter: O(1) per plan);
  - ``uj_per_token``: without a power model, the configured ``--uj-per-token`` * tokens reported;
  - ``none``: neither: 0 J. Such a receipt says nothing, so the worker does not send it
    (:meth:`~worker_agent.telemetry.Telemetry.plan_finished`) unless it carries reported tokens or
    devices: the plan has no receipt. Without NVML and a power model (:attr:`ReceiptMeter.timed`) no
    plan's start is noted either, so a plain CPU worker pays nothing per plan here.

* Emissions: joules / 3.6e6 (J per kWh) * the zone intensity when the plan ended (0: unknown zone).

Everything here is pure bookkeeping over a clock and readings handed in: tests drive it with a
fake clock and a fake counter.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import protocol

__all__ = ["J_PER_KWH", "ReceiptMeter", "co2e_g"]

J_PER_KWH = 3.6e6


def co2e_g(joules: float, intensity_g_per_kwh: float) -> float:
    """Grams of CO2e of ``joules`` drawn from a grid at ``intensity_g_per_kwh`` (0 when unknown)."""
    if not (intensity_g_per_kwh > 0 and math.isfinite(intensity_g_per_kwh)):
        return 0.0
    return joules / J_PER_KWH * intensity_g_per_kwh


@dataclass(slots=True)
class _Start:
    at_s: float
    share_s: float  # the meter's running share-seconds when it started
    counter_mj: float | None  # summed energy counters of its devices then (None: not countable)


class ReceiptMeter:
    """Receipts for the plans of one worker.

    Args:
        clock: monotonic seconds.
        power_w: the worker's power model (``--power-watts``); 0: none.
        uj_per_token: configured energy per token, used without NVML and without a power model.
        counters_mj: the latest energy counter (mJ) of each physical GPU index (None: that GPU
            has none); None: no NVML, so nothing here is measured.
        intensity: the worker's zone intensity now, gCO2e/kWh (0: unknown).
    """

    def __init__(
        self,
        *,
        clock: Callable[[], float],
        power_w: float = 0.0,
        uj_per_token: float = 0.0,
        counters_mj: Callable[[], Sequence[float | None]] | None = None,
        intensity: Callable[[], float] = lambda: 0.0,
    ) -> None:
        if not (power_w >= 0 and math.isfinite(power_w)):
            raise ValueError(f"power model must be a finite number of watts >= 0, got {power_w}")
        self._clock = clock
        self.power_w = power_w
        self.uj_per_token = uj_per_token
        self._counters = counters_mj
        self._intensity = intensity
        self._running: dict[str, _Start] = {}
        self._share_s = 0.0  # sum over intervals of (interval ÷ plans running in it)
        self._last_s: float | None = None

    @property
    def measured(self) -> bool:
        """Whether NVML readings exist (receipts are measured, not estimated)."""
        return self._counters is not None

    @property
    def running(self) -> int:
        """Plans whose start is noted and whose receipt is not yet made."""
        return len(self._running)

    @property
    def timed(self) -> bool:
        """Whether a receipt needs its plan's start (NVML readings or a power model): without, only
        reported tokens can price a plan, and :meth:`started` need not be called."""
        return self._counters is not None or self.power_w > 0

    def _advance(self, now: float) -> None:
        if self._last_s is not None and now > self._last_s and self._running:
            self._share_s += (now - self._last_s) / len(self._running)
        self._last_s = now

    def _counter_mj(self, physical: Sequence[int]) -> float | None:
        if self._counters is None or not physical:
            return None
        readings = self._counters()
        total = 0.0
        for index in physical:
            value = readings[index] if 0 <= index < len(readings) else None
            if value is None:
                return None
            total += value
        return total

    def started(self, plan_id: str, physical: Sequence[int] = ()) -> None:
        """A plan began; ``physical``: the NVML indices of the whole GPUs it holds (none: it shares the host)."""
        now = self._clock()
        self._advance(now)
        self._running[plan_id] = _Start(now, self._share_s, self._counter_mj(physical))

    def finished(
        self,
        plan_id: str,
        *,
        tokens: int = 0,
        physical: Sequence[int] = (),
        devices: Sequence[str] = (),
        power_joules: float | None = None,
        run_s: float = 0.0,
    ) -> protocol.Receipt:
        """The receipt of a plan that ended.

        ``power_joules``: its share of the sampled NVML power (the energy meter's figure), when
        the host has NVML; used when no energy counter covers the plan's devices. ``run_s``: its
        run time as the caller measured it, for a plan whose start was not noted here (not
        :attr:`timed`).
        """
        now = self._clock()
        self._advance(now)
        start = self._running.pop(plan_id, None)
        if start is None:  # not noted here (not timed, or refused before it ran): nothing used over time
            start = _Start(now - max(0.0, run_s), self._share_s, None)
        run_s = max(0.0, now - start.at_s)
        joules, source, estimated = 0.0, "none", True
        end_mj = self._counter_mj(physical) if start.counter_mj is not None else None
        if start.counter_mj is not None and end_mj is not None and end_mj >= start.counter_mj:
            joules, source, estimated = (end_mj - start.counter_mj) / 1000.0, "nvml_counter", False
        elif self.measured and power_joules is not None:
            joules, source, estimated = power_joules, "nvml_power", False
        elif self.power_w > 0:
            joules, source = self.power_w * (self._share_s - start.share_s), "power_model"
        elif self.uj_per_token > 0 and tokens > 0:
            joules, source = self.uj_per_token * tokens / 1e6, "uj_per_token"
        intensity = self._intensity()
        intensity = intensity if intensity > 0 and math.isfinite(intensity) else 0.0
        return protocol.Receipt(
            joules=joules,
            co2e_g=co2e_g(joules, intensity) if intensity else 0.0,
            estimated=estimated,
            source=source,
            intensity_g_per_kwh=intensity,
            tokens=max(0, tokens),
            run_s=run_s,
            devices=list(devices) if devices else [],
        )

    def forget(self, plan_id: str) -> None:
        """A plan stopped without a receipt (its lease went elsewhere)."""
        now = self._clock()
        self._advance(now)
        self._running.pop(plan_id, None)
