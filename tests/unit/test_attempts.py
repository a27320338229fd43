"""Which plan attempts a worker takes bytes for (worker_agent/attempts.py), driven directly with a fake clock."""

from __future__ import annotations

from pathlib import Path

import structlog

import protocol
from worker_agent.attempts import Attempts
from worker_agent.data_side import DataSide, WatchedOutbound
from worker_agent.outbox import SendQueue
from worker_agent.settings import AgentSettings


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def book(**kwargs: object) -> tuple[Attempts, Clock, list[tuple[str, int]]]:
    """An Attempts on a fake clock, recording the attempts it ends."""
    clock = Clock()
    ended: list[tuple[str, int]] = []
    attempts = Attempts(clock=clock, on_end=lambda plan, attempt: ended.append((plan, attempt)), **kwargs)  # type: ignore[arg-type]
    return attempts, clock, ended


def test_an_assigned_attempt_takes_bytes_until_it_is_cancelled() -> None:
    """Live from its assign; after a cancel every request is refused 410 naming the plan, attempt and why."""
    attempts, _, ended = book()
    attempts.assigned("p", 2)
    assert attempts.check("p", 2) is None and attempts.live("p", 2)
    attempts.ended("p", 0, "was cancelled")  # a cancel without an attempt: the live one
    refusal = attempts.check("p", 2)
    assert refusal is not None and refusal.status == 410
    assert refusal.reason.startswith("plan 'p' attempt 2 was cancelled")
    assert ended == [("p", 2)] and not attempts.live("p", 2) and len(attempts) == 0


def test_the_first_reason_given_stands() -> None:
    """A cancel, then the runner's done(cancelled): the refusal says it was cancelled, and it ends once."""
    attempts, _, ended = book()
    attempts.assigned("p", 1)
    attempts.ended("p", 1, "was cancelled")
    attempts.ended("p", 1, "ended cancelled")
    refusal = attempts.check("p", 1)
    assert refusal is not None and "was cancelled" in refusal.reason and ended == [("p", 1)]


def test_a_newer_attempt_supersedes_the_older_and_an_older_assign_changes_nothing() -> None:
    """Attempt 3 assigned over 2: 2 is refused as superseded; a late assign of 1 neither revives nor ends anything."""
    attempts, _, ended = book()
    attempts.assigned("p", 2)
    attempts.assigned("p", 3)
    refusal = attempts.check("p", 2)
    assert refusal is not None and refusal.status == 410 and "superseded by attempt 3" in refusal.reason
    attempts.assigned("p", 1)
    assert attempts.live("p", 3) and ended == [("p", 2)]
    older = attempts.check("p", 1)
    assert older is not None and older.status == 410 and "it runs attempt 3 here" in older.reason


def test_an_upload_before_its_assign_is_held_and_the_assign_makes_it_live() -> None:
    """Bytes for an attempt the worker has not heard of yet are taken; its assign, within the hold, makes it live."""
    attempts, clock, ended = book(early_hold_s=60.0)
    assert attempts.check("p", 1) is None and attempts.held == 1 and attempts.keeps("p", 1)
    clock.now += 59
    attempts.assigned("p", 1)
    clock.now += 600
    assert attempts.expire() == [] and attempts.check("p", 1) is None and ended == []


def test_a_held_attempt_whose_assign_never_comes_ends_and_is_refused() -> None:
    """No assign within the hold: the attempt ends (its bytes go) and later requests get 410 'not assigned'."""
    attempts, clock, ended = book(early_hold_s=60.0)
    assert attempts.check("p", 1) is None
    clock.now += 61
    assert attempts.expire() == [("p", 1)] and ended == [("p", 1)] and not attempts.keeps("p", 1)
    refusal = attempts.check("p", 1)
    assert refusal is not None and refusal.status == 410
    assert "is not assigned to this worker (no assign for it arrived within 60 s" in refusal.reason


def test_a_request_past_the_hold_ends_the_held_attempt_without_a_sweep() -> None:
    """A held attempt's next request after the hold is refused at once, not taken until the sweeper runs."""
    attempts, clock, ended = book(early_hold_s=60.0)
    assert attempts.check("p", 1) is None
    clock.now += 61
    refusal = attempts.check("p", 1)
    assert refusal is not None and refusal.status == 410 and ended == [("p", 1)]


def test_held_attempts_are_bounded_in_number() -> None:
    """Past max_early held attempts one more is answered 503 with a retry hint; an expired hold frees its room."""
    attempts, clock, _ = book(early_hold_s=60.0, max_early=3)
    for n in range(3):
        assert attempts.check(f"p{n}", 1) is None
    busy = attempts.check("p9", 1)
    assert busy is not None and busy.status == 503 and busy.retry_after_s > 0
    assert attempts.held == 3
    clock.now += 61
    assert attempts.check("p9", 1) is None and attempts.held == 1


def test_ended_attempts_are_remembered_within_a_bound() -> None:
    """Only the last max_ended reasons are kept; a forgotten one counts as never heard of (held again)."""
    attempts, _, _ = book(max_ended=2)
    for n in range(3):
        attempts.assigned(f"p{n}", 1)
        attempts.ended(f"p{n}", 1, "ended succeeded")
    assert attempts.reason("p0", 1) is None and attempts.reason("p2", 1) == "ended succeeded"
    assert attempts.check("p0", 1) is None and attempts.held == 1


def test_an_end_for_an_attempt_never_seen_refuses_its_later_uploads() -> None:
    """A revoke answered before any upload came: the attempt's first request is refused, not held."""
    attempts, _, _ = book()
    attempts.ended("p", 4, "was revoked (to be placed again)")
    refusal = attempts.check("p", 4)
    assert refusal is not None and refusal.status == 410 and "was revoked" in refusal.reason
    assert attempts.held == 0


def test_without_reasons_an_attempt_is_still_live_and_its_end_still_drops_its_inputs() -> None:
    """A worker without a data endpoint keeps no reasons (none is read): what is live and on_end stay as they were."""
    attempts, _, ended = book()
    attempts.keeps_reasons = False
    attempts.assigned("p", 1)
    assert attempts.live("p", 1) and attempts.keeps("p", 1)  # a prefetched plan's relayed inputs stay past a sweep
    attempts.ended("p", 0, "was cancelled")
    attempts.ended("q", 3, "")  # never assigned here: its inputs relayed before the assign go too
    assert ended == [("p", 1), ("q", 3)] and len(attempts) == 0
    assert attempts.reason("p", 1) is None and attempts.reason("q", 3) is None


async def test_a_worker_keeps_reasons_only_with_a_data_endpoint(tmp_path: Path) -> None:
    """DataSide says whether reasons are kept; WatchedOutbound makes a done's reason only where it is kept."""
    for listen, reason in ((None, None), ("127.0.0.1:0", "ended succeeded")):
        attempts, _, _ = book()  # (DataSide's on_end: the spool's)
        settings = AgentSettings(spool_dir=str(tmp_path / str(bool(listen))), data_listen=listen)
        side = DataSide(settings, "w1", attempts, lambda msg: None, structlog.get_logger())
        await side.start()
        try:
            assert attempts.keeps_reasons is (listen is not None)
            attempts.assigned("p", 1)
            done = protocol.Done(plan_id="p", attempt=1, outcome="succeeded")
            WatchedOutbound(SendQueue(100, structlog.get_logger()), attempts).send(done)
            assert not attempts.live("p", 1) and attempts.reason("p", 1) == reason
        finally:
            await side.stop()
