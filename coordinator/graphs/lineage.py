"""Where each referenced output is now, which are lost, and whether a lost one can be rebuilt.

What it owns: the rebuilds of each producer (a *rebuild* is a new plan with the producer's spec,
made when outputs the graph needs were lost: its key is the producer's key + ``.r<n>``) and the
outputs known to be lost. The producer itself is never run again: it stays ``succeeded`` (terminal
states are final, docs/SEMANTICS.md §Plan lifecycle); its consumers take the output from its latest
rebuild that made it.

Rules (docs/SEMANTICS.md §Graphs, *Lineage*):

* An output is *lost* when the worker that made it is gone (the core says which, after its reconnect
  grace) or a consumer's worker reported it missing (a 404 from the holder: its spool retention passed).
* A lost output is rebuilt when its producer is ``deterministic`` (the default), its inputs can be
  had again (references only: inputs a client uploaded lived on a worker and are not kept anywhere
  else), it was rebuilt fewer than ``max_rebuilds`` times, and its latest rebuild did not fail.
  Otherwise the consumers that need it fail ``output_lost``, naming what is gone and why.
* One rebuild at a time per producer: while one is under way, consumers wait for it.
* A *copy* (a copy plan of a producer submitted with ``replicas``: coordinator/graphs/replicas.py) holds
  the producer's outputs on another worker: a consumer takes an output from the latest rebuild that
  has it, else the producer, else a copy, so a producer's lost worker costs no rebuild while a copy lives.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Final, Literal

from coordinator.graphs.needs import Need, PlanView
from coordinator.graphs.remote import REMOTE_PREFIX

__all__ = ["DEFAULT_MAX_REBUILDS", "Lineage", "Lookup", "Source"]

DEFAULT_MAX_REBUILDS: Final = 3


@dataclass(frozen=True, slots=True)
class Source:
    """Where a referenced output is: the attempt of plan ``plan_id`` that made it, on ``worker_id``."""

    plan_id: str  # the producer's key, or its rebuild's
    attempt: int
    worker_id: str
    name: str
    size: int
    digest: str


LookupKind = Literal["found", "unfinished", "failed", "missing", "rebuilding", "lost"]


@dataclass(frozen=True, slots=True)
class Lookup:
    """What a need finds (:meth:`Lineage.lookup`).

    ``kind``: ``found`` (``source`` is set; an order that is met has no source), ``unfinished``
    (the upstream has not ended), ``failed`` (it ended without succeeding), ``missing`` (it
    succeeded without that output), ``rebuilding`` (``key``: the rebuild under way), ``lost``
    (gone from everywhere it was made).
    """

    kind: LookupKind
    key: str = ""
    source: Source | None = None


class Lineage:
    """Rebuilds and lost outputs.

    Args:
        plans: the core's plans by key (read only).
        max_rebuilds: rebuilds one producer may have; past them a lost output stays lost.
    """

    def __init__(self, plans: Mapping[str, PlanView], max_rebuilds: int = DEFAULT_MAX_REBUILDS) -> None:
        self._plans = plans
        self.max_rebuilds = max_rebuilds
        self.rebuilds: dict[str, list[str]] = {}
        """Producer key -> the keys of its rebuilds, oldest first."""
        self.origin: dict[str, str] = {}
        """Rebuild key -> the producer it rebuilds."""
        self.lost: set[tuple[str, str]] = set()
        """(plan key, output name) known gone from the worker that made it."""
        self.copies: dict[str, list[str]] = {}
        """Producer key -> its succeeded copy plans (``submit.replicas``: graphs/replicas.py), oldest first."""
        self.copy_origin: dict[str, str] = {}
        """Copy plan key -> the producer whose outputs it holds."""

    def origin_of(self, key: str) -> str:
        """The producer ``key`` rebuilds, or ``key`` itself."""
        return self.origin.get(key, key)

    def lookup(self, need: Need) -> Lookup:
        """What ``need`` finds now: the upstream's state, and for a reference where its output is."""
        upstream = self._plans.get(need.upstream)
        if upstream is None:
            return Lookup("lost", need.upstream)
        if not upstream.terminal:
            return Lookup("unfinished", need.upstream)
        if upstream.state != "succeeded":
            return Lookup("failed", need.upstream)
        if not need.data:
            return Lookup("found")
        if not any(spec.name == need.output for spec in upstream.produced):
            return Lookup("missing", need.upstream)
        copies = self.copies.get(need.upstream, ())
        for key in reversed([*copies, need.upstream, *self.rebuilds.get(need.upstream, ())]):  # rebuilds, it, copies
            plan = self._plans.get(key)
            if plan is None or not plan.terminal:  # None: decided, the core is making it (PlanGraph.admit)
                if key in copies:
                    continue  # a copy forgotten by retention: not a rebuild under way
                return Lookup("rebuilding", key)
            if plan.state != "succeeded" or plan.worker_id is None or (key, need.output) in self.lost:
                continue
            for spec in plan.produced:
                if spec.name == need.output:
                    return Lookup("found", key, Source(key, plan.attempt, plan.worker_id, spec.name, spec.size,
                                                       spec.digest))
        return Lookup("lost", need.upstream)

    def holders(self, origin: str) -> list[str]:
        """The plans that made or hold outputs of producer ``origin``: itself, its copies, its rebuilds."""
        return [origin, *self.copies.get(origin, ()), *self.rebuilds.get(origin, ())]

    def record_copy(self, origin: str, key: str) -> None:
        """Copy plan ``key`` succeeded: it holds outputs of ``origin`` as well (decided now, or restored)."""
        chain = self.copies.setdefault(origin, [])
        if key not in chain:
            chain.append(key)
        self.copy_origin[key] = origin

    def mark_lost(self, key: str, output: str) -> bool:
        """Output ``output`` of plan ``key`` (a producer or a rebuild) is gone; False if it was known."""
        if (key, output) in self.lost:
            return False
        self.lost.add((key, output))
        return True

    def lost_on(self, worker_id: str, producers: Iterable[str]) -> list[str]:
        """Every output of ``producers`` (and of their rebuilds) made on ``worker_id`` is gone: mark
        them lost. Returns the producers (origins) that lost one."""
        hit: list[str] = []
        for origin in producers:
            for key in self.holders(origin):
                plan = self._plans.get(key)
                if plan is None or plan.state != "succeeded" or plan.worker_id != worker_id:
                    continue
                marked = [self.mark_lost(key, spec.name) for spec in plan.produced]
                if any(marked) and origin not in hit:
                    hit.append(origin)
        return hit

    def why_not(self, origin: str) -> str | None:
        """Why producer ``origin``'s lost outputs cannot be rebuilt, or None when they can."""
        plan = self._plans.get(origin)
        if plan is None:
            return "it was forgotten"
        if origin.startswith(REMOTE_PREFIX):  # a plan of another shard (graphs/remote.py): no lineage across shards
            return "it is a plan of another shard, and outputs are not made again across shards"
        if not plan.deterministic:
            return "it was submitted with deterministic=false, so running it again may not give the same output"
        uploaded = [spec.name for spec in plan.inputs if spec.ref is None]
        if uploaded:
            return f"its input {uploaded[0]!r} was uploaded by its client and is not kept elsewhere"
        rebuilds = self.rebuilds.get(origin, ())
        if rebuilds:
            latest = self._plans.get(rebuilds[-1])
            if latest is not None and latest.terminal and latest.state != "succeeded":
                cause = f" ({latest.error.code}: {latest.error.message})" if latest.error is not None else ""
                return f"its rebuild, plan {rebuilds[-1]}, {latest.state}{cause}"
        if len(rebuilds) >= self.max_rebuilds:
            return f"it was rebuilt {len(rebuilds)} times already (the most)"
        return None

    def next_key(self, origin: str) -> str:
        """The key the next rebuild of ``origin`` gets: ``<origin>.r<n>``, the first one no plan holds."""
        n = len(self.rebuilds.get(origin, ())) + 1
        while f"{origin}.r{n}" in self._plans:
            n += 1
        return f"{origin}.r{n}"

    def record(self, origin: str, key: str) -> None:
        """``key`` rebuilds ``origin`` (decided now, or restored from the store)."""
        origin = self.origin_of(origin)
        chain = self.rebuilds.setdefault(origin, [])
        if key not in chain:
            chain.append(key)
        self.origin[key] = origin

    def forget(self, key: str) -> None:
        """Plan ``key`` was forgotten (retention): its rebuild links and lost marks go."""
        origin = self.origin.pop(key, None)
        if origin is not None:
            chain = self.rebuilds.get(origin)
            if chain is not None and key in chain:
                chain.remove(key)
        for rebuild in self.rebuilds.pop(key, ()):
            self.origin.pop(rebuild, None)
        origin = self.copy_origin.pop(key, None)
        if origin is not None and key in self.copies.get(origin, ()):
            self.copies[origin].remove(key)
        for copy in self.copies.pop(key, ()):
            self.copy_origin.pop(copy, None)
        if self.lost:
            self.lost = {item for item in self.lost if item[0] != key}
