"""Plan timings kept by the core for ``/metrics``: pure bucket counts, no Prometheus import.

The core observes two durations per plan attempt (docs/OPERATIONS.md §Metrics):

* **queue wait**: from the moment the plan entered the queue (submit or requeue) to the
  worker's ``accept`` of the attempt that followed;
* **run time**: from that ``accept`` to the worker's ``done``, per outcome.

Observing is a bisect and three integer/float additions, paid once per plan transition,
never per frame; ``coordinator/io/ops/metrics.py`` reads the counts at scrape time. Times are the
core's ``now`` (monotonic seconds), so a fake clock drives them in tests.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from typing import TYPE_CHECKING, Final

from protocol.messages import Outcome

if TYPE_CHECKING:
    from coordinator.plans import Plan

__all__ = ["QUEUE_WAIT_BUCKETS_S", "RUN_TIME_BUCKETS_S", "FrameCounters", "Histogram", "PlanTimings"]

# Upper bounds in seconds (Prometheus ``le``); +Inf is implied. Queue waits are usually
# short, runs range from an echo (ms) to a training job (hours).
# Typed tuple[float, ...]: compiled (setup.py), a Final tuple of floats of an inferred type reads as never set.
QUEUE_WAIT_BUCKETS_S: Final[tuple[float, ...]] = (
    0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 10.0, 30.0, 60.0, 300.0, 1800.0)
RUN_TIME_BUCKETS_S: Final[tuple[float, ...]] = (
    0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 10.0, 30.0, 60.0, 300.0, 1800.0, 3600.0, 14400.0)


class Histogram:
    """Cumulative-ready bucket counts of observed values.

    Args:
        bounds: increasing upper bounds; a value equal to a bound falls in that bucket.
    """

    __slots__ = ("bounds", "count", "counts", "exemplars", "sum")

    def __init__(self, bounds: Sequence[float]) -> None:
        if list(bounds) != sorted(set(bounds)):
            raise ValueError(f"histogram bounds must be strictly increasing, got {list(bounds)}")
        self.bounds = tuple(bounds)
        self.counts = [0] * (len(self.bounds) + 1)  # the last one is +Inf
        self.sum = 0.0
        self.count = 0
        # Per bucket, the last traced value: (its traceparent, value), an OpenMetrics exemplar (None: none yet); the
        # trace id is sliced from it when a scrape renders it (coordinator/io/ops/metrics.py), not per plan here.
        self.exemplars: list[tuple[str, float] | None] | None = None

    def observe(self, value: float, traceparent: str = "") -> None:
        """Count one value (negative values, from a clock that stepped back, count as 0); ``traceparent``: the
        value's (sampled) trace context, kept as its bucket's exemplar (docs/OPERATIONS.md §Tracing)."""
        if not value >= 0.0:  # max(0.0, value) without the call: NaN counts as 0 too
            value = 0.0
        bucket = bisect.bisect_left(self.bounds, value)
        self.counts[bucket] += 1
        self.sum += value
        self.count += 1
        if traceparent:
            if self.exemplars is None:
                self.exemplars = [None] * len(self.counts)
            self.exemplars[bucket] = (traceparent, value)

    def cumulative(self) -> list[tuple[float, int]]:
        """``(upper bound, values <= bound)`` pairs ending with ``(inf, count)``, as Prometheus wants."""
        out: list[tuple[float, int]] = []
        running = 0
        for bound, n in zip((*self.bounds, float("inf")), self.counts, strict=True):
            running += n
            out.append((bound, running))
        return out


class PlanTimings:
    """Queue-wait and run-time histograms of every plan attempt the core saw."""

    def __init__(self) -> None:
        self.queue_wait = Histogram(QUEUE_WAIT_BUCKETS_S)
        self.run_time: dict[str, Histogram] = {
            outcome: Histogram(RUN_TIME_BUCKETS_S) for outcome in ("succeeded", "failed", "cancelled")
        }

    def started(self, plan: Plan, now: float) -> None:
        """The worker accepted the plan's attempt: its queue wait ends, its run starts."""
        self.queue_wait.observe(now - plan.queued_at_s, plan.traceparent if plan.sampled else "")  # a trace that exists
        plan.started_at_s = now

    def finished(self, plan: Plan, outcome: Outcome, now: float) -> None:
        """The worker's ``done`` ended an attempt; one that never started (no accept) has no run time."""
        if plan.started_at_s is not None:
            self.run_time[outcome].observe(now - plan.started_at_s, plan.traceparent if plan.sampled else "")


class FrameCounters:
    """Websocket frames and bytes in and out, per session role, counted by the server.

    Each role has one list ``[frames_in, bytes_in, frames_out, bytes_out]``; a session keeps
    a reference to its role's list so counting a frame is two list-item additions.
    """

    FRAMES_IN: Final = 0  # one name a line: mypyc compiles no tuple assignment in a class body (setup.py)
    BYTES_IN: Final = 1
    FRAMES_OUT: Final = 2
    BYTES_OUT: Final = 3

    def __init__(self, roles: Sequence[str] = ("worker", "client")) -> None:
        self.by_role: dict[str, list[int]] = {role: [0, 0, 0, 0] for role in roles}

    def of(self, role: str) -> list[int]:
        """The counters of ``role`` (made on first use)."""
        return self.by_role.setdefault(role, [0, 0, 0, 0])
