"""Idle sockets at ``--metrics-listen`` of a real coordinator process with a small open-file limit (issue 24 part 5).

The probe's finding: 1,100 idle token-less sockets at ``--metrics-listen`` broke 14 of 47 round
trips on the *main* port, because both listeners share the process's file descriptors. Here the
same at a smaller scale: a coordinator limited to 200 fds, 300 idle sockets at its metrics port.
"""

from __future__ import annotations

import asyncio
import socket

import pytest

from fleetwire import Client
from tests.e2e.conftest import Cluster
from tests.e2e.test_fairness import coordinator_with_fd_limit

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.parametrize("defer_accept", ["0", "10"], ids=["accepted-at-once", "deferred"])
async def test_idle_sockets_at_metrics_listen_do_not_starve_the_main_port(cluster: Cluster, defer_accept: str) -> None:
    """300 idle TCP connections at --metrics-listen of a coordinator limited to 200 fds: 40 real round trips
    on the main port all succeed, and a scrape is still served."""
    metrics_port = free_port()
    await coordinator_with_fd_limit(cluster, "--metrics-listen", f"127.0.0.1:{metrics_port}",
                                    "--defer-accept", defer_accept)  # fmt: skip
    idle = [await asyncio.open_connection("127.0.0.1", metrics_port) for _ in range(300)]
    try:
        failures = []
        for i in range(40):
            try:
                async with Client(cluster.url, open_timeout_s=5.0) as client:
                    await client.workers()
            except Exception as exc:  # what a refused or timed-out connect raises; counted, not raised
                failures.append(f"{i}: {type(exc).__name__}: {exc}")
        assert not failures, failures
        reader, writer = await asyncio.open_connection("127.0.0.1", metrics_port)
        writer.write(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
        assert (await asyncio.wait_for(reader.read(), 10)).startswith(b"HTTP/1.1 200 OK")
        writer.close()
    finally:
        for _, writer in idle:
            writer.close()
