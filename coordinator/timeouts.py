"""The coordinator's own enforcement of ``timeout_s``: a backstop for a worker that does not report.

The worker enforces a plan's ``timeout_s`` first: its handler is stopped when the attempt has run
that long and it sends ``done(failed, timeout)`` (worker_agent/runner.py). A worker that is hung,
wedged in a driver call, or written without a timer never does; its session may stay alive (its
heartbeats come from another task), so the reaper never frees the plan. The core therefore
watches every running attempt that has a ``timeout_s``: one still running ``timeout_s`` +
``grace_s`` after it started is failed ``timeout`` by :meth:`RunTimeouts.expire` (called from
``Coordinator.tick``), and its worker is sent ``cancel``. The lease stays claimed until the
worker's ``done`` for that attempt (or its reaping), as after a client's cancel. A timed-out plan
is not retried: its worker may still be running it.

When the clock starts (docs/PROTOCOL.md §5 *Timeouts*): at the worker's ``accept``; for a plan
with ``inputs``, once the worker reported every declared input arrived (``input_received``),
since the handler starts only then. A plan a reconnecting worker continues after a coordinator
restart is timed from that ``hello``.

Pure: time comes in as ``now``. Deadlines sit in a heap with lazy deletion: an entry whose
attempt is no longer the plan's running one is dropped when it comes up, and the heap is
compacted when it doubles, so plans that end early cost nothing later.
"""

from __future__ import annotations

import heapq
from typing import TYPE_CHECKING, Final

import structlog

from coordinator.plans import Plan, advance
from protocol import errors
from protocol.messages import Cancel, ErrorInfo

if TYPE_CHECKING:
    from coordinator.effects import Outbox
    from coordinator.registry import WorkerRegistry
    from coordinator.stats import PlanTimings
    from coordinator.streams import Streams

__all__ = ["DEFAULT_GRACE_S", "RunTimeouts"]

log = structlog.get_logger(__name__)

#: Seconds past ``timeout_s`` the coordinator waits for the worker's own ``done(failed, timeout)``:
#: the worker's stop grace (SIGTERM, then SIGKILL after 5 s) and the trip back, with room to spare.
DEFAULT_GRACE_S: Final = 30.0

_MIN_COMPACT: Final = 1024


class RunTimeouts:
    """Deadlines of running attempts with a ``timeout_s``; :meth:`expire` fails the late ones.

    Args:
        plans: every plan, by id.
        registry: the workers, to find the session of a timed-out plan's worker.
        outbox: sends ``cancel`` to that worker.
        streams: ends the plan's stream with ``failed``.
        timings: run-time histograms.
        grace_s: seconds past ``timeout_s`` before the coordinator acts (> 0).
    """

    def __init__(
        self,
        *,
        plans: dict[str, Plan],
        registry: WorkerRegistry,
        outbox: Outbox,
        streams: Streams,
        timings: PlanTimings,
        grace_s: float = DEFAULT_GRACE_S,
    ) -> None:
        if not grace_s > 0:
            raise ValueError(f"the run-timeout grace must be above 0 s, not {grace_s}")
        self.grace_s = grace_s
        self._plans = plans
        self._registry = registry
        self._outbox = outbox
        self._streams = streams
        self._timings = timings
        self._heap: list[tuple[float, str, int]] = []  # (deadline, plan id, attempt)
        self._watched: dict[str, int] = {}  # plan id -> the attempt whose deadline is in the heap
        self._compact_at = _MIN_COMPACT

    def __len__(self) -> int:
        """Attempts watched now (some may have ended since; they are dropped when they come up)."""
        return len(self._watched)

    def watch(self, plan: Plan, now: float) -> None:
        """Start the clock of the plan's running attempt, if it has a ``timeout_s`` and it is due to start.

        Called at ``accept``, at each ``input_received`` and when a reconnecting worker continues
        the plan; a second call for the same attempt changes nothing.
        """
        timeout_s = plan.timeout_s
        if timeout_s is None or plan.state != "running" or self._watched.get(plan.id) == plan.attempt:
            return
        if plan.inputs and not _inputs_arrived(plan):
            return  # the handler has not started: the worker's input timeout governs until then
        self._watched[plan.id] = plan.attempt
        heapq.heappush(self._heap, (now + timeout_s + self.grace_s, plan.id, plan.attempt))
        if len(self._heap) >= self._compact_at:
            self._compact()

    def expire(self, now: float) -> list[str]:
        """Fail ``timeout`` every running attempt past ``timeout_s`` + grace; returns their plan ids."""
        heap, plans, expired = self._heap, self._plans, []
        while heap and heap[0][0] <= now:
            _, plan_id, attempt = heapq.heappop(heap)
            if self._watched.get(plan_id) == attempt:
                del self._watched[plan_id]
            plan = plans.get(plan_id)
            if plan is None or plan.attempt != attempt or plan.state != "running" or plan.replicating:
                continue  # it ended, or moved on to another attempt, in time (or its success waits for copies)
            self._time_out(plan, now)
            expired.append(plan_id)
        return expired

    def _time_out(self, plan: Plan, now: float) -> None:
        timeout_s = plan.timeout_s or 0.0
        worker_id = plan.worker_id
        ran_s = now - plan.started_at_s if plan.started_at_s is not None else timeout_s + self.grace_s
        advance(plan, "timeout")
        self._timings.finished(plan, "failed", now)
        message = (
            f"plan ran {ran_s:.1f} s, past its timeout_s ({timeout_s:g} s) and the coordinator's grace "
            f"({self.grace_s:g} s), and worker {worker_id} never reported it ended; the coordinator failed it "
            "and told the worker to cancel it"
        )
        registry = self._registry
        if worker_id is not None and worker_id in registry:
            # The lease stays claimed until the worker's done for this attempt (or its reaping).
            conn_id = registry.get(worker_id).conn_id
            if conn_id is not None:
                self._outbox.send(conn_id, Cancel(plan_id=plan.id, attempt=plan.attempt))
        log.warning("plan timed out at the coordinator", plan_id=plan.id, worker_id=worker_id,
                    attempt=plan.attempt, timeout_s=timeout_s, grace_s=self.grace_s)  # fmt: skip
        detail = {"timeout_s": timeout_s, "grace_s": self.grace_s, "enforced_by": "coordinator"}
        self._streams.fail(plan, worker_id, ErrorInfo(errors.TIMEOUT, message, detail))

    def _compact(self) -> None:
        """Drop the entries of attempts that are no longer watched; the heap then holds only live ones."""
        watched = self._watched
        for plan_id in [pid for pid, attempt in watched.items() if not _running(self._plans.get(pid), attempt)]:
            del watched[plan_id]
        self._heap = [entry for entry in self._heap if watched.get(entry[1]) == entry[2]]
        heapq.heapify(self._heap)
        self._compact_at = max(_MIN_COMPACT, 2 * len(self._heap))


def _running(plan: Plan | None, attempt: int) -> bool:
    return plan is not None and plan.attempt == attempt and plan.state == "running"


def _inputs_arrived(plan: Plan) -> bool:
    """Whether the worker reported every declared input of the current attempt arrived whole."""
    arrived = {
        event.data.get("name")
        for event in plan.events
        if event.kind == "input_received" and event.attempt == plan.attempt and isinstance(event.data, dict)
    }
    return all(spec.name in arrived for spec in plan.inputs)
