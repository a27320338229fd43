"""The README's Python blocks run as written against a real local fleet (only the coordinator's address changed)."""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import sys
from pathlib import Path

import pytest

from tests.e2e.conftest import WORKER_TOKEN, Cluster, Proc
from tests.unit.test_readme import ROOT, python_blocks

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]


def block(*needles: str) -> str:
    """The one README Python block that contains every needle."""
    found = [code for _, code in python_blocks() if all(n in code for n in needles)]
    assert len(found) == 1, f"{len(found)} README blocks contain {needles}"
    return found[0]


async def run_block(cluster: Cluster, code: str, cwd: Path, name: str, env: dict[str, str] | None = None) -> Proc:
    """Start ``code`` as a script of its own in ``cwd``, the fleet's URL in place of the README's default one."""
    script = cwd / f"{name}.py"
    script.write_text(code.replace("ws://127.0.0.1:8765", cluster.url).replace("127.0.0.1:8766", "127.0.0.1:0"))
    proc = await asyncio.create_subprocess_exec(
        sys.executable, str(script), stdout=asyncio.subprocess.PIPE, env=env or cluster.env(), cwd=cwd,
    )
    p = Proc(proc, name)
    cluster.procs.append(p)
    return p


async def test_readme_client_blocks_run(cluster: Cluster, tmp_path: Path) -> None:
    """The 'From Python' blocks (Client with submit_many, SyncClient) run to their end and print the results."""
    await cluster.coordinator()
    # The block's 10,000 echo plans took 10.6 s on the default 4 slots, 2.2-4.0 s on 128 (the block is unchanged).
    await cluster.worker("w1", "--tags", "local", "--max-concurrency", "128")
    client = await run_block(cluster, block("Client()", "submit_many"), tmp_path, "readme_client")
    assert await client.wait(120) == 0, client.lines
    assert "{'x': 1}" in client.lines and client.lines[-1] == "10000 results", client.lines[-5:]
    sync = await run_block(cluster, block("SyncClient"), tmp_path, "readme_sync")
    assert await sync.wait(60) == 0, sync.lines
    assert sync.lines == ["[1, 2, 3]"]


async def test_readme_worker_blocks_serve_plans(cluster: Cluster, tmp_path: Path) -> None:
    """The README's handler and data-plane worker blocks register and serve their ops; its data client block
    uploads cat.png and fetches the mask the worker made."""
    await cluster.coordinator()
    worker_env = cluster.env(FLEETWIRE_WORKER_TOKEN=WORKER_TOKEN)
    await run_block(cluster, block("Agent(", "word_count"), tmp_path, "readme_handlers", env=worker_env)
    await run_block(cluster, block("Agent(", '"segment"'), tmp_path, "readme_data_worker", env=worker_env)
    image = bytes(range(256)) * 64
    (tmp_path / "cat.png").write_bytes(image)
    # The CLI's plan and the data client's run side by side (each is mostly its process's start).
    submit = await cluster.run("submit", "word_count", "--args", '{"text": "to be or not"}', "--json")
    client = await run_block(cluster, block("Client()", '"segment"'), tmp_path, "readme_data_client")
    assert await submit.wait(60) == 0, submit.lines
    assert json.loads(submit.lines[-1])["result"] == 4
    assert await client.wait(60) == 0, client.lines
    assert (tmp_path / "mask.png").read_bytes() == image[::-1]


def shell_block(*needles: str) -> str:
    """The one README block without a language that contains every needle (a shell transcript)."""
    text = (ROOT / "README.md").read_text()
    blocks = [m.group(1) for m in re.finditer(r"^```\n(.*?)^```$", text, re.S | re.M)]
    found = [code for code in blocks if all(n in code for n in needles)]
    assert len(found) == 1, f"{len(found)} README shell blocks contain {needles}"
    return found[0]


async def test_readme_pipeline_blocks_run(cluster: Cluster, tmp_path: Path) -> None:
    """The README's pipeline blocks run as written: the Python one prints the sum of the first plan's numbers, the
    shell one (submit --detach, --input x=plan:ID/NAME, output) prints it too and ends with status 0."""
    if shutil.which("jq") is None:
        pytest.skip("the README's shell pipeline reads the plan id with jq")
    await cluster.coordinator()
    await cluster.worker("w1", "--allow-shell", "--data-listen", "127.0.0.1:0")
    # The two blocks make their own plans: they run side by side (each is mostly its processes' start).
    client = await run_block(cluster, block("Client()", ".ref("), tmp_path, "readme_pipeline")
    env = cluster.env(PATH=os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]))
    script = "set -euo pipefail\n" + shell_block("plan:$A/n")
    shell = await asyncio.create_subprocess_exec("bash", "-c", script, stdout=asyncio.subprocess.PIPE, env=env,
                                                 cwd=tmp_path)  # fmt: skip
    p = Proc(shell, "readme_pipeline_shell")
    cluster.procs.append(p)
    assert await client.wait(90) == 0, client.lines
    assert client.lines == ["500500"], client.lines
    assert await p.wait(90) == 0, "\n".join(p.lines)
    assert p.lines[-1] == "500500", p.lines
