"""Preemption decisions (issue #27): which preemptible lease to stop so that a waiting plan runs, with a fake clock."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from coordinator.placement.fairshare import Capacity, Demand, ShareBook
from coordinator.placement.preemption import Preemption, Preemptor, Running, Waiting
from coordinator.teams import Member, Team, TeamBook

ONE = Demand()
GPU = Demand(gpus=1.0)


class Fleet:
    """Workers of a few slots (and GPUs); a ShareBook and a Preemptor told of every lease."""

    def __init__(self, workers: dict[str, tuple[int, int]], teams: TeamBook | None = None,
                 min_run_s: float = 10.0) -> None:
        self.workers = workers
        slots = sum(s for s, _ in workers.values())
        gpus = sum(g for _, g in workers.values())
        self.book = ShareBook(teams, Capacity(float(gpus), float(slots), 0.0))
        self.preemptor = Preemptor(min_run_s)
        self.leases: dict[str, Running] = {}

    def start(self, plan_id: str, owner: str, worker: str, now: float, *, priority: int = 0,
              demand: Demand = ONE, preemptible: bool = True) -> None:
        plan = Running(plan_id, owner, worker, priority, demand, now)
        self.leases[plan_id] = plan
        self.book.started(owner, demand, now)
        if preemptible:
            self.preemptor.started(plan, self.book.team_of(owner))

    def end(self, plan_id: str, now: float) -> tuple[str, str] | None:
        plan = self.leases.pop(plan_id)
        self.book.ended(plan.owner, plan.demand, now)
        return self.preemptor.ended(plan_id)

    def fits_after(self, need: Demand) -> Callable[[str, Sequence[Running]], bool]:
        def fits(worker_id: str, victims: Sequence[Running]) -> bool:
            slots, gpus = self.workers[worker_id]
            held = [p for p in self.leases.values() if p.worker_id == worker_id]
            free_slots = slots - len(held) + len(victims)
            free_gpus = gpus - sum(p.demand.gpus for p in held) + sum(v.demand.gpus for v in victims)
            return free_slots >= need.slots and free_gpus >= need.gpus

        return fits

    def decide(self, plan_id: str, owner: str, now: float, *, priority: int = 0,
               demand: Demand = ONE) -> Preemption | None:
        self.book.queued(owner, 1)
        return self.preemptor.decide(Waiting(plan_id, owner, priority, demand), self.book, now,
                                     self.fits_after(demand))


def test_a_team_below_its_share_preempts_the_most_recent_plan_of_the_team_above() -> None:
    """Alice holds both slots with preemptible plans past the minimum run: Bob's plan stops her newest one."""
    fleet = Fleet({"w1": (2, 0)})
    fleet.start("a1", "alice", "w1", now=0.0)
    fleet.start("a2", "alice", "w1", now=5.0)
    decision = fleet.decide("b1", "bob", now=20.0)
    assert decision is not None
    assert (decision.waiting, decision.victims, decision.worker_id, decision.why) == ("b1", ("a2",), "w1", "fair_share")
    assert "team bob is below its share" in decision.reason
    assert fleet.preemptor.stopping("a2") and fleet.preemptor.pending_for("b1")
    assert fleet.end("a2", now=25.0) == ("b1", "w1")  # the last victim stopped: b1 goes to w1 first


def test_no_plan_is_preempted_before_its_minimum_run() -> None:
    """A plan younger than min_run_s is not a victim; once past it, it is."""
    fleet = Fleet({"w1": (2, 0)}, min_run_s=10.0)
    fleet.start("a1", "alice", "w1", now=0.0)
    fleet.start("a2", "alice", "w1", now=0.0)
    assert fleet.decide("b1", "bob", now=9.9) is None
    assert fleet.preemptor.decide(Waiting("b1", "bob", 0, ONE), fleet.book, 10.0, fleet.fits_after(ONE)) is not None


def test_one_slot_is_not_traded_back_and_forth() -> None:
    """On a one-slot fleet a swap would leave the waiting team above the other: no preemption (no ping-pong)."""
    fleet = Fleet({"w1": (1, 0)})
    fleet.start("a1", "alice", "w1", now=0.0)
    assert fleet.decide("b1", "bob", now=1000.0) is None


def test_a_plan_not_marked_preemptible_is_never_a_victim() -> None:
    """Only leases of preemptible plans are candidates."""
    fleet = Fleet({"w1": (2, 0)})
    fleet.start("a1", "alice", "w1", now=0.0, preemptible=False)
    fleet.start("a2", "alice", "w1", now=0.0, preemptible=False)
    assert fleet.decide("b1", "bob", now=100.0) is None


def test_no_preemption_when_the_waiting_plan_could_not_run_there_after() -> None:
    """A GPU plan does not stop CPU plans on a worker without GPUs."""
    fleet = Fleet({"cpu": (2, 0), "gpu": (1, 1)})
    fleet.start("a1", "alice", "cpu", now=0.0)
    fleet.start("a2", "alice", "cpu", now=0.0)
    fleet.start("g1", "carol", "gpu", now=0.0, demand=GPU, preemptible=False)
    assert fleet.decide("b1", "bob", now=100.0, demand=GPU) is None


def test_a_swap_that_would_leave_the_waiting_team_above_the_other_is_not_made() -> None:
    """Even shares are not traded back and forth: Alice 1 slot, Bob 1 slot, Bob's second plan preempts nothing."""
    fleet = Fleet({"w1": (2, 0)})
    fleet.start("a1", "alice", "w1", now=0.0)
    fleet.start("b1", "bob", "w1", now=0.0)
    assert fleet.decide("b2", "bob", now=100.0) is None
    assert fleet.decide("a2", "alice", now=100.0) is None


def test_victims_stopping_count_as_gone_so_a_second_waiter_does_not_overshoot() -> None:
    """Alice holds 2 slots, Bob waits with 2 plans: one preemption, not two (1-1 is even)."""
    fleet = Fleet({"w1": (2, 0)})
    fleet.start("a1", "alice", "w1", now=0.0)
    fleet.start("a2", "alice", "w1", now=1.0)
    first = fleet.decide("b1", "bob", now=50.0)
    assert first is not None and first.victims == ("a2",)
    assert fleet.decide("b1", "bob", now=51.0) is None  # under way for b1 already
    assert fleet.decide("b2", "bob", now=51.0) is None  # as it will be: alice 1, bob 1


def test_a_higher_priority_plan_preempts_its_own_principals_lower_priority_plan() -> None:
    """Within a principal, priority 5 waits while its priority-0 plans hold the fleet: the lowest, newest goes."""
    fleet = Fleet({"w1": (2, 0)})
    fleet.start("low-old", "alice", "w1", now=0.0, priority=0)
    fleet.start("low-new", "alice", "w1", now=3.0, priority=0)
    decision = fleet.decide("urgent", "alice", now=30.0, priority=5)
    assert decision is not None and decision.why == "priority" and decision.victims == ("low-new",)
    assert fleet.decide("same", "alice", now=30.0, priority=0) is None  # equal priority: no


def test_another_principals_priority_preempts_nothing_by_itself() -> None:
    """Priority orders plans within a principal only: Bob's priority 100 does not stop Carol's plan of his team."""
    teams = TeamBook([], {"bob": Member("t"), "carol": Member("t")})
    fleet = Fleet({"w1": (1, 0)}, teams)
    fleet.start("c1", "carol", "w1", now=0.0)
    assert fleet.decide("b1", "bob", now=100.0, priority=100) is None


def test_a_team_within_its_quota_preempts_a_borrowed_plan_first() -> None:
    """Team capped at 1 running borrowed a second slot: a waiting plan of a team within quota takes it back."""
    teams = TeamBook([Team("capped", 1.0, max_running=1), Team("other", 1.0)],
                     {"c": Member("capped"), "o": Member("other")})
    fleet = Fleet({"w1": (3, 0)}, teams)
    fleet.start("c1", "c", "w1", now=0.0)
    fleet.start("c2", "c", "w1", now=1.0)
    fleet.start("o1", "o", "w1", now=0.0, preemptible=False)
    decision = fleet.decide("o2", "o", now=50.0)
    # Fair share alone would not (other 2 of 3 after, capped 1): the quota rule takes the borrowed slot.
    assert decision is not None and decision.why == "quota" and decision.victims == ("c2",)
    assert "borrowed beyond its own" in decision.reason


def test_a_plan_that_would_borrow_preempts_nothing() -> None:
    """A waiting plan that would take its team past a quota only takes idle capacity."""
    teams = TeamBook([Team("capped", 1.0, max_running=1)], {"c": Member("capped")})
    fleet = Fleet({"w1": (2, 0)}, teams)
    fleet.start("c1", "c", "w1", now=0.0, preemptible=False)
    fleet.start("x1", "x", "w1", now=0.0)
    assert fleet.decide("c2", "c", now=100.0) is None


def test_a_gpu_plan_may_stop_several_plans_on_one_worker() -> None:
    """A 2-GPU plan stops the two newest 1-GPU plans of the team above, on the same worker."""
    fleet = Fleet({"w1": (4, 2), "w2": (4, 2)})
    for i, worker in enumerate(["w1", "w1", "w2", "w2"]):
        fleet.start(f"a{i}", "alice", worker, now=float(i), demand=GPU)
    decision = fleet.decide("b1", "bob", now=100.0, demand=Demand(gpus=2.0))
    assert decision is not None and decision.worker_id == "w2" and decision.victims == ("a3", "a2")


def test_a_placed_waiting_plan_no_longer_counts_but_its_victims_still_stop() -> None:
    """When the waiting plan is placed elsewhere, the victims' ends nominate nothing."""
    fleet = Fleet({"w1": (2, 0)})
    fleet.start("a1", "alice", "w1", now=0.0)
    fleet.start("a2", "alice", "w1", now=0.0)
    assert fleet.decide("b1", "bob", now=50.0) is not None
    fleet.preemptor.placed("b1")
    assert fleet.preemptor.stopping("a2") or fleet.preemptor.stopping("a1")
    victim = "a2" if fleet.preemptor.stopping("a2") else "a1"
    assert fleet.end(victim, now=60.0) is None
