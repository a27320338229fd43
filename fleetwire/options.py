"""Submit arguments: plan ids, requirements and routing hints, checked before anything is sent.

Split out of fleetwire/client.py. The ``TypedDict`` s name the keyword arguments that
``Client.submit`` / ``submit_many`` take, so ``SyncClient`` passes them through unchanged
(one list of options to keep in step, not two).
"""

from __future__ import annotations

import secrets
from collections.abc import Iterable, Mapping
from typing import Any, TypedDict, TypeVar, cast

import msgspec

from protocol.messages import Requirements, Resources, RoutingHints

__all__ = ["SubmitManyOptions", "SubmitOptions", "hints", "new_plan_id", "requirements", "resources"]

S = TypeVar("S", Requirements, RoutingHints, Resources)


class _PlanOptions(TypedDict, total=False):
    tags: Iterable[str] | None
    requirements: Requirements | Mapping[str, Any] | None
    priority: int
    timeout_s: float | None
    max_attempts: int


class SubmitOptions(_PlanOptions, total=False):
    """The keyword arguments of ``Client.submit`` (see it for their meaning)."""

    retries: int
    plan_id: str | None
    hints: RoutingHints | Mapping[str, Any] | None
    session_key: str | None
    policy: str | None
    inputs: Mapping[str, Any] | None  # name -> bytes | memoryview | pathlib.Path | binary file (fleetwire/data.py)
    outputs: Iterable[str] | Mapping[str, Mapping[str, Any] | None]  # names, or names with options (replicas)
    relay: bool  # inputs and outputs through the coordinator (fleetwire/relay.py)
    resources: Resources | Mapping[str, Any] | None  # devices it holds: {"gpus": 2, "gpu_memory_gb": 40, ...}
    after: Iterable[Any]  # plans (Plan, SyncPlan) or plan ids that must succeed first (docs/SEMANTICS.md §Graphs)
    deterministic: bool  # running it again gives the same outputs (a lost one may be made again)
    preemptible: bool  # it may be stopped and queued again for another team's plan (docs/SEMANTICS.md §Preemption)
    deadline_s: float | None  # it may finish within this many seconds: held for a greener hour (§Deadlines)
    deadline_at: Any  # the same as a time: Unix seconds or an aware datetime
    expected_run_s: float | None  # how long it runs (else its op's observed median)


class SubmitManyOptions(_PlanOptions, total=False):
    """The keyword arguments of ``Client.submit_many`` (see it for their meaning)."""

    plan_ids: Iterable[str | None] | None


def new_plan_id() -> str:
    """A plan id made by the SDK: the coordinator's format, so it is also the idempotency key."""
    return secrets.token_hex(8)


def _struct(value: S | Mapping[str, Any] | None, cls: type[S], what: str) -> S:
    """``value`` as a ``cls``: itself, the default when None, or converted from a dict of its fields."""
    if value is None:
        return cls()
    if isinstance(value, cls):
        return value
    mapping = cast("Mapping[str, Any]", value)  # isinstance on a TypeVar's class does not narrow for mypy
    fields = cls.__struct_fields__
    unknown = sorted(set(mapping) - set(fields))
    if unknown:
        raise ValueError(f"unknown {what} {unknown}; known: {', '.join(fields)}")
    try:
        return msgspec.convert(dict(mapping), cls)
    except msgspec.ValidationError as exc:
        raise ValueError(f"invalid {what}: {exc}") from exc


def hints(value: RoutingHints | Mapping[str, Any] | None, session_key: str | None, policy: str | None) -> RoutingHints:
    """The routing hints of a submit; ``session_key`` and ``policy`` override the fields of ``value``."""
    routing = _struct(value, RoutingHints, "hints")
    if session_key is not None:
        routing = msgspec.structs.replace(routing, session_key=session_key)
    if policy is not None:
        routing = msgspec.structs.replace(routing, policy=policy)
    return routing


def resources(value: Resources | Mapping[str, Any] | None) -> Resources | None:
    """The device request of a submit (None: none); the coordinator checks the numbers."""
    if value is None:
        return None
    found = _struct(value, Resources, "resources")
    return found if found.gpus or found.gpu_memory_gb or found.accelerator else None


def requirements(value: Requirements | Mapping[str, Any] | None, tags: Iterable[str] | None) -> Requirements:
    """The requirements of a submit; ``tags`` are added to ``value``'s tags."""
    reqs = _struct(value, Requirements, "requirements")
    if tags is not None:
        if isinstance(tags, str):
            raise TypeError("tags must be a list of strings, not one string")
        extra = [tag for tag in tags if tag not in reqs.tags]
        if extra:
            reqs = msgspec.structs.replace(reqs, tags=[*reqs.tags, *extra])
    return reqs
