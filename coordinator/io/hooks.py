"""The autoscaler's hook command: the I/O half of an autoscaler decision (docs/ROUTING.md §Autoscaler).

The core decides (coordinator/autoscaler.py) and hands its decisions to the server in
``Effects.decisions``; the server gives each one to :class:`HookRunner`, which runs the
operator's command through the shell with the decision as one JSON object on stdin. The
command starts or stops workers (a cloud API call, ``systemctl``, ``kubectl scale``...).
It runs in its own task: a slow or failing hook never blocks the coordinator, and its
outcome (exit status, the tail of its output) is logged.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Iterable
from typing import Any

import structlog

__all__ = ["HookRunner"]

log = structlog.get_logger(__name__)


class HookRunner:
    """Runs ``command`` once per decision, at most ``timeout_s`` each (then it is killed).

    Args:
        command: a shell command line; it reads the decision JSON on stdin.
        timeout_s: how long one run may take.
    """

    def __init__(self, command: str, timeout_s: float = 60.0) -> None:
        self.command = command
        self.timeout_s = timeout_s
        self.runs = 0
        self.failures = 0
        self._tasks: set[asyncio.Task[None]] = set()

    def run(self, decisions: Iterable[dict[str, Any]]) -> None:
        """Start one run per decision, in the background (call on the event loop)."""
        for decision in decisions:
            task = asyncio.get_running_loop().create_task(self._run(decision))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _run(self, decision: dict[str, Any]) -> None:
        payload = json.dumps(decision).encode() + b"\n"
        try:
            proc = await asyncio.create_subprocess_shell(
                self.command,
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.STDOUT,
            )
        except OSError as exc:
            self.failures += 1
            log.error("autoscale hook could not start", command=self.command, error=str(exc))
            return
        try:
            output, _ = await asyncio.wait_for(proc.communicate(payload), self.timeout_s)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()
            self.failures += 1
            log.error("autoscale hook timed out and was killed", command=self.command, timeout_s=self.timeout_s)
            return
        self.runs += 1
        tail = output.decode(errors="replace")[-2000:].strip()
        if proc.returncode == 0:
            log.info("autoscale hook ran", pool=decision.get("pool"), desired=decision.get("desired"), output=tail)
        else:
            self.failures += 1
            log.error("autoscale hook failed", command=self.command, status=proc.returncode, output=tail)

    async def close(self) -> None:
        """Wait for the runs in progress (each is bounded by ``timeout_s``)."""
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
