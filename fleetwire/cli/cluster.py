"""``fleetwire cluster status``: a cluster's shards, owners, epochs and leases, read from PostgreSQL.

It reads the cluster's database directly (read-only; it creates nothing), so it works with any
coordinator up or down. Every time is judged by the database's clock, as the leases are: a
lease's ``expires in`` is ``expires_at - now()`` on the server, and ``held for`` is
``now() - acquired_at``. Open plans are counted per shard from ``fleetwire_plans``. The commit
lag is the replication lag of each standby PostgreSQL reports (``pg_stat_replication``): with a
synchronous standby, what a commit waits for.

    fleetwire cluster status --store postgresql://fleetwire@db:5432/fleetwire
    fleetwire cluster status --json          # $FLEETWIRE_STORE

Exit status: 0 (the report, whatever it says), 2 when the database cannot be reached or holds
no fleetwire cluster.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

__all__ = ["add_cluster_command", "cluster_status"]

_EXIT_USAGE = 2
_TERMINAL = ["succeeded", "failed", "cancelled"]
_LEASES = """
SELECT shard, owner, owner_url, epoch, expires_at > now() AS live,
       CASE WHEN isfinite(expires_at) THEN extract(epoch FROM expires_at - now())::float8 END AS expires_in_s,
       extract(epoch FROM now() - acquired_at)::float8 AS held_for_s
FROM shard_leases ORDER BY shard
"""
_PLANS = """
SELECT shard, count(*) AS plans, count(*) FILTER (WHERE state <> ALL($1::text[])) AS open
FROM fleetwire_plans GROUP BY shard
"""
_COORDINATORS = """
SELECT owner, url, extract(epoch FROM expires_at - now())::float8 AS expires_in_s
FROM fleetwire_coordinators WHERE expires_at > now() ORDER BY owner
"""
_STANDBYS = """
SELECT application_name, client_addr::text, state, sync_state,
       extract(epoch FROM write_lag)::float8, extract(epoch FROM flush_lag)::float8,
       extract(epoch FROM replay_lag)::float8
FROM pg_stat_replication ORDER BY application_name
"""


def add_cluster_command(sub: Any, parents: list[argparse.ArgumentParser]) -> None:
    """Register ``fleetwire cluster`` and its subcommands on ``sub`` (the top-level subparsers)."""
    p = sub.add_parser("cluster", parents=parents, help="cluster mode (PostgreSQL): shards, owners and leases",
                       description="Cluster mode tools (docs/CLUSTER.md). They read the cluster's PostgreSQL "
                                   "database directly. Exit status: 0 report, 2 unreachable or not a cluster.")
    csub = p.add_subparsers(dest="cluster_command", required=True, metavar="SUBCOMMAND")
    s = csub.add_parser("status",
                        help="shards, owners, owner URLs, epochs, lease expiry (database clock), open plans, lag")
    s.add_argument("--store", default=None, metavar="DSN",
                   help="the cluster's postgresql://USER@HOST:PORT/DB (default: $FLEETWIRE_STORE)")
    s.add_argument("--json", action="store_true", help="print the report as one JSON object")
    s.set_defaults(func=_status)


async def cluster_status(dsn: str) -> dict[str, Any]:
    """The report of the cluster whose database ``dsn`` names (raises ``ValueError`` with one line)."""
    from coordinator.io.stores.integrity import StoreError
    from coordinator.io.stores.postgres import describe_dsn

    try:
        description, where = describe_dsn(dsn)
    except StoreError as exc:
        raise ValueError(str(exc)) from None
    try:
        import asyncpg  # type: ignore[import-untyped]
    except ImportError:
        raise ValueError("cluster status needs the asyncpg driver: pip install 'fleetwire[postgres]'") from None
    try:
        conn = await asyncpg.connect(dsn, timeout=10, command_timeout=30)
    except (OSError, TimeoutError, asyncpg.PostgresError, asyncpg.InterfaceError) as exc:
        cause = " ".join(str(exc).split()) or type(exc).__name__
        if isinstance(exc, ConnectionRefusedError):
            cause = "connection refused (is PostgreSQL running and listening there?)"
        raise ValueError(f"cannot connect to PostgreSQL at {where}: {cause[:300]}") from None
    try:
        async with conn.transaction(isolation="repeatable_read", readonly=True):  # one snapshot, one clock
            if await conn.fetchval("SELECT to_regclass('fleetwire_meta') IS NULL OR "
                                   "to_regclass('shard_leases') IS NULL"):  # fmt: skip
                raise ValueError(f"the database at {description} holds no fleetwire cluster (no fleetwire_meta "
                                 "table): start a coordinator with this --store first")  # fmt: skip
            meta = {r["key"]: r["value"] for r in await conn.fetch("SELECT key, value FROM fleetwire_meta")}
            clock = await conn.fetchval("SELECT now()")
            leases = await conn.fetch(_LEASES)
            counts = {r["shard"]: (r["plans"], r["open"]) for r in await conn.fetch(_PLANS, _TERMINAL)}
            coordinators = []
            if await conn.fetchval("SELECT to_regclass('fleetwire_coordinators') IS NOT NULL"):
                coordinators = [{"owner": r["owner"], "url": r["url"], "expires_in_s": round(r["expires_in_s"], 3)}
                                for r in await conn.fetch(_COORDINATORS)]  # fmt: skip
            standbys = [{"name": r[0], "address": r[1], "state": r[2], "sync_state": r[3], "write_lag_s": r[4],
                         "flush_lag_s": r[5], "replay_lag_s": r[6]} for r in await conn.fetch(_STANDBYS)]  # fmt: skip
            in_recovery = bool(await conn.fetchval("SELECT pg_is_in_recovery()"))
    except asyncpg.PostgresError as exc:
        raise ValueError(f"cannot read the cluster at {description}: {' '.join(str(exc).split())[:300]}") from None
    finally:
        await conn.close()
    shards = []
    for r in leases:
        plans, open_plans = counts.get(r["shard"], (0, 0))
        live = bool(r["live"]) and bool(r["owner"])
        shards.append({
            "shard": r["shard"], "owner": r["owner"], "url": r["owner_url"], "epoch": r["epoch"], "live": live,
            "expires_in_s": round(r["expires_in_s"], 3) if r["expires_in_s"] is not None else None,
            "held_for_s": round(r["held_for_s"], 3) if r["held_for_s"] is not None else None,
            "open_plans": open_plans, "plans": plans,
        })  # fmt: skip
    return {
        "store": description,
        "cluster": meta.get("cluster_name", ""),
        "schema_version": int(meta.get("schema_version", "0")),
        "shard_count": int(meta.get("shards", "0")),
        "database_clock": clock.isoformat(),
        "database_in_recovery": in_recovery,
        "coordinators": coordinators,
        "shards": shards,
        "unowned": [s["shard"] for s in shards if not s["live"]],
        "open_plans": sum(s["open_plans"] for s in shards),
        "standbys": standbys,
    }


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f} s" if abs(value) < 3600 else f"{value / 3600:.1f} h"


def render(report: dict[str, Any]) -> list[str]:
    """The human-readable report."""
    lines = [
        f"cluster {report['cluster']!r} at {report['store']} (schema {report['schema_version']}, "
        f"{report['shard_count']} shards; database clock {report['database_clock']}"
        f"{', IN RECOVERY: a standby, not the primary' if report['database_in_recovery'] else ''})",
    ]
    coordinators = report["coordinators"]
    lines.append(f"coordinators: {len(coordinators)} live" + (":" if coordinators else ""))
    for c in coordinators:
        lines.append(f"  {c['owner']}  {c['url']}  (beat expires in {_seconds(c['expires_in_s'])})")
    rows = [("SHARD", "OWNER", "URL", "EPOCH", "LEASE", "HELD FOR", "OPEN PLANS", "PLANS")]
    for s in report["shards"]:
        lease = f"expires in {_seconds(s['expires_in_s'])}" if s["live"] else "free (expired)" if s["owner"] else "free"
        held = _seconds(s["held_for_s"]) if s["live"] else "-"
        rows.append((str(s["shard"]), s["owner"] or "-", s["url"] or "-", str(s["epoch"]), lease, held,
                     str(s["open_plans"]), str(s["plans"])))  # fmt: skip
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines += ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in rows]
    unowned = report["unowned"]
    lines.append(f"{len(report['shards']) - len(unowned)} of {len(report['shards'])} shards owned"
                 + (f"; NO OWNER: {', '.join(map(str, unowned))}" if unowned else "")
                 + f"; {report['open_plans']} open plans")  # fmt: skip
    if report["standbys"]:
        lines.append("standbys (commit lag, pg_stat_replication):")
        for b in report["standbys"]:
            lines.append(f"  {b['name'] or '?'} {b['address'] or 'local'} {b['state']} {b['sync_state']}: write "
                         f"{_seconds(b['write_lag_s'])}, flush {_seconds(b['flush_lag_s'])}, replay "
                         f"{_seconds(b['replay_lag_s'])}")  # fmt: skip
    else:
        lines.append("standbys: none connected (no synchronous standby: a database failover may lose commits)")
    return lines


async def _status(ns: argparse.Namespace) -> int:
    dsn = ns.store or os.environ.get("FLEETWIRE_STORE") or ""
    if not dsn.startswith(("postgresql://", "postgres://")):
        print("fleetwire: error: cluster status needs --store postgresql://USER@HOST:PORT/DB (or $FLEETWIRE_STORE)"
              + (f", got {dsn.split('://', 1)[0]!r}" if dsn else ""), file=sys.stderr)  # fmt: skip
        return _EXIT_USAGE
    try:
        report = await cluster_status(dsn)
    except ValueError as exc:
        print(f"fleetwire: error: {exc}", file=sys.stderr)
        return _EXIT_USAGE
    print(json.dumps(report) if ns.json else "\n".join(render(report)))
    return 0
