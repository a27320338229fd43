"""Multi-turn chats on a local kv_aware fleet: three fake engines, a coordinator, three workers, chat.py.

    python examples/multi_turn_chat/run_local.py

The engines are examples/inference_fleet/fake_engine.py (vLLM's API and metrics, a toy model), so
this runs anywhere. The coordinator runs ``--policy kv_aware``; the chats need nothing else: the SDK
hints every ``generate`` plan. Exit status: chat.py's.
"""

from __future__ import annotations

import asyncio
import os
import re
import secrets
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
FAKE_ENGINE = HERE.parent / "inference_fleet" / "fake_engine.py"
WORKERS = ("gpu-a", "gpu-b", "gpu-c")


async def start(*cmd: str, env: dict[str, str], ready: str, what: str) -> tuple[asyncio.subprocess.Process, str]:
    """Start a process and wait (30 s at most) for a stdout line matching ``ready``; returns it and the match.

    Its stderr (an engine's connection resets at shutdown) is dropped, so the chats' lines stand out.
    """
    proc = await asyncio.create_subprocess_exec(*cmd, stdout=asyncio.subprocess.PIPE,
                                                stderr=asyncio.subprocess.DEVNULL, env=env)
    assert proc.stdout is not None
    async with asyncio.timeout(30):
        while line := (await proc.stdout.readline()).decode():
            if m := re.search(ready, line):
                asyncio.get_running_loop().create_task(drain(proc))
                return proc, m.group(1) if m.groups() else line
    raise RuntimeError(f"{what} exited ({await proc.wait()}) before it was ready")


async def drain(proc: asyncio.subprocess.Process) -> None:
    """Read a started process's output to its end (so it never blocks on a full pipe)."""
    assert proc.stdout is not None
    while await proc.stdout.readline():
        pass


async def main() -> int:
    worker_token, client_token = secrets.token_urlsafe(16), secrets.token_urlsafe(16)
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLEETWIRE_")}
    env.update(PYTHONUNBUFFERED="1", FLEETWIRE_WORKER_TOKEN=worker_token, FLEETWIRE_CLIENT_TOKEN=client_token)
    fleetwire = (sys.executable, "-m", "fleetwire")
    procs: list[asyncio.subprocess.Process] = []
    try:
        engines = []
        for worker_id in WORKERS:
            proc, url = await start(sys.executable, str(FAKE_ENGINE), "--port", "0", "--name", f"engine-{worker_id}",
                                    env=env, ready=r"listening on (http://\S+)", what="engine")  # fmt: skip
            procs.append(proc)
            engines.append(url)
        proc, ws_url = await start(*fleetwire, "coordinator", "--port", "0", "--store", "memory",
                                   "--policy", "kv_aware", env=env, ready=r"listening on (ws://\S+)",
                                   what="coordinator")  # fmt: skip
        procs.append(proc)
        for worker_id, engine_url in zip(WORKERS, engines, strict=True):
            proc, _ = await start(*fleetwire, "worker", "--url", ws_url, "--id", worker_id, "--tags", "llm",
                                  "--max-concurrency", "4", "--inference-url", engine_url,
                                  env={**env, "FLEETWIRE_TOKEN": worker_token}, ready="(registered)",
                                  what=worker_id)  # fmt: skip
            procs.append(proc)
        client_env = {**env, "FLEETWIRE_URL": ws_url, "FLEETWIRE_TOKEN": client_token}
        client = await asyncio.create_subprocess_exec(sys.executable, str(HERE / "chat.py"), env=client_env)
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
