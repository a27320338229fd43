"""A real coordinator and worker on a GPU host: device isolation, health sampling and /metrics, end to end.

    python bench/gpu_fleet.py [--plans 50] [--json]

bench/gpu_check.py checks the worker's NVML code piece by piece; this runs the whole path a user gets on a GPU
host (docs/SEMANTICS.md §GPU resources, docs/OPERATIONS.md §GPU health), in one process that plays the client:

1. a coordinator (memory store, loopback) and a worker whose GPUs come from NVML's own probe (no ``--gpus``) and
   whose health monitor samples the devices every second;
2. a custom handler (``cuda_probe`` below) run with the default isolation for plans that hold devices (a child
   process per device set): a plan holding one GPU sees exactly that device in ``os.environ``, in the CUDA
   driver (``libcuda`` through ctypes: count and UUID) and, where torch is importable, in torch (it multiplies
   on it); a plan holding none sees no device at all (``CUDA_VISIBLE_DEVICES`` empty, the driver counts 0);
3. the worker's load frames carry each device's health: the coordinator's ``/metrics`` shows
   ``fleetwire_gpu_*`` series for every device of the worker with readings NVML gave (temperature > 0,
   health ``ok``), and no device is quarantined on a healthy host;
4. the cost per plan of the child bridge on this host: ``--plans`` no-op plans holding one GPU (the reused
   child) against the same handler run inline, medians printed side by side.

Prints PASS/FAIL per check and exits 0 when all pass; on a host without NVML or a GPU it prints SKIP and exits
0 (2 with ``--require-gpu``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_check import _CUDA_PROBE


def cuda_probe(ctx: Any, args: Any) -> dict[str, Any]:
    """What this plan's process sees of the GPUs: its environment, the CUDA driver and (if here) torch."""
    # The CUDA driver, asked by a process with this plan's environment (bench/gpu_check.py's probe).
    out = subprocess.run([sys.executable, "-c", _CUDA_PROBE], capture_output=True, text=True, timeout=60, check=False)
    names = ("CUDA_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES")
    seen: dict[str, Any] = {
        "pid": os.getpid(),
        "devices": list(ctx.devices),
        "env": {k: os.environ.get(k) for k in names},
        "driver": json.loads(out.stdout.strip().splitlines()[-1]) if out.stdout.strip() else {"error": out.stderr},
    }
    if (args or {}).get("torch"):
        try:
            import torch  # type: ignore[import-not-found]
        except ImportError:
            seen["torch"] = None
        else:
            seen["torch"] = {"count": torch.cuda.device_count()}
            if torch.cuda.device_count():
                a = torch.randn(1024, 1024, device="cuda")
                seen["torch"]["name"] = torch.cuda.get_device_name(0)
                seen["torch"]["matmul_sum_finite"] = bool(torch.isfinite((a @ a).sum()).item())
    return seen


def noop(ctx: Any, args: Any) -> None:
    """The cheapest plan: what the bridge to a child costs, with nothing else in the way."""


async def _run(ns: argparse.Namespace, report: dict[str, Any], checks: dict[str, bool]) -> None:
    import httpx

    from coordinator.io.frontdoor.server import CoordinatorServer, ServerSettings
    from fleetwire import Client
    from worker_agent import Agent
    from worker_agent.energy import Nvml

    nvml = Nvml.open()
    assert nvml is not None
    try:
        gpus = nvml.gpus()
    finally:
        nvml.close()
    report["nvml_gpus"] = [{"index": g.index, "uuid": g.uuid, "name": g.name, "mig_parent": g.parent_uuid}
                           for g in gpus]  # fmt: skip
    coordinator = CoordinatorServer(ServerSettings(port=0, insecure=True, store="memory"))
    await coordinator.start()
    agent = Agent(coordinator.url, None, worker_id="gpu-host", max_concurrency=8, gpu_health_interval_s=1.0)
    agent.add_handler("cuda_probe", cuda_probe)  # default isolation: a child per device set for plans holding GPUs
    agent.add_handler("noop", noop)
    agent.add_handler("noop_inline", noop, isolation="inline")
    task = asyncio.create_task(agent.run())
    try:
        await asyncio.wait_for(agent.registered.wait(), 30)
        async with Client(coordinator.url) as client:
            held = await (await client.submit("cuda_probe", args={"torch": True}, resources={"gpus": 1})).result()
            none = await (await client.submit("cuda_probe", args={"torch": True})).result()
            report["plan_holding_one_gpu"], report["plan_holding_none"] = held, none
            uuids = {str(g.index): g.uuid for g in gpus}
            own = held["devices"][0] if held["devices"] else None
            driver = held["driver"]
            checks["one_gpu_plan_sees_exactly_its_device"] = (
                own is not None
                and held["env"]["CUDA_VISIBLE_DEVICES"] == own
                and held["pid"] != os.getpid()
                and (
                    "skip" in driver
                    or (
                        driver["count"] == 1
                        and (gpus[0].parent_uuid is not None or driver["uuids"] == [uuids.get(own)])
                    )
                )
            )
            if held.get("torch"):
                checks["one_gpu_plan_torch_sees_one_and_computes"] = (
                    held["torch"]["count"] == 1 and held["torch"].get("matmul_sum_finite") is True
                )
            checks["plan_holding_none_sees_no_gpu"] = (
                none["env"]["CUDA_VISIBLE_DEVICES"] == ""
                and ("skip" in none["driver"] or none["driver"]["count"] == 0)
                and (not none.get("torch") or none["torch"]["count"] == 0)
            )

            # Health: the monitor samples every second; wait (bounded) until a load frame has carried every device.
            deadline = time.monotonic() + 20
            text = ""
            async with httpx.AsyncClient() as http:
                while time.monotonic() < deadline:
                    text = (await http.get(coordinator.url.replace("ws://", "http://") + "/metrics")).text
                    lines = [x for x in text.splitlines() if x.startswith("fleetwire_gpu_temperature_celsius")]
                    if len(lines) >= len(gpus):
                        break
                    await asyncio.sleep(0.25)  # polling an HTTP endpoint for a sample that arrives on its own clock
            gpu_lines = [line for line in text.splitlines() if line.startswith("fleetwire_gpu_")]
            report["metrics_gpu_lines"] = gpu_lines[:40]
            temps = [float(line.rsplit(" ", 1)[1]) for line in gpu_lines
                     if line.startswith("fleetwire_gpu_temperature_celsius")]  # fmt: skip
            checks["metrics_show_every_device_with_readings"] = len(temps) >= len(gpus) and all(t > 0 for t in temps)
            states = [line for line in gpu_lines if line.startswith("fleetwire_gpu_health") and line.endswith(" 1.0")]
            report["device_states"] = states  # ok, or degraded (hot, or clocks held down by the hardware)
            checks["no_device_quarantined_on_a_healthy_host"] = len(states) >= len(gpus) and not any(
                'state="quarantined"' in line for line in states
            )

            # The bridge's cost per plan on this host: the reused child vs inline, the same no-op handler.
            timings: dict[str, list[float]] = {"process (reused child)": [], "inline": []}
            for op, name in (("noop", "process (reused child)"), ("noop_inline", "inline")):
                await (await client.submit(op, resources={"gpus": 1})).result()  # warm: the child exists
                for _ in range(ns.plans):
                    t0 = time.perf_counter()
                    await (await client.submit(op, resources={"gpus": 1})).result()
                    timings[name].append(time.perf_counter() - t0)
            report["per_plan_ms"] = {k: {"median": round(statistics.median(v) * 1e3, 3),
                                         "p90": round(statistics.quantiles(v, n=10)[-1] * 1e3, 3)}
                                     for k, v in timings.items()}  # fmt: skip
            report["children_started"] = agent._handler_processes.started
    finally:
        agent.stop()
        await asyncio.wait_for(task, 30)
        await coordinator.stop()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--plans", type=int, default=50, help="plans per mode for the per-plan cost (default 50)")
    parser.add_argument("--json", action="store_true", help="print one JSON report instead of lines")
    parser.add_argument("--require-gpu", action="store_true", help="exit 2 (not SKIP, 0) on a host without a GPU")
    ns = parser.parse_args()
    from worker_agent.energy import Nvml

    nvml = Nvml.open()
    if nvml is None or not nvml.gpus():
        if nvml is not None:
            nvml.close()
        print("SKIP: no NVML library, driver or device on this host; nothing to check")
        return 2 if ns.require_gpu else 0
    nvml.close()
    report: dict[str, Any] = {}
    checks: dict[str, bool] = {}
    try:  # what was gathered before a step failed is printed too (a lent GPU's run is not repeated lightly)
        asyncio.run(_run(ns, report, checks))
    except Exception as exc:
        report["failed_step"] = f"{type(exc).__name__}: {exc}"
        checks["every_step_ran"] = False
    if ns.json:
        print(json.dumps({"report": report, "checks": checks}, indent=2))
    else:
        for key, value in report.items():
            print(f"{key}: {value}")
        for name, ok in checks.items():
            print(f"{'PASS' if ok else 'FAIL'} {name}")
    return 0 if checks and all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
