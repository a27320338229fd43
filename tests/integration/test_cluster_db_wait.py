"""A cluster coordinator started while PostgreSQL is unreachable waits for it (issue #25 part 3).

It used to exit 2, which the shipped systemd unit never restarts. Now it listens, answers
``/readyz`` 503 "waiting for the database" and new sessions 503 + Retry-After, retries with a
backoff, and joins the cluster once the database answers; a database that answers but refuses
it (another cluster's) still ends it with status 2.
"""

from __future__ import annotations

import asyncio
import re
import signal
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from coordinator.io.cluster.host import ClusterHost
from coordinator.io.frontdoor.server import ServerSettings
from coordinator.shards import ClusterConfig
from fleetwire import Client
from tests.pg import PostgresServer, missing_reason, postgres_server, scratch_dir
from tests.waiting import until

pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).resolve().parents[2]
CLUSTER = ClusterConfig(shards=2, lease_ttl_s=5.0, lease_renew_s=0.3)


@pytest.fixture
def own_pg() -> Iterator[PostgresServer]:
    """A PostgreSQL server of this test's own (it is stopped and started again)."""
    reason = missing_reason()
    if reason is not None:
        pytest.skip(reason)
    with postgres_server(parent=scratch_dir()) as server:
        yield server


def get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def dead_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def test_a_host_started_without_its_database_waits_then_serves(own_pg: PostgresServer) -> None:
    """PostgreSQL down at start: start() returns, /readyz 503 'waiting for the database', sessions 503 +
    Retry-After; once it is back the host serves every shard and /readyz says ready."""
    dsn = own_pg.new_database()
    await asyncio.to_thread(own_pg.pause)
    host = ClusterHost(ServerSettings(port=0, insecure=True, store=dsn, cluster=CLUSTER))
    await host.start()
    try:
        http = host.url.replace("ws://", "http://")
        status, body = await asyncio.to_thread(get, f"{http}/readyz")
        assert status == 503 and "waiting for the database" in body and "cannot connect to PostgreSQL" in body
        with pytest.raises(Exception, match="HTTP 503") as refused:
            async with Client(host.url, reconnect=False, open_timeout_s=5):
                pass
        assert getattr(refused.value, "retry_after_s", None) == 1.0
        await asyncio.to_thread(own_pg.resume)
        await until(lambda: len(host.servers) == CLUSTER.shards, timeout_s=60)
        status, body = await asyncio.to_thread(get, f"{http}/readyz")
        assert (status, body) == (200, "ready\n")
        async with Client([host.url], reconnect_base_s=0.05, reconnect_cap_s=0.3) as client:
            plan = await client.submit("echo", {"n": 1}, plan_id="after-the-wait")
            assert plan.id == "after-the-wait"
    finally:
        await host.stop()


def test_fleetwire_coordinator_without_its_database_keeps_waiting_instead_of_exiting_2() -> None:
    """`fleetwire coordinator --store postgresql://<nothing there>` listens and waits (it exited 2); SIGTERM: 0."""
    store = f"postgresql://fleetwire@127.0.0.1:{dead_port()}/fleetwire"
    proc = subprocess.Popen(
        [sys.executable, "-m", "fleetwire", "coordinator", "--insecure", "--port", "0", "--store", store,
         "--log-format", "json"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    seen: list[str] = []  # its stderr lines up to the first failed retry's
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        m = re.search(r"listening on ws://(\S+)", line)
        assert m, (line, proc.poll())
        status, body = get(f"http://{m.group(1)}/readyz")
        assert status == 503 and "waiting for the database" in body
        assert proc.stderr is not None
        for line in proc.stderr:  # its first retry failed too (0.5-1 s after the start): logged, not exited
            seen.append(line)
            if "still waiting for the cluster's database" in line:
                break
        assert seen and "still waiting for the cluster's database" in seen[-1], (proc.poll(), seen)
        assert proc.poll() is None, (proc.returncode, seen)
    finally:
        proc.send_signal(signal.SIGTERM)
        _, rest = proc.communicate(timeout=30)
    err = "".join(seen) + rest
    assert proc.returncode == 0, err
    assert "waiting for it" in err


async def test_a_database_of_another_cluster_still_ends_it_with_status_2(own_pg: PostgresServer) -> None:
    """Reached after the wait but owned by another cluster: a configuration error, exit 2 with one line."""
    dsn = own_pg.new_database()
    other = ClusterHost(ServerSettings(port=0, insecure=True, store=dsn, cluster=ClusterConfig(name="other")))
    other.control.close()  # type: ignore[union-attr]  # the database now belongs to cluster "other"
    await asyncio.to_thread(own_pg.pause)
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "fleetwire", "coordinator", "--insecure", "--port", "0", "--store", dsn,
        "--log-format", "json", cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        assert b"listening on" in await asyncio.wait_for(proc.stdout.readline(), 30)
        await asyncio.to_thread(own_pg.resume)
        _, err = await asyncio.wait_for(proc.communicate(), 60)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    assert proc.returncode == 2 and "belongs to cluster 'other'" in err.decode()
