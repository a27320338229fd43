"""The coordinator's I/O layer: everything that touches sockets, files, threads or the clock.

The pure core (``coordinator/`` outside this folder) decides; the modules here drive it: the
websocket server and its per-connection writers (server, connection), admission before the
upgrade (gate), the store and its group-commit writer (store, commit), the HTTP routes and the
dashboard (http, dashboard/), the operator's hook command (hooks) and the Prometheus exposition
(metrics). tests/unit/test_layers.py keeps the boundary.
"""
