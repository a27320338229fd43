"""The coordinator's I/O layer: everything that touches sockets, files, threads or the clock.

The pure core (``coordinator/`` outside this folder) decides; the packages here drive it, one
folder per subsystem:

===========  ==========================================================================
frontdoor/   where peers come in: the server that drives the core (server), each
             websocket's writer (connection), admission before the upgrade (gate,
             admission) and the plain-HTTP routes (routes)
stores/      where plans are kept: the Store interface with memory and SQLite (store),
             PostgreSQL (postgres), tables (schema), rows read back (rows), damage
             (integrity), group commit (commit, pg_commit, backlog), maintenance (admin)
cluster/     cluster mode: the main port and its shards (host), client sessions across
             shards (sessions) and their reads (views), shard leases (leases), metrics
ops/         for operators: Prometheus metrics (metrics) and their listener
             (metrics_http), autoscaler providers (provision), hook commands (hooks)
dashboard/   the dashboard page's files and their loader (assets)
===========  ==========================================================================

tests/unit/test_layers.py keeps the boundary.
"""
