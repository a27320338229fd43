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

The :class:`~coordinator.journal.Journal` that collects them, and ``status_of``, are in
coordinator/journal.py: that module is compiled with the core (setup.py), this one is not (mypyc would
give these Structs' fields the annotation ``type``, which the store's decoder then enforces).
"""

from __future__ import annotations

from typing import Any

import msgspec

from protocol.messages import ErrorInfo, Event, OutputSpec, PlanStateName, Receipt, Submit

__all__ = ["PlanCreated", "PlanForgotten", "PlanStatus", "Record", "StoredPlan", "UsageRows"]


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
