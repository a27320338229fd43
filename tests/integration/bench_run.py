"""Running a bench/ script from a test: its output, or a clear failure, and never a process left behind."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
KILLED = -signal.SIGKILL


async def run_bench(script: Path, args: Sequence[str], timeout_s: float) -> tuple[int, str, str]:
    """Run ``script`` with ``args`` in a session of its own; ``(exit status, stdout, stderr)``.

    Past ``timeout_s`` the script and every process it started (its session's process group) are
    killed, and the result says so: exit status :data:`KILLED`, a last stderr line naming the
    timeout. A bare ``wait_for`` raised TimeoutError instead, leaving the bench's processes running
    and their pipes to the garbage collector, whose ResourceWarnings (errors in this suite) came
    while pytest formatted the failure: CPython 3.11's ``ast.parse``, entered again from inside
    itself by that finalizer's traceback, raised ``SystemError: AST constructor recursion depth
    mismatch`` and pytest stopped with an INTERNALERROR (under xdist: a crashed worker).
    """
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLEETWIRE_")}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, str(script), *args, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        cwd=ROOT, env=env, start_new_session=True,
    )  # fmt: skip
    try:
        out, err = await asyncio.wait_for(proc.communicate(), timeout_s)
    except TimeoutError:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        out, err = await asyncio.wait_for(proc.communicate(), 30)  # the pipes end once their holders are dead
        note = f"\n{script.name} gave no result within {timeout_s:g} s: killed, with the processes it started"
        return KILLED, out.decode(errors="replace"), err.decode(errors="replace") + note
    return proc.returncode or 0, out.decode(errors="replace"), err.decode(errors="replace")
