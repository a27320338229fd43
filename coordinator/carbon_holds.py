"""Carbon-aware time shifting in the core (issue #31): a plan with a deadline may wait for a greener hour.

What it owns: the plans held for carbon (state ``queued``, out of the placement queue), the
planner that decides them (coordinator/carbon_time/planner.py ``TimeShifter``), the forecast book
its feeds fill (coordinator/carbon_time/forecast.py; the driver, coordinator/io/ops/carbon_feed.py,
fetches), each op's observed run times, and the receipt's ``avoided_co2e_g``. The decisions are
the planner's; this collaborator feeds it what the core knows and carries them out with the
scheduler and the streams.

Rules (docs/SEMANTICS.md §Deadlines, docs/ROUTING.md §Carbon in time):

* *Deferrable.* A submit with ``deadline_s`` (seconds from now) or ``deadline_at`` (Unix seconds).
  ``deadline_s`` is made absolute at submit and the submit is recorded with ``deadline_at`` (both
  stores keep the submit whole), with the plan's submit time in its status: the deadline survives
  restarts and failover. A plan without a deadline never passes here.
* *Submit.* The planner sees the plan's zones (the carbon zones of the connected, undrained workers
  that can run it), each zone's slots (their ``max_concurrency``), and its expected run
  (``expected_run_s``, else its op's observed median run time with the observed spread as its run
  margin; with neither it is not held). Held: the plan stays ``queued``, out of the placement
  queue, and its ``waiting`` reason says until when and why (``deferred for carbon until 02:00 (52
  g/kWh vs 302 now)``, times in UTC). Otherwise it is placed as any plan, and why it was not held is
  logged (once per reason per :data:`LOG_EVERY_S`) and counted.
* *Release.* At its start (:meth:`CarbonHolds.tick`), early (``release_plan``: its owner or an
  admin), or when a re-plan says run now (a forecast changed or went stale: a stale forecast
  costs savings, never a deadline). Plans released together enter the placement queue (the fair
  queue, coordinator/placement/fair_queue.py) least latest start first. A hold never passes the
  plan's latest start (deadline - run x (1 + margin) - queue margin), so the queue margin is what
  a released plan has to wait for a slot.
* *Cancel.* A held plan that is cancelled leaves the planner, its reserved slots freed.
* *Restore.* A queued plan held at the stop whose latest start has come is queued at once; the
  others keep their stored reason and are decided again once the workers had :attr:`restore_wait_s`
  to reconnect and the feed to fetch, or earlier when their stored start or their latest start comes.
* *Receipt.* Every attempt's receipt of a plan that was held gets ``avoided_co2e_g`` and the two
  intensities it comes from, by the rule of coordinator/carbon_time/accounting.py (both windows
  read from the book's latest values when the attempt ends; None when the book does not cover
  them). The usage ledger and ``/metrics`` sum it.

Cost: nothing for a plan without a deadline but one attribute test at submit, cancel and done,
and a deque append per successful ``done`` (its op's run time). A deferrable submit costs one
planner decision (coordinator/carbon_time/planner.py: independent of the plans held) and a pass
over the pool of workers that can run it when the registry changed since the last.

Pure: the core's ``now`` (monotonic) plus :attr:`CarbonHolds.wall_offset` is the planner's Unix time.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Iterable
from typing import TYPE_CHECKING, Final

import msgspec
import structlog

from coordinator.carbon_time import Deferrable, ForecastBook, Hold, ShiftConfig, TimeShifter, avoided_co2e
from coordinator.placement.plan_queue import Signature
from coordinator.plans import SMALL_EVENT_BYTES

if TYPE_CHECKING:
    from coordinator.carbon_time.planner import Decision
    from coordinator.plans import Plan
    from coordinator.scheduling import Scheduler
    from coordinator.state import CoreState
    from coordinator.streams import Streams
    from protocol.messages import Receipt, Submit

__all__ = ["CARBON_COUNTERS", "CarbonHolds", "OpRunTimes"]

log = structlog.get_logger(__name__)

CARBON_COUNTERS: Final = ("carbon_held", "carbon_released", "carbon_not_held")
LOG_EVERY_S: Final = 600.0  # a reason a deferrable plan was not held is logged again after this long
MAX_DEADLINE_S: Final = 366 * 86400.0  # a deadline further away than this is refused (a unit mistake)
JOULES_PER_KWH: Final = 3.6e6


class OpRunTimes:
    """Each op's last :attr:`keep` successful run times: the expected run of a plan that gives none."""

    def __init__(self, keep: int = 64) -> None:
        self.keep = keep
        self._runs: dict[str, deque[float]] = {}

    def observe(self, op: str, run_s: float) -> None:
        runs = self._runs.get(op)
        if runs is None:
            runs = self._runs[op] = deque(maxlen=self.keep)
        runs.append(run_s)

    def expected(self, op: str) -> tuple[float, float] | None:
        """(median, spread) of ``op``'s observed runs, the spread being p90 / median - 1; None: none seen."""
        runs = self._runs.get(op)
        if not runs:
            return None
        ordered = sorted(runs)
        median = statistics.median(ordered)
        if not median > 0:
            return None
        p90 = ordered[min(len(ordered) - 1, math.ceil(0.9 * len(ordered)) - 1)]
        return median, max(0.0, p90 / median - 1)


class CarbonHolds:
    """The core's collaborator for carbon time shifting (module docstring).

    Args:
        state: the core's tables (plans, registry, counters, journal).
        scheduler: places a released plan (``enqueue``).
        streams: held plans' ``waiting`` events.
        config: the planner's knobs.
        book: the forecasts (the feeds' driver fills it); None: a new, empty one.
        restore_wait_s: how long restored held plans wait for workers and forecasts before being decided again.

    Attributes:
        wall_offset: Unix time minus the core's ``now`` (the core's ``set_wall_offset``).
    """

    def __init__(
        self, state: CoreState, *, scheduler: Scheduler, streams: Streams, config: ShiftConfig | None = None,
        book: ForecastBook | None = None, restore_wait_s: float = 30.0,
    ) -> None:
        self._state = state
        self._scheduler = scheduler
        self._streams = streams
        self.book = book if book is not None else ForecastBook()
        self.shifter = TimeShifter(self.book, config)
        self.runs = OpRunTimes()
        self.restore_wait_s = restore_wait_s
        self.wall_offset = 0.0
        self.held: set[str] = set()  # plans out of the placement queue, held by the planner
        self._restored: dict[str, Plan] = {}  # held at the stop, not decided again yet
        self._restored_until = 0.0  # (the core's now) when they are decided again
        self._zones: dict[Signature, tuple[str, ...]] = {}  # cached per registry generation
        self._stamp = -1
        self._logged: dict[str, float] = {}  # reason -> when it was last logged (Unix)
        state.counters.update(dict.fromkeys(CARBON_COUNTERS, 0))

    def unix(self, now: float) -> float:
        return now + self.wall_offset

    # ------------------------------------------------------------------ submit

    def admit(self, plan: Plan, msg: Submit, now: float) -> tuple[Submit, str | None]:
        """A new plan's deadline made absolute: the submit to record, or the problem to refuse it with."""
        unix = self.unix(now)
        deadline = msg.deadline_at if msg.deadline_s is None else unix + msg.deadline_s
        assert deadline is not None
        if deadline - unix > MAX_DEADLINE_S:
            return msg, (f"the deadline is {(deadline - unix) / 86400:.0f} days away; at most "
                         f"{MAX_DEADLINE_S / 86400:.0f} (deadline_at is Unix seconds)")
        plan.deadline_at, plan.submitted_at = deadline, unix
        if msg.deadline_s is not None:
            msg = msgspec.structs.replace(msg, deadline_s=None, deadline_at=deadline)
        return msg, None

    def hold(self, plan: Plan, now: float) -> bool:
        """Decide a plan with a deadline: True when it is held (out of the queue), False: place it now."""
        unix = self.unix(now)
        deferrable = self._deferrable(plan, unix)
        if isinstance(deferrable, str):
            self._not_held(plan, deferrable, unix)
            return False
        decisions = self.shifter.submit(deferrable, unix)
        own, others = decisions[0], decisions[1:]
        self._apply(others, now)
        if isinstance(own, Hold):
            self._hold(plan, own)
            return True
        self._not_held(plan, own.reason, unix)
        return False

    def _deferrable(self, plan: Plan, unix: float) -> Deferrable | str:
        """What the planner needs of the plan, or why it cannot be held."""
        assert plan.deadline_at is not None
        margin = None
        expected = plan.expected_run_s
        if not expected > 0:
            observed = self.runs.expected(plan.op)
            if observed is None:
                return f"no expected_run_s and no observed run of op {plan.op!r} to plan with"
            expected, spread = observed
            margin = max(self.shifter.config.run_margin, spread)
        zones = self._zones_of(plan)
        if not zones:
            return "no connected worker can run it"
        return Deferrable(plan.id, plan.deadline_at, expected, zones, margin)

    def _zones_of(self, plan: Plan) -> tuple[str, ...]:
        """The zones of the connected, undrained workers that can run the plan; the slots of every zone set."""
        registry = self._state.registry
        if registry.generation != self._stamp:
            self._stamp = registry.generation
            self._zones.clear()
            slots: dict[str, int] = {}
            for record in registry:
                if record.connected and not record.draining:
                    zone = record.capabilities.carbon_zone.strip().upper()
                    slots[zone] = slots.get(zone, 0) + record.capabilities.max_concurrency
            for zone, count in slots.items():
                self.shifter.set_slots(zone, count)
        signature = Signature.of(plan.op, plan.requirements, plan.avoid, plan.gpus)
        zones = self._zones.get(signature)
        if zones is None:
            pool = registry.matching(signature, signature.admits)
            found = {record.capabilities.carbon_zone.strip().upper() for record in pool if not record.draining}
            zones = self._zones[signature] = tuple(sorted(found, key=lambda zone: (not zone, zone)))
        return zones

    def _hold(self, plan: Plan, hold: Hold) -> None:
        """The plan waits for its window: out of the queue, its reason told."""
        if plan.id not in self.held:
            self.held.add(plan.id)
            self._state.counters["carbon_held"] += 1
        plan.deferred, plan.deferred_until = True, hold.start_s
        reason = hold.reason()
        if plan.waiting_reason != reason:
            plan.waiting_reason = reason
            plan.drop_superseded("waiting", SMALL_EVENT_BYTES)  # only the newest reason in a row is held
            data = {"reason": reason, "deferred_until": hold.start_s}
            self._streams.emit(plan, "waiting", data, small=True)
        else:
            self._state.journal.touched(plan)

    def _not_held(self, plan: Plan, reason: str, unix: float) -> None:
        self._state.counters["carbon_not_held"] += 1
        last = self._logged.get(reason)
        if last is None or unix - last >= LOG_EVERY_S:
            if len(self._logged) > 1000:
                self._logged.clear()
            self._logged[reason] = unix
            log.info("plan with a deadline placed at once", plan_id=plan.id, op=plan.op, reason=reason)

    # ------------------------------------------------------------------ release

    def _apply(self, decisions: Iterable[Decision], now: float) -> None:
        """Carry out the planner's decisions: new holds told, released plans queued least latest start first."""
        plans, shifter = self._state.plans, self.shifter
        released: list[tuple[float, str, Plan]] = []
        for decision in decisions:
            plan = plans.get(decision.plan_id)
            if plan is None or plan.state != "queued":
                shifter.forget(decision.plan_id, self.unix(now))
                self.held.discard(decision.plan_id)
                continue
            if isinstance(decision, Hold):
                self._hold(plan, decision)
            elif decision.plan_id in self.held:
                released.append((self._latest(plan), plan.id, plan))
        released.sort(key=lambda item: item[:2])
        for _, _, plan in released:
            self._release(plan, now)

    def _release(self, plan: Plan, now: float) -> None:
        self.held.discard(plan.id)
        plan.deferred_until = None
        self._state.counters["carbon_released"] += 1
        self._state.journal.touched(plan)
        self._scheduler.enqueue(plan, now)

    def release(self, plan: Plan, now: float) -> bool:
        """``release_plan``: a held plan is placed now; False when it was not held."""
        if plan.id in self._restored:
            del self._restored[plan.id]
            self._release(plan, now)
            return True
        if plan.id not in self.held:
            return False
        self.shifter.release(plan.id, self.unix(now))
        self._release(plan, now)
        return True

    def forget(self, plan: Plan, now: float) -> None:
        """The plan ended or was cancelled: it leaves the planner, its slots freed."""
        self.held.discard(plan.id)
        self._restored.pop(plan.id, None)
        plan.deferred_until = None
        self.shifter.forget(plan.id, self.unix(now))

    # ------------------------------------------------------------------ time and forecasts

    def tick(self, now: float) -> None:
        """Release the plans whose window began, re-plan where the planner says; decide restored plans when due."""
        if self._restored:
            self._decide_restored(now)
        if self.held:
            self._apply(self.shifter.tick(self.unix(now)), now)

    def forecast_changed(self, zones: Iterable[str], now: float) -> None:
        """A feed changed the book's forecast of ``zones``: the plans that may run there are decided again."""
        self._apply(self.shifter.forecast_changed(zones, self.unix(now)), now)

    def restored(self, plan: Plan, now: float) -> bool:
        """A queued plan loaded from the store: True when it stays held for now (module docstring)."""
        if plan.deferred_until is None or plan.deadline_at is None:
            return False
        unix = self.unix(now)
        if self._latest(plan) <= unix:
            plan.deferred_until = None
            return False  # its latest start came while the coordinator was down: placed at once
        self._restored[plan.id] = plan
        self._restored_until = now + self.restore_wait_s
        return True

    def _latest(self, plan: Plan) -> float:
        """The plan's latest start by its own expected run, or its deadline when it gave none."""
        assert plan.deadline_at is not None
        if not plan.expected_run_s > 0:
            observed = self.runs.expected(plan.op)
            if observed is None:
                return plan.deadline_at - self.shifter.config.queue_margin_s
            expected, spread = observed
            return plan.deadline_at - expected * (1 + max(self.shifter.config.run_margin, spread)) \
                - self.shifter.config.queue_margin_s
        return plan.deadline_at - plan.expected_run_s * (1 + self.shifter.config.run_margin) \
            - self.shifter.config.queue_margin_s

    def _started(self, plan: Plan, unix: float) -> bool:
        """A restored plan's stored start (or its latest start) has come: decided now, whoever reconnected."""
        return (plan.deferred_until is not None and plan.deferred_until <= unix) or self._latest(plan) <= unix

    def _decide_restored(self, now: float) -> None:
        unix = self.unix(now)
        due = now >= self._restored_until
        for plan in [p for p in self._restored.values() if due or self._started(p, unix)]:
            del self._restored[plan.id]
            if plan.state != "queued":
                continue
            if not self.hold(plan, now):
                plan.deferred_until = None
                self._state.journal.touched(plan)
                self._scheduler.enqueue(plan, now)

    # ------------------------------------------------------------------ runs and receipts

    def ran(self, plan: Plan, now: float) -> None:
        """A successful attempt ended: its op's run time is observed."""
        if plan.started_at_s is not None:
            self.runs.observe(plan.op, now - plan.started_at_s)

    def account(self, plan: Plan, receipt: Receipt, zone: str, now: float) -> None:
        """The attempt of a plan that was held ended with ``receipt`` in ``zone``: what its wait avoided."""
        if plan.submitted_at is None:
            return
        end = self.unix(now)
        run_s = receipt.run_s if receipt.run_s > 0 else (now - plan.started_at_s if plan.started_at_s else 0.0)
        found = avoided_co2e(self.book.forecast(zone.strip().upper()), receipt.joules / JOULES_PER_KWH,
                             plan.submitted_at, end - run_s, run_s)  # fmt: skip
        if found is not None:
            receipt.avoided_co2e_g = found.avoided_co2e_g
            receipt.ran_g_per_kwh = found.ran_g_per_kwh
            receipt.at_submit_g_per_kwh = found.at_submit_g_per_kwh

