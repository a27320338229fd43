"""The usage ledger (issue #27): who used what, by hour, principal and team, with wall time handed in."""

from __future__ import annotations

import math

from coordinator.ledger import BUCKET_S, Totals, UsageLedger
from protocol.messages import Receipt

T0 = 1_700_000_000.0  # 800 s into an hour


def test_leases_plans_receipts_and_preemptions_add_up_per_principal_and_team() -> None:
    """Slot- and GPU-seconds per lease, receipt figures, outcomes and preemptions, by principal and by team."""
    ledger = UsageLedger()
    receipt = Receipt(joules=120.0, co2e_g=0.5, tokens=300)
    ledger.lease_ended("alice", "vision", run_s=10.0, slots=1.0, gpus=2.0, receipt=receipt, wall_s=T0)
    ledger.preempted("alice", "vision", wall_s=T0)
    ledger.lease_ended("alice", "vision", run_s=5.0, gpus=2.0, wall_s=T0 + 1)  # the retry, no receipt
    ledger.plan_ended("alice", "vision", "succeeded", wall_s=T0 + 1)
    ledger.lease_ended("carol", "vision", run_s=3.0, wall_s=T0 + 2)
    ledger.plan_ended("carol", "vision", "failed", wall_s=T0 + 2)
    ledger.plan_ended("bob", "bob", "cancelled", wall_s=T0 + 3)
    alice = ledger.totals()["alice"]
    assert (alice.slot_s, alice.gpu_s, alice.tokens, alice.joules, alice.co2e_g) == (15.0, 30.0, 300, 120.0, 0.5)
    assert (alice.succeeded, alice.preemptions, alice.plans) == (1, 1, 1)
    teams = ledger.totals("team")
    assert set(teams) == {"vision", "bob"}
    assert (teams["vision"].slot_s, teams["vision"].succeeded, teams["vision"].failed) == (18.0, 1, 1)
    assert teams["bob"].cancelled == 1


def test_since_counts_whole_hours_from_the_one_that_holds_it() -> None:
    """``since`` keeps the hour it falls in and later ones."""
    ledger = UsageLedger()
    ledger.lease_ended("alice", "alice", run_s=1.0, wall_s=T0 - 3 * BUCKET_S)
    ledger.lease_ended("alice", "alice", run_s=2.0, wall_s=T0)
    assert ledger.totals(since_s=T0 - 60)["alice"].slot_s == 2.0  # the same hour as T0
    assert ledger.totals(since_s=T0 - 3 * BUCKET_S - 700)["alice"].slot_s == 3.0  # the hour of the first lease
    assert ledger.totals(since_s=T0 + BUCKET_S) == {}
    assert ledger.totals()["alice"].slot_s == 3.0


def test_a_client_sees_only_its_own() -> None:
    """``only`` restricts the totals to the principals named."""
    ledger = UsageLedger()
    ledger.lease_ended("alice", "t", run_s=1.0, wall_s=T0)
    ledger.lease_ended("bob", "t", run_s=1.0, wall_s=T0)
    assert set(ledger.totals(only=["alice"])) == {"alice"}
    assert ledger.totals("team", only=["alice"])["t"].slot_s == 1.0


def test_moving_a_principal_to_another_team_keeps_its_history_where_it_was() -> None:
    """Usage is booked to the team the principal was in when it happened."""
    ledger = UsageLedger()
    ledger.lease_ended("alice", "old", run_s=4.0, wall_s=T0)
    ledger.lease_ended("alice", "new", run_s=1.0, wall_s=T0)
    teams = ledger.totals("team")
    assert (teams["old"].slot_s, teams["new"].slot_s) == (4.0, 1.0)
    assert ledger.totals()["alice"].slot_s == 5.0


def test_old_hours_fold_into_hour_zero_and_all_time_totals_stay_exact() -> None:
    """Past keep_hours, hours fold into one row per principal and team; totals do not change."""
    ledger = UsageLedger(keep_hours=2)
    for hour in range(6):
        ledger.lease_ended("alice", "t", run_s=1.0, wall_s=T0 + hour * BUCKET_S)
    ledger.take_dirty()
    assert len(ledger) == 6
    folded = ledger.fold(T0 + 5 * BUCKET_S)
    assert folded == 3 and len(ledger) == 4
    assert ledger.totals()["alice"].slot_s == 6.0
    rows, deleted = ledger.take_dirty()
    assert [r.hour_s for r in rows] == [0] and rows[0].totals.slot_s == 3.0 and len(deleted) == 3
    assert ledger.fold(T0 + 5 * BUCKET_S) == 0


def test_stored_rows_restore_the_same_totals() -> None:
    """What take_dirty gives back, restored into a new ledger, gives the same totals."""
    ledger = UsageLedger()
    ledger.lease_ended("alice", "t", run_s=2.5, gpus=1.0, receipt=Receipt(joules=7.0, tokens=3), wall_s=T0)
    ledger.plan_ended("alice", "t", "succeeded", wall_s=T0)
    rows, _ = ledger.take_dirty()
    assert ledger.take_dirty() == ([], [])  # nothing changed since
    again = UsageLedger()
    again.restore(rows)
    assert again.totals() == ledger.totals()


def test_a_peers_impossible_figures_count_as_nothing() -> None:
    """Negative or infinite run seconds and receipt figures add nothing (a worker is a peer)."""
    ledger = UsageLedger()
    bad = Receipt(joules=math.inf, co2e_g=-1.0, tokens=-5)
    ledger.lease_ended("alice", "t", run_s=-3.0, receipt=bad, wall_s=T0)
    ledger.lease_ended("alice", "t", run_s=math.nan, wall_s=T0)
    assert ledger.totals()["alice"] == Totals()


def test_a_row_changed_again_after_it_was_taken_is_taken_again() -> None:
    """take_dirty hands back a row each time it changed since the last call, even one changed by the very next call."""
    ledger = UsageLedger()
    ledger.lease_ended("alice", "t", run_s=1.0, wall_s=T0)
    assert [r.totals.slot_s for r in ledger.take_dirty()[0]] == [1.0]
    ledger.plan_ended("alice", "t", "succeeded", wall_s=T0)
    rows, _ = ledger.take_dirty()
    assert [(r.principal, r.totals.succeeded, r.totals.slot_s) for r in rows] == [("alice", 1, 1.0)]


def test_usage_in_the_next_hour_goes_to_that_hours_row() -> None:
    """Two calls in a row for one principal and team but in two hours make two rows."""
    ledger = UsageLedger()
    ledger.lease_ended("alice", "t", run_s=1.0, wall_s=T0)
    ledger.lease_ended("alice", "t", run_s=2.0, wall_s=T0 + BUCKET_S)
    rows, _ = ledger.take_dirty()
    assert [r.totals.slot_s for r in rows] == [1.0, 2.0]
    assert ledger.totals(since_s=T0 + BUCKET_S)["alice"].slot_s == 2.0


def test_usage_of_a_folded_hour_that_comes_late_is_still_counted() -> None:
    """A lease that ends in an hour already folded into hour 0 adds to the totals (its row is made again)."""
    ledger = UsageLedger(keep_hours=1)
    ledger.lease_ended("alice", "t", run_s=1.0, wall_s=T0)
    assert ledger.fold(T0 + 3 * BUCKET_S) == 1
    ledger.lease_ended("alice", "t", run_s=2.0, wall_s=T0)  # the same hour as the row just folded away
    assert ledger.totals()["alice"].slot_s == 3.0
