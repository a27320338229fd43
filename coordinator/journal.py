"""The journal: the records (coordinator/records.py) the core's steps leave between two effects.

Split from coordinator/records.py so it can be compiled with the rest of the per-plan path (setup.py)
while the record Structs stay pure Python: a compiled module's msgspec Structs lose their field types.
"""

from __future__ import annotations

from coordinator.plans import Plan
from coordinator.records import PlanCreated, PlanForgotten, PlanStatus, Record
from protocol.messages import Event, Submit

__all__ = ["Journal", "status_of"]


def status_of(plan: Plan) -> PlanStatus:
    """The status record of a plan as it is now."""
    # Positional, in PlanStatus's field order (this runs for every plan at every step it changed in:
    # keyword matching cost more than the rest of it); Plan.terminal and max() inlined for the same reason.
    next_seq, recorded = plan.next_seq, plan.seq_recorded
    state = plan.state
    if recorded > next_seq and state not in ("succeeded", "failed", "cancelled"):
        next_seq = recorded  # a reservation for unrecorded events (streams.py), none once the stream has ended
    return PlanStatus(
        plan.id, state, plan.attempt, plan.worker_id, next_seq, plan.result, plan.error, plan.waiting_reason,
        plan.worker_seq, plan.retried, plan.free_attempts, list(plan.history), plan.ended_at, plan.receipt,
        plan.produced, plan.submitted_at, plan.deferred, plan.deferred_until,
    )


class Journal:
    """Records accumulated since the last :meth:`take`, with plan statuses coalesced."""

    def __init__(self) -> None:
        self._created: list[PlanCreated] = []
        # ``events`` and ``dirty`` are public for Streams.emit, which does what :meth:`emitted` does inline
        # (once per event) on the objects it took at its start: they are never replaced, only emptied (take);
        # everything else goes through the methods.
        self.events: list[Event] = []
        self.dirty: dict[str, Plan] = {}
        self._forgotten: list[PlanForgotten] = []

    def __bool__(self) -> bool:
        return bool(self._created or self.events or self.dirty or self._forgotten)

    def created(self, plan: Plan, submit: Submit) -> None:
        """A plan was created from ``submit``."""
        self._created.append(PlanCreated(plan.id, plan.owner, plan.order, submit, plan.rebuild_of))
        self.dirty[plan.id] = plan

    def emitted(self, plan: Plan, event: Event) -> None:
        """The plan's stream got ``event`` (its status changed with it: at least ``next_seq``)."""
        if not event.ephemeral:
            self.events.append(event)
        self.dirty[plan.id] = plan

    def touched(self, plan: Plan) -> None:
        """The plan changed without an event."""
        self.dirty[plan.id] = plan

    def forgotten(self, plan: Plan) -> None:
        """The plan was forgotten (it ended before this step: nothing of it is pending here)."""
        self.dirty.pop(plan.id, None)
        self._forgotten.append(PlanForgotten(plan.id))

    def take(self) -> list[Record]:
        """Every record since the last call: forgets, then creations, events and statuses.

        Forgets first: a submit that reuses a forgotten id in the same step is a new plan.
        """
        if not self:
            return []
        records: list[Record] = [*self._forgotten, *self._created, *self.events]
        records.extend(map(status_of, self.dirty.values()))  # map, not a generator: no frame resumed per plan
        self._created, self._forgotten = [], []
        self.events.clear()  # emptied in place: Streams holds these two (one attribute read an event fewer)
        self.dirty.clear()
        return records
