"""Exercise the NVML branch of worker_agent/energy.py on a machine with an NVIDIA GPU.

The test suite runs on CPU machines, where only the absent-device branch can run. This script is
the check for the other branch; run it on a GPU host (the package and nvidia-ml-py installed):

    python bench/gpu_check.py [--seconds 5] [--json]

What it checks, each printed as PASS/FAIL with the figures:

1. ``Nvml.open()`` finds the library, the driver and at least one device;
2. ``Nvml.gpus()`` gives every GPU (or each MIG instance, with ``parent_uuid``) a name, memory and
   a UUID, and ``probe_capabilities`` reports ``accelerator="gpu"`` with the same GPUs;
3. ``Nvml.power_w()`` reads a positive draw;
4. ``PowerSampler`` + ``EnergyMeter`` integrate power over a "plan" of ``--seconds`` (a matmul
   loop when torch with CUDA is importable, so the draw rises above idle; idle power otherwise),
   and a fake token count gives a finite µJ/token; the meter's energy is compared with NVML's own
   energy counter (``nvmlDeviceGetTotalEnergyConsumption``, Volta and later) over the same window;
5. per-plan isolation (docs/SEMANTICS.md §GPU resources): the worker's allocator
   (worker_agent/devices.py) gives one device to each of as many "plans" as there are devices, and
   each plan's process, started with the ``CUDA_VISIBLE_DEVICES`` the ``shell`` handler would set,
   asks the CUDA driver (``libcuda`` through ctypes, no torch needed) what it sees: exactly one
   device each, a different one per plan (by UUID), and, for whole GPUs, the very one allocated.
   Skipped (not failed) without ``libcuda``;
6. GPU health (worker_agent/gpu_health.py): ``NvmlHealthSource`` reads every device (utilisation,
   memory, temperature, power, clocks event reasons, volatile ECC counts), polls the critical-XID event
   set, and the quarantine rules put no device of a healthy host in quarantine.

Exit status 0 when every check passes, 1 otherwise; without NVML or a GPU it prints
``SKIP`` and exits 0 (nothing to check here), or 2 with ``--require-gpu``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import structlog

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from worker_agent.devices import DeviceAllocator, DeviceRequest
from worker_agent.energy import EnergyMeter, Nvml, PowerSampler
from worker_agent.probe import probe_capabilities


def _total_energy_j(nvml: Nvml) -> float | None:
    """NVML's own cumulative energy counter summed over devices, joules; None where unsupported."""
    try:
        return sum(nvml._nvml.nvmlDeviceGetTotalEnergyConsumption(h) for h in nvml._handles) / 1000.0
    except Exception:
        return None


def _load_gpu(seconds: float) -> str:
    """Keep the GPU busy for ``seconds`` if torch with CUDA is here; else just wait (idle power)."""
    try:
        import torch  # type: ignore[import-not-found]  # optional: only to raise the draw above idle
    except ImportError:
        time.sleep(seconds)
        return "idle (torch not installed)"
    if not torch.cuda.is_available():
        time.sleep(seconds)
        return "idle (torch without CUDA)"
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.float16)
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        (a @ a).sum().item()
    return "fp16 8192x8192 matmul loop"


# Run in each plan's process: what the CUDA driver shows it (count, and each device's UUID).
_CUDA_PROBE = r"""
import ctypes, json, sys
try:
    cuda = ctypes.CDLL("libcuda.so.1")
except OSError as exc:
    print(json.dumps({"skip": str(exc)})); sys.exit(0)
if cuda.cuInit(0) != 0:
    print(json.dumps({"count": 0, "uuids": []})); sys.exit(0)
count = ctypes.c_int()
cuda.cuDeviceGetCount(ctypes.byref(count))
uuids = []
for i in range(count.value):
    dev = ctypes.c_int()
    cuda.cuDeviceGet(ctypes.byref(dev), i)
    raw = (ctypes.c_ubyte * 16)()
    get = getattr(cuda, "cuDeviceGetUuid_v2", None) or cuda.cuDeviceGetUuid
    get(raw, dev)
    h = bytes(raw).hex()
    uuids.append(f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}")
print(json.dumps({"count": count.value, "uuids": uuids}))
"""


def isolation_check(gpus: list[Any]) -> tuple[dict[str, Any], bool | None]:
    """Check 5: one device per plan, each plan's process sees only its own; None: skipped (no libcuda)."""
    allocator = DeviceAllocator(gpus)
    seen: list[dict[str, Any]] = []
    for n in range(len(gpus)):
        held = allocator.allocate(f"plan-{n}", DeviceRequest(1))
        if held is None:
            return {"error": f"the allocator gave plan {n} no device"}, False
        env = {**os.environ, "CUDA_VISIBLE_DEVICES": allocator.visible(held)}
        out = subprocess.run([sys.executable, "-c", _CUDA_PROBE], env=env, capture_output=True, text=True,
                             timeout=60, check=False)
        try:
            answer = json.loads(out.stdout.strip().splitlines()[-1])
        except (ValueError, IndexError):
            return {"error": f"plan {n}'s probe printed {out.stdout!r} {out.stderr[-300:]!r}"}, False
        if "skip" in answer:
            return {"skipped": answer["skip"]}, None
        gpu = gpus[held[0]]
        seen.append({"plan": n, "visible": env["CUDA_VISIBLE_DEVICES"], "count": answer["count"],
                     "uuids": answer["uuids"], "allocated_uuid": gpu.uuid, "mig": bool(gpu.parent_uuid)})
    ok = all(s["count"] == 1 for s in seen)
    ok = ok and len({s["uuids"][0] for s in seen}) == len(seen)
    ok = ok and all(s["mig"] or s["uuids"][0] == s["allocated_uuid"] for s in seen)
    return {"plans": seen}, ok


def health_check(gpus: list[Any]) -> tuple[dict[str, Any], bool]:
    """GPU health (worker_agent/gpu_health.py, docs/OPERATIONS.md §GPU health) read through NVML itself: every
    device reads (utilisation, memory, temperature, power, clocks reasons, ECC), the XID event set polls
    without error, and a healthy host's devices come out ok or degraded, never quarantined."""
    from worker_agent.gpu_health import HealthRules, NvmlHealthSource, ProbeFailed, physical_of

    source = NvmlHealthSource.open()
    if source is None:
        return {"error": "NvmlHealthSource.open() found no device"}, False
    try:
        physical = physical_of(gpus, source.uuids)
        rules = HealthRules(len(gpus))
        readings: dict[int, Any] = {}
        for index, p in enumerate(physical):
            if p is None:
                continue
            try:
                readings[p] = readings.get(p) or source.read(p)
            except ProbeFailed as exc:
                rules.probe_failed(index, str(exc))
                continue
            rules.read(index, readings[p])
        started = time.monotonic()
        xids = source.xids()
        poll_ms = (time.monotonic() - started) * 1e3
        for p, xid in xids:
            for index, q in enumerate(physical):
                if q == p:
                    rules.xid(index, xid)
    finally:
        source.close()
    import msgspec

    report = {"devices": msgspec.to_builtins(rules.report()), "xids_pending": xids, "xid_poll_ms": round(poll_ms, 3)}
    ok = bool(readings) and all(0 <= r.utilization_pct <= 100 and r.temperature_c > 0 and r.memory_used_bytes >= 0
                                for r in readings.values()) and not rules.quarantined  # fmt: skip
    return report, ok


def main() -> int:
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.INFO))
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=5.0, help="length of the measured 'plan' (default 5)")
    parser.add_argument("--json", action="store_true", help="print one JSON report instead of lines")
    parser.add_argument("--require-gpu", action="store_true", help="exit 2 (not SKIP, 0) on a host without a GPU")
    ns = parser.parse_args()
    report: dict[str, Any] = {"checks": {}}
    checks: dict[str, bool] = report["checks"]

    nvml = Nvml.open()
    checks["nvml_open"] = nvml is not None
    if nvml is None:
        if not ns.require_gpu:
            print("SKIP: no NVML library, driver or device on this host; nothing to check")
            return 0
        print("FAIL nvml_open: no NVML library, driver or device on this host", file=sys.stderr)
        return 2
    try:
        gpus = nvml.gpus()
        report["gpus"] = [{"name": g.name, "memory_bytes": g.memory_bytes, "uuid": g.uuid, "index": g.index,
                           "parent_uuid": g.parent_uuid} for g in gpus]
        checks["gpus_described"] = bool(gpus) and all(g.name and g.memory_bytes > 0 and g.uuid for g in gpus)
        caps = probe_capabilities(tags=[], max_concurrency=1, ops=[])
        checks["capabilities_gpu"] = caps.accelerator == "gpu" and [g.uuid for g in caps.gpus] == [g.uuid for g in gpus]
        report["mig_instances"] = sum(1 for g in gpus if g.parent_uuid)

        idle_w = nvml.power_w()
        report["power_w_idle"] = idle_w
        checks["power_positive"] = idle_w > 0

        meter = EnergyMeter(measured=True)
        sampler = PowerSampler(nvml.power_w, meter, interval_s=0.1)
        sampler.start()
        time.sleep(0.3)
        counter_before = _total_energy_j(nvml)
        meter.plan_started("gpu-check")
        report["load"] = _load_gpu(ns.seconds)
        time.sleep(0.2)  # one more sample inside the window
        used = meter.plan_finished("gpu-check", tokens=1000)
        counter_after = _total_energy_j(nvml)
        sampler.stop()
        report["power_w_last"] = meter.power_w
        report["meter_joules"] = None if used is None else round(used.joules, 3)
        report["uj_per_token_for_1000_tokens"] = meter.uj_per_token
        checks["energy_measured"] = used is not None and used.joules > 0 and 0 < meter.uj_per_token < float("inf")
        if counter_before is not None and counter_after is not None and used is not None:
            counter_j = counter_after - counter_before
            report["nvml_counter_joules"] = round(counter_j, 3)
            report["meter_vs_counter"] = round(used.joules / counter_j, 3) if counter_j > 0 else None
            # Sampling at 10 Hz misses short spikes; within 25 % of the hardware counter is the bar.
            checks["energy_matches_counter"] = counter_j > 0 and abs(used.joules / counter_j - 1) < 0.25
        report["health"], checks["health_sampled"] = health_check(gpus)
        report["isolation"], isolated = isolation_check(gpus) if gpus else ({"skipped": "no devices"}, None)
        if isolated is not None:
            checks["per_plan_isolation"] = isolated
    finally:
        nvml.close()

    if ns.json:
        print(json.dumps(report, indent=2))
    else:
        for key, value in report.items():
            if key != "checks":
                print(f"{key}: {value}")
        for name, ok in checks.items():
            print(f"{'PASS' if ok else 'FAIL'} {name}")
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
