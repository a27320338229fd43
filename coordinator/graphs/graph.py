"""The plan graph: edges both ways, refusals at submit, readiness, failure propagation, rebuilds.

What it owns: each plan's needs (coordinator/graphs/needs.py) and the reverse index (an upstream's
dependants), the plans it holds back until their needs are met (*held*), and the lineage
(coordinator/graphs/lineage.py). It reads the plans' states from the core's table and changes none:
every method answers with what the core should do (:class:`Verdicts`).

Rules (docs/SEMANTICS.md §Graphs):

* *Refusals at submit.* An upstream must be a plan of the same principal that the coordinator
  holds; a reference to an output a succeeded upstream did not make, a plan already in the graph,
  or an edge that would close a cycle is refused, naming what is wrong (:meth:`PlanGraph.refusal`).
* *Readiness.* A plan is ready when every upstream succeeded and every output it takes exists
  somewhere (the producer's worker, or a rebuild's). Until then it is held, and its waiting reason
  names the first need not met: ``plan a1b2 has not produced 'y' yet``.
* *Failure at once.* When a plan ends without succeeding, every unfinished plan that needs it,
  and every unfinished plan that needs those, fails ``upstream_failed`` naming its own upstream
  (``detail.root``: the plan whose end started it). A consumer waiting on an output whose rebuild
  failed, or which cannot be rebuilt, fails ``output_lost`` (and its own dependants
  ``upstream_failed``).
* *Lineage.* A held consumer whose output is lost gets it rebuilt when the lineage allows
  (:meth:`Lineage.why_not`): the graph decides the rebuild's key and needs (the producer's), the core
  makes the plan. A succeeded producer is never run again unless outputs it made are lost and a
  plan still waiting needs one, or a client fetching one finds it lost (:meth:`PlanGraph.wanted`);
  a rebuild under way is never doubled.
* *Dependants.* :meth:`PlanGraph.dependants` lists the unfinished plans that need a plan, directly
  or not, upstream first (``cancel --with-dependants``); :meth:`PlanGraph.pinned` says whether
  retention must keep a finished plan because an unfinished one still needs it.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from coordinator.graphs.lineage import DEFAULT_MAX_REBUILDS, Lineage, Lookup, Source
from coordinator.graphs.needs import MAX_NEEDS, Need, PlanView
from protocol import errors
from protocol.messages import ErrorInfo

__all__ = ["Doom", "PlanGraph", "Rebuild", "Verdicts", "Wait"]


@dataclass(frozen=True, slots=True)
class Wait:
    """Why a held plan waits: ``need`` is not met, ``why`` says how; ``rebuild``: the rebuild under way."""

    need: Need
    why: Literal["unfinished", "rebuilding"]
    rebuild: str = ""

    def reason(self, name_of: Callable[[str], str]) -> str:
        """The waiting reason, naming plans as ``name_of`` shows them (their owner's ids)."""
        upstream = name_of(self.need.upstream)
        if self.why == "rebuilding":
            return (f"plan {upstream}'s output {self.need.output!r} was lost; plan {name_of(self.rebuild)} "
                    "is making it again")
        if self.need.data:
            return f"plan {upstream} has not produced {self.need.output!r} yet"
        return f"plan {upstream} has not succeeded yet"


@dataclass(frozen=True, slots=True)
class Doom:
    """A plan that must fail now: ``code`` is ``upstream_failed`` or ``output_lost``."""

    plan_id: str
    code: str
    message: str
    upstream: str  # the key of the plan it needs whose end (or lost output) dooms it
    root: str  # the key of the plan whose end started this, or whose output is lost

    def error(self, name_of: Callable[[str], str] = str) -> ErrorInfo:
        """The plan's ``error``; ``detail`` names the upstream and the root as ``name_of`` shows them."""
        detail: dict[str, Any] = {"upstream": name_of(self.upstream), "root": name_of(self.root)}
        return ErrorInfo(self.code, self.message, detail)


@dataclass(frozen=True, slots=True)
class Rebuild:
    """Make plan ``key``: producer ``origin``'s spec again, its outputs ``outputs`` having been lost."""

    origin: str
    key: str
    outputs: tuple[str, ...]


@dataclass
class Verdicts:
    """What the core does after a graph call, in this order: make the ``rebuilds`` (every one: the graph
    counts on it; then :meth:`PlanGraph.admit` each), fail the ``doomed`` (in order), take the ``held``
    plans out of the placement queue (their waiting reason: :meth:`PlanGraph.reason`), queue the ``ready``."""

    ready: list[str] = field(default_factory=list)
    doomed: list[Doom] = field(default_factory=list)
    rebuilds: list[Rebuild] = field(default_factory=list)
    held: list[str] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.ready or self.doomed or self.rebuilds or self.held)

    def extend(self, other: Verdicts) -> None:
        """Add ``other``'s verdicts after these."""
        self.ready += other.ready
        self.doomed += other.doomed
        self.rebuilds += other.rebuilds
        self.held += other.held


class PlanGraph:
    """The graph of needs between plans (module docstring).

    Args:
        plans: the core's plans by key (read only; the graph reads states, outputs and workers).
        name_of: how a plan is named in reasons and errors (its owner's id for it; default: its key).
        max_rebuilds: rebuilds one producer may have (coordinator/graphs/lineage.py).
    """

    def __init__(
        self, plans: Mapping[str, PlanView], *, name_of: Callable[[str], str] | None = None,
        max_rebuilds: int = DEFAULT_MAX_REBUILDS,
    ) -> None:
        self._plans = plans
        self.name_of: Callable[[str], str] = name_of or str
        self.lineage = Lineage(plans, max_rebuilds)
        self.needs: dict[str, tuple[Need, ...]] = {}
        """Plan key -> its needs (only plans that have some)."""
        self.dependants: dict[str, set[str]] = {}
        """Upstream key -> the keys of the plans that need it directly."""
        self.held: set[str] = set()
        """Plans kept out of the placement queue until their needs are met."""
        self._blocked: dict[str, int] = {}  # held plan -> the index of the need that holds it (admit)

    def __len__(self) -> int:
        return len(self.needs)

    def __contains__(self, plan_id: object) -> bool:
        return plan_id in self.needs

    # ------------------------------------------------------------------ submit

    def refusal(self, plan_id: str, owner: str, needs: Sequence[Need]) -> str | None:
        """Why a plan of ``owner`` with key ``plan_id`` may not have ``needs``, or None (module doc, rules)."""
        if len(needs) > MAX_NEEDS + MAX_NEEDS:
            return f"a plan may name at most {MAX_NEEDS} plans in after, and reference at most {MAX_NEEDS} outputs"
        if plan_id in self.needs:
            return f"plan {self.name_of(plan_id)} is in the graph already"
        for need in needs:
            where = f"input {need.input!r} refers to" if need.data else "after names"
            upstream = self._plans.get(need.upstream)
            if upstream is None or need.upstream == plan_id:
                if need.upstream == plan_id:
                    return f"{where} the plan itself: a plan cannot need its own output"
                return f"{where} plan {need.upstream}, which this principal has not submitted (or it was forgotten)"
            if upstream.owner != owner:
                return (f"{where} plan {self.name_of(need.upstream)} of principal {upstream.owner!r}: a plan may use "
                        "only its own principal's plans")
            if need.data and upstream.state == "succeeded" and not _made(upstream, need.output):
                made = ", ".join(repr(spec.name) for spec in upstream.produced) or "none"
                return (f"{where} output {need.output!r} of plan {self.name_of(need.upstream)}, which succeeded "
                        f"without making it (its outputs: {made})")
            if self._reaches(need.upstream, plan_id):
                return f"{where} plan {self.name_of(need.upstream)}, which needs this plan: that would be a cycle"
        return None

    def add(self, plan_id: str, needs: Sequence[Need]) -> None:
        """Record ``plan_id``'s needs (refused ones first: :meth:`refusal`). No needs: nothing to record.

        Raises:
            ValueError: the plan has needs already, or an edge would close a cycle (a caller that
                skipped :meth:`refusal`); nothing is recorded.
        """
        if not needs:
            return
        if plan_id in self.needs:
            raise ValueError(f"plan {plan_id!r} is in the graph already")
        for need in needs:
            if need.upstream == plan_id or self._reaches(need.upstream, plan_id):
                raise ValueError(f"plan {plan_id!r} needing {need.upstream!r} would close a cycle")
        self.needs[plan_id] = tuple(needs)
        for need in needs:
            self.dependants.setdefault(need.upstream, set()).add(plan_id)

    def _reaches(self, start: str, target: str) -> bool:
        """Whether ``target`` is ``start`` or one of its upstreams, directly or not."""
        seen = {start}
        todo = [start]
        while todo:
            key = todo.pop()
            if key == target:
                return True
            for need in self.needs.get(key, ()):
                if need.upstream not in seen:
                    seen.add(need.upstream)
                    todo.append(need.upstream)
        return False

    # ------------------------------------------------------------------ readiness

    def admit(self, plan_id: str, *, resume: bool = False) -> Verdicts:
        """A plan with needs is about to be queued (submitted, restored, requeued): is it ready?

        Ready: in ``ready`` (no longer held). Waiting: held (:meth:`wait_of` says why). An upstream that
        failed: the plan and its dependants in ``doomed``. A lost output: a rebuild in ``rebuilds`` (the
        plan stays held), or ``output_lost`` in ``doomed`` when none can be made.

        ``resume``: start at the need that held it last time (the ones before it were met, and only a
        loss unmeets one: losses admit from the start). A fan-in of N plans then costs O(N), not O(N^2).
        """
        verdicts = Verdicts()
        needs = self.needs.get(plan_id, ())
        start = self._blocked.get(plan_id, 0) if resume else 0
        for index in range(start, len(needs)):
            need = needs[index]
            found = self.lineage.lookup(need)
            if found.kind == "found":
                continue
            if found.kind in ("unfinished", "rebuilding"):
                self.held.add(plan_id)
                self._blocked[plan_id] = index
                verdicts.held.append(plan_id)
                return verdicts
            if found.kind == "lost" and found.key in self._plans:
                self.held.add(plan_id)
                self._blocked[plan_id] = index
                lost = self._lost(found.key, (need.output,))
                if plan_id in self.held:  # not doomed: it waits for the rebuild
                    verdicts.held.append(plan_id)
                verdicts.extend(lost)
                return verdicts
            self._unhold(plan_id)
            # An upstream that failed: its fall dooms this plan; an output never made (or a forgotten
            # upstream): this plan is doomed by its own need, and its dependants fall with it.
            verdicts.doomed += self._fall(need.upstream if found.kind == "failed" else plan_id, set())
            return verdicts
        self._unhold(plan_id)
        verdicts.ready.append(plan_id)
        return verdicts

    def _unhold(self, plan_id: str) -> None:
        self.held.discard(plan_id)
        self._blocked.pop(plan_id, None)

    def wait_of(self, plan_id: str) -> Wait | None:
        """The first need of ``plan_id`` that keeps it waiting, or None (ready, doomed, or no needs)."""
        needs = self.needs.get(plan_id, ())
        for need in needs[self._blocked.get(plan_id, 0):]:  # those before the blocking one are met (admit)
            found = self.lineage.lookup(need)
            if found.kind == "unfinished":
                return Wait(need, "unfinished")
            if found.kind == "rebuilding":
                return Wait(need, "rebuilding", found.key)
            if found.kind != "found":
                return None
        return None

    def reason(self, plan_id: str) -> str | None:
        """The waiting reason of a held plan (:meth:`Wait.reason`), or None."""
        wait = self.wait_of(plan_id)
        return None if wait is None else wait.reason(self.name_of)

    def sources(self, plan_id: str) -> dict[str, Source] | None:
        """Where each of a ready plan's referenced inputs is, by input name; None if one is not found now."""
        found: dict[str, Source] = {}
        for need in self.needs.get(plan_id, ()):
            lookup = self.lineage.lookup(need)
            if lookup.kind != "found":
                return None
            if lookup.source is not None:
                found[need.input] = lookup.source
        return found

    # ------------------------------------------------------------------ ends and losses

    def ended(self, plan_id: str) -> Verdicts:
        """``plan_id`` reached a terminal state: its held dependants are admitted again, or fail with it."""
        plan = self._plans.get(plan_id)
        verdicts = Verdicts()
        if plan is None or not plan.terminal:
            return verdicts
        self._unhold(plan_id)  # a held plan that ended otherwise (cancelled) waits no more
        origin = self.lineage.origin_of(plan_id)
        if plan.state != "succeeded" and origin == plan_id:
            verdicts.doomed += self._fall(plan_id, set())
            return verdicts
        # Succeeded, or a rebuild that failed: each held dependant looks again (a failed rebuild's
        # consumers find their output lost and not rebuildable: output_lost).
        waiting = {plan_id, origin}
        keys = sorted(self.dependants.get(plan_id, set()) | self.dependants.get(origin, set()))
        # Only a held plan blocked on this one looks again (from where it was blocked): a fan-in's
        # plan is not rescanned at each of its upstreams' ends.
        blocked = self._blocked
        return self._admit_all(
            (key for key in keys if key in self.held and self.needs[key][blocked.get(key, 0)].upstream in waiting),
            resume=True,
        )

    def _admit_all(self, keys: Iterable[str], verdicts: Verdicts | None = None, *, resume: bool = False) -> Verdicts:
        """:meth:`admit` each of ``keys`` but those already doomed in ``verdicts`` (one loss dooms every
        consumer waiting on it: the next one admitted must not be doomed twice)."""
        verdicts = verdicts if verdicts is not None else Verdicts()
        doomed = {doom.plan_id for doom in verdicts.doomed}
        for key in keys:
            plan = self._plans.get(key)
            if plan is not None and (key in self.held or plan.state == "queued") and key not in doomed:
                found = self.admit(key, resume=resume)
                # A loss found through ``key`` dooms every waiter on it, some doomed already by an earlier key.
                found.doomed = [doom for doom in found.doomed if doom.plan_id not in doomed]
                doomed.update(doom.plan_id for doom in found.doomed)
                verdicts.extend(found)
        return verdicts

    def holder_lost(self, worker_id: str) -> Verdicts:
        """Worker ``worker_id`` is gone for good: the outputs it made for the graph are lost; the queued plans
        that need them get rebuilds, or fail ``output_lost``. (One pass over the producers that have
        dependants: a worker's loss is rare next to a plan's end.)"""
        verdicts = Verdicts()
        for origin in self.lineage.lost_on(worker_id, list(self.dependants)):
            self._relook(origin, verdicts)
        verdicts.ready = [key for key in verdicts.ready if key not in self.held]
        return verdicts

    def output_missing(self, plan_id: str, output: str) -> Verdicts:
        """A worker found output ``output`` of plan ``plan_id`` (a producer or a rebuild) gone from its holder."""
        verdicts = Verdicts()
        if self.lineage.mark_lost(plan_id, output):
            self._relook(self.lineage.origin_of(plan_id), verdicts)
            verdicts.ready = [key for key in verdicts.ready if key not in self.held]
        return verdicts

    def _relook(self, origin: str, verdicts: Verdicts) -> None:
        """The queued plans that need ``origin`` look again (outputs it made were lost): a ready one whose
        source went is held again (``held``), or doomed."""
        keys = [key for key in sorted(self.dependants.get(origin, ())) if key in self._plans]
        held_before = {key for key in keys if key in self.held}
        start = len(verdicts.ready)
        self._admit_all(keys, verdicts)
        # A queued plan that was ready and still is: already in the placement queue, not news.
        verdicts.ready[start:] = [key for key in verdicts.ready[start:] if key in held_before or key not in keys]

    def _lost(self, origin: str, outputs: tuple[str, ...], why: str | None = None) -> Verdicts:
        """Producer ``origin``'s ``outputs`` are gone and a held plan needs them: rebuild it, or doom its
        waiters (``why``: the reason none can be made, when the caller knows it already)."""
        verdicts = Verdicts()
        why = why or self.lineage.why_not(origin)
        if why is None:
            key = self.lineage.next_key(origin)
            self.lineage.record(origin, key)
            needs = self.needs.get(origin, ())
            if needs:
                self.needs[key] = needs
                for need in needs:
                    self.dependants.setdefault(need.upstream, set()).add(key)
            verdicts.rebuilds.append(Rebuild(origin, key, outputs))
            return verdicts
        name = self.name_of(origin)
        seen: set[str] = set()
        for key in sorted(self.dependants.get(origin, ())):
            plan = self._plans.get(key)
            if plan is None or plan.terminal or plan.state != "queued" or key in seen:
                continue
            for need in self.needs.get(key, ()):
                if need.upstream == origin and need.data and self.lineage.lookup(need).kind == "lost":
                    message = f"output {need.output!r} of plan {name} is lost and cannot be made again: {why}"
                    seen.add(key)
                    self._unhold(key)
                    verdicts.doomed.append(Doom(key, errors.OUTPUT_LOST, message, origin, origin))
                    verdicts.doomed += self._fall(key, seen, root=origin)
                    break
        return verdicts

    def _fall(self, failed: str, seen: set[str], *, root: str = "") -> list[Doom]:
        """The unfinished plans that need ``failed``, directly or not, each failing ``upstream_failed``
        naming its own upstream (breadth first: an upstream's doom comes before its dependants')."""
        root = root or failed
        out: list[Doom] = []
        plan = self._plans.get(failed)
        if plan is not None and not plan.terminal and failed not in seen:  # doomed by a need, not by its own end
            seen.add(failed)
            self._unhold(failed)
            out.append(self._first_doom(failed))
        todo = deque([failed])
        while todo:
            upstream = todo.popleft()
            for key in sorted(self.dependants.get(upstream, ())):
                dependant = self._plans.get(key)
                if key in seen or dependant is None or dependant.terminal:
                    continue
                seen.add(key)
                self._unhold(key)
                out.append(self._upstream_doom(key, upstream, root))
                todo.append(key)
            origin = self.lineage.origin.get(upstream)
            if origin is not None:  # a rebuild doomed in this fall: its producer's waiting consumers fail too
                why = f"its rebuild, plan {self.name_of(upstream)}, failed because plan {self.name_of(root)} did"
                for verdict in self._lost(origin, (), why).doomed:
                    if verdict.plan_id not in seen:
                        seen.add(verdict.plan_id)
                        out.append(verdict)
        return out

    def _first_doom(self, plan_id: str) -> Doom:
        """The doom of a plan whose own need is not met (an output its succeeded upstream never made)."""
        for need in self.needs.get(plan_id, ()):
            found = self.lineage.lookup(need)
            if found.kind == "missing":
                upstream = self._plans[need.upstream]
                made = ", ".join(repr(spec.name) for spec in upstream.produced) or "none"
                message = (f"plan {self.name_of(need.upstream)} succeeded without making output {need.output!r} "
                           f"(its outputs: {made})")
                return Doom(plan_id, errors.OUTPUT_LOST, message, need.upstream, need.upstream)
            if found.kind == "failed":
                return self._upstream_doom(plan_id, need.upstream, need.upstream)
            if found.kind == "lost":
                message = f"plan {self.name_of(need.upstream)} was forgotten before it could be used"
                return Doom(plan_id, errors.OUTPUT_LOST, message, need.upstream, need.upstream)
        return Doom(plan_id, errors.UPSTREAM_FAILED, "an upstream plan did not succeed", plan_id, plan_id)

    def _upstream_doom(self, plan_id: str, upstream: str, root: str) -> Doom:
        """``plan_id`` fails because ``upstream`` ended without succeeding (or is failing in the same fall)."""
        plan = self._plans.get(upstream)
        terminal = plan is not None and plan.terminal
        state = plan.state if plan is not None and terminal else "failed"  # not ended: doomed in this fall
        error = plan.error if plan is not None and terminal else None
        cause = f" ({error.code}: {error.message})" if error is not None and state == "failed" else ""
        outputs = [need.output for need in self.needs.get(plan_id, ()) if need.upstream == upstream and need.data]
        how = f"whose output {outputs[0]!r} it uses" if outputs else "which it runs after"
        rooted = f", because plan {self.name_of(root)} did not succeed" if root != upstream else ""
        message = f"plan {self.name_of(upstream)}, {how}, {state}{cause}{rooted}"
        return Doom(plan_id, errors.UPSTREAM_FAILED, message, upstream, root)

    # ------------------------------------------------------------------ a client's fetch

    def wanted(self, plan_id: str, output: str) -> tuple[Lookup, Verdicts]:
        """A client wants output ``output`` of succeeded plan ``plan_id`` (or of a rebuild of it; the caller marked
        the copies it knows are gone): where it is now (``found``), the rebuild making it (``rebuilding``: one
        under way, or one decided now, in the verdicts), or ``lost`` (:meth:`Lineage.why_not` says why)."""
        origin = self.lineage.origin_of(plan_id)
        found = self.lineage.lookup(Need(origin, output, output))
        if found.kind == "lost" and origin in self._plans and self.lineage.why_not(origin) is None:
            verdicts = self._lost(origin, (output,))
            return Lookup("rebuilding", verdicts.rebuilds[0].key), verdicts
        return found, Verdicts()

    # ------------------------------------------------------------------ dependants and retention

    def dependants_of(self, plan_id: str) -> list[str]:
        """The unfinished plans that need ``plan_id``, directly or not, breadth first (upstream first)."""
        out: list[str] = []
        seen = {plan_id}
        todo = deque([plan_id])
        while todo:
            for key in sorted(self.dependants.get(todo.popleft(), ())):
                if key in seen:
                    continue
                seen.add(key)
                plan = self._plans.get(key)
                if plan is not None and not plan.terminal:
                    out.append(key)
                todo.append(key)
        return out

    def pinned(self, plan_id: str) -> bool:
        """Whether an unfinished plan still needs ``plan_id`` (retention keeps it while one does)."""
        for key in self.dependants.get(self.lineage.origin_of(plan_id), ()):
            plan = self._plans.get(key)
            if plan is not None and not plan.terminal:
                return True
        return False

    def forget(self, plan_id: str) -> None:
        """Plan ``plan_id`` was forgotten (retention): its edges, hold and lineage go."""
        self._unhold(plan_id)
        for need in self.needs.pop(plan_id, ()):
            users = self.dependants.get(need.upstream)
            if users is not None:
                users.discard(plan_id)
                if not users:
                    del self.dependants[need.upstream]
        self.dependants.pop(plan_id, None)
        self.lineage.forget(plan_id)

    def edges(self) -> Iterator[tuple[str, str]]:
        """Every (upstream, dependant) pair, for tests and the dashboard."""
        for plan_id, needs in self.needs.items():
            for need in needs:
                yield need.upstream, plan_id


def _made(plan: PlanView, output: str) -> bool:
    return any(spec.name == output for spec in plan.produced)
