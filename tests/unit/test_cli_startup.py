"""What a CLI command imports before it runs: a client command does not pay for the worker agent.

Each command is a fresh process (the e2e tests start hundreds), so its imports are its start-up
time: building ``fleetwire worker``'s flags imported the whole worker agent (httpx, psutil,
prometheus_client: about a third of a client command's CPU) for every command.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

PROBE = """
import contextlib, io, sys
from fleetwire.cli import main
out = io.StringIO()
with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):
    main(sys.argv[1:])
print("worker_agent" in sys.modules, "--max-concurrency" in out.getvalue())
"""


def _probe(*argv: str) -> str:
    done = subprocess.run([sys.executable, "-c", PROBE, *argv], cwd=ROOT, capture_output=True, text=True,
                          timeout=60, check=True)  # fmt: skip
    return done.stdout.split("\n")[-2]


def test_a_client_command_does_not_import_the_worker_agent() -> None:
    """`fleetwire status --help` parses and prints without importing worker_agent."""
    assert _probe("status", "--help") == "False False"


def test_the_worker_command_still_has_its_flags() -> None:
    """`fleetwire worker --help` lists the worker's own flags (it imports the agent to build them)."""
    assert _probe("worker", "--help") == "True True"
