"""``fleetwire worker --handler NAME=MODULE:FUNCTION`` finds MODULE in the worker's current directory."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import pytest

from tests.e2e.conftest import WORKER_TOKEN, Cluster, Proc

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]

HANDLER = '''
def wc(ctx, args):
    """Words in args["text"]."""
    return len(str(args["text"]).split())
'''


async def test_console_script_imports_handler_module_from_current_directory(cluster: Cluster, tmp_path: Path) -> None:
    """The installed ``fleetwire`` script (whose sys.path starts at its bin directory) imports a handler module
    sitting in its current directory, as ``python -m`` would, without PYTHONPATH."""
    (tmp_path / "h7_cwd_handlers.py").write_text(HANDLER)
    await cluster.coordinator()
    script = Path(sys.executable).parent / "fleetwire"
    assert script.exists(), f"no console script at {script}"
    env = cluster.env(FLEETWIRE_WORKER_TOKEN=WORKER_TOKEN)
    env.pop("PYTHONPATH", None)
    proc = await asyncio.create_subprocess_exec(
        str(script), "worker", "--id", "cwd-worker", "--handler", "wc=h7_cwd_handlers:wc",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT, env=env, cwd=tmp_path,
    )
    worker = Proc(proc, "cwd-worker")
    cluster.procs.append(worker)
    await worker.wait_for_line("registered")
    submit = await cluster.run("submit", "wc", "--args", '{"text": "to be or not"}', "--json")
    assert await submit.wait(60) == 0, submit.lines
    assert json.loads(submit.lines[-1])["result"] == 4
