"""Shared fleets in the core (issue #27): fair share, quotas, preemption and the usage ledger, with a fake clock."""

from __future__ import annotations

from typing import Any

from coordinator.sharing import BACKSTOP_S
from coordinator.teams import Member, Team, TeamBook
from protocol import errors
from protocol.messages import (
    Accept,
    Assign,
    Cancel,
    Done,
    Error,
    ErrorInfo,
    Event,
    GetUsage,
    Heartbeat,
    Preempt,
    Submit,
    Usage,
)
from tests.unit.test_core import Harness


class Fleet:
    """A core with client sessions per principal and one worker whose plans end when the test says."""

    def __init__(self, slots: int = 2, teams: TeamBook | None = None, **config: Any) -> None:
        self.h = Harness(**config)
        if teams is not None:
            self.h.core.set_teams(teams, 0.0)
        self.w = self.h.worker("w1", max_concurrency=slots)
        self.h.take(self.w)
        self.clients: dict[str, int] = {}
        self.running: list[tuple[str, int]] = []  # (plan key, attempt) the worker runs, in start order
        self.inbox: list[Any] = []  # what the worker got besides assigns

    def client(self, principal: str) -> int:
        if principal not in self.clients:
            self.clients[principal] = self.h.client(principal)
        return self.clients[principal]

    def submit(self, principal: str, **kw: Any) -> str:
        return self.h.submit(self.client(principal), "echo", **kw)

    def at(self, now: float) -> None:
        """The clock moves to ``now``: the worker beats, the core ticks, the worker takes its assigns."""
        self.h.now = now
        self.h.send(self.w, Heartbeat())
        self.h.tick(now)
        self._start()

    def _start(self) -> None:
        """The worker accepts every assign it got."""
        for msg in self.h.take(self.w):
            if isinstance(msg, Assign):
                self.running.append((msg.plan_id, msg.attempt))
                self.h.send(self.w, Accept(plan_id=msg.plan_id, attempt=msg.attempt))
            else:
                self.inbox.append(msg)

    def finish(self, plan_id: str, outcome: str = "succeeded", **kw: Any) -> None:
        attempt = next(a for p, a in self.running if p == plan_id)
        self.running.remove((plan_id, attempt))
        self.h.send(self.w, Done(plan_id=plan_id, attempt=attempt, outcome=outcome, **kw))  # type: ignore[arg-type]
        self._start()

    def owner(self, plan_id: str) -> str:
        return self.h.core.plans[plan_id].owner


def two_teams(**alice: Any) -> TeamBook:
    return TeamBook([Team("ml", **alice), Team("web")], {"alice": Member("ml"), "bob": Member("web")})


def test_a_trickle_is_served_before_a_flood_submitted_earlier() -> None:
    """Alice floods one worker of 2 slots with 40 plans; bob's 4 later plans get every other freed slot (his equal
    share), not the slots after alice's 38 waiting plans."""
    f = Fleet(slots=2)
    flood = [f.submit("alice") for _ in range(40)]
    f._start()
    trickle = [f.submit("bob") for _ in range(4)]
    f._start()
    ended = 0
    while any(f.h.core.plans[p].state == "queued" for p in trickle):
        f.finish(f.running[0][0])
        ended += 1
    assert ended <= 2 * len(trickle)  # first come, first served: 38 + 4
    assert sum(f.h.core.plans[p].state == "queued" for p in flood) >= 30


def test_one_principal_keeps_priority_then_age() -> None:
    """With one principal the fair queue serves as before: higher priority first, then older first."""
    f = Fleet(slots=1)
    first = f.submit("alice")
    f._start()
    low, high, later = f.submit("alice"), f.submit("alice", priority=5), f.submit("alice")
    order = []
    f.finish(first)
    for _ in range(3):
        plan_id = f.running[0][0]
        order.append(plan_id)
        f.finish(plan_id)
    assert order == [high, low, later]


def preempt_setup(**config: Any) -> tuple[Fleet, list[str], str]:
    f = Fleet(slots=2, teams=two_teams(), preemption_grace_s=30.0, preemption_min_run_s=10.0, **config)
    held = [f.submit("alice", preemptible=True) for _ in range(2)]
    f.at(0.0)
    f.at(5.0)
    waiting = f.submit("bob")
    f._start()
    return f, held, waiting


def test_preemption_waits_for_the_minimum_run() -> None:
    """No plan is preempted before it has run --preemption-min-run seconds."""
    f, _, waiting = preempt_setup()
    f.at(9.0)
    assert not [m for m in f.inbox if isinstance(m, Preempt)]
    assert f.h.core.plans[waiting].state == "queued"


def test_a_team_below_its_share_preempts_the_newest_preemptible_plan() -> None:
    """Bob waits behind alice's 2 preemptible plans: the newer is preempted, bob runs in its slot, it is requeued."""
    f, held, waiting = preempt_setup()
    client = f.clients["alice"]
    f.h.take(client)
    f.at(11.0)
    preempts = [m for m in f.inbox if isinstance(m, Preempt)]
    assert [p.plan_id for p in preempts] == [held[1]] and preempts[0].grace_s == 30.0
    assert "team web is below its share" in preempts[0].reason
    events = [e for e in f.h.take(client) if isinstance(e, Event) and e.plan_id == held[1]]
    assert [e.kind for e in events] == ["preempted"] and events[0].data["grace_s"] == 30.0
    f.at(12.0)  # one preemption at a time: nothing more while it is under way
    assert len([m for m in f.inbox if isinstance(m, Preempt)]) == 1
    f.finish(held[1], "cancelled", preempted=True, error=ErrorInfo(errors.CANCELLED, "preempted: checkpointed"))
    core = f.h.core
    assert core.plans[waiting].state == "running" and core.plans[waiting].worker_id == "w1"
    victim = core.plans[held[1]]
    assert victim.state == "queued" and victim.free_attempts == 1 and victim.history[-1]["outcome"] == "preempted"
    kinds = [e.kind for e in f.h.take(client) if isinstance(e, Event) and e.plan_id == held[1]]
    assert kinds == ["requeued", "waiting"]  # its preempted event went out with the preempt
    usage = core.sharing.ledger.totals("principal")
    assert usage["alice"].preemptions == 1 and usage["alice"].cancelled == 0


def test_a_preempted_plan_that_succeeds_within_its_grace_has_ended() -> None:
    """A victim whose done says succeeded ends the plan; the waiting plan takes its slot."""
    f, held, waiting = preempt_setup()
    f.at(11.0)
    f.finish(held[1], "succeeded", result=1)
    core = f.h.core
    assert core.plans[held[1]].state == "succeeded"
    assert core.plans[waiting].state == "running"


def test_a_worker_that_ignores_preempt_has_the_plan_taken_back() -> None:
    """Past grace + the backstop the coordinator cancels the victim on its worker and requeues it itself."""
    f, held, waiting = preempt_setup()
    f.at(11.0)
    f.at(11.0 + 30.0 + BACKSTOP_S - 1)
    assert f.h.core.plans[waiting].state == "queued"
    f.inbox.clear()
    f.at(11.0 + 30.0 + BACKSTOP_S + 0.5)
    assert [m.plan_id for m in f.inbox if isinstance(m, Cancel)] == [held[1]]
    core = f.h.core
    assert core.plans[waiting].state == "running"
    assert core.plans[held[1]].state == "queued" and core.plans[held[1]].free_attempts == 1
    assert core.counters["preemptions_taken_back"] == 1


def test_plans_not_marked_preemptible_are_never_preempted() -> None:
    """A fleet full of plans that are not preemptible leaves the waiting plan waiting."""
    f = Fleet(slots=2, teams=two_teams())
    for _ in range(2):
        f.submit("alice")
    f.at(0.0)
    waiting = f.submit("bob")
    f.at(100.0)
    assert not [m for m in f.inbox if isinstance(m, Preempt)]
    assert f.h.core.plans[waiting].state == "queued"


def test_an_interrupted_host_hands_its_plan_back_without_charging_an_attempt() -> None:
    """A done(cancelled, preempted=True) nobody asked for (the host is going away) requeues the plan for free."""
    f = Fleet(slots=1)
    plan_id = f.submit("alice", max_attempts=1)
    f._start()
    client = f.clients["alice"]
    f.h.take(client)
    f.finish(plan_id, "cancelled", preempted=True, error=ErrorInfo(errors.CANCELLED, "host interrupted: spot"))
    plan = f.h.core.plans[plan_id]
    assert plan.state in ("queued", "leased", "running") and plan.attempt - plan.free_attempts == 1
    kinds = [e.kind for e in f.h.take(client) if isinstance(e, Event)]
    assert kinds[:2] == ["preempted", "requeued"]


def test_a_submit_past_the_team_max_queued_is_refused() -> None:
    """A team at its max_queued gets too_many_plans naming the team; nothing is queued."""
    book = TeamBook([Team("ml", max_queued=2)], {"alice": Member("ml")})
    f = Fleet(slots=1, teams=book)
    f.submit("alice")
    f._start()
    for _ in range(2):
        f.submit("alice")
    client = f.clients["alice"]
    f.h.take(client)
    f.h.send(client, Submit(req_id=99, op="echo"))
    refused = [m for m in f.h.take(client) if isinstance(m, Error)]
    assert refused and refused[0].code == errors.TOO_MANY_PLANS and "team ml has 2 plans queued" in refused[0].message
    assert len(f.h.core.plans) == 3


def test_a_team_past_a_quota_it_may_not_borrow_beyond_waits_with_the_quota_as_reason() -> None:
    """max_running = 1, borrow = false: the second plan waits on a worker with room, saying why; it runs after."""
    book = TeamBook([Team("ml", max_running=1, borrow=False)], {"alice": Member("ml")})
    f = Fleet(slots=2, teams=book)
    first = f.submit("alice")
    f._start()
    client = f.clients["alice"]
    f.h.take(client)
    second = f.submit("alice")
    f._start()
    waiting = [e for e in f.h.take(client) if isinstance(e, Event) and e.kind == "waiting"]
    assert waiting[-1].data["reason"] == "team ml is at its quota of 1 running plan"
    assert f.h.core.plans[second].state == "queued"
    f.finish(first)
    assert f.h.core.plans[second].state == "running"


def test_usage_is_counted_per_principal_and_shown_to_whom_it_belongs() -> None:
    """get_usage: an admin sees both principals (and teams); a client sees only its own row."""
    f = Fleet(slots=2, teams=two_teams())
    a, b = f.submit("alice"), f.submit("bob")
    f.at(0.0)
    f.at(4.0)
    f.finish(a)
    f.finish(b, "failed", error=ErrorInfo("handler_error", "boom"))
    admin = f.h.core
    conn = 900
    admin.open_session(conn, "client", 4.0, principal="root", admin=True)
    f.h.send(conn, GetUsage(req_id=1))
    rows = {r.name: r for r in next(m for m in f.h.take(conn) if isinstance(m, Usage)).rows}
    assert set(rows) == {"alice", "bob"} and rows["alice"].team == "ml"
    assert rows["alice"].succeeded == 1 and rows["bob"].failed == 1 and rows["alice"].slot_seconds == 4.0
    f.h.send(conn, GetUsage(req_id=2, by="team"))
    assert {r.name for r in next(m for m in f.h.take(conn) if isinstance(m, Usage)).rows} == {"ml", "web"}
    client = f.clients["bob"]
    f.h.take(client)
    f.h.send(client, GetUsage(req_id=3))
    assert [r.name for r in next(m for m in f.h.take(client) if isinstance(m, Usage)).rows] == ["bob"]


def test_a_reaped_workers_leases_end_for_fair_share() -> None:
    """The leases of a worker reaped while holding them stop counting for their principal."""
    f = Fleet(slots=2)
    a = f.submit("alice")
    f._start()
    sharing = f.h.core.sharing
    assert sharing.holds(a) and sharing.queue.shares.principal_account("alice").running == 1
    f.h.close(f.w)
    f.h.tick(100.0)
    assert not sharing.holds(a) and sharing.queue.shares.principal_account("alice").running == 0
    assert sharing.ledger.totals("principal")["alice"].slot_s == 100.0


def test_a_lone_principals_tallied_leases_count_as_each_at_once() -> None:
    """Alice's plans on 2 slots, her leases tallied by the core between ticks: her account reads 2 slots held for
    5 s and 1 for 1 s (5.5 slot-share-seconds over a fleet of 2 slots), as one step per lease would."""
    f = Fleet(slots=2)
    f.h.now = 10.0
    plans = [f.submit("alice") for _ in range(6)]
    f._start()
    for i in range(5):  # one ends each second; the next waiting one starts at once
        f.h.now = 11.0 + i
        f.finish(plans[i])
    shares = f.h.core.sharing.queue.shares
    assert shares.principal_accounts["alice"].pending  # tallied, not counted yet
    account = shares.principal_account("alice")  # read through the book: counted
    assert account.running == 1 and not account.pending and shares.team_account("alice").running == 1
    assert abs(account.service_at(16.0) - 5.5) < 1e-9 and abs(account.rate - 0.5) < 1e-9
