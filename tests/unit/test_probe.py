"""Capability probe and load tracking of the worker agent."""

from __future__ import annotations

import os
import sys
import types
from typing import Any

import psutil
import pytest
from structlog.testing import capture_logs

import protocol
from worker_agent.probe import LoadTracker, probe_capabilities, probe_gpus


def _fake_nvml(devices: list[dict[str, Any]], *, init_error: Exception | None = None) -> types.ModuleType:
    """A stand-in for ``pynvml`` reporting ``devices``."""
    module = types.ModuleType("pynvml")
    calls: list[str] = []

    def init() -> None:
        calls.append("init")
        if init_error is not None:
            raise init_error

    module.nvmlInit = init  # type: ignore[attr-defined]
    module.nvmlShutdown = lambda: calls.append("shutdown")  # type: ignore[attr-defined]
    module.nvmlDeviceGetCount = lambda: len(devices)  # type: ignore[attr-defined]
    module.nvmlDeviceGetHandleByIndex = lambda i: devices[i]  # type: ignore[attr-defined]
    module.nvmlDeviceGetName = lambda h: h["name"]  # type: ignore[attr-defined]
    module.nvmlDeviceGetUUID = lambda h: h["uuid"]  # type: ignore[attr-defined]
    module.nvmlDeviceGetMemoryInfo = lambda h: types.SimpleNamespace(total=h["mem"])  # type: ignore[attr-defined]
    module.calls = calls  # type: ignore[attr-defined]
    return module


def test_capabilities_fields_are_sane() -> None:
    """The probe reports this host's CPUs, RAM, hostname, interpreter and the given settings."""
    caps = probe_capabilities(
        tags=["a", "b", "a"], max_concurrency=3, ops=["sleep", "echo"], python_envs=["/opt/py/bin/python"]
    )
    assert caps.cpu_cores == os.cpu_count()
    assert caps.ram_bytes == psutil.virtual_memory().total > 0
    assert caps.hostname
    assert caps.python_envs == [sys.executable, "/opt/py/bin/python"]
    assert caps.ops == ["echo", "sleep"]
    assert caps.tags == ["a", "b"]
    assert caps.max_concurrency == 3
    assert caps.accelerator == ("gpu" if caps.gpus else "cpu")


def test_missing_nvml_module_gives_no_gpus_and_no_noise(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without pynvml importable the probe returns [] and logs nothing above debug."""
    monkeypatch.setitem(sys.modules, "pynvml", None)
    with capture_logs() as logs:
        assert probe_gpus() == []
        caps = probe_capabilities(tags=[], max_concurrency=1, ops=[])
    assert caps.gpus == [] and caps.accelerator == "cpu"
    assert all(entry["log_level"] == "debug" for entry in logs)


def test_nvml_without_driver_gives_no_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    """An NVML library that fails to initialise (CPU host) means no GPUs, no error."""
    monkeypatch.setitem(sys.modules, "pynvml", _fake_nvml([], init_error=OSError("libnvidia-ml.so.1 not found")))
    with capture_logs() as logs:
        assert probe_gpus() == []
    assert all(entry["log_level"] == "debug" for entry in logs)


def test_real_environment_probe_does_not_raise() -> None:
    """Probing the real NVML of this machine (present or not) returns a list without raising."""
    gpus = probe_gpus()
    assert isinstance(gpus, list)
    assert all(isinstance(gpu, protocol.GpuInfo) and gpu.memory_bytes > 0 for gpu in gpus)


def test_gpus_are_read_from_nvml(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each NVML device becomes a GpuInfo (bytes or str names), and NVML is shut down after."""
    fake = _fake_nvml(
        [
            {"name": b"NVIDIA H200", "uuid": b"GPU-aaa", "mem": 141 << 30},
            {"name": "NVIDIA L4", "uuid": "GPU-bbb", "mem": 24 << 30},
        ]
    )
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    caps = probe_capabilities(tags=[], max_concurrency=1, ops=[])
    assert caps.gpus == [
        protocol.GpuInfo(name="NVIDIA H200", memory_bytes=141 << 30, uuid="GPU-aaa", index=0),
        protocol.GpuInfo(name="NVIDIA L4", memory_bytes=24 << 30, uuid="GPU-bbb", index=1),
    ]
    assert caps.accelerator == "gpu"
    assert fake.calls == ["init", "shutdown"]  # type: ignore[attr-defined]


def test_load_tracker_counts_plans_and_averages_latency() -> None:
    """in_flight follows started/finished; the latency EMA starts at the first sample."""
    load = LoadTracker(alpha=0.5)
    assert load.snapshot() == protocol.Load()
    load.started()
    load.started()
    assert load.snapshot().in_flight == 2
    load.finished(0.100)
    assert load.snapshot() == protocol.Load(in_flight=1, latency_ema_ms=100.0)
    load.finished(0.300)
    assert load.snapshot() == protocol.Load(in_flight=0, latency_ema_ms=200.0)


def test_load_tracker_rejects_bad_alpha() -> None:
    """An EMA weight outside (0, 1] is refused."""
    with pytest.raises(ValueError, match="alpha"):
        LoadTracker(alpha=0)
