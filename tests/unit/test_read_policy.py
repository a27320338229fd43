"""The reader's verdicts per frame (coordinator/read_policy.py), driven with a fake clock: no sockets."""

from __future__ import annotations

from coordinator.limits import Limits
from coordinator.read_policy import FLOOD, MAX_PAUSE_S, Penalty, ReadPolicy, Verdict, penalty
from protocol import errors as codes


def test_within_the_rate_a_frame_is_read_on_at_once() -> None:
    """A connection within its message rate gets no pause and no close."""
    conn = ReadPolicy(Limits(client_rate=100, client_burst=10, cost_rate=0)).connection("client", "alice", 0.0)
    assert conn.admit(10, 0.0) == 0.0
    assert conn.after(10, 100, 0, 0.0, 0.0, store_over=False) == Verdict()


def test_over_the_rate_the_reader_pauses_until_the_bucket_refills() -> None:
    """Past the burst the pause is the time the rate takes to refill what was overdrawn."""
    conn = ReadPolicy(Limits(client_rate=100, client_burst=10, cost_rate=0)).connection("client", "alice", 0.0)
    pause = conn.admit(30, 0.0)  # 20 over a burst of 10 at 100/s
    assert pause == 0.2
    assert conn.after(30, 100, 0, 0.0, pause, store_over=False) == Verdict(pause_s=0.2)


def test_a_flood_past_the_grace_is_closed_4429() -> None:
    """Over the rate without a break for longer than flood_grace_s: None, the close is FLOOD (4429)."""
    conn = ReadPolicy(Limits(worker_rate=100, worker_burst=10, flood_grace_s=1.0)).connection("worker", "w", 0.0)
    now = 0.0
    verdicts = []
    while now < 1.5:
        verdicts.append(conn.admit(50, now))
        now += 0.1
    assert verdicts[0] is not None and verdicts[0] > 0
    assert None in verdicts and all(v is not None for v in verdicts[: verdicts.index(None)])
    assert FLOOD == (codes.CLOSE_RATE_LIMITED, "message rate limit exceeded")


def test_a_role_without_a_rate_is_never_throttled() -> None:
    """client_rate 0: no bucket, every frame is admitted."""
    conn = ReadPolicy(Limits(client_rate=0, cost_rate=0)).connection("client", "alice", 0.0)
    assert all(conn.admit(1_000_000, t) == 0.0 for t in (0.0, 0.0, 0.001))


def test_a_client_principal_pays_messages_kib_and_what_its_requests_scanned() -> None:
    """Work units: one per message, one per KiB of the frame, plus the session's count; over the bucket, a pause."""
    policy = ReadPolicy(Limits(client_rate=0, cost_rate=1000, cost_burst=100))
    conn = policy.connection("client", "alice", 0.0)
    assert conn.after(10, 20 << 10, 70, 0.0, 0.0, store_over=False) == Verdict()  # 10 + 20 + 70 = the burst
    assert policy.cost_throttles == 0
    verdict = conn.after(1, 0, 49, 0.0, 0.0, store_over=False)  # 50 more at 1000/s
    assert verdict.pause_s == 0.05 and policy.cost_throttles == 1


def test_a_principals_sessions_share_one_bucket_and_workers_pay_nothing() -> None:
    """Two sessions of one principal draw on one bucket; a worker connection is never charged."""
    policy = ReadPolicy(Limits(worker_rate=0, client_rate=0, cost_rate=100, cost_burst=100))
    first, second = policy.connection("client", "alice", 0.0), policy.connection("client", "alice", 0.0)
    assert first.after(100, 0, 0, 0.0, 0.0, store_over=False) == Verdict()
    assert second.after(10, 0, 0, 0.0, 0.0, store_over=False).pause_s == 0.1
    assert policy.connection("client", "bob", 0.0).after(100, 0, 0, 0.0, 0.0, store_over=False) == Verdict()
    worker = policy.connection("worker", "alice", 0.0)
    assert worker.after(10_000, 1 << 20, 10_000, 0.0, 0.0, store_over=False) == Verdict()
    assert policy.cost_throttles == 1


def test_one_cost_pause_is_at_most_max_pause_s() -> None:
    """A principal deep in debt pauses MAX_PAUSE_S at a time, not what it owes."""
    policy = ReadPolicy(Limits(client_rate=0, cost_rate=10, cost_burst=10))
    verdict = policy.connection("client", "alice", 0.0).after(1, 0, 10_000, 0.0, 0.0, store_over=False)
    assert verdict.pause_s == MAX_PAUSE_S


def test_the_rate_pause_and_the_cost_pause_take_the_longer() -> None:
    """Over both its rate and its work units: the reader pauses the longer of the two."""
    policy = ReadPolicy(Limits(client_rate=0, cost_rate=100, cost_burst=10))
    conn = policy.connection("client", "alice", 0.0)
    assert conn.after(1, 0, 19, 0.0, 2.0, store_over=False).pause_s == 2.0
    assert conn.after(1, 0, 99, 0.0, 0.1, store_over=False).pause_s == 1.1  # 110 owed at 100/s


def test_a_store_over_its_backlog_makes_the_reader_wait_for_it() -> None:
    """The committer's backlog over its bound: the verdict says wait for the store, pause or not."""
    conn = ReadPolicy(Limits(client_rate=0, cost_rate=0)).connection("client", "alice", 0.0)
    assert conn.after(1, 10, 0, 0.0, 0.0, store_over=True) == Verdict(wait_for_store=True)
    assert conn.after(1, 10, 0, 0.0, 0.3, store_over=True) == Verdict(pause_s=0.3, wait_for_store=True)


def test_the_frame_budget_lets_the_loop_run_others_past_frame_cost_budget() -> None:
    """A frame's requests may cost frame_cost_budget units in one loop turn, not one more."""
    policy = ReadPolicy(Limits(frame_cost_budget=500))
    assert not policy.over_frame_budget(500)
    assert policy.over_frame_budget(501)


def test_abusive_closes_are_penalized_and_the_cores_4429_per_worker_id() -> None:
    """1009, 4400 and 4429 box the peer; the core's 4429 (reconnect budget) only that worker id; others none."""
    assert penalty(codes.CLOSE_TOO_BIG) == Penalty(codes.CLOSE_TOO_BIG)
    assert penalty(codes.CLOSE_PROTOCOL, by_core=True) == penalty(codes.CLOSE_PROTOCOL) == Penalty(codes.CLOSE_PROTOCOL)
    assert penalty(codes.CLOSE_RATE_LIMITED) == Penalty(codes.CLOSE_RATE_LIMITED)
    assert penalty(codes.CLOSE_RATE_LIMITED, by_core=True) == Penalty(codes.CLOSE_RATE_LIMITED, per_worker_id=True)
    for code in (codes.CLOSE_SLOW_CONSUMER, codes.CLOSE_REVOKED, codes.CLOSE_MOVED, 1000, 1001):
        assert penalty(code) is None and penalty(code, by_core=True) is None
