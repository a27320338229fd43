"""A closed connection is not silence (issue #25 part 2); a reconnecting worker's id cannot be taken (issue #24 part 6).

The core with a fake clock: a worker whose session closed keeps its plans for the reconnect grace
(``worker_reconnect_grace_s``, 5 s by default), continues them when it reconnects in time with its
session secret, and has them requeued once the grace is over, long before the heartbeat timeout
(30 s). Heartbeat silence on an open session still waits for the timeout. Within the grace the id
is refused to a hello without the secret or the holder's client certificate.
"""

from __future__ import annotations

import pytest

from coordinator.registry import WorkerRegistry
from protocol import errors
from protocol.messages import Accept, Capabilities, Error, Event, Hello, RunningPlan, Welcome
from tests.unit.test_core import Harness, only

GRACE_S = 5.0


@pytest.fixture
def h() -> Harness:
    return Harness(worker_reconnect_grace_s=GRACE_S)


def running_plan(h: Harness, worker_id: str = "w1") -> tuple[int, int, str]:
    """A worker running one plan: (worker session, client session, plan id)."""
    w = h.worker(worker_id)
    c = h.client()
    plan_id = h.submit(c)
    h.send(w, Accept(plan_id=plan_id, attempt=1))
    h.take(w)
    h.take(c)
    return w, c, plan_id


def hello_from(h: Harness, worker_id: str, *, secret: str = "", identity: str = "", running: tuple[str, ...] = ()
               ) -> int:  # fmt: skip
    conn = next(h._conns)
    h.core.open_session(conn, "worker", h.now, address=f"10.9.9.{conn}:5000", identity=identity)
    h.send(conn, Hello(worker_id=worker_id, capabilities=Capabilities(ops=["echo"]), session_secret=secret,
                       running=[RunningPlan(p, 1) for p in running]))  # fmt: skip
    return conn


def test_a_closed_connection_requeues_its_plans_after_the_grace_not_the_heartbeat_timeout(h: Harness) -> None:
    """kill -9: the session closes; the plan stays leased for the grace, then is requeued, at ~5 s not ~30 s."""
    w, _, plan_id = running_plan(h)
    h.now = 2.0
    h.close(w)
    assert h.tick(2.0 + GRACE_S - 0.1) == [] and h.state(plan_id) == "running"
    assert h.tick(2.0 + GRACE_S + 0.1) == ["w1"]
    plan = h.core.plans[plan_id]
    assert plan.state == "queued" and plan.worker_id is None
    assert plan.history[-1]["outcome"] == "lost"
    assert "did not reconnect within the reconnect grace (5 s)" in plan.history[-1]["reason"]
    assert "w1" not in h.core.registry


def test_a_worker_that_reconnects_within_the_grace_continues_its_plans(h: Harness) -> None:
    """Back within the grace with its session secret: continue_plans, and the old grace deadline reaps nothing."""
    w, _, plan_id = running_plan(h)
    h.close(w)
    h.now = GRACE_S - 1.0
    back = h.worker("w1", running=[(plan_id, 1)])
    welcome = only(h.take(back), Welcome)
    assert welcome.continue_plans == [plan_id]
    assert h.tick(GRACE_S + 1.0) == [] and h.state(plan_id) == "running"
    assert h.core.registry.get("w1").conn_id == back


def test_heartbeat_silence_on_an_open_session_keeps_the_heartbeat_timeout(h: Harness) -> None:
    """An open but silent session is not reaped at the grace: only past heartbeat_timeout_s (30 s)."""
    _, _, plan_id = running_plan(h)
    assert h.tick(GRACE_S + 1.0) == [] and h.state(plan_id) == "running"
    assert h.tick(29.9) == []
    assert h.tick(30.1) == ["w1"] and h.state(plan_id) == "queued"


def test_a_hello_without_the_secret_is_refused_within_the_grace_and_the_holder_comes_back(h: Harness) -> None:
    """Issue #24 part 6: a worker token cannot take a reconnecting worker's id; the honest worker then continues."""
    w, _, plan_id = running_plan(h)
    secret = h.secrets["w1"]
    h.now = 1.0
    h.close(w)
    h.now = 2.0
    impostor = hello_from(h, "w1", running=(plan_id,))
    refusal = only(h.take(impostor), Error)
    assert refusal.code == errors.WORKER_ID_IN_USE and refusal.retry_after_s == pytest.approx(4.0)
    assert "reconnect" in refusal.message and secret not in refusal.message
    assert (impostor, errors.CLOSE_REPLACED) in [(conn, code) for conn, code, _ in h.closes]
    assert h.core.registry.get("w1").leases == {plan_id} and h.state(plan_id) == "running"
    assert h.core.counters["takeovers_refused"] == 1
    h.now = 3.0
    honest = hello_from(h, "w1", secret=secret, running=(plan_id,))
    assert only(h.take(honest), Welcome).continue_plans == [plan_id]


def test_the_holders_client_certificate_is_proof_within_the_grace(h: Harness) -> None:
    """With mTLS, the holder's certificate identity takes the id back within the grace; another one is refused."""
    conn = next(h._conns)
    h.core.open_session(conn, "worker", h.now, address="10.0.0.1:4000", identity="cert-a")
    h.send(conn, Hello(worker_id="gpu-1", capabilities=Capabilities(ops=["echo"])))
    h.close(conn)
    h.now = 1.0
    assert only(h.take(hello_from(h, "gpu-1", identity="cert-b")), Error).code == errors.WORKER_ID_IN_USE
    assert only(h.take(hello_from(h, "gpu-1", identity="cert-a")), Welcome).worker_id == "gpu-1"


def test_after_the_grace_the_id_is_free_again(h: Harness) -> None:
    """A restarted worker (no secret) gets its id once the grace is over; its old plans were requeued."""
    w, _, plan_id = running_plan(h)
    h.close(w)
    h.tick(GRACE_S + 0.5)
    restarted = hello_from(h, "w1")
    assert only(h.take(restarted), Welcome).worker_id == "w1"
    assert h.core.plans[plan_id].attempt == 2  # requeued at the grace, then placed on the new session


def test_grace_zero_requeues_at_the_next_tick() -> None:
    """worker_reconnect_grace_s 0: a closed session's plans are requeued at the next tick, and no hello is refused."""
    h = Harness(worker_reconnect_grace_s=0.0)
    w, _, _ = running_plan(h)
    h.close(w)
    assert only(h.take(hello_from(h, "w1")), Welcome)  # no grace: nothing to hold the id for
    h2 = Harness(worker_reconnect_grace_s=0.0)
    w2, _, plan2 = running_plan(h2)
    h2.close(w2)
    assert h2.tick(0.01) == ["w1"] and h2.state(plan2) == "queued"


def test_registry_grace_clock_starts_at_disconnect_and_stops_at_register() -> None:
    """disconnect(now) makes the worker stale after the grace; registering again in time cancels it."""
    reg = WorkerRegistry(heartbeat_timeout_s=30.0, reconnect_grace_s=5.0)
    reg.register("a", Capabilities(), 0.0)
    reg.register("b", Capabilities(), 0.0)
    reg.disconnect("a", 1.0)
    reg.disconnect("b", 1.0)
    assert reg.in_grace("a", 3.0) == pytest.approx(3.0)
    reg.register("b", Capabilities(), 4.0)
    assert reg.in_grace("b", 4.0) is None
    assert [r.id for r in reg.stale(6.0)] == []
    assert [r.id for r in reg.stale(6.1)] == ["a"]
    assert [r.id for r in reg.stale(6.2)] == ["a"]  # stays stale until reaped
    assert reg.reap(6.2) == ["a"] and reg.stale(20.0) == []
    reg.disconnect("b", 25.0)  # a disconnect without a fresh beat: the heartbeat timeout still applies
    assert [r.id for r in reg.stale(34.1)] == ["b"]


def test_a_disconnect_without_a_time_waits_for_the_heartbeat_timeout() -> None:
    """A restored lease's placeholder (no disconnect time) keeps its one heartbeat timeout."""
    reg = WorkerRegistry(heartbeat_timeout_s=30.0, reconnect_grace_s=5.0)
    reg.register("a", Capabilities(), 0.0)
    reg.disconnect("a")
    assert reg.stale(10.0) == [] and [r.id for r in reg.stale(30.1)] == ["a"]


def test_the_flag_reaches_the_core_and_a_negative_grace_is_refused() -> None:
    """--worker-reconnect-grace-s sets CoreConfig (default 5 s); a negative value is refused naming the flag."""
    from coordinator.core import CoreConfig
    from coordinator.io.frontdoor.server import ServerSettings
    from fleetwire.cli.main import build_parser
    from fleetwire.cli.serve import server_settings

    parser = build_parser()
    default = server_settings(parser.parse_args(["coordinator", "--insecure"]), (), ()).core
    assert default.worker_reconnect_grace_s == 5.0
    ns = parser.parse_args(["coordinator", "--insecure", "--worker-reconnect-grace-s", "2.5"])
    assert server_settings(ns, (), ()).core.worker_reconnect_grace_s == 2.5
    with pytest.raises(ValueError, match="--worker-reconnect-grace-s"):
        ServerSettings(insecure=True, core=CoreConfig(worker_reconnect_grace_s=-1.0)).check()


def test_events_of_a_continued_plan_still_flow_after_the_grace_deadline(h: Harness) -> None:
    """A continued plan's events after the old grace deadline are forwarded (its lease was never taken back)."""
    w, _, plan_id = running_plan(h)
    h.close(w)
    h.now = 1.0
    back = h.worker("w1", running=[(plan_id, 1)])
    h.tick(GRACE_S + 2.0)
    h.send(back, Event(plan_id=plan_id, attempt=1, kind="log", data="still here", seq=0))
    assert h.core.plans[plan_id].events[-1].data == "still here"
