"""The front door: where a peer's connection comes in, and the driver that feeds the core its frames.

* door: the routes and admission of a listening port and the sessions it holds, the same for a
  core's port and a cluster's main port (each a ``Port``: its plain paths, its session handlers);
* reader: the per-connection frame loop and the ``SessionHandler`` protocol it drives (the read
  decisions are the pure coordinator/read_policy.py);
* core_driver: the core's sessions (``CoreSession``) and its effects out: committer, writers, replays;
* server: ``CoordinatorServer``, the wiring of one core's port; settings: ``ServerSettings``;
* connection: the websocket connection class and each session's writer;
* gate, admission: what is checked before the upgrade (TLS, the bearer token, the penalty box,
  the pending-handshake budget, the fd limit, held repeated refusals);
* routes: plain HTTP on a core's port (health, readiness, metrics, the dashboard's files).
"""
