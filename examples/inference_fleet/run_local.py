"""The whole inference fleet on this machine: two OpenAI-compatible engines, a coordinator, two
workers each fronting one engine, and the streaming client. Stops everything when the client ends.

    python examples/inference_fleet/run_local.py

The engines are ``fake_engine.py`` (vLLM's API and metrics, a toy model) so this runs anywhere; on a
GPU host, start ``vllm serve <model> --port 8000`` instead and give its URL to the worker (README.md).
Exit status: the client's.
"""

from __future__ import annotations

import asyncio
import os
import re
import secrets
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


async def _start(*cmd: str, env: dict[str, str], ready: str, what: str) -> tuple[asyncio.subprocess.Process, str]:
    """Start a process and wait (30 s at most) for a stdout line matching ``ready``; returns it and the match."""
    proc = await asyncio.create_subprocess_exec(*cmd, stdout=asyncio.subprocess.PIPE, env=env)
    assert proc.stdout is not None
    async with asyncio.timeout(30):
        while line := (await proc.stdout.readline()).decode():
            print(f"[{what}] {line.rstrip()}", flush=True)
            if m := re.search(ready, line):
                return proc, m.group(1) if m.groups() else line
    raise RuntimeError(f"{what} exited ({await proc.wait()}) before it was ready")


async def main() -> int:
    worker_token, client_token = secrets.token_urlsafe(16), secrets.token_urlsafe(16)
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLEETWIRE_")}
    env.update(PYTHONUNBUFFERED="1", FLEETWIRE_WORKER_TOKEN=worker_token, FLEETWIRE_CLIENT_TOKEN=client_token)
    fleetwire = (sys.executable, "-m", "fleetwire")
    procs: list[asyncio.subprocess.Process] = []
    try:
        engines = []
        for name in ("engine-a", "engine-b"):
            proc, url = await _start(sys.executable, str(HERE / "fake_engine.py"), "--port", "0", "--name", name,
                                     env=env, ready=r"listening on (http://\S+)", what=name)
            procs.append(proc)
            engines.append(url)
        proc, ws_url = await _start(*fleetwire, "coordinator", "--port", "0", "--store", "memory", env=env,
                                    ready=r"listening on (ws://\S+)", what="coordinator")
        procs.append(proc)
        for worker_id, engine_url in zip(("gpu-a", "gpu-b"), engines, strict=True):
            proc, _ = await _start(*fleetwire, "worker", "--url", ws_url, "--id", worker_id, "--tags", "llm",
                                   "--max-concurrency", "2", "--inference-url", engine_url, "--carbon-zone", "FR",
                                   env={**env, "FLEETWIRE_TOKEN": worker_token}, ready="(registered)", what=worker_id)
            procs.append(proc)
        client_env = {**env, "FLEETWIRE_URL": ws_url, "FLEETWIRE_TOKEN": client_token}
        client = await asyncio.create_subprocess_exec(sys.executable, str(HERE / "client.py"), env=client_env)
        return await client.wait()
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


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
