"""Projected vs measured energy per plan, for a run of examples/inference_fleet/ (issue 14 part 2).

    python bench/receipts.py                       # 2 fake engines, 2 workers, 12 chat plans
    python bench/receipts.py --plans 24 --power-watts 300 --uj-per-token 6e6

Starts, as real processes on 127.0.0.1: two ``fake_engine.py`` engines (vLLM's API, a toy model that
streams the prompt's words reversed, ``--token-delay`` s per token), an in-memory coordinator, and
two workers fronting them (``--carbon-zone FR``). Without NVML the workers *estimate* energy
(``--power-watts`` x run time, split over their concurrent plans) and report ``--uj-per-token`` as
their energy per generated token, which the receipt's projection uses: µJ/token x the hinted maximum
output tokens (a bound: a plan may stop early). The hints are the SDK's own
(fleetwire/prompt_hints.py: prompt tokens estimated from the chat's characters, ``max_tokens`` as
the output bound), as any ``generate`` plan gets them. One warm-up plan per worker first (so the
coordinator holds their figures), then the plans, and one row per plan: tokens, projected and
measured joules and gCO2e, and their ratio.

On a GPU host (NVML present) the same script prints measured NVML figures (``estimated`` no) for
workers fronting real engines: pass ``--inference-url`` to the workers instead (edit ENGINES).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import secrets
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from fleetwire import Client  # noqa: E402  (after the path set-up, as the other benches)
from fleetwire.prompt_hints import fill_hints  # noqa: E402
from protocol import RoutingHints  # noqa: E402

FAKE_ENGINE = ROOT / "examples" / "inference_fleet" / "fake_engine.py"
PROMPTS = [
    "fleetwire routes plans to workers",
    "each worker fronts an inference engine",
    "tokens stream back as events",
    "the result carries the whole text and its receipt",
]


async def _start(*cmd: str, env: dict[str, str], ready: str) -> tuple[asyncio.subprocess.Process, str]:
    proc = await asyncio.create_subprocess_exec(*cmd, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL,
                                                env=env)  # fmt: skip
    assert proc.stdout is not None
    async with asyncio.timeout(30):
        while line := (await proc.stdout.readline()).decode():
            if m := re.search(ready, line):
                asyncio.get_running_loop().create_task(_drain(proc))
                return proc, m.group(1) if m.groups() else line
    raise RuntimeError(f"{cmd[1:3]} exited ({await proc.wait()}) before it was ready")


async def _drain(proc: asyncio.subprocess.Process) -> None:
    assert proc.stdout is not None
    while await proc.stdout.readline():
        pass


async def run(ns: argparse.Namespace) -> list[dict[str, Any]]:
    worker_token, client_token = secrets.token_urlsafe(16), secrets.token_urlsafe(16)
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLEETWIRE_")}
    env.update(PYTHONUNBUFFERED="1", FLEETWIRE_WORKER_TOKEN=worker_token, FLEETWIRE_CLIENT_TOKEN=client_token,
               FLEETWIRE_LOG_LEVEL="warning")  # fmt: skip
    fleetwire = (sys.executable, "-m", "fleetwire")
    procs: list[asyncio.subprocess.Process] = []
    try:
        engines = []
        for name in ("engine-a", "engine-b"):
            proc, url = await _start(sys.executable, str(FAKE_ENGINE), "--port", "0", "--name", name,
                                     "--token-delay", str(ns.token_delay), env=env,
                                     ready=r"listening on (http://\S+)")  # fmt: skip
            procs.append(proc)
            engines.append(url)
        proc, ws_url = await _start(*fleetwire, "coordinator", "--port", "0", "--store", "memory", env=env,
                                    ready=r"listening on (ws://\S+)")  # fmt: skip
        procs.append(proc)
        for worker_id, engine_url in zip(("gpu-a", "gpu-b"), engines, strict=True):
            proc, _ = await _start(*fleetwire, "worker", "--url", ws_url, "--id", worker_id, "--tags", "llm",
                                   "--max-concurrency", "2", "--inference-url", engine_url, "--carbon-zone", "FR",
                                   "--power-watts", str(ns.power_watts), "--uj-per-token", str(ns.uj_per_token),
                                   env={**env, "FLEETWIRE_TOKEN": worker_token}, ready="(registered)")  # fmt: skip
            procs.append(proc)
        rows: list[dict[str, Any]] = []
        async with Client(ws_url, token=client_token) as client:
            warm = [await client.submit("generate", args={"prompt": "warm up", "max_tokens": 2}, tags=["llm"])
                    for _ in range(2)]  # fmt: skip
            await asyncio.gather(*(p.result() for p in warm))
            plans, hinted = [], []
            for i in range(ns.plans):
                prompt = PROMPTS[i % len(PROMPTS)]
                args = {"messages": [{"role": "user", "content": prompt}], "max_tokens": ns.max_tokens}
                hints = fill_hints(RoutingHints(), args)  # what client.submit sends for op generate
                hinted.append(hints.prompt_tokens + hints.max_output_tokens)
                plans.append(await client.submit("generate", args=args, tags=["llm"]))
            for plan, tokens in zip(plans, hinted, strict=True):
                result = await plan.result()
                r = plan.receipt
                assert r is not None, f"plan {plan.id} ended without a receipt"
                rows.append({"plan": plan.id, "worker": plan.worker_id, "tokens": result["usage"]["completion_tokens"],
                             "hinted": tokens,
                             "projected_j": r.projected_joules, "measured_j": r.joules, "estimated": r.estimated,
                             "source": r.source, "run_s": r.run_s, "projected_g": r.projected_co2e_g,
                             "measured_g": r.co2e_g})  # fmt: skip
        return rows
    finally:
        for proc in reversed(procs):
            if proc.returncode is None:
                proc.terminate()
        for proc in procs:
            try:
                await asyncio.wait_for(proc.wait(), 15)
            except TimeoutError:
                proc.kill()
                await proc.wait()


def table(rows: list[dict[str, Any]]) -> str:
    """The rows as a markdown table, with totals."""
    out = ["| plan | worker | tokens (hinted) | run s | projected J | measured J | measured / projected | "
           "projected gCO2e | measured gCO2e | source |",
           "|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        ratio = f"{r['measured_j'] / r['projected_j']:.2f}" if r["projected_j"] else "-"
        est = " (estimated)" if r["estimated"] else ""
        out.append(f"| {r['plan'][:8]} | {r['worker']} | {r['tokens']} ({r['hinted']}) | {r['run_s']:.3f} | "
                   f"{r['projected_j']:.2f} | {r['measured_j']:.2f} | {ratio} | {r['projected_g']:.6f} | "
                   f"{r['measured_g']:.6f} | {r['source']}{est} |")  # fmt: skip
    pj, mj = sum(r["projected_j"] for r in rows), sum(r["measured_j"] for r in rows)
    pg, mg = sum(r["projected_g"] for r in rows), sum(r["measured_g"] for r in rows)
    ratio = f"{mj / pj:.2f}" if pj else "-"
    out.append(f"| **total** | | {sum(r['tokens'] for r in rows)} | | {pj:.2f} | {mj:.2f} | {ratio} | {pg:.6f} | "
               f"{mg:.6f} | |")  # fmt: skip
    return "\n".join(out)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--plans", type=int, default=12)
    parser.add_argument("--max-tokens", type=int, default=16, help="max_tokens of each chat plan, hinted as output")
    parser.add_argument("--token-delay", type=float, default=0.02, help="the fake engines' seconds per token")
    parser.add_argument("--power-watts", type=float, default=300.0, help="the workers' power model")
    parser.add_argument("--uj-per-token", type=float, default=6e6,
                        help="the workers' configured µJ/token (300 W at 50 tokens/s = 6e6)")
    ns = parser.parse_args()
    rows = asyncio.run(run(ns))
    print(f"{len(rows)} plans; workers: --power-watts {ns.power_watts:g}, --uj-per-token {ns.uj_per_token:g}, "
          f"zone FR; engines: {ns.token_delay:g} s/token\n")
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
