"""Where a reconnect dials after a dial that timed out, and how long each dial may take (no sockets).

The SDK's :class:`~fleetwire.connection.UrlList` and the agent's :class:`~worker_agent.handshake.Dialer`
keep the same rule: a URL whose dial timed out (a frozen coordinator) goes to the back of the turn.
tests/integration/test_reconnect_frozen.py drives both over loopback sockets.
"""

from __future__ import annotations

import pytest

from fleetwire import Client
from fleetwire.connection import UrlList
from protocol.messages import Moved
from worker_agent.handshake import Dialer

A, B, C = "ws://a:1/v1/client", "ws://b:1/v1/client", "ws://c:1/v1/client"
WA, WB, WC = "ws://a:1/v1/worker", "ws://b:1/v1/worker", "ws://c:1/v1/worker"


def picks(urls: UrlList, n: int) -> list[str]:
    return [urls.pick() for _ in range(n)]


def test_a_url_that_timed_out_is_skipped_while_another_has_not():
    """A, B, C in turn; B timed out: A, C, A, C... until B is the only one left."""
    urls = UrlList([A, B, C])
    assert picks(urls, 2) == [A, B]
    urls.failed(B, timed_out=True)
    assert picks(urls, 4) == [C, A, C, A]


def test_a_refused_dial_keeps_its_turn():
    """A dial refused at once (not a timeout) costs nothing: the URL stays in turn."""
    urls = UrlList([A, B])
    urls.failed(urls.pick())
    assert picks(urls, 3) == [B, A, B]


def test_every_url_timed_out_means_every_one_in_turn_again():
    """Once all timed out, none is skipped (the whole cluster may have been frozen and be back)."""
    urls = UrlList([A, B])
    for url in picks(urls, 2):
        urls.failed(url, timed_out=True)
    assert picks(urls, 2) == [A, B]


def test_a_moved_to_a_url_that_timed_out_is_followed_and_clears_it_when_it_answers():
    """A ``moved`` is followed even to a URL at the back; its success puts it back in turn."""
    urls = UrlList([A, B])
    urls.failed(urls.pick(), timed_out=True)
    urls.move_to(A)
    assert urls.pick() == A
    urls.succeeded()
    assert picks(urls, 2) == [B, A]


def test_the_client_bounds_only_a_cluster_reconnect():
    """The short bound is the lesser of the two timeouts; None leaves the open timeout."""
    assert Client([A, B], open_timeout_s=10, reconnect_dial_timeout_s=2)._reconnect_timeout_s() == 2
    assert Client([A, B], open_timeout_s=1, reconnect_dial_timeout_s=2)._reconnect_timeout_s() == 1
    assert Client([A, B], open_timeout_s=None, reconnect_dial_timeout_s=2)._reconnect_timeout_s() == 2
    assert Client([A, B], open_timeout_s=10, reconnect_dial_timeout_s=None)._reconnect_timeout_s() == 10
    with pytest.raises(ValueError, match="reconnect_dial_timeout_s"):
        Client(A, reconnect_dial_timeout_s=0)


def test_the_agent_dialer_skips_a_url_that_timed_out():
    """The agent's turn: B timed out, so A and C alternate; B answering later (a ``moved``) puts it back."""
    dialer = Dialer([WA, WB, WC])
    assert [dialer.next_url(), dialer.next_url()] == [WA, WB]
    dialer.dial_ended(WB, timed_out=True)
    assert [dialer.next_url() for _ in range(3)] == [WC, WA, WC]
    dialer.follow(Moved(url=WB))
    assert dialer.next_url() == WB
    dialer.dial_ended(WB, timed_out=False)
    assert [dialer.next_url() for _ in range(3)] == [WA, WB, WC]


def test_the_agent_first_dial_and_a_lone_coordinator_keep_the_handshake_timeout():
    """Cluster: the first dial 10 s, then 3 s. One URL: 10 s each time, until a ``moved`` makes it cluster mode."""
    cluster = Dialer([WA, WB])
    assert [cluster.timeout_s(10, 3) for _ in range(3)] == [10, 3, 3]
    assert Dialer([WA, WB]).timeout_s(2, 3) == 2
    lone = Dialer([WA])
    assert [lone.timeout_s(10, 3) for _ in range(2)] == [10, 10]
    lone.follow(Moved(url=WB))
    lone.next_url()
    assert lone.timeout_s(10, 3) == 3
