"""``fleetwire cluster status`` and the cluster metrics against a real PostgreSQL (tests/pg.py; skipped without)."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import urllib.request
from concurrent.futures import ThreadPoolExecutor

from coordinator.io.cluster.host import ClusterHost
from coordinator.io.cluster.leases import ACQUIRE
from coordinator.io.frontdoor.server import ServerSettings
from coordinator.io.stores.postgres import PgStore
from coordinator.records import PlanCreated, PlanStatus
from coordinator.shards import ClusterConfig, pool_shard
from fleetwire.cli.cluster import cluster_status, render
from protocol.messages import Requirements, Submit

CLUSTER = ClusterConfig(shards=4, lease_ttl_s=30.0, lease_renew_s=1.0)


def status(*args: str) -> subprocess.CompletedProcess[str]:
    """``fleetwire cluster status ARGS`` as a user runs it."""
    return subprocess.run([sys.executable, "-m", "fleetwire", "cluster", "status", *args], capture_output=True,
                          text=True, timeout=60, check=False)  # fmt: skip


def side_by_side(*commands: tuple[str, ...]) -> list[subprocess.CompletedProcess[str]]:
    """Several `fleetwire cluster status` commands run at once (each is mostly its interpreter's start)."""
    with ThreadPoolExecutor(len(commands)) as pool:
        return list(pool.map(lambda args: status(*args), commands))


def pool_on(shard: int) -> str:
    """A pool name whose plans live on ``shard``."""
    return next(f"p{i}" for i in range(1000) if pool_shard(f"p{i}", CLUSTER.shards) == shard)


def created(plan_id: str, shard: int) -> PlanCreated:
    submit = Submit(req_id=1, op="echo", plan_id=plan_id, requirements=Requirements(tags=[f"pool:{pool_on(shard)}"]))
    return PlanCreated(plan_id, "alice", 1, submit)


def seeded(dsn: str) -> None:
    """Shards 0 and 1 held by 'coord-a' (epoch 1); shard 1 has two open plans and one that ended; 2, 3 free."""
    store = PgStore(dsn, CLUSTER)
    try:
        rows = store.execute(lambda c: c.fetch(ACQUIRE, "coord-a", "ws://a:8765", 30.0, [0, 1]))
        store.owner, store.fence = "coord-a", {r[0]: r[1] for r in rows}
        store.write([created("open-1", 1), created("open-2", 1), created("done", 1),
                     PlanStatus("done", "succeeded", attempt=1, next_seq=2)])  # fmt: skip
    finally:
        store.close()


async def test_the_report_reads_owners_epochs_leases_and_open_plans_by_the_database_clock(pg_dsn: str) -> None:
    """Owned shards show owner, URL, epoch, time to expiry and held-for (DB clock); free ones are named unowned."""
    await asyncio.to_thread(seeded, pg_dsn)
    report = await cluster_status(pg_dsn)
    assert report["cluster"] == "fleetwire" and report["shard_count"] == 4 and report["schema_version"] >= 1
    by_shard = {s["shard"]: s for s in report["shards"]}
    assert by_shard[0]["owner"] == "coord-a" and by_shard[0]["url"] == "ws://a:8765" and by_shard[0]["epoch"] == 1
    assert by_shard[0]["live"] and 0 < by_shard[0]["expires_in_s"] <= 30 and by_shard[0]["held_for_s"] >= 0
    assert (by_shard[1]["open_plans"], by_shard[1]["plans"]) == (2, 3) and by_shard[0]["open_plans"] == 0
    assert report["unowned"] == [2, 3] and not by_shard[2]["live"] and by_shard[2]["expires_in_s"] is None
    assert report["open_plans"] == 2 and report["standbys"] == []
    text = "\n".join(render(report))
    assert "coord-a" in text and "NO OWNER: 2, 3" in text and "2 of 4 shards owned" in text


def test_the_command_prints_json_and_text(pg_dsn: str) -> None:
    """`fleetwire cluster status --store DSN [--json]` exits 0 with the report."""
    seeded(pg_dsn)
    as_json, as_text = side_by_side(("--store", pg_dsn, "--json"), ("--store", pg_dsn))
    assert as_json.returncode == 0, as_json.stderr
    report = json.loads(as_json.stdout)
    assert [s["owner"] for s in report["shards"]] == ["coord-a", "coord-a", "", ""]
    assert as_text.returncode == 0 and "ws://a:8765" in as_text.stdout and "NO OWNER: 2, 3" in as_text.stdout


def test_a_database_without_a_cluster_and_an_unreachable_one_exit_2(pg_dsn: str) -> None:
    """No fleetwire tables, or nothing listening: one line naming the database or host, exit 2."""
    empty, unreachable, sqlite = side_by_side(("--store", pg_dsn), ("--store", "postgresql://nobody@127.0.0.1:1/x"),
                                              ("--store", "sqlite"))  # fmt: skip
    assert empty.returncode == 2 and "holds no fleetwire cluster" in empty.stderr
    assert unreachable.returncode == 2 and "cannot connect to PostgreSQL at 127.0.0.1:1" in unreachable.stderr
    assert sqlite.returncode == 2 and "needs --store postgresql://" in sqlite.stderr


def _scrape(url: str) -> dict[str, float]:
    with urllib.request.urlopen(url.replace("ws://", "http://") + "/metrics", timeout=10) as answer:
        text = answer.read().decode()
    values: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            values[name] = float(value)
    return values


async def test_the_main_port_serves_the_cluster_metrics(pg_dsn: str) -> None:
    """A cluster coordinator's /metrics counts its lease acquisitions, shards owned and takeovers."""
    serving: list[str] = []
    all_served = asyncio.Event()

    def announce(line: str) -> None:  # one line per shard whose core serves
        if line.startswith("serving shard"):
            serving.append(line)
            if len(serving) == CLUSTER.shards:
                all_served.set()

    host = ClusterHost(ServerSettings(port=0, insecure=True, store=pg_dsn, cluster=CLUSTER), announce=announce)
    await host.start()
    try:
        await asyncio.wait_for(all_served.wait(), 30)
        values = await asyncio.to_thread(_scrape, host.url)
    finally:
        await host.stop()
    assert values["fleetwire_shard_lease_acquisitions_total"] == CLUSTER.shards
    assert values["fleetwire_shards_owned"] == CLUSTER.shards
    assert values["fleetwire_failovers_total"] == 0 and values["fleetwire_fenced_commits_total"] == 0
    assert values["fleetwire_takeover_seconds_count"] == CLUSTER.shards
