"""Cluster mode's metrics: shard leases, fenced commits, failovers and takeover time (docs/CLUSTER.md).

A cluster coordinator (coordinator/io/cluster/host.py) keeps a :class:`ClusterStats` of plain
integers and a :class:`~coordinator.stats.Histogram`, updated where leases are won and shards
start or stop, never per message. Its main port's ``/metrics`` renders them with
:func:`render`, read at scrape time like coordinator/io/ops/metrics.py does for one core (each
shard's core keeps its own ``/metrics`` on its own port).

Families (docs/OPERATIONS.md §Metrics; :data:`CLUSTER_METRIC_NAMES`):

* ``fleetwire_shard_lease_acquisitions_total``: shard leases this coordinator won (a slot that
  was free or expired became its own; renewals are not counted).
* ``fleetwire_fenced_commits_total``: group commits the database refused because the shard's
  lease was no longer this coordinator's at its epoch (each one stops that shard's core).
* ``fleetwire_failovers_total``: shards this coordinator took over from another one (the slot
  had an owner before: it died, stalled past its lease, or handed the slot over).
* ``fleetwire_takeover_seconds``: histogram, from winning a shard's lease to serving it (its
  plans loaded, its core listening and published in the topology).
* ``fleetwire_shards_owned``: shards this coordinator serves now.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Final

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.process_collector import ProcessCollector

from coordinator.stats import Histogram

__all__ = ["CLUSTER_METRIC_NAMES", "CONTENT_TYPE", "TAKEOVER_BUCKETS_S", "ClusterCollector", "ClusterStats",
           "build_registry", "render"]

CONTENT_TYPE: Final = CONTENT_TYPE_LATEST

TAKEOVER_BUCKETS_S: Final = (0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 3.0, 5.0, 10.0, 30.0, 60.0)

CLUSTER_METRIC_NAMES: Final = (
    "fleetwire_shard_lease_acquisitions",
    "fleetwire_fenced_commits",
    "fleetwire_failovers",
    "fleetwire_takeover_seconds",
    "fleetwire_shards_owned",
)
"""The families :class:`ClusterCollector` yields (counters without their ``_total`` suffix)."""


class ClusterStats:
    """What a cluster coordinator counts for ``/metrics`` (plain numbers; the host updates them)."""

    __slots__ = ("acquisitions", "failovers", "fenced_commits", "takeover")

    def __init__(self) -> None:
        self.acquisitions = 0
        self.fenced_commits = 0
        self.failovers = 0
        self.takeover = Histogram(TAKEOVER_BUCKETS_S)

    def won(self, epochs: Iterable[int]) -> None:
        """Leases won at these epochs; an epoch above 1 means the slot had another owner before."""
        for epoch in epochs:
            self.acquisitions += 1
            if epoch > 1:
                self.failovers += 1


class ClusterCollector:
    """A prometheus-client collector over a :class:`ClusterStats`.

    Args:
        stats: the counters.
        owned: how many shards this coordinator serves now.
    """

    def __init__(self, stats: ClusterStats, owned: Callable[[], int]) -> None:
        self._stats = stats
        self._owned = owned

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        stats = self._stats
        yield CounterMetricFamily(
            "fleetwire_shard_lease_acquisitions", "Shard leases this coordinator won (renewals not counted).",
            value=stats.acquisitions,
        )
        yield CounterMetricFamily(
            "fleetwire_fenced_commits", "Group commits refused because the shard's lease was no longer this "
            "coordinator's at its epoch (each stops that shard's core).", value=stats.fenced_commits,
        )
        yield CounterMetricFamily(
            "fleetwire_failovers", "Shards this coordinator took over from another coordinator (dead, stalled past "
            "its lease, or handing over).", value=stats.failovers,
        )
        hist = stats.takeover
        takeover = HistogramMetricFamily(
            "fleetwire_takeover_seconds", "From winning a shard's lease to serving it (plans loaded, core listening)."
        )
        takeover.add_metric([], [(_le(bound), n) for bound, n in hist.cumulative()], hist.sum)
        yield takeover
        yield GaugeMetricFamily("fleetwire_shards_owned", "Shards this coordinator serves now.", value=self._owned())


def _le(bound: float) -> str:
    return "+Inf" if bound == float("inf") else repr(float(bound))


def build_registry(stats: ClusterStats, owned: Callable[[], int], *, process: bool = True) -> CollectorRegistry:
    """Our own registry (never prometheus-client's global one) with the cluster families and the process's."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(ClusterCollector(stats, owned))  # type: ignore[arg-type]
    if process:
        ProcessCollector(registry=registry)
    return registry


def render(registry: CollectorRegistry) -> bytes:
    """The Prometheus text exposition of ``registry``."""
    return generate_latest(registry)
