"""Issue #15 (operator experience) against a real coordinator and agent on loopback sockets:
no secrets in log lines, a clean stop counted as left, URL schemes, tokens by role."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from coordinator.io.frontdoor.server import CoordinatorServer, ServerSettings
from fleetwire import Client
from fleetwire.connection import resolve_url
from fleetwire.errors import FleetwireConnectionError
from worker_agent import Agent

WORKER_TOKEN = "worker-token-0123456789"
CLIENT_TOKEN = "client-token-0123456789"
ADMIN_TOKEN = "admin-token-0123456789"
SECRET = "sk-live-SECRET-7f3a9c"  # plan args, events and results carry it; no log line may
ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(30)


@pytest.fixture
async def server() -> AsyncIterator[CoordinatorServer]:
    """A real coordinator on a free loopback port, with a worker, a client and an admin token."""
    srv = CoordinatorServer(ServerSettings(port=0, worker_tokens=(WORKER_TOKEN,), client_tokens=(CLIENT_TOKEN,),
                                           admin_tokens=(ADMIN_TOKEN,), store="memory"))  # fmt: skip
    await srv.start()
    yield srv
    await srv.stop()


def _logs_of_a_leaky_run(fmt: str) -> str:
    """stdout+stderr of tests/integration/leaky_logs.py: a coordinator and agent in one process, logging in ``fmt``."""
    done = subprocess.run(
        [sys.executable, "-m", "tests.integration.leaky_logs", fmt, SECRET],
        capture_output=True, text=True, cwd=ROOT, timeout=60,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout + done.stderr


@pytest.mark.parametrize("fmt", ["json", "console"])
def test_no_log_line_carries_plan_args_events_or_results(fmt: str) -> None:
    """--log-format json/console at debug: 'handler raised' has a traceback without locals; the secret is nowhere."""
    logged = _logs_of_a_leaky_run(fmt)
    assert SECRET not in logged
    assert "handler raised" in logged and "RuntimeError" in logged
    assert "Traceback" in logged  # the traceback is there, as plain text
    if fmt == "json":
        lines = [json.loads(line) for line in logged.splitlines() if line.startswith("{")]
        raised = [line for line in lines if line["event"] == "handler raised"]
        assert raised and all("locals" not in json.dumps(line) for line in raised)


def test_agent_as_a_library_logs_no_locals() -> None:
    """With structlog's own defaults (rich tracebacks with locals), the agent's lines still omit the secret."""
    logged = _logs_of_a_leaky_run("default")
    assert "handler raised" in logged
    assert SECRET not in logged


async def test_goodbye_is_counted_as_left_not_reaped(server: CoordinatorServer) -> None:
    """A worker stopped cleanly is gone from the registry at once; workers_left counts it, workers_reaped does not."""
    agent = Agent(server.url, WORKER_TOKEN, worker_id="w1")
    task = asyncio.create_task(agent.run())
    await asyncio.wait_for(agent.registered.wait(), 5)
    assert "w1" in server.core.registry
    agent.stop()
    await asyncio.wait_for(task, 10)  # its close completes after the coordinator read (and applied) the goodbye
    assert "w1" not in server.core.registry
    assert server.core.counters["workers_left"] == 1
    assert server.core.counters["workers_reaped"] == 0


async def test_admin_token_watches_and_cancels_anyones_plan(server: CoordinatorServer) -> None:
    """A plan submitted with the client token can be watched and cancelled with the admin token."""
    async with Client(server.url, token=CLIENT_TOKEN) as client, Client(server.url, token=ADMIN_TOKEN) as admin:
        plan = await client.submit("nobody-runs-this")
        watched = await admin.watch(plan.id)
        assert watched.id == plan.id
        info = await admin.cancel(plan.id)
        assert info.state == "cancelled"


def test_http_scheme_means_ws_and_no_scheme_is_refused() -> None:
    """http(s):// (the dashboard's address) resolves to ws(s)://; host:port and ftp:// are refused with a hint."""
    assert resolve_url("http://h:1") == "ws://h:1/v1/client"
    assert resolve_url("https://h:1/") == "wss://h:1/v1/client"
    assert resolve_url("WSS://h:1/x") == "wss://h:1/x"
    with pytest.raises(ValueError, match=r"has no scheme: write ws://h:1 \(plain\) or wss://h:1 \(TLS\)"):
        resolve_url("h:1")
    with pytest.raises(ValueError, match="scheme ftp://"):
        resolve_url("ftp://h:1")


async def test_wss_against_a_plain_coordinator_says_it_does_not_serve_tls(server: CoordinatorServer) -> None:
    """Dialling wss:// at a plain coordinator fails with 'this coordinator does not serve TLS', not an empty reason."""
    url = server.url.replace("ws://", "wss://")
    with pytest.raises(FleetwireConnectionError, match="this coordinator does not serve TLS"):
        async with Client(url, token=CLIENT_TOKEN, reconnect=False):
            pass


@pytest.mark.parametrize(
    ("url", "said"),
    [("127.0.0.1:9", "has no scheme"), ("ftp://127.0.0.1:9", "scheme ftp://"), ("ws://", "has no host")],
)
def test_cli_bad_url_is_one_line_and_exit_2(url: str, said: str) -> None:
    """`fleetwire workers --url BAD`: one line on stderr naming the problem, exit 2, no traceback."""
    done = subprocess.run(
        [sys.executable, "-m", "fleetwire", "workers", "--url", url, "--token", CLIENT_TOKEN],
        capture_output=True, text=True, cwd=ROOT, timeout=20,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert said in done.stderr and "Traceback" not in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1
