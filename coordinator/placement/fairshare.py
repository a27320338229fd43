"""Fair share: what each team and principal uses and has used, and the order that follows (issue #27).

What it owns: per team and per principal, the resources its leased and running plans hold now
(GPUs, CPU slots, KV blocks: a :class:`Demand` each), the service it has had, and the *share key*
the fair queue orders by (coordinator/placement/fair_queue.py). The teams, weights and quotas
are coordinator/teams.py's :class:`~coordinator.teams.TeamBook`.

Rules (docs/SEMANTICS.md §Fair share):

* An account's *rate* is its dominant resource share now (DRF, Ghodsi et al. 2011): of GPUs,
  CPU slots and KV blocks, the largest fraction of the fleet's capacity its leases hold, over
  its weight. Its *service* is that rate integrated over time (weighted dominant-share-seconds),
  as Virtual Token Counter scheduling counts service (Sheng et al. 2024).
* Its key is ``service + rate x horizon_s``: what it has had, plus what it holds now counted
  as ``horizon_s`` seconds of service (default 10). The smallest key is served first. The rate
  term makes what is in use now decide at once (a team that holds more waits behind one that
  holds less); the service term makes the shares of backlogged teams converge to their weights
  over time, even where whole slots cannot split the fleet in their proportion (two slots for
  weights 1:2), and keeps the service gap between two backlogged accounts bounded. The shares
  themselves, largest first, break ties.
* Service is counted up to a reference time the driver moves on (:meth:`ShareBook.advance`, at
  its tick) and at each lease's start and end: between those, keys stand still, so the queue's
  heaps stay ordered; the queue rebuilds them when the reference time moves.
* A team is *active* while it has plans waiting or running; likewise a principal within its
  team. One that becomes active is lifted to the least service among the active ones of its
  scope (VTC's lift), so time spent idle is not banked as credit.
* A lease's start raises its account's key, its end lowers it (the rate falls, and the service
  it had is already counted); every change bumps the account's version, and the fair queue's
  heaps skip entries of old versions (lazy deletion).
* Leases of one slot (:data:`SLOT`, the usual lease) are counted *late* while nothing needs the
  keys at once: no fair-queue heap holds them (the fair queue says so: :meth:`ShareBook.keyed`)
  and no lease of a GPU or KV blocks is held. Then an account's rate is its slots over the
  fleet's slots, linear in them, so a principal's starts and ends can be tallied (their count,
  and the sum of their times) and added to it and its team in one step, with the same service
  and key as one step per lease: :meth:`ShareBook.settle`, which every reader of an account
  runs first (:attr:`Account.key`, the book's accessors and changes). A principal whose lease
  would leave it idle, a lease of anything else, or a heap made by the queue settles first and
  counts at once. A lone principal's plans, the common case, then cost one tally per lease.

Pure: ``now`` is handed in (monotonic seconds); no I/O.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator
from typing import NamedTuple

from coordinator.teams import Team, TeamBook

__all__ = ["HORIZON_S", "NO_CAPACITY", "SLOT", "Account", "Capacity", "Demand", "ShareBook", "dominant"]


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
SLOT = Demand(0.0, 1.0, 0.0)  # one slot, nothing else: the usual lease (this object: counted late, module docstring)
HORIZON_S = 10.0  # what an account holds now weighs as this many seconds of service (module docstring)


def _share(used: float, total: float) -> float:
    # A resource the fleet has none of (its workers left) still counts what is held: it is scarce.
    return used / total if total > 0 else used


def dominant(demand: Demand, capacity: Capacity) -> float:
    """The largest share of the fleet one demand takes."""
    return max(
        _share(demand.gpus, capacity.gpus), _share(demand.slots, capacity.slots),
        _share(demand.kv_blocks, capacity.kv_blocks),
    )


class _Fleet:
    """What every account's key reads: the capacity, the horizon, the reference time (shared by a book's accounts),
    and the principals whose leases are tallied but not counted yet (module docstring)."""

    __slots__ = ("capacity", "dirty", "heavy", "horizon_s", "keyed", "late", "now")

    def __init__(self, capacity: Capacity, horizon_s: float) -> None:
        self.capacity = capacity
        self.horizon_s = horizon_s
        self.now = 0.0
        self.dirty: list[Account] = []  # principals with tallied leases (Account.pending), in the order tallied
        self.heavy = 0  # leases held now that hold more than one slot's worth (a GPU, KV blocks)
        self.keyed = False  # whether a heap of the fair queue holds keys (ShareBook.keyed)
        self.late = True  # whether a SLOT lease may be tallied: not keyed and nothing heavy held

    def relate(self) -> None:
        """Work out :attr:`late` again (``heavy`` or ``keyed`` changed)."""
        self.late = not self.keyed and self.heavy == 0


class Account:
    """One team's or one principal's usage now, service so far, and key (worked out when read)."""

    __slots__ = (
        "_fleet", "_key", "_keyed", "active", "gpus", "kv_blocks", "parent", "pending", "pending_at", "pending_n",
        "pending_s", "rate", "running", "scope", "service", "since", "slots", "version", "waiting", "weight",
    )

    def __init__(self, weight: float, fleet: _Fleet, scope: str = "", parent: Account | None = None) -> None:
        self.weight = weight
        self.scope = scope  # a principal's team ("" for a team): where the VTC lift looks
        self.parent = parent  # a principal's team's account (None for a team)
        self.gpus = 0.0
        self.slots = 0.0
        self.kv_blocks = 0.0
        self.running = 0  # plans leased or running
        self.waiting = 0  # a principal: 1 while it has plans queued; a team: its principals that have (fair_queue.py)
        self.rate = 0.0  # dominant share now over weight: service per second
        self.service = 0.0  # weighted dominant-share-seconds, counted up to ``since``
        self.since = fleet.now
        self.version = 0  # moves on with every change of the key
        self.active = False
        # SLOT leases tallied, not counted yet (module docstring): whether it is in the fleet's dirty list, their
        # count (starts less ends), the sum of their times less ``since`` (ends subtracted), the last one's time.
        self.pending = False
        self.pending_n = 0
        self.pending_s = 0.0
        self.pending_at = 0.0
        self._fleet = fleet
        self._key: tuple[float, ...] = (0.0, 0.0, 0.0, 0.0)
        self._keyed = -1  # the version _key was worked out at

    def service_at(self, now: float) -> float:
        """Its service as of ``now``."""
        return self.service + self.rate * (now - self.since)

    @property
    def key(self) -> tuple[float, ...]:
        """``service + rate x horizon`` at the book's reference time, then its shares, largest first."""
        fleet = self._fleet
        if fleet.dirty:  # tallied leases are counted first (module docstring)
            _settle(fleet)
        if self._keyed == self.version:
            return self._key
        total_gpus, total_slots, total_kv = fleet.capacity
        weight = self.weight
        a = (self.gpus / total_gpus if total_gpus > 0 else self.gpus) / weight  # _share, inlined
        b = (self.slots / total_slots if total_slots > 0 else self.slots) / weight
        c = (self.kv_blocks / total_kv if total_kv > 0 else self.kv_blocks) / weight
        if a < b:  # sorted((a, b, c), reverse=True), unrolled: keys are read at every decision
            a, b = b, a
        if b < c:
            b, c = c, b
            if a < b:
                a, b = b, a
        # At the reference time, or at its own last change if later (a driver that never ticks).
        since = self.since
        at = fleet.now if fleet.now > since else since
        self._key = key = (self.service + self.rate * (at - since + fleet.horizon_s), a, b, c)
        self._keyed = self.version
        return key

    def fold(self, now: float) -> None:
        """Count the service of its leases up to ``now``."""
        if self.rate:
            self.service += self.rate * (now - self.since)
        self.since = now

    def holds(self, demand: Demand, sign: int, now: float) -> None:
        """It holds one more (``sign`` 1) or one less (-1) lease of ``demand`` from ``now`` on."""
        _hold((self,), demand, sign, now)

    def rerate(self) -> None:
        """Work the rate out again (usage, capacity or weight changed); the key moves."""
        capacity = self._fleet.capacity
        self.rate = max(
            _share(self.gpus, capacity.gpus), _share(self.slots, capacity.slots),
            _share(self.kv_blocks, capacity.kv_blocks),
        ) / self.weight
        self.version += 1


def _hold(accounts: tuple[Account, ...], demand: Demand, sign: int, now: float) -> None:
    """Each of ``accounts`` holds one more (``sign`` 1) or one less (-1) lease of ``demand`` from ``now`` on.

    :meth:`Account.fold` and :meth:`Account.rerate` inlined, for a team's and its principal's accounts in
    one call: this runs at every lease's start and end. Every end follows its start (the caller's rule):
    usage never goes below 0.
    """
    gpus_d, slots_d, kv_d = demand
    if sign < 0:
        gpus_d, slots_d, kv_d = -gpus_d, -slots_d, -kv_d
    total_gpus, total_slots, total_kv = accounts[0]._fleet.capacity
    plain = not gpus_d and not kv_d  # a slot only: the usual lease
    for account in accounts:
        rate = account.rate
        if rate:
            account.service += rate * (now - account.since)
        account.since = now
        account.running += sign
        account.version += 1
        slots = account.slots = account.slots + slots_d
        if total_slots > 0:  # _share, inlined
            slots /= total_slots
        if plain and not account.gpus and not account.kv_blocks:  # no other resource: slots are the dominant one
            account.rate = slots / account.weight
            continue
        gpus = account.gpus = account.gpus + gpus_d
        kv_blocks = account.kv_blocks = account.kv_blocks + kv_d
        if total_gpus > 0:
            gpus /= total_gpus
        if total_kv > 0:
            kv_blocks /= total_kv
        top = gpus if gpus > slots else slots
        account.rate = (top if top > kv_blocks else kv_blocks) / account.weight


def _settle(fleet: _Fleet) -> None:
    """Count the tallied SLOT leases of the fleet's dirty principals on them and on their teams (module docstring).

    While leases are tallied, an account's rate is its slots over the fleet's (``late``: no GPU or KV block is
    held), so its service from ``since`` to its last tallied lease at ``at`` is its rate then times the span, plus
    ``(n x span - s) / slots / weight`` for ``n`` leases more (starts less ends) whose times less ``since`` add up
    to ``s``: what one step per lease would have counted. A team adds up its principals' tallies, their times
    taken from its own ``since``.
    """
    total = fleet.capacity.slots
    per = total if total > 0 else 1.0  # _share: a fleet of no slots counts the slots held
    teams: list[Account] = []
    for owner in fleet.dirty:
        n, s, at = owner.pending_n, owner.pending_s, owner.pending_at
        owner.pending = False
        owner.pending_n = 0
        owner.pending_s = 0.0
        group = owner.parent
        assert group is not None  # a principal's account has its team's
        if not group.pending:
            group.pending = True
            group.pending_at = at
            teams.append(group)
        elif at > group.pending_at:
            group.pending_at = at
        group.pending_n += n
        group.pending_s += s + n * (owner.since - group.since)
        _count(owner, n, s, at, per)
    fleet.dirty.clear()
    for group in teams:
        n, s = group.pending_n, group.pending_s
        group.pending = False
        group.pending_n = 0
        group.pending_s = 0.0
        _count(group, n, s, group.pending_at, per)


def _count(account: Account, n: int, s: float, at: float, per: float) -> None:
    """Count ``n`` more SLOT leases, whose times less ``since`` add up to ``s``, on an account up to ``at``."""
    span = at - account.since
    weight = account.weight
    account.service += account.rate * span + (n * span - s) / per / weight
    account.since = at
    account.running += n
    slots = account.slots = account.slots + n
    account.rate = slots / per / weight
    account.version += 1


class _Level:
    """Accounts of one level (teams, or principals) and, per scope, a heap for the VTC lift."""

    def __init__(self, fleet: _Fleet) -> None:
        self.accounts: dict[str, Account] = {}
        self._fleet = fleet
        # scope -> heap of (service when pushed, name): lower bounds of the active accounts' services
        self._least: dict[str, list[tuple[float, str]]] = {}

    def add(self, name: str, weight: float, scope: str = "", parent: Account | None = None) -> Account:
        account = self.accounts[name] = Account(weight, self._fleet, scope, parent)
        return account

    def least_service(self, scope: str, now: float) -> float | None:
        """The least service as of ``now`` among the scope's active accounts.

        Services only grow, so an entry is a lower bound: one found below its account's service
        now is pushed again with it; those of accounts no longer active (or moved) are dropped.
        """
        heap = self._least.get(scope)
        while heap:
            service, name = heap[0]
            account = self.accounts[name]
            current = account.service_at(now)
            if not account.active or account.scope != scope:
                heapq.heappop(heap)
            elif current > service + 1e-12:
                heapq.heapreplace(heap, (current, name))
            else:
                return current
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
        horizon_s: what an account holds now weighs as this many seconds of service.
    """

    def __init__(
        self, teams: TeamBook | None = None, capacity: Capacity = NO_CAPACITY, horizon_s: float = HORIZON_S,
    ) -> None:
        self.teams_book = teams or TeamBook()
        self._fleet = self.fleet = _Fleet(capacity, horizon_s)
        """What its accounts share, with the tallies (coordinator/sharing.py tallies a lease inline as :meth:`started`
        and :meth:`ended` do)."""
        self._teams = _Level(self._fleet)
        self._principals = _Level(self._fleet)
        self.team_accounts = self._teams.accounts  # team -> its account (read at every decision)
        self.principal_accounts = self._principals.accounts  # principal -> its account

    @property
    def capacity(self) -> Capacity:
        """The fleet's totals the shares divide by."""
        return self._fleet.capacity

    @property
    def now(self) -> float:
        """The reference time keys are read at (:meth:`advance`)."""
        return self._fleet.now

    # ------------------------------------------------------------------ accounts

    def team_account(self, team: str) -> Account:
        """The account of a team (made at its first use)."""
        if self._fleet.dirty:
            _settle(self._fleet)
        account = self._teams.accounts.get(team)
        return account if account is not None else self._teams.add(team, self.teams_book.team(team).weight)

    def principal_account(self, principal: str) -> Account:
        """The account of a principal (made at its first use)."""
        if self._fleet.dirty:
            _settle(self._fleet)
        account = self._principals.accounts.get(principal)
        if account is not None:
            return account
        book = self.teams_book
        team = book.team_of(principal)
        return self._principals.add(principal, book.member_weight(principal), team, self.team_account(team))

    def team(self, team: str) -> Team:
        """A team's weight and quotas."""
        return self.teams_book.team(team)

    def team_of(self, principal: str) -> str:
        """The principal's team."""
        return self.teams_book.team_of(principal)

    def teams(self) -> Iterator[tuple[str, Account]]:
        """Every team account, in the order they were first used."""
        self.settle()
        return iter(self._teams.accounts.items())

    def principals(self) -> Iterator[tuple[str, Account]]:
        """Every principal account, in the order they were first used."""
        self.settle()
        return iter(self._principals.accounts.items())

    def settle(self) -> None:
        """Count the SLOT leases tallied so far (module docstring): the accounts say what one step per lease says."""
        if self._fleet.dirty:
            _settle(self._fleet)

    def keyed(self, keyed: bool) -> None:
        """Whether a heap of the fair queue holds keys from now on: while one does, every lease counts at once (the
        queue pushes an account's new key where it waits when a lease ends: coordinator/placement/fair_queue.py)."""
        fleet = self._fleet
        if keyed and fleet.dirty:
            _settle(fleet)
        fleet.keyed = keyed
        fleet.relate()

    # ------------------------------------------------------------------ changes

    def queued(self, principal: str, delta: int) -> None:
        """The principal began (``delta`` 1) or ceased (-1) to have plans queued (the fair queue tells only then,
        not at every plan: coordinator/placement/fair_queue.py). Its and its team's activity follow."""
        owner = self.principal_accounts.get(principal) or self.principal_account(principal)
        group = self.team_accounts.get(owner.scope) or self.team_account(owner.scope)
        owner.waiting += delta
        group.waiting += delta
        if not (owner.active and owner.waiting + owner.running + owner.pending_n > 0):  # else both stay active
            self.settle()
            self._activity(owner, group, principal, 0)

    def started(self, principal: str, demand: Demand, now: float) -> str:
        """A plan of the principal was leased at ``now``: its team and it hold ``demand`` until :meth:`ended`.

        Returns:
            the principal's team (the caller need not ask the team book again).
        """
        owner = self.principal_accounts.get(principal)
        fleet = self._fleet
        if owner is not None and demand is SLOT and owner.active and fleet.late:  # tallied (module docstring)
            if not owner.pending:
                owner.pending = True
                fleet.dirty.append(owner)
            owner.pending_n += 1
            owner.pending_s += now - owner.since
            owner.pending_at = now
            return owner.scope
        if fleet.dirty:
            _settle(fleet)
        if owner is None:
            owner = self.principal_account(principal)
        team = owner.scope
        group = owner.parent = self.team_accounts.get(team) or self.team_account(team)
        if not owner.active:
            self._activity(owner, group, principal, 1)  # before the lease is counted: it reads the running count
        if demand is not SLOT and demand != SLOT:  # it holds a GPU or KV blocks: no lease is tallied while it does
            fleet.heavy += 1
            fleet.relate()
        _hold((group, owner), demand, 1, now)
        return team

    def ended(self, principal: str, demand: Demand, now: float) -> None:
        """A plan of the principal that held ``demand`` let go of its lease at ``now``."""
        owner = self.principal_accounts.get(principal)
        fleet = self._fleet
        if owner is not None and demand is SLOT and fleet.late and (
            owner.waiting or owner.running + owner.pending_n > 1  # it stays active: tallied (module docstring)
        ):
            if not owner.pending:
                owner.pending = True
                fleet.dirty.append(owner)
            owner.pending_n -= 1
            owner.pending_s -= now - owner.since
            owner.pending_at = now
            return
        if fleet.dirty:
            _settle(fleet)
        if owner is None:
            owner = self.principal_account(principal)
        group = self.team_accounts.get(owner.scope) or self.team_account(owner.scope)
        _hold((group, owner), demand, -1, now)
        if demand is not SLOT and demand != SLOT:
            fleet.heavy -= 1
            fleet.relate()
        if owner.waiting + owner.running == 0:
            self._activity(owner, group, principal, 0)

    def _activity(self, owner: Account, group: Account, principal: str, running: int) -> None:
        """Mark the principal and its team active or not; one that becomes active is lifted (VTC)."""
        now = self._fleet.now
        for level, name, account in ((self._teams, owner.scope, group), (self._principals, principal, owner)):
            active = account.waiting > 0 or account.running + running > 0
            if active and not account.active:
                least = level.least_service(account.scope, now)  # no credit for the time it was idle
                account.fold(now)
                if least is not None and least > account.service:
                    account.service = least
                    account.version += 1
                account.active = True
                level.note(name, account)
            elif not active:
                account.active = False

    def advance(self, now: float) -> None:
        """Read keys at ``now`` from here on (the driver's tick): the keys of accounts that hold leases grow."""
        fleet = self._fleet
        if now <= fleet.now:
            return
        if fleet.dirty:
            _settle(fleet)
        fleet.now = now
        for level in (self._teams, self._principals):
            for account in level.accounts.values():
                if account.rate:
                    account.version += 1

    def set_capacity(self, capacity: Capacity, now: float) -> bool:
        """The fleet's totals changed at ``now``: every rate and key moves. Returns whether they changed."""
        if capacity == self._fleet.capacity:
            return False
        self.settle()  # tallied leases count at the capacity they were held under
        for level in (self._teams, self._principals):
            for account in level.accounts.values():
                account.fold(now)
        self._fleet.capacity = capacity
        for level in (self._teams, self._principals):
            for account in level.accounts.values():
                account.rerate()
        return True

    def set_teams(self, teams: TeamBook, moved: dict[str, tuple[list[Demand], int]], now: float) -> None:
        """A new team book (the token file was reloaded at ``now``): weights are taken up, and the usage of
        principals that changed team moves with them.

        Args:
            teams: the new book.
            moved: principal -> (the demands of its leased plans, its queued count), for every principal
                with plans that may have changed team; the caller has them (the core's plans).
            now: when.
        """
        self.settle()
        old = self.teams_book
        self.teams_book = teams
        for principal, (demands, waiting) in moved.items():
            was, becomes = old.team_of(principal), teams.team_of(principal)
            if was == becomes:
                continue
            before, after = self.team_account(was), self.team_account(becomes)
            for demand in demands:
                before.holds(demand, -1, now)
                after.holds(demand, 1, now)
            before.waiting = max(0, before.waiting - waiting)
            after.waiting += waiting
            for account in (before, after):
                account.active = account.waiting > 0 or account.running > 0
        for name, account in self._teams.accounts.items():
            account.fold(now)
            account.weight = teams.team(name).weight
            account.rerate()
        for name, account in list(self._principals.accounts.items()):
            account.fold(now)
            account.weight = teams.member_weight(name)
            account.scope = teams.team_of(name)
            account.parent = self._teams.accounts.get(account.scope)  # one that is active has it: see started
            account.rerate()
