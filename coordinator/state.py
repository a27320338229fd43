"""The core's shared state: the tables every collaborator of the core reads and changes.

What it owns: nothing but the grouping. :class:`CoreState` holds the registry, the plans and
their names, the queue, the subscriptions, the session table, the plan quota, the timing
histograms, the energy footprint, the counters, the journal of records, the usage ledger and the placement
policies' own state (coordinator/placement/placer.py), so that a collaborator is handed one
object for all of them instead of a parameter each.

Rules:

* The :class:`~coordinator.core.Coordinator` makes one ``CoreState`` and hands the same object
  to every collaborator; none of them replaces a field (each field is one shared table, and the
  core's public attributes name the same objects).
* A collaborator keeps the state, not copies of its fields' contents: a table read here is the
  one every other collaborator changes.
* Settings are not state: each collaborator takes the few settings it needs on its own
  (coordinator/worker_sessions/registration.py ``WorkerSessionConfig``, the core's ``CoreConfig``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from coordinator.journal import Journal
from coordinator.ledger import UsageLedger
from coordinator.limits import PlanQuota
from coordinator.placement.fair_queue import FairQueue
from coordinator.placement.placer import Placement, PlacementConfig
from coordinator.plans import Plan, PlanNames, Subscriptions
from coordinator.receipts import Footprint
from coordinator.registry import WorkerRegistry
from coordinator.sessions import SessionTable
from coordinator.stats import PlanTimings

__all__ = ["COUNTERS", "CoreState"]

#: The core's counters that exist from the start, so a metrics scrape never misses one (collaborators add
#: their own: coordinator/scheduling.py's placements per policy, coordinator/recovery.py's, ...).
COUNTERS = (
    "plans_submitted plans_requeued events_forwarded stale_dropped protocol_errors workers_reaped workers_left"
    " heartbeats plans_revoked scope_refused plans_refused plans_recovered_from_client results_recovered_from_worker"
).split()


@dataclass(eq=False)
class CoreState:
    """The tables the core's collaborators share (see the module docstring).

    Attributes:
        registry: the workers, their leases and liveness (coordinator/registry.py).
        quota: unfinished plans and bytes per client principal (coordinator/limits.py).
        placement: the placement policies over ``registry`` and ``plans`` (coordinator/placement/placer.py).
        plans: every plan the core holds, by key.
        names: the keys of plans whose owner's id for them is not their key (coordinator/plans.py).
        queue: the queued plans, grouped by signature, in fair-share order (coordinator/placement/fair_queue.py).
        subscriptions: who follows which plan.
        sessions: the open connections (coordinator/sessions.py).
        timings: queue-wait and run-time histograms (coordinator/io/ops/metrics.py exports them).
        footprint: energy and CO2e of finished plans by principal and op (coordinator/receipts.py).
        counters: the core's counters by name.
        journal: records for the store, accumulated since the last take (coordinator/records.py).
        ledger: usage by hour, principal and team (coordinator/ledger.py; coordinator/sharing.py adds to it).
    """

    registry: WorkerRegistry
    quota: PlanQuota
    placement: Placement
    plans: dict[str, Plan]
    names: PlanNames = field(default_factory=PlanNames)
    queue: FairQueue = field(default_factory=FairQueue)
    subscriptions: Subscriptions = field(default_factory=Subscriptions)
    sessions: SessionTable = field(default_factory=dict)
    timings: PlanTimings = field(default_factory=PlanTimings)
    footprint: Footprint = field(default_factory=Footprint)
    counters: dict[str, int] = field(default_factory=lambda: dict.fromkeys(COUNTERS, 0))
    journal: Journal = field(default_factory=Journal)
    ledger: UsageLedger = field(default_factory=UsageLedger)

    @classmethod
    def new(
        cls, *, registry: WorkerRegistry, quota: PlanQuota, placement: PlacementConfig
    ) -> CoreState:
        """Empty tables around ``registry`` and ``quota``, with placement policies set by ``placement``."""
        plans: dict[str, Plan] = {}
        return cls(registry=registry, quota=quota, placement=Placement(registry, plans, placement), plans=plans)
