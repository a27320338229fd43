"""Idle token-less sockets against a real coordinator process with a small open-file limit (issue 17, finding 6)."""

from __future__ import annotations

import asyncio
import sys

import pytest

from fleetwire import Client
from tests.e2e.conftest import ROOT, Cluster, Proc

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]

FD_LIMIT = 200  # soft and hard: the coordinator cannot raise it


async def coordinator_with_fd_limit(cluster: Cluster, *extra: str) -> Proc:
    """``fleetwire coordinator --insecure`` in a process whose RLIMIT_NOFILE is FD_LIMIT (soft = hard)."""
    code = (
        "import resource, runpy, sys; "
        f"resource.setrlimit(resource.RLIMIT_NOFILE, ({FD_LIMIT}, {FD_LIMIT})); "
        "sys.argv = ['fleetwire', *sys.argv[1:]]; runpy.run_module('fleetwire', run_name='__main__')"
    )
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", code, "coordinator", "--insecure", "--port", "0", "--store", "memory", *extra,
        stdout=asyncio.subprocess.PIPE, stderr=None, env=cluster.env(), cwd=ROOT,
    )
    p = Proc(proc, "coordinator")
    cluster.procs.append(p)
    cluster.url = (await p.wait_for_line(r"listening on (ws://\S+)")).group(1)
    return p


async def test_idle_sockets_past_the_fd_limit_do_not_starve_legitimate_connects(cluster: Cluster) -> None:
    """300 idle TCP connections against a coordinator limited to 200 fds: 40 real clients still connect."""
    await coordinator_with_fd_limit(cluster)
    host, port = cluster.url.removeprefix("ws://").rsplit(":", 1)
    idle = [await asyncio.open_connection(host, int(port)) for _ in range(300)]
    try:
        failures = []
        for i in range(40):
            try:
                async with Client(cluster.url, open_timeout_s=5.0) as client:
                    await client.workers()
            except Exception as exc:  # what a refused or timed-out connect raises; counted, not raised
                failures.append(f"{i}: {type(exc).__name__}: {exc}")
        assert not failures, failures
    finally:
        for _, writer in idle:
            writer.close()
