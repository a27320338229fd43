"""A view session's decisions, sans-I/O: what a client session on a cluster's main port answers from the rows.

A **view session** (docs/CLUSTER.md §Cross-shard views) is a client session on a cluster
coordinator's main port that names no pool: it sees the plans and workers of every shard, read
from PostgreSQL's committed rows. Its driver (coordinator/io/cluster/sessions.py) reads the rows
(the SQL is coordinator/io/cluster/views.py), forwards what only a shard's owner can do, and
hands what it read to a :class:`ViewSession`, which decides the answer: plain data in, messages
out, no clock, database or socket here, so unit tests drive it directly
(tests/unit/test_view_session.py).

What it owns: whose plans the session sees and by which id it names them, the plans it follows
(:attr:`ViewSession.watched`, the subscribe to all's :attr:`~ViewSession.tips`) and the work units
its requests cost beyond one per message (:attr:`~ViewSession.work`, coordinator/limits.py).

Rules:

* **Plan ids** are scoped per principal, as in a core (docs/SEMANTICS.md §Plan ids): a client's
  look-ups find only its own plans, by the id it submitted, and every frame names them by it
  (:func:`catch_up`); another principal's plan of that id answers as an unused id
  (:meth:`ViewSession.not_found`). An admin finds plans by key and sees each one's owner and name.
* **Listings**: the same checks as a core's (``page_start``); a client lists only its own plans
  (``owner`` of another: ``forbidden``). A page stays under :data:`PAGE_BYTES`. The counts per
  state come from the driver's per-principal cache; a filtered listing's total is counted apart.
* **Following**: at most :data:`MAX_WATCHED` plans by id, and at most :data:`MAX_ALL` at once from
  a subscribe to all (past it, new plans are skipped and counted). A followed plan's events go out
  from the next seq not sent, with a ``resync`` for each run the rows never held; a plan that ended
  and was sent whole, or (from the subscribe to all) is no longer stored, is followed no longer.
* **Costs**: a listing costs the rows it scanned plus the rows read plus four per row built, a
  ``list_workers`` the registries and rows read, a ``subscribe`` one per id looked up (and one per
  shard to follow all); the rows a subscribe to all discovers and the events sent are charged by
  the driver as they happen.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Final

import msgspec

from coordinator.auth import Principal
from coordinator.operator_requests import MAX_FILTER_CHARS, PAGE_BYTES, page_start
from coordinator.plans import Plan
from protocol import errors as codes
from protocol.messages import (
    TERMINAL_STATES,
    Accepted,
    Error,
    GetPlan,
    ListPlans,
    ListWorkers,
    Ok,
    PlanInfo,
    PlanReply,
    Plans,
    Resync,
    Subscribe,
    Unsubscribe,
    WorkerInfo,
    Workers,
)

__all__ = ["ALL_PER_RING", "MAX_ALL", "MAX_WATCHED", "Listing", "ViewSession", "Watched", "catch_up",
           "workers_summary"]

MAX_WATCHED: Final = 1000  # plans one view session may follow by id
MAX_ALL: Final = 1000  # plans one view session's subscribe to all follows at once
ALL_PER_RING: Final = 200  # new plans of one shard read per doorbell (more: read again at once)

#: A plan's row as the look-up by id finds it: ``(shard, owner principal, store key)`` (None: no such plan).
Found = tuple[int, str, int] | None
#: A new plan's row as a subscribe to all discovers it: ``(key, id, shard, owner, name)``.
NewPlan = tuple[int, str, int, str, str | None]


class Watched(msgspec.Struct):
    """A plan a view session follows from the rows: ``since`` is the first events row to read again.

    ``plan_id``: the id the session knows it by (a client's: the one it submitted; an admin's: the key).
    """

    key: int
    plan_id: str
    shard: int
    expected: int  # the next seq to send
    since: int = 0


@dataclass(frozen=True, slots=True)
class Listing:
    """What a ``list_plans`` reads (:meth:`ViewSession.listing`), as coordinator/io/cluster/views.py takes it.

    Attributes:
        states: the states listed (empty: all).
        limit: rows to read: one more than the page, to know whether more follow.
        owner: whose plans (None: everyone's, an admin's listing).
        before: the store key the page starts below (None: from the newest).
        op, id_contains: the filters ("" : none).
        admin: ``id_contains`` may match a key (an admin's), not only a submitted id.
        counted_apart: the cached counts per state cannot give the total: count the matching rows.
    """

    states: list[str]
    limit: int
    owner: str | None
    before: int | None
    op: str
    id_contains: str
    admin: bool
    counted_apart: bool


class ViewSession:
    """One view session's state and decisions (module docstring).

    Args:
        principal: who the session speaks for.
        browser: its handshake sent ``Origin`` (the dashboard): its submits are forwarded, not moved.

    Attributes:
        owner: whose plans it sees (None: an admin, everyone's).
        watched: plan key -> what was sent of it.
        tips: subscribed to all: shard -> highest plan key read (None: not subscribed to all).
        from_all: keys of the watched plans the subscribe to all added.
        work: work units spent beyond one per message since the driver last took them.
    """

    def __init__(self, principal: Principal, *, browser: bool = False) -> None:
        self.principal = principal
        self.owner = None if principal.admin else principal.name
        self.browser = browser
        self.watched: dict[int, Watched] = {}
        self.tips: dict[int, int] | None = None
        self.from_all: set[int] = set()
        self.work = 0

    # ------------------------------------------------------------------ who sees what

    def charge(self, units: int) -> None:
        """Count work beyond a request's one message: rows scanned and built."""
        self.work += units

    def take_work(self) -> int:
        """The work units counted since the last call (a frame's, for the reader's verdict)."""
        spent, self.work = self.work, 0
        return spent

    def visible(self, owner: str) -> bool:
        """Whether a plan of ``owner`` is this session's to see."""
        return self.owner is None or owner == self.owner

    def not_found(self, plan_id: str, req_id: int) -> Error:
        """The answer for an id this session knows no plan by: another principal's plan of that id answers alike
        (plan ids are scoped per principal, docs/SEMANTICS.md §Plan ids: the look-ups never find it)."""
        message = f"no plan with id {plan_id!r} in any shard of this cluster"
        return Error(code=codes.PLAN_NOT_FOUND, message=message, req_id=req_id, plan_id=plan_id)

    def plan_shard(self, plan_id: str, req_id: int, found: Found) -> int | Error:
        """The shard of a plan this session may see (to forward or move a request there), else ``plan_not_found``."""
        if found is None or not self.visible(found[1]):
            return self.not_found(plan_id, req_id)
        return found[0]

    # ------------------------------------------------------------------ requests answered from the rows

    def plan_reply(self, msg: GetPlan, found: Sequence[Plan]) -> PlanReply | Error:
        """``get_plan``: the newest of the plans found under the id that this session may see."""
        mine = [p for p in found if self.visible(p.owner)]
        if not mine:
            return self.not_found(msg.plan_id, msg.req_id)
        return PlanReply(req_id=msg.req_id, plan=mine[-1].info(self.owner is None))

    def listing(self, msg: ListPlans) -> Listing | Error:
        """What a ``list_plans`` reads, or the error it is answered (the same checks as a core's listing)."""
        before, problem = page_start(msg)
        if problem is not None:
            return Error(code=codes.INVALID_ARGUMENT, message=problem, req_id=msg.req_id)
        if msg.owner and self.owner is not None and msg.owner != self.owner:
            problem = (f"owner {msg.owner[:MAX_FILTER_CHARS]!r}: a client token lists only its own plans "
                       f"({self.owner!r}); another principal's need an admin token")  # fmt: skip
            return Error(code=codes.FORBIDDEN, message=problem, req_id=msg.req_id)
        owner = self.owner if self.owner is not None else msg.owner or None
        admin = self.owner is None  # a client's id_contains matches the ids it submitted, never a key
        apart = owner != self.owner or bool(msg.op) or bool(msg.id_contains)
        return Listing(list(msg.states), msg.limit + 1, owner, before, msg.op, msg.id_contains, admin, apart)

    def plans_page(
        self, msg: ListPlans, listing: Listing, plans: Sequence[tuple[int, Plan]], counts: dict[str, int],
        scanned: int, matching: int,
    ) -> Plans:  # fmt: skip
        """The ``plans`` reply: a page of the rows read (store key, plan), highest key first.

        ``counts``: plans per state of the session's principal (``scanned``: the rows that count
        scanned, 0 when cached); ``matching``: the filtered total when ``listing.counted_apart``.
        """
        if listing.counted_apart:  # the cached counts cannot say: counted apart, a scan of its own
            total = matching
            scanned += matching
        else:
            total = sum(n for state, n in counts.items() if not listing.states or state in listing.states)
        listed: list[PlanInfo] = []
        size = last = 0
        cursor = ""
        for key, plan in plans:
            row = plan.summary_bytes()
            if len(listed) >= msg.limit or (listed and size + row > PAGE_BYTES):  # a page stays under frame limits
                cursor = str(last)
                break
            last = key
            if msg.op and plan.op != msg.op:  # its args held the op's marker (views.py op_marker)
                continue
            listed.append(plan.summary(self.owner is None))
            size += row
        else:
            if len(plans) > msg.limit:  # every row read, one of them not of the op: more may follow
                cursor = str(last)
        self.charge(scanned + len(plans) + 4 * len(listed))  # rows scanned and rows built, as the core's listing
        return Plans(req_id=msg.req_id, plans=listed, counts=counts, total=total, next_cursor=cursor)

    def workers_reply(self, msg: ListWorkers, registries: dict[int, list[WorkerInfo]], version: str) -> Workers:
        """``list_workers``: every served shard's registry, in shard order."""
        rows = [w for shard in sorted(registries) for w in registries[shard]]
        self.charge(len(registries) + len(rows))  # registries read, rows sent
        return Workers(req_id=msg.req_id, workers=rows, summary=workers_summary(rows), version=version)

    def worker_shard(self, worker_id: str, req_id: int, registries: dict[int, list[WorkerInfo]]) -> int | Error:
        """The shard whose registry holds a worker (to forward a drain or remove there), else ``unknown_worker``."""
        for shard, rows in registries.items():
            if any(w.id == worker_id for w in rows):
                return shard
        message = f"no worker {worker_id!r} in any served shard of this cluster (see `fleetwire workers`)"
        return Error(code=codes.UNKNOWN_WORKER, message=message, req_id=req_id)

    # ------------------------------------------------------------------ following plans

    @property
    def following(self) -> bool:
        """Whether the session follows anything (plans by id, or every new plan)."""
        return bool(self.watched) or self.tips is not None

    def subscribe(self, msg: Subscribe, found: Sequence[Found]) -> list[Watched] | Error:
        """The plans a ``subscribe`` follows (``found``: each of ``msg.plan_ids`` looked up), or its error.

        One id this session cannot see and nothing is subscribed; past :data:`MAX_WATCHED` neither.
        """
        fresh: list[Watched] = []
        if msg.plan_ids:
            self.charge(len(msg.plan_ids))  # one look-up by id each
            for plan_id, one in zip(msg.plan_ids, found, strict=True):
                if one is None or not self.visible(one[1]):
                    return self.not_found(plan_id, msg.req_id)
                fresh.append(Watched(one[2], plan_id, one[0], max(0, msg.from_seq) + 1))
        if len(self.watched) - len(self.from_all) + len(fresh) > MAX_WATCHED:
            problem = f"a view session follows at most {MAX_WATCHED} plans; subscribe on the shard's owner (?pool=)"
            return Error(code=codes.INVALID_ARGUMENT, message=problem, req_id=msg.req_id)
        return fresh

    def wants_tips(self, msg: Subscribe) -> bool:
        """Whether a subscribe to all starts here: the driver reads each shard's highest key (:meth:`follow_all`)."""
        return msg.all and self.tips is None

    def follow_all(self, tips: dict[int, int]) -> None:
        """Follow every plan created after ``tips`` (shard -> highest key now)."""
        self.tips = tips
        self.charge(len(tips))

    def watch(self, fresh: Iterable[Watched], shards: int) -> set[int] | None:
        """Follow ``fresh`` too; the shards to wait on (all of them when following all), None when nothing changed."""
        fresh = list(fresh)
        for w in fresh:
            self.watched.setdefault(w.key, w)
        if not fresh and self.tips is None:
            return None
        if self.tips is not None:
            return set(range(shards))
        return {w.shard for w in self.watched.values()}

    def accepted(self, reply: Any, found: Found) -> list[Watched]:
        """A browser's forwarded submit that subscribed: the plan to follow from its first event (none if not)."""
        if type(reply) is not Accepted or found is None or len(self.watched) - len(self.from_all) >= MAX_WATCHED:
            return []
        return [Watched(found[2], reply.plan_id, found[0], 1)]

    def unsubscribe(self, msg: Unsubscribe) -> Ok:
        """Stop following the plans named (and, with ``all``, every plan)."""
        if msg.all:
            self.watched.clear()
            self.tips = None
            self.from_all.clear()
        gone = set(msg.plan_ids)
        for key in [k for k, w in self.watched.items() if w.plan_id in gone]:
            del self.watched[key]
            self.from_all.discard(key)
        return Ok(req_id=msg.req_id)

    def discover(self, rows: Sequence[NewPlan]) -> tuple[bool, int]:
        """Subscribed to all: follow the plans committed since the last read (``rows``, by key within each shard).

        Returns:
            Whether a shard had more new plans than one read takes (:data:`ALL_PER_RING`: read
            again at once), and how many were skipped (past :data:`MAX_ALL` followed at once).
        """
        tips = self.tips
        assert tips is not None, "discover() is for a subscribe to all"
        per_shard: dict[int, int] = {}
        skipped = 0
        for key, plan_id, shard, owner, name in rows:
            tips[shard] = max(tips[shard], key)
            per_shard[shard] = per_shard.get(shard, 0) + 1
            if not self.visible(owner) or key in self.watched:
                continue
            if len(self.from_all) >= MAX_ALL:
                skipped += 1
                continue
            # a client knows its plan by the id it submitted (name, when that is not the key), an admin by key
            self.watched[key] = Watched(key, plan_id if self.owner is None else name or plan_id, shard, 1)
            self.from_all.add(key)
        return any(n >= ALL_PER_RING for n in per_shard.values()), skipped

    def caught_up(self, stored: dict[int, Plan]) -> list[Any]:
        """The watched plans' events not sent yet (``stored``: each as read now, by key), each a message of its own.

        A plan that ended and was sent whole is followed no longer; one of the subscribe to all no
        longer stored (forgotten at retention, or damaged) neither.
        """
        out: list[Any] = []
        for key, w in list(self.watched.items()):
            plan = stored.get(key)
            if plan is None:
                if key in self.from_all:
                    self.from_all.discard(key)
                    del self.watched[key]
                continue
            out += catch_up(plan, w)
            if plan.state in TERMINAL_STATES and w.expected >= plan.next_seq:
                del self.watched[key]
                self.from_all.discard(key)
        return out


def catch_up(plan: Plan, w: Watched) -> list[Any]:
    """The events of ``plan`` from ``w.expected`` on, a ``resync`` for each run the rows never held, naming the
    plan as the session knows it (``w.plan_id``: its owner's name for it where that is not its key)."""
    out: list[Any] = []
    shown = w.plan_id
    by_key = shown == plan.id  # an admin's view, or a plan whose name is its key (the same view)
    for event in plan.events:
        if event.seq < w.expected:
            continue
        if event.seq > w.expected:
            out.append(Resync(plan_id=shown, first_seq=w.expected, last_seq=event.seq - 1, plan=plan.info(by_key)))
        out.append(event if by_key else msgspec.structs.replace(event, plan_id=shown))
        w.expected = event.seq + 1
    if plan.state in TERMINAL_STATES and w.expected < plan.next_seq:
        out.append(Resync(plan_id=shown, first_seq=w.expected, last_seq=plan.next_seq - 1, plan=plan.info(by_key)))
        w.expected = plan.next_seq
    # The inline events are re-read whole with the row; events rows from the last one's first seq.
    w.since = max((e.seq for e in plan.events), default=w.since)
    return out


def workers_summary(rows: list[WorkerInfo]) -> str:
    """``"N workers (C CPUs, G GPUs, R GB RAM)"`` over alive workers, as one core's ``list_workers`` says."""
    alive = [w for w in rows if w.alive]
    cpus = sum(w.capabilities.cpu_cores for w in alive)
    gpus = sum(len(w.capabilities.gpus) for w in alive)
    ram_gb = sum(w.capabilities.ram_bytes for w in alive) / 1e9
    return f"{len(alive)} workers ({cpus} CPUs, {gpus} GPUs, {ram_gb:.1f} GB RAM)"
