"""What a CLI command imports before it runs: a command does not pay for what it does not use.

Each command is a fresh process (the e2e tests start hundreds), so its imports are its start-up
time: building ``fleetwire worker``'s flags imported the whole worker agent (httpx, psutil,
prometheus_client: about a third of a client command's CPU) for every command; structlog imported
rich and greenlet, and httpx its own command-line client (click, pygments, rich), in every process
(fleetwire/cli/lean.py); rich's tables and progress bars, difflib and the package version were
imported by commands that print none of them.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# Modules no command imports just to start: each is imported where it is used, or not at all.
DEFERRED = ("rich", "greenlet", "click", "pygments", "difflib")

PROBE = """
import contextlib, io, json, sys
from fleetwire.cli import main
out = io.StringIO()
with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):
    main(sys.argv[1:])
loaded = sorted(name for name in sys.modules
                if name.split(".")[0] in {deferred!r} or name in ("worker_agent", "fleetwire.client"))
print(json.dumps({{"loaded": loaded, "out": out.getvalue()}}))
"""


def _probe(*argv: str) -> tuple[set[str], str]:
    done = subprocess.run([sys.executable, "-c", PROBE.format(deferred=set(DEFERRED)), *argv], cwd=ROOT,
                          capture_output=True, text=True, timeout=60, check=True)  # fmt: skip
    result = json.loads(done.stdout.split("\n")[-2])
    return {name if name.startswith("fleetwire") else name.split(".")[0] for name in result["loaded"]}, result["out"]


def test_a_client_command_does_not_import_the_worker_agent() -> None:
    """`fleetwire status --help` parses and prints without importing worker_agent."""
    loaded, out = _probe("status", "--help")
    assert "worker_agent" not in loaded
    assert "--max-concurrency" not in out


def test_the_worker_command_still_has_its_flags() -> None:
    """`fleetwire worker --help` lists the worker's own flags (it imports the agent to build them)."""
    loaded, out = _probe("worker", "--help")
    assert "worker_agent" in loaded
    assert "--max-concurrency" in out


def test_a_command_starts_without_rich_greenlet_or_difflib() -> None:
    """`fleetwire submit --help` imports structlog (logging) but not rich, greenlet, click, pygments or difflib."""
    loaded, out = _probe("submit", "--help")
    assert "usage: fleetwire submit" in out
    assert loaded == set()


def test_the_worker_imports_the_agent_without_httpx_clients() -> None:
    """`fleetwire worker --help` imports the agent but not click, pygments or rich."""
    loaded, _ = _probe("worker", "--help")
    assert loaded == {"worker_agent"}


def test_a_worker_without_an_engine_imports_neither_httpx_nor_the_metrics_parser() -> None:
    """The agent imports httpx and prometheus_client's parser only when an inference engine is used."""
    code = (
        "import sys, worker_agent.main, worker_agent.inference as i; "
        "print(sorted(m for m in ('httpx', 'prometheus_client.parser') if m in sys.modules)); "
        "i.parse_engine_metrics('vllm:num_requests_running 2\\n'); "
        "e = i.InferenceEngine('http://127.0.0.1:9'); e._http(); "
        "print(sorted(m for m in ('httpx', 'prometheus_client.parser') if m in sys.modules))"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60,
                          check=True)  # fmt: skip
    assert done.stdout.split("\n")[:2] == ["[]", "['httpx', 'prometheus_client.parser']"]


def test_the_daemons_do_not_import_the_client() -> None:
    """`fleetwire coordinator --help` and `fleetwire worker --help` parse without the SDK's client."""
    assert _probe("coordinator", "--help")[0] == set()
    assert "fleetwire.client" not in _probe("worker", "--help")[0]


def test_the_package_still_exports_the_client() -> None:
    """`from fleetwire import Client, SyncClient` works (the package imports them on first use)."""
    done = subprocess.run([sys.executable, "-c", "import sys, fleetwire; a = 'fleetwire.client' in sys.modules;"
                           "from fleetwire import Client, Plan, SyncClient, SyncPlan; print(a, Client.__name__,"
                           "fleetwire.Plan is Plan, 'SyncPlan' in dir(fleetwire))"],
                          cwd=ROOT, capture_output=True, text=True, timeout=60, check=True)  # fmt: skip
    assert done.stdout.split() == ["False", "Client", "True", "True"]


def test_version_is_looked_up_when_asked() -> None:
    """`fleetwire --version` still prints the installed version (looked up only for that flag)."""
    from fleetwire.cli.serve import version

    _, out = _probe("--version")
    assert out == f"fleetwire {version()}\n"


def test_rich_still_renders_after_structlog_was_imported_without_it() -> None:
    """Once logging is set up without rich, a command's table still renders through rich."""
    code = ("from fleetwire.cli.logs import configure_logging; configure_logging('json');"
            "from fleetwire.cli.console import escape, make_console, plans_table; import io;"
            "buf = io.StringIO(); make_console(buf).print(plans_table([]));"
            "print(escape('[x]'), 'ID' in buf.getvalue())")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60,
                          check=True)  # fmt: skip
    assert done.stdout.split() == ["\\[x]", "True"]
