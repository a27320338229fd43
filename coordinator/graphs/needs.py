"""The edges one plan declares, and what the graph reads of a plan (docs/SEMANTICS.md §Graphs).

A plan *needs* another plan (its *upstream*) in two ways:

* a reference: its input ``x`` is the upstream's output ``y`` (``InputSpec(name="x",
  ref=OutputRef(upstream, "y"))``): it waits until the upstream succeeded *and* ``y`` exists;
* an order: ``submit.after`` names the upstream: it waits until the upstream succeeded.

Both are a :class:`Need`; ``output`` is ``""`` for an order. Upstreams are named by their
*key* (coordinator/plans.py, §Plan ids): the core resolves the ids a session gave before the
graph sees them.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Final, Protocol

from protocol.messages import ErrorInfo, InputSpec, OutputSpec

__all__ = ["MAX_NEEDS", "Need", "PlanView", "needs_of"]

MAX_NEEDS: Final = 1024
"""Upstreams one plan may name in ``after`` (its references are bounded with its inputs)."""


@dataclass(frozen=True, slots=True)
class Need:
    """One edge into a plan.

    Attributes:
        upstream: the key of the plan it needs.
        output: the upstream's output it takes as an input; ``""`` for an order (``after``).
        input: the name that output has among its inputs (``""`` for an order).
    """

    upstream: str
    output: str = ""
    input: str = ""

    @property
    def data(self) -> bool:
        """Whether it takes an output (a reference), not only an order."""
        return bool(self.output)


class PlanView(Protocol):
    """What the graph reads of a plan: coordinator/plans.py's ``Plan`` has all of it."""

    @property
    def id(self) -> str: ...
    @property
    def owner(self) -> str: ...
    @property
    def state(self) -> str: ...
    @property
    def attempt(self) -> int: ...
    @property
    def worker_id(self) -> str | None: ...
    @property
    def produced(self) -> Sequence[OutputSpec]: ...
    @property
    def inputs(self) -> Sequence[InputSpec]: ...
    @property
    def deterministic(self) -> bool: ...
    @property
    def error(self) -> ErrorInfo | None: ...
    @property
    def terminal(self) -> bool: ...


def needs_of(inputs: Iterable[InputSpec], after: Iterable[str]) -> tuple[Need, ...]:
    """The needs a plan's inputs (those with ``ref``) and ``after`` declare: references first, in input
    order, then orders, each upstream once (an upstream also named by a reference is not ordered again)."""
    needs = [Need(spec.ref.plan_id, spec.ref.name, spec.name) for spec in inputs if spec.ref is not None]
    seen = {need.upstream for need in needs}
    for upstream in after:
        if upstream not in seen:
            seen.add(upstream)
            needs.append(Need(upstream))
    return tuple(needs)
