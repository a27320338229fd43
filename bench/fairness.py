#!/usr/bin/env python3
"""Fair share, quotas and preemption (issue #27), simulated on the core's own pieces, in virtual time.

The queue under test is the coordinator's: :class:`coordinator.placement.fair_queue.FairQueue`
(and, as the peer it is compared to, the first-come :class:`coordinator.placement.plan_queue.PlanQueue`
the coordinator used before), with :class:`coordinator.placement.preemption.Preemptor` deciding
preemptions and :class:`coordinator.ledger.UsageLedger` counting usage. Workers, plan runs and the
grace a preempted plan takes to checkpoint are simulated; nothing sleeps and no socket is opened.
``--live`` runs (a), (b) and (d) with real processes instead (bench/fairness_live.py); (e), the
throughput cost of fair share, is bench/compare.py (or bench/throughput.py) on a tree before and after.

Scenarios (the issue's):

* (a) ``flood``: team A submits 10,000 plans at once, team B a trickle (one plan every few
  seconds). B's p99 sojourn (submit to end) against its sojourn on an empty fleet (the plan's
  own length): fair share keeps it within 2x; first come, first served makes B wait for A's flood.
* (b) ``weights``: three teams with weights 1:2:3, all backlogged. Each team's share of the
  slot-seconds served in every 60 s window after a warm-up, against 1/6, 2/6, 3/6 (±5 %).
* (c) ``gap``: two backlogged principals of equal weight with plans of random lengths: the largest
  difference of their cumulative service (slot-seconds) while both wait, over a short and a 4x
  longer run: a constant bound (VTC) does not grow with the run.
* (d) ``preempt``: A's preemptible plans hold every slot (and have run past the minimum run); B
  submits: B's plan starts within grace + 1 s (the checkpoint takes up to the grace).
* ``decide``: the cost of one placement decision with 100,000 plans queued across 1,000 principals
  (and 10,000 / 100 for the slope), fair share against the first-come queue.

Usage: ``python bench/fairness.py`` runs them all; ``--scenario NAME`` one; ``--json`` rows as JSON;
``--live`` the live run (``--quick``: smaller).
"""

from __future__ import annotations

import argparse
import heapq
import itertools
import json
import random
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from coordinator.devices import GpuNeed  # noqa: E402 - after the path tweak above
from coordinator.ledger import UsageLedger  # noqa: E402
from coordinator.placement.fair_queue import FairQueue  # noqa: E402
from coordinator.placement.fairshare import SLOT, Capacity, Demand  # noqa: E402
from coordinator.placement.plan_queue import PlanQueue, Signature  # noqa: E402
from coordinator.placement.preemption import Preemption, Preemptor, Running, Waiting  # noqa: E402
from coordinator.teams import Member, Team, TeamBook  # noqa: E402
from protocol.messages import Requirements  # noqa: E402

OP = "work"
TICK_S = 1.0  # the coordinator's tick: fair-share keys count running service up to it


# ---------------------------------------------------------------------------- the simulated fleet


@dataclass
class SimPlan:
    """One plan: who submits it, what it holds, how long it runs."""

    id: str
    owner: str
    submit_s: float
    run_s: float
    priority: int = 0
    gpus: int = 0
    preemptible: bool = False
    order: int = 0
    attempt: int = 0
    started_s: float | None = None  # the current lease's start
    first_start_s: float | None = None
    end_s: float | None = None
    worker: str | None = None
    done_s: float = 0.0  # run seconds already done (a preempted plan starts over: no checkpoint credit)
    preemptions: int = 0

    @property
    def demand(self) -> Demand:
        return Demand(float(self.gpus), 1.0, 0.0) if self.gpus else SLOT  # SLOT: as the core's leases of one slot

    @property
    def signature(self) -> Signature:
        return Signature.of(OP, Requirements(), gpus=GpuNeed(self.gpus) if self.gpus else None)


@dataclass
class SimWorker:
    id: str
    slots: int
    gpus: int = 0
    running: set[str] = field(default_factory=set)
    gpus_used: int = 0

    def room(self) -> bool:
        return len(self.running) < self.slots


@dataclass
class Served:
    """One lease, as served: for the shares over windows."""

    owner: str
    start_s: float
    end_s: float
    slots: float = 1.0


class Sim:
    """A fleet of simulated workers driven by the core's queue, preemptor and ledger, in virtual time.

    Args:
        workers: (slots, gpus) of each worker.
        teams: the team book (weights, quotas); None: everyone alone, weight 1.
        fair: the fair-share queue (else the first-come one, without preemption).
        preempt: decide preemptions (fair only).
        grace_s: how long a preempted plan takes to stop (it checkpoints within it).
        min_run_s: a plan runs this long before it may be preempted.
        on_preempt: called with every preemption decided (the property tests check each one).
    """

    def __init__(
        self, workers: Sequence[tuple[int, int]], teams: TeamBook | None = None, *, fair: bool = True,
        preempt: bool = True, grace_s: float = 30.0, stop_s: float | None = None, min_run_s: float = 10.0,
        on_preempt: Callable[[Sim, Preemption], None] | None = None,
    ) -> None:
        self.workers = {f"w{i}": SimWorker(f"w{i}", slots, gpus) for i, (slots, gpus) in enumerate(workers)}
        capacity = Capacity(float(sum(g for _, g in workers)), float(sum(s for s, _ in workers)), 0.0)
        self.fair = fair
        self.queue: PlanQueue = FairQueue(teams, capacity) if fair else PlanQueue()
        self.preemptor = Preemptor(min_run_s) if fair and preempt else None
        self.ledger = UsageLedger()
        self.grace_s = grace_s
        self.stop_s = grace_s if stop_s is None else stop_s
        self.on_preempt = on_preempt
        self.plans: dict[str, SimPlan] = {}
        self.now = 0.0
        self._events: list[tuple[float, int, str, str, int]] = []  # (time, seq, kind, plan id, attempt)
        self._seq = itertools.count()
        self._orders = itertools.count(1)
        self.served: list[Served] = []
        self.preemptions: list[Preemption] = []
        self.decisions = 0
        self._ticking = False
        self._advanced = 0.0

    # -------------------------------------------------------------- inputs

    def submit(self, plan: SimPlan) -> None:
        """Schedule the plan's submit at its ``submit_s``."""
        self.plans[plan.id] = plan
        self._at(plan.submit_s, "submit", plan.id, 0)

    def _at(self, when: float, kind: str, plan_id: str, attempt: int) -> None:
        heapq.heappush(self._events, (when, next(self._seq), kind, plan_id, attempt))

    def run(self, until_s: float = float("inf"), max_events: int = 10_000_000) -> None:
        """Play events until none is left, ``until_s`` or ``max_events``."""
        events = self._events
        count = 0
        while events and events[0][0] <= until_s and count < max_events:
            when, _, kind, plan_id, attempt = heapq.heappop(events)
            self.now = when
            count += 1
            if when - self._advanced >= TICK_S and isinstance(self.queue, FairQueue):
                self.queue.advance(when)  # the coordinator's tick: service of running leases counted
                self._advanced = when
            plan = self.plans[plan_id] if plan_id else None
            if kind == "submit" and plan is not None:
                plan.order = next(self._orders)
                self._enqueue(plan)
            elif kind == "end" and plan is not None and attempt == plan.attempt and plan.worker is not None:
                self._release(plan, outcome="succeeded")
            elif kind == "stop" and plan is not None and attempt == plan.attempt and plan.worker is not None:
                self._release(plan, outcome=None)
            elif kind == "tick":
                self._ticking = False
            self._fill()
            self._maybe_preempt()
        if until_s != float("inf"):
            self.now = max(self.now, min(until_s, self.now if not events else events[0][0]))

    # -------------------------------------------------------------- the core's part

    def _enqueue(self, plan: SimPlan) -> None:
        queue = self.queue
        if isinstance(queue, FairQueue):
            queue.push(plan.id, plan.signature, plan.priority, plan.order, plan.owner)
        else:
            queue.push(plan.id, plan.signature, plan.priority, plan.order)

    def _fill(self) -> None:
        for worker in self.workers.values():
            self._fill_worker(worker)

    def _fill_worker(self, worker: SimWorker, first: str | None = None) -> None:
        plans = self.plans
        if first is not None and first in self.queue and worker.room():
            plan = plans[first]
            if plan.gpus <= worker.gpus - worker.gpus_used:
                self._start(plan, worker)
        while worker.room():
            self.decisions += 1
            plan_id = self.queue.best_for(
                lambda sig: (sig.gpus.count if sig.gpus else 0) <= worker.gpus,
                lambda pid: plans[pid].gpus <= worker.gpus - worker.gpus_used,
            )
            if plan_id is None:
                return
            self._start(plans[plan_id], worker)

    def _start(self, plan: SimPlan, worker: SimWorker) -> None:
        self.queue.discard(plan.id)
        plan.attempt += 1
        plan.worker = worker.id
        plan.started_s = self.now
        if plan.first_start_s is None:
            plan.first_start_s = self.now
        worker.running.add(plan.id)
        worker.gpus_used += plan.gpus
        if isinstance(self.queue, FairQueue):
            self.queue.started(plan.owner, plan.demand, self.now)
        if self.preemptor is not None:
            self.preemptor.placed(plan.id)
            if plan.preemptible:
                team = self.queue.shares.team_of(plan.owner)  # type: ignore[attr-defined]
                self.preemptor.started(
                    Running(plan.id, plan.owner, worker.id, plan.priority, plan.demand, self.now), team,
                )
        self._at(self.now + plan.run_s, "end", plan.id, plan.attempt)

    def _release(self, plan: SimPlan, outcome: str | None) -> None:
        worker = self.workers[plan.worker or ""]
        worker.running.discard(plan.id)
        worker.gpus_used -= plan.gpus
        started = plan.started_s or 0.0
        run_s = self.now - started
        self.served.append(Served(plan.owner, started, self.now))
        team = self.queue.shares.team_of(plan.owner) if isinstance(self.queue, FairQueue) else plan.owner
        self.ledger.lease_ended(plan.owner, team, run_s=run_s, gpus=plan.gpus, wall_s=self.now)
        if isinstance(self.queue, FairQueue):
            self.queue.ended(plan.owner, plan.demand, self.now)
        plan.worker = None
        plan.started_s = None
        nominated = None if self.preemptor is None else self.preemptor.ended(plan.id)
        if outcome is not None:
            plan.end_s = self.now
            self.ledger.plan_ended(plan.owner, team, "succeeded", wall_s=self.now)
        else:  # preempted: back to the queue with its age, no attempt charged
            plan.preemptions += 1
            self.ledger.preempted(plan.owner, team, wall_s=self.now)
            self._enqueue(plan)
        if nominated is not None:  # the preemption's last victim stopped: its waiting plan goes there first
            waiting, worker_id = nominated
            self._fill_worker(self.workers[worker_id], waiting)

    def _maybe_preempt(self) -> None:
        preemptor = self.preemptor
        queue = self.queue
        if preemptor is None or not len(queue) or not isinstance(queue, FairQueue):
            return
        head = queue.best_for(lambda sig: True)
        if head is None:
            return
        plan = self.plans[head]
        workers = self.workers

        def fits_after(worker_id: str, victims: Sequence[Running]) -> bool:
            worker = workers[worker_id]
            if plan.gpus > worker.gpus:
                return False
            free_slots = worker.slots - len(worker.running) + len(victims)
            free_gpus = worker.gpus - worker.gpus_used + sum(int(v.demand.gpus) for v in victims)
            return free_slots >= 1 and free_gpus >= plan.gpus

        decision = preemptor.decide(Waiting(plan.id, plan.owner, plan.priority, plan.demand), queue.shares,
                                    self.now, fits_after)
        if decision is None:
            if not self._ticking and any(self.plans[i].preemptible for w in workers.values() for i in w.running):
                self._ticking = True  # a victim may pass its minimum run: look again in a second
                self._at(self.now + 1.0, "tick", "", 0)
            return
        if self.on_preempt is not None:
            self.on_preempt(self, decision)
        self.preemptions.append(decision)
        for victim in decision.victims:
            self._at(self.now + self.stop_s, "stop", victim, self.plans[victim].attempt)

    # -------------------------------------------------------------- figures

    def service(self, owner_of: Callable[[str], str], start_s: float, end_s: float) -> dict[str, float]:
        """Slot-seconds served within [start_s, end_s) per ``owner_of(principal)`` (team, or principal)."""
        out: dict[str, float] = {}
        for s in self.served:
            overlap = min(s.end_s, end_s) - max(s.start_s, start_s)
            if overlap > 0:
                key = owner_of(s.owner)
                out[key] = out.get(key, 0.0) + overlap * s.slots
        for worker in self.workers.values():  # leases still running count up to end_s
            for pid in worker.running:
                plan = self.plans[pid]
                overlap = min(self.now, end_s) - max(plan.started_s or 0.0, start_s)
                if overlap > 0:
                    key = owner_of(plan.owner)
                    out[key] = out.get(key, 0.0) + overlap
        return out



# ---------------------------------------------------------------------------- scenarios


def _p99(values: Sequence[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))] if ordered else 0.0


def flood(*, fair: bool, flood_plans: int = 10_000, slots: int = 8, run_s: float = 1.0,
          trickle_every_s: float = 5.0, seed: int = 1) -> dict[str, Any]:
    """(a) A floods, B trickles: B's sojourn (submit to end) against its plans' own length."""
    rng = random.Random(seed)
    sim = Sim([(slots, 0)], fair=fair, preempt=False)
    for i in range(flood_plans):
        sim.submit(SimPlan(f"a{i}", "alice", 0.0, run_s * rng.uniform(0.5, 1.5)))
    horizon = flood_plans * run_s / slots
    trickle = [SimPlan(f"b{i}", "bob", 1.0 + i * trickle_every_s, run_s) for i in range(int(horizon / trickle_every_s))]
    for plan in trickle:
        sim.submit(plan)
    sim.run()
    sojourn = [(p.end_s or 0.0) - p.submit_s for p in trickle]
    empty = run_s  # on an empty fleet a plan starts at once and lasts its length
    return {
        "scenario": "a flood", "queue": "fair share" if fair else "first come", "trickle_plans": len(trickle),
        "p99_sojourn_s": round(_p99(sojourn), 3), "empty_fleet_s": empty,
        "ratio": round(_p99(sojourn) / empty, 2), "met": _p99(sojourn) <= 2 * empty,
    }


def weights(*, fair: bool, slots: int = 24, seconds: float = 600.0, warmup_s: float = 60.0,
            window_s: float = 60.0, seed: int = 2) -> dict[str, Any]:
    """(b) Teams of weights 1:2:3, backlogged: their shares of the service in each window."""
    rng = random.Random(seed)
    book = TeamBook([Team("t1", 1.0), Team("t2", 2.0), Team("t3", 3.0)],
                    {f"p{i}": Member(f"t{i}") for i in (1, 2, 3)})
    sim = Sim([(slots, 0)], book, fair=fair, preempt=False)
    count = int(seconds * slots / 0.5)  # enough for all three to stay backlogged
    for i in range(count):
        for team in (1, 2, 3):
            sim.submit(SimPlan(f"p{team}-{i}", f"p{team}", 0.0, rng.uniform(0.2, 1.8)))
    sim.run(until_s=seconds)
    target = {"t1": 1 / 6, "t2": 2 / 6, "t3": 3 / 6}
    worst = 0.0
    windows = 0
    start = warmup_s
    while start + window_s <= seconds:
        served = sim.service(lambda p: "t" + p[1:], start, start + window_s)
        total = sum(served.values()) or 1.0
        for team, want in target.items():
            worst = max(worst, abs(served.get(team, 0.0) / total / want - 1.0))
        windows += 1
        start += window_s
    return {
        "scenario": "b weights 1:2:3", "queue": "fair share" if fair else "first come", "slots": slots,
        "windows": windows,
        "worst_deviation_pct": round(100 * worst, 2), "met": worst <= 0.05,
    }


def gap(*, seconds: float, slots: int = 5, seed: int = 3) -> dict[str, Any]:
    """(c) Two backlogged principals, equal weights, random plan lengths: the largest service gap."""
    rng = random.Random(seed)
    sim = Sim([(slots, 0)], preempt=False)
    count = int(seconds * slots / 0.5) + 10
    for i in range(count):
        for who in ("x", "y"):
            sim.submit(SimPlan(f"{who}{i}", who, 0.0, rng.uniform(0.1, 2.0)))
    worst = 0.0
    step = 1.0
    t = 0.0
    while t < seconds:
        t += step
        sim.run(until_s=t)
        served = sim.service(lambda p: p, 0.0, t)
        worst = max(worst, abs(served.get("x", 0.0) - served.get("y", 0.0)))
    return {"scenario": "c VTC gap", "seconds": seconds, "max_gap_slot_s": round(worst, 3),
            "longest_plan_s": 2.0, "slots": slots}


def preempt(*, grace_s: float = 30.0, stop_s: float = 30.0, min_run_s: float = 10.0) -> dict[str, Any]:
    """(d) A's preemptible plans hold every slot past their minimum run; B submits one plan."""
    sim = Sim([(2, 0)], grace_s=grace_s, stop_s=stop_s, min_run_s=min_run_s)
    for i in range(4):
        sim.submit(SimPlan(f"a{i}", "alice", 0.0, 3600.0, preemptible=True))
    b = SimPlan("b0", "bob", 60.0, 5.0)
    sim.submit(b)
    sim.run(until_s=4000.0)
    delay = (b.first_start_s or float("inf")) - b.submit_s
    return {"scenario": "d preemption", "grace_s": grace_s, "start_delay_s": round(delay, 3),
            "preemptions": len(sim.preemptions), "met": delay <= grace_s + 1.0}


def decide(*, queued: int, principals: int, fair: bool, decisions: int = 20_000, seed: int = 4) -> dict[str, Any]:
    """The cost of one decision (best_for, discard, started/ended) with ``queued`` plans waiting."""
    rng = random.Random(seed)
    queue: PlanQueue = FairQueue(capacity=Capacity(0.0, 1000.0, 0.0)) if fair else PlanQueue()
    signatures = [Signature.of(OP, Requirements(tags=[f"t{i}"])) for i in range(4)]
    owners: dict[str, str] = {}
    order = itertools.count(1)
    ids = itertools.count()

    def push() -> None:
        plan_id = f"p{next(ids)}"
        owner = f"u{rng.randrange(principals)}"
        owners[plan_id] = owner
        sig = rng.choice(signatures)
        if isinstance(queue, FairQueue):
            queue.push(plan_id, sig, rng.randrange(3), next(order), owner)
        else:
            queue.push(plan_id, sig, rng.randrange(3), next(order))

    for _ in range(queued):
        push()
    running: list[str] = []
    now = 0.0
    t0 = time.perf_counter()
    for _ in range(decisions):
        plan_id = queue.best_for(lambda sig: True)
        assert plan_id is not None
        queue.discard(plan_id)
        now += 0.001
        if isinstance(queue, FairQueue):
            queue.started(owners[plan_id], SLOT, now)
        running.append(plan_id)
        if len(running) > 500:  # a plan ends: its owner's keys move
            done = running.pop(rng.randrange(len(running)))
            if isinstance(queue, FairQueue):
                queue.ended(owners[done], SLOT, now)
        push()  # the queue stays as deep
    elapsed = time.perf_counter() - t0
    return {"scenario": "decide", "queue": "fair share" if fair else "first come", "queued": queued,
            "principals": principals, "us_per_decision": round(1e6 * elapsed / decisions, 2)}


SCENARIOS = ("flood", "weights", "gap", "preempt", "decide")


def run_scenario(name: str, quick: bool = False) -> list[dict[str, Any]]:
    """The rows of one scenario, fair share beside its peer where it has one."""
    if name == "flood":
        n = 2_000 if quick else 10_000
        return [flood(fair=True, flood_plans=n), flood(fair=False, flood_plans=n)]
    if name == "weights":
        seconds = 180.0 if quick else 600.0
        return [weights(fair=True, seconds=seconds, slots=slots) for slots in (24, 23, 5, 2)] + [
            weights(fair=False, seconds=seconds)]
    if name == "gap":
        short = 100.0 if quick else 300.0
        return [gap(seconds=short), gap(seconds=4 * short)]
    if name == "preempt":
        return [preempt(stop_s=30.0), preempt(stop_s=5.0)]
    if name == "decide":
        sizes = [(10_000, 100), (100_000, 1_000)]
        n = 5_000 if quick else 20_000
        return [decide(queued=q, principals=p, fair=fair, decisions=n) for q, p in sizes for fair in (True, False)]
    raise ValueError(f"unknown scenario {name!r}; one of {', '.join(SCENARIOS)}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--scenario", choices=SCENARIOS, action="append", help="run only this one (repeatable)")
    parser.add_argument("--quick", action="store_true", help="smaller runs (a smoke)")
    parser.add_argument("--json", action="store_true", help="one JSON object per row")
    parser.add_argument("--live", action="store_true",
                        help="(a), (b), (d) and the ledger with real processes instead (bench/fairness_live.py)")
    ns = parser.parse_args(argv)
    if ns.live:
        import fairness_live

        return fairness_live.main(ns.quick, ns.json)
    for name in ns.scenario or SCENARIOS:
        t0 = time.perf_counter()
        rows = run_scenario(name, ns.quick)
        for row in rows:
            if ns.json:
                print(json.dumps(row))
            else:
                print("  ".join(f"{k}={v}" for k, v in row.items()))
        if not ns.json:
            print(f"  ({name}: {time.perf_counter() - t0:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
