"""The coordinator's I/O layer: everything that touches sockets, files, threads or the clock.

The pure core (``coordinator/`` outside this folder) decides; the packages here drive it, one
folder per subsystem:

===========  ==========================================================================
frontdoor/   where peers come in, one front door for every port (door: routes,
             admission, sessions; reader: each session's frame loop), the core's
             driver (core_driver) and its port's wiring (server, settings), each
             websocket's writer (connection), admission before the upgrade (gate,
             admission) and the plain-HTTP routes (routes)
stores/      where plans are kept: the Store interface with memory (store) and the
             abilities a store declares (abilities), SQLite (sqlite, schema),
             PostgreSQL (postgres, pg_schema), rows read back (rows), damage
             (integrity), group commit (commit, pg_commit, backlog), maintenance (admin)
cluster/     cluster mode: a coordinator's shards (host) and its main port's routes and
             router (mainport), client sessions across shards (sessions) and their
             reads (views, doorbell), shard leases (leases), metrics
ops/         for operators: Prometheus metrics (metrics) and their listener
             (metrics_http), autoscaler providers (provision), hook commands (hooks)
dashboard/   the dashboard page's files and their loader (assets)
===========  ==========================================================================

tests/unit/test_layers.py keeps the boundary.
"""
