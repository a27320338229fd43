"""Upstreams of another shard (cluster mode): what a shard's core knows of the plans its consumers need elsewhere.

A shard's core holds only its own shard's plans. A consumer submitted here may name a plan of another shard
(docs/SEMANTICS.md §Graphs, docs/CLUSTER.md §Shards and pools): the driver, which reads PostgreSQL
(coordinator/io/cluster/remote_refs.py), finds that plan's row and tells the core; the core keeps a
:class:`RemotePlan` for it, a plan view (coordinator/graphs/needs.py ``PlanView``) the graph reads as it reads
any upstream, under a key of its own (:func:`remote_key`: ``@row:<store key>``, the row's key in
``fleetwire_plans``, unique in the cluster). The consumer's reference is stored with that key, so a restarted
or new owner finds the remote upstreams again in the stored plans (:func:`remote_row`) and the driver reads
their rows again.

Rules:

* A remote upstream is *unknown* (not ended) until the driver reads its row; then it has the row's state, and
  for a succeeded one its outputs, the worker holding them and that worker's data endpoint (from the plan's
  ``data_ready`` event): the consumer's worker fetches them worker to worker with a ticket signed by the
  cluster's shared key (coordinator/data_plane.py ``shared``).
* Its end is final here as everywhere: once terminal the driver stops reading it.
* Its outputs are never rebuilt here (no lineage across shards): a lost one fails the consumer
  ``output_lost`` (coordinator/graphs/lineage.py ``why_not``).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Final

from coordinator.graphs.needs import PlanView
from protocol.messages import ErrorInfo, InputSpec, OutputSpec

__all__ = ["REMOTE_PREFIX", "PlansAndRemotes", "RemotePlan", "RemoteUpstreams", "remote_key", "remote_row"]

REMOTE_PREFIX: Final = "@row:"
"""The keys of remote upstreams: this prefix and the row's store key (docs/SEMANTICS.md §Graphs)."""

_TERMINAL: Final = frozenset({"succeeded", "failed", "cancelled"})


def remote_key(row: int) -> str:
    """The key a remote upstream has here: its row's store key in ``fleetwire_plans``."""
    return f"{REMOTE_PREFIX}{row}"


def remote_row(key: str) -> int | None:
    """The store key a remote upstream's key names, or None for any other key."""
    if not key.startswith(REMOTE_PREFIX):
        return None
    digits = key[len(REMOTE_PREFIX):]
    return int(digits) if digits.isdigit() and len(digits) < 20 else None


@dataclass(slots=True)
class RemotePlan:
    """What this core knows of a plan of another shard (a ``PlanView``): its row as the driver read it last.

    ``id``: its key here (:func:`remote_key`); ``key``: its key in its own shard's core (its worker's spool, the
    tickets); ``name``: as its owner knows it; ``data_url``: the data endpoint of the worker holding its outputs.
    """

    id: str
    owner: str
    name: str
    shard: int = -1
    key: str = ""
    state: str = "unknown"
    attempt: int = 0
    worker_id: str | None = None
    produced: tuple[OutputSpec, ...] = ()
    error: ErrorInfo | None = None
    data_url: str = ""
    inputs: tuple[InputSpec, ...] = field(default=())

    @property
    def terminal(self) -> bool:
        return self.state in _TERMINAL

    @property
    def deterministic(self) -> bool:
        return False  # never rebuilt here (module docstring)


class RemoteUpstreams:
    """The remote upstreams of this core's consumers, by key, and by ``(owner, name)`` for submits."""

    def __init__(self) -> None:
        self.plans: dict[str, RemotePlan] = {}
        self._names: dict[tuple[str, str], str] = {}

    def __bool__(self) -> bool:
        return bool(self.plans)

    def get(self, key: str) -> RemotePlan | None:
        return self.plans.get(key)

    def named(self, owner: str, name: str) -> RemotePlan | None:
        """``owner``'s remote upstream it knows as ``name``, or None."""
        key = self._names.get((owner, name))
        return None if key is None else self.plans.get(key)

    def add(self, plan: RemotePlan) -> RemotePlan:
        """Know ``plan`` (a known one keeps its record, and is named ``plan.name`` as well)."""
        known = self.plans.setdefault(plan.id, plan)
        if plan.name:
            self._names[(plan.owner, plan.name)] = plan.id
        return known

    def drop(self, key: str) -> None:
        """Forget a remote upstream (no consumer here needs it any longer, or its row is gone)."""
        plan = self.plans.pop(key, None)
        if plan is not None:
            self._names = {k: v for k, v in self._names.items() if v != key}

    def unfinished(self) -> list[RemotePlan]:
        """The remote upstreams whose end this core has not seen yet (the driver reads their rows)."""
        return [plan for plan in self.plans.values() if not plan.terminal]


class PlansAndRemotes(Mapping[str, PlanView]):
    """The core's plans and the remote upstreams, as the graph reads them (a remote key first: module docstring).

    While no remote upstream is known (every core but a few shards' in cluster mode) a look-up is the plans'
    own ``get`` and one truth test.
    """

    __slots__ = ("_plans", "_remote")

    def __init__(self, plans: Mapping[str, PlanView], remote: dict[str, RemotePlan]) -> None:
        self._plans = plans
        self._remote = remote

    def get(self, key: str, default: object = None) -> PlanView | None:  # type: ignore[override]
        if self._remote:
            remote = self._remote.get(key)
            if remote is not None:
                return remote
        plan = self._plans.get(key)
        return plan if plan is not None else default  # type: ignore[return-value]  # None, as the graph passes

    def __getitem__(self, key: str) -> PlanView:
        plan = self.get(key)
        if plan is None:
            raise KeyError(key)
        return plan

    def __contains__(self, key: object) -> bool:
        return key in self._remote or key in self._plans

    def __iter__(self) -> Iterator[str]:
        yield from self._plans
        yield from self._remote

    def __len__(self) -> int:
        return len(self._plans) + len(self._remote)
