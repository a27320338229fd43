"""Reconnect that follows the cluster (issue #25 part 3): protocol/backoff.py and the SDK's Resumer driving it.

The worker agent and the client SDK share one backoff: an answer from any coordinator resets
it, a refusal's Retry-After is the wait (not a floor under a growing random delay), and while
some coordinator of the list answers the ceiling stays at the first step (base, at most 5 s).
"""

from __future__ import annotations

import asyncio
import itertools
import random

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


def test_an_answer_resets_and_the_ceiling_stays_low_while_the_list_answers() -> None:
    """A coordinator of the list answered within the last pass: n is 0 again, and the ceiling never passes 5 s."""
    b = backoff(urls=3)
    for _ in range(8):
        b.unanswered()
    assert b.ceiling_s() == 30.0
    assert 0.0 <= b.answered() <= 0.5 and b.failures == 0
    delays = []
    for _ in range(20):  # the dead owner's URL and a main port that answers moved/1013, in turn
        delays.append(b.unanswered())
        assert b.ceiling_s() <= ANSWERED_CAP_S
        delays.append(b.answered())
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
        assert 0.0 <= b.answered() <= 0.5
        b.unanswered()
        assert b.ceiling_s() == 0.5
        b.unanswered()
        assert b.ceiling_s() == 0.5
    b.unanswered()  # the third in a row: nothing of the list answered for a whole pass
    assert b.answering is False and b.ceiling_s() == 4.0
    b.unanswered()
    assert b.ceiling_s() == 8.0
    high = ReconnectBackoff(8.0, 30.0, urls=3, rng=random.Random(1))  # a base above 5 s is cut while answering
    high.answered()
    high.unanswered()
    assert high.ceiling_s() == ANSWERED_CAP_S


def test_retry_after_is_the_wait_with_a_little_jitter() -> None:
    """Retry-After 1 s is waited as such (1.0 to 1.1 s), however many tries came before; 30 s: 30 to 31 s."""
    b = backoff()
    for _ in range(10):
        b.unanswered()
    waits = [b.answered(1.0) for _ in range(50)]
    assert all(1.0 <= w <= 1.1 for w in waits) and len(set(waits)) > 1
    assert 30.0 <= b.answered(30.0) <= 31.0
    assert 0.0 <= b.answered(0.0) <= 0.5  # 0: no wait named, the jittered delay


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
