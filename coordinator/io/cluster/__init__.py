"""Cluster mode: several coordinators share the shards of one PostgreSQL database (docs/CLUSTER.md).

* host: a coordinator's main port and one core per shard it owns;
* sessions: the driver of the client sessions on the main port that see every shard (their
  decisions: coordinator/views.py); views: their reads of the committed rows; doorbell: the
  commits' NOTIFY that wakes them;
* leases: the fenced shard lease rows and the loop that keeps them;
* metrics: the main port's ``/metrics`` (leases, fenced commits, failovers).
"""
