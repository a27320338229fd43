"""When a cluster host runs its next round (coordinator/io/cluster/host.py ``next_round_s``), on a fake clock.

A killed owner's shards are taken at the next round after its lease expires. With a round every
scan period (0.5 s) that was up to half a second after the expiry; the rows' time left now
schedules the round just after it, a shard another coordinator just won is polled for its URL (unless the
host hears the URLs published),
and a round that lost an orphan to another coordinator looks again soon. Nothing here decides
whether a lease expired: the acquire statement does, on the database clock.
"""

from __future__ import annotations

import pytest

from coordinator.io.cluster.host import EXPIRY_SLACK_S, URL_POLL_S, next_round_s
from coordinator.shards import LeaseRow

PERIOD = 0.5  # --lease-renew 1 s: a round every 0.5 s


def rows(*specs: tuple[int, str, bool, str]) -> list[LeaseRow]:
    return [LeaseRow(shard, owner, 1, live, url) for shard, owner, live, url in specs]


def test_owners_that_renew_leave_the_period() -> None:
    """Every other owner renewed within the period (about the TTL left) and serves: the next round is a period away."""
    scan = rows((0, "a", True, "ws://a/0"), (1, "b", True, "ws://b/1"), (2, "me", True, "ws://me/2"))
    assert next_round_s(PERIOD, scan, {0: 2.7, 1: 2.9, 2: 2.6}, {2: 1}) == PERIOD


def test_a_lease_about_to_expire_is_tried_just_after_it_can() -> None:
    """An owner that stopped renewing (0.31 s left): the round runs at its expiry plus the slack."""
    scan = rows((0, "a", True, "ws://a/0"), (1, "dead", True, "ws://dead/1"), (2, "dead", True, "ws://dead/2"))
    assert next_round_s(PERIOD, scan, {0: 2.8, 1: 0.31, 2: 0.42}, {}) == pytest.approx(0.31 + EXPIRY_SLACK_S)
    assert next_round_s(PERIOD, scan, {0: 2.8, 1: -0.01, 2: 2.0}, {}) == pytest.approx(EXPIRY_SLACK_S)


def test_own_and_expired_rows_ask_for_nothing() -> None:
    """This host's own rows (renewed by its own rounds) and rows already expired (taken in this round) do not."""
    scan = rows((0, "me", True, ""), (1, "me", True, "ws://me/1"), (2, "gone", False, "ws://gone/2"))
    assert next_round_s(PERIOD, scan, {0: 0.1, 1: 0.2, 2: -1.0}, {0: 3, 1: 3}) == PERIOD


def test_a_shard_won_elsewhere_is_polled_until_it_has_a_url() -> None:
    """Another coordinator won shard 1 and its core is loading (no URL yet): rounds every URL_POLL_S."""
    scan = rows((0, "me", True, "ws://me/0"), (1, "b", True, ""))
    assert next_round_s(PERIOD, scan, {0: 2.9, 1: 2.95}, {0: 2}) == URL_POLL_S


def test_a_shard_won_elsewhere_is_not_polled_while_the_urls_are_heard() -> None:
    """The host LISTENs for the URLs published (their NOTIFY runs the round): a shard without one leaves the period."""
    scan = rows((0, "me", True, "ws://me/0"), (1, "b", True, ""))
    assert next_round_s(PERIOD, scan, {0: 2.9, 1: 2.95}, {0: 2}, hearing=True) == PERIOD
    assert next_round_s(PERIOD, scan, {0: 2.9, 1: 2.95}, {0: 2}, missed=True, hearing=True) == URL_POLL_S


def test_a_round_that_lost_an_orphan_looks_again_soon() -> None:
    """Both standbys ran at the expiry and asked for the same orphan: the loser rescans URL_POLL_S later."""
    scan = rows((0, "a", True, "ws://a/0"))
    assert next_round_s(PERIOD, scan, {0: 2.9}, {}, missed=True) == URL_POLL_S


@pytest.mark.parametrize("phase", [i / 20 for i in range(10)])
def test_takeover_follows_the_expiry_whatever_the_rounds_phase(phase: float) -> None:
    """Fake clock: the owner renewed at 0 (TTL 3 s) and was killed; the standby's rounds start at ``phase``.

    Each round scans (the time left is the expiry minus now) and takes the shard once it expired;
    the next round is ``next_round_s`` later. The takeover comes EXPIRY_SLACK_S after the expiry,
    whatever the phase; with a round every period (before) it came up to 0.5 s after it.
    """
    expiry = 3.0

    def takeover(schedule: str) -> float:
        now = phase
        while True:
            left = expiry - now
            if left < 0:
                return now
            scan = rows((0, "dead", True, "ws://dead/0"))
            now += next_round_s(PERIOD, scan, {0: left}, {}) if schedule == "rows" else PERIOD

    assert takeover("rows") - expiry == pytest.approx(EXPIRY_SLACK_S, abs=1e-9)
    assert takeover("period") - expiry == pytest.approx((phase - expiry) % PERIOD or PERIOD, abs=1e-9)
