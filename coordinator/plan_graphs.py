"""Plan graphs in the core (issue #28): coordinator/graphs/ tied to submits, placement, plan ends and lost workers.

What it owns: the :class:`~coordinator.graphs.PlanGraph` over the core's plans, and the consumers waiting
for a busy worker that holds their bytes. The decisions are the graph's; this collaborator carries them
out with the core's own parts (the scheduler, the streams, the data plane), as every collaborator does.

Rules (docs/SEMANTICS.md §Graphs):

* *Submit.* A session's references (``InputSpec.ref``) and ``after`` name plans as the session knows
  them; they are resolved to keys (:meth:`PlanGraphs.resolve`) and the plan, and its stored submit, name
  keys. A refusal is ``invalid_argument`` naming the input (coordinator/graphs/graph.py ``refusal``).
* *Held, ready, doomed.* A plan with needs passes the graph before the placement queue, whenever it
  would be queued (submitted, requeued, restored): held (out of the queue, its ``waiting`` reason the
  graph's), ready (queued as any plan), or doomed: it fails at once (the ``doom`` move, ``queued ->
  failed``, with ``upstream_failed`` or ``output_lost``), and so do its own dependants.
* *Ends.* Every plan's end is told to the graph (``Streams.on_end``): its held dependants are queued, or
  fail with it. A plan forgotten by retention leaves the graph; one an unfinished plan needs is kept.
* *Assign.* An input in the reference form gets the size and digest of the output it is, and a
  ``Pull``: the holder, its data endpoint and a ``get`` ticket signed for it (coordinator/data_plane.py).
  A holder with no data endpoint gets a pull with no ``url``: the consumer's worker then fetches through
  the relay with the same ticket (coordinator/relay.py ``open_pull``), as it does when the dial fails.
* *Locality.* A ready consumer goes, among the workers with room, to those holding most of its bytes
  (coordinator/graphs/locality.py); when the best holder is busy it waits for it up to the bound, and no
  other worker takes it before (:meth:`PlanGraphs.may_take`); past the bound it goes where there is room.
* *Losses.* A worker gone for good (reaped, removed) takes the outputs it made with it; a consumer's
  worker that could not fetch one reports ``done(failed, output_lost)``: the consumer is queued again
  without charging an attempt (the ``retry`` move) and the output marked missing. Either way the graph
  has it made again by a *rebuild* (a new plan ``<key>.r<n>`` with the producer's spec, same owner,
  recorded with ``rebuild_of``), or fails the waiting consumers ``output_lost``.
* *Across shards* (cluster mode; coordinator/graphs/remote.py). An upstream of another shard is a
  ``RemotePlan`` the driver tells (:meth:`PlanGraphs.remote_seen`, ``remote_gone``; the ids it looks up:
  :meth:`PlanGraphs.unknown_upstreams`); the graph reads it as any upstream. Its consumer's pull names its
  key, attempt and worker in its shard, that worker's endpoint and a ticket of the cluster's shared key; a
  lost output of it is never rebuilt here. A restored consumer's remote upstream is a placeholder, not
  ended, until the driver reads its row.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING

import msgspec
import structlog

from coordinator.capacity import Pool
from coordinator.graphs import (
    LocalityConfig,
    PlanGraph,
    Source,
    Verdicts,
    choose_holders,
    held_bytes,
    needs_of,
)
from coordinator.graphs.needs import MAX_NEEDS
from coordinator.graphs.remote import PlansAndRemotes, RemotePlan, RemoteUpstreams, remote_row
from coordinator.graphs.replicas import HeldSuccess, copy_submit, copy_wait_s, is_copy, still_wanted, wanted
from coordinator.plans import SMALL_EVENT_BYTES, Plan, advance, held_size
from protocol import errors
from protocol.messages import Done, ErrorInfo, InputSpec, OutputRef, Pull, Submit

if TYPE_CHECKING:
    from coordinator.data_plane import DataPlane
    from coordinator.scheduling import Scheduler
    from coordinator.state import CoreState
    from coordinator.streams import Streams
    from coordinator.workers import WorkerRecord

__all__ = ["PlanGraphs"]

log = structlog.get_logger(__name__)

GRAPH_COUNTERS = ("plans_rebuilt", "plans_doomed", "outputs_lost", "outputs_copied")

Finish = Callable[[Plan, str, Done, float, "dict[str, list[str]] | None"], None]


class PlanGraphs:
    """The core's collaborator for plan graphs (module docstring).

    Args:
        state: the core's tables.
        streams: lifecycle events and failures.
        scheduler: the placement queue (``enqueue``, ``dequeue``) and the submit order.
        data: signs the tickets of ``assign.pulls``.
        locality: how consumers are placed by their bytes.
        max_rebuilds: rebuilds one producer may have.
    """

    def __init__(
        self, state: CoreState, *, streams: Streams, scheduler: Scheduler, data: DataPlane,
        locality: LocalityConfig | None = None, max_rebuilds: int = 3,
    ) -> None:
        self._state = state
        self._plans = state.plans
        self._streams = streams
        self._scheduler = scheduler
        self._data = data
        self.locality = locality or LocalityConfig()
        self.remotes = RemoteUpstreams()
        """Upstreams of another shard (cluster mode; coordinator/graphs/remote.py): the driver tells their rows."""
        self.graph = PlanGraph(PlansAndRemotes(state.plans, self.remotes.plans),  # type: ignore[arg-type]
                               name_of=self.name_of, max_rebuilds=max_rebuilds)  # fmt: skip
        self.waits: dict[str, tuple[str, float]] = {}
        """Consumer key -> (the busy holder it waits for, until when, the core's clock)."""
        self._ready_at: dict[str, float] = {}  # a ready consumer's first try at placement (its wait's start)
        self._dooming: set[str] = set()
        """When the core loaded a store's plans (``Core.restore``): workers are still coming back for a while."""
        self.held_successes: dict[str, HeldSuccess] = {}
        """Replicating plans (``submit.replicas``): key -> the success held until copies of its outputs exist."""
        self.finish: Finish | None = None
        """Ends a plan as its worker's ``done`` says (the worker sessions' ``Leases.finish``; set by the core)."""
        state.counters.update(dict.fromkeys(GRAPH_COUNTERS, 0))
        scheduler.graphs = self  # asked before a graphed plan is queued, placed or assigned (graphs/hooks.py)

    def name_of(self, key: str) -> str:
        """A plan as its owner knows it (its name, else its key)."""
        plan = self._plans.get(key)
        if plan is None:
            remote = self.remotes.get(key) if self.remotes else None
            return key if remote is None else remote.name
        return key if plan.name is None else plan.name

    # ------------------------------------------------------------------ submit

    def resolve(self, msg: Submit, owner: str, find: Callable[[str], Plan | None]) -> tuple[Submit, str | None]:
        """``msg`` with its references and ``after`` naming plan keys (``find``: the session's look-up of an
        id), or the reason it is refused (naming the input or ``after``)."""
        if len(msg.after) > MAX_NEEDS:
            return msg, f"after names {len(msg.after)} plans; at most {MAX_NEEDS}"
        inputs: list[InputSpec] = []
        for spec in msg.inputs:
            ref = spec.ref
            if ref is None:
                inputs.append(spec)
                continue
            plan = find(ref.plan_id) or self.remotes.named(owner, ref.plan_id)
            if plan is None:
                return msg, self._unknown(f"input {spec.name!r} refers to", ref.plan_id, msg.plan_id)
            inputs.append(msgspec.structs.replace(spec, ref=OutputRef(plan.id, ref.name)))
        after: list[str] = []
        for plan_id in msg.after:
            plan = find(plan_id) or self.remotes.named(owner, plan_id)
            if plan is None:
                return msg, self._unknown("after names", plan_id, msg.plan_id)
            after.append(plan.id)
        resolved = msgspec.structs.replace(msg, inputs=inputs, after=after)
        problem = self.graph.refusal(msg.plan_id or "", owner, needs_of(resolved.inputs, resolved.after))
        return resolved, problem

    def _unknown(self, where: str, plan_id: str, own: str | None) -> str:
        """Why an upstream is refused as unknown; a shard's core (cluster mode) says no shard holds it."""
        return _unknown(where, plan_id, own, self._state.placement.config.cluster)

    def unknown_upstreams(self, msg: Submit, principal: str, admin: bool) -> list[str]:
        """The ids a submit's references and ``after`` name that neither a plan of this core nor a known remote
        upstream is, for ``principal`` (an admin names plans by key): the driver looks them up in the other
        shards before the core takes the submit (coordinator/io/cluster/remote_refs.py)."""
        plans, aliases = self._plans, self._state.names.keys
        unknown: list[str] = []
        for plan_id in [spec.ref.plan_id for spec in msg.inputs if spec.ref is not None] + list(msg.after):
            if admin:
                if plan_id in plans:
                    continue
            else:
                key = aliases.get((principal, plan_id)) if aliases else None
                plan = plans.get(plan_id if key is None else key)
                if plan is not None and plan.owner == principal and (key is not None or plan.name is None):
                    continue
            if self.remotes.named(principal, plan_id) is None and plan_id not in unknown:
                unknown.append(plan_id)
        return unknown

    # ------------------------------------------------------------------ remote upstreams (cluster mode)

    def remote_seen(self, seen: RemotePlan, now: float) -> None:
        """The driver read the row of a remote upstream (coordinator/graphs/remote.py): its record here is updated,
        and when it has just ended, its held consumers are placed, or fail with it (as any upstream's end)."""
        remote = self.remotes.add(seen)
        was_terminal = remote.terminal and remote is not seen
        if remote is not seen:
            for name in ("name", "shard", "key", "state", "attempt", "worker_id", "produced", "error", "data_url"):
                setattr(remote, name, getattr(seen, name))
        if remote.terminal and not was_terminal:
            self.apply(self.graph.ended(remote.id), now)

    def remote_gone(self, key: str, now: float) -> None:
        """No shard holds the row of remote upstream ``key`` any longer (forgotten there before its end was read
        here): it is taken as failed, and its consumers here fail ``upstream_failed`` saying so."""
        remote = self.remotes.get(key)
        if remote is None or remote.terminal:
            return
        remote.state = "failed"
        remote.error = ErrorInfo(errors.PLAN_NOT_FOUND, "its shard no longer holds it (forgotten at retention)")
        self.apply(self.graph.ended(key), now)

    def _remote_key_of(self, plan: Plan, key: str) -> str:
        """The key here of the remote upstream of ``plan`` whose key in its own shard is ``key`` (else ``key``)."""
        for need in self.graph.needs.get(plan.id, ()):
            remote = self.remotes.get(need.upstream)
            if remote is not None and remote.key == key:
                return remote.id
        return key

    def _remote_placeholder(self, key: str, owner: str) -> None:
        """A restored consumer names remote upstream ``key``: it is not ended until the driver reads its row."""
        if key not in self.remotes.plans and key not in self._plans and remote_row(key) is not None:
            self.remotes.add(RemotePlan(key, owner, key))

    # ------------------------------------------------------------------ held, ready, doomed

    def hold(self, plan: Plan, now: float) -> bool:
        """A plan with needs is about to be queued: False to queue it (ready), True when the graph holds it
        (its waiting reason set) or failed it. The scheduler asks this first (``Scheduler.hold``)."""
        if is_copy(plan.op, plan.rebuild_of):
            return False  # its producer is replicating, not succeeded: the copy takes its outputs as they are
        graph = self.graph
        if plan.id not in graph:
            graph.add(plan.id, needs_of(plan.inputs, plan.after))
        self._gone_copies(plan.id, now)
        verdicts = graph.admit(plan.id)
        ready = plan.id in verdicts.ready
        verdicts.ready = [key for key in verdicts.ready if key != plan.id]
        self.apply(verdicts, now)
        return not ready

    def _gone_copies(self, plan_id: str, now: float) -> None:
        """The copies a plan about to be admitted takes whose worker is gone for good (not in the registry: reaped,
        removed, left) are lost: it is placed on a copy that lives, or a rebuild, rather than fetch from nowhere
        and fail. Not in the first heartbeat timeout after a restart, while workers come back."""
        registry = self._state.registry
        if registry.awaiting_restored(now) is not None:
            return
        lineage = self.graph.lineage
        for need in self.graph.needs.get(plan_id, ()):
            if not need.output:
                continue
            for key in lineage.holders(need.upstream):
                holder = self._plans.get(key)
                if holder is not None and holder.state == "succeeded" and holder.worker_id is not None and (
                    holder.worker_id not in registry and lineage.mark_lost(key, need.output)
                ):
                    self._state.counters["outputs_lost"] += 1

    def apply(self, verdicts: Verdicts, now: float) -> None:
        """Carry out the graph's verdicts (coordinator/graphs/graph.py ``Verdicts``), in their order."""
        for rebuild in verdicts.rebuilds:
            self._rebuild(rebuild.origin, rebuild.key, rebuild.outputs, now)
        if verdicts.doomed:
            self._doom(verdicts, now)
        for key in verdicts.held:
            plan = self._plans.get(key)
            if plan is not None and plan.state == "queued":
                self._scheduler.dequeue(plan)
                self._say_waiting(plan)
        for key in verdicts.ready:
            plan = self._plans.get(key)
            if plan is not None and plan.state == "queued":
                self._scheduler.enqueue(plan, now)

    def _doom(self, verdicts: Verdicts, now: float) -> None:
        doomed = [doom for doom in verdicts.doomed if doom.plan_id in self._plans]
        self._dooming.update(doom.plan_id for doom in doomed)
        try:
            for doom in doomed:
                plan = self._plans[doom.plan_id]
                if plan.state != "queued":  # ended already (a cancel in the same step), or placed: left alone
                    continue
                self._scheduler.dequeue(plan)
                advance(plan, "doom")
                plan.waiting_reason = None
                self._state.counters["plans_doomed"] += 1
                self._streams.fail(plan, None, doom.error(self.name_of))
        finally:
            self._dooming.difference_update(doom.plan_id for doom in doomed)

    def _say_waiting(self, plan: Plan) -> None:
        reason = self.graph.reason(plan.id)
        if reason is not None and reason != plan.waiting_reason:
            plan.waiting_reason = reason
            plan.drop_superseded("waiting", SMALL_EVENT_BYTES)
            self._streams.emit(plan, "waiting", {"reason": reason}, small=True)

    def ended(self, plan: Plan, now: float) -> None:
        """A plan reached a terminal state (``Streams.on_end``)."""
        if self.waits or self._ready_at:
            self.waits.pop(plan.id, None)
            self._ready_at.pop(plan.id, None)
        if self.held_successes or plan.rebuild_of is not None:
            if is_copy(plan.op, plan.rebuild_of):
                self._copy_ended(plan, now)
                return
            held = self.held_successes.pop(plan.id, None)
            if held is not None:  # cancelled while it replicated: its copy not yet placed is not made
                plan.replicating = False
                self._drop_copy(held.copy, "its producer ended before the copy was placed", now)
        graph = self.graph
        if (plan.id in self._dooming and plan.rebuild_of is None) or (
            plan.id not in graph.dependants and plan.id not in graph and plan.id not in graph.lineage.origin
        ):
            # Nothing needs it, it is no rebuild, or it ends with its dependants in this same step. A doomed rebuild
            # is told to the graph all the same: the plans waiting for it are no dependants of it, but of its origin.
            return
        self.apply(graph.ended(plan.id), now)

    @contextlib.contextmanager
    def ending_together(self, plans: Iterable[Plan]) -> Iterator[None]:
        """Plans ended together on purpose (``cancel`` with dependants): their ends doom none of them."""
        keys = {plan.id for plan in plans} - self._dooming
        self._dooming.update(keys)
        try:
            yield
        finally:
            self._dooming.difference_update(keys)

    def tick(self, reaped: Iterable[str], now: float) -> None:
        """The clock moved: the outputs the reaped workers made are lost; consumers whose wait for a busy holder
        is over are placed wherever there is room."""
        for worker_id in reaped:
            self.holder_lost(worker_id, now)
        if self.held_successes:
            self._replication_tick(now)
        if self.waits:
            for plan in self.expired_waits(now):
                self._scheduler.dequeue(plan)
                self._scheduler.enqueue(plan, now)

    def dependants(self, plan: Plan) -> list[Plan]:
        """The unfinished plans that need ``plan``, directly or not, upstream first (``cancel --with-dependants``)."""
        return [self._plans[key] for key in self.graph.dependants_of(plan.id) if key in self._plans]

    def pinned(self, plan: Plan) -> bool:
        """Whether an unfinished plan still needs ``plan`` (retention keeps it)."""
        return self.graph.pinned(plan.id)

    def forget(self, plan_id: str) -> None:
        """Retention forgot a plan (and a remote upstream it alone needed is forgotten with it)."""
        needs = self.graph.needs.get(plan_id, ()) if self.remotes else ()
        self.graph.forget(plan_id)
        for need in needs:
            if need.upstream in self.remotes.plans and need.upstream not in self.graph.dependants:
                self.remotes.drop(need.upstream)

    # ------------------------------------------------------------------ rebuilds

    def _rebuild(self, origin_key: str, key: str, outputs: Iterable[str], now: float) -> None:
        """Make plan ``key``: producer ``origin_key``'s spec again, its lost ``outputs`` to be made again."""
        state = self._state
        origin = self._plans[origin_key]
        msg = Submit(
            req_id=0, op=origin.op, args=origin.args, requirements=origin.requirements, priority=origin.priority,
            timeout_s=origin.timeout_s, max_attempts=origin.max_attempts, plan_id=key, subscribe=False,
            hints=origin.hints, retries=origin.retries, inputs=list(origin.inputs), outputs=list(origin.outputs),
            resources=origin.resources, after=list(origin.after),
        )
        plan = Plan.from_submit(msg, key, origin.owner, next(self._scheduler.orders))
        plan.rebuild_of = origin_key
        self._plans[key] = plan
        state.quota.add(plan.owner, key, held_size(plan))
        state.counters["plans_rebuilt"] += 1
        state.journal.created(plan, msg)
        for conn_id in state.subscriptions.all_followers(plan.owner):
            state.subscriptions.add(key, conn_id)
        lost = sorted(outputs)
        log.info("plan rebuilt", plan_id=key, rebuilds=origin_key, outputs=lost)
        self._streams.emit(plan, "queued", {"rebuilds": self.name_of(origin_key), "outputs": lost})
        self._scheduler.enqueue(plan, now)

    def restored(self, plan: Plan) -> None:
        """A plan restored from the store: its edges and rebuild link go back into the graph; a replicating plan
        holds its success again, and a copy plan is its producer's copy again (or the copy under way)."""
        if is_copy(plan.op, plan.rebuild_of):
            assert plan.rebuild_of is not None
            origin = self._plans.get(plan.rebuild_of)
            if origin is not None and origin.worker_id is not None:
                plan.avoid = frozenset({origin.worker_id})  # not stored: it never goes to its producer's worker
            if plan.state == "succeeded":
                self.graph.lineage.record_copy(plan.rebuild_of, plan.id)
            return
        if plan.replicas and plan.state == "running" and plan.produced and plan.worker_id is not None:
            plan.replicating = True  # the success its worker reported is held for copies (coordinator/recovery.py)
            done = Done(plan_id=plan.id, attempt=plan.attempt, outcome="succeeded", result=plan.result,
                        outputs=plan.produced)
            now = self._state.registry.restored_at or 0.0
            self.held_successes[plan.id] = HeldSuccess(
                plan.worker_id, done, now + copy_wait_s(spec.size for spec in plan.produced), restored=True)
        if plan.rebuild_of is not None:
            self.graph.lineage.record(plan.rebuild_of, plan.id)
        needs = needs_of(plan.inputs, plan.after)
        if needs and plan.id not in self.graph:
            if not plan.terminal:
                for need in needs:  # its remote upstreams are read again by the driver (graphs/remote.py)
                    self._remote_placeholder(need.upstream, plan.owner)
            self.graph.add(plan.id, needs)

    # ------------------------------------------------------------------ losses

    def holder_lost(self, worker_id: str, now: float) -> None:
        """Worker ``worker_id`` is gone for good (reaped, removed): the outputs it made are lost."""
        if self.graph.dependants:
            self.apply(self.graph.holder_lost(worker_id), now)

    def output_missing(self, plan: Plan, error: ErrorInfo | None) -> bool:
        """A consumer's attempt failed ``output_lost`` (its worker could not fetch an input): mark that output
        missing. True when the consumer is to be queued again (the caller's ``retry`` move, not counted)."""
        if error is None or error.code != errors.OUTPUT_LOST or plan.id not in self.graph:
            return False
        detail = error.detail if isinstance(error.detail, dict) else {}
        source, output = detail.get("plan_id"), detail.get("output")
        if self.remotes and isinstance(source, str):  # a remote upstream, named by its key in its shard: its key here
            source = self._remote_key_of(plan, source)
        known = isinstance(source, str) and (source in self._plans or source in self.remotes.plans)
        if not known or not isinstance(source, str) or not isinstance(output, str):
            return False
        self._state.counters["outputs_lost"] += 1
        self.graph.lineage.mark_lost(source, output)
        return True

    # ------------------------------------------------------------------ a client's fetch

    def output_source(self, plan: Plan, output: str, lost: str, now: float) -> Plan | str | ErrorInfo:
        """Where a client fetches output ``output`` of succeeded plan ``plan`` (``data_ticket.output``): the plan
        that holds a copy (``plan`` or a rebuild of it), the key of the rebuild making it again, or why it is lost
        for good (``output_lost``). ``lost``: the key of the plan whose copy the client could not fetch.

        A copy is gone when the client could not fetch it, or when its worker is gone for good (not in the registry:
        reaped, removed); but a worker not back yet in the first heartbeat timeout after a restart is not taken as
        gone, whatever the client says (it may come back with its spool): ``unavailable`` then, saying when."""
        graph = self.graph
        lineage = graph.lineage
        origin = lineage.origin_of(plan.id)
        copies = lineage.holders(origin)
        registry = self._state.registry
        wait_s = registry.awaiting_restored(now)
        settled = wait_s is None
        failed = self._plans.get(lost) if lost in copies else None
        if failed is not None and wait_s is not None and failed.worker_id not in registry:
            return ErrorInfo(errors.UNAVAILABLE, f"worker {failed.worker_id}, which holds output {output!r} of plan "
                             f"{self.name_of(lost)}, has not come back since the coordinator restarted; ask again "
                             f"in {wait_s:.0f} s (then its copy is taken as lost)")  # fmt: skip
        if failed is not None and lineage.mark_lost(lost, output):
            self._state.counters["outputs_lost"] += 1
        if settled:
            for key in copies:
                copy = self._plans.get(key)
                if copy is not None and copy.state == "succeeded" and copy.worker_id not in registry:
                    lineage.mark_lost(key, output)
        found, verdicts = graph.wanted(origin, output)
        if verdicts:
            self.apply(verdicts, now)
        if found.kind == "found" and found.source is not None:
            return self._plans[found.source.plan_id]
        if found.kind == "rebuilding":
            return found.key
        why = lineage.why_not(origin) or "it is gone from every worker that made it"
        return ErrorInfo(errors.OUTPUT_LOST, f"output {output!r} of plan {self.name_of(origin)} is lost and cannot "
                         f"be made again: {why}", {"plan_id": self.name_of(origin), "output": output})

    # ------------------------------------------------------------------ replicated outputs

    def replicate(self, plan: Plan, worker_id: str, msg: Done, now: float) -> bool:
        """A plan with ``replicas`` succeeded on ``worker_id``: True when its success is held for copies of its
        outputs (a copy plan made), False to end it now (nothing to copy, or no other worker is alive)."""
        if not wanted(plan.replicas, msg.outputs) or self.finish is None:
            return False
        if not any(record.id != worker_id for record in self._state.registry.alive(now)):
            return False  # nowhere to copy to: the plan ends now, its outputs on one worker
        plan.replicating = True
        plan.produced = msg.outputs
        plan.result = msg.result  # stored with its status: a restart holds the same success again
        until = now + copy_wait_s(spec.size for spec in msg.outputs)
        held = HeldSuccess(worker_id, msg, until, {spec.name: [worker_id] for spec in msg.outputs})
        self.held_successes[plan.id] = held
        self._next_copy(plan, held, now)
        return True

    def _next_copy(self, plan: Plan, held: HeldSuccess, now: float) -> None:
        """Make the next copy plan of ``plan``'s outputs that want one more copy, or end the plan: all are made."""
        outputs = still_wanted(plan.replicas, plan.produced, held.holders)
        if not outputs or now >= held.until:
            self._finish_held(plan, now)
            return
        n = 1
        while f"{plan.id}.c{n}" in self._plans:
            n += 1
        key = f"{plan.id}.c{n}"
        msg = copy_submit(key, plan.id, outputs, plan.priority, held.until - now)
        copy = Plan.from_submit(msg, key, plan.owner, next(self._scheduler.orders))
        copy.rebuild_of = plan.id  # stored with its creation: a copy of plan.id (graphs/replicas.py is_copy)
        copy.avoid = frozenset(worker for spec in outputs for worker in held.holders.get(spec.name, ()))
        state = self._state
        self._plans[key] = copy
        state.quota.add(copy.owner, key, held_size(copy))
        state.journal.created(copy, msg)
        for conn_id in state.subscriptions.all_followers(copy.owner):
            state.subscriptions.add(key, conn_id)
        held.copy = key
        names = [spec.name for spec in outputs]
        self._streams.emit(copy, "queued", {"copies": self.name_of(plan.id), "outputs": names})
        self._streams.emit(plan, "replicating", {"copy": key, "outputs": names,
                                                 "holders": {name: list(held.holders[name]) for name in names}})
        self._scheduler.enqueue(copy, now)

    def _copy_ended(self, copy: Plan, now: float) -> None:
        """A copy plan ended: a succeeded one holds its producer's outputs; its producer's next copy, or its end."""
        origin_key = copy.rebuild_of
        assert origin_key is not None
        if copy.state == "succeeded" and copy.worker_id is not None:
            self.graph.lineage.record_copy(origin_key, copy.id)
            self._state.counters["outputs_copied"] += len(copy.produced)
        held = self.held_successes.get(origin_key)
        origin = self._plans.get(origin_key)
        if held is None or held.copy != copy.id or origin is None:
            return  # its producer ended meanwhile (the bound passed, or it was cancelled)
        held.copy = ""
        if copy.state != "succeeded" or copy.worker_id is None:
            self._finish_held(origin, now)  # copies are a best effort: the plan ends with what exists
            return
        for spec in copy.produced:
            held.holders.setdefault(spec.name, []).append(copy.worker_id)
        self._next_copy(origin, held, now)

    def _finish_held(self, plan: Plan, now: float) -> None:
        """End a replicating plan ``succeeded`` with the copies that exist (its ``succeeded`` event names them)."""
        held = self.held_successes.pop(plan.id)
        plan.replicating = False
        self._drop_copy(held.copy, f"plan {self.name_of(plan.id)} ended without waiting for it any longer", now)
        copies = {name: workers for name, workers in held.holders.items() if plan.replicas.get(name, 1) > 1}
        assert self.finish is not None
        self.finish(plan, held.worker_id, held.done, now, copies)

    def _drop_copy(self, key: str, why: str, now: float) -> None:
        """A copy plan not yet placed is not made (``timeout``); one placed runs on, and counts if it succeeds."""
        copy = self._plans.get(key) if key else None
        if copy is None or copy.state != "queued":
            return
        self._scheduler.dequeue(copy)
        advance(copy, "doom")
        copy.waiting_reason = None
        self._streams.fail(copy, None, ErrorInfo(errors.TIMEOUT, f"no worker took this copy in time: {why}"))

    def _replication_tick(self, now: float) -> None:
        """Replicating plans past their bound end with the copies that exist; restored ones find their copies."""
        for key, held in list(self.held_successes.items()):
            plan = self._plans.get(key)
            if plan is None or plan.state != "running":
                del self.held_successes[key]
                continue
            if held.restored:
                self._found_again(plan, held)
            if now >= held.until:
                if held.copy and (copy := self._plans.get(held.copy)) is not None and copy.state == "queued":
                    self._drop_copy(held.copy, "the copies took longer than their bound", now)  # ends it
                if key in self.held_successes:
                    self._finish_held(plan, now)
            elif not held.copy:
                self._next_copy(plan, held, now)

    def _found_again(self, plan: Plan, held: HeldSuccess) -> None:
        """After a restart: the workers holding a replicating plan's outputs, and its copy under way, from its copy
        plans (restored after it, so looked up at the first tick)."""
        held.restored = False
        held.holders = {spec.name: [held.worker_id] for spec in plan.produced}
        for key in self.graph.lineage.copies.get(plan.id, ()):
            copy = self._plans.get(key)
            if copy is not None and copy.worker_id is not None:
                for spec in copy.produced:
                    held.holders.setdefault(spec.name, []).append(copy.worker_id)
        for copy in self._plans.values():  # one pass, once per replicating plan after a restart
            if is_copy(copy.op, copy.rebuild_of) and copy.rebuild_of == plan.id and not copy.terminal:
                held.copy = copy.id

    def _copy_sources(self, copy: Plan) -> dict[str, Source]:
        """Where a copy plan's inputs are: its producer's outputs, on its producer's worker."""
        origin = self._plans.get(copy.rebuild_of or "")
        if origin is None or origin.worker_id is None:
            return {}
        return {spec.name: Source(origin.id, origin.attempt, origin.worker_id, spec.name, spec.size, spec.digest)
                for spec in origin.produced}

    # ------------------------------------------------------------------ assign and locality

    def assign_inputs(self, plan: Plan, record: WorkerRecord) -> tuple[list[InputSpec], list[Pull]]:
        """The inputs of an ``assign`` (references with their size and digest) and its ``pulls``."""
        sources = self._copy_sources(plan) if is_copy(plan.op, plan.rebuild_of) else self.graph.sources(plan.id) or {}
        self._ready_at.pop(plan.id, None)
        inputs: list[InputSpec] = []
        pulls: list[Pull] = []
        registry, now = self._state.registry, self._streams.now
        for spec in plan.inputs:
            source = sources.get(spec.name) if spec.ref is not None else None
            if source is None:
                inputs.append(spec)
                continue
            inputs.append(InputSpec(spec.name, source.size, source.digest, spec.ref))
            remote = self.remotes.get(source.plan_id) if self.remotes else None
            if remote is not None:  # a plan of another shard: its key there, its worker's endpoint, the shared key
                source = Source(remote.key, source.attempt, source.worker_id, source.name, source.size, source.digest)
                ticket = self._data.pull_ticket(source, now, shared=True)
                pulls.append(Pull(spec.name, source.plan_id, source.attempt, source.name, source.worker_id,
                                  remote.data_url, ticket))  # fmt: skip
                continue
            holder = registry.get(source.worker_id) if source.worker_id in registry else None
            url = holder.data_url if holder is not None else ""
            ticket = "" if source.worker_id == record.id else self._data.pull_ticket(source, now)
            pulls.append(Pull(spec.name, source.plan_id, source.attempt, source.name, source.worker_id, url, ticket))
        return inputs, pulls

    def narrow(self, plan: Plan, pool: Pool, now: float) -> Pool:
        """The workers of ``pool`` a ready consumer should go to: those with room holding most of its bytes, none
        while it waits for a busy holder (then it is queued, saying so), or ``pool`` when locality plays no part."""
        sources = self.graph.sources(plan.id)
        if not sources:
            return pool
        registry = self._state.registry
        room = [w for w in pool if w.has_capacity() and registry.is_alive(w.id, now)]
        able = {w.id for w in pool if registry.is_alive(w.id, now)}
        ready_at = self._ready_at.setdefault(plan.id, now)
        choice = choose_holders(held_bytes(sources.values()), [w.id for w in room], able, now - ready_at, self.locality)
        if choice.wait_for:
            self.waits[plan.id] = (choice.wait_for, ready_at + choice.wait_s)
            return Pool.unindexed(())
        self.waits.pop(plan.id, None)
        if not choice.among:
            return pool
        among = set(choice.among)
        return Pool.unindexed(w for w in room if w.id in among)

    def may_take(self, plan: Plan, record: WorkerRecord, now: float) -> bool:
        """Whether a worker with room may take a queued consumer: not while it waits for another, busy holder."""
        wait = self.waits.get(plan.id)
        if wait is None or wait[0] == record.id:
            return True
        if now >= wait[1]:
            del self.waits[plan.id]
            return True
        return False

    def expired_waits(self, now: float) -> list[Plan]:
        """The consumers whose wait for a busy holder is over (the tick places them again)."""
        over = [key for key, (_, until) in self.waits.items() if now >= until]
        for key in over:
            del self.waits[key]  # its _ready_at stays: placed again, it does not wait again
        return [self._plans[key] for key in over if key in self._plans and self._plans[key].state == "queued"]

    def wait_reason(self, plan: Plan) -> str | None:
        """Why a queued consumer waits for a busy holder, or None."""
        wait = self.waits.get(plan.id)
        if wait is None:
            return None
        sources = self.graph.sources(plan.id) or {}
        local = held_bytes(sources.values()).get(wait[0], 0)
        bound = wait[1] - self._ready_at.get(plan.id, wait[1])
        return (f"waiting for worker {wait[0]}, which holds {local / 2**20:.1f} MiB of its inputs, to have room "
                f"(at most {bound:.1f} s; then it goes where there is room)")


_ACROSS_SHARDS = " in any shard of this cluster"


def _unknown(where: str, plan_id: str, own: str | None, cluster: bool = False) -> str:
    if own is not None and plan_id == own:
        return f"{where} the plan itself: a plan cannot need its own output"
    where_held = _ACROSS_SHARDS if cluster else ""
    return f"{where} plan {plan_id}, which this principal has not submitted{where_held} (or it was forgotten)"

