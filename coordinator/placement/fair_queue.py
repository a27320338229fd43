"""The fair-share plan queue: which waiting plan a free worker gets next (issue #27).

A layer on :class:`~coordinator.placement.plan_queue.PlanQueue`: plans are still grouped by
:class:`~coordinator.placement.plan_queue.Signature`, so a worker with room is matched against
the few signatures it can run, never the many plans. What changes is the order within and
between groups (docs/SEMANTICS.md §Fair share):

1. quota tier: plans of teams within their quotas first, then plans that would borrow beyond a
   quota; a team past a quota with ``borrow = false`` is not offered at all (coordinator/teams.py);
2. the team's share key, smallest first (coordinator/placement/fairshare.py: its weighted
   dominant-share service so far plus what it holds now, counted for a horizon);
3. within the team, the principal's share key;
4. within the principal, higher priority first, then older first.

Theory of operation. Each group holds a heap of teams keyed ``(tier, team key)``; each team part a
heap of its principals keyed by the principal's key; each principal a heap of its plans keyed
``(-priority, order)``. The head of a group walks down the three heaps: O(1) when nothing changed.
Keys change when a team's or principal's usage changes (a plan of theirs is leased or lets go of
its lease: :meth:`FairQueue.started`, :meth:`FairQueue.ended`): the new key is pushed into each
group where the team (or principal) has waiting plans, and the old entry, whose version is now
stale, is dropped when it surfaces. That is O(g log t) per change for a team waiting in g groups
among t teams, and a decision (:meth:`PlanQueue.best_for`) costs O(log n) amortised per group
looked at: nothing scans the waiting plans or the teams. A heap whose stale entries outnumber its
live ones is rebuilt.

The driver's tick (:meth:`FairQueue.advance`), capacity changes (workers come or go) and
token-file reloads move every key: the groups' team and principal heaps are rebuilt, O(teams and
principals waiting, per group), never O(plans).

Pure: no clock, no I/O.
"""

from __future__ import annotations

import heapq
from typing import Any

from coordinator.placement.fairshare import NO_CAPACITY, Capacity, Demand, ShareBook
from coordinator.placement.plan_queue import PlanQueue, Signature
from coordinator.teams import TeamBook

__all__ = ["TIER_BORROW", "TIER_HELD", "TIER_WITHIN", "FairOrder", "FairQueue"]

TIER_WITHIN = 0  # the team stays within its quotas with this plan
TIER_BORROW = 1  # the plan would take its team past a quota: only capacity nobody else waits for
TIER_HELD = 2  # past a quota and the team may not borrow: not offered
# A share plan's fraction of a device is not part of its signature: against max_gpus it counts as "some".
SHARE_NEED = 1e-6


class _TeamPart:
    """One team's waiting plans in one group: its principals' heap and each principal's plans."""

    __slots__ = ("count", "counts", "indexed", "plans", "principals", "pushed")

    def __init__(self) -> None:
        self.indexed = False  # whether ``principals`` is kept (only with two principals or more)
        self.count = 0
        self.counts: dict[str, int] = {}  # principal -> live plans here
        self.plans: dict[str, list[tuple[int, int, int, str]]] = {}  # principal -> heap (-priority, order, token, id)
        self.principals: list[tuple[tuple[float, ...], int, str]] = []  # heap (key, version, principal)
        self.pushed: dict[str, int] = {}  # principal -> version of its newest entry in ``principals``
        # The team's newest entry in the group's heap has version pushed[""] (no principal is named "").


class _FairPart:
    """One group's teams: a heap of ``(tier, key, version, team)`` and each team's part."""

    __slots__ = ("indexed", "members", "teams")

    def __init__(self) -> None:
        self.indexed = False  # whether ``teams`` is kept (only with two teams or more: one needs no order)
        self.teams: list[tuple[int, tuple[float, ...], int, str]] = []
        self.members: dict[str, _TeamPart] = {}


class FairOrder:
    """The fair-share order of a :class:`~coordinator.placement.plan_queue.PlanQueue`'s groups (module docstring).

    The plan queue keeps its groups and indexes and hands each group's plans to this order
    (:meth:`push`, :meth:`discard`), which says who heads each group (:meth:`head`). It keeps
    its own record of which plans are queued, with their owners.

    Args:
        teams: who is in which team, weights, quotas.
        capacity: the fleet's totals now.
    """

    def __init__(self, teams: TeamBook | None = None, capacity: Capacity = NO_CAPACITY) -> None:
        self.shares = ShareBook(teams, capacity)
        self._entries: dict[str, tuple[Signature, int]] = {}  # queued plan id -> (its group, its live token)
        self._parts: dict[Signature, _FairPart] = {}
        self._owners: dict[str, tuple[str, str]] = {}  # queued plan id -> (its principal, its team when pushed)
        # team -> the groups it waits in, with their parts; principal -> the groups it waits in, with its team's
        # part there (a lease's end visits them without hashing a signature: coordinator/placement/plan_queue.py)
        self._team_groups: dict[str, dict[Signature, _FairPart]] = {}
        self._principal_groups: dict[str, dict[Signature, _TeamPart]] = {}
        self.heaps = 0
        """Groups whose teams, and team parts whose principals, are kept in a heap (``indexed``): while there are
        none, a lease's end moves no entry (:meth:`rekeyed`)."""

    # ------------------------------------------------------------------ queue

    def push(self, plan_id: str, signature: Signature, token: int, priority: int, order: int, owner: str) -> bool:
        """A plan of ``owner`` joins the group (a plan already queued moves). True if the group had no plan."""
        return self._push(plan_id, signature, token, priority, order, owner, True)

    def _push(
        self, plan_id: str, signature: Signature, token: int, priority: int, order: int, owner: str, tell: bool,
    ) -> bool:
        if plan_id in self._entries:
            self.discard(plan_id)
        self._entries[plan_id] = (signature, token)
        shares = self.shares
        team = shares.teams_book.team_of(owner)
        self._owners[plan_id] = (owner, team)
        part = self._parts.get(signature)
        if part is None:
            part = self._parts[signature] = _FairPart()
        empty = not part.members
        if tell and owner not in self._principal_groups:  # it waited nowhere: it (and maybe its team) becomes active
            shares.queued(owner, 1)  # before the keys are read: a team that comes back is lifted first
        member = part.members.get(team)
        if member is None:
            member = part.members[team] = _TeamPart()
            self._team_groups.setdefault(team, {})[signature] = part
            self._push_team(part, member, team, signature)
        if owner not in member.counts:
            member.counts[owner] = 0
            member.plans[owner] = []
            self._principal_groups.setdefault(owner, {})[signature] = member
            self._push_principal(member, owner)
        member.count += 1
        member.counts[owner] += 1
        heapq.heappush(member.plans[owner], (-priority, order, token, plan_id))
        return empty

    def discard(self, plan_id: str) -> bool:
        """A plan left the queue (its heap entry is dropped when it surfaces). True if it was queued."""
        entry = self._entries.pop(plan_id, None)
        if entry is None:
            return False
        owner, team = self._owners.pop(plan_id)  # the team it was pushed under: its part is there
        signature = entry[0]
        part = self._parts[signature]
        member = part.members[team]
        member.count -= 1
        member.counts[owner] -= 1
        if not member.counts[owner]:
            del member.counts[owner], member.plans[owner]
            member.pushed.pop(owner, None)
            _unindex(self._principal_groups, owner, signature)
            if owner not in self._principal_groups:  # its last queued plan: it waits nowhere now
                self.shares.queued(owner, -1)
            if len(member.counts) < 2 and member.indexed:
                member.indexed = False
                self._heap_count(-1)
        if not member.count:
            del part.members[team]
            _unindex(self._team_groups, team, signature)
            if len(part.members) < 2 and part.indexed:
                part.indexed = False
                self._heap_count(-1)
        return True

    def owner_of(self, plan_id: str) -> str | None:
        """The principal of a queued plan."""
        found = self._owners.get(plan_id)
        return None if found is None else found[0]

    # ------------------------------------------------------------------ one owner (the plan queue's solo)

    def sleeps(self) -> bool:
        """Whether one principal's plans may wait without this order: their order is priority then age, unless a
        quota may hold its team back (coordinator/placement/plan_queue.py keeps them then)."""
        return not self.shares.teams_book.quotas

    def waits(self, owner: str, delta: int) -> None:
        """The principal's plans began (1) or ceased (-1) to wait while the plan queue kept them."""
        self.shares.queued(owner, delta)

    def adopt(self, owner: str, entries: list[tuple[str, Signature, int, int, int]]) -> None:
        """The plans the plan queue kept (all of ``owner``, who waits already), in this order from now on."""
        for plan_id, signature, token, priority, order in entries:
            self._push(plan_id, signature, token, priority, order, owner, False)

    def reset(self) -> None:
        """The queue is empty (every plan was discarded): the groups' parts go."""
        self._parts.clear()

    def head(self, signature: Signature) -> tuple[Any, ...] | None:
        """The group's fair head: ``(tier, team key, principal key, -priority, order, token, plan id)``.

        A group of one team (a team part of one principal) needs no heap to say who is first.
        """
        part = self._parts.get(signature)
        if part is None or not part.members:
            return None
        shares = self.shares
        teams = shares.team_accounts
        members = part.members
        if len(members) == 1:
            team, member = next(iter(members.items()))
            tier = self._tier(team, signature) if shares.teams_book.quotas else TIER_WITHIN
            team_key = teams[team].key
        else:
            tier, team_key, team, member = self._first_team(part, signature)
        principals = shares.principal_accounts
        if len(member.counts) == 1:
            owner = next(iter(member.counts))
            key = principals[owner].key
        else:
            key, owner = self._first_principal(member)
        plans = member.plans[owner]
        live = self._entries
        while plans:
            entry = plans[0]
            if live.get(entry[3]) == (signature, entry[2]):
                return (tier, team_key, key, *entry)
            heapq.heappop(plans)
        raise AssertionError(f"principal {owner!r} counted in group {signature} with no live plan")

    def first(self, signature: Signature) -> str | None:
        """The group's head plan if it may be placed now (a team past a quota that may not borrow: None).

        What :meth:`head` says without the keys that order heads across groups: a group of one team and
        one principal reads no key at all (the plan queue asks this when it looks at one group only).
        """
        part = self._parts.get(signature)
        if part is None or not part.members:
            return None
        members = part.members
        if len(members) == 1:
            team, member = next(iter(members.items()))
            if self.shares.teams_book.quotas and self._tier(team, signature) == TIER_HELD:
                return None
            if len(member.counts) == 1:
                plans, live = member.plans[next(iter(member.counts))], self._entries
                while plans:
                    entry = plans[0]
                    if live.get(entry[3]) == (signature, entry[2]):
                        return entry[3]
                    heapq.heappop(plans)
        head = self.head(signature)
        return None if head is None or head[0] == TIER_HELD else str(head[-1])

    def _first_team(self, part: _FairPart, signature: Signature) -> tuple[int, tuple[float, ...], str, _TeamPart]:
        """The top of a group's team heap, stale entries replaced on the way."""
        teams = self.shares.team_accounts
        heap = part.teams
        while heap:
            tier, team_key, version, team = heap[0]
            member = part.members.get(team)
            current = teams[team].version
            if member is not None and current == version:
                return tier, team_key, team, member
            heapq.heappop(heap)
            if member is not None and member.pushed[""] != current:  # its key grew: see rekeyed
                self._push_team(part, member, team, signature)
        raise AssertionError(f"group {signature} has teams and no team entry")

    def _first_principal(self, member: _TeamPart) -> tuple[tuple[float, ...], str]:
        """The top of a team part's principal heap, stale entries replaced on the way."""
        principals = self.shares.principal_accounts
        heap = member.principals
        while heap:
            key, version, owner = heap[0]
            present = owner in member.counts
            current = principals[owner].version
            if present and current == version:
                return key, owner
            heapq.heappop(heap)
            if present and member.pushed[owner] != current:
                self._push_principal(member, owner)
        raise AssertionError("a team part has principals and no principal entry")

    def holds(self, signature: Signature) -> bool:
        """Whether the group has a queued plan (members are counted: no heap to look at)."""
        part = self._parts.get(signature)
        return part is not None and bool(part.members)

    @staticmethod
    def offered(head: tuple[Any, ...]) -> bool:
        """Whether a group's head may be placed: not of a team past a quota that may not borrow."""
        return bool(head[0] != TIER_HELD)

    def drop(self, signature: Signature) -> None:
        """The plan queue dropped the (empty) group."""
        self._parts.pop(signature, None)

    def has_ahead(self, signature: Signature, priority: int, order: int, owner: str) -> bool:
        """Whether the group holds a plan that comes before a newcomer of ``owner``, ``priority`` and ``order``."""
        part = self._parts.get(signature)
        if part is None or not part.members:
            return False
        shares = self.shares
        team = shares.teams_book.team_of(owner)
        member = part.members.get(team)
        if member is not None and len(part.members) == 1 and len(member.counts) == 1 and owner in member.counts:
            # Only the newcomer's own principal waits here: same tier and keys, so priority and age decide.
            plans, live = member.plans[owner], self._entries
            while plans:
                entry = plans[0]
                if live.get(entry[3]) == (signature, entry[2]):
                    return entry[:2] < (-priority, order)
                heapq.heappop(plans)
        head = self.head(signature)
        if head is None:
            return False
        mine = (self._tier(team, signature), shares.team_account(team).key,
                shares.principal_account(owner).key, -priority, order)
        return bool(head[:5] < mine)

    def plans_in(self, signature: Signature) -> list[str]:
        """The queued plans of one signature, in the order the keys give now (they move as plans start and end)."""
        part = self._parts.get(signature)
        if part is None:
            return []
        live = self._entries
        shares = self.shares
        ranked: list[tuple[Any, ...]] = []
        for team, member in part.members.items():
            team_key = (self._tier(team, signature), shares.team_account(team).key)
            for owner, plans in member.plans.items():
                owner_key = shares.principal_account(owner).key
                ranked.extend(
                    (team_key, owner_key, e) for e in plans if live.get(e[3]) == (signature, e[2])
                )
        ranked.sort()
        return [entry[3] for _, _, entry in ranked]

    def entries(self, signature: Signature) -> list[tuple[str, int, int, str]]:
        """The group's queued plans as (id, priority, order, owner), by priority then age (a forgiven group's move)."""
        part = self._parts.get(signature)
        if part is None:
            return []
        live = self._entries
        found = sorted(
            (entry, owner) for member in part.members.values() for owner, plans in member.plans.items()
            for entry in plans if live.get(entry[3]) == (signature, entry[2])
        )
        return [(plan_id, -neg_priority, order, owner) for (neg_priority, order, _, plan_id), owner in found]

    def waiting_of(self, team: str) -> int:
        """Plans of a team waiting now (for its ``max_queued``): O(groups it waits in)."""
        parts = self._team_groups.get(team)
        return 0 if parts is None else sum(part.members[team].count for part in parts.values())

    def tier_of(self, owner: str, signature: Signature) -> int:
        """The quota tier a plan of ``owner`` in ``signature`` has now: TIER_WITHIN, TIER_BORROW or TIER_HELD."""
        return self._tier(self.shares.team_of(owner), signature)

    # ------------------------------------------------------------------ usage

    def started(self, owner: str, demand: Demand, now: float) -> None:
        """A plan of ``owner`` was leased at ``now`` (taken out of the queue first): its team's and its keys grow.

        Nothing is pushed: the old, smaller entries surface first and are replaced then (:meth:`head`).
        """
        self.shares.started(owner, demand, now)

    def ended(self, owner: str, demand: Demand, now: float, team: str | None = None) -> None:
        """A leased plan of ``owner`` (of ``team``, when the caller knows it) let go of its lease at ``now``: its
        keys move (mostly shrink)."""
        self.shares.ended(owner, demand, now)
        if self.heaps:  # else no heap holds a key: nothing to push (one team and one principal per group)
            self.rekeyed(owner, team)

    def advance(self, now: float) -> None:
        """The driver's tick: keys are read at ``now`` (the service of running leases counted up to it)."""
        if now > self.shares.now:
            self.shares.advance(now)
            self._rebuild()

    def set_capacity(self, capacity: Capacity, now: float) -> None:
        """The fleet's totals changed (workers came, left, drained): every key moves."""
        if self.shares.set_capacity(capacity, now):
            self._rebuild()

    def set_teams(self, teams: TeamBook, running: dict[str, list[Demand]], now: float) -> None:
        """A new team book (the token file was reloaded).

        Args:
            running: principal -> the demands of its leased plans (principals that moved team
                carry their usage with them).
            now: when.
        """
        moved = {p: (demands, 0) for p, demands in running.items()}  # queued plans are taken out and put back
        entries: list[tuple[str, Signature, int, int, int, str]] = []
        for signature, part in self._parts.items():
            for member in part.members.values():
                for owner, plans in member.plans.items():
                    live = [e for e in plans if self._entries.get(e[3]) == (signature, e[2])]
                    entries.extend((e[3], signature, e[2], -e[0], e[1], owner) for e in live)
        # Taken out under the old book (discard reads it), put back under the new one.
        for plan_id, *_ in entries:
            self.discard(plan_id)
        self.shares.set_teams(teams, moved, now)
        self._parts.clear()
        self._team_groups.clear()
        self._principal_groups.clear()
        # (every plan was discarded: no part and no heap is left, so heaps is 0 and the book is told so)
        for plan_id, signature, token, priority, order, owner in entries:
            self.push(plan_id, signature, token, priority, order, owner)

    def _tier(self, team: str, signature: Signature) -> int:
        shares = self.shares
        if not shares.teams_book.quotas:
            return TIER_WITHIN
        quota = shares.team(team)
        if quota.max_running is None and quota.max_gpus is None:
            return TIER_WITHIN
        account = shares.team_account(team)
        if not quota.over_quota(account.running, account.gpus, _need(signature).gpus):
            return TIER_WITHIN
        return TIER_BORROW if quota.borrow else TIER_HELD

    def _team_entry(self, team: str, signature: Signature) -> tuple[int, tuple[float, ...], int, str]:
        account = self.shares.team_account(team)
        return (self._tier(team, signature), account.key, account.version, team)

    def _push_team(self, part: _FairPart, member: _TeamPart, team: str, signature: Signature) -> None:
        """Put the team's current key in the group's heap (kept only from two teams on: see :meth:`_head`)."""
        if len(part.members) < 2:
            return
        heap = part.teams
        if not part.indexed or len(heap) > 2 * len(part.members) + 8:  # new, or mostly stale: one per team
            self._index_teams(part, signature)
            return
        entry = self._team_entry(team, signature)
        member.pushed[""] = entry[2]
        heapq.heappush(heap, entry)

    def _index_teams(self, part: _FairPart, signature: Signature) -> None:
        heap = part.teams
        heap[:] = [self._team_entry(t, signature) for t in part.members]
        heapq.heapify(heap)
        for entry in heap:
            part.members[entry[3]].pushed[""] = entry[2]
        if not part.indexed:
            part.indexed = True
            self._heap_count(1)

    def _push_principal(self, member: _TeamPart, owner: str) -> None:
        """Put the principal's current key in the team part's heap (kept only from two principals on)."""
        if len(member.counts) < 2:
            return
        heap = member.principals
        if not member.indexed or len(heap) > 2 * len(member.counts) + 8:
            self._index_principals(member)
            return
        entry = self._principal_entry(owner)
        member.pushed[owner] = entry[1]
        heapq.heappush(heap, entry)

    def _index_principals(self, member: _TeamPart) -> None:
        heap = member.principals
        heap[:] = [self._principal_entry(p) for p in member.counts]
        heapq.heapify(heap)
        for entry in heap:
            member.pushed[entry[2]] = entry[1]
        if not member.indexed:
            member.indexed = True
            self._heap_count(1)

    def rekeyed(self, owner: str, team: str | None = None) -> None:
        """A lease of the owner ended: push its team's and its own new keys where they wait.

        Keys grow when a lease starts or an account comes back (the lift): the old entries,
        smaller, surface before they would be due and are replaced by :meth:`head`, so a start
        pushes nothing. An end moves them either way (mostly down: the rate falls), so its new
        keys are pushed into the O(groups) heaps where the team and the principal wait.
        """
        shares = self.shares
        if team is None:
            team = shares.teams_book.team_of(owner)
        parts = self._team_groups.get(team)
        if parts:  # both accounts exist: the lease that ended was counted on them
            version = shares.team_accounts[team].version
            for signature, part in parts.items():
                if part.indexed:  # else one team waits there: no heap (the usual case)
                    member = part.members[team]
                    if member.pushed[""] != version:
                        self._push_team(part, member, team, signature)
        members = self._principal_groups.get(owner)
        if members:
            version = shares.principal_accounts[owner].version
            for member in members.values():
                if member.indexed and member.pushed[owner] != version:
                    self._push_principal(member, owner)

    def _heap_count(self, delta: int) -> None:
        """One heap more (``delta`` 1) or less (-1). The share book tallies SLOT leases only while no heap holds
        keys (coordinator/placement/fairshare.py): the first heap has it count what it tallied, and stop tallying."""
        before = self.heaps
        self.heaps = before + delta
        if not before or not self.heaps:
            self.shares.keyed(bool(self.heaps))

    def _principal_entry(self, owner: str) -> tuple[tuple[float, ...], int, str]:
        account = self.shares.principal_account(owner)
        return (account.key, account.version, owner)

    def _rebuild(self) -> None:
        """Every key moved: each group's heaps anew from its members."""
        for signature, part in self._parts.items():
            if len(part.members) > 1:
                self._index_teams(part, signature)
            for member in part.members.values():
                if len(member.counts) > 1:
                    self._index_principals(member)


def _need(signature: Signature) -> Demand:
    """What one plan of a group holds: its GPUs (a share plan: a sliver) and a slot; KV blocks depend on the worker."""
    gpus = signature.gpus
    return Demand(0.0 if gpus is None else (SHARE_NEED if gpus.shared else float(gpus.count)), 1.0, 0.0)


def _unindex(index: dict[str, dict[Signature, Any]], name: str, signature: Signature) -> None:
    groups = index.get(name)
    if groups is not None:
        groups.pop(signature, None)
        if not groups:
            del index[name]



class FairQueue(PlanQueue):
    """A :class:`~coordinator.placement.plan_queue.PlanQueue` in fair-share order: its :class:`FairOrder`,
    with the order's usage calls at hand.

    Args:
        teams: who is in which team, weights, quotas.
        capacity: the fleet's totals now.
    """

    def __init__(self, teams: TeamBook | None = None, capacity: Capacity = NO_CAPACITY) -> None:
        self.fair = FairOrder(teams, capacity)
        super().__init__(self.fair)

    @property
    def shares(self) -> ShareBook:
        """Usage, service and keys per team and principal."""
        return self.fair.shares

    def owner_of(self, plan_id: str) -> str | None:
        """The principal of a queued plan."""
        if self.order is None:  # one principal's plans, kept by the plan queue (coordinator/placement/plan_queue.py)
            return self.solo if plan_id in self else None
        return self.fair.owner_of(plan_id)

    def waiting_of(self, team: str) -> int:
        """Plans of a team waiting now (for its ``max_queued``)."""
        if self.order is None:
            return len(self) if self.solo is not None and self.shares.team_of(self.solo) == team else 0
        return self.fair.waiting_of(team)

    def held(self, owner: str, signature: Signature) -> bool:
        """Whether a plan of ``owner`` in ``signature`` may not be placed now (its team is past a quota and
        may not borrow)."""
        return self.fair.tier_of(owner, signature) == TIER_HELD

    def started(self, owner: str, demand: Demand, now: float) -> None:
        """A plan of ``owner`` was leased at ``now`` (taken out of the queue first)."""
        self.fair.started(owner, demand, now)

    def ended(self, owner: str, demand: Demand, now: float) -> None:
        """A leased plan of ``owner`` let go of its lease at ``now``."""
        self.fair.ended(owner, demand, now)

    def advance(self, now: float) -> None:
        """The driver's tick: keys are read at ``now``."""
        self.fair.advance(now)

    def set_capacity(self, capacity: Capacity, now: float) -> None:
        """The fleet's totals changed at ``now``."""
        self.fair.set_capacity(capacity, now)

    def set_teams(self, teams: TeamBook, running: dict[str, list[Demand]], now: float) -> None:
        """A new team book (the token file was reloaded at ``now``); ``running``: each principal's leased demands."""
        self.wake()  # the order moves the queued plans' waiting to their new teams
        self.fair.set_teams(teams, running, now)
