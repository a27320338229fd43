"""``/metrics`` families of shared fleets (docs/OPERATIONS.md §Shared fleets): usage and fair share per team.

Read at scrape time from the core's :class:`~coordinator.sharing.Sharing` (its usage ledger and the fair
queue's accounts), never on the hot path. Label sets are bounded: one ``team`` value per team the token
file names (or principal on a team of its own), at most :data:`MAX_TEAMS` of them, the largest by
slot-seconds; the rest are summed under ``team="other"``. Principals are not a label: `fleetwire usage`
shows them.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Final

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from coordinator.ledger import Totals
from coordinator.sharing import Sharing

__all__ = ["MAX_TEAMS", "SHARING_METRIC_NAMES", "sharing_families"]

MAX_TEAMS: Final = 64  # team label values per family; the rest are summed as "other"
OTHER: Final = "other"

#: The families :func:`sharing_families` yields (counters get ``_total`` in the exposition).
SHARING_METRIC_NAMES: Final = (
    "fleetwire_team_plans",
    "fleetwire_team_slot_seconds",
    "fleetwire_team_gpu_seconds",
    "fleetwire_team_energy_joules",
    "fleetwire_team_co2e_grams",
    "fleetwire_team_preemptions",
    "fleetwire_team_running",
    "fleetwire_team_waiting",
    "fleetwire_plans_preempted",
    "fleetwire_preemptions_taken_back",
)


def _bounded(totals: dict[str, Totals]) -> dict[str, Totals]:
    """At most :data:`MAX_TEAMS` teams, the largest by slot-seconds; the others summed as ``other``."""
    if len(totals) <= MAX_TEAMS:
        return totals
    ranked = sorted(totals.items(), key=lambda item: (-item[1].slot_s, item[0]))
    kept = dict(ranked[: MAX_TEAMS - 1])
    other = Totals()
    for _, t in ranked[MAX_TEAMS - 1:]:
        other.add(t)
    kept[OTHER] = other
    return kept


def sharing_families(sharing: Sharing, counters: dict[str, int]) -> Iterator[Metric]:
    """Usage per team from the ledger (all time), what each team holds and waits for now, and preemptions."""
    by_team = _bounded(sharing.ledger.totals("team"))
    label = ["team"]
    plans = CounterMetricFamily("fleetwire_team_plans", "Plans that ended, by team and outcome (the usage ledger).",
                                labels=["team", "outcome"])  # fmt: skip
    slot_s = CounterMetricFamily("fleetwire_team_slot_seconds", "Run seconds of a team's leases times the slots "
                                 "they held.", labels=label)  # fmt: skip
    gpu_s = CounterMetricFamily("fleetwire_team_gpu_seconds", "Run seconds of a team's leases times the GPUs they "
                                "held.", labels=label)  # fmt: skip
    joules = CounterMetricFamily("fleetwire_team_energy_joules", "Energy its receipts reported, J.", labels=label)
    co2e = CounterMetricFamily("fleetwire_team_co2e_grams", "Emissions its receipts reported, gCO2e.", labels=label)
    preempted = CounterMetricFamily("fleetwire_team_preemptions", "Attempts of a team's plans that were preempted.",
                                    labels=label)  # fmt: skip
    for team, t in sorted(by_team.items()):
        for outcome in ("succeeded", "failed", "cancelled"):
            plans.add_metric([team, outcome], getattr(t, outcome))
        slot_s.add_metric([team], t.slot_s)
        gpu_s.add_metric([team], t.gpu_s)
        joules.add_metric([team], t.joules)
        co2e.add_metric([team], t.co2e_g)
        preempted.add_metric([team], t.preemptions)
    yield from (plans, slot_s, gpu_s, joules, co2e, preempted)
    running = GaugeMetricFamily("fleetwire_team_running", "Leases a team's plans hold now (fair share counts them).",
                                labels=label)  # fmt: skip
    waiting = GaugeMetricFamily("fleetwire_team_waiting", "A team's plans waiting in the queue now.", labels=label)
    accounts = sorted(sharing.queue.shares.teams(), key=lambda item: (-item[1].running, item[0]))
    other_running = other_waiting = 0
    for index, (team, account) in enumerate(accounts):
        if index < MAX_TEAMS - 1 or len(accounts) <= MAX_TEAMS:
            running.add_metric([team], account.running)
            waiting.add_metric([team], account.waiting)
        else:
            other_running += account.running
            other_waiting += account.waiting
    if len(accounts) > MAX_TEAMS:
        running.add_metric([OTHER], other_running)
        waiting.add_metric([OTHER], other_waiting)
    yield from (running, waiting)
    yield CounterMetricFamily("fleetwire_plans_preempted", "Attempts the coordinator preempted (sent preempt) so that "
                              "a waiting plan could run.", value=counters.get("plans_preempted", 0))  # fmt: skip
    yield CounterMetricFamily("fleetwire_preemptions_taken_back", "Preempted attempts whose worker did not end them "
                              "within grace + 10 s: the coordinator took the lease back.",
                              value=counters.get("preemptions_taken_back", 0))  # fmt: skip
