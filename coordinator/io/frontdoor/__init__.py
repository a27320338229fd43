"""The front door: where a peer's connection comes in, and the driver that feeds the core its frames.

* server: ``CoordinatorServer``, the asyncio driver around the sans-I/O ``Coordinator`` core;
* connection: the websocket connection class and each session's writer;
* gate, admission: what is checked before the upgrade (TLS, the bearer token, the penalty box,
  the pending-handshake budget, the fd limit, held repeated refusals);
* routes: plain HTTP on the same port (health, readiness, metrics, the dashboard's files).
"""
