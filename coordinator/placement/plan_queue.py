"""The plan queue: queued plans grouped by what they need from a worker.

Placement must not scan every queued plan against every worker (docs/SEMANTICS.md §Placement).
Plans that need the same thing share a :class:`Signature`: op, sorted tags, accelerator,
model, minimum GPU memory, python env, the devices it holds (coordinator/devices.py), plus the
workers the plan avoids after they rejected it. Whether a worker can run a plan depends only
on the signature, so a worker with room is matched against the few signatures, not the many plans.

Each signature holds a heap ordered by ``(-priority, submit order)``: higher priority
first, then older first. Deletion is lazy: :meth:`PlanQueue.discard` forgets the plan and
its heap entry is skipped when it surfaces. Each push carries a fresh token so a plan
pushed again (requeued) never revives its old entry.

:func:`explain_wait` turns a signature and the alive workers into the reason a person
can act on, shown in the plan's ``waiting`` events. A signature with devices (``gpus``) is met by
workers that have that many matching devices at all; whether enough are *free* is placement's
check (:meth:`~coordinator.placement.placer.Placement.fits`), and :func:`explain_wait` names the
largest free count when that is what is missing. Reasons know pools (docs/CLUSTER.md §Pools): a
worker started with ``--pool NAME`` carries the tag ``pool:NAME``, so a plan that requires tag
``cpu`` of workers that carry ``pool:cpu`` is told to use ``--pool cpu``; in cluster mode a
core sees only the workers of its shard's pools, so there "no worker" names the plan's pool
instead of claiming that none is connected.

The queue owns its groups and its index of live entries: a plan id is queued exactly when
it maps to its (signature, token) entry, and at most one entry per plan is live.

Groups are also indexed by op (issue 17 finding 5): a worker can run only signatures of its ops,
and why a plan waits depends only on the workers that handle its op, so a worker's connect or
disconnect looks at the groups of that worker's ops (:meth:`PlanQueue.signatures` with ``ops``),
plus the groups whose reason is not known yet (``unexplained=True``), not at every
group. A client that queues thousands of plans with distinct tag lists under an op no worker
serves then costs a worker (dis)connect nothing; the groups with avoided workers are indexed
too, for :meth:`PlanQueue.forgive`.
"""

from __future__ import annotations

import functools
import heapq
import itertools
from collections.abc import Callable, Collection, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, Final, NamedTuple, Protocol, cast

from coordinator.devices import GpuNeed, largest_free, matching
from coordinator.shards import POOL_TAG, pool_of
from coordinator.workers import WorkerRecord
from protocol.messages import Accelerator, Requirements

__all__ = ["GroupOrder", "PlanQueue", "Signature", "explain_wait"]


class GroupOrder(Protocol):
    """An order of each group's plans other than (priority, age): fair share's
    (coordinator/placement/fair_queue.py ``FairOrder``). It holds the groups' plans; the queue keeps
    the groups, their indexes and which plans are queued, and asks it who heads each group."""

    def push(self, plan_id: str, signature: Signature, token: int, priority: int, order: int, owner: str) -> bool:
        """A plan joins a group; True if the group had no plan."""

    def discard(self, plan_id: str) -> bool:
        """A plan left the queue."""

    def head(self, signature: Signature) -> tuple[Any, ...] | None:
        """The group's first plan as a tuple that orders heads across groups, the plan id last."""

    def first(self, signature: Signature) -> str | None:
        """The group's first plan if it may be placed now (:meth:`head` without what orders it against others)."""

    def holds(self, signature: Signature) -> bool:
        """Whether the group has a plan."""

    def offered(self, head: tuple[Any, ...]) -> bool:
        """Whether a head may be placed now."""

    def drop(self, signature: Signature) -> None:
        """The queue dropped the group."""

    def has_ahead(self, signature: Signature, priority: int, order: int, owner: str) -> bool:
        """Whether the group holds a plan before a newcomer of ``owner``, ``priority`` and ``order``."""

    def entries(self, signature: Signature) -> list[tuple[str, int, int, str]]:
        """The group's plans as (id, priority, order, owner), by priority then age."""

    def plans_in(self, signature: Signature) -> list[str]:
        """The group's plans in this order."""

    def sleeps(self) -> bool:
        """Whether the queue may leave one owner's plans in (priority, age) order without it (:class:`PlanQueue`)."""

    def waits(self, owner: str, delta: int) -> None:
        """The owner's plans began (``delta`` 1) or ceased (-1) to wait while the queue kept them without it."""

    def adopt(self, owner: str, entries: list[tuple[str, Signature, int, int, int]]) -> None:
        """Take the plans the queue kept without it: (id, group, token, priority, order), all of ``owner``, who
        waits already (it was told by :meth:`waits`)."""

    def reset(self) -> None:
        """The queue is empty and keeps its plans without the order again: forget every group."""


_new_tuple: Final = cast("Callable[[type[Signature], tuple[Any, ...]], Signature]", tuple.__new__)
"""``tuple.__new__``: a :class:`Signature` made from its fields in order, without its Python ``__new__``."""


class Signature(NamedTuple):
    """What a worker must have to run any plan of a group."""

    op: str
    tags: tuple[str, ...] = ()
    accelerator: Accelerator | None = None
    model: str | None = None
    min_gpu_memory_bytes: int = 0
    python_env: str | None = None
    avoid: tuple[str, ...] = ()
    gpus: GpuNeed | None = None

    @classmethod
    def of(
        cls, op: str, requirements: Requirements, avoid: Iterable[str] = (), gpus: GpuNeed | None = None
    ) -> Signature:
        """The signature of a plan with this op, requirements, avoided workers and device need."""
        tags = requirements.tags
        # tuple.__new__ with the fields in their order: this runs at every enqueue, and the NamedTuple's own
        # __new__ is a Python function (interpreted even in the compiled core: ~2,800 instructions a call).
        return _new_tuple(cls, (
            op,
            # The usual plan asks for no tag, or (cluster mode) its pool's one: nothing to sort.
            ((tags[0],) if len(tags) == 1 else tuple(sorted(set(tags)))) if tags else (),
            requirements.accelerator,
            requirements.model,
            requirements.min_gpu_memory_bytes,
            requirements.python_env,
            tuple(sorted(set(avoid))) if avoid else (),  # the usual plan avoids nobody
            gpus,
        ))

    def avoiding(self, avoid: Iterable[str]) -> Signature:
        """This signature with ``avoid`` as the workers it avoids (sorted, without repeats)."""
        return Signature(
            op=self.op,
            tags=self.tags,
            accelerator=self.accelerator,
            model=self.model,
            min_gpu_memory_bytes=self.min_gpu_memory_bytes,
            python_env=self.python_env,
            avoid=tuple(sorted(set(avoid))),
            gpus=self.gpus,
        )

    def meets(self, worker: WorkerRecord) -> bool:
        """Whether the worker has everything asked for (ignoring avoidance and capacity)."""
        for check in _compiled(self):
            if not check(worker):
                return False
        return True

    def admits(self, worker: WorkerRecord) -> bool:
        """Whether a plan of this signature may be placed on the worker, capacity aside."""
        return worker.id not in self.avoid and self.meets(worker)

    def _checks(self) -> Iterator[tuple[str, Callable[[WorkerRecord], bool]]]:
        """Each requirement as (how a person names it, the test), in the order reasons report them."""
        op = self.op
        yield f"op {op!r}", lambda w: op in w.capabilities.ops
        if self.tags:
            tags = self.tags
            if len(tags) == 1:  # a pool's tag (cluster mode): one look in the worker's list, no set made
                tag = tags[0]
                yield f"tags [{tag}]", lambda w: tag in w.capabilities.tags
            else:
                yield f"tags [{_tag_list(tags)}]", lambda w: w.has_tags(tags)
        if self.accelerator is not None:
            acc = self.accelerator
            # A mixed host has several accelerator kinds, so it can serve any single one.
            yield f"accelerator {acc!r}", lambda w: w.capabilities.accelerator in (acc, "mixed")
        if self.model is not None:
            model = self.model
            yield f"model {model!r}", lambda w: model in w.capabilities.models
        if self.min_gpu_memory_bytes > 0:
            need = self.min_gpu_memory_bytes
            yield (
                f"a GPU with at least {need / 1e9:.1f} GB of memory",
                lambda w: any(g.memory_bytes >= need for g in w.capabilities.gpus),
            )
        if self.python_env is not None:
            env = self.python_env
            yield f"python env {env!r}", lambda w: env in w.capabilities.python_envs
        if self.gpus is not None:
            gpus = self.gpus
            yield GPU_CHECK + gpus.describe(free=False), lambda w: len(matching(gpus, w.capabilities)) >= gpus.count


@functools.lru_cache(maxsize=4096)
def _compiled(signature: Signature) -> tuple[Callable[[WorkerRecord], bool], ...]:
    """The tests of a signature, built once: placement runs them for every candidate worker."""
    return tuple(check for _, check in signature._checks())


def explain_wait(signature: Signature, alive: Iterable[WorkerRecord], *, cluster: bool = False) -> str:
    """Why a plan of ``signature`` cannot be placed on any of the ``alive`` workers.

    The requirements are applied one by one; the first that leaves no worker is the
    reason, phrased with the ones that did match so the person knows what to change.
    ``cluster``: the workers are those of one shard's pools (cluster mode), not all of them.
    """
    pool = list(alive)
    matched: list[str] = []
    for name, check in signature._checks():
        before, pool = pool, [w for w in pool if check(w)]
        if not pool:
            if name.startswith(GPU_CHECK) and signature.gpus is not None:
                return _too_many_gpus(signature.gpus, before)
            if not matched:
                if cluster:
                    return _no_worker_of_pool(signature.tags, name)
                return f"no connected worker handles {name}"
            reason = f"no worker {_describe(matched)} has {name}"
            if name.startswith(TAGS_CHECK):
                reason += _pool_hint(signature.tags, before)
            return reason
        matched.append(name)
    avoided = sorted(w.id for w in pool if w.id in signature.avoid)
    pool = [w for w in pool if w.id not in signature.avoid]
    if not pool:
        return f"every matching worker rejected it ({', '.join(avoided)})"
    if all(w.draining for w in pool):
        if len(pool) == 1:
            return f"the only matching worker ({pool[0].id}) is draining"
        return f"all {len(pool)} matching workers are draining"
    if all(not w.has_capacity() for w in pool):
        if len(pool) == 1:
            return f"the only matching worker ({pool[0].id}) is at capacity"
        # No count: it would change with every registration and re-send `waiting` to every queued plan.
        return "all matching workers are at capacity"
    need = signature.gpus
    if need is not None:
        room = [w for w in pool if w.has_capacity() and not w.draining]
        free, where = largest_free(need, [(w.id, w.capabilities, w.gpu_use) for w in room])
        if free < need.count:
            return f"needs {need.describe()}; largest free: {free} on {where}"
    return "waiting for placement"


GPU_CHECK = "devices: "  # how the GPU requirement's name starts (explain_wait words its reason itself)
TAGS_CHECK = "tags ["  # how the tags requirement's name starts (explain_wait adds pool hints to it)


def _no_worker_of_pool(tags: tuple[str, ...], need: str) -> str:
    """Cluster mode, no worker of the plan's shard meets ``need`` (its op): name the pool the plan went to.

    A core sees only its shard's workers, so "no connected worker" would be false while other
    pools' workers are connected. A signature's tags are sorted: the pool is its ``pool:NAME``
    tag's, or its only tag's; of several plain tags the first named it when the plan was routed.
    """
    if not tags:
        return (f"no worker of the default pool (workers with no tags) handles {need}: a plan with no tags waits "
                "for one; to run on the workers of pool NAME submit it with --pool NAME")
    if not any(t.startswith(POOL_TAG) for t in tags) and len(tags) > 1:
        return (f"no worker of the pool named by the plan's first tag (tags [{_tag_list(tags)}]) handles {need}: "
                "workers join pool NAME with `fleetwire worker --pool NAME`, plans with `fleetwire submit --pool NAME`")
    pool = pool_of(tags)
    return f"no worker of pool {pool!r} handles {need}: workers join it with `fleetwire worker --pool {pool}`"


def _pool_hint(tags: tuple[str, ...], workers: list[WorkerRecord]) -> str:
    """When tags and pools are mixed up: the required tag ``cpu`` where workers carry ``pool:cpu``, or back.

    Names no worker and counts none: the reason must not change with every registration.
    """
    for tag in tags:
        if tag.startswith(POOL_TAG):
            name = tag[len(POOL_TAG):]
            if name and name not in tags and any(w.has_tags((name,)) for w in workers):
                return (f"; workers tagged {name!r} are not in pool {name!r} (that is the tag pool:{name}, "
                        f"from `fleetwire worker --pool {name}`): to run on them require --tags {name}")
        elif any(w.has_tags((POOL_TAG + tag,)) for w in workers):
            return (f"; workers of pool {tag!r} carry the tag pool:{tag}, not {tag!r}: "
                    f"submit with --pool {tag} (the tag pool:{tag})")
    return ""


def _too_many_gpus(need: GpuNeed, pool: list[WorkerRecord]) -> str:
    """Why no worker can ever hold the plan's devices: it asks more than the largest worker has."""
    what = need.describe(free=False)
    if need.shared and not any(w.capabilities.gpu_share > 1 for w in pool):
        return f"needs {what}, and no matching worker shares its GPUs (start one with --gpu-share K)"
    best = max(pool, key=lambda w: (len(matching(need, w.capabilities)), w.id), default=None)
    if best is None:
        return f"needs {what}, and no matching worker has one"
    return f"needs {what}; the largest matching worker is {best.id} with {len(matching(need, best.capabilities))}"


REASON_TAGS = 4  # a waiting reason names this many tags, then "and N more" (issue 17 finding 5)


def _tag_list(tags: tuple[str, ...]) -> str:
    """The tags for a waiting reason: the first few, and how many more (a reason stays short)."""
    if len(tags) <= REASON_TAGS:
        return ", ".join(tags)
    return ", ".join(tags[:REASON_TAGS]) + f", and {len(tags) - REASON_TAGS} more"


def _describe(matched: list[str]) -> str:
    """``handling op 'x' with tags [a] and model 'm'`` from the names of met requirements."""
    head, *rest = matched
    text = f"handling {head}"
    if rest:
        text += " with " + " and ".join(rest)
    return text


@dataclass
class _Group:
    """One signature's heap of ``(-priority, order, token, plan_id)``.

    While its plans come in order (``ordered``: each pushed after every entry it holds, as one priority's plans in
    submit order do) the list is sorted, and its front is ``heap[start]``: a dead entry there is stepped over, not
    popped (a ``heappop`` walks the heap's depth, over entries scattered through a large heap, once a plan). The
    entries before ``start`` are dead, as are some after it: every reader of ``heap`` but :meth:`PlanQueue._head`
    checks each entry's liveness.
    """

    heap: list[tuple[int, int, int, str]] = field(default_factory=list)
    start: int = 0  # ordered: the index of its first entry not known dead
    ordered: bool = True
    reason: str | None = None  # the waiting reason last given to its plans
    born: int = 0  # creation order: a selection of groups is visited in the order of the whole


TAG_INDEX_MIN = 64  # groups of one op past which best_for looks them up by the worker's tags


def _born(pair: tuple[Signature, _Group]) -> int:
    return pair[1].born


class PlanQueue:
    """Queued plans, grouped by signature, each group in (priority, age) order, or in ``order``'s.

    While every queued plan has one owner (and the order :meth:`GroupOrder.sleeps`), the order is that
    owner's priority-then-age order: the queue keeps the plans in its own heaps and ``order`` is None
    (the owner is :attr:`solo`). A plan of another owner hands them to the order (:meth:`GroupOrder.adopt`),
    which keeps them until the queue is empty again.

    Args:
        order: the fair-share order of each group (coordinator/placement/fair_queue.py), which then
            holds the groups' plans; None: priority, then age.
    """

    def __init__(self, order: GroupOrder | None = None) -> None:
        self.order: GroupOrder | None = None  # the order in use now (None: priority, then age)
        self._kept = order  # the order given, in use or not
        self.solo: str | None = None
        """The owner of every queued plan while the order is not in use and a plan is queued."""
        self._groups: dict[Signature, _Group] = {}
        self._live: dict[str, tuple[Signature, int]] = {}  # plan_id -> (its group, live token)
        self._tokens = itertools.count(1)
        self._by_op: dict[str, dict[Signature, _Group]] = {}  # op -> its groups
        self._unexplained: dict[Signature, _Group] = {}  # groups whose reason is None
        self._avoiding: dict[Signature, _Group] = {}  # groups that avoid some worker
        # (op, first tag or ""): its groups. A worker without a group's first tag cannot run it (best_for).
        self._by_tag: dict[tuple[str, str], dict[Signature, _Group]] = {}

    def __contains__(self, plan_id: object) -> bool:
        return plan_id in self._live

    def __len__(self) -> int:
        return len(self._live)

    def push(self, plan_id: str, signature: Signature, priority: int, order: int, owner: str = "") -> bool:
        """Queue a plan of ``owner`` (again). A plan already queued is moved to the new position.

        Returns:
            True if the plan is its group's only one (the group is new, or was empty).
        """
        token = next(self._tokens)
        self._live[plan_id] = (signature, token)
        group, new = self._group_for(signature, token)
        fair = self.order
        if fair is not None:
            return fair.push(plan_id, signature, token, priority, order, owner) or new
        kept = self._kept
        if kept is not None:
            if owner != self.solo:
                if self.solo is None and len(self._live) == 1 and kept.sleeps():  # the empty queue's first plan
                    self.solo = owner
                    kept.waits(owner, 1)
                else:  # another owner's plan: the order takes the queue's plans, and this one
                    self._wake()
                    return kept.push(plan_id, signature, token, priority, order, owner) or new
            if not new and self._head(signature, group) is None:  # as the order says: a group with no live plan
                new = True
        entry, heap = (-priority, order, token, plan_id), group.heap
        if group.ordered:
            if group.start == len(heap):  # every entry dead: start the list again
                heap.clear()
                group.start = 0
            if not heap or heap[-1] < entry:  # still in order: heappush would put it last too
                heap.append(entry)
                return new
            del heap[: group.start]  # out of order: a heap from now on (a sorted list is one)
            group.start, group.ordered = 0, False
        heapq.heappush(heap, entry)
        return new

    def _wake(self) -> None:
        """Hand the plans kept in (priority, age) order to the order, which is in use from now on."""
        kept = self._kept
        assert kept is not None
        solo, live = self.solo, self._live
        if solo is not None:
            entries = [(plan_id, signature, token, -neg_priority, order)
                       for signature, group in self._groups.items()
                       for neg_priority, order, token, plan_id in group.heap if live.get(plan_id) == (signature, token)]
            for group in self._groups.values():
                group.heap.clear()
                group.start, group.ordered = 0, True
            kept.adopt(solo, entries)
        self.solo = None
        self.order = kept

    def _group_for(self, signature: Signature, token: int) -> tuple[_Group, bool]:
        """The signature's group, made (and indexed) if it has none; whether it was made."""
        group = self._groups.get(signature)
        if group is not None:
            return group, False
        group = self._groups[signature] = _Group(born=token)
        self._by_op.setdefault(signature.op, {})[signature] = group
        self._by_tag.setdefault((signature.op, signature.tags[0] if signature.tags else ""), {})[signature] = group
        self._unexplained[signature] = group
        if signature.avoid:
            self._avoiding[signature] = group
        return group, True

    def discard(self, plan_id: str) -> bool:
        """Take a plan out of the queue; its heap entry is dropped when it surfaces.

        Returns:
            True if it was queued.
        """
        if self._live.pop(plan_id, None) is None:
            return False
        if self.order is not None:
            self.order.discard(plan_id)
            if not self._live and self.order.sleeps():  # empty: one owner's plans need no order again
                self.order.reset()
                self.order = None
        elif self.solo is not None and not self._live:
            assert self._kept is not None
            self._kept.waits(self.solo, -1)
            self.solo = None
        return True

    def wake(self) -> None:
        """Have the order take the queued plans and keep them from now on (until the queue is empty)."""
        if self.order is None and self._kept is not None:
            self._wake()

    def signature_of(self, plan_id: str) -> Signature | None:
        """The group of a queued plan, None if it is not queued."""
        entry = self._live.get(plan_id)
        return None if entry is None else entry[0]

    def _head(self, signature: Signature, group: _Group) -> tuple[Any, ...] | None:
        """The live head of a group, popping dead entries off the top: a tuple that orders heads
        across groups (smaller first), the plan id last; None when the group has no live plan."""
        if self.order is not None:
            return self.order.head(signature)
        heap, live = group.heap, self._live
        if group.ordered:  # sorted: the dead entries at its front are stepped over (_Group)
            start, end = group.start, len(heap)
            while start < end:
                entry = heap[start]
                if live.get(entry[3]) == (signature, entry[2]):
                    if start > 64 and 2 * start > end:  # the dead front is most of the list: let it go
                        del heap[:start]
                        start = 0
                    group.start = start
                    return entry
                start += 1
            heap.clear()
            group.start = 0
            return None
        while heap:
            entry = heap[0]
            if live.get(entry[3]) == (signature, entry[2]):
                return entry
            heapq.heappop(heap)
        group.ordered = True  # empty: in order again until a push says otherwise
        return None

    def signatures(self, ops: Iterable[str] | None = None, *, unexplained: bool = False) -> list[Signature]:
        """Signatures that still have queued plans, in creation order; empty groups are dropped on the way.

        ``ops``: only those of these ops, and (``unexplained``) those whose group has no waiting
        reason recorded yet. None: every signature.
        """
        return [sig for sig, _ in self._pairs(ops, unexplained)]

    def iter_signatures(self, ops: Iterable[str] | None = None, *, unexplained: bool = False) -> Iterator[Signature]:
        """:meth:`signatures`, lazily: a caller that stops early (a work budget) pays for what it took,
        not for sorting every group. Groups dropped or re-created meanwhile are skipped."""
        groups = self._groups
        if ops is None:
            sources = [groups]
        else:
            by_op = self._by_op
            sources = [of_op for op in dict.fromkeys(ops) if (of_op := by_op.get(op))]
        if unexplained and self._unexplained:
            sources.append(dict(sorted(self._unexplained.items(), key=_born)))  # marked in any order
        if not sources:
            return
        pairs: Iterable[tuple[Signature, _Group]] = (
            list(sources[0].items()) if len(sources) == 1
            else heapq.merge(*(list(source.items()) for source in sources), key=_born)
        )
        last = -1
        for signature, group in pairs:
            if group.born == last or groups.get(signature) is not group:
                continue  # met twice (its op's and the unexplained), or gone since
            last = group.born
            if not self._dropped(signature, group):
                yield signature

    def _pairs(self, ops: Iterable[str] | None, unexplained: bool = False) -> list[tuple[Signature, _Group]]:
        """:meth:`signatures` with their groups."""
        by_op = self._by_op
        if ops is None or (len(by_op) == 1 and not unexplained and next(iter(by_op)) in ops):
            candidates: list[tuple[Signature, _Group]] = list(self._groups.items())  # every group qualifies
        else:
            found = [of_op for op in ops if (of_op := by_op.get(op))]
            if unexplained and self._unexplained:
                found.append(self._unexplained)
            if not found:
                return []
            if len(found) == 1 and found[0] is not self._unexplained:
                candidates = list(found[0].items())  # one op's groups: already in creation order
            else:
                picked = {sig: group for of_op in found for sig, group in of_op.items()}
                candidates = sorted(picked.items(), key=_born)
        held = self._holds
        return [(sig, group) for sig, group in candidates if held(sig, group) or self._drop(sig)]

    def _tagged_pairs(self, ops: Iterable[str], tags: Collection[str]) -> list[tuple[Signature, _Group]]:
        """:meth:`_pairs` of ``ops`` that a worker with ``tags`` may admit, by the first-tag index of large ops."""
        by_op, by_tag = self._by_op, self._by_tag
        found: list[dict[Signature, _Group]] = []
        for op in ops:
            of_op = by_op.get(op)
            if not of_op:
                continue
            if len(of_op) <= TAG_INDEX_MIN:
                found.append(of_op)
                continue
            found.extend(of_tag for tag in ("", *tags) if (of_tag := by_tag.get((op, tag))))
        if not found:
            return []
        if len(found) == 1:
            candidates = list(found[0].items())
        else:
            picked = {sig: group for of in found for sig, group in of.items()}
            candidates = sorted(picked.items(), key=_born)
        held = self._holds
        return [(sig, group) for sig, group in candidates if held(sig, group) or self._drop(sig)]

    def _dropped(self, signature: Signature, group: _Group) -> bool:
        """Drop the group if it has no live plan left; whether it was dropped."""
        return not self._holds(signature, group) and not self._drop(signature)

    def _holds(self, signature: Signature, group: _Group) -> bool:
        """Whether the group has a live plan (its dead entries on top are dropped on the way)."""
        if self.order is not None:
            return self.order.holds(signature)
        return self._head(signature, group) is not None

    def _drop(self, signature: Signature) -> bool:
        """Forget an empty group; returns False (so a filter drops it too)."""
        del self._groups[signature]
        of_op = self._by_op[signature.op]
        del of_op[signature]
        if not of_op:
            del self._by_op[signature.op]
        key = (signature.op, signature.tags[0] if signature.tags else "")
        of_tag = self._by_tag[key]
        del of_tag[signature]
        if not of_tag:
            del self._by_tag[key]
        self._unexplained.pop(signature, None)
        self._avoiding.pop(signature, None)
        if self.order is not None:
            self.order.drop(signature)
        return False

    def best_for(
        self, admits: Callable[[Signature], bool], fits: Callable[[str], bool] | None = None,
        ops: Iterable[str] | None = None, tags: Collection[str] | None = None,
    ) -> str | None:
        """The best queued plan among the signatures ``admits`` accepts (it is not removed).

        ``fits`` (a plan id) vets each group's head, e.g. whether its KV blocks fit: a head
        that does not fit holds its group back (first come, first served within a group,
        as vLLM's scheduler does), so a later, smaller plan never overtakes it. ``ops``: only
        signatures of these ops are looked at (those ``admits`` can accept, e.g. a worker's ops);
        with ``tags`` (the worker's), an op of more than :data:`TAG_INDEX_MIN` groups offers only
        its groups without tags or whose first tag is one of ``tags`` (the others need a tag the
        worker lacks). Cost is one ``admits`` call per signature looked at, whatever the number of plans.
        """
        best: tuple[Any, ...] | None = None
        pairs = self._pairs(ops) if tags is None or ops is None else self._tagged_pairs(ops, tags)
        order = self.order
        if order is not None and len(pairs) == 1:  # one group: nothing to order its head against
            signature = pairs[0][0]
            first = order.first(signature) if admits(signature) else None
            return first if first is not None and (fits is None or fits(first)) else None
        for signature, group in pairs:
            if not admits(signature):
                continue
            head = self._head(signature, group)
            if head is None or (best is not None and head >= best) or not self._offered(head):
                continue
            if fits is None or fits(head[-1]):
                best = head
        return None if best is None else best[-1]

    def _offered(self, head: tuple[Any, ...]) -> bool:
        """Whether a group's head may be placed now (the fair order holds back a team past a hard quota)."""
        return self.order is None or self.order.offered(head)

    def has_ahead(self, signature: Signature, priority: int, order: int, owner: str = "") -> bool:
        """Whether the group holds a plan that comes before one of ``owner``, ``priority`` and ``order``."""
        if self.order is None and self.solo is not None and owner != self.solo:
            self._wake()  # another owner's plan is compared by the order's keys
        if self.order is not None:
            return signature in self._groups and self.order.has_ahead(signature, priority, order, owner)
        group = self._groups.get(signature)
        head = None if group is None else self._head(signature, group)
        return head is not None and (head[0], head[1]) < (-priority, order)

    def counts(self) -> dict[Signature, int]:
        """How many plans each signature holds (for the autoscaler; one pass over the queue)."""
        counts: dict[Signature, int] = {}
        for signature, _ in self._live.values():
            counts[signature] = counts.get(signature, 0) + 1
        return counts

    def forgive(self, worker_id: str) -> list[str]:
        """Move the plans that avoid ``worker_id`` to the groups without that avoidance.

        Returns:
            The ids of the plans moved; their priority and age are kept.
        """
        moved: list[str] = []
        for signature, group in sorted(self._avoiding.items(), key=_born):
            if worker_id not in signature.avoid or self._dropped(signature, group):
                continue
            kept = signature.avoiding(w for w in signature.avoid if w != worker_id)
            if self.order is not None:
                for plan_id, priority, order, owner in self.order.entries(signature):
                    self.push(plan_id, kept, priority, order, owner)
                    moved.append(plan_id)
                continue
            for neg_priority, order, token, plan_id in sorted(group.heap):
                if self._live.get(plan_id) == (signature, token):
                    self.push(plan_id, kept, -neg_priority, order, self.solo or "")  # (every plan is the solo's)
                    moved.append(plan_id)
        return moved

    def plans_in(self, signature: Signature) -> list[str]:
        """The queued plans of one signature, in queue order (the fair order's: as its keys stand now)."""
        if self.order is not None:
            return self.order.plans_in(signature)
        group = self._groups.get(signature)
        if group is None:
            return []
        live = [e for e in group.heap if self._live.get(e[3]) == (signature, e[2])]
        return [e[3] for e in sorted(live)]

    def group_reason(self, signature: Signature) -> str | None:
        """The waiting reason last recorded for a signature's plans."""
        group = self._groups.get(signature)
        return None if group is None else group.reason

    def set_group_reason(self, signature: Signature, reason: str | None) -> None:
        """Record the waiting reason given to a signature's plans."""
        group = self._groups.get(signature)
        if group is not None:
            group.reason = reason
            if reason is None:
                self._unexplained[signature] = group
            else:
                self._unexplained.pop(signature, None)
