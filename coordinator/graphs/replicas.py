"""Replicated outputs (``submit.replicas``): copies on other workers made before the plan is reported succeeded.

What it owns: nothing of the core's; the rules and the pure pieces the core's collaborator
(coordinator/plan_graphs.py) carries out: which outputs still want a copy, the copy plan's submit, how
long a plan's success may wait for its copies.

Rules (docs/SEMANTICS.md §Graphs, *Replicas*):

* A plan submitted with ``replicas={"y": 2}`` (copies of ``y``, its own included) whose attempt succeeds
  with ``y`` while another worker is alive is *replicating*: it stays ``running`` (its lease is freed; its
  outputs and result are kept, and stored), its ``replicating`` event names the copy under way, and its end
  waits while copy plans make the copies. A copy plan, ``<key>.c<n>`` (op :data:`~protocol.messages.COPY_OP`,
  the same owner, ``rebuild_of`` the producer in its stored creation), takes the outputs that still want a
  copy as references and keeps each as its own output of the same name; it avoids every worker that holds
  one of them already. One copy plan at a time per producer (a second copy goes where the first is not).
* The plan ends ``succeeded`` when every copy exists, its ``succeeded`` event naming the workers that
  hold each replicated output (``copies``), or sooner, with what exists: when a copy failed, when the
  copies took longer than :func:`copy_wait_s` (a copy plan not yet placed then fails ``timeout``; one
  running goes on, and counts as a copy if it succeeds), or at once when no other worker is alive. Copies
  are a best effort: they never fail the plan.
* A copy is a source of the output as its producer is (coordinator/graphs/lineage.py ``copies``): while
  one lives, the producer's lost worker costs no rebuild.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Final

from protocol.messages import COPY_OP, Done, InputSpec, OutputRef, OutputSpec, Requirements, Submit

__all__ = ["COPY_MAX_ATTEMPTS", "HeldSuccess", "copy_submit", "copy_wait_s", "is_copy", "still_wanted", "wanted"]

COPY_BYTES_PER_S: Final = 50e6  # a copy's pace for the bound on a held success (the relay's is slower than a pull's)
MIN_WAIT_S: Final = 30.0
MAX_WAIT_S: Final = 600.0
COPY_MAX_ATTEMPTS: Final = 2


@dataclass(slots=True)
class HeldSuccess:
    """A replicating plan's success, held until its copies exist.

    Attributes:
        worker_id: the worker whose ``done`` it is.
        done: that ``done`` (rebuilt from the stored status after a restart).
        until: when the plan ends whatever copies exist (the core's clock).
        holders: output name -> the workers holding it, its own worker first.
        copy: the key of the copy plan under way ("": none).
        restored: loaded from the store; the copies are looked up again at the next tick.
    """

    worker_id: str
    done: Done
    until: float
    holders: dict[str, list[str]] = field(default_factory=dict)
    copy: str = ""
    restored: bool = False


def is_copy(op: str, rebuild_of: str | None) -> bool:
    """Whether a plan is a copy plan (its op is the copy op and it names its producer)."""
    return rebuild_of is not None and op == COPY_OP


def wanted(replicas: Mapping[str, int], produced: Iterable[OutputSpec]) -> dict[str, int]:
    """The outputs the attempt made that want more than one copy, and how many."""
    return {spec.name: replicas[spec.name] for spec in produced if replicas.get(spec.name, 1) > 1}


def still_wanted(replicas: Mapping[str, int], produced: Sequence[OutputSpec],
                 holders: Mapping[str, Sequence[str]]) -> list[OutputSpec]:
    """The produced outputs that have fewer copies than wanted."""
    return [spec for spec in produced if len(holders.get(spec.name, ())) < replicas.get(spec.name, 1)]


def copy_wait_s(sizes: Iterable[int]) -> float:
    """How long a success may wait for its copies: the bytes at :data:`COPY_BYTES_PER_S`, 30 s to 10 min."""
    return min(MAX_WAIT_S, max(MIN_WAIT_S, sum(sizes) / COPY_BYTES_PER_S))


def copy_submit(key: str, origin: str, outputs: Sequence[OutputSpec], priority: int, timeout_s: float) -> Submit:
    """The submit of copy plan ``key``: ``outputs`` of plan ``origin`` taken as references, kept as its own.

    It requires nothing of its worker but the copy op (not its producer's tags: any other worker holding a copy
    spares a rebuild; in cluster mode a shard's core sees only its own pools' workers anyway).
    """
    names = [spec.name for spec in outputs]
    return Submit(
        req_id=0, op=COPY_OP, args={"copies": origin}, requirements=Requirements(), priority=priority,
        timeout_s=timeout_s, max_attempts=COPY_MAX_ATTEMPTS, plan_id=key, subscribe=False,
        inputs=[InputSpec(spec.name, spec.size, spec.digest, OutputRef(origin, spec.name)) for spec in outputs],
        outputs=names,
    )
