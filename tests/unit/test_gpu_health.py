"""GPU health rules and the monitor, driven by a fake NVML that injects each fault (worker_agent/gpu_health.py)."""

from __future__ import annotations

import protocol
from worker_agent.gpu_health import (
    FakeNvml,
    HealthMonitor,
    HealthRules,
    Reading,
    physical_of,
    throttle_names,
)


def _ok(**fields: object) -> Reading:
    return Reading(**{"ecc_corrected": 0, "ecc_uncorrected": 0, "temperature_c": 50.0, **fields})  # type: ignore[arg-type]


def test_a_fatal_xid_quarantines_the_device_and_names_it() -> None:
    """XID 79 (fallen off the bus) quarantines the device; its reason names the XID."""
    rules = HealthRules(2)
    rules.read(0, _ok())
    assert rules.xid(0, 79) is True
    assert rules.state(0) == ("quarantined", "fatal XID 79 (GPU has fallen off the bus)")
    assert rules.quarantined == (0,)
    assert rules.state(1)[0] == "ok"


def test_an_application_xid_is_counted_not_quarantined() -> None:
    """XID 13 (a graphics engine exception: the application's fault) is reported but quarantines nothing."""
    rules = HealthRules(1)
    rules.read(0, _ok())
    rules.xid(0, 13)
    assert rules.state(0) == ("ok", "")
    health = rules.report()[0]
    assert (health.xid, health.xid_count) == (13, 1)


def test_rising_uncorrectable_ecc_quarantines() -> None:
    """Uncorrectable ECC errors present at the first reading are the baseline; a rise quarantines."""
    rules = HealthRules(1)
    rules.read(0, _ok(ecc_uncorrected=3))
    assert rules.state(0)[0] == "ok"
    rules.read(0, _ok(ecc_uncorrected=3, ecc_corrected=40))  # corrected ones do not count
    assert rules.state(0)[0] == "ok"
    assert rules.read(0, _ok(ecc_uncorrected=5)) is True
    assert rules.state(0) == ("quarantined", "uncorrectable ECC errors rose from 3 to 5")


def test_a_hot_device_is_degraded_until_it_cools() -> None:
    """At or above hot_c a device is degraded (still placed on); a normal reading clears it."""
    rules = HealthRules(1, hot_c=85)
    rules.read(0, _ok(temperature_c=91))
    assert rules.state(0) == ("degraded", "temperature 91 °C >= 85 °C")
    assert rules.quarantined == ()
    rules.read(0, _ok(temperature_c=70))
    assert rules.state(0) == ("ok", "")


def test_hardware_throttling_degrades_but_a_power_cap_does_not() -> None:
    """Clocks held down by hardware (thermal, power brake) degrade a device; the software power cap is normal."""
    rules = HealthRules(1)
    rules.read(0, _ok(throttle=("sw_power_cap",)))
    assert rules.state(0)[0] == "ok"
    rules.read(0, _ok(throttle=throttle_names(0x40 | 0x4)))
    assert rules.state(0) == ("degraded", "clocks held down: hw_thermal_slowdown")


def test_failed_probes_degrade_then_quarantine_and_the_quarantine_holds() -> None:
    """One failed probe degrades; probe_failures in a row quarantine; a later good reading keeps it quarantined."""
    rules = HealthRules(1, probe_failures=2)
    rules.read(0, _ok())
    rules.probe_failed(0, "GPU is lost")
    assert rules.state(0)[0] == "degraded"
    rules.probe_failed(0, "GPU is lost")
    assert rules.state(0) == ("quarantined", "health probe failed 2 times in a row: GPU is lost")
    rules.read(0, _ok())
    assert rules.state(0)[0] == "quarantined"


def test_release_ends_the_quarantine_and_takes_the_counters_as_baseline() -> None:
    """A released device is ok again; the ECC count it had then no longer counts as a rise."""
    rules = HealthRules(1)
    rules.read(0, _ok(ecc_uncorrected=0))
    rules.read(0, _ok(ecc_uncorrected=1))
    assert rules.quarantined == (0,)
    assert rules.release(0) is True
    assert rules.state(0) == ("ok", "")
    rules.read(0, _ok(ecc_uncorrected=1))
    assert rules.state(0)[0] == "ok"
    rules.read(0, _ok(ecc_uncorrected=2))
    assert rules.state(0)[0] == "quarantined"
    assert HealthRules(1).release(0) is False


def test_report_carries_every_reading_field() -> None:
    """The load frame's DeviceHealth holds what was read."""
    rules = HealthRules(1)
    rules.read(0, Reading(utilization_pct=87, memory_used_bytes=5 << 30, temperature_c=66, power_w=301.5,
                          throttle=("sw_power_cap",), ecc_corrected=2, ecc_uncorrected=0))  # fmt: skip
    assert rules.report() == [protocol.DeviceHealth(
        index=0, utilization_pct=87, memory_used_bytes=5 << 30, temperature_c=66, power_w=301.5,
        throttle=["sw_power_cap"], ecc_corrected=2,
    )]  # fmt: skip


def test_mig_instances_are_read_through_their_gpu() -> None:
    """A MIG instance maps to its parent's NVML index; a whole GPU to its own; an unknown declared device to None."""
    gpus = [
        protocol.GpuInfo(name="A100", index=0, uuid="GPU-a"),
        protocol.GpuInfo(name="mig", index=1, uuid="MIG-1", parent_uuid="GPU-b", visible_id="MIG-1"),
        protocol.GpuInfo(name="mig", index=2, uuid="MIG-2", parent_uuid="GPU-b", visible_id="MIG-2"),
        protocol.GpuInfo(name="declared", index=3, uuid="MIG-x", visible_id="MIG-x"),
    ]
    assert physical_of(gpus, ["GPU-a", "GPU-b"]) == [0, 1, 1, None]


async def test_monitor_quarantines_each_instance_of_a_faulty_gpu_and_says_so() -> None:
    """An XID on a GPU quarantines every device read through it; ``changed`` is called once for the round."""
    nvml = FakeNvml(2)
    calls: list[int] = []
    monitor = HealthMonitor(nvml, [0, 1, 1], HealthRules(3), 10.0, changed=lambda: calls.append(1))
    assert await monitor.round() is False  # all ok from the start: nothing moved
    nvml.inject_xid(1, 48)
    assert await monitor.round() is True
    assert calls == [1]
    assert monitor.rules.quarantined == (1, 2)
    nvml.fail(0)
    await monitor.round()
    await monitor.round()
    assert monitor.rules.quarantined == (0, 1, 2)
    assert monitor.release(0) is True
    assert monitor.rules.quarantined == (1, 2)
    await monitor.stop()
    assert nvml.closed
