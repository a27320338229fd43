"""``fleetwire up``'s wait for its local workers to register (fleetwire/cli/up.py) ends when it is cancelled (Ctrl-C),
whenever the cancel comes: started from inside the awaited read as it returns (deterministic; no sleeps)."""

from __future__ import annotations

import asyncio
import sys

import pytest

from fleetwire.cli.up import _await_registered


@pytest.mark.timeout(15)
async def test_the_wait_for_registration_cancelled_as_a_line_is_read_ends(monkeypatch: pytest.MonkeyPatch) -> None:
    """Cancelled in the loop iteration in which a worker's line is read, the wait ends at once (on Python 3.11
    asyncio.wait_for lost that cancel: the wait read on until the worker registered or its timeout passed)."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", "import sys, time; print('starting', flush=True); time.sleep(30)",
        stdout=asyncio.subprocess.PIPE)  # fmt: skip
    task: asyncio.Task[None] | None = None
    readline = asyncio.StreamReader.readline

    async def readline_then_cancel(reader: asyncio.StreamReader) -> bytes:
        """The real readline; as it returns a line, the wait's task is cancelled (Ctrl-C)."""
        line = await readline(reader)
        if line and task is not None and not task.cancelling():
            task.cancel()
        return line

    monkeypatch.setattr(asyncio.StreamReader, "readline", readline_then_cancel)
    try:
        task = asyncio.create_task(_await_registered(proc, "local-1", 30.0))
        done, _ = await asyncio.wait([task], timeout=3)
        if not done:  # the bug: end it with a second cancel, so nothing is left running
            task.cancel()
            await asyncio.wait([task], timeout=2)
        assert done and task.cancelled(), "the wait for registration went on after it was cancelled"
    finally:
        monkeypatch.undo()
        proc.kill()
        await proc.wait()
