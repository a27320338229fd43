"""tests/integration/bench_run.py: a bench past its time is killed with everything it started, and says so."""

from __future__ import annotations

import contextlib
from pathlib import Path

from tests.integration.bench_run import KILLED, run_bench
from tests.waiting import until


def _gone(pid: int) -> bool:
    """No such process, or only its zombie (reaped by whoever adopted it)."""
    with contextlib.suppress(OSError):
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    return True


async def test_a_bench_past_its_time_is_killed_with_its_children_and_named(tmp_path: Path) -> None:
    """A script that starts a child and hangs: killed at the timeout with the child, its exit status and a line
    naming the timeout returned (no TimeoutError escapes, no process is left behind)."""
    pid_file = tmp_path / "child.pid"
    script = tmp_path / "hang.py"
    script.write_text(
        "import subprocess, sys, time\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'])\n"
        f"open({str(pid_file)!r}, 'w').write(str(child.pid))\n"
        "print('started', flush=True)\n"
        "time.sleep(120)\n"
    )
    rc, _out, err = await run_bench(script, [], timeout_s=5.0)
    assert rc == KILLED and "hang.py gave no result within" in err, (rc, err)
    child = int(pid_file.read_text())
    await until(lambda: _gone(child), timeout_s=10)


async def test_a_bench_that_ends_gives_its_output_and_status(tmp_path: Path) -> None:
    """A script that prints and exits 3 within its time: both come back as they were."""
    script = tmp_path / "ends.py"
    script.write_text("import sys\nprint('{\"ok\": 1}')\nprint('why', file=sys.stderr)\nsys.exit(3)\n")
    assert await run_bench(script, ["--json"], timeout_s=60) == (3, '{"ok": 1}\n', "why\n")
