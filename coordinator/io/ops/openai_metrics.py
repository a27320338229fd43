"""``/metrics`` families of the OpenAI door (docs/OPENAI.md §Metrics), read from its counts at scrape time.

The door keeps plain counters and one histogram (coordinator/openai_api/limits.py ``DoorStats``);
nothing here runs on the hot path. A core's port exposes them through its collector
(coordinator/io/ops/metrics.py); a cluster's main port registers :class:`OpenAICollector`
beside its cluster families (coordinator/io/cluster/host.py).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Final

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric

from coordinator.openai_api.limits import DoorStats

__all__ = ["OPENAI_METRIC_NAMES", "OpenAICollector", "openai_families"]

#: The families :func:`openai_families` yields (counters get ``_total`` in the exposition).
OPENAI_METRIC_NAMES: Final = (
    "fleetwire_openai_requests",
    "fleetwire_openai_requests_in_flight",
    "fleetwire_openai_streams_open",
    "fleetwire_openai_first_byte_seconds",
    "fleetwire_openai_rate_limited",
    "fleetwire_openai_slow_consumers",
    "fleetwire_openai_forwarded",
)


def openai_families(stats: DoorStats | None) -> Iterator[Metric]:
    """The door's families (zeros without a door: ``--no-openai``)."""
    stats = stats if stats is not None else DoorStats()
    requests = CounterMetricFamily("fleetwire_openai_requests", "OpenAI-compatible requests answered, by HTTP "
                                   "status.", labels=["status"])  # fmt: skip
    for status, n in sorted(stats.answers.items()):
        requests.add_metric([str(status)], n)
    yield requests
    yield GaugeMetricFamily("fleetwire_openai_requests_in_flight", "OpenAI completions submitted and not yet "
                            "answered whole.", value=stats.in_flight)  # fmt: skip
    yield GaugeMetricFamily("fleetwire_openai_streams_open", "OpenAI streams whose head was sent and whose end was "
                            "not.", value=stats.streams_open)  # fmt: skip
    first = HistogramMetricFamily("fleetwire_openai_first_byte_seconds", "From an OpenAI request's last byte to the "
                                  "first byte of its answer (queue wait and the engine's first token included).")
    hist = stats.first_byte
    first.add_metric([], [("+Inf" if bound == float("inf") else repr(bound), count)
                          for bound, count in hist.cumulative()], hist.sum)  # fmt: skip
    yield first
    yield CounterMetricFamily("fleetwire_openai_rate_limited", "OpenAI requests refused 429 past the principal's "
                              "--openai-rate.", value=stats.rate_limited)  # fmt: skip
    yield CounterMetricFamily("fleetwire_openai_slow_consumers", "OpenAI connections aborted for letting more than "
                              "--max-pending-bytes wait unread.", value=stats.slow_consumers)  # fmt: skip
    yield CounterMetricFamily("fleetwire_openai_forwarded", "OpenAI requests a cluster's main port forwarded to the "
                              "coordinator serving their shard.", value=stats.forwarded)  # fmt: skip


class OpenAICollector:
    """A prometheus-client collector over one door's counts (a cluster's main port)."""

    def __init__(self, stats: DoorStats) -> None:
        self._stats = stats

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        yield from openai_families(self._stats)
