"""Fair share: what each team and principal uses now, and the order that follows (issue #27).

What it owns: per team and per principal, the resources its leased and running plans hold now
(GPUs, CPU slots, KV blocks: a :class:`Demand` each), its cumulative service, and the *share
key* the fair queue orders by (coordinator/placement/fair_queue.py). The teams, weights and
quotas are coordinator/teams.py's :class:`~coordinator.teams.TeamBook`.

Rules (docs/SEMANTICS.md §Fair share):

* Dominant resource fairness (DRF, Ghodsi et al. 2011) with weights: an account's share of a
  resource is what it holds over the fleet's capacity of it; its key is its shares, largest
  first, each divided by its weight. The account with the smallest key is the furthest below
  its weighted share of what is in use now, and is served first. Comparing the whole sorted
  vector (not only the dominant share) makes any plan that starts raise its account's key
  strictly: every plan holds a CPU slot. The preemption rules rely on it
  (coordinator/placement/preemption.py).
* Ties between equal keys go to the account with less cumulative *service* (its plans'
  run seconds times their dominant share, over its weight), as in Virtual Token Counter
  scheduling (Sheng et al. 2024): two backlogged accounts alternate, and the service gap
  between them stays bounded. An account that comes back after being idle starts from the
  least service among the accounts active then (VTC's lift), so idle time is not banked.
* A team is *active* while it has plans waiting or running; likewise a principal within its team.
* Every change of an account's key bumps its version: the fair queue's heaps hold (key,
  version) entries and skip those whose version is old (lazy deletion).

Pure: no clock (run seconds are handed in), no I/O.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator
from typing import NamedTuple

from coordinator.teams import Team, TeamBook

__all__ = ["NO_CAPACITY", "Account", "Capacity", "Demand", "ShareBook", "dominant"]


class Demand(NamedTuple):
    """What one plan holds while leased: GPUs (a share plan: its fraction), CPU slots, KV blocks."""

    gpus: float = 0.0
    slots: float = 1.0
    kv_blocks: float = 0.0


class Capacity(NamedTuple):
    """The fleet's totals of each resource (alive workers): GPUs, slots (max concurrency), KV blocks."""

    gpus: float = 0.0
    slots: float = 0.0
    kv_blocks: float = 0.0


NO_CAPACITY = Capacity()  # before the first worker registers


def _share(used: float, total: float) -> float:
    # A resource the fleet has none of (its workers left) still counts what is held: it is scarce.
    return used / total if total > 0 else used


def dominant(demand: Demand, capacity: Capacity) -> float:
    """The largest share of the fleet one plan's demand takes."""
    return max(
        _share(demand.gpus, capacity.gpus), _share(demand.slots, capacity.slots),
        _share(demand.kv_blocks, capacity.kv_blocks),
    )


class _Fleet:
    """The capacity every account's key divides by (one object shared by a book's accounts)."""

    __slots__ = ("capacity",)

    def __init__(self, capacity: Capacity) -> None:
        self.capacity = capacity


class Account:
    """One team's or one principal's usage now, service so far, and key (worked out when read)."""

    __slots__ = (
        "_fleet", "_key", "_keyed", "active", "gpus", "kv_blocks", "running", "scope", "service", "slots",
        "version", "waiting", "weight",
    )

    def __init__(self, weight: float, fleet: _Fleet, scope: str = "") -> None:
        self.weight = weight
        self.scope = scope  # a principal's team ("" for a team): where the VTC lift looks
        self.gpus = 0.0
        self.slots = 0.0
        self.kv_blocks = 0.0
        self.running = 0  # plans leased or running
        self.waiting = 0  # plans queued
        self.service = 0.0  # run seconds x dominant share / weight, of the plans that ended
        self.version = 0  # moves on with every change of the key
        self.active = False
        self._fleet = fleet
        self._key: tuple[float, ...] = (0.0, 0.0, 0.0, 0.0)
        self._keyed = 0  # the version _key was worked out at

    @property
    def key(self) -> tuple[float, ...]:
        """Shares of each resource over the weight, largest first, then service (module docstring)."""
        if self._keyed == self.version:
            return self._key
        capacity = self._fleet.capacity
        weight = self.weight
        a = (self.gpus / capacity.gpus if capacity.gpus > 0 else self.gpus) / weight
        b = (self.slots / capacity.slots if capacity.slots > 0 else self.slots) / weight
        c = (self.kv_blocks / capacity.kv_blocks if capacity.kv_blocks > 0 else self.kv_blocks) / weight
        # sorted((a, b, c), reverse=True), unrolled: keys are read at every decision
        if a < b:
            a, b = b, a
        if b < c:
            b, c = c, b
            if a < b:
                a, b = b, a
        self._key = key = (a, b, c, self.service)
        self._keyed = self.version
        return key

    def holds(self, demand: Demand, sign: int) -> None:
        """It holds one more (``sign`` 1) or one less (-1) lease of ``demand``."""
        gpus, slots, kv_blocks = demand
        if sign > 0:
            self.gpus += gpus
            self.slots += slots
            self.kv_blocks += kv_blocks
        else:  # every end follows its start (the caller's rule): usage never goes below 0
            self.gpus -= gpus
            self.slots -= slots
            self.kv_blocks -= kv_blocks
        self.running += sign
        self.version += 1


class _Level:
    """Accounts of one level (teams, or principals) and, per scope, a heap for the VTC lift."""

    def __init__(self, fleet: _Fleet) -> None:
        self.accounts: dict[str, Account] = {}
        self._fleet = fleet
        # scope -> heap of (service when pushed, name): lower bounds of the active accounts' services
        self._least: dict[str, list[tuple[float, str]]] = {}

    def add(self, name: str, weight: float, scope: str = "") -> Account:
        account = self.accounts[name] = Account(weight, self._fleet, scope)
        return account

    def least_service(self, scope: str) -> float | None:
        """The least service among the scope's active accounts.

        Services only grow, so an entry is a lower bound: one found below its account's service
        now is pushed again with it; those of accounts no longer active (or moved) are dropped.
        """
        heap = self._least.get(scope)
        while heap:
            service, name = heap[0]
            account = self.accounts[name]
            if not account.active or account.scope != scope:
                heapq.heappop(heap)
            elif account.service > service:
                heapq.heapreplace(heap, (account.service, name))
            else:
                return service
        return None

    def note(self, name: str, account: Account) -> None:
        """An account became active: it enters its scope's heap."""
        heap = self._least.setdefault(account.scope, [])
        heapq.heappush(heap, (account.service, name))
        if len(heap) > 2 * len(self.accounts) + 16:  # entries of accounts that came and went pile up
            live = [(a.service, n) for n, a in self.accounts.items() if a.active and a.scope == account.scope]
            heapq.heapify(live)
            heap[:] = live


class ShareBook:
    """Usage, service and share keys of every team and principal.

    Args:
        teams: who is in which team, the weights and quotas.
        capacity: the fleet's totals now (:meth:`set_capacity` when they change).
    """

    def __init__(self, teams: TeamBook | None = None, capacity: Capacity = NO_CAPACITY) -> None:
        self.teams_book = teams or TeamBook()
        self._fleet = _Fleet(capacity)
        self._teams = _Level(self._fleet)
        self._principals = _Level(self._fleet)

    @property
    def capacity(self) -> Capacity:
        """The fleet's totals the keys divide by."""
        return self._fleet.capacity

    # ------------------------------------------------------------------ accounts

    def team_account(self, team: str) -> Account:
        """The account of a team (made at its first use)."""
        account = self._teams.accounts.get(team)
        return account if account is not None else self._teams.add(team, self.teams_book.team(team).weight)

    def principal_account(self, principal: str) -> Account:
        """The account of a principal (made at its first use)."""
        account = self._principals.accounts.get(principal)
        if account is not None:
            return account
        book = self.teams_book
        return self._principals.add(principal, book.member_weight(principal), book.team_of(principal))

    def team(self, team: str) -> Team:
        """A team's weight and quotas."""
        return self.teams_book.team(team)

    def team_of(self, principal: str) -> str:
        """The principal's team."""
        return self.teams_book.team_of(principal)

    def teams(self) -> Iterator[tuple[str, Account]]:
        """Every team account, in the order they were first used."""
        return iter(self._teams.accounts.items())

    def principals(self) -> Iterator[tuple[str, Account]]:
        """Every principal account, in the order they were first used."""
        return iter(self._principals.accounts.items())

    # ------------------------------------------------------------------ changes

    def queued(self, principal: str, delta: int) -> None:
        """``delta`` plans of the principal entered (+) or left (-) the queue."""
        owner = self.principal_account(principal)
        group = self.team_account(owner.scope)
        owner.waiting += delta
        group.waiting += delta
        if not (owner.active and owner.waiting + owner.running > 0):  # else both stay active: the usual case
            self._activity(owner, group, principal, 0)

    def started(self, principal: str, demand: Demand) -> None:
        """A plan of the principal was leased: its team and it hold ``demand`` until :meth:`ended`."""
        owner = self.principal_account(principal)
        group = self.team_account(owner.scope)
        if not owner.active:
            self._activity(owner, group, principal, 1)  # before the lease is counted: it reads the running count
        group.holds(demand, 1)
        owner.holds(demand, 1)

    def ended(self, principal: str, demand: Demand, run_s: float) -> None:
        """A plan of the principal that held ``demand`` for ``run_s`` seconds let go of its lease."""
        owner = self.principal_account(principal)
        group = self.team_account(owner.scope)
        group.holds(demand, -1)
        owner.holds(demand, -1)
        if run_s > 0:
            capacity = self._fleet.capacity
            share = max(  # dominant(demand, capacity), inlined: this runs at every lease's end
                demand.gpus / capacity.gpus if capacity.gpus > 0 else demand.gpus,
                demand.slots / capacity.slots if capacity.slots > 0 else demand.slots,
                demand.kv_blocks / capacity.kv_blocks if capacity.kv_blocks > 0 else demand.kv_blocks,
            )
            group.service += run_s * share / group.weight
            owner.service += run_s * share / owner.weight
        if owner.waiting + owner.running == 0:
            self._activity(owner, group, principal, 0)

    def _activity(self, owner: Account, group: Account, principal: str, running: int) -> None:
        """Mark the principal and its team active or not; one that becomes active is lifted (VTC)."""
        for level, name, account in ((self._teams, owner.scope, group), (self._principals, principal, owner)):
            active = account.waiting > 0 or account.running + running > 0
            if active and not account.active:
                least = level.least_service(account.scope)  # no credit for the time it was idle
                if least is not None and least > account.service:
                    account.service = least
                    account.version += 1
                account.active = True
                level.note(name, account)
            elif not active:
                account.active = False

    def set_capacity(self, capacity: Capacity) -> bool:
        """The fleet's totals changed: every key moves. Returns whether they changed."""
        if capacity == self._fleet.capacity:
            return False
        self._fleet.capacity = capacity
        for level in (self._teams, self._principals):
            for account in level.accounts.values():
                account.version += 1
        return True

    def set_teams(self, teams: TeamBook, moved: dict[str, tuple[list[Demand], int]]) -> None:
        """A new team book (the token file was reloaded): weights are taken up, and the usage of principals
        that changed team moves with them.

        Args:
            teams: the new book.
            moved: principal -> (the demands of its leased plans, its queued count), for every principal
                with plans that may have changed team; the caller has them (the core's plans).
        """
        old = self.teams_book
        self.teams_book = teams
        for principal, (demands, waiting) in moved.items():
            was, now = old.team_of(principal), teams.team_of(principal)
            if was == now:
                continue
            before, after = self.team_account(was), self.team_account(now)
            for demand in demands:
                before.holds(demand, -1)
                after.holds(demand, 1)
            before.waiting = max(0, before.waiting - waiting)
            after.waiting += waiting
            for account in (before, after):
                account.active = account.waiting > 0 or account.running > 0
        for name, account in self._teams.accounts.items():
            account.weight = teams.team(name).weight
            account.version += 1
        for name, account in self._principals.accounts.items():
            account.weight = teams.member_weight(name)
            account.scope = teams.team_of(name)
            account.version += 1
