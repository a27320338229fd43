"""What the core's parts ask of plan graphs (``Scheduler.graphs``, coordinator/scheduling.py).

The core's collaborator, coordinator/plan_graphs.py ``PlanGraphs``, answers and plugs itself into the
scheduler; the scheduler, the client sessions and the worker sessions name only this protocol, so none
of them imports it. The scheduler calls for a plan with references or ``after`` (``plan.graphed``)
only, or while a consumer waits for a busy holder (``waits``): a plan without a graph costs it one
attribute test.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from coordinator.capacity import Pool
    from coordinator.plans import Plan
    from coordinator.workers import WorkerRecord
    from protocol.messages import Done, ErrorInfo, InputSpec, Pull, Submit

__all__ = ["GraphHooks"]


class GraphHooks(Protocol):
    """The graph's part in submitting, placing, cancelling and retrying plans."""

    finish: Callable[[Plan, str, Done, float, dict[str, list[str]] | None], None] | None
    """Ends a plan as its worker's ``done`` says (``Leases.finish``: a success held for copies ends there)."""

    @property
    def waits(self) -> dict[str, tuple[str, float]]:
        """Consumers waiting for a busy holder: key -> (that worker, until when)."""
        ...

    def hold(self, plan: Plan, now: float) -> bool:
        """True when the graph holds the plan (or failed it) instead of its being queued."""
        ...

    def narrow(self, plan: Plan, pool: Pool, now: float) -> Pool:
        """The workers of ``pool`` the plan should go to, by where its bytes are."""
        ...

    def may_take(self, plan: Plan, record: WorkerRecord, now: float) -> bool:
        """Whether ``record`` may take the queued plan now (not while it waits for another holder)."""
        ...

    def wait_reason(self, plan: Plan) -> str | None:
        """Why a queued plan waits for a busy holder, or None."""
        ...

    def assign_inputs(self, plan: Plan, record: WorkerRecord) -> tuple[list[InputSpec], list[Pull]]:
        """The ``assign``'s inputs (references filled in) and ``pulls``."""
        ...

    def output_missing(self, plan: Plan, error: ErrorInfo | None) -> bool:
        """A consumer's attempt failed because an input it takes from another plan was lost: True when it is
        to be queued again (not counted) while that output is made again."""
        ...

    def resolve(self, msg: Submit, owner: str, find: Callable[[str], Plan | None]) -> tuple[Submit, str | None]:
        """A submit's references and ``after`` resolved to plan keys, or why it is refused."""
        ...

    def dependants(self, plan: Plan) -> list[Plan]:
        """The unfinished plans that need ``plan``, directly or not."""
        ...

    def ending_together(self, plans: Iterable[Plan]) -> AbstractContextManager[None]:
        """While in it, the ends of ``plans`` doom none of them (a cancel with dependants)."""
        ...

    def output_source(self, plan: Plan, output: str, lost: str, now: float) -> Plan | str | ErrorInfo:
        """Where a client fetches an output of a succeeded plan: the plan holding a copy, the key of the rebuild
        making it again, or why it is lost for good (``data_ticket.output``)."""
        ...

    def replicate(self, plan: Plan, worker_id: str, msg: Done, now: float) -> bool:
        """A plan with ``replicas`` succeeded: True when its success is held until copies of its outputs exist."""
        ...

    def name_of(self, key: str) -> str:
        """A plan as its owner knows it (its name, else its key)."""
        ...
