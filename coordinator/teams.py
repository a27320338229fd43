"""Teams: who shares the fleet with whom, with what weight, and each team's quotas (issue #27).

The token file says it (coordinator/auth.py parses it; docs/OPERATIONS.md §Security): a
client or admin entry may carry ``team = "vision"`` and ``weight = 2``, and a ``[[team]]`` table
gives a team its own weight and quotas::

    [[team]]
    name = "vision"
    weight = 2          # the team's share against other teams (default 1)
    max_gpus = 8        # GPUs its running plans may hold within quota (default: no quota)
    max_running = 20    # plans it may have leased or running within quota (default: no quota)
    max_queued = 5000   # plans it may have waiting; a submit past it is refused (default: no quota)
    borrow = true       # past max_gpus/max_running it may still use idle capacity (default true)

Rules:

* A principal without ``team`` is a team of its own, named after it; its ``weight`` is then its
  team's weight (so ``weight = 2`` on a lone principal doubles its share against the others).
  With ``team``, ``weight`` is its share within the team, and the team's weight is its
  ``[[team]]`` table's (1 when it has none).
* A principal the file does not name (the ``FLEETWIRE_*_TOKEN`` shortcut, ``--insecure``) is a
  team of its own with weight 1.
* Quotas are nominal (as Kueue's): a team within its quota is served first; past it, a plan may
  still borrow capacity nobody else waits for (``borrow``, on by default), and borrowed plans are
  the first to be preempted (coordinator/placement/preemption.py).

Pure data: no clock, no I/O. :class:`TeamBook` is built once per token file load and replaced
whole on SIGHUP.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Final

__all__ = ["MAX_WEIGHT", "Member", "Team", "TeamBook", "quota_reason", "weight_problem"]

MAX_WEIGHT: Final = 1e6  # a larger weight is a typo, and would squeeze every other share to nothing


def weight_problem(value: object) -> str | None:
    """Why ``value`` cannot be a weight (a finite number > 0 and at most 1e6); None when it can."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return f"must be a number, got {value!r}"
    if not math.isfinite(value) or value <= 0:
        return f"must be > 0, got {value!r}"
    if value > MAX_WEIGHT:
        return f"must be at most {MAX_WEIGHT:g}, got {value!r}"
    return None


@dataclass(frozen=True, slots=True)
class Team:
    """One team's weight and quotas (None: no quota of that kind).

    Attributes:
        name: as principals name it in ``team``.
        weight: its share against other teams (> 0).
        max_gpus: GPUs its leased and running plans may hold within quota.
        max_running: plans it may have leased or running within quota.
        max_queued: plans it may have queued; a submit past it is refused.
        borrow: whether past ``max_gpus``/``max_running`` it may use capacity nobody else waits for.
    """

    name: str
    weight: float = 1.0
    max_gpus: float | None = None
    max_running: int | None = None
    max_queued: int | None = None
    borrow: bool = True

    def over_quota(self, running: int, gpus: float, need_gpus: float = 0.0) -> bool:
        """Whether one more plan holding ``need_gpus`` takes it past a quota (``running`` plans hold ``gpus`` now)."""
        if self.max_running is not None and running + 1 > self.max_running:
            return True
        return self.max_gpus is not None and need_gpus > 0 and gpus + need_gpus > self.max_gpus + 1e-9

    def beyond_quota(self, running: int, gpus: float) -> bool:
        """Whether it holds more than a quota allows now (it borrowed)."""
        if self.max_running is not None and running > self.max_running:
            return True
        return self.max_gpus is not None and gpus > self.max_gpus + 1e-9


@dataclass(frozen=True, slots=True)
class Member:
    """A principal's place: its team and its weight within it.

    ``alone``: the entry named no team, so the principal is a team of its own (named after it)
    and ``weight`` is that team's weight.
    """

    team: str
    weight: float = 1.0
    alone: bool = False


def quota_reason(team: Team, running: int, gpus: float, need_gpus: float = 0.0) -> str | None:
    """Why a plan of ``team`` needing ``need_gpus`` waits on a quota, as a waiting reason; None when it is within quota.

    The reason names the quota that is reached: ``team vision is at its quota of 8 GPUs``.
    """
    if team.max_gpus is not None and need_gpus > 0 and gpus + need_gpus > team.max_gpus + 1e-9:
        what = f"{team.max_gpus:g} GPU" + ("" if team.max_gpus == 1 else "s")
    elif team.max_running is not None and running + 1 > team.max_running:
        what = f"{team.max_running} running plan" + ("" if team.max_running == 1 else "s")
    else:
        return None
    tail = "; it may use capacity no other team waits for" if team.borrow else ""
    return f"team {team.name} is at its quota of {what}{tail}"


class TeamBook:
    """Every principal's team and weight, and every team's weight and quotas.

    Args:
        teams: the ``[[team]]`` tables (names unique).
        members: principal name -> its :class:`Member` (principals with ``team`` or ``weight``).
    """

    def __init__(self, teams: Iterable[Team] = (), members: Mapping[str, Member] | None = None) -> None:
        self._teams = {team.name: team for team in teams}
        self._implicit: set[str] = set()  # teams without a table, in _teams since asked for
        self.quotas = any(t.max_gpus is not None or t.max_running is not None for t in self._teams.values())
        """Whether some team has ``max_gpus`` or ``max_running`` (else no plan is ever past a quota)."""
        self._members = dict(members or {})
        # A principal on its own carries its team's weight: its team has no table, the weight is the member's.
        self._own = {m.team: m.weight for m in self._members.values() if m.alone}

    def member(self, principal: str) -> Member:
        """The principal's team and weight within it (a team of its own, weight 1, when the file does not name it)."""
        found = self._members.get(principal)
        return found if found is not None else Member(principal, alone=True)

    def team_of(self, principal: str) -> str:
        """The name of the principal's team."""
        found = self._members.get(principal)
        return principal if found is None else found.team

    def team(self, name: str) -> Team:
        """A team's weight and quotas: its ``[[team]]`` table's, or weight 1 and no quota."""
        found = self._teams.get(name)
        if found is None:  # made once: fair share asks for it at every lease
            found = self._teams[name] = Team(name, weight=self._own.get(name, 1.0))
            self._implicit.add(name)
        return found

    def member_weight(self, principal: str) -> float:
        """The principal's weight within its team (1 on a team of its own: the weight went to the team)."""
        found = self._members.get(principal)
        if found is None or found.alone:
            return 1.0
        return found.weight

    @property
    def teams(self) -> tuple[Team, ...]:
        """The ``[[team]]`` tables."""
        return tuple(t for name, t in self._teams.items() if name not in self._implicit)

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, TeamBook) and set(self.teams) == set(other.teams) and self._members == other._members
        )

    __hash__ = None  # type: ignore[assignment]  # mutable-looking container: compared, never hashed
