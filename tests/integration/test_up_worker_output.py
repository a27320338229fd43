"""``fleetwire up`` reads its local workers' stdout to the end (fleetwire/cli/up.py ``_drop_output``), not only up to
their registration line: a pipe nobody reads fills at 64 KiB and blocks the process that writes to it."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

from fleetwire.cli import up
from fleetwire.cli.main import build_parser
from tests.waiting import until

pytestmark = pytest.mark.timeout(60)

WRITTEN_BYTES = 1 << 20  # well past a pipe's 64 KiB

# A stand-in for `fleetwire worker`: its registration line, then 1 MiB more on stdout, then a file saying it got
# through the write; then it waits for up's SIGTERM.
WORKER = """
import sys, time
from pathlib import Path
print("worker local-1 registered with the test's coordinator", flush=True)
sys.stdout.buffer.write(b"x" * {size})
sys.stdout.buffer.flush()
Path({done!r}).write_text("written")
time.sleep(60)
"""


async def test_a_local_worker_that_writes_more_than_a_pipe_holds_after_registering_is_not_stalled(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A local worker that writes 1 MiB to its stdout after its registration line gets through that write while
    `up` runs; before, `up` stopped reading at the registration line and the worker blocked in its write."""
    done = tmp_path / "written"
    script = WORKER.format(size=WRITTEN_BYTES, done=str(done))
    monkeypatch.setattr(up, "_local_worker_argv", lambda *args, **kwargs: [sys.executable, "-c", script])
    seen: list[bool] = []

    async def until_written() -> None:  # up's wait for Ctrl-C: ends once the worker's write is through (or not)
        try:
            await until(done.exists, timeout_s=10)
        except TimeoutError:
            seen.append(False)
        else:
            seen.append(True)

    monkeypatch.setattr(up, "wait_for_signal", until_written)
    ns: Any = build_parser().parse_args(["up", "--workers", "1", "--port", "0", "--store", "memory"])
    assert await up.run_up(ns) == 0
    assert seen == [True], "the local worker was still blocked writing to its stdout"
