"""Everything in examples/ runs against a real local fleet, so the docs cannot rot."""

from __future__ import annotations

import asyncio
import json
import sys

import pytest

from tests.e2e.conftest import ROOT, WORKER_TOKEN, Cluster
from tests.e2e.module_fleet import ON_THE_FLEETS_LOOP, module_fleet

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]

# One coordinator and worker w1 for the stream example and the refused example (tests/e2e/module_fleet.py);
# the custom handler example registers a worker of its own, so it has a fleet of its own (the stream example
# counts the workers).
fleet = module_fleet()


@ON_THE_FLEETS_LOOP
async def test_submit_and_stream_example(fleet: Cluster) -> None:
    """examples/submit_and_stream.py streams events, collects results, shows a failure and a waiting plan."""
    proc = await fleet.script(ROOT / "examples" / "submit_and_stream.py")
    assert await proc.wait(60) == 0, proc.lines
    out = "\n".join(proc.lines)
    assert "result: {'x': 1}" in out
    assert "failed: timeout" in out
    assert "waiting: no connected worker handles op 'no-such-op'" in out
    assert "cancelled:" in out
    assert proc.lines[-1].startswith("1 workers (") or proc.lines[-1].startswith("1 worker")


async def test_custom_handler_example(cluster: Cluster) -> None:
    """examples/custom_handler.py registers a worker whose word_count handler serves submitted plans."""
    await cluster.coordinator()
    worker_env = cluster.env(FLEETWIRE_TOKEN=WORKER_TOKEN)
    worker = await cluster.script(ROOT / "examples" / "custom_handler.py", env=worker_env)
    await worker.wait_for_line("registered")
    submit = await cluster.run("submit", "word_count", "--args", '{"text": "to be or\\nnot to be"}', "--json")
    assert await submit.wait() == 0
    assert json.loads(submit.lines[-1])["result"] == {"to": 2, "be": 2, "or": 1, "not": 1}


@ON_THE_FLEETS_LOOP
async def test_custom_handler_example_refuses_a_client_token(fleet: Cluster) -> None:
    """examples/custom_handler.py given a client's token says why in one line and exits 1 instead of hanging."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, str(ROOT / "examples" / "custom_handler.py"),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=fleet.env(), cwd=ROOT,
    )
    try:
        _, err = await asyncio.wait_for(proc.communicate(), 30)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    lines = err.decode().strip().splitlines()
    assert proc.returncode == 1, lines
    assert len(lines) == 1 and "not for a worker" in lines[0] and "worker role" in lines[0], lines
