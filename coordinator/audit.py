"""Read-only checks of a ``Coordinator``'s state: a comparable snapshot and consistency rules.

Used by the security tests ("every refusal leaves the state exactly as it was": snapshot
before, refuse, snapshot after, compare), by the property-based fuzz tests and by
``bench/fuzz_live.py`` (state violations after each hostile input). Nothing here changes
the core; it reads the same attributes the core's own tests read.

Consistency rules (:func:`violations`), each a fact the core maintains after every input:

* a plan in the queue is ``queued``, and a ``queued`` plan is in the queue;
* a worker's lease names a known plan whose ``worker_id`` is that worker;
* a ``leased``/``running`` plan whose worker is registered is among that worker's leases;
* a plan's held events have strictly increasing ``seq``, all below ``next_seq``;
* a terminal plan's last held event is its terminal event, and it is not in the queue.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import TYPE_CHECKING, Any

import msgspec

if TYPE_CHECKING:
    from coordinator.core import Coordinator

__all__ = ["snapshot", "violations"]

_TERMINAL = frozenset({"succeeded", "failed", "cancelled"})


def _freeze(value: Any) -> Any:
    """A hashable, comparable copy of a state value (dataclass, Struct, container or scalar)."""
    if isinstance(value, msgspec.Struct):
        return _freeze(msgspec.to_builtins(value, builtin_types=(bytes,)))
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return tuple((f.name, _freeze(getattr(value, f.name))) for f in dataclasses.fields(value))
    if isinstance(value, dict):
        return tuple(sorted(((repr(k), _freeze(v)) for k, v in value.items()), key=lambda kv: kv[0]))
    if isinstance(value, list | tuple):
        return tuple(_freeze(v) for v in value)
    if isinstance(value, set | frozenset):
        return tuple(sorted(repr(v) for v in value))
    return value


def _attributes(value: object) -> dict[str, Any]:
    """An object's attributes: its ``vars()``, or those mypyc lists for a class it compiled (setup.py)."""
    names = getattr(type(value), "__mypyc_attrs__", None)
    if names is None:
        return vars(value)
    return {name: getattr(value, name) for name in names if name != "__dict__" and hasattr(value, name)}


def snapshot(core: Coordinator) -> Any:
    """Everything a refusal must not change: plans, registry, queue and subscriptions.

    Session bookkeeping (protocol-error counts, the refused session itself) and metrics
    counters are left out: they record the refusal, which is the point.
    """
    plans = tuple(sorted((pid, _freeze(plan)) for pid, plan in core.plans.items()))
    workers = tuple((record.id, _freeze(record)) for record in core.registry)
    queued = tuple(sorted(pid for pid in core.plans if pid in core.queue))
    subscriptions = _freeze(_attributes(core.subscriptions))
    return plans, workers, queued, subscriptions


def violations(core: Coordinator) -> list[str]:
    """Every consistency rule the state breaks now, in words; empty when consistent."""
    found: list[str] = []
    registry = core.registry
    for pid, plan in core.plans.items():
        in_queue = pid in core.queue
        if in_queue and plan.state != "queued":
            found.append(f"plan {pid} is in the queue but {plan.state}")
        if plan.state == "queued" and not in_queue:
            found.append(f"plan {pid} is queued but not in the queue")
        if plan.state in ("leased", "running"):
            if plan.worker_id is None:
                found.append(f"plan {pid} is {plan.state} without a worker")
            elif plan.worker_id in registry and pid not in registry.get(plan.worker_id).leases:
                found.append(f"plan {pid} is {plan.state} on {plan.worker_id}, which does not hold its lease")
        seqs = [event.seq for event in plan.events]
        if any(b <= a for a, b in itertools.pairwise(seqs)) or (seqs and seqs[-1] >= plan.next_seq):
            found.append(f"plan {pid} events are out of order: {seqs[-5:]} (next_seq {plan.next_seq})")
        if plan.state in _TERMINAL and plan.events and plan.events[-1].kind != plan.state:
            found.append(f"plan {pid} is {plan.state} but its last event is {plan.events[-1].kind!r}")
    for record in registry:
        for pid in record.leases:
            held = core.plans.get(pid)
            if held is None:
                found.append(f"worker {record.id} holds a lease on unknown plan {pid}")
            elif held.worker_id != record.id:
                found.append(f"worker {record.id} holds {pid}, whose worker is {held.worker_id}")
    return found
