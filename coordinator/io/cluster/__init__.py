"""Cluster mode: several coordinators share the shards of one PostgreSQL database (docs/CLUSTER.md).

* host: a coordinator's shards, one core per shard it owns, and the rounds that decide them; cores: those cores'
  starts and stops; teardown: the bounded ends of the host's stop; mainport: its main port's routes and
  per-session router (a view session, or ``moved`` to a shard's owner) on the front door;
* sessions: the driver of the client sessions on the main port that see every shard (their
  decisions: coordinator/views.py); views: their reads of the committed rows; doorbell: the
  commits' NOTIFY that wakes them;
* leases: the fenced shard lease rows and the loop that keeps them;
* metrics: the main port's ``/metrics`` (leases, fenced commits, failovers).
"""
