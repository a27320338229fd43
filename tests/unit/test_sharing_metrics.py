"""/metrics of shared fleets (coordinator/io/ops/sharing_metrics.py): usage per team, bounded label sets."""

from __future__ import annotations

from prometheus_client.core import Metric

from coordinator.io.ops.sharing_metrics import MAX_TEAMS, OTHER, sharing_families
from coordinator.ledger import Totals, UsageRow
from tests.unit.test_sharing import Fleet, two_teams


def family(metrics: list[Metric], name: str) -> dict[tuple[str, ...], float]:
    [found] = [m for m in metrics if m.name == name]
    return {tuple(s.labels.values()): s.value for s in found.samples if s.name.endswith("_total") or s.name == name}


def test_usage_and_holdings_per_team() -> None:
    """A finished plan's slot-seconds and outcome are its team's; running and waiting are counted now."""
    f = Fleet(slots=1, teams=two_teams())
    a = f.submit("alice")
    f.at(0.0)
    f.submit("bob")
    f.at(2.0)
    f.finish(a)
    metrics = list(sharing_families(f.h.core.sharing, f.h.core.counters))
    assert family(metrics, "fleetwire_team_slot_seconds")[("ml",)] == 2.0
    assert family(metrics, "fleetwire_team_plans")[("ml", "succeeded")] == 1
    assert family(metrics, "fleetwire_team_running") == {("ml",): 0, ("web",): 1}


def test_teams_past_the_bound_are_summed_as_other() -> None:
    """With more teams than MAX_TEAMS, the largest keep their label and the rest sum into team="other"."""
    f = Fleet(slots=1)
    rows = [UsageRow(3600, f"p{i}", f"t{i:03d}", Totals(slot_s=float(i + 1))) for i in range(MAX_TEAMS + 6)]
    f.h.core.restore_usage(rows)
    slot_s = family(list(sharing_families(f.h.core.sharing, f.h.core.counters)), "fleetwire_team_slot_seconds")
    assert len(slot_s) == MAX_TEAMS and (OTHER,) in slot_s
    assert sum(slot_s.values()) == sum(r.totals.slot_s for r in rows)
    assert ("t069",) in slot_s and ("t000",) not in slot_s  # the largest keep their label
