"""Energy per token, power and carbon intensity on the worker: the absent-device branch, the meter's
arithmetic on a fake clock, the carbon table, file and command, and what the heartbeat carries."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import sys
import threading
from pathlib import Path

import pytest
from structlog.testing import capture_logs

import protocol
from tests.lost_cancel import stop_as_communicate_returns, stopped
from tests.waiting import alive, until
from worker_agent.carbon import BUILTIN_G_PER_KWH, CarbonIntensity, lookup, parse_table
from worker_agent.energy import EnergyMeter, Nvml, PowerSampler, probe_gpus
from worker_agent.telemetry import Telemetry, add_telemetry_arguments, telemetry_from_args


class Clock:
    """A fake monotonic clock."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


# ---------------------------------------------------------------------------- absent device


def test_without_nvml_there_is_no_device_and_no_noise(monkeypatch: pytest.MonkeyPatch) -> None:
    """No pynvml importable: Nvml.open() is None, no GPUs, and nothing is logged above debug."""
    monkeypatch.setitem(sys.modules, "pynvml", None)
    with capture_logs() as logs:
        assert Nvml.open() is None
        assert probe_gpus() == []
    assert all(entry["log_level"] == "debug" for entry in logs)


def test_this_hosts_real_nvml_takes_the_absent_branch_or_reports_devices() -> None:
    """The real NVML of the test machine: absent (CI) gives None; present gives GPUs with memory and power."""
    nvml = Nvml.open()
    if nvml is None:
        assert probe_gpus() == []
        return
    try:  # pragma: no cover - only on a GPU machine (bench/gpu_check.py checks this branch in depth)
        gpus = nvml.gpus()
        assert gpus and all(g.memory_bytes > 0 and g.uuid for g in gpus)
        assert nvml.power_w() >= 0
    finally:
        nvml.close()


def test_without_a_measurement_the_configured_energy_per_token_is_reported() -> None:
    """No NVML: plans finishing with tokens change nothing; the configured µJ/token is what load carries."""
    clock = Clock()
    meter = EnergyMeter(configured_uj_per_token=1500.0, measured=False, clock=clock)
    meter.plan_started("p")
    clock.now = 10.0
    assert meter.plan_finished("p", tokens=100) is None
    telemetry = Telemetry(meter=meter)
    load = telemetry.load(protocol.Load(in_flight=1))
    assert load.uj_per_token == 1500.0 and load.power_w == 0.0 and load.in_flight == 1


def test_telemetry_from_flags_on_a_cpu_host_has_no_sampler(tmp_path: Path) -> None:
    """`fleetwire worker` flags on a host without NVML: no power sampler, configured energy, carbon from the table."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--carbon-zone", default="")
    add_telemetry_arguments(parser)
    ns = parser.parse_args(["--carbon-zone", "FR", "--uj-per-token", "800"])
    telemetry = telemetry_from_args(ns)
    if Nvml.open() is None:
        assert telemetry.sampler is None
    load = telemetry.load(protocol.Load())
    assert load.uj_per_token == 800.0 and load.zone_intensity_g_per_kwh == 56
    assert telemetry.capabilities(protocol.Capabilities()).carbon_zone == "FR"


# ---------------------------------------------------------------------------- the meter


def test_energy_is_integrated_and_split_among_running_plans() -> None:
    """Trapezoids between power samples; an interval's energy is shared equally by the plans running in it."""
    clock = Clock()
    meter = EnergyMeter(measured=True, alpha=1.0, clock=clock)
    meter.sample(100.0)  # t=0: 100 W
    meter.plan_started("a")
    clock.now = 2.0
    meter.sample(100.0)  # a alone: 200 J
    meter.plan_started("b")
    clock.now = 4.0
    meter.sample(300.0)  # mean 200 W for 2 s = 400 J, 200 J each
    a = meter.plan_finished("a", tokens=400)
    assert a is not None and a.joules == pytest.approx(400.0) and a.tokens == 400
    assert a.uj_per_token == pytest.approx(1e6)  # 400 J / 400 tokens = 1 J = 1e6 µJ
    assert meter.uj_per_token == pytest.approx(1e6)
    clock.now = 5.0  # b alone, at the last sample's 300 W: 300 J more
    b = meter.plan_finished("b", tokens=0)
    assert b is not None and b.joules == pytest.approx(500.0) and b.uj_per_token == 0.0
    assert meter.uj_per_token == pytest.approx(1e6)  # a plan without tokens leaves the average alone
    assert meter.total_joules == pytest.approx(900.0)
    assert meter.power_w == 300.0


def test_running_share_sum_matches_per_plan_accounting() -> None:
    """Staggered overlapping plans get exactly their equal shares of each interval (running-sum arithmetic)."""
    clock = Clock()
    meter = EnergyMeter(measured=True, alpha=1.0, clock=clock)
    meter.sample(60.0)  # constant 60 W from t=0: each 1 s interval holds 60 J
    # (time, event, plan): a runs 0-2, b 1-4, c 2-3, d 3-4; each expected figure below is the sum,
    # over the intervals a plan ran in, of 60 J divided by the plans running in that interval.
    steps = [(0.0, "start", "a"), (1.0, "start", "b"), (2.0, "start", "c"), (2.0, "finish", "a"),
             (3.0, "finish", "c"), (3.0, "start", "d"), (4.0, "finish", "b"), (4.0, "finish", "d")]
    used: dict[str, float] = {}
    for at, event, plan in steps:
        clock.now = at
        if event == "start":
            meter.plan_started(plan)
        else:
            energy = meter.plan_finished(plan, tokens=1)
            assert energy is not None
            used[plan] = energy.joules
    # [0,1] a alone: 60; [1,2] a,b: 30 each; [2,3] b,c: 30 each; [3,4] b,d: 30 each.
    assert used == pytest.approx({"a": 90.0, "b": 90.0, "c": 30.0, "d": 30.0})
    assert meter.total_joules == pytest.approx(240.0)
    assert meter.plan_finished("never-started", tokens=1) is None  # unknown plan: nothing measured


def test_energy_per_token_is_a_moving_average() -> None:
    """Each plan with tokens moves the average by alpha toward its own µJ/token."""
    clock = Clock()
    meter = EnergyMeter(measured=True, alpha=0.5, clock=clock)
    for joules_per_token, plan in ((1.0, "a"), (3.0, "b")):
        meter.sample(100.0)
        meter.plan_started(plan)
        clock.now += 1.0
        meter.sample(100.0)  # 100 J
        meter.plan_finished(plan, tokens=round(100 / joules_per_token))
    first, second = 1e6, 100 / 33 * 1e6  # 100 J over 100 tokens, then over 33
    assert meter.uj_per_token == pytest.approx(first + 0.5 * (second - first))


def test_power_sampler_thread_feeds_the_meter_and_stops() -> None:
    """The sampler reads power in its own thread and stops when asked; a failing read does not end it."""
    meter = EnergyMeter(measured=True)
    readings = iter([RuntimeError("driver hiccup"), 42.0])
    second_read_sampled = threading.Event()

    def read() -> float:
        value = next(readings, None)
        if value is None:  # the third read: the second one has been fed to the meter
            second_read_sampled.set()
            return 42.0
        if isinstance(value, Exception):
            raise value
        return value

    sampler = PowerSampler(read, meter, interval_s=0.001)
    sampler.start()
    assert second_read_sampled.wait(5)
    sampler.stop()
    assert meter.power_w == 42.0


@pytest.mark.parametrize("value", [-1.0])
def test_negative_configured_energy_is_refused(value: float) -> None:
    """A negative configured µJ/token is a usage error that says so."""
    with pytest.raises(ValueError, match=">= 0"):
        EnergyMeter(configured_uj_per_token=value)


# ---------------------------------------------------------------------------- carbon


def test_builtin_table_and_zone_fallback() -> None:
    """Zones are matched exactly, then by country prefix, case-insensitively; unknown is None."""
    assert lookup("FR", BUILTIN_G_PER_KWH) == 56
    assert lookup("us-cal-ciso", BUILTIN_G_PER_KWH) == BUILTIN_G_PER_KWH["US"]
    assert lookup("XX", BUILTIN_G_PER_KWH) is None
    assert lookup("", BUILTIN_G_PER_KWH) is None
    assert CarbonIntensity("XX").g_per_kwh == 0.0


def test_carbon_file_overrides_the_table(tmp_path: Path) -> None:
    """A file (lines or JSON) adds zones and overrides built-in values."""
    lines = tmp_path / "zones.txt"
    lines.write_text("# our own figures\nFR 40\nUS-CAL-CISO 210  # CAISO 2023\n")
    assert CarbonIntensity("FR", file=lines).g_per_kwh == 40
    assert CarbonIntensity("US-CAL-CISO", file=lines).g_per_kwh == 210
    as_json = tmp_path / "zones.json"
    as_json.write_text('{"de": 350}')
    assert CarbonIntensity("DE", file=as_json).g_per_kwh == 350


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("FR forty\n", "zones:1: 'forty' is not a number"),
        ("FR\n", "zones:1: expected 'ZONE grams'"),
        ("FR -3\n", "zones:1: intensity must be a finite number >= 0"),
        ('{"FR": "x"}', "zones: zone 'FR': expected a number"),
        ("{nope", "zones: not valid JSON"),
    ],
)
def test_bad_carbon_tables_say_where(text: str, fragment: str) -> None:
    """A bad table names the source, the line or zone, and what is wrong."""
    with pytest.raises(ValueError) as info:
        parse_table(text, "zones")
    assert fragment in str(info.value)


def test_missing_carbon_file_is_a_clear_error(tmp_path: Path) -> None:
    """An unreadable file is refused at start with its path."""
    with pytest.raises(ValueError, match=r"cannot read carbon file .*missing"):
        CarbonIntensity("FR", file=tmp_path / "missing")


async def test_carbon_command_output_overrides_and_failures_keep_the_last_value() -> None:
    """The command's number (or JSON table) replaces the value; a failure, bad output or timeout keeps it."""
    carbon = CarbonIntensity("FR", command='echo "$FLEETWIRE_CARBON_ZONE" >/dev/null; echo 73.5', timeout_s=5)
    await carbon.refresh()
    assert carbon.g_per_kwh == 73.5
    carbon.command = "exit 3"
    with capture_logs() as logs:
        await carbon.refresh()
    assert carbon.g_per_kwh == 73.5 and logs[0]["event"].startswith("carbon command failed")
    carbon.command = "echo '{\"FR\": 12}'"
    await carbon.refresh()
    assert carbon.g_per_kwh == 12
    carbon.command = "echo '{\"DE\": 1}'"
    with capture_logs() as logs:
        await carbon.refresh()
    assert carbon.g_per_kwh == 12 and "no value for zone 'FR'" in logs[0]["error"]
    carbon.command, carbon.timeout_s = "sleep 5", 0.1
    with capture_logs() as logs:
        await carbon.refresh()
    assert carbon.g_per_kwh == 12 and "timed out" in logs[0]["event"]


@pytest.mark.timeout(20)
async def test_the_carbon_command_running_when_telemetry_stops_is_killed_with_what_it_started(tmp_path: Path) -> None:
    """Telemetry.stop() (the worker stops) while the carbon command runs kills its session: the shell's child (here
    a sleep 30) ran on to its end before."""
    pid_file = tmp_path / "pid"
    command = f"sh -c 'echo $$ > {pid_file}; exec sleep 30'"
    telemetry = Telemetry(meter=EnergyMeter(), carbon=CarbonIntensity("FR", command=command, timeout_s=60))
    await telemetry.start()
    await until(lambda: pid_file.exists() and pid_file.stat().st_size > 0, timeout_s=10)
    pid = int(await asyncio.to_thread(pid_file.read_text))
    try:
        await telemetry.stop()
        await until(lambda: not alive(pid), timeout_s=5)
    finally:
        with contextlib.suppress(ProcessLookupError):  # without the fix the sleep runs on: not past the test
            os.kill(pid, signal.SIGKILL)


@pytest.mark.timeout(15)
async def test_telemetry_stopped_as_the_carbon_command_ends_stops(monkeypatch: pytest.MonkeyPatch) -> None:
    """Telemetry.stop() started in the loop iteration in which the carbon command's output is read returns and ends
    the refresh loop (on Python 3.11 asyncio.wait_for lost that cancel: the worker's stop waited for ever)."""
    carbon = CarbonIntensity("FR", command="echo 73.5", timeout_s=5, interval_s=3600)
    telemetry = Telemetry(meter=EnergyMeter(), carbon=carbon)
    stopping = stop_as_communicate_returns(monkeypatch, telemetry.stop)  # before the refresh goes on
    await telemetry.start()
    (refresh,) = telemetry._tasks
    assert await stopped(stopping, refresh), "Telemetry.stop() still waited for the carbon command's loop"
