"""End to end (issue #24 part 2): a real `fleetwire worker` started with its token in its environment.

The probe printed ``FLEETWIRE_WORKER_TOKEN`` with ``env`` in a shell plan, and a plan of the same
user can read the worker's ``/proc/PID/environ``. Here no plan finds the token: not in its own
environment, not in the worker's ``os.environ`` (a python plan run in the worker's process), not
in the worker's ``/proc`` (non-dumpable; as root, plans run as ``--plan-user nobody``).
"""

from __future__ import annotations

import asyncio
import os
from typing import Any

import pytest

from fleetwire import Client
from fleetwire.plan import Plan
from tests.e2e.conftest import CLIENT_TOKEN, WORKER_TOKEN, Cluster

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]


async def stdout_of(plan: Plan) -> list[str]:
    """The plan's stdout lines, once it ended."""
    lines = []
    async for event in plan.events():
        if event.kind == "stdout":
            lines.append(str(event.data))
    return lines


async def test_no_plan_finds_the_worker_token(cluster: Cluster) -> None:
    """Shell `env` and the worker's /proc/PID/environ, and os.environ in the worker's process: no worker token."""
    await cluster.coordinator()
    # As root, a plan reads any process's /proc: the isolation that holds then is another user's.
    as_user = ("--plan-user", "nobody") if os.geteuid() == 0 else ()
    await cluster.worker("shell-worker", "--allow-shell", *as_user)
    await cluster.worker("python-worker", "--python-allow", "tests.plan_functions:*")  # runs them in its process
    cmd = "env; tr '\\0' '\\n' < /proc/$PPID/environ || echo cannot-read-the-worker"
    async with Client(cluster.url, token=CLIENT_TOKEN) as client:
        shell = await client.submit("shell", {"cmd": cmd})
        lines = await asyncio.wait_for(stdout_of(shell), 60)
        assert any(line.startswith("PATH=") for line in lines), lines
        assert "cannot-read-the-worker" in lines and not [line for line in lines if WORKER_TOKEN in line]
        python = await client.submit("python", {"function": "tests.plan_functions:seen"})
        seen: Any = await asyncio.wait_for(python.result(), 60)
        assert python.worker_id == "python-worker" and seen["pid"] != os.getpid()
        assert not [name for name, value in seen["env"].items() if WORKER_TOKEN in value]  # os.environ lost it
