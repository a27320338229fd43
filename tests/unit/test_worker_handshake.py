"""The worker's handshake rules (worker_agent/handshake.py), driven directly: no sockets, no agent."""

from __future__ import annotations

from protocol.codec import DecodeFailure
from protocol.messages import Ack, Assign, Capabilities, Error, Hello, Moved, RunningPlan, Welcome
from worker_agent.handshake import Answer, Dialer, Welcomed, hello, upgrade_refusal, worker_urls
from worker_agent.session import AuthError

WELCOME = Welcome(worker_id="w1", heartbeat_interval_s=10.0, heartbeat_timeout_s=30.0)


def test_dials_go_through_the_list_in_turn() -> None:
    """Without a ``moved`` each dial takes the list's next URL, round and round; one URL is not cluster mode."""
    dialer = Dialer(["ws://a/v1/worker", "ws://b/v1/worker"])
    assert dialer.cluster
    assert [dialer.next_url() for _ in range(5)] == ["ws://a/v1/worker", "ws://b/v1/worker"] * 2 + ["ws://a/v1/worker"]
    assert not Dialer(["ws://a/v1/worker"]).cluster


def test_a_moved_sends_the_next_dial_there_once_and_makes_it_cluster_mode() -> None:
    """A ``moved`` with a URL: the next dial goes there (its worker path added) and pings go to cluster mode."""
    dialer = Dialer(["ws://a/v1/worker"])
    dialer.follow(Moved(shard=2, epoch=7, url="ws://c:8765"))
    assert dialer.moved
    assert dialer.next_url() == "ws://c:8765/v1/worker"
    assert dialer.cluster and not dialer.moved
    assert dialer.next_url() == "ws://a/v1/worker"


def test_a_moved_without_a_url_leaves_the_list() -> None:
    """A ``moved`` naming no owner yet ("") sends the next dial to the list."""
    dialer = Dialer(["ws://a/v1/worker", "ws://b/v1/worker"])
    dialer.follow(Moved(shard=1, epoch=1, url=""))
    assert not dialer.moved
    assert dialer.next_url() == "ws://a/v1/worker"


def test_401_and_403_refusals_are_fatal_and_name_the_fix() -> None:
    """401: the token; 403 naming a client certificate: mTLS flags; other 403: the role; other statuses: None."""
    token = upgrade_refusal("ws://a/v1/worker", 401, b"")
    assert isinstance(token, AuthError) and token.status == 401 and "--token or FLEETWIRE_WORKER_TOKEN" in str(token)
    mtls = upgrade_refusal("ws://a/v1/worker", 403, b"a client certificate is required\n")
    assert isinstance(mtls, AuthError) and "--tls-cert and --tls-key" in str(mtls)
    role = upgrade_refusal("ws://a/v1/worker", 403, b"role client may not open /v1/worker")
    assert isinstance(role, AuthError) and "worker role (role client may not open /v1/worker)" in str(role)
    assert "no reason given" in str(upgrade_refusal("ws://a/v1/worker", 403, b""))
    assert upgrade_refusal("ws://a/v1/worker", 429, b"") is None
    assert upgrade_refusal("ws://a/v1/worker", 503, b"") is None


def test_hello_lists_running_plans_then_recent_results_of_other_plans() -> None:
    """The hello lists what runs (or holds a done) first, then recent results of plans not listed already."""
    asked: list[set[str]] = []

    def recent(exclude: set[str]) -> list[RunningPlan]:
        asked.append(exclude)
        return [RunningPlan(plan_id="old", attempt=1)]

    caps = Capabilities(ops=["echo"])
    msg = hello("w1", caps, running=[RunningPlan(plan_id="p", attempt=2)], recent=recent, session_secret="s3",
                data_url="http://h:9")  # fmt: skip
    assert isinstance(msg, Hello)
    assert [(r.plan_id, r.attempt) for r in msg.running] == [("p", 2), ("old", 1)]
    assert asked == [{"p"}]
    assert (msg.worker_id, msg.capabilities, msg.session_secret, msg.data_url) == ("w1", caps, "s3", "http://h:9")


def test_the_welcome_keeps_the_messages_around_it_in_order() -> None:
    """Messages before the welcome, then those after it in its frame, are handed back to dispatch in order."""
    answer = Answer()
    first = Ack(seq=1)
    assert answer.feed([first]) is None
    assign = Assign(plan_id="p", attempt=1, op="echo")
    failure = DecodeFailure(code="invalid_message", message="bad")
    verdict = answer.feed([Ack(seq=2), WELCOME, assign, failure])
    assert verdict == Welcomed(WELCOME, [first, Ack(seq=2), assign, failure])


def test_an_error_or_a_moved_decides_the_handshake() -> None:
    """An ``error`` (a refused hello) or a ``moved`` ends the reading; what came before is dropped with it."""
    refusal = Error(code="too_many_reconnects", message="slow down", retry_after_s=2.5)
    assert Answer().feed([Ack(seq=1), refusal, WELCOME]) is refusal
    moved = Moved(shard=1, epoch=3, url="ws://b")
    assert Answer().feed([moved]) is moved


def test_cluster_urls_ask_for_the_workers_pool() -> None:
    """A list of URLs asks each for the pool (its first tag), unless a URL has a query; one URL only with pool:."""
    assert worker_urls("ws://a:1, ws://b:2?pool=x", ["gpu", "fast"]) == [
        "ws://a:1/v1/worker?pool=gpu", "ws://b:2/v1/worker?pool=x",
    ]
    assert worker_urls("ws://a:1", ["gpu"]) == ["ws://a:1/v1/worker"]
    assert worker_urls("ws://a:1", ["gpu", "pool:big"]) == ["ws://a:1/v1/worker?pool=big"]
    assert worker_urls("ws://a:1,ws://b:2", []) == ["ws://a:1/v1/worker", "ws://b:2/v1/worker"]
