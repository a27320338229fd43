"""The coordinator's spans of a traced plan, made from what its core noted (docs/OPERATIONS.md §Tracing).

The pure core never sees OpenTelemetry: while the driver traces, ``Streams`` notes each lifecycle
step of a plan whose caller sampled its trace (``Effects.traces``: coordinator/effects.py
``TraceNote``, a plain tuple). :class:`PlanSpans` gets a step's notes twice, from the driver
(coordinator/io/frontdoor/core_driver.py): when the step is flushed (its records handed to the
store) and when it is delivered (its records committed, its frames released). It does no work per
plan on the event loop: each call hands the tracer one record per step (``Tracing.add_step``: the
step's number, the time and its notes list as the core made it; ``Tracing.add_commit``: the step's
number and the time), and the spans are made where the tracer exports, in its exporter child
process (or thread), by wireio/span_export.py :class:`~wireio.span_export.StepSpans`, each a child
of the plan's stored context (the caller's submit span):

* ``fleetwire.queue``: from ``queued`` (or ``requeued``, ``preempted``) to the placement that
  leased it (or the plan's end while queued); every ``waiting`` reason is an event of it, the last
  one its ``fleetwire.wait_reason`` attribute; the placement that ended it is its
  ``fleetwire.policy`` and ``fleetwire.worker_id`` (one span, not a zero-length placement span
  beside it). The scheduler notes the lease once, with its placement (``leased``,
  coordinator/scheduling.py), not a placement and a lease apart.
* ``fleetwire.store.commit``: the step that recorded the plan (``queued``: ``accepted`` waits for it)
  or its end (``succeeded``/``failed``/``cancelled``), from the flush to the commit.

Spans carry ``fleetwire.plan_id`` and ``fleetwire.attempt``. Times are wall-clock nanoseconds read
here, once a step. What the exporter holds between notes is bounded by the traced plans queued now.
After a restart (of the coordinator, or of its exporter child) a plan queued before it has no start:
its queue span starts at the first note after it.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from coordinator.effects import TraceNote
from wireio.tracing import Tracing

__all__ = ["PlanSpans"]


class PlanSpans:
    """The traced plans' steps to the tracer, one record per step and per commit (module docstring).

    Args:
        tracing: the coordinator's tracer.
        clock: wall-clock nanoseconds.
    """

    def __init__(self, tracing: Tracing, clock: Callable[[], int] = time.time_ns) -> None:
        self.tracing = tracing
        self._clock = clock
        self._steps: dict[int, int] = {}  # id(notes) -> its step's number, from the flush to the delivery
        self._step = 0

    def flushed(self, notes: list[TraceNote]) -> None:
        """A step's notes, as its records go to the store (the list is the tracer's from now on: never changed)."""
        self._step = step = self._step + 1
        self._steps[id(notes)] = step
        self.tracing.add_step(step, self._clock(), notes)

    def delivered(self, notes: list[TraceNote]) -> None:
        """The step's records are committed: the commit spans of its plans' creations and ends."""
        step = self._steps.pop(id(notes), None)
        if step is not None:
            self.tracing.add_commit(step, self._clock())
