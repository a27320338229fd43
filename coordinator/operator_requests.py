"""Operator requests the core answers: ``list_plans``, ``drain_worker``, ``undrain_worker``, ``remove_worker``,
``release_device``.

Rules (docs/SEMANTICS.md §Operator requests):

* ``list_plans`` shows the plans the session may see (its principal's; an admin's: all), newest
  first, optionally only some states, at most ``limit``; with them the queue in placement order
  (priority, then age) and the count of visible plans per state. It costs one pass over the plans
  the session may see, so dashboards poll it every few seconds, not per event; the pass is charged
  to the principal (``Outbox.charge``, coordinator/limits.py §Cost per principal). A client's
  pass walks only its own plans (:class:`_OwnerIndex`), not every principal's: 100 plans listed
  every 100 ms next to another client's 30,000 finished ones held the loop ~2 ms per listing
  (issue 17 finding 11, bench phase ``f11-dashboard``); an admin's walks them all.
* ``op``, ``owner`` and ``id_contains`` narrow the rows (and ``total``) to one op, one principal
  (a client may name only itself: another is ``error(forbidden)``) and ids containing a text
  (case-sensitive); ``counts`` and the queue stay those of every visible plan. A tally cannot
  count such rows, so a narrowed client's pass walks all of its own plans. The queue comes with
  the waiting reason of each plan in it (``waiting``): why it waits, beside its id.
* Listings are **summaries** and **pages** (issue 17 findings 5 and 11): a row carries no result
  (``result_bytes`` gives its size; ``get_plan`` the body), a cut error message and waiting
  reason; a page stops at about :data:`PAGE_BYTES` or :data:`PAGE_ROWS` rows even below ``limit``
  (so one request's rows cost the loop about a millisecond, bench phase ``f2-never-reads``) and says where the next
  starts (``next_cursor``: the submit order of its last row; plans older than it follow). The
  queue list stops at about :data:`QUEUE_BYTES`. No reply can exceed a peer's frame limit.
* ``drain_worker`` marks a worker *draining*: placement skips it (it has no capacity), its
  session is sent ``drain(deadline_s)``, and plans waiting on it are told why. Running plans may
  finish. With a deadline, whatever it still holds when the deadline passes is taken back: the
  worker is sent ``cancel`` for each attempt and the plan goes through ``worker_lost`` (requeued,
  or failed on its last attempt), as if that worker had died. Draining again replaces the
  deadline. A drained worker stays drained across reconnects (it is sent ``drain`` again after
  its ``welcome``) until ``undrain_worker`` or until it is reaped.
* ``undrain_worker`` clears the mark, sends ``undrain``, forgives the worker's earlier rejects
  (made while draining) and places queued plans on it.
* ``remove_worker`` removes a worker for good, *at once* (a graceful removal is ``drain_worker``
  with a deadline first): its live attempts are cancelled on the worker and the plans requeued at
  no cost in attempts, its record is forgotten, its session closed 4410, and a later ``hello``
  with its id is refused the same way until the coordinator restarts
  (coordinator/worker_sessions/registration.py).
* ``release_device`` passes an operator's release of a quarantined device to its worker, which keeps
  the quarantine (docs/OPERATIONS.md §GPU health): the worker's next load reports the device ``ok``
  and placement counts it again. A disconnected worker, or a device it does not have, is an error.
* ``drain_worker``, ``undrain_worker``, ``remove_worker`` and ``release_device`` are operator actions: a
  session without the admin role gets ``error(forbidden)`` and nothing changes (``list_plans`` stays open to clients: it
  shows only their own plans).
* An unknown worker id answers ``error(unknown_worker)``; a negative or non-finite deadline,
  a ``limit`` outside 1..10000, or a filter over 256 characters, answers ``error(invalid_argument)``.

Like the rest of the core, nothing here reads a clock: ``now`` comes in.

Depends on the registry, plans and queue it is handed, the scheduler (coordinator/scheduling.py)
and the outbox (coordinator/effects.py).
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING

import structlog

from coordinator.plans import SUMMARY_TEXT, OwnerTally
from protocol import errors
from protocol.messages import (
    Cancel,
    Drain,
    DrainWorker,
    Error,
    ListPlans,
    Ok,
    PlanInfo,
    Plans,
    ReleaseDevice,
    RemoveWorker,
    Undrain,
    UndrainWorker,
)

if TYPE_CHECKING:
    from coordinator.effects import Outbox
    from coordinator.placement.plan_queue import PlanQueue
    from coordinator.plans import Plan
    from coordinator.registry import WorkerRegistry
    from coordinator.scheduling import Scheduler
    from coordinator.sessions import Session
    from coordinator.workers import WorkerRecord

__all__ = ["MAX_FILTER_CHARS", "MAX_LIST_LIMIT", "PAGE_ROWS", "OperatorRequests", "page_start", "row_filter"]

log = structlog.get_logger(__name__)

MAX_LIST_LIMIT = 10_000
_PRIORITY = operator.attrgetter("priority")
_AGE = operator.attrgetter("order")
PAGE_BYTES = 256 * 1024  # about the most a page of ``plans`` rows encodes to; the rest via ``next_cursor``
PAGE_ROWS = 500  # ... and the most rows it holds: each costs ~1.5 µs to size and build on the loop
QUEUE_BYTES = 64 * 1024  # ... and its queue of plan ids (with their waiting reasons)
MAX_FILTER_CHARS = 256  # a listing's op, owner or id_contains filter, at most


class OperatorRequests:
    """The core's handlers for operator requests, and the drain deadlines they schedule.

    Args:
        registry: the workers (drain marks, leases).
        plans: the core's plans by id.
        queue: the queued plans (a worker's earlier rejects are forgiven there).
        scheduler: places plans on an undrained worker, takes back a drained one's leases.
        outbox: where replies, ``drain`` and ``undrain`` go.
    """

    def __init__(
        self,
        *,
        registry: WorkerRegistry,
        plans: dict[str, Plan],
        queue: PlanQueue,
        scheduler: Scheduler,
        outbox: Outbox,
    ) -> None:
        self._registry = registry
        self._plans = plans
        self._queue = queue
        self._scheduler = scheduler
        self._outbox = outbox
        self._deadlines: dict[str, float] = {}  # worker id -> when its remaining plans are taken back
        self._owned = _OwnerIndex(plans)
        # Set by the core: WorkerSessions.remove (it owns the sessions and secrets a removal clears).
        self.remover: Callable[[str, float], None] | None = None

    # ------------------------------------------------------------------ list_plans

    def list_plans(self, s: Session, msg: ListPlans) -> None:
        """Answer ``list_plans`` with one page of ``plans`` (see the module docstring)."""
        before, problem = page_start(msg)
        if problem is not None:
            self._error(s, msg.req_id, errors.INVALID_ARGUMENT, problem)
            return
        if msg.owner and not s.admin and msg.owner != s.principal:
            problem = (f"owner {msg.owner[:MAX_FILTER_CHARS]!r}: a client token lists only its own plans "
                       f"({s.principal!r}); another principal's need an admin token")
            self._error(s, msg.req_id, errors.FORBIDDEN, problem)
            return
        wanted = frozenset(msg.states)
        # op, owner, id_contains: rows a tally cannot count, so a client's pass walks all of its plans
        matches = row_filter(msg.op, msg.owner if s.admin else "", msg.id_contains, s.admin)
        counts: dict[str, int] = {}
        listed: list[PlanInfo] = []
        queued: list[Plan] = []
        total = scanned = size = 0
        last_order = -1
        next_cursor = ""
        full = False
        walk: Iterable[Plan]
        if s.admin:  # every principal's plans: walked whole for the counts (plans are in submit order)
            walk = reversed(self._plans.values())
        else:  # its own plans: counts and queue from its tally, and only as many walked as the page needs
            tally = self._owned.tally(s.principal)
            counts = {state: n for state, n in tally.counts.items() if n}
            if matches is None:
                total = sum(n for state, n in counts.items() if not wanted or state in wanted)
            queued = sorted(tally.queued.values(), key=_AGE)  # oldest first
            scanned = len(queued)
            walk = self._owned.newest_first(s.principal)
        for plan in walk:
            scanned += 1
            if s.admin:
                counts[plan.state] = counts.get(plan.state, 0) + 1
                if plan.state == "queued":
                    queued.append(plan)
            elif next_cursor and matches is None:
                break  # the page is full and one more plan is known to follow
            if (wanted and plan.state not in wanted) or (matches is not None and not matches(plan)):
                continue
            if s.admin or matches is not None:
                total += 1
            if before is not None and plan.order >= before:
                continue
            if full:
                if not next_cursor:
                    next_cursor = str(last_order)
                continue
            row = plan.summary_bytes()
            if listed and (size + row > PAGE_BYTES or len(listed) >= PAGE_ROWS):  # far under every frame limit
                full = True
                next_cursor = str(last_order)
                continue
            listed.append(plan.summary(s.admin))
            size += row
            last_order = plan.order
            full = len(listed) >= msg.limit
        if s.admin:
            queued.reverse()  # oldest first
        queued.sort(key=_PRIORITY, reverse=True)  # stable: age order kept within a priority
        queue: list[str] = []
        waiting: dict[str, str] = {}
        room = QUEUE_BYTES
        for p in queued[: msg.limit]:
            reason = p.waiting_reason
            if reason is not None and len(reason) > SUMMARY_TEXT:
                reason = reason[: SUMMARY_TEXT - 3] + "..."
            shown = p.shown_id(s.admin)  # its owner's name for it, to a client (plans.py PlanNames)
            room -= len(shown) + 4 + (len(shown) + len(reason) + 8 if reason else 0)
            if room < 0:
                break
            queue.append(shown)
            if reason:  # the queue's "why": an operator reads it beside the id (a dashboard's queue pane)
                waiting[shown] = reason
        self._outbox.charge(scanned + 4 * len(listed))  # rows scanned and rows built (coordinator/limits.py)
        reply = Plans(req_id=msg.req_id, plans=listed, queue=queue, counts=counts, total=total,
                      next_cursor=next_cursor, waiting=waiting)  # fmt: skip
        self._outbox.send(s.conn_id, reply)

    # ------------------------------------------------------------------ drain / undrain

    def drain(self, s: Session, msg: DrainWorker, now: float) -> None:
        """Answer ``drain_worker``: mark the worker draining, tell it, and schedule its deadline."""
        if not self._admin(s, msg.req_id, "drain_worker"):
            return
        deadline_s = msg.deadline_s
        if deadline_s is not None and not (math.isfinite(deadline_s) and deadline_s >= 0):
            problem = f"deadline_s must be a number of seconds >= 0, or null for no deadline (got {deadline_s})"
            self._error(s, msg.req_id, errors.INVALID_ARGUMENT, problem)
            return
        record = self._record(s, msg.req_id, msg.worker_id)
        if record is None:
            return
        self._outbox.send(s.conn_id, Ok(req_id=msg.req_id))
        self.drain_record(record, deadline_s, now)

    def drain_record(self, record: WorkerRecord, deadline_s: float | None, now: float) -> None:
        """Drain one worker (``drain_worker``, and the autoscaler's scale-down): mark, tell, schedule."""
        record.draining = True
        if deadline_s is None:
            record.drain_deadline_s = None
            self._deadlines.pop(record.id, None)
        else:
            record.drain_deadline_s = self._deadlines[record.id] = now + deadline_s
        if record.conn_id is not None:
            self._outbox.send(record.conn_id, Drain(deadline_s=deadline_s))
        log.info("worker draining", worker_id=record.id, deadline_s=deadline_s, leases=len(record.leases))
        self._scheduler.refresh_waiting(now)
        self.tick(now)  # a zero deadline takes its plans back at once

    def undrain(self, s: Session, msg: UndrainWorker, now: float) -> None:
        """Answer ``undrain_worker``: the worker takes plans again, including those it rejected while draining."""
        if not self._admin(s, msg.req_id, "undrain_worker"):
            return
        record = self._record(s, msg.req_id, msg.worker_id)
        if record is None:
            return
        was_draining = record.draining
        record.draining = False
        record.drain_deadline_s = None
        self._deadlines.pop(record.id, None)
        if record.conn_id is not None and was_draining:
            self._outbox.send(record.conn_id, Undrain())
        log.info("worker undrained", worker_id=record.id, was_draining=was_draining)
        self._outbox.send(s.conn_id, Ok(req_id=msg.req_id))
        for plan_id in self._queue.forgive(record.id):
            self._plans[plan_id].avoid -= {record.id}
        self._scheduler.fill_worker(record, now)
        self._scheduler.refresh_waiting(now)

    def remove(self, s: Session, msg: RemoveWorker, now: float) -> None:
        """Answer ``remove_worker``: the worker goes at once, its plans back to the queue."""
        if not self._admin(s, msg.req_id, "remove_worker"):
            return
        record = self._record(s, msg.req_id, msg.worker_id)
        if record is None:
            return
        self._deadlines.pop(record.id, None)
        assert self.remover is not None
        self.remover(record.id, now)
        self._outbox.send(s.conn_id, Ok(req_id=msg.req_id))

    def release_device(self, s: Session, msg: ReleaseDevice) -> None:
        """Answer ``release_device``: pass it to the worker, which ends the device's quarantine (its next
        load says so, and placement uses the device again; docs/OPERATIONS.md §GPU health)."""
        if not self._admin(s, msg.req_id, "release_device"):
            return
        record = self._record(s, msg.req_id, msg.worker_id)
        if record is None:
            return
        count = len(record.capabilities.gpus)
        if not 0 <= msg.device < count:
            self._error(s, msg.req_id, errors.INVALID_ARGUMENT, f"worker {record.id} has no device {msg.device} "
                        f"(its devices are 0..{count - 1})" if count else f"worker {record.id} has no devices")
            return
        if record.conn_id is None:
            self._error(s, msg.req_id, errors.UNKNOWN_WORKER, f"worker {record.id} is not connected: it keeps its "
                        "quarantines; release the device once it is back")  # fmt: skip
            return
        self._outbox.send(record.conn_id, msg)
        log.info("device release passed to the worker", worker_id=record.id, device=msg.device, by=s.principal)
        self._outbox.send(s.conn_id, Ok(req_id=msg.req_id))

    def registered(self, record: WorkerRecord, now: float) -> None:
        """A worker (re)registered: a drained one is told again, right after its ``welcome``."""
        if record.draining and record.conn_id is not None:
            deadline = self._deadlines.get(record.id)
            left_s = None if deadline is None else max(0.0, deadline - now)
            self._outbox.send(record.conn_id, Drain(deadline_s=left_s))

    def tick(self, now: float) -> None:
        """Take back the plans of drained workers whose deadline passed."""
        if not self._deadlines:
            return
        registry = self._registry
        for worker_id, deadline in sorted(self._deadlines.items()):
            if deadline > now:
                continue
            del self._deadlines[worker_id]
            if worker_id not in registry:
                continue  # reaped meanwhile: its plans were already handled
            record = registry.get(worker_id)
            record.drain_deadline_s = None
            self._take_back(record, now)

    def _take_back(self, record: WorkerRecord, now: float) -> None:
        plans, scheduler = self._plans, self._scheduler
        # A cancelled plan's lease stays held until the worker's done; only live plans move.
        live = [plans[pid] for pid in record.leases if pid in plans and not plans[pid].terminal]
        if not live:
            return
        log.info("drain deadline passed: taking plans back", worker_id=record.id, plans=sorted(p.id for p in live))
        for plan in sorted(live, key=lambda p: (-p.priority, p.order)):
            if record.conn_id is not None:
                self._outbox.send(record.conn_id, Cancel(plan_id=plan.id, attempt=plan.attempt))
            self._registry.release(record.id, plan.id)  # through the registry: its room index sees the slot
            scheduler.lease_lost(plan, record.id, f"worker {record.id} was drained and its deadline passed", now)
        scheduler.refresh_waiting(now)

    # ------------------------------------------------------------------ helpers

    def _admin(self, s: Session, req_id: int, request: str) -> bool:
        """Whether the session may send an operator action; if not, it is told so (nothing changes)."""
        if s.admin:
            return True
        problem = (
            f"{request} needs an admin token; this session's token ({s.principal!r}) is a client token "
            "(use FLEETWIRE_ADMIN_TOKEN, which `fleetwire up` prints)"
        )
        self._error(s, req_id, errors.FORBIDDEN, problem)
        return False

    def _record(self, s: Session, req_id: int, worker_id: str) -> WorkerRecord | None:
        if worker_id in self._registry:
            return self._registry.get(worker_id)
        ids = [r.id for r in self._registry]
        known = ", ".join(ids[:10]) + (f" and {len(ids) - 10} more" if len(ids) > 10 else "") if ids else "none"
        self._error(s, req_id, errors.UNKNOWN_WORKER, f"no worker with id {worker_id!r} (registered: {known})")
        return None

    def _error(self, s: Session, req_id: int, code: str, message: str) -> None:
        self._outbox.send(s.conn_id, Error(code=code, message=message, req_id=req_id))


def page_start(msg: ListPlans) -> tuple[int | None, str | None]:
    """A ``list_plans``' first order to skip (its cursor; None: from the newest), or why it is invalid."""
    if not 1 <= msg.limit <= MAX_LIST_LIMIT:
        return None, f"limit must be 1..{MAX_LIST_LIMIT} (got {msg.limit})"
    for name, text in (("op", msg.op), ("owner", msg.owner), ("id_contains", msg.id_contains)):
        if len(text) > MAX_FILTER_CHARS:
            return None, f"{name} is {len(text)} characters; a filter is at most {MAX_FILTER_CHARS}"
    if not msg.cursor:
        return None, None
    try:
        return int(msg.cursor), None
    except ValueError:
        return None, f"cursor {msg.cursor[:40]!r} is not one this coordinator gave (use a reply's next_cursor)"


def row_filter(op: str, owner: str, id_contains: str, admin: bool = True) -> Callable[[Plan], bool] | None:
    """Whether a plan matches a ``list_plans``' ``op``, ``owner`` and ``id_contains`` (None: no such filter).

    ``id_contains`` is matched against the id the session knows the plan by: a client's, the name it
    submitted (never a key the core made for it: docs/SEMANTICS.md §Plan ids); an admin's, the key or the name.
    """
    if not (op or owner or id_contains):
        return None

    def matches(plan: Plan) -> bool:
        if (op and plan.op != op) or (owner and plan.owner != owner):
            return False
        name = plan.name
        if name is None:
            return id_contains in plan.id
        return id_contains in name or (admin and id_contains in plan.id)

    return matches


class _OwnerIndex:
    """Each principal's plan ids in submit order, kept up to date lazily from the core's plans.

    The core's ``plans`` dict is the truth, changed in several places (submit, load, retention);
    this index hooks none of them. New plans are appended to the dict, so each call indexes the
    ones after the newest it has seen (``_last``, held by identity); stale ids (forgotten plans,
    or a plan now under another owner) are skipped when read and dropped by a rebuild once they
    outnumber the live plans. Only ids are held, never a forgotten plan's args or result (but
    ``_last``, one plan). Costs amortised O(1) per plan, and a listing O(the principal's plans).
    """

    __slots__ = ("_ids", "_last", "_plans", "_size", "_tallies")

    def __init__(self, plans: dict[str, Plan]) -> None:
        self._plans = plans
        self._ids: dict[str, list[str]] = {}  # owner -> its plan ids, oldest first (may hold stale ones)
        self._last: Plan | None = None  # the newest plan indexed
        self._size = 0  # ids held, stale ones included
        self._tallies: dict[str, OwnerTally] = {}  # owner -> its plans by state (plans.py OwnerTally)

    def newest_first(self, owner: str) -> Iterator[Plan]:
        """``owner``'s plans, newest first (a generator: walk only what you need)."""
        self._catch_up()
        plans = self._plans
        seen: set[str] = set()
        for plan_id in reversed(self._ids.get(owner, ())):
            plan = plans.get(plan_id)
            if plan is not None and plan.owner == owner and plan_id not in seen:  # not stale, listed once
                seen.add(plan_id)
                yield plan

    def tally(self, owner: str) -> OwnerTally:
        """``owner``'s plans counted by state, and its queued plans (kept up to date from here on)."""
        self._catch_up()
        tally = self._tallies.get(owner)
        if tally is None:
            tally = self._tallies[owner] = OwnerTally()
        return tally

    def _catch_up(self) -> None:
        plans, last = self._plans, self._last
        if self._size > 2 * len(plans) + 1024 or (last is not None and plans.get(last.id) is not last):
            self._ids, self._size, last = {}, 0, None  # rebuild: too many stale ids, or the mark is gone
        new: list[Plan] = []
        for plan in reversed(plans.values()):
            if plan is last:
                break
            new.append(plan)
        if not new:
            return
        ids, tallies = self._ids, self._tallies
        for plan in reversed(new):
            mine = ids.get(plan.owner)
            if mine is None:
                mine = ids[plan.owner] = []
            mine.append(plan.id)
            if plan.tally is None:  # counted once, in its state now; advance() and forgetting keep it right
                tally = tallies.get(plan.owner)
                if tally is None:
                    tally = tallies[plan.owner] = OwnerTally()
                tally.add(plan)
        self._size += len(new)
        self._last = new[0]
