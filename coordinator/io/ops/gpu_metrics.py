"""``/metrics`` families of the workers' GPU health, per worker and device (docs/OPERATIONS.md §GPU health).

Read from each worker's last load (``load.devices``: worker_agent/gpu_health.py) at scrape time,
never on the hot path. Devices are named by their position in the worker's ``capabilities.gpus``
(``device="0"``), as ``fleetwire device release WORKER DEVICE`` names them.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Final

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from coordinator.workers import WorkerRecord

__all__ = ["GPU_METRIC_NAMES", "gpu_families"]

_STATES: Final = ("ok", "degraded", "quarantined")

#: The families :func:`gpu_families` yields (counters get ``_total`` in the exposition).
GPU_METRIC_NAMES: Final = (
    "fleetwire_gpu_health",
    "fleetwire_gpu_utilization_ratio",
    "fleetwire_gpu_memory_used_bytes",
    "fleetwire_gpu_temperature_celsius",
    "fleetwire_gpu_power_watts",
    "fleetwire_gpu_throttled",
    "fleetwire_gpu_ecc_errors",
    "fleetwire_gpu_xid_events",
)


def gpu_families(workers: Iterable[WorkerRecord]) -> Iterator[Metric]:
    """The GPU health families over every worker that reports its devices."""
    labels = ["worker", "device"]
    health = GaugeMetricFamily("fleetwire_gpu_health", "1 for the device's health state now (ok, degraded: hot or "
                               "held down by hardware, quarantined: no new plan until released).",
                               labels=[*labels, "state"])  # fmt: skip
    util = GaugeMetricFamily("fleetwire_gpu_utilization_ratio", "GPU busy, 0..1 (NVML).", labels=labels)
    memory = GaugeMetricFamily("fleetwire_gpu_memory_used_bytes", "Device memory in use (NVML).", labels=labels)
    temperature = GaugeMetricFamily("fleetwire_gpu_temperature_celsius", "GPU temperature (NVML).", labels=labels)
    power = GaugeMetricFamily("fleetwire_gpu_power_watts", "Device power draw (NVML).", labels=labels)
    throttled = GaugeMetricFamily("fleetwire_gpu_throttled", "1 for each clocks event reason active now "
                                  "(hw_thermal_slowdown, sw_power_cap, ...).", labels=[*labels, "reason"])  # fmt: skip
    ecc = CounterMetricFamily("fleetwire_gpu_ecc_errors", "Volatile ECC errors since the driver loaded, by type.",
                              labels=[*labels, "type"])  # fmt: skip
    xids = CounterMetricFamily("fleetwire_gpu_xid_events", "Critical XID events seen since the worker started "
                               "(the last one: the dashboard, `fleetwire workers --json`).", labels=labels)  # fmt: skip
    for record in workers:
        load = record.load
        if load is None or not load.devices:
            continue
        for d in load.devices:
            key = [record.id, str(d.index)]
            for state in _STATES:
                health.add_metric([*key, state], 1.0 if d.state == state else 0.0)
            util.add_metric(key, d.utilization_pct / 100.0)
            memory.add_metric(key, d.memory_used_bytes)
            temperature.add_metric(key, d.temperature_c)
            power.add_metric(key, d.power_w)
            for reason in d.throttle:
                throttled.add_metric([*key, reason], 1.0)
            ecc.add_metric([*key, "corrected"], d.ecc_corrected)
            ecc.add_metric([*key, "uncorrected"], d.ecc_uncorrected)
            xids.add_metric(key, d.xid_count)
    yield from (health, util, memory, temperature, power, throttled, ecc, xids)
