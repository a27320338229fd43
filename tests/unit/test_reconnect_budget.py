"""A worker id that registers in a tight loop is refused (issue 17 finding 5, bench phases f5-tags, f5-distinct).

The budget itself (coordinator/reconnects.py) and the core's ``hello`` with a fake clock: past
``worker_reconnect_burst`` registrations (refilled at ``worker_reconnect_rate`` per second) a
``hello`` gets ``error(too_many_reconnects)`` with ``retry_after_s`` and close 4429, before
anything changes. The driver's penalty box for that 4429 is tests/integration/test_reconnect_budget.py.
"""

from __future__ import annotations

import weakref

import pytest

from coordinator.reconnects import ReconnectBudget
from protocol import errors
from protocol.messages import Capabilities, Error, Hello, Requirements, Welcome
from tests.unit.test_core import Harness, only

BURST = 3
RATE = 0.5  # a token every 2 s


@pytest.fixture
def h() -> Harness:
    return Harness(worker_reconnect_burst=BURST, worker_reconnect_rate=RATE)


def hello_on_new_session(h: Harness, worker_id: str, address: str = "10.0.0.9:4000", secret: str = "") -> int:
    """A new worker session says hello ``worker_id``; its connection id."""
    conn = next(h._conns)
    h.core.open_session(conn, "worker", h.now, address=address)
    h.send(conn, Hello(worker_id=worker_id, capabilities=Capabilities(ops=["echo"]), session_secret=secret))
    return conn


_SECRETS: weakref.WeakKeyDictionary[Harness, dict[str, str]] = weakref.WeakKeyDictionary()


def cycle(h: Harness, worker_id: str = "churn") -> list[object]:
    """One connect, hello and disconnect of an agent reconnecting in a loop; what the session was sent.

    Its hello carries the session secret of its last welcome, as the agent's does: without it a
    hello within the reconnect grace of the id's last session is refused (worker_id_in_use).
    """
    secrets = _SECRETS.setdefault(h, {})
    conn = hello_on_new_session(h, worker_id, secret=secrets.get(worker_id, ""))
    sent = h.take(conn)
    for msg in sent:
        if isinstance(msg, Welcome):
            secrets[worker_id] = msg.session_secret
    h.close(conn)
    return sent


def closes_of(h: Harness, conn: int) -> list[int]:
    return [code for c, code, _ in h.closes if c == conn]


# ---------------------------------------------------------------- the budget


def test_the_budget_allows_a_burst_then_its_rate() -> None:
    """burst registrations at once, then one per 1/rate seconds; wait_s says how long until the next."""
    budget = ReconnectBudget(rate=0.5, burst=2)
    for _ in range(2):
        assert budget.wait_s("w", 0.0) == 0.0
        budget.spend("w", 0.0)
    assert budget.wait_s("w", 0.0) == pytest.approx(2.0)
    assert budget.wait_s("w", 1.5) == pytest.approx(0.5)
    assert budget.wait_s("w", 2.0) == 0.0
    assert budget.wait_s("other", 0.0) == 0.0  # per id


def test_refills_summed_in_floats_still_make_a_whole_token() -> None:
    """A token refilled in many small steps (0.1 s at 2/s) counts as whole: no refusal with a 0.0 s wait."""
    budget = ReconnectBudget(rate=0.2, burst=1)
    budget.spend("w", 0.0)
    now = 0.0
    for _ in range(50):
        now += 0.1
        budget.wait_s("w", now)
    assert budget.wait_s("w", 5.0) == 0.0


def test_rate_zero_is_no_budget_and_memory_is_bounded() -> None:
    """rate 0: never refused; past max_keys ids the least recent is forgotten (it starts full again)."""
    off = ReconnectBudget(rate=0.0, burst=1)
    for _ in range(100):
        off.spend("w", 0.0)
    assert off.wait_s("w", 0.0) == 0.0
    small = ReconnectBudget(rate=0.001, burst=1, max_keys=2)
    for key in ("a", "b", "c"):
        small.spend(key, 0.0)
    assert small.wait_s("a", 0.0) == 0.0 and small.wait_s("c", 0.0) > 0


# ---------------------------------------------------------------- the core's hello


def test_a_worker_id_past_its_burst_is_refused_with_retry_after_and_4429(h: Harness) -> None:
    """The burst+1st hello in a row: error(too_many_reconnects) naming the flags, retry_after_s, then close 4429."""
    for _ in range(BURST):
        assert isinstance(only(cycle(h), Welcome), Welcome)
    conn = hello_on_new_session(h, "churn")
    refusal = only(h.take(conn), Error)
    assert refusal.code == errors.TOO_MANY_RECONNECTS
    assert refusal.retry_after_s == pytest.approx(1 / RATE)
    assert "--worker-reconnect-burst" in refusal.message and "'churn'" in refusal.message
    assert closes_of(h, conn) == [errors.CLOSE_RATE_LIMITED]
    assert h.core.counters["worker_reconnects_refused"] == 1
    assert h.core.registry.get("churn").conn_id is None  # not registered on the refused session


def test_a_refused_hello_changes_nothing_and_the_holder_keeps_its_session(h: Harness) -> None:
    """Past the budget, even the live holder's own takeover (with its secret) is refused; the old session stays."""
    for _ in range(BURST - 1):
        cycle(h)
    live = hello_on_new_session(h, "churn", secret=_SECRETS[h]["churn"])
    secret = only(h.take(live), Welcome).session_secret
    c = h.client()
    plan_id = h.submit(c)
    assert h.state(plan_id) == "leased"
    again = hello_on_new_session(h, "churn", secret=secret)
    assert only(h.take(again), Error).code == errors.TOO_MANY_RECONNECTS
    assert live not in [conn for conn, _, _ in h.closes]
    record = h.core.registry.get("churn")
    assert record.conn_id == live and record.leases == {plan_id}


def test_the_id_registers_again_once_its_budget_refills(h: Harness) -> None:
    """After retry_after_s the same id is welcomed; other ids were never held back."""
    for _ in range(BURST):
        cycle(h)
    assert only(cycle(h), Error).code == errors.TOO_MANY_RECONNECTS
    assert isinstance(only(cycle(h, "other"), Welcome), Welcome)
    h.tick(1 / RATE)
    assert isinstance(only(cycle(h), Welcome), Welcome)
    assert only(cycle(h), Error).code == errors.TOO_MANY_RECONNECTS  # one token came back, and went


def test_a_refused_takeover_takes_no_token(h: Harness) -> None:
    """Hellos refused with worker_id_in_use (no proof) do not use up the id's budget."""
    hello_on_new_session(h, "held")  # the live holder: one token
    for _ in range(BURST + 2):
        assert only(cycle(h, "held"), Error).code == errors.WORKER_ID_IN_USE
    assert h.core.counters.get("worker_reconnects_refused", 0) == 0


def test_churn_past_the_budget_no_longer_flips_queued_plans(h: Harness) -> None:
    """A churning worker's refused hellos re-explain nothing: the queued plans' reasons stop changing."""
    c = h.client("bob")
    pid = h.submit(c, requirements=Requirements(tags=["gpu"]))
    for _ in range(BURST):
        cycle(h)
    seq = h.core.plans[pid].next_seq
    for _ in range(20):
        cycle(h)
    assert h.core.plans[pid].next_seq == seq
    assert h.core.counters["worker_reconnects_refused"] == 20


def test_rate_zero_turns_the_budget_off() -> None:
    """worker_reconnect_rate 0: a worker may register as often as it likes."""
    h = Harness(worker_reconnect_rate=0)
    for _ in range(50):
        assert isinstance(only(cycle(h), Welcome), Welcome)


def test_the_flags_reach_the_core_and_bad_values_are_refused() -> None:
    """--worker-reconnect-burst/-rate set CoreConfig; a burst below 1 or a negative rate is refused naming the flag."""
    from coordinator.core import CoreConfig
    from coordinator.io.frontdoor.server import ServerSettings
    from fleetwire.cli.main import build_parser
    from fleetwire.cli.serve import server_settings

    parser = build_parser()
    ns = parser.parse_args(["coordinator", "--insecure", "--worker-reconnect-burst", "3",
                            "--worker-reconnect-rate", "0"])
    core = server_settings(ns, (), ()).core
    assert (core.worker_reconnect_burst, core.worker_reconnect_rate) == (3, 0.0)
    for bad, flag in (({"worker_reconnect_burst": 0}, "--worker-reconnect-burst"),
                      ({"worker_reconnect_rate": -1.0}, "--worker-reconnect-rate")):
        with pytest.raises(ValueError, match=flag):
            ServerSettings(insecure=True, core=CoreConfig(**bad)).check()
