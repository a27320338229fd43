"""Exceptions raised by the coordinator core.

Every exception carries the fields a caller needs to answer the peer (no parsing of
messages), and a stable ``code`` from :mod:`protocol.errors` that goes on the wire
unchanged (docs/PROTOCOL.md §Errors).

Exception tree::

    FleetwireError (protocol.errors)
    └── CoordinatorError                          code: internal
        ├── UnknownWorker(worker_id)              code: unknown_worker
        ├── PlanNotFound(plan_id)                 code: plan_not_found
        └── InvalidTransition(plan_id, state, event)
                                                  code: invalid_transition
"""

from __future__ import annotations

from protocol import errors
from protocol.errors import FleetwireError

__all__ = ["CoordinatorError", "InvalidTransition", "PlanNotFound", "UnknownWorker"]


class CoordinatorError(FleetwireError):
    """Base of every exception the coordinator core raises."""

    code = errors.INTERNAL


class UnknownWorker(CoordinatorError):
    """A registry operation named a worker id the registry does not hold.

    Attributes:
        worker_id: the id that was asked for.
    """

    code = errors.UNKNOWN_WORKER

    def __init__(self, worker_id: str) -> None:
        super().__init__(f"unknown worker {worker_id!r}: it never registered or was reaped")
        self.worker_id = worker_id


class PlanNotFound(CoordinatorError):
    """A request named a plan id the coordinator does not hold.

    Attributes:
        plan_id: the id that was asked for.
    """

    code = errors.PLAN_NOT_FOUND

    def __init__(self, plan_id: str) -> None:
        super().__init__(f"no plan with id {plan_id!r}")
        self.plan_id = plan_id


class InvalidTransition(CoordinatorError):
    """A plan was asked to move along an edge the transition table does not have.

    Attributes:
        plan_id: the plan.
        state: the state it was in (unchanged by the failed move).
        event: the event that was refused.
    """

    code = errors.INVALID_TRANSITION

    def __init__(self, plan_id: str, state: str, event: str) -> None:
        super().__init__(f"plan {plan_id!r} cannot take event {event!r} in state {state!r}")
        self.plan_id = plan_id
        self.state = state
        self.event = event
