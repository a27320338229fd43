"""Preemption: which running plan to stop so that a waiting one can run (issue #27).

What it owns: the preemptible plans that hold leases now (by team, in start order), the
preemptions under way (victims in their grace, the waiting plan each was stopped for, the worker
where that plan is nominated), and :meth:`Preemptor.decide`, the decision itself. The usage and
keys it reads are the :class:`~coordinator.placement.fairshare.ShareBook`'s; the caller (the
scheduler) says whether a set of victims would make room on their worker (``fits_after``), sends
``preempt`` to the worker, and requeues the victims without charging an attempt.

Rules (docs/SEMANTICS.md §Preemption), tried in this order for a waiting plan W of team T that
cannot be placed now:

1. **Quota**: W keeps T within its quotas, and a team V past a quota (it borrowed) holds
   preemptible plans: its most recently started ones are stopped, no more than V's excess.
2. **Fair share**: W keeps T within its quotas, and a team V whose share key is above T's holds
   preemptible plans; V is the team furthest above (largest key), its most recently started plans
   go first, and only if afterwards T's key (with W) is still no larger than V's (without them).
3. **Priority**: a preemptible plan of W's own principal with a lower priority, most recently
   started first, if afterwards T's key is no smaller than before and T stays within its quotas.

Always: a victim is preemptible, has run at least ``min_run_s``, is not already stopping, and all
victims of one preemption are on one worker and of one team, few enough that W then fits there
(``fits_after``). A waiting plan with a preemption under way for it asks for no other. Usage is
counted *as it will be*: victims in their grace as gone, the plans they were stopped for as running.

Why there are no loops. Order the states of the fleet by (1) the total excess over quotas, less
is better, then (2) the team keys sorted ascending, compared lexicographically (leximin: the
worst-off team first), larger is better, then (3) the running plans' priorities, likewise. A
quota preemption lowers (1); a fair-share one leaves (1) no worse and raises the smaller of T's and
V's keys strictly (a plan always holds a slot, so keys move strictly: fairshare.py), which raises
(2); a priority one leaves (1) and (2) no worse and raises (3). Every preemption improves the
state, and there are finitely many: a set of plans cannot preempt its way around a cycle
(tests/unit/test_fair_properties.py checks it over random fleets).

Pure: ``now`` is handed in; no I/O.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Final, Literal

from coordinator.placement.fairshare import Capacity, Demand, ShareBook
from coordinator.teams import Team

__all__ = ["Preemption", "Preemptor", "Running", "Waiting", "share_key"]

Why = Literal["quota", "fair_share", "priority"]
MAX_VICTIMS: Final = 16  # victims one preemption may stop (on one worker): more would not be a decision but a purge
SCAN_BUDGET: Final = 4096  # candidate victims one decision looks at, at most


@dataclass(frozen=True, slots=True)
class Running:
    """A preemptible plan that holds a lease."""

    plan_id: str
    owner: str
    worker_id: str
    priority: int
    demand: Demand
    started_s: float  # when its lease began (its running time counts toward min_run_s from here)


@dataclass(frozen=True, slots=True)
class Waiting:
    """A queued plan that cannot be placed now."""

    plan_id: str
    owner: str
    priority: int
    demand: Demand


@dataclass(frozen=True, slots=True)
class Preemption:
    """A decision: stop ``victims`` on ``worker_id`` so that ``waiting`` runs there."""

    waiting: str
    victims: tuple[str, ...]
    worker_id: str
    why: Why
    reason: str  # for the victims' ``preempted`` events: who waited and why it may go first


@dataclass(slots=True)
class _Usage:
    gpus: float
    slots: float
    kv_blocks: float
    running: int

    def add(self, demand: Demand, sign: int) -> None:
        self.gpus += sign * demand.gpus
        self.slots += sign * demand.slots
        self.kv_blocks += sign * demand.kv_blocks
        self.running += sign


def share_key(gpus: float, slots: float, kv_blocks: float, weight: float, capacity: Capacity) -> tuple[float, ...]:
    """A team's shares of each resource over its weight, largest first (fairshare.py's key without service)."""
    def share(used: float, total: float) -> float:
        return used / total if total > 0 else used

    return tuple(sorted(
        (share(gpus, capacity.gpus) / weight, share(slots, capacity.slots) / weight,
         share(kv_blocks, capacity.kv_blocks) / weight),
        reverse=True,
    ))


@dataclass(slots=True)
class _Pending:
    waiting: Waiting
    victims: dict[str, Running] = field(default_factory=dict)
    worker_id: str = ""


class Preemptor:
    """Preemptible leases and preemptions under way; :meth:`decide` picks the victims.

    Args:
        min_run_s: a plan runs at least this long before it may be preempted.
    """

    def __init__(self, min_run_s: float = 10.0) -> None:
        self.min_run_s = min_run_s
        self._by_team: dict[str, dict[str, Running]] = {}  # team -> its preemptible leases, oldest start first
        self._team_of: dict[str, str] = {}  # preemptible plan id -> team
        self._stopping: dict[str, str] = {}  # victim plan id -> the waiting plan it was stopped for
        self._pending: dict[str, _Pending] = {}  # waiting plan id -> its preemption under way
        # Read-only views for the core's hot path (a lease's start and end ask them without a call).
        self.stopping_plans: Mapping[str, str] = self._stopping
        """The victims whose lease has not ended yet (plan id -> the waiting plan it was stopped for)."""
        self.waiting_plans: Mapping[str, object] = self._pending
        """The waiting plans a preemption is under way for."""

    # ------------------------------------------------------------------ leases

    def started(self, plan: Running, team: str) -> None:
        """A preemptible plan was leased (a plan that is not preemptible is never a victim: not told)."""
        self._by_team.setdefault(team, {})[plan.plan_id] = plan
        self._team_of[plan.plan_id] = team

    def ended(self, plan_id: str) -> tuple[str, str] | None:
        """A lease ended (done, lost, or stopped). When it was the last victim still stopping of a
        preemption, returns (the waiting plan it was for, the worker where it was made room for):
        place that plan there first, if it still waits."""
        team = self._team_of.pop(plan_id, None)
        if team is not None:
            of_team = self._by_team[team]
            of_team.pop(plan_id, None)
            if not of_team:
                del self._by_team[team]
        waiting = self._stopping.pop(plan_id, None)
        if waiting is None:
            return None
        pending = self._pending.get(waiting)
        if pending is None:
            return None
        pending.victims.pop(plan_id, None)
        if pending.victims:
            return None
        del self._pending[waiting]
        return waiting, pending.worker_id

    def placed(self, plan_id: str) -> None:
        """A waiting plan was placed or ended: a preemption under way for it no longer counts it as running.

        Its victims still stop (they were told) and are still counted as gone until they end.
        """
        pending = self._pending.pop(plan_id, None)
        if pending is not None:
            for victim in pending.victims:
                self._stopping[victim] = ""  # stopping for nobody now

    @property
    def candidates(self) -> bool:
        """Whether any preemptible plan holds a lease (else no decision can find a victim)."""
        return bool(self._by_team)

    def reteam(self, team_of: Callable[[str], str]) -> None:
        """The teams changed (a token file reload): each preemptible lease is filed under its owner's team now."""
        leases = [plan for plans in self._by_team.values() for plan in plans.values()]
        leases.sort(key=lambda p: p.started_s)  # start order within each team, as started() keeps it
        self._by_team.clear()
        self._team_of.clear()
        for plan in leases:
            self.started(plan, team_of(plan.owner))

    def stopping(self, plan_id: str) -> bool:
        """Whether the plan was preempted and its lease has not ended yet."""
        return plan_id in self._stopping

    def pending_for(self, plan_id: str) -> bool:
        """Whether a preemption is under way for this waiting plan."""
        return plan_id in self._pending

    # ------------------------------------------------------------------ decision

    def decide(
        self, waiting: Waiting, book: ShareBook, now: float,
        fits_after: Callable[[str, Sequence[Running]], bool],
    ) -> Preemption | None:
        """Which preemptible plans to stop so that ``waiting`` can run (module docstring), or None.

        ``fits_after(worker_id, victims)``: whether ``waiting`` can be placed on the worker once
        ``victims`` (all on it) let go of their leases. The decision is recorded: its victims
        count as gone and ``waiting`` as running until they end (:meth:`ended`).
        """
        if waiting.plan_id in self._pending or not self._by_team:
            return None
        team = book.team_of(waiting.owner)
        usage = self._projected(book)
        mine = usage.get(team) or _Usage(0.0, 0.0, 0.0, 0)
        quota = book.team(team)
        if quota.over_quota(mine.running, mine.gpus, waiting.demand.gpus):
            return None  # a plan that would borrow only takes idle capacity
        capacity = book.capacity
        weight = quota.weight
        key_now = share_key(mine.gpus, mine.slots, mine.kv_blocks, weight, capacity)
        with_w = _Usage(mine.gpus, mine.slots, mine.kv_blocks, mine.running)
        with_w.add(waiting.demand, 1)
        key_with = share_key(with_w.gpus, with_w.slots, with_w.kv_blocks, weight, capacity)
        keys = {
            name: share_key(u.gpus, u.slots, u.kv_blocks, book.team(name).weight, capacity)
            for name, u in usage.items() if name in self._by_team
        }
        budget = [SCAN_BUDGET]
        # 1. quota: teams past a quota, furthest above their share first
        for victim_team in sorted((n for n in self._by_team if n != team), key=lambda n: keys[n], reverse=True):
            other = book.team(victim_team)
            found = self._pick(
                waiting, victim_team, now, fits_after, budget, lowest_first=False,
                allow=_quota_allows(other, usage[victim_team]),
            )
            if found is not None:
                return self._record(waiting, found, "quota",
                                    f"team {team} is within its quota and team {victim_team} borrowed beyond its own")
        # 2. fair share: teams with a larger key, largest first
        for victim_team in sorted((n for n in self._by_team if n != team and keys[n] > key_now),
                                  key=lambda n: keys[n], reverse=True):
            other_weight = book.team(victim_team).weight
            base = usage[victim_team]

            def fair(victims: Sequence[Running], base: _Usage = base, other_weight: float = other_weight) -> bool:
                after = _Usage(base.gpus, base.slots, base.kv_blocks, base.running)
                for v in victims:
                    after.add(v.demand, -1)
                return key_with <= share_key(after.gpus, after.slots, after.kv_blocks, other_weight, capacity)

            found = self._pick(waiting, victim_team, now, fits_after, budget, lowest_first=False, allow=fair)
            if found is not None:
                return self._record(
                    waiting, found, "fair_share",
                    f"team {team} is below its share (key {key_now[0]:.3f}) and team {victim_team} is above it "
                    f"({keys[victim_team][0]:.3f})",
                )
        # 3. priority: the same principal's lower-priority plans
        if team in self._by_team:

            def lower(victims: Sequence[Running]) -> bool:
                after = _Usage(with_w.gpus, with_w.slots, with_w.kv_blocks, with_w.running)
                for v in victims:
                    if v.owner != waiting.owner or v.priority >= waiting.priority:
                        return False
                    after.add(v.demand, -1)
                if quota.beyond_quota(after.running, after.gpus):
                    return False
                return share_key(after.gpus, after.slots, after.kv_blocks, weight, capacity) >= key_now

            found = self._pick(waiting, team, now, fits_after, budget, lowest_first=True, allow=lower)
            if found is not None:
                return self._record(waiting, found, "priority",
                                    f"a plan of {waiting.owner} with priority {waiting.priority} waits")
        return None

    def _pick(
        self, waiting: Waiting, team: str, now: float, fits_after: Callable[[str, Sequence[Running]], bool],
        budget: list[int], *, lowest_first: bool, allow: Callable[[Sequence[Running]], bool],
    ) -> tuple[str, tuple[Running, ...]] | None:
        """Victims of ``team`` on one worker that ``allow`` accepts and that make room: (worker, victims) or None.

        Candidates go most recently started first (lowest priority first for ``lowest_first``); on each
        worker they pile up until the waiting plan fits there, or ``allow`` refuses the pile.
        """
        piles: dict[str, list[Running]] = {}
        closed: set[str] = set()
        for plan in self._candidates(team, now, lowest_first, waiting.owner if lowest_first else None):
            if budget[0] <= 0:
                return None
            budget[0] -= 1
            if plan.worker_id in closed:
                continue
            pile = piles.setdefault(plan.worker_id, [])
            pile.append(plan)
            if not allow(pile):
                closed.add(plan.worker_id)
                continue
            if fits_after(plan.worker_id, pile):
                return plan.worker_id, tuple(pile)
            if len(pile) >= MAX_VICTIMS:
                closed.add(plan.worker_id)
        return None

    def _candidates(self, team: str, now: float, lowest_first: bool, owner: str | None) -> Iterator[Running]:
        plans = self._by_team.get(team, {})
        ready = (
            p for p in reversed(plans.values())
            if p.plan_id not in self._stopping and now - p.started_s >= self.min_run_s
            and (owner is None or p.owner == owner)
        )
        if not lowest_first:
            return ready
        return iter(sorted(ready, key=lambda p: p.priority))  # stable: the most recent first within a priority

    def _record(self, waiting: Waiting, found: tuple[str, tuple[Running, ...]], why: Why, reason: str) -> Preemption:
        worker_id, victims = found
        self._pending[waiting.plan_id] = _Pending(waiting, {v.plan_id: v for v in victims}, worker_id)
        for victim in victims:
            self._stopping[victim.plan_id] = waiting.plan_id
        return Preemption(waiting.plan_id, tuple(v.plan_id for v in victims), worker_id, why, reason)

    def _projected(self, book: ShareBook) -> dict[str, _Usage]:
        """Each team's usage as it will be: victims stopping count as gone, the plans they make room for as running."""
        usage: dict[str, _Usage] = {}
        for name, account in book.teams():
            usage[name] = _Usage(account.gpus, account.slots, account.kv_blocks, account.running)
        for victim_id in self._stopping:
            team = self._team_of.get(victim_id)
            if team is not None:
                usage.setdefault(team, _Usage(0.0, 0.0, 0.0, 0)).add(self._by_team[team][victim_id].demand, -1)
        for pending in self._pending.values():
            owner_team = book.team_of(pending.waiting.owner)
            usage.setdefault(owner_team, _Usage(0.0, 0.0, 0.0, 0)).add(pending.waiting.demand, 1)
        return usage


def _quota_allows(team: Team, usage: _Usage) -> Callable[[Sequence[Running]], bool]:
    """Victims of a team past a quota: each must still find its team past it before it goes."""

    def allow(victims: Sequence[Running]) -> bool:
        left = _Usage(usage.gpus, usage.slots, usage.kv_blocks, usage.running)
        for victim in victims:
            if not team.beyond_quota(left.running, left.gpus):
                return False
            if not (team.max_running is not None and left.running > team.max_running) and victim.demand.gpus <= 0:
                return False  # past max_gpus only: a victim without GPUs lowers no excess
            left.add(victim.demand, -1)
        return True

    return allow
