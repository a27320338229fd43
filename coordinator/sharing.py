"""Shared fleets in the core (issue #27): fair share's bookkeeping, quotas, preemption and the usage ledger.

What it owns: the leases fair share counts (whose, holding what, since when), the fleet's
capacity as fair share divides it, the preemptions under way (the pure decision is
coordinator/placement/preemption.py's :class:`~coordinator.placement.preemption.Preemptor`) with
their deadlines, the workers a preemption made room on (*nominations*), and the usage ledger
(coordinator/ledger.py). The fair-share *order* is the queue's (``CoreState.queue``,
coordinator/placement/fair_queue.py); the teams, weights and quotas are the token file's
(coordinator/teams.py), handed in on start and on every reload (:meth:`Sharing.set_teams`).

Rules (docs/SEMANTICS.md §Shared fleets):

* **Leases.** A lease counts for its principal and team from its claim to its release, however
  it ends (done, reject, revoke, hand-back, drain deadline, its worker reaped or removed): the
  registry tells (:meth:`Sharing.lease_claimed`, :meth:`Sharing.lease_released`, called from
  coordinator/registry.py). A lease holds one slot, its plan's GPUs (a share plan: its
  fraction) and its KV blocks on that worker. Its end adds its run time to the ledger.
* **Capacity** is what the alive workers offer (GPUs, slots, KV blocks), taken again at the tick
  when the registry's membership changed (and at a claim while it is still nothing).
* **Quotas.** A submit past its team's ``max_queued`` is refused (``too_many_plans``, naming the
  team). A plan whose team is past ``max_gpus``/``max_running`` and may not borrow is not
  placed; one that may borrow takes only capacity no plan within its quota waits for. Either
  waits with the quota's reason (``team vision is at its quota of 8 GPUs``).
* **Preemption**, at each tick: the fair head of the queue (a plan that cannot be placed now)
  asks the preemptor for victims. Each victim's worker is sent ``preempt`` (``--preemption-grace``)
  and its stream gets ``preempted``; when its lease ends without succeeding (its ``done``, or the
  coordinator's own deadline, grace + :data:`BACKSTOP_S`, for a worker that does not stop it) the
  plan is queued again without charging an attempt, and the worker where its last victim let go
  is *nominated*: the waiting plan is placed there first (coordinator/scheduling.py).
* **Ledger.** Run time at each lease's end, receipts (tokens, joules, gCO2e) as ``done`` brings
  them, outcomes as plans end, preemptions as preempted attempts end, all under the principal's
  team of the moment, by wall-clock hour (the driver's ``wall_offset``).

Pure: the core hands in ``now`` (:attr:`Sharing.now`, set before each input) and the wall
offset; nothing here reads a clock or does I/O. Calls go down only: the scheduler, the worker
sessions and the client sessions call this; this calls the outbox and the streams.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final

import structlog

from coordinator.devices import pick
from coordinator.ledger import BUCKET_S, UsageLedger, UsageRow
from coordinator.placement.fair_queue import FairQueue
from coordinator.placement.fairshare import SLOT, Capacity, Demand
from coordinator.placement.plan_queue import Signature
from coordinator.placement.preemption import Preemptor, Running, Waiting
from coordinator.records import UsageRows
from coordinator.teams import TeamBook, quota_reason
from protocol.messages import GetUsage, Preempt, Receipt, Usage, UsageTotals

if TYPE_CHECKING:
    from coordinator.effects import Outbox
    from coordinator.placement.placer import Placement
    from coordinator.plans import Plan
    from coordinator.registry import WorkerRegistry
    from coordinator.streams import Streams
    from coordinator.workers import WorkerRecord

__all__ = ["BACKSTOP_S", "COUNTERS", "Sharing", "SharingConfig", "demand_of"]

log = structlog.get_logger(__name__)

#: A preempted attempt whose lease has not ended this long past its grace is taken back by the
#: coordinator (its worker is sent ``cancel``): a worker that ignores ``preempt`` (an older one) does
#: not hold the waiting plan up for ever. The worker's own stop takes the grace and then its kill
#: grace (SIGTERM to SIGKILL, 5 s by default).
BACKSTOP_S: Final = 10.0

COUNTERS: Final = ("plans_preempted", "preemptions_taken_back", "submits_over_team_quota")


@dataclass(frozen=True)
class SharingConfig:
    """The settings of shared fleets (``CoreConfig`` carries them; docs/OPERATIONS.md §Shared fleets)."""

    preemption_grace_s: float = 30.0  # a preempted plan has this long to checkpoint and end (``preempt.grace_s``)
    preemption_min_run_s: float = 10.0  # a plan runs at least this long before it may be preempted


_SLOT: Final = SLOT  # what most leases hold: one slot (this object: fair share tallies it, fairshare.py)


def demand_of(plan: Plan, kv_blocks: float = 0.0) -> Demand:
    """What a lease of the plan holds: its GPUs (a share plan: its fraction), one slot, ``kv_blocks``."""
    gpus = plan.gpus
    if gpus is None:
        return _SLOT if not kv_blocks else Demand(0.0, 1.0, kv_blocks)
    if gpus.shared:
        held = plan.resources.gpus if plan.resources is not None else 0.0
    else:
        held = float(gpus.count)
    return Demand(held, 1.0, kv_blocks)


# A lease fair share counts: (whose, its team then, what it holds, since when, preemptible). A plain tuple: one
# is made at every lease's start.
_Lease = tuple[str, str, Demand, float, bool]


class Sharing:
    """Fair share's leases and capacity, quotas at submit and placement, preemption, the usage ledger.

    Args:
        registry: the workers (capacity; the victims' workers; it calls :meth:`lease_claimed` and
            :meth:`lease_released`).
        plans: the core's plans by key.
        queue: the fair-share queue (``CoreState.queue``).
        placement: KV blocks a lease holds, whether a waiting plan fits once victims let go.
        outbox: ``preempt`` to workers.
        streams: the victims' ``preempted`` events.
        ledger: the usage ledger (``CoreState.ledger``).
        counters: the core's counters (:data:`COUNTERS`).
        config: grace and minimum run.

    Attributes:
        now: the time of the input being handled (the core sets it before each).
        wall_offset: Unix time minus ``now`` (the driver's; the ledger's hours are wall-clock hours).
        preemptor: preemptible leases and preemptions under way.
    """

    def __init__(
        self,
        *,
        registry: WorkerRegistry,
        plans: dict[str, Plan],
        queue: FairQueue,
        placement: Placement,
        outbox: Outbox,
        streams: Streams,
        ledger: UsageLedger,
        counters: dict[str, int],
        config: SharingConfig,
    ) -> None:
        self._registry = registry
        self._plans = plans
        self.queue = queue
        self._placement = placement
        self._outbox = outbox
        self._streams = streams
        self.ledger = ledger
        self._counters = counters
        counters.update(dict.fromkeys(COUNTERS, 0))
        self.config = config
        self.preemptor = Preemptor(config.preemption_min_run_s)
        self._shares = queue.shares  # one object for the queue's life (set_teams and set_capacity change it in place)
        self._fair = queue.fair
        self._tallies = queue.shares.fleet  # a lease of one slot is tallied inline (fairshare.py's module docstring)
        self.stopping_plans = self.preemptor.stopping_plans
        """Victims whose lease has not ended yet (a lease's end asks it without a call)."""
        self._waiting = self.preemptor.waiting_plans
        self.now = 0.0
        self.wall_offset = 0.0
        self._leases: dict[str, _Lease] = {}  # plan id -> its lease as fair share counts it
        self._capacity_stamp = -1  # the registry generation the capacity was taken at
        self._deadlines: dict[str, tuple[float, int]] = {}  # victim plan id -> (taken back at, its attempt)
        self.queued_quotas = False
        """Whether some team has ``max_queued`` (else a submit need not ask :meth:`submit_refusal`)."""
        self.quotas = False
        """Whether some team has ``max_gpus`` or ``max_running`` (else no plan is ever past a quota)."""
        self._counted = False  # whether the capacity was taken with a worker in it
        self.usage_due = False
        """The tick says the ledger's changed rows go to the store with the next effects (:meth:`usage_record`)."""
        self._folded_hour = 0  # the wall-clock hour the ledger was last folded in
        self.nominated: dict[str, str] = {}
        """Worker id -> the waiting plan a preemption made room for there (the scheduler places it first)."""

    # ------------------------------------------------------------------ teams and capacity

    @property
    def teams(self) -> TeamBook:
        """The team book in force."""
        return self.queue.shares.teams_book

    def set_teams(self, teams: TeamBook, now: float) -> None:
        """The token file was (re)loaded: new teams, weights and quotas; usage moves with principals."""
        if teams == self.teams:
            return
        running: dict[str, list[Demand]] = {}
        for owner, _, demand, _, _ in self._leases.values():
            running.setdefault(owner, []).append(demand)
        self.queue.set_teams(teams, running, now)
        self.preemptor.reteam(teams.team_of)
        self.queued_quotas = any(t.max_queued is not None for t in teams.teams)
        self.quotas = teams.quotas
        log.info("teams set", teams=sorted(t.name for t in teams.teams))

    def refresh_capacity(self, now: float) -> None:
        """Take the fleet's capacity again (alive workers' GPUs, slots and KV blocks) if its membership changed."""
        registry = self._registry
        if registry.generation == self._capacity_stamp:
            return
        self._capacity_stamp = registry.generation
        gpus = slots = kv_blocks = 0.0
        for record in registry.iter_alive(now):
            caps = record.capabilities
            gpus += len(caps.gpus)
            slots += caps.max_concurrency
            kv_blocks += caps.kv_blocks
        self._counted = slots > 0
        self.queue.set_capacity(Capacity(gpus, slots, kv_blocks), now)

    # ------------------------------------------------------------------ leases (the registry calls these)

    def lease_claimed(self, record: WorkerRecord, plan_id: str) -> None:
        """A lease began: its principal and team hold it from now on."""
        plan = self._plans.get(plan_id)
        if plan is None or plan_id in self._leases:
            return
        now = self.now
        if not self._counted:  # the first lease: the fleet must be counted before it
            self.refresh_capacity(now)
        if record.capabilities.kv_blocks:
            demand = demand_of(plan, float(self._placement.kv_need(plan, record)))
        else:
            demand = _SLOT if plan.gpus is None else demand_of(plan)
        owner = plan.owner
        account = self._shares.principal_accounts.get(owner)
        fleet = self._tallies
        if demand is _SLOT and fleet.late and account is not None and account.active:  # ShareBook.started's tally
            if not account.pending:
                account.pending = True
                fleet.dirty.append(account)
            account.pending_n += 1
            account.pending_s += now - account.since
            account.pending_at = now
            team = account.scope
        else:
            team = self._shares.started(owner, demand, now)  # FairQueue.started, without its two hops
        self._leases[plan_id] = (owner, team, demand, now, plan.preemptible)
        if self._waiting:
            self.preemptor.placed(plan_id)  # a waiting plan a preemption was under way for is placed
        if plan.preemptible:
            self.preemptor.started(Running(plan_id, owner, record.id, plan.priority, demand, now), team)

    def lease_released(self, record: WorkerRecord, plan_id: str) -> None:
        """A lease ended (however): its run time goes to the ledger, its usage is let go."""
        lease = self._leases.pop(plan_id, None)
        if lease is None:
            return
        now = self.now
        owner, team, demand, started_s, preemptible = lease
        account = self._shares.principal_accounts.get(owner)
        fleet = self._tallies
        if demand is _SLOT and fleet.late and account is not None and (
            account.waiting or account.running + account.pending_n > 1  # ShareBook.ended's tally: it stays active
        ):
            if not account.pending:
                account.pending = True
                fleet.dirty.append(account)
            account.pending_n -= 1
            account.pending_s -= now - account.since
            account.pending_at = now
        else:
            self._shares.ended(owner, demand, now)  # FairOrder.ended, without its hop:
            if self._fair.heaps:  # a heap holds keys: the new ones go where the owner and its team wait
                self._fair.rekeyed(owner, team)
        if demand is _SLOT:
            self.ledger.lease_ended(owner, team, now - started_s, now + self.wall_offset)
        else:
            self.ledger.lease_ended(owner, team, now - started_s, now + self.wall_offset, demand.slots, demand.gpus)
        if preemptible:
            self._deadlines.pop(plan_id, None)
            nominated = self.preemptor.ended(plan_id)
            if nominated is not None:
                waiting, where = nominated
                self.nominated[where] = waiting

    def holds(self, plan_id: str) -> bool:
        """Whether fair share counts a lease of the plan now."""
        return plan_id in self._leases

    def take_nomination(self, worker_id: str) -> str | None:
        """The waiting plan a preemption made room for on the worker, once (None: none)."""
        return self.nominated.pop(worker_id, None) if self.nominated else None

    # ------------------------------------------------------------------ quotas

    def held(self, plan: Plan, signature: Signature) -> bool:
        """Whether the plan may not be placed now: its team is past a quota and may not borrow."""
        return self.queue.held(plan.owner, signature)

    def quota_reason(self, plan: Plan) -> str | None:
        """Why the plan waits on its team's quota (``team vision is at its quota of 8 GPUs``); None: within it."""
        teams = self.teams
        name = teams.team_of(plan.owner)
        team = teams.team(name)
        if team.max_gpus is None and team.max_running is None:
            return None
        account = self.queue.shares.team_account(name)
        return quota_reason(team, account.running, account.gpus, demand_of(plan).gpus)

    def submit_refusal(self, principal: str) -> str | None:
        """Why a new plan of ``principal`` is refused (its team's ``max_queued`` is reached); None: it is not."""
        if not self.queued_quotas:
            return None
        teams = self.teams
        name = teams.team_of(principal)
        limit = teams.team(name).max_queued
        if limit is None:
            return None
        waiting = self.queue.waiting_of(name)
        if waiting < limit:
            return None
        self._counters["submits_over_team_quota"] += 1
        return (f"team {name} has {waiting} plans queued, its max_queued (the token file's [[team]] table); "
                "wait for some to start or cancel them")  # fmt: skip

    # ------------------------------------------------------------------ preemption

    def stopping(self, plan_id: str) -> bool:
        """Whether the plan's attempt was preempted and its lease has not ended yet."""
        return plan_id in self.stopping_plans

    def preempt(self, now: float) -> None:
        """The tick's preemption pass: the queue's fair head, if it cannot be placed, may stop preemptible plans."""
        preemptor, queue = self.preemptor, self.queue
        if not preemptor.candidates or not len(queue):
            return
        head = queue.best_for(_any)
        if head is None or preemptor.pending_for(head):
            return
        plan = self._plans[head]
        demand = demand_of(plan)
        decision = preemptor.decide(
            Waiting(plan.id, plan.owner, plan.priority, demand), queue.shares, now, self._fits_after(plan),
        )
        if decision is None:
            return
        grace = self.config.preemption_grace_s
        log.info("preempting", waiting=plan.id, victims=list(decision.victims), worker_id=decision.worker_id,
                 why=decision.why, reason=decision.reason)  # fmt: skip
        registry, plans = self._registry, self._plans
        for victim_id in decision.victims:
            victim = plans[victim_id]
            self._deadlines[victim_id] = (now + grace + BACKSTOP_S, victim.attempt)
            self._counters["plans_preempted"] += 1
            conn_id = registry.get(decision.worker_id).conn_id
            if conn_id is not None:
                self._outbox.send(
                    conn_id, Preempt(plan_id=victim_id, attempt=victim.attempt, grace_s=grace, reason=decision.reason)
                )
            data = {"reason": decision.reason, "grace_s": grace, "worker_id": decision.worker_id,
                    "attempt": victim.attempt}  # fmt: skip
            self._streams.emit(victim, "preempted", data, small=True)

    def overdue(self, now: float) -> list[str]:
        """Victims whose lease outlived their grace + :data:`BACKSTOP_S`: the coordinator takes them back."""
        if not self._deadlines:
            return []
        late: list[str] = []
        for plan_id in [p for p, (due, _) in self._deadlines.items() if due <= now]:
            _, attempt = self._deadlines.pop(plan_id)
            plan = self._plans.get(plan_id)
            if plan is not None and plan.attempt == attempt and plan_id in self._leases:
                late.append(plan_id)
        if late:
            self._counters["preemptions_taken_back"] += len(late)
        return late

    def _fits_after(self, plan: Plan) -> _FitsAfter:
        return _FitsAfter(plan, self._registry, self._placement, self.now)

    # ------------------------------------------------------------------ ledger

    def preempted(self, plan: Plan) -> None:
        """A preempted attempt of the plan ended without succeeding (the plan is queued again)."""
        self.ledger.preempted(plan.owner, self.teams.team_of(plan.owner), wall_s=self.now + self.wall_offset)

    def receipt(self, plan: Plan, receipt: Receipt) -> None:
        """An attempt of the plan ended with ``receipt``: its tokens, joules and gCO2e."""
        self.ledger.receipt(plan.owner, self.teams.team_of(plan.owner), receipt, wall_s=self.now + self.wall_offset)

    def plan_ended(self, plan: Plan) -> None:
        """The plan reached its terminal state (coordinator/streams.py calls it)."""
        state = plan.state
        if state == "succeeded" or state == "failed" or state == "cancelled":
            owner = plan.owner
            account = self._shares.principal_accounts.get(owner)  # its scope is the owner's team in the book
            team = account.scope if account is not None else self._shares.teams_book.team_of(owner)
            self.ledger.plan_ended(owner, team, state, self.now + self.wall_offset)

    def usage_record(self) -> UsageRows | None:
        """The ledger's rows changed since the last call, for the store (None: none changed)."""
        self.usage_due = False
        rows, deleted = self.ledger.take_dirty()
        if not rows and not deleted:
            return None
        return UsageRows([(r.hour_s, r.principal, r.team, r.values()) for r in rows], deleted)

    def restore_usage(self, rows: list[UsageRow]) -> None:
        """The ledger's rows a store kept (at start, before any usage is added)."""
        self.ledger.restore(rows)

    def tick(self, now: float) -> None:
        """The tick's bookkeeping: the ledger's rows go to the store, and once an hour its old hours fold."""
        self.usage_due = True
        hour = int((now + self.wall_offset) // BUCKET_S)
        if hour != self._folded_hour:
            self._folded_hour = hour
            self.ledger.fold(now + self.wall_offset)

    def usage(self, msg: GetUsage, principal: str, admin: bool) -> Usage:
        """The answer to ``get_usage``: every principal's or team's totals for an admin, a client's own."""
        since = msg.since if msg.since > 0 else None
        only = None if admin else (principal,)
        totals = self.ledger.totals(msg.by, since_s=since, only=only)
        teams = self.teams
        rows = [
            UsageTotals(
                name=name, team=teams.team_of(name) if msg.by == "principal" else "", succeeded=t.succeeded,
                failed=t.failed, cancelled=t.cancelled, slot_seconds=t.slot_s, gpu_seconds=t.gpu_s, tokens=t.tokens,
                joules=t.joules, co2e_g=t.co2e_g, preemptions=t.preemptions, avoided_co2e_g=t.avoided_co2e_g,
            )
            for name, t in sorted(totals.items())
        ]
        return Usage(req_id=msg.req_id, by=msg.by, since=msg.since, rows=rows)


def _any(signature: Signature) -> bool:
    return True


class _FitsAfter:
    """Whether a waiting plan fits a worker once some victims there let go (the preemptor's ``fits_after``)."""

    __slots__ = ("_now", "_placement", "_plan", "_registry", "_signature")

    def __init__(self, plan: Plan, registry: WorkerRegistry, placement: Placement, now: float) -> None:
        self._plan = plan
        self._registry = registry
        self._placement = placement
        self._now = now
        self._signature = Signature.of(plan.op, plan.requirements, plan.avoid, plan.gpus)

    def __call__(self, worker_id: str, victims: Sequence[Running]) -> bool:
        registry = self._registry
        if worker_id not in registry or not registry.is_alive(worker_id, self._now):
            return False
        record = registry.get(worker_id)
        caps = record.capabilities
        if record.draining or not self._signature.admits(record):
            return False
        if len(record.leases) - len(victims) >= caps.max_concurrency:  # a free slot, not a place in its queue
            return False
        plan = self._plan
        if plan.gpus is not None:
            use = list(record.gpu_use)
            for victim in victims:
                for i in record.gpu_held.get(victim.plan_id, ()):
                    if i < len(use):
                        use[i] = max(0, use[i] - 1)
            if pick(plan.gpus, caps, use) is None:
                return False
        if caps.kv_blocks > 0:
            need = self._placement.kv_need(plan, record)
            freed = sum(int(v.demand.kv_blocks) for v in victims)
            if need and self._placement.kv_reserved(record) - freed + need > caps.kv_blocks:
                return False
        return True
