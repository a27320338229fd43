"""The coordinator's spans of a traced plan, made from what its core noted (docs/OPERATIONS.md §Tracing).

The pure core never sees OpenTelemetry: while the driver traces, ``Streams`` notes each lifecycle
step of a plan whose caller sampled its trace (``Effects.traces``: coordinator/effects.py
``TraceNote``). :class:`PlanSpans` gets a step's notes twice, from the driver
(coordinator/io/frontdoor/core_driver.py): when the step is flushed (its records handed to the
store) and when it is delivered (its records committed, its frames released). From them it writes
finished spans, each a child of the plan's stored context (the caller's submit span):

* ``fleetwire.queue``: from ``queued`` (or ``requeued``, ``preempted``) to the placement that
  leased it (or the plan's end while queued); every ``waiting`` reason is an event of it, the last
  one its ``fleetwire.wait_reason`` attribute; the placement that ended it is its
  ``fleetwire.policy`` and ``fleetwire.worker_id`` (one span, not a zero-length placement span
  beside it: each span costs ~6 µs of CPU from its note to its post, docs/OPERATIONS.md §Tracing). The
  scheduler notes the lease once, with its placement (``leased``, coordinator/scheduling.py), not a
  placement and a lease apart.
* ``fleetwire.store.commit``: the step that recorded the plan (``queued``: ``accepted`` waits for it)
  or its end (``succeeded``/``failed``/``cancelled``), from the flush to the commit.

Spans carry ``fleetwire.plan_id`` and ``fleetwire.attempt``. Times are wall-clock nanoseconds read
here. What is held between notes is bounded by the traced plans queued now. After a restart a plan
queued before it has no start: its queue span starts at the first note after it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Final

from coordinator.effects import TraceNote
from wireio.otlp import COMMIT_SPAN
from wireio.tracing import Tracing

Attributes = dict[str, str | int | float | bool]

__all__ = ["PlanSpans"]

_QUEUED_BY: Final = frozenset({"queued", "requeued", "preempted"})
_ENDS: Final = frozenset({"succeeded", "failed", "cancelled"})
_COMMITTED: Final = _ENDS | {"queued"}


class _Queued:
    __slots__ = ("attempt", "events", "reason", "since_ns", "traceparent")

    def __init__(self, traceparent: str, since_ns: int, attempt: int) -> None:
        self.traceparent = traceparent
        self.since_ns = since_ns
        self.attempt = attempt
        self.reason = ""
        self.events: list[tuple[str, int, dict[str, str | int | float | bool]]] | None = None  # once it waits


class PlanSpans:
    """Spans of traced plans from the core's notes (module docstring).

    Args:
        tracing: the coordinator's tracer.
        clock: wall-clock nanoseconds.
    """

    def __init__(self, tracing: Tracing, clock: Callable[[], int] = time.time_ns) -> None:
        self.tracing = tracing
        self._clock = clock
        self._queued: dict[str, _Queued] = {}
        self._flushed: dict[int, int] = {}  # id(notes) -> when the step was flushed

    def flushed(self, notes: Sequence[TraceNote]) -> None:
        """A step's notes, as its records go to the store: queue spans, each ended by its placement."""
        now = self._clock()
        self._flushed[id(notes)] = now
        queued, add = self._queued, self.tracing.add
        for traceparent, plan_id, attempt, kind, data in notes:
            if kind == "leased" or kind in _ENDS:
                entry = queued.pop(plan_id, None)
                if entry is None:
                    if kind != "leased":
                        continue
                    entry = _Queued(traceparent, now, attempt)  # queued before a restart: a queue span from here
                attributes: Attributes = {"fleetwire.plan_id": plan_id, "fleetwire.attempt": entry.attempt}
                if entry.reason:  # no attribute for a plan that never waited: each one costs the exporter
                    attributes["fleetwire.wait_reason"] = entry.reason
                if kind != "leased":
                    add("fleetwire.queue", entry.traceparent, entry.since_ns, now, attributes, entry.events,
                        f"ended {kind} while queued")  # fmt: skip
                    continue
                if data:  # the placement that leased it (none when recovery adopted the lease)
                    attributes["fleetwire.policy"] = str(data.get("policy", ""))
                    attributes["fleetwire.worker_id"] = str(data.get("worker_id", ""))
                add("fleetwire.queue", entry.traceparent, entry.since_ns, now, attributes, entry.events)
            elif kind in _QUEUED_BY:
                queued[plan_id] = _Queued(traceparent, now, attempt + 1)
            elif kind == "waiting":
                entry = queued.get(plan_id)
                if entry is None:  # queued before a restart: its wait is known from here on
                    entry = queued[plan_id] = _Queued(traceparent, now, attempt + 1)
                entry.reason = reason = str((data or {}).get("reason", ""))
                if entry.events is None:
                    entry.events = []
                entry.events.append(("waiting", now, {"reason": reason}))

    def delivered(self, notes: Sequence[TraceNote]) -> None:
        """The step's records are committed: the commit spans of its plans' creations and ends."""
        started = self._flushed.pop(id(notes), None)
        if started is None:
            return
        now = self._clock()
        done: set[str] = set()
        add = self.tracing.add_compact  # fleetwire.store.commit: plan_id, attempt, event (wireio/otlp.py)
        for traceparent, plan_id, attempt, kind, _ in notes:
            if kind in _COMMITTED and plan_id not in done:
                done.add(plan_id)
                add(COMMIT_SPAN, traceparent, started, now, plan_id, attempt, kind)

    @property
    def queued(self) -> int:
        """Traced plans whose queue span is open."""
        return len(self._queued)
