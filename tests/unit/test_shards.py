"""The shard lease state machine (coordinator/shards.py) with a fake clock: acquire, renew, fence, give back."""

from __future__ import annotations

import pytest

from coordinator.shards import ClusterConfig, LeaseState, Outcome, ShardLeases

CONFIG = ClusterConfig(shards=4, lease_ttl_s=3.0, lease_renew_s=1.0)


def all_rows(epoch: int = 1, shards: int = 4) -> list[tuple[int, int]]:
    return [(s, epoch) for s in range(shards)]


def owner_at(now: float = 0.0) -> ShardLeases:
    leases = ShardLeases(CONFIG, "me")
    leases.attempt(now)
    assert leases.result(all_rows(), now + 0.01) is Outcome.ACQUIRED
    return leases


def test_a_standby_that_gets_every_shard_becomes_the_owner() -> None:
    """The first attempt that returns every slot makes it the owner, with the epochs as its fence."""
    leases = owner_at()
    assert leases.state is LeaseState.OWNER and leases.held == {0: 1, 1: 1, 2: 1, 3: 1}
    assert leases.acquisitions == 1 and leases.due(0.0) == pytest.approx(1.0)


def test_a_standby_that_gets_nothing_scans_again_at_half_the_renew_period() -> None:
    """No slot free: it stays a standby and tries again after scan_s (renew / 2)."""
    leases = ShardLeases(CONFIG, "me")
    leases.attempt(10.0)
    assert leases.result([], 10.02) is Outcome.NONE
    assert leases.state is LeaseState.STANDBY and leases.due(10.0) == pytest.approx(0.5)


def test_holding_some_shards_without_shard_0_gives_them_back() -> None:
    """Phase 1: a partial set without shard 0 is released, so the holder of shard 0 gets every slot."""
    leases = ShardLeases(CONFIG, "me")
    leases.attempt(0.0)
    assert leases.result([(2, 5), (3, 5)], 0.01) is Outcome.GIVE_BACK
    leases.released()
    assert leases.held == {} and leases.state is LeaseState.STANDBY


def test_holding_shard_0_keeps_the_partial_set_and_waits_for_the_rest() -> None:
    """With shard 0 a partial holder keeps what it has and takes the rest when it expires."""
    leases = ShardLeases(CONFIG, "me")
    leases.attempt(0.0)
    assert leases.result([(0, 2), (1, 2)], 0.01) is Outcome.NONE
    leases.attempt(0.5)
    assert leases.result([(0, 2), (1, 2), (2, 3), (3, 3)], 0.51) is Outcome.ACQUIRED


def test_renewals_keep_the_owner_and_move_its_deadline() -> None:
    """Each answered renewal extends valid_until to its send time + ttl - margin."""
    leases = owner_at(0.0)
    leases.attempt(1.0)
    assert leases.result(all_rows(), 1.05) is Outcome.NONE
    assert leases.valid_until == pytest.approx(1.0 + 3.0 - CONFIG.margin_s) and leases.renewals == 1


def test_a_renewal_missing_a_shard_fences_the_owner() -> None:
    """A held slot absent from the answer (someone else took it) is a lost lease: FENCED, fail-stop."""
    leases = owner_at()
    leases.attempt(1.0)
    assert leases.result([(0, 1), (1, 1), (2, 1)], 1.01) is Outcome.FENCED
    assert leases.state is LeaseState.FENCED and "shard(s) 3" in leases.why and 3 not in leases.held


def test_a_changed_epoch_fences_the_owner() -> None:
    """A held slot that comes back with another epoch was taken over in between: FENCED."""
    leases = owner_at()
    leases.attempt(1.0)
    assert leases.result([(0, 1), (1, 2), (2, 1), (3, 1)], 1.01) is Outcome.FENCED


def test_an_owner_that_cannot_renew_in_time_self_demotes() -> None:
    """Failed renewals are retried until ttl - margin after the last good one; then FENCED."""
    leases = owner_at(0.0)
    assert leases.failed(1.0) is Outcome.NONE and leases.state is LeaseState.OWNER
    assert leases.check(2.0) is Outcome.NONE
    assert leases.check(3.0 - CONFIG.margin_s) is Outcome.FENCED
    assert "could expire" in leases.why


def test_a_renewal_answered_after_the_lease_could_expire_fences() -> None:
    """An answer that arrives later than ttl after its send proves nothing: FENCED."""
    leases = owner_at(0.0)
    leases.attempt(1.0)
    assert leases.result(all_rows(), 1.0 + CONFIG.lease_ttl_s) is Outcome.FENCED


def test_a_fenced_coordinator_never_becomes_owner_again() -> None:
    """After FENCED, later answers change nothing (the process stops)."""
    leases = owner_at()
    leases.check(100.0)
    assert leases.result(all_rows(9), 100.1) is Outcome.NONE and leases.state is LeaseState.FENCED


def test_release_on_shutdown() -> None:
    """An owner that gave its slots back is RELEASED and holds nothing."""
    leases = owner_at()
    leases.released()
    assert leases.state is LeaseState.RELEASED and leases.held == {}


@pytest.mark.parametrize(
    ("config", "message"),
    [
        (ClusterConfig(shards=0), "--shards"),
        (ClusterConfig(lease_ttl_s=1.0, lease_renew_s=1.0), "at least twice"),
        (ClusterConfig(name=""), "--cluster-name"),
        (ClusterConfig(lease_renew_s=0), "positive"),
    ],
)
def test_bad_cluster_settings_are_refused(config: ClusterConfig, message: str) -> None:
    """Settings that cannot work are refused with the flag's name."""
    with pytest.raises(ValueError, match=message):
        config.check()


def test_default_timings_meet_the_takeover_target() -> None:
    """Defaults: a dead owner's shards are free after ttl, found within one scan: 3.5 s < 5 s."""
    config = ClusterConfig()
    config.check()
    assert config.lease_ttl_s + config.scan_s <= 3.5


# ---- phase 2: partial ownership, rebalance and pools (pure, fake clock)

from coordinator.shards import LeaseRow, PartialLeases, fair_share, plan_round, pool_of, pool_shard  # noqa: E402


def _rows(owners: list[str], live: list[bool] | None = None) -> list[LeaseRow]:
    live = live or [bool(o) for o in owners]
    return [LeaseRow(s, o, 1, alive) for s, (o, alive) in enumerate(zip(owners, live, strict=True))]


def test_fair_share_is_the_ceiling_over_live_coordinators() -> None:
    """ceil(shards / live coordinators), with at least one coordinator counted."""
    assert (fair_share(16, 3), fair_share(4, 2), fair_share(4, 0)) == (6, 2, 4)


def test_a_lone_coordinator_takes_every_orphaned_slot() -> None:
    """Alone (no live peer), a coordinator's share is every slot: it takes all the expired ones."""
    assert plan_round("a", [], _rows(["", "", "", ""]), {"a"}).acquire == [0, 1, 2, 3]


def test_an_owner_over_its_share_gives_back_a_few_when_another_joins() -> None:
    """A joins B: A (4 of 4) releases at most max_moves slots, B takes nothing held (none orphaned)."""
    rows = _rows(["a", "a", "a", "a"])
    a = plan_round("a", [0, 1, 2, 3], rows, {"a", "b"}, max_moves=1)
    assert a.release == [3] and a.acquire == []
    assert plan_round("b", [], rows, {"a", "b"}).acquire == []


def test_nobody_gives_back_when_no_live_peer_is_under_its_share() -> None:
    """Balanced (2 + 2 of 4): no release, no acquisition."""
    rows = _rows(["a", "a", "b", "b"])
    assert plan_round("a", [0, 1], rows, {"a", "b"}) == plan_round("a", [0, 1], rows, {"a", "b"}).__class__()


def test_survivors_take_a_dead_owners_slots_up_to_their_share() -> None:
    """C died (its leases expired): A and B (share 2 of 4 each) take the orphans, never more than the share."""
    rows = _rows(["a", "b", "c", "c"], [True, True, False, False])
    assert plan_round("a", [0], rows, {"a", "b"}).acquire == [2]
    assert plan_round("b", [1], rows, {"a", "b"}).acquire == [2]  # both try; the database gives it to one


def test_giving_back_is_capped_by_max_moves_per_round() -> None:
    """Three newcomers: an owner of 8 of 8 gives back at most max_moves slots in one round."""
    rows = _rows(["a"] * 8)
    assert plan_round("a", range(8), rows, {"a", "b", "c", "d"}, max_moves=2).release == [7, 6]


def test_partial_leases_win_and_lose_slots_one_by_one() -> None:
    """A changed epoch loses only that slot; a new row is a won slot; the rest stay held."""
    leases = PartialLeases(ClusterConfig(shards=4, lease_ttl_s=3, lease_renew_s=1), "me")
    assert leases.result([(0, 1), (1, 1)], 0.0, 0.1) == ([0, 1], [])
    assert leases.result([(1, 1), (2, 5)], 1.0, 1.1) == ([2], [0])
    assert leases.held == {1: 1, 2: 5}


def test_partial_leases_lose_everything_when_renewals_stop() -> None:
    """No renewal before ttl - margin: every held slot is lost (self-demotion); a late answer too."""
    config = ClusterConfig(shards=4, lease_ttl_s=3, lease_renew_s=1)
    leases = PartialLeases(config, "me")
    leases.result([(0, 1), (3, 2)], 0.0, 0.1)
    assert leases.check(2.0) == []
    assert leases.check(3.0 - config.margin_s) == [0, 3] and leases.held == {}
    leases.result([(0, 1)], 10.0, 10.1)
    assert leases.result([(0, 1)], 11.0, 11.0 + 3.0) == ([], [0])


def test_pools_map_to_shards_and_the_default_pool_to_shard_0() -> None:
    """pool:NAME wins, else the first tag; no tag is the default pool on shard 0; the same name, the same slot."""
    assert pool_of(["gpu", "pool:train"]) == "train" and pool_of(["gpu", "a100"]) == "gpu" and pool_of([]) == ""
    assert pool_shard("", 16) == 0 and pool_shard("gpu", 1) == 0
    assert pool_shard("gpu", 16) == pool_shard("gpu", 16) and 0 <= pool_shard("gpu", 16) < 16
    assert len({pool_shard(f"p{i}", 16) for i in range(100)}) == 16
