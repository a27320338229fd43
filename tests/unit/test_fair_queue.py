"""The fair-share queue (issue #27): which waiting plan a free worker gets next, driven directly."""

from __future__ import annotations

import random
from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st

from coordinator.devices import GpuNeed
from coordinator.placement.fair_queue import FairQueue
from coordinator.placement.fairshare import Capacity, Demand
from coordinator.placement.plan_queue import PlanQueue, Signature
from coordinator.teams import Member, Team, TeamBook
from protocol.messages import Requirements

SIG = Signature.of("work", Requirements())
GPU_SIG = Signature.of("work", Requirements(), gpus=GpuNeed(1))


class Fleet:
    """A fleet of ``slots`` slots (and ``gpus`` GPUs) run by a FairQueue; plans end when told to."""

    def __init__(self, slots: int, gpus: int = 0, teams: TeamBook | None = None) -> None:
        self.queue = FairQueue(teams, Capacity(float(gpus), float(slots), 0.0))
        self.slots, self.gpus = slots, gpus
        self.running: dict[str, tuple[str, Demand]] = {}
        self.now = 0.0  # the fake clock: tests move it
        self.order = 0
        self.started: list[str] = []

    def submit(self, plan_id: str, owner: str, *, priority: int = 0, gpus: int = 0) -> None:
        self.order += 1
        self.queue.push(plan_id, GPU_SIG if gpus else SIG, priority, self.order, owner)

    def fill(self) -> list[str]:
        """Start what fits; the ids started."""
        new: list[str] = []
        while len(self.running) < self.slots:
            free_gpus = self.gpus - sum(d.gpus for _, d in self.running.values())
            plan_id = self.queue.best_for(lambda sig: True, lambda pid, free=free_gpus: free >= self._gpus(pid))
            if plan_id is None:
                break
            owner = self.queue.owner_of(plan_id)
            assert owner is not None
            demand = Demand(float(self._gpus(plan_id)))
            self.queue.discard(plan_id)
            self.queue.started(owner, demand, self.now)
            self.running[plan_id] = (owner, demand)
            new.append(plan_id)
        self.started += new
        return new

    def _gpus(self, plan_id: str) -> int:
        signature = self.queue.signature_of(plan_id)
        return 0 if signature is None or signature.gpus is None else signature.gpus.count

    def end(self, plan_id: str, after_s: float = 0.0) -> None:
        """The plan ends ``after_s`` from now (the clock moves on)."""
        self.now += after_s
        self.queue.advance(self.now)
        owner, demand = self.running.pop(plan_id)
        self.queue.ended(owner, demand, self.now)


def test_a_flood_does_not_hold_back_another_principals_handful() -> None:
    """Alice's 40 queued plans and Bob's 4: a 2-slot fleet serves them alternately, Bob done within 8 plans."""
    fleet = Fleet(slots=2)
    for i in range(40):
        fleet.submit(f"a{i}", "alice")
    for i in range(4):
        fleet.submit(f"b{i}", "bob")
    fleet.fill()
    while len(fleet.started) < 12:
        fleet.end(next(iter(fleet.running)))
        fleet.fill()
    assert fleet.started[:8] == ["a0", "b0", "a1", "b1", "a2", "b2", "a3", "b3"]
    assert fleet.started[8:12] == ["a4", "a5", "a6", "a7"]  # work-conserving: alice alone takes every slot


def test_weights_split_the_slots_in_their_proportion() -> None:
    """Teams of weight 2 and 1, both backlogged, hold 2/3 and 1/3 of the slots."""
    teams = TeamBook([Team("big", 2.0), Team("small", 1.0)], {"b": Member("big"), "s": Member("small")})
    fleet = Fleet(slots=9, teams=teams)
    for i in range(100):
        fleet.submit(f"b{i}", "b")
        fleet.submit(f"s{i}", "s")
    fleet.fill()
    held = Counter(owner for owner, _ in fleet.running.values())
    assert held == {"b": 6, "s": 3}
    for _ in range(60):  # plans end in any order: the split holds
        fleet.end(random.Random(len(fleet.started)).choice(sorted(fleet.running)))
        fleet.fill()
        held = Counter(owner for owner, _ in fleet.running.values())
        assert held == {"b": 6, "s": 3}


def test_priority_orders_plans_within_a_principal_not_across_principals() -> None:
    """A principal's high-priority plan goes before its older ones; another principal's priority does not jump it."""
    fleet = Fleet(slots=1)
    fleet.submit("a-low", "alice")
    fleet.submit("a-high", "alice", priority=5)
    fleet.submit("b-top", "bob", priority=100)
    fleet.submit("b-next", "bob", priority=100)
    started = []
    for _ in range(4):
        started += fleet.fill()
        fleet.end(started[-1])
    assert started == ["a-high", "b-top", "a-low", "b-next"]


def test_age_breaks_ties_within_a_principal() -> None:
    """Equal priorities of one principal go oldest first."""
    fleet = Fleet(slots=3)
    for i in range(3):
        fleet.submit(f"p{i}", "alice")
    assert fleet.fill() == ["p0", "p1", "p2"]


def test_dominant_resource_counts_gpus_against_cpu_slots() -> None:
    """A team holding half the GPUs is above one holding a few CPU slots: the CPU team goes next (DRF)."""
    fleet = Fleet(slots=10, gpus=4)
    fleet.submit("g1", "gpu-team", gpus=1)
    fleet.submit("g2", "gpu-team", gpus=1)
    fleet.submit("c1", "cpu-team")
    fleet.submit("c2", "cpu-team")
    fleet.submit("c3", "cpu-team")
    assert fleet.fill()[:2] == ["g1", "c1"]
    # gpu-team holds 1/4 of the GPUs (its dominant share) and 1/10 of the slots: cpu-team is served
    # before it while its share is below that (c1, c2: 1/10, 2/10), and again after (c3 at 3/10 would pass it).
    assert fleet.started == ["g1", "c1", "c2", "c3", "g2"]


def test_a_cpu_plan_of_a_team_holding_gpus_leaves_its_gpu_share_dominant() -> None:
    """A team's rate stays its GPU share while a CPU-only plan of it starts and ends (DRF over all it holds)."""
    queue = FairQueue(capacity=Capacity(4.0, 100.0, 0.0))
    team = queue.shares.team_account("ml")
    queue.started("ml", Demand(2.0, 1.0, 0.0), 0.0)  # half the GPUs, one slot in a hundred
    assert team.rate == 0.5
    queue.started("ml", Demand(0.0, 1.0, 0.0), 1.0)  # a slot only
    assert team.rate == 0.5 and team.slots == 2.0
    queue.ended("ml", Demand(0.0, 1.0, 0.0), 2.0)
    assert team.rate == 0.5 and team.slots == 1.0
    queue.ended("ml", Demand(2.0, 1.0, 0.0), 3.0)
    assert team.rate == 0.0 and team.gpus == 0.0 and team.service == 1.5  # 0.5 for 3 s


def test_principals_share_their_team_by_their_weights() -> None:
    """Within a team, principals of weight 1 and 3 split its slots 1:3."""
    teams = TeamBook([], {"x": Member("t", 1.0), "y": Member("t", 3.0)})
    fleet = Fleet(slots=8, teams=teams)
    for i in range(20):
        fleet.submit(f"x{i}", "x")
        fleet.submit(f"y{i}", "y")
    fleet.fill()
    assert Counter(owner for owner, _ in fleet.running.values()) == {"x": 2, "y": 6}


def test_a_team_at_its_quota_borrows_only_what_nobody_else_waits_for() -> None:
    """Past max_running a team's plans come after every within-quota plan, yet idle slots still go to them."""
    teams = TeamBook([Team("capped", 1.0, max_running=1)], {"c": Member("capped")})
    fleet = Fleet(slots=4, teams=teams)
    for i in range(4):
        fleet.submit(f"c{i}", "c")
    assert fleet.fill() == ["c0", "c1", "c2", "c3"]  # alone: it borrows the whole fleet
    fleet.submit("o0", "other")
    fleet.submit("o1", "other")
    fleet.submit("c4", "c")
    fleet.end("c3")
    fleet.end("c2")
    assert fleet.fill() == ["o0", "o1"]  # c is past its quota: the other team's plans go first
    assert fleet.queue.plans_in(SIG) == ["c4"]


def test_a_team_that_may_not_borrow_is_not_offered_past_its_quota() -> None:
    """With borrow = false a team past max_running waits even while slots are idle."""
    teams = TeamBook([Team("strict", 1.0, max_running=2, borrow=False)], {"s": Member("strict")})
    fleet = Fleet(slots=4, teams=teams)
    for i in range(4):
        fleet.submit(f"s{i}", "s")
    assert fleet.fill() == ["s0", "s1"]
    assert len(fleet.queue) == 2


def test_max_gpus_holds_gpu_plans_but_not_cpu_ones() -> None:
    """A team at max_gpus still gets CPU plans placed; its next GPU plan waits behind others."""
    teams = TeamBook([Team("v", 1.0, max_gpus=1, borrow=False)], {"v": Member("v")})
    fleet = Fleet(slots=4, gpus=4, teams=teams)
    fleet.submit("g1", "v", gpus=1)
    fleet.submit("g2", "v", gpus=1)
    fleet.submit("cpu", "v")
    assert fleet.fill() == ["g1", "cpu"]


def test_has_ahead_compares_fair_keys() -> None:
    """A newcomer of an idle principal is not behind a busy principal's queued plans."""
    fleet = Fleet(slots=1)
    fleet.submit("a0", "alice")
    fleet.submit("a1", "alice")
    fleet.fill()
    queue = fleet.queue
    assert queue.has_ahead(SIG, 0, 99, "alice")  # alice's own a1 is older
    assert not queue.has_ahead(SIG, 0, 99, "carol")  # carol runs nothing: she comes before alice's a1
    fleet.submit("b0", "bob")
    assert queue.has_ahead(SIG, 0, 100, "carol")  # bob runs nothing either, and b0 is older
    assert queue.best_for(lambda sig: True) == "b0"


def test_forgiven_plans_keep_their_owner_and_place() -> None:
    """Plans moved out of a group that avoided a worker keep their owner, priority and age."""
    queue = FairQueue(capacity=Capacity(0.0, 4.0, 0.0))
    avoiding = SIG.avoiding(["w1"])
    queue.push("a0", avoiding, 0, 1, "alice")
    queue.push("b0", SIG, 0, 2, "bob")
    queue.push("a1", avoiding, 3, 3, "alice")
    assert queue.forgive("w1") == ["a1", "a0"]
    assert queue.signature_of("a0") == SIG and queue.owner_of("a1") == "alice"
    assert queue.plans_in(SIG) == ["a1", "a0", "b0"]  # equal keys (nobody runs): priority, then age
    assert queue.signatures() == [SIG]


def test_a_reloaded_team_book_moves_principals_and_their_usage() -> None:
    """After a reload that puts two principals in one team, they share that team's place."""
    fleet = Fleet(slots=4)
    for i in range(10):
        fleet.submit(f"x{i}", "x")
        fleet.submit(f"y{i}", "y")
        fleet.submit(f"z{i}", "z")
    fleet.fill()
    running = {owner: [d for o, d in fleet.running.values() if o == owner] for owner in ("x", "y", "z")}
    fleet.queue.set_teams(TeamBook([], {"x": Member("xy"), "y": Member("xy")}), running, fleet.now)
    for plan_id in list(fleet.running):
        fleet.end(plan_id)
    fleet.fill()
    held = Counter(owner for owner, _ in fleet.running.values())
    assert held["z"] == 2 and held["x"] + held["y"] == 2  # teams xy and z, halves
    assert fleet.queue.waiting_of("xy") + fleet.queue.waiting_of("z") == 30 - 8


def test_a_team_back_from_idle_does_not_bring_credit() -> None:
    """A principal idle for long comes back at the least service of those active (VTC's lift), not at 0."""
    fleet = Fleet(slots=1)
    fleet.submit("old", "late")
    fleet.fill()
    fleet.end("old", after_s=1.0)
    for i in range(50):  # early is served alone for a long time
        fleet.submit(f"e{i}", "early")
    for i in range(20):
        fleet.fill()
        fleet.end(f"e{i}", after_s=10.0)
    fleet.submit("l0", "late")
    fleet.submit("l1", "late")
    fleet.submit("l2", "late")
    started = []
    for _ in range(6):
        started += fleet.fill()
        fleet.end(started[-1], after_s=10.0)
    assert started == ["l0", "e20", "l1", "e21", "l2", "e22"]  # alternation, not late's three in a row


def test_capacity_changes_rekey_every_team() -> None:
    """When GPUs leave the fleet a GPU-holding team's dominant share grows and it goes behind."""
    fleet = Fleet(slots=10, gpus=8)
    fleet.submit("g", "gpu-team", gpus=1)
    fleet.submit("c1", "cpu-team")
    fleet.submit("c1b", "cpu-team")
    fleet.fill()
    fleet.submit("g2", "gpu-team")
    fleet.submit("c2", "cpu-team")
    assert fleet.queue.best_for(lambda sig: True) == "g2"  # gpu-team 1/8 of the GPUs, cpu-team 2/10 of the slots
    fleet.queue.set_capacity(Capacity(2.0, 10.0, 0.0), fleet.now)  # 6 GPUs gone: gpu-team holds half of them
    assert fleet.queue.best_for(lambda sig: True) == "c2"
    fleet.queue.set_capacity(Capacity(8.0, 10.0, 0.0), fleet.now)
    assert fleet.queue.best_for(lambda sig: True) == "g2"


@settings(max_examples=60, deadline=None)
@given(ops=st.lists(st.tuples(st.sampled_from(["push", "take", "drop"]), st.integers(0, 30), st.integers(0, 3),
                              st.integers(0, 2)), max_size=120))
def test_with_one_principal_the_fair_queue_orders_as_the_first_come_queue(
    ops: list[tuple[str, int, int, int]],
) -> None:
    """One principal: the fair queue picks exactly what the priority-then-age queue picks."""
    fair, plain = FairQueue(capacity=Capacity(0.0, 4.0, 0.0)), PlanQueue()
    signatures = [Signature.of("work", Requirements(tags=[f"t{i}"])) for i in range(3)]
    order = 0
    for op, number, priority, sig in ops:
        plan_id = f"p{number}"
        if op == "push":
            order += 1
            fair.push(plan_id, signatures[sig], priority, order, "solo")
            plain.push(plan_id, signatures[sig], priority, order)
        elif op == "drop":
            assert fair.discard(plan_id) == plain.discard(plan_id)
        else:
            picked = fair.best_for(lambda s: True)
            assert picked == plain.best_for(lambda s: True)
            if picked is not None:
                fair.discard(picked)
                plain.discard(picked)
                fair.started("solo", Demand(), float(order))
        assert len(fair) == len(plain)
    for signature in signatures:
        assert fair.plans_in(signature) == plain.plans_in(signature)
