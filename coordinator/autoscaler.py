"""The autoscaler: how many workers each pool should have (Ray Serve's rule), with no I/O.

Rules (docs/ROUTING.md §Autoscaler):

* A *pool* is the set of workers that meet one requirement signature (op, tags, accelerator,
  model, GPU memory, python env, the devices each plan holds). Its *ongoing* count is its queued
  plans plus the leased and running plans it holds; a worker without the devices a pool's plans
  hold is not one of its workers.
* desired = clamp(ceil(ongoing / per_worker), min_workers, max_workers), where per_worker is
  ``target_per_worker``, or for a pool whose plans hold G devices each, when the operator said
  how many devices a provisioned worker has (``worker_gpus``, ``--autoscale-worker-gpus``), at
  most ``worker_gpus // G`` (the plans one such worker can run at once). A pool whose plans need
  more devices than a provisioned worker has is never scaled: no worker the provider starts could
  run them (:meth:`Autoscaler.unprovisionable` names it).
* The autoscaler remembers a *target* per pool (at first sight: the alive workers it has).
  A desired count above the target must hold for ``upscale_delay_s``, one below it for
  ``downscale_delay_s``, before it is acted on; the level acted on is the one that held the
  whole time (the smallest desired count seen while scaling up, the largest while scaling
  down). A signal that crosses back resets the wait, so a noisy signal never makes it flap.
* No action within ``cooldown_s`` of the pool's previous one.
* An action is a :class:`Decision`; the target becomes its ``desired``. The core sends it to
  admin sessions that follow all plans, as an ``event`` with ``plan_id`` "" and kind
  ``autoscale``, and the server runs the operator's hook command with it as JSON on stdin.
  With a *provider* (coordinator/io/ops/provision.py: ``local`` worker processes or operator
  ``command``s) the server also acts on it; without one, the hook command does.
* Scale-up is bounded by ``max_workers`` and rate-limited: one action adds at most ``max_step``
  workers (0: no step bound), and actions are ``cooldown_s`` apart.
* Scale-down *names* the workers to remove (:func:`pick_removals`: idle first, then the least
  work lost: fewest live plans, then the least run time they would lose). The core drains them
  (``drain_deadline_s``); a provider stops each one only once :func:`drained_out` says so (no
  live plan left: done, or taken back when the drain deadline passed).
* A provider is told what the pool's workers must have (:class:`PoolNeeds`: its op, tags,
  accelerator, model, GPU memory, python env, devices; in every decision's ``needs``), so the
  workers it starts can run the plans that wait.
* An idle worker the provider started that can run none of the plans that wait (it meets no
  pool with ongoing plans while some pool has queued ones) is removed once that held for
  ``downscale_delay_s`` (:func:`unfit_idle`): a decision for the pool :data:`UNFIT_POOL` that names
  it. Only the provider's workers (:attr:`Autoscaler.managed`, set by the driver) are removed so;
  workers an operator started stay theirs.
* A provider that fails is retried with exponential backoff (:class:`Backoff`).

Time comes in as ``now``; nothing here reads a clock.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from coordinator.placement.plan_queue import PlanQueue, Signature
from coordinator.plans import Plan
from coordinator.registry import WorkerRegistry
from coordinator.workers import WorkerRecord

__all__ = [
    "UNFIT_POOL",
    "AutoscaleConfig",
    "Autoscaler",
    "Backoff",
    "Decision",
    "PoolNeeds",
    "PoolSignal",
    "drained_out",
    "pick_removals",
    "pool_name",
    "pool_signals",
    "unfit_idle",
]

UNFIT_POOL = "unfit"
"""The pool of a decision that removes idle workers unable to run what waits (they belong to no pool with work)."""


@dataclass(frozen=True)
class AutoscaleConfig:
    """Autoscaler settings (``fleetwire coordinator --autoscale-*``)."""

    target_per_worker: float = 4.0  # ongoing plans one worker should carry
    min_workers: int = 0
    max_workers: int = 64
    upscale_delay_s: float = 30.0
    downscale_delay_s: float = 600.0
    cooldown_s: float = 60.0
    interval_s: float = 1.0  # how often the signal is sampled
    max_step: int = 0  # most workers one scale-up adds (0: no bound but max_workers)
    drain_deadline_s: float | None = 300.0  # a removed worker's plans are taken back after this (None: never)
    worker_gpus: int | None = None  # devices each provisioned worker has (None: not said; pools scale by plans)

    def check(self) -> None:
        """Raise ``ValueError`` with an actionable message when a setting cannot work."""
        if not self.target_per_worker > 0:
            raise ValueError(f"autoscale target per worker must be > 0, got {self.target_per_worker}")
        if not 0 <= self.min_workers <= self.max_workers:
            raise ValueError(
                f"autoscale bounds must satisfy 0 <= min ({self.min_workers}) <= max ({self.max_workers})"
            )
        for name in ("upscale_delay_s", "downscale_delay_s", "cooldown_s", "interval_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"autoscale {name} must be >= 0, got {getattr(self, name)}")
        if self.max_step < 0:
            raise ValueError(f"autoscale max_step must be >= 0 (0: no bound), got {self.max_step}")
        if self.worker_gpus is not None and self.worker_gpus < 0:
            raise ValueError(
                f"autoscale worker_gpus (devices per provisioned worker) must be >= 0, got {self.worker_gpus}"
            )
        if self.drain_deadline_s is not None and not (
            math.isfinite(self.drain_deadline_s) and self.drain_deadline_s >= 0
        ):
            raise ValueError(f"autoscale drain deadline must be >= 0 seconds, got {self.drain_deadline_s}")


@dataclass(frozen=True)
class PoolNeeds:
    """What a worker must have to run a pool's plans: what a provider is asked to start.

    Sent as the decision's ``needs`` object (:meth:`as_dict`; docs/PROTOCOL.md §Fleet events)
    and, for ``--autoscale-provider command``, in ``FLEETWIRE_NEEDS`` and friends.
    """

    op: str = ""
    tags: tuple[str, ...] = ()  # the worker must carry all of them
    accelerator: str | None = None
    model: str | None = None
    min_gpu_memory_bytes: int = 0  # some GPU with at least this much memory
    python_env: str | None = None
    gpus: int = 0  # devices each plan holds (0: none)
    gpu_share: bool = False  # a share of one device: the worker must share its GPUs (--gpu-share)
    gpu_memory_bytes: int = 0  # each held device has at least this much memory
    gpu_model: str = ""  # each held device's name contains this ("": any)

    @classmethod
    def of(cls, signature: Signature) -> PoolNeeds:
        """The needs of a pool's requirement signature (which workers it avoids is not a need)."""
        need = signature.gpus
        return cls(
            op=signature.op,
            tags=signature.tags,
            accelerator=signature.accelerator,
            model=signature.model,
            min_gpu_memory_bytes=signature.min_gpu_memory_bytes,
            python_env=signature.python_env,
            gpus=need.count if need is not None else 0,
            gpu_share=need is not None and need.shared,
            gpu_memory_bytes=need.min_memory_bytes if need is not None else 0,
            gpu_model=need.accelerator if need is not None else "",
        )

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None) -> PoolNeeds:
        """Back from :meth:`as_dict` (a decision as the driver receives it); missing fields take defaults."""
        if not data:
            return cls()
        return cls(
            op=str(data.get("op", "")),
            tags=tuple(str(t) for t in data.get("tags", ())),
            accelerator=data.get("accelerator"),
            model=data.get("model"),
            min_gpu_memory_bytes=int(data.get("min_gpu_memory_bytes", 0)),
            python_env=data.get("python_env"),
            gpus=int(data.get("gpus", 0)),
            gpu_share=bool(data.get("gpu_share", False)),
            gpu_memory_bytes=int(data.get("gpu_memory_bytes", 0)),
            gpu_model=str(data.get("gpu_model", "")),
        )

    def as_dict(self) -> dict[str, Any]:
        """The needs as the JSON object admins, the hook and the command provider receive."""
        return {
            "op": self.op,
            "tags": list(self.tags),
            "accelerator": self.accelerator,
            "model": self.model,
            "min_gpu_memory_bytes": self.min_gpu_memory_bytes,
            "python_env": self.python_env,
            "gpus": self.gpus,
            "gpu_share": self.gpu_share,
            "gpu_memory_bytes": self.gpu_memory_bytes,
            "gpu_model": self.gpu_model,
        }


@dataclass(frozen=True)
class PoolSignal:
    """One pool's figures at one instant."""

    ongoing: int  # queued + leased + running plans of the pool
    current: int  # alive workers in the pool
    members: tuple[str, ...] = ()  # their ids (scale-down picks among them)
    gpus: int = 0  # devices each plan of the pool holds (0: none)
    waiting: int = 0  # its queued plans (part of ongoing)
    signature: Signature | None = None  # what its workers must meet (None: unknown)

    @property
    def needs(self) -> PoolNeeds:
        """What a worker of the pool must have (empty when the signature is unknown)."""
        return PoolNeeds.of(self.signature) if self.signature is not None else PoolNeeds()


@dataclass(frozen=True)
class Decision:
    """Scale ``pool`` from ``current`` (its target so far) to ``desired`` workers."""

    pool: str
    action: Literal["scale_up", "scale_down"]
    current: int
    desired: int
    ongoing: int
    alive: int
    at_s: float
    held_s: float
    workers: tuple[str, ...] = ()  # scale_down: the workers to remove (drained by the core)
    needs: PoolNeeds = field(default_factory=PoolNeeds)  # what the pool's workers must have
    reason: str = ""  # why, when not the pool's load (the idle workers of UNFIT_POOL)

    def as_dict(self) -> dict[str, Any]:
        """The decision as the JSON object admins and the hook command receive."""
        return {
            "pool": self.pool,
            "action": self.action,
            "current": self.current,
            "desired": self.desired,
            "ongoing": self.ongoing,
            "alive": self.alive,
            "at_s": round(self.at_s, 3),
            "held_s": round(self.held_s, 3),
            "workers": list(self.workers),
            "needs": self.needs.as_dict(),
            "reason": self.reason,
        }


@dataclass
class _PoolState:
    target: int
    up_since: float | None = None
    down_since: float | None = None
    held: int = 0  # the level that held during the current wait
    last_action_s: float | None = None
    last: PoolSignal = field(default_factory=lambda: PoolSignal(0, 0))


class Autoscaler:
    """Per-pool desired worker counts from the ongoing load; see the module docstring.

    Args:
        config: settings.
    """

    def __init__(self, config: AutoscaleConfig) -> None:
        config.check()
        self.config = config
        self.decisions_made = 0
        self._pools: dict[str, _PoolState] = {}
        self._next_sample_s: float | None = None
        self._unprovisionable: dict[str, int] = {}  # pool -> devices its plans hold, more than a worker has
        self.managed: frozenset[str] = frozenset()
        """The workers the provider started (the driver keeps it current): only they are removed as unfit."""
        self._unfit_since: dict[str, float] = {}  # worker -> since when it has been idle and unfit

    def due(self, now: float) -> bool:
        """Whether ``interval_s`` has passed since the last sample (the core samples only then)."""
        if self._next_sample_s is not None and now < self._next_sample_s:
            return False
        self._next_sample_s = now + self.config.interval_s
        return True

    def desired(self, ongoing: int, gpus: int = 0) -> int:
        """clamp(ceil(ongoing / per_worker), min_workers, max_workers); ``gpus``: devices each plan holds."""
        c = self.config
        return min(c.max_workers, max(c.min_workers, math.ceil(ongoing / self.per_worker(gpus))))

    def per_worker(self, gpus: int) -> float:
        """Plans one worker should carry when each holds ``gpus`` devices (module docstring)."""
        c = self.config
        if gpus <= 0 or c.worker_gpus is None:
            return c.target_per_worker
        return max(1, min(c.target_per_worker, c.worker_gpus // gpus)) if c.worker_gpus >= gpus else math.inf

    def unprovisionable(self) -> dict[str, int]:
        """Pools with ongoing plans that need more devices than a provisioned worker has (pool -> devices)."""
        return dict(self._unprovisionable)

    def desired_replicas(self) -> dict[str, int]:
        """The target worker count of every pool seen (read by ``/metrics``)."""
        return {name: state.target for name, state in self._pools.items()}

    def members(self, pool: str) -> tuple[str, ...]:
        """The alive, undrained workers of ``pool`` at its last sample (scale-down picks among them)."""
        state = self._pools.get(pool)
        return state.last.members if state is not None else ()

    def observe(
        self, now: float, signals: Mapping[str, PoolSignal], unfit: Iterable[str] = ()
    ) -> list[Decision]:
        """Take one sample of every pool; returns the decisions it makes now.

        A pool seen before but absent from ``signals`` has nothing ongoing; it is forgotten
        once its target is back at ``min_workers``. ``unfit``: the idle workers that can run
        nothing that waits now (:func:`unfit_idle`); those that stayed so for
        ``downscale_delay_s`` are removed by one decision for :data:`UNFIT_POOL`.
        """
        decisions: list[Decision] = []
        removal = self._remove_unfit(now, tuple(unfit), signals)
        if removal is not None:
            decisions.append(removal)
        self._unprovisionable = {}
        for name in sorted(set(self._pools) | set(signals)):
            signal = signals.get(name)
            if signal is not None and self.per_worker(signal.gpus) == math.inf:
                self._unprovisionable[name] = signal.gpus  # no worker the provider starts could run them
                continue
            state = self._pools.get(name)
            if state is None:
                assert signal is not None
                state = self._pools[name] = _PoolState(target=signal.current)
            if signal is None:
                if state.target <= self.config.min_workers:
                    del self._pools[name]
                    continue
                signal = dataclasses.replace(state.last, ongoing=0, waiting=0)
            state.last = signal
            decision = self._step(name, state, signal, now)
            if decision is not None:
                decisions.append(decision)
        return decisions

    def _step(self, name: str, state: _PoolState, signal: PoolSignal, now: float) -> Decision | None:
        c = self.config
        desired = self.desired(signal.ongoing, signal.gpus)
        if desired > state.target:
            state.down_since = None
            if state.up_since is None:
                state.up_since, state.held = now, desired
            state.held = min(state.held, desired)
            since, delay = state.up_since, c.upscale_delay_s
        elif desired < state.target:
            state.up_since = None
            if state.down_since is None:
                state.down_since, state.held = now, desired
            state.held = max(state.held, desired)
            since, delay = state.down_since, c.downscale_delay_s
        else:
            state.up_since = state.down_since = None
            return None
        if now - since < delay:
            return None
        if state.last_action_s is not None and now - state.last_action_s < c.cooldown_s:
            return None
        held = state.held
        if c.max_step and held > state.target:
            held = min(held, state.target + c.max_step)  # the rate limit: at most max_step per action
        decision = Decision(
            pool=name,
            action="scale_up" if held > state.target else "scale_down",
            current=state.target,
            desired=held,
            ongoing=signal.ongoing,
            alive=signal.current,
            at_s=now,
            held_s=now - since,
            needs=signal.needs,
        )
        state.target = held
        state.up_since = state.down_since = None
        state.last_action_s = now
        self.decisions_made += 1
        return decision


    def _remove_unfit(self, now: float, unfit: tuple[str, ...], signals: Mapping[str, PoolSignal]) -> Decision | None:
        """The decision removing the workers idle and unfit for ``downscale_delay_s`` (None: none yet)."""
        self._unfit_since = {w: self._unfit_since.get(w, now) for w in unfit}
        delay = self.config.downscale_delay_s
        due = tuple(sorted(w for w, since in self._unfit_since.items() if now - since >= delay))
        if not due:
            return None
        held = max(now - self._unfit_since.pop(w) for w in due)  # named once: drained from here on
        self.decisions_made += 1
        return Decision(
            pool=UNFIT_POOL,
            action="scale_down",
            current=len(unfit),
            desired=len(unfit) - len(due),
            ongoing=sum(s.ongoing for s in signals.values()),
            alive=len(unfit),
            at_s=now,
            held_s=held,
            workers=due,
            reason=f"idle for {held:g} s and unable to run any of the plans that wait",
        )


def pool_name(signature: Signature) -> str:
    """A pool's name: its signature in words, e.g. ``op=generate tags=gpu model=llama-3-8b``."""
    parts = [f"op={signature.op}"]
    if signature.tags:
        parts.append("tags=" + ",".join(signature.tags))
    if signature.accelerator is not None:
        parts.append(f"accelerator={signature.accelerator}")
    if signature.model is not None:
        parts.append(f"model={signature.model}")
    if signature.min_gpu_memory_bytes:
        parts.append(f"min_gpu_memory_bytes={signature.min_gpu_memory_bytes}")
    if signature.python_env is not None:
        parts.append(f"python_env={signature.python_env}")
    if signature.gpus is not None:  # pools differing only in devices are different pools
        need = signature.gpus
        parts.append("gpus=" + ("share" if need.shared else str(need.count)))
        if need.min_memory_bytes:
            parts.append(f"gpu_memory_bytes={need.min_memory_bytes}")
        if need.accelerator:
            parts.append(f"gpu_model={need.accelerator}")
    return " ".join(parts)


def pool_signals(
    queue: PlanQueue, registry: WorkerRegistry, plans: Mapping[str, Plan], now: float
) -> dict[str, PoolSignal]:
    """Every pool with ongoing plans: queued ones from the queue, leased/running ones from the leases.

    Cost: one pass over the queue and one over the leases, never over finished plans.
    """
    ongoing: dict[Signature, int] = {}
    waiting: dict[Signature, int] = {}
    for signature, count in queue.counts().items():
        key = signature.avoiding(())
        ongoing[key] = ongoing.get(key, 0) + count
        waiting[key] = waiting.get(key, 0) + count
    for worker in registry:
        for plan_id in worker.leases:
            plan = plans.get(plan_id)
            if plan is not None and not plan.terminal:
                key = Signature.of(plan.op, plan.requirements, gpus=plan.gpus)
                ongoing[key] = ongoing.get(key, 0) + 1
    signals: dict[str, PoolSignal] = {}
    for signature, count in ongoing.items():
        members = registry.matching(signature, signature.meets)
        ids = tuple(w.id for w in members if not w.draining and registry.is_alive(w.id, now))
        gpus = signature.gpus.count if signature.gpus is not None else 0
        signals[pool_name(signature)] = PoolSignal(
            ongoing=count, current=len(ids), members=ids, gpus=gpus, waiting=waiting.get(signature, 0),
            signature=signature,
        )
    return signals


def unfit_idle(
    registry: WorkerRegistry, signals: Mapping[str, PoolSignal], managed: Collection[str], now: float
) -> tuple[str, ...]:
    """The ``managed`` workers that are idle and can run none of the plans that wait.

    Such a worker is alive, not draining, holds no lease, and meets the requirements of no pool
    with ongoing plans (ignoring room), while some pool has queued plans. Nothing waits: none is
    (an idle member of a pool leaves by that pool's scale-down). Cost: the managed workers times
    the pools with ongoing plans, once per sample.
    """
    if not managed or not any(s.waiting for s in signals.values()):
        return ()
    pools = [s.signature for s in signals.values() if s.signature is not None]
    found = []
    for worker_id in sorted(managed):
        if worker_id not in registry:
            continue
        worker = registry.get(worker_id)
        if worker.draining or worker.leases or not registry.is_alive(worker_id, now):
            continue
        if not any(signature.meets(worker) for signature in pools):
            found.append(worker_id)
    return tuple(found)


def pick_removals(
    candidates: Iterable[WorkerRecord], count: int, plans: Mapping[str, Plan], now: float
) -> list[str]:
    """The ``count`` workers to remove from ``candidates``: idle first, then the least work lost.

    Work lost is ranked by the live plans a worker holds, then by the run time those plans
    have behind them (what a drain deadline would throw away); ties go by worker id.
    """
    if count <= 0:
        return []

    def cost(worker: WorkerRecord) -> tuple[int, float, str]:
        live = [plans[p] for p in worker.leases if p in plans and not plans[p].terminal]
        ran = sum(now - p.started_at_s for p in live if p.started_at_s is not None)
        return len(live), ran, worker.id

    return [w.id for w in sorted(candidates, key=cost)[:count]]


def drained_out(registry: WorkerRegistry, plans: Mapping[str, Plan], worker_id: str) -> bool:
    """Whether a worker being removed may be stopped: it is gone, or holds no live plan.

    A drained worker's plans end on their own, or are taken back when its drain deadline
    passes (coordinator/operator_requests.py); either way its leases empty.
    """
    if worker_id not in registry:
        return True
    worker = registry.get(worker_id)
    return not any(p in plans and not plans[p].terminal for p in worker.leases)


class Backoff:
    """Retry spacing for a failing provider: ``base_s`` doubling per failure, at most ``cap_s``.

    Args:
        base_s: the wait after the first failure.
        cap_s: the longest wait.
    """

    def __init__(self, base_s: float = 1.0, cap_s: float = 60.0) -> None:
        self.base_s = base_s
        self.cap_s = cap_s
        self.failures = 0  # in a row
        self.retry_at_s = 0.0

    def failed(self, now: float) -> float:
        """Record a failure; returns how long to wait before the next try."""
        self.failures += 1
        wait = min(self.cap_s, self.base_s * 2.0 ** (self.failures - 1))
        self.retry_at_s = now + wait
        return wait

    def succeeded(self) -> None:
        """A try worked: the next failure waits ``base_s`` again."""
        self.failures = 0
        self.retry_at_s = 0.0

    def ready(self, now: float) -> bool:
        """Whether a try may run now."""
        return now >= self.retry_at_s
