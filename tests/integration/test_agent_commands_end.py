"""A worker agent's own commands (``--interruption-command``) end with it: what they started does not outlive it."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from pathlib import Path

import pytest

from tests.waiting import alive, until
from worker_agent.agent import Agent

pytestmark = pytest.mark.timeout(30)


async def test_the_interruption_command_running_when_the_agent_stops_is_killed_with_what_it_started(
    tmp_path: Path,
) -> None:
    """The agent stopping while its --interruption-command runs kills the command's session: the shell's child (a
    sleep 30 here) ran on before, the watch's cancel killing nothing (and its timeout the shell alone)."""
    pid_file = tmp_path / "pid"
    agent = Agent("ws://127.0.0.1:9", "t", worker_id="w-commands-end",
                  interruption_command=f"sh -c 'echo $$ > {pid_file}; exec sleep 30'", interruption_poll_s=60,
                  reconnect_base_s=5.0, reconnect_cap_s=5.0)  # fmt: skip
    run = asyncio.create_task(agent.run())
    pid = 0
    try:
        await until(lambda: pid_file.exists() and pid_file.stat().st_size > 0, timeout_s=10)
        pid = int(await asyncio.to_thread(pid_file.read_text))
        agent.stop()
        await asyncio.wait_for(run, 10)
        await until(lambda: not alive(pid), timeout_s=5)
    finally:
        agent.stop()
        if not run.done():
            await asyncio.wait_for(run, 10)
        with contextlib.suppress(ProcessLookupError):  # without the fix the sleep runs on: not past the test
            if pid:
                os.kill(pid, signal.SIGKILL)
