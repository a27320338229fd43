"""Reconnect that follows the cluster (issue #25 part 3): protocol/backoff.py and the SDK's Resumer driving it.

The worker agent and the client SDK share one backoff: a served session or a ``moved`` holds the
ceiling at the first step (base, at most 5 s) for a pass over the list, a refusal's Retry-After is
the wait (not a floor under a growing random delay), and a refusal without one doubles the ceiling
until a session is served, so a coordinator that answers but refuses is backed off from.
"""

from __future__ import annotations

import asyncio
import itertools
import random
from typing import Any

import pytest

from fleetwire.errors import FleetwireConnectionError
from fleetwire.resume import Resumer
from fleetwire.session import ClientSession
from protocol.backoff import ANSWERED_CAP_S, ReconnectBackoff


def backoff(urls: int = 1, base_s: float = 0.5, cap_s: float = 30.0, seed: int = 1) -> ReconnectBackoff:
    return ReconnectBackoff(base_s, cap_s, urls=urls, rng=random.Random(seed))


def test_nothing_answering_grows_to_the_configured_cap() -> None:
    """Only unanswered tries: the ceiling doubles from base up to the cap (30 s)."""
    b = backoff()
    ceilings = []
    for _ in range(10):
        b.unanswered()
        ceilings.append(b.ceiling_s())
    assert ceilings == [1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0, 30.0, 30.0, 30.0]


def test_a_served_session_resets_and_the_ceiling_stays_low_while_the_list_moves_it() -> None:
    """A session was served: n is 0 again; while a ``moved`` comes within each pass the ceiling never passes 5 s."""
    b = backoff(urls=3)
    for _ in range(8):
        b.unanswered()
    assert b.ceiling_s() == 30.0
    assert 0.0 <= b.served() <= 0.5 and b.failures == 0
    delays = []
    for _ in range(20):  # the dead owner's URL and a main port that answers moved, in turn
        delays.append(b.unanswered())
        assert b.ceiling_s() <= ANSWERED_CAP_S
        delays.append(b.moved())
    assert max(delays) <= ANSWERED_CAP_S
    for _ in range(3):  # a whole pass over the list without an answer: the configured cap again
        b.unanswered()
    assert b.ceiling_s() == 4.0 and b.answering is False
    for _ in range(5):
        b.unanswered()
    assert b.ceiling_s() == 30.0


def test_tries_refused_after_an_answer_stay_at_the_first_step_while_the_list_answers() -> None:
    """A failover as the clients saw it (bench/cluster_chaos.py's clients.log, three main ports, one killed).

    A live main port answers ``moved`` to the dead owner (its lease outlives it), that URL is refused,
    then the list's next URL, the dead coordinator's main port, is refused too: the cluster answered
    one try ago, so the next delay is still U(0, base), not U(0, 2 s) (the client that came back
    2.2 s after its shard was served again). A whole pass with no answer still grows it."""
    b = backoff(urls=3)
    for _ in range(5):  # until the lease expires: moved to the dead owner, refused, the dead main port
        assert b.moved() == 0.0
        b.unanswered()
        assert b.ceiling_s() == 0.5
        b.unanswered()
        assert b.ceiling_s() == 0.5
    b.unanswered()  # the third in a row: nothing of the list answered for a whole pass
    assert b.answering is False and b.ceiling_s() == 4.0
    b.unanswered()
    assert b.ceiling_s() == 8.0
    high = ReconnectBackoff(8.0, 30.0, urls=3, rng=random.Random(1))  # a base above 5 s is cut while answering
    high.moved()
    high.unanswered()
    assert high.ceiling_s() == ANSWERED_CAP_S


def ceilings_after(b: ReconnectBackoff, tries: str) -> list[float]:
    """Drive ``b`` through ``tries`` (s served, m moved, r refused without a wait, w refused with 1 s, u unanswered);
    the ceiling after each, checking each delay against it."""
    ceilings = []
    for kind in tries:
        match kind:
            case "s":
                delay = b.served()
            case "m":
                delay = b.moved()
                assert delay == 0.0
            case "r":
                delay = b.refused()
            case "w":
                delay = b.refused(1.0)
                assert 1.0 <= delay <= 1.1
            case "u":
                delay = b.unanswered()
        if kind != "w":
            assert 0.0 <= delay <= b.ceiling_s()
        ceilings.append(b.ceiling_s())
    return ceilings


@pytest.mark.parametrize("urls", [2, 10])
def test_a_coordinator_that_answers_but_refuses_is_backed_off_while_the_rest_refuse_tcp(urls: int) -> None:
    """A review's storm: one URL answers an HTTP refusal without Retry-After, the others refuse TCP.

    From the second refusal each doubles the ceiling, and the refused connections between do not hold
    it at base: a pass at 0.5 s, then 1 s, 2 s ... 30 s. With 93c5df1's rule every ceiling was 0.5 s
    (the refusal held the pass at base), x1.5 (two URLs) to x7.5 (ten) the dials of the rule before it
    (bench/reconnect_storm.py: per 10,000 peers 19,979 and 3,997 dials/s; now 341 and 166)."""
    b = backoff(urls=urls)
    passes = [ceilings_after(b, "r" + "u" * (urls - 1)) for _ in range(8)]
    assert passes == [[c] * urls for c in (0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0)]
    assert b.answering and not b.held


def test_sessions_closed_before_registering_double_it_until_one_is_served() -> None:
    """A single URL whose websocket closes before ``welcome`` (1013): 0.5, 1, 2 ... 30 s; a served session: base.

    Before, each opened websocket set n back to 0: U(0, 0.5 s) for ever."""
    b = backoff(urls=1)
    assert ceilings_after(b, "rrrrrrrr") == [0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0]
    assert ceilings_after(b, "su") == [0.5, 1.0]  # served: base; then the single URL silent: the first doubling


def test_a_moved_holds_the_pass_but_does_not_undo_the_refusals() -> None:
    """A ``moved`` holds the next pass at base; a refusal without a wait ends the hold and the doublings go on.

    A main port that moves every session to an owner that turns it away (no Retry-After) is backed off
    from (0.5, 1, 2 s), not dialled at U(0, base) (a moved then a refusal, in turn)."""
    b = backoff(urls=3)
    assert ceilings_after(b, "mrmrmr") == [0.5, 0.5, 0.5, 1.0, 0.5, 2.0]
    assert ceilings_after(b, "muuu") == [0.5, 0.5, 0.5, 16.0]  # a silent pass: 2**(3 refusals - 1 + 3 tries)
    assert ceilings_after(b, "s") == [0.5] and b.refusals == 0


def test_a_failover_with_a_no_owner_yet_still_comes_back_within_a_second() -> None:
    """93c5df1's scenario with the 1013 window between the lease's expiry and the new owner's URL.

    The owner is killed (its session was served), the main ports move the peer to the dead owner
    (refused) and the dead main port refuses too, all at base; the first 1013 ("no owner yet") is
    free, a second doubles the ceiling once (1 s), and a main port's moved to the new owner goes at
    once. bench/reconnect_storm.py: back p99 0.90 s, max 1.67 s after the shard was served (0.75 /
    0.91 s with 93c5df1's rule, 2.25 / 2.75 s before it)."""
    b = backoff(urls=3)
    assert ceilings_after(b, "s" + "muu" * 4 + "r" + "m") == [0.5] * 15
    assert ceilings_after(b, "s" + "muu" * 4 + "rr" + "m") == [0.5] * 14 + [1.0, 0.5]


def test_refusals_with_a_wait_neither_grow_it_nor_let_the_dead_urls_grow_it() -> None:
    """A database freeze: the live URL answers 503 with Retry-After, the other two refuse TCP; 20 passes.

    The waits are waited; the refused connections between stay at base (the list answers every
    pass), so the peer is not at the cap when the freeze ends (issue #25 part 3)."""
    b = backoff(urls=3)
    assert ceilings_after(b, "wuu" * 20)[-2:] == [0.5, 0.5]
    assert max(ceilings_after(b, "wuu" * 20)) == 0.5


def test_retry_after_is_the_wait_with_a_little_jitter() -> None:
    """Retry-After 1 s is waited as such (1.0 to 1.1 s), however many tries came before; 30 s: 30 to 31 s."""
    b = backoff()
    for _ in range(10):
        b.unanswered()
    waits = [b.refused(1.0) for _ in range(50)]
    assert all(1.0 <= w <= 1.1 for w in waits) and len(set(waits)) > 1
    assert 30.0 <= b.refused(30.0) <= 31.0
    b.served()
    assert 0.0 <= b.refused(0.0) <= 0.5 and b.ceiling_s() == 0.5  # 0: no wait named; the first refusal is free
    assert 0.0 <= b.refused(0.0) <= 1.0 and b.ceiling_s() == 1.0  # the second doubles


def test_bad_delays_are_refused() -> None:
    """base must be above 0 and at most the cap."""
    with pytest.raises(ValueError, match="0 < base"):
        ReconnectBackoff(0.0, 1.0)
    with pytest.raises(ValueError, match="0 < base"):
        ReconnectBackoff(2.0, 1.0)


async def test_the_client_comes_back_at_the_retry_after_not_a_grown_backoff() -> None:
    """Eight 503s with Retry-After 0.05 s in a row (the database away): the session resumes ~0.5 s later.

    Before: each refusal grew the backoff (base 0.2 s, cap 30 s: ~25 s expected for eight); the
    Retry-After was only a floor under it."""
    refusals = 8
    dials: list[float] = []
    attached = asyncio.Event()
    loop = asyncio.get_running_loop()

    async def dial() -> str:
        dials.append(loop.time())
        if len(dials) <= refusals:
            raise FleetwireConnectionError("HTTP 503: database away", retry_after_s=0.05, answered=True)
        return "connection"

    resumer: Resumer[str] = Resumer(
        ClientSession("msgpack"), dial=dial, attach=lambda _c: attached.set(), end=lambda e: None, enabled=True,
        base_s=0.2, cap_s=30.0, give_up_s=None, urls=3,
    )  # fmt: skip
    started = loop.time()
    resumer.start(FleetwireConnectionError("lost the connection"))
    await asyncio.wait_for(attached.wait(), 5)
    gaps = [b - a for a, b in itertools.pairwise(dials)]
    assert len(dials) == refusals + 1
    assert all(0.04 <= gap <= 0.3 for gap in gaps), gaps
    assert loop.time() - started < 3.0


class RecordingBackoff(ReconnectBackoff):
    """The backoff, with what its caller said each try came to."""

    made: list[RecordingBackoff] = []

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.said: list[str] = []
        RecordingBackoff.made.append(self)

    def served(self) -> float:
        self.said.append("served")
        return super().served()

    def moved(self) -> float:
        self.said.append("moved")
        return super().moved()

    def refused(self, retry_after_s: float | None = None) -> float:
        self.said.append(f"refused {retry_after_s or 0:g}")
        return super().refused(retry_after_s)

    def unanswered(self) -> float:
        self.said.append("unanswered")
        return super().unanswered()


async def test_the_client_backs_off_from_sessions_closed_1013_before_they_served(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The SDK keeps one backoff across resumes and tells it what each ended session was.

    A session closed 1013 (a main port's "no owner yet") was not served: a doubling, and the next
    one doubles again; 4307 is a ``moved``; any other end (a drop) was a served session. Before,
    each resume made a new backoff and called every end an answer: U(0, base) for ever."""
    RecordingBackoff.made = []
    monkeypatch.setattr("fleetwire.resume.ReconnectBackoff", RecordingBackoff)
    attached: asyncio.Queue[str] = asyncio.Queue()
    dials = iter([FleetwireConnectionError("HTTP 500", answered=True), "c1", "c2", "c3", "c4"])

    async def dial() -> str:
        item = next(dials)
        if isinstance(item, Exception):
            raise item
        return item

    resumer: Resumer[str] = Resumer(
        ClientSession("msgpack"), dial=dial, attach=attached.put_nowait, end=lambda e: None, enabled=True,
        base_s=0.01, cap_s=0.08, give_up_s=None, urls=1,
    )  # fmt: skip
    for close_code in (1013, 1013, 4307, None):
        resumer.start(FleetwireConnectionError("closed", close_code=close_code))
        await asyncio.wait_for(attached.get(), 5)
    assert len(RecordingBackoff.made) == 1
    b = RecordingBackoff.made[0]
    assert b.said == ["refused 0", "refused 0", "refused 0", "moved", "served"]
    assert b.ceiling_s() == 0.01 and b.refusals == 0


async def test_the_client_takes_a_connection_that_went_silent_as_a_dial_that_timed_out(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A connection left as silent (no reply to its first request within the dial's bound, fleetwire/connection.py
    FirstReply; or nothing until the keepalive gave up) is unanswered for the backoff, as a dial that timed out,
    not a refusal: it grows the ceiling only once a whole pass over the list was silent."""
    RecordingBackoff.made = []
    monkeypatch.setattr("fleetwire.resume.ReconnectBackoff", RecordingBackoff)
    attached: asyncio.Queue[str] = asyncio.Queue()

    async def dial() -> str:
        return "connection"

    resumer: Resumer[str] = Resumer(
        ClientSession("msgpack"), dial=dial, attach=attached.put_nowait, end=lambda e: None, enabled=True,
        base_s=0.01, cap_s=0.08, give_up_s=None, urls=2,
    )  # fmt: skip
    for _ in range(2):
        resumer.start(FleetwireConnectionError("answered no request"), served=False, timed_out=True)
        await asyncio.wait_for(attached.get(), 5)
    b = RecordingBackoff.made[0]
    assert b.said == ["unanswered", "unanswered"] and b.refusals == 0
