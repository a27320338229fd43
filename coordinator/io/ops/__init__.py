"""What operators watch and what acts on the fleet for them (docs/OPERATIONS.md).

* metrics: Prometheus metrics, read from the core's state at scrape time;
* metrics_http: what ``/metrics`` costs and who may read it (a cached exposition, an optional
  token, ``--metrics-listen``);
* provision: the autoscaler's providers, which start and stop workers;
* hooks: the operator's commands, run detached.
"""
