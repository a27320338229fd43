"""Cluster mode: several coordinators share the shards of one PostgreSQL database (docs/CLUSTER.md).

* host: a coordinator's main port and one core per shard it owns;
* sessions: client sessions on the main port that see every shard; views: their reads of the
  committed rows;
* leases: the fenced shard lease rows and the loop that keeps them;
* metrics: the main port's ``/metrics`` (leases, fenced commits, failovers).
"""
