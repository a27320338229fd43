"""The usage ledger: who used what of the fleet (issue #27).

What it owns: per principal (with its team) and per hour, running totals of plans by outcome,
slot-seconds and GPU-seconds of their leases, tokens, joules and gCO2e from their receipts, and
preemptions suffered. ``fleetwire usage [--by principal|team] [--since 24h]`` reads it
(:meth:`UsageLedger.totals`), ``/metrics`` exports its totals, and the store keeps its rows
(:meth:`UsageLedger.take_dirty`, :meth:`UsageLedger.restore`) so it survives restarts and failover.

Rules (docs/SEMANTICS.md §Usage ledger):

* A lease that ends (the plan finished, was requeued, preempted, or its worker was lost) adds
  its run seconds times the slots and GPUs it held, and the receipt's tokens, joules and gCO2e
  when its ``done`` brought one: energy spent by an attempt that did not finish the plan is
  still spent. A plan that ends adds one to its outcome; a preempted lease adds one preemption.
* Rows are ``(hour, principal, team)``: the team is the principal's when the usage happened, so
  moving a principal to another team does not rewrite history. ``--since`` counts whole hours
  (the hour that holds ``since`` included).
* Past ``keep_hours`` an hour's rows are folded into the principal's row of hour 0 (before
  retention), so all-time totals stay exact and the rows stay bounded by principals x hours kept.

Pure: wall-clock seconds (Unix time) are handed in; no I/O.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, fields
from typing import Final, Literal

from protocol.messages import Outcome, Receipt

__all__ = ["BUCKET_S", "FIELDS", "Totals", "UsageLedger", "UsageRow"]

BUCKET_S: Final = 3600  # rows are per hour
KEEP_HOURS: Final = 24 * 35  # hours kept apart before they fold into hour 0

By = Literal["principal", "team"]


@dataclass(slots=True)
class Totals:
    """Running totals of one principal or team (in one hour, or summed)."""

    succeeded: int = 0
    failed: int = 0
    cancelled: int = 0
    slot_s: float = 0.0
    gpu_s: float = 0.0
    tokens: int = 0
    joules: float = 0.0
    co2e_g: float = 0.0
    preemptions: int = 0
    avoided_co2e_g: float = 0.0  # receipts' avoided_co2e_g: plans held for a greener hour (coordinator/carbon_holds.py)

    def add(self, other: Totals) -> None:
        """Add another's totals to these."""
        for f in fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))

    @property
    def plans(self) -> int:
        """Plans that ended, whatever their outcome."""
        return self.succeeded + self.failed + self.cancelled


#: The totals' fields in the order a store keeps them (coordinator/records.py ``UsageRows``).
FIELDS: Final = tuple(f.name for f in fields(Totals))


@dataclass(frozen=True, slots=True)
class UsageRow:
    """One stored row: an hour (its start, Unix seconds; 0: before retention), a principal, its team, totals."""

    hour_s: int
    principal: str
    team: str
    totals: Totals

    def values(self) -> list[float]:
        """The totals as numbers in :data:`FIELDS` order (how a store keeps them)."""
        totals = self.totals
        return [getattr(totals, name) for name in FIELDS]

    @classmethod
    def of(cls, hour_s: int, principal: str, team: str, values: Iterable[float]) -> UsageRow:
        """A row from what a store kept (:meth:`values`); a shorter list (an older coordinator's) leaves zeros."""
        totals = Totals()
        for name, value in zip(FIELDS, values, strict=False):
            setattr(totals, name, type(getattr(totals, name))(value))
        return cls(hour_s, principal, team, totals)


def _figure(value: float) -> float:
    return value if 0 <= value < math.inf else 0.0


def _signed(value: float) -> float:
    return value if -math.inf < value < math.inf else 0.0


class UsageLedger:
    """Usage by hour, principal and team.

    Args:
        keep_hours: hours kept apart; older ones fold into hour 0.
    """

    def __init__(self, keep_hours: int = KEEP_HOURS) -> None:
        self.keep_hours = keep_hours
        self._rows: dict[tuple[int, str, str], Totals] = {}
        self._dirty: set[tuple[int, str, str]] = set()
        self._deleted: list[tuple[int, str, str]] = []  # keys folded into hour 0 since the last take_dirty
        self._oldest = 0  # the oldest hour kept apart (0: none yet)
        # The row used last, already marked dirty: a plan's lease end and its outcome come one after the other,
        # and a busy principal's plans end in runs, so most calls find it. (principal, team, hour from, to, row)
        self._last: tuple[str, str, float, float, Totals] | None = None

    def _row(self, principal: str, team: str, wall_s: float) -> Totals:
        last = self._last
        if last is not None and last[0] == principal and last[1] == team and last[2] <= wall_s < last[3]:
            return last[4]
        hour = int(wall_s // BUCKET_S) * BUCKET_S
        key = (hour, principal, team)
        row = self._rows.get(key)
        if row is None:
            row = self._rows[key] = Totals()
            if self._oldest == 0 or hour < self._oldest:
                self._oldest = hour
        self._dirty.add(key)
        self._last = (principal, team, float(hour), float(hour + BUCKET_S), row)  # floats: compared with wall_s
        return row

    def lease_ended(
        self, principal: str, team: str, run_s: float, wall_s: float, slots: float = 1.0, gpus: float = 0.0,
        receipt: Receipt | None = None,
    ) -> None:
        """A lease of the principal's plan ended after ``run_s`` seconds holding ``slots`` and ``gpus``.

        Positional arguments (not keyword-only): coordinator/sharing.py calls it at every lease's end.
        """
        last = self._last  # _row's first test, inlined: this runs at every lease's end
        if last is not None and last[0] == principal and last[1] == team and last[2] <= wall_s < last[3]:
            row = last[4]
        else:
            row = self._row(principal, team, wall_s)
        if not 0 <= run_s < math.inf:  # _figure, inlined: this runs at every lease's end
            run_s = 0.0
        row.slot_s += run_s * slots
        if gpus:
            row.gpu_s += run_s * gpus
        if receipt is not None:
            row.tokens += max(0, receipt.tokens)
            row.joules += _figure(receipt.joules)
            row.co2e_g += _figure(receipt.co2e_g)
            if receipt.avoided_co2e_g is not None:
                row.avoided_co2e_g += _signed(receipt.avoided_co2e_g)

    def receipt(self, principal: str, team: str, receipt: Receipt, *, wall_s: float) -> None:
        """An attempt of the principal's plan ended with ``receipt`` (its lease's end was counted apart)."""
        row = self._row(principal, team, wall_s)
        row.tokens += max(0, receipt.tokens)
        row.joules += _figure(receipt.joules)
        row.co2e_g += _figure(receipt.co2e_g)
        if receipt.avoided_co2e_g is not None:  # may be negative: a plan that ran at a dirtier hour (accounting.py)
            row.avoided_co2e_g += _signed(receipt.avoided_co2e_g)

    def plan_ended(self, principal: str, team: str, outcome: Outcome, wall_s: float) -> None:
        """A plan of the principal reached its final state (positional arguments: called at every plan's end)."""
        last = self._last  # as in lease_ended: at every plan's end
        if last is not None and last[0] == principal and last[1] == team and last[2] <= wall_s < last[3]:
            row = last[4]
        else:
            row = self._row(principal, team, wall_s)
        if outcome == "succeeded":
            row.succeeded += 1
        elif outcome == "failed":
            row.failed += 1
        else:
            row.cancelled += 1

    def preempted(self, principal: str, team: str, *, wall_s: float) -> None:
        """A lease of the principal's plan was preempted."""
        self._row(principal, team, wall_s).preemptions += 1

    def totals(
        self, by: By = "principal", *, since_s: float | None = None, only: Iterable[str] | None = None,
    ) -> dict[str, Totals]:
        """Totals by principal or by team, over every hour or those from ``since_s`` on.

        ``only``: just these principals (a client sees its own); None: all.
        """
        start = None if since_s is None else int(since_s // BUCKET_S) * BUCKET_S
        wanted = None if only is None else set(only)
        result: dict[str, Totals] = {}
        for (hour, principal, team), row in self._rows.items():
            if start is not None and hour < start:
                continue
            if wanted is not None and principal not in wanted:
                continue
            name = principal if by == "principal" else team
            into = result.get(name)
            if into is None:
                into = result[name] = Totals()
            into.add(row)
        return result

    def fold(self, wall_s: float) -> int:
        """Fold hours older than ``keep_hours`` into hour 0 (call it now and then, e.g. hourly). Returns rows folded."""
        limit = (int(wall_s // BUCKET_S) - self.keep_hours) * BUCKET_S
        if self._oldest == 0 or self._oldest >= limit:
            return 0
        old = [key for key in self._rows if 0 < key[0] < limit]
        self._last = None  # its row may be folded away
        for key in old:
            row = self._rows.pop(key)
            self._dirty.discard(key)
            self._deleted.append(key)
            into_key = (0, key[1], key[2])
            into = self._rows.get(into_key)
            if into is None:
                into = self._rows[into_key] = Totals()
            into.add(row)
            self._dirty.add(into_key)
        self._oldest = min((k[0] for k in self._rows if k[0] > 0), default=0)
        return len(old)

    def take_dirty(self) -> tuple[list[UsageRow], list[tuple[int, str, str]]]:
        """The rows changed since the last call (to write) and the keys folded away (to delete)."""
        rows = [UsageRow(k[0], k[1], k[2], Totals(**{f.name: getattr(self._rows[k], f.name) for f in fields(Totals)}))
                for k in sorted(self._dirty)]
        deleted, self._deleted = self._deleted, []
        self._dirty.clear()
        self._last = None  # no longer marked dirty
        return rows, deleted

    def restore(self, rows: Iterable[UsageRow]) -> None:
        """Load stored rows (at start, before any usage is added)."""
        self._last = None  # a restored row may replace it
        for row in rows:
            key = (row.hour_s, row.principal, row.team)
            self._rows[key] = row.totals
            if row.hour_s > 0 and (self._oldest == 0 or row.hour_s < self._oldest):
                self._oldest = row.hour_s

    def __len__(self) -> int:
        return len(self._rows)
