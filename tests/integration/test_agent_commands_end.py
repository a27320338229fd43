"""A worker agent's own commands (``--interruption-command``) end with it: what they started does not outlive it."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from pathlib import Path
from typing import Any

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


async def test_the_interruption_command_is_reaped_before_the_agents_run_returns(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The watch's kill of its command (the agent stopping while it runs) is waited for by ``Agent.run``: the
    command's exit is collected before run returns. It was not (the watch's task cancelled, never awaited): the loop
    that ended with the test left its Process unreaped, and the collector's 'subprocess ... is still running'
    ResourceWarning failed whichever later test of that pytest process it fell in."""
    pid_file = tmp_path / "pid"
    procs: list[asyncio.subprocess.Process] = []
    shell = asyncio.create_subprocess_shell

    async def noted(*args: Any, **kwargs: Any) -> asyncio.subprocess.Process:
        proc = await shell(*args, **kwargs)
        procs.append(proc)
        return proc

    monkeypatch.setattr(asyncio, "create_subprocess_shell", noted)
    agent = Agent("ws://127.0.0.1:9", "t", worker_id="w-commands-reaped",
                  interruption_command=f"sh -c 'echo $$ > {pid_file}; exec sleep 30'", interruption_poll_s=60,
                  reconnect_base_s=5.0, reconnect_cap_s=5.0)  # fmt: skip
    run = asyncio.create_task(agent.run())
    try:
        await until(lambda: pid_file.exists() and pid_file.stat().st_size > 0, timeout_s=10)
        agent.stop()
        await asyncio.wait_for(run, 10)
        assert [p.returncode for p in procs] == [-signal.SIGKILL], "the command was not reaped when run returned"
    finally:
        agent.stop()
        if not run.done():
            await asyncio.wait_for(run, 10)
        for proc in procs:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await asyncio.wait_for(proc.wait(), 10)
