"""What the core asks to persist, and the journal that collects it between two effects.

The core stays sans-I/O (docs/SEMANTICS.md §Durability): it never writes anything. Each
input leaves *records* in ``Effects.records``; the server writes them in one batch and only
then sends the frames of that batch, so a reply that depends on a record (``accepted``, an
``ack``, the events a subscriber sees) leaves the coordinator only once the record is
committed. A store (``coordinator/io/stores/store.py``) applies records; recovery
(``coordinator/recovery.py``) turns what a store holds back into plans.

Four kinds of record; a store applies a batch in its order (a forget, then a new creation of
the same id, leaves the new plan), and a journal's batch is forgets, creations, events, statuses:

* :class:`PlanForgotten`: a finished plan past its retention (``--plan-retention``,
  coordinator/retention.py): the store deletes it, its events with it. Its id may then be
  created again, as a new plan.
* :class:`PlanCreated`: a new plan: who submitted it, its submit order and the submit
  itself (so every submit field, present or future, comes back after a restart). The plan id
  is the idempotency key: a plan id is created at most once while the plan is kept.
* ``protocol.Event``: a durable event of a plan's stream, with its coordinator ``seq``.
  Ephemeral events are never recorded.
* :class:`PlanStatus`: the mutable part of a plan, written once per batch for every plan the
  batch touched (a plan that moved ten times in one batch is written once). It carries
  ``next_seq`` even when the batch only held ephemeral events, so a restarted coordinator
  never hands out a seq a subscriber has already seen. A finished plan's carries ``ended_at``
  (Unix time), so its retention survives a restart; a store written before it had the field
  decodes it as None (coordinator/retention.py). Its ``receipt`` (energy and carbon) is optional
  the same way: a status without one encodes exactly as before (``omit_defaults``).

And one that is not a plan's: :class:`UsageRows`, the usage ledger's rows changed since the last
(coordinator/ledger.py, coordinator/sharing.py), at most one a tick. A store that keeps them
declares the ``usage`` ability to give them back (coordinator/io/stores/abilities.py); one that does not
ignores them.
"""

from __future__ import annotations

from typing import Any

import msgspec

from coordinator.plans import Plan
from protocol.messages import ErrorInfo, Event, OutputSpec, PlanStateName, Receipt, Submit

__all__ = ["Journal", "PlanCreated", "PlanForgotten", "PlanStatus", "Record", "StoredPlan", "UsageRows", "status_of"]


class PlanCreated(msgspec.Struct, frozen=True, gc=False):
    """A new plan, as submitted."""

    plan_id: str
    owner: str
    order: int
    submit: Submit
    rebuild_of: str | None = None  # the plan whose lost outputs it makes again (coordinator/plan_graphs.py)


class PlanStatus(msgspec.Struct, frozen=True, omit_defaults=True, gc=False):
    """Everything about a plan that changes after its submit.

    ``omit_defaults``: a store writes one per plan per group; fields at their default (no
    error, no history, ...) are left out of the encoding and come back as the default.
    ``gc=False`` (as PlanCreated, and the wire messages: protocol/messages.py ``_Msg``): a record never
    refers back to itself, and a few are made per plan at every step, so the collector need not track them.
    """

    plan_id: str
    state: PlanStateName
    attempt: int = 0
    worker_id: str | None = None
    next_seq: int = 1
    result: Any = None
    error: ErrorInfo | None = None
    waiting_reason: str | None = None
    worker_seq: tuple[int, int] = (0, 0)
    retried: int = 0
    free_attempts: int = 0
    history: list[dict[str, Any]] = []
    ended_at: float | None = None  # Unix time it reached its terminal state (retention runs from it)
    receipt: Receipt | None = None  # a finished plan's energy and carbon (coordinator/receipts.py); None: none
    produced: list[OutputSpec] = []  # the outputs its last attempt left on its worker (plan graphs use them)
    submitted_at: float | None = None  # a plan with a deadline: its submit's Unix time (coordinator/carbon_holds.py)
    deferred: bool = False  # ... whether it was held for a greener hour
    deferred_until: float | None = None  # ... and, held now, the start it waits for (Unix)


class PlanForgotten(msgspec.Struct, frozen=True):
    """A finished plan the coordinator no longer keeps: delete it and its events."""

    plan_id: str


class UsageRows(msgspec.Struct, frozen=True):
    """The usage ledger's rows changed since the last ones (coordinator/ledger.py, written at the core's tick):
    each row is kept whole (``(hour, principal, team, totals in ledger.FIELDS order)``, replacing the one of its
    key), and the keys in ``deleted`` (hours folded into hour 0) are dropped. Not a plan's record."""

    rows: list[tuple[int, str, str, list[float]]] = []
    deleted: list[tuple[int, str, str]] = []


Record = PlanCreated | PlanStatus | Event | PlanForgotten | UsageRows


class StoredPlan(msgspec.Struct):
    """One plan as a store gives it back: its creation, latest status and durable events."""

    created: PlanCreated
    status: PlanStatus | None = None
    events: list[Event] = []


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
        # (once per event); everything else goes through the methods.
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
        self._created, self.events, self.dirty, self._forgotten = [], [], {}, []
        return records
