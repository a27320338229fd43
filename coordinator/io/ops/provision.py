"""Autoscaler providers: the I/O half that starts and stops workers (docs/ROUTING.md §Autoscaler).

The core decides (coordinator/autoscaler.py): a ``scale_up`` decision says how many workers a
pool should have and what they need (:class:`~coordinator.autoscaler.PoolNeeds`); a ``scale_down``
one names the workers to remove, which the core has already drained. :class:`Provisioner` acts
on them with a :class:`Provider`:

* ``local`` (:class:`LocalProvider`): ``fleetwire worker`` processes on this host
  (``fleetwire up --autoscale 1..8``), started with the tags the pool's plans require. It stops
  only the processes it started.
* ``command`` (:class:`CommandProvider`): the operator's start and stop shell commands, run with
  ``FLEETWIRE_POOL``, ``FLEETWIRE_COUNT`` and ``FLEETWIRE_WORKER_IDS`` (space-separated) in their
  environment, and for a start what the pool's workers need: ``FLEETWIRE_NEEDS`` (JSON),
  ``FLEETWIRE_TAGS``, ``FLEETWIRE_ACCELERATOR``, ``FLEETWIRE_MODEL``, ``FLEETWIRE_GPUS`` (a systemd
  template, a cloud CLI; docs/OPERATIONS.md §Autoscaling). The commands run detached
  (coordinator/io/ops/hooks.py ``run_detached``): a start command that leaves the worker running in
  the background succeeds when it exits 0.

Rules:

* Scale-up starts ``desired - alive - starting`` workers for the pool (``starting``: the ones
  started for it that have not registered yet), never more than ``max_workers`` in flight
  (started and not stopped); the core bounds each step (``max_step``) and spaces actions
  (``cooldown_s``). Worker ids are ``<prefix>-<n>``, never reused within a run.
* A ``local`` worker process that exits on its own (not stopped by us) counts as a provider
  failure: it is replaced, with the needs it was started with, after the backoff.
* A worker to remove is stopped only once :func:`~coordinator.autoscaler.drained_out` says so:
  its plans are done, or the drain deadline passed and the core took them back.
* Provider calls run in tasks of their own, one at a time per (start or stop, pool): a slow
  start for one pool never holds up a stop, nor a start for another pool, nor the coordinator.
  A call that fails (an exception, a command that exits non-zero or runs past ``timeout_s``) is
  retried with exponential backoff (:class:`~coordinator.autoscaler.Backoff`, one per call kind
  and pool), counted in :attr:`ProviderStatus.failures`
  (``fleetwire_autoscaler_provider_failures_total``) and reported to admin followers as an
  ``autoscale`` event with action ``provider_failed`` (the dashboard shows it).
* The workers started and not stopped are the autoscaler's :attr:`~coordinator.autoscaler.Autoscaler.managed`:
  those it may remove for idling while unable to run what waits.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
from collections.abc import Callable, Coroutine, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import structlog

from coordinator.autoscaler import Backoff, PoolNeeds, drained_out
from coordinator.io.ops.hooks import run_detached

__all__ = ["CommandProvider", "LocalProvider", "Provider", "ProviderError", "ProviderStatus", "Provisioner"]

log = structlog.get_logger(__name__)


class ProviderError(Exception):
    """A provider could not start or stop workers; the message says why."""


class Provider(Protocol):
    """Starts and stops workers. ``name`` labels it in logs and metrics."""

    name: str

    async def start(self, pool: str, worker_ids: Sequence[str], needs: PoolNeeds) -> None:
        """Start these workers (they register with these ids) able to meet ``needs``; raise
        :class:`ProviderError` on failure."""
        ...

    async def stop(self, pool: str, worker_ids: Sequence[str]) -> None:
        """Stop these workers; raise :class:`ProviderError` on failure."""
        ...

    async def close(self) -> None:
        """Stop whatever this provider owns (the coordinator is stopping)."""
        ...


@dataclass
class ProviderStatus:
    """What ``/metrics`` shows of the provisioner (coordinator/io/ops/metrics.py reads it duck-typed)."""

    provider: str
    failures: int = 0
    workers: dict[str, int] = field(default_factory=lambda: {"starting": 0, "running": 0, "draining": 0})
    last_error: str = ""


class LocalProvider:
    """Worker processes on this host.

    Args:
        argv: the command line of one worker, given its id and what it must have
            (``fleetwire worker --id ID --tags ...``: `up` gives it the tags the pool's plans require).
        env: its environment (the worker token goes here, never on the command line).
        grace_s: how long a stopped worker has after SIGTERM before SIGKILL.
    """

    name = "local"

    def __init__(
        self, argv: Callable[[str, PoolNeeds], list[str]], env: Mapping[str, str], grace_s: float = 10.0
    ) -> None:
        self._argv = argv
        self._env = dict(env)
        self.grace_s = grace_s
        self.procs: dict[str, asyncio.subprocess.Process] = {}

    async def start(self, pool: str, worker_ids: Sequence[str], needs: PoolNeeds) -> None:
        """Spawn one process per id; a spawn that fails raises :class:`ProviderError`."""
        for worker_id in worker_ids:
            try:
                self.procs[worker_id] = await asyncio.create_subprocess_exec(
                    *self._argv(worker_id, needs), env=self._env, stdin=asyncio.subprocess.DEVNULL,
                    stdout=asyncio.subprocess.DEVNULL,
                )
            except OSError as exc:
                raise ProviderError(f"cannot start worker {worker_id}: {exc}") from exc
            log.info("autoscaler started a local worker", worker_id=worker_id, pool=pool, tags=list(needs.tags),
                     pid=self.procs[worker_id].pid)

    async def stop(self, pool: str, worker_ids: Sequence[str]) -> None:
        """SIGTERM, then SIGKILL after ``grace_s``; ids this provider did not start are skipped."""
        procs = [(w, self.procs.pop(w)) for w in worker_ids if w in self.procs]
        await asyncio.gather(*(self._end(p) for _, p in procs))
        for worker_id, proc in procs:
            log.info("autoscaler stopped a local worker", worker_id=worker_id, pool=pool, status=proc.returncode)

    def exited(self) -> list[str]:
        """The ids of processes that ended on their own (forgotten here)."""
        gone = [w for w, p in self.procs.items() if p.returncode is not None]
        for worker_id in gone:
            del self.procs[worker_id]
        return gone

    async def close(self) -> None:
        """Stop every process this provider started."""
        procs, self.procs = list(self.procs.values()), {}
        await asyncio.gather(*(self._end(p) for p in procs))

    async def _end(self, proc: asyncio.subprocess.Process) -> None:
        if proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                proc.terminate()
        try:
            await asyncio.wait_for(proc.wait(), self.grace_s)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()


def needs_environment(needs: PoolNeeds) -> dict[str, str]:
    """What a start command is told the pool's workers need (docs/OPERATIONS.md §Environment variables)."""
    return {
        "FLEETWIRE_NEEDS": json.dumps(needs.as_dict(), separators=(",", ":")),
        "FLEETWIRE_TAGS": ",".join(needs.tags),  # as `fleetwire worker --tags` takes them
        "FLEETWIRE_ACCELERATOR": needs.accelerator or "",
        "FLEETWIRE_MODEL": needs.model or "",
        "FLEETWIRE_GPUS": str(needs.gpus),
    }


class CommandProvider:
    """The operator's shell commands, run detached; see the module docstring for their environment.

    Args:
        start_command: run to start workers (None: this provider cannot scale up).
        stop_command: run to stop workers (None: drained workers are left for the operator).
        timeout_s: how long one run may take (then it is killed with its process group and counts
            as a failure). A command that starts a worker in the background is done when it exits.
    """

    name = "command"

    def __init__(self, start_command: str | None, stop_command: str | None, timeout_s: float = 120.0) -> None:
        self.start_command = start_command
        self.stop_command = stop_command
        self.timeout_s = timeout_s

    async def start(self, pool: str, worker_ids: Sequence[str], needs: PoolNeeds) -> None:
        """Run the start command for these workers, telling it what they need."""
        if self.start_command is not None:
            await self._run(self.start_command, "start", pool, worker_ids, needs_environment(needs))

    async def stop(self, pool: str, worker_ids: Sequence[str]) -> None:
        """Run the stop command for these workers."""
        if self.stop_command is not None:
            await self._run(self.stop_command, "stop", pool, worker_ids, {})

    async def close(self) -> None:
        """Nothing: the operator's machines outlive the coordinator."""

    async def _run(
        self, command: str, action: str, pool: str, worker_ids: Sequence[str], extra: Mapping[str, str]
    ) -> None:
        env = {**os.environ, "FLEETWIRE_ACTION": action, "FLEETWIRE_POOL": pool,
               "FLEETWIRE_COUNT": str(len(worker_ids)), "FLEETWIRE_WORKER_IDS": " ".join(worker_ids), **extra}
        try:
            finished = await run_detached(command, env=env, timeout_s=self.timeout_s)
        except OSError as exc:
            raise ProviderError(f"{action} command could not start: {exc}") from exc
        tail = finished.output[-500:]
        if finished.status is None:
            raise ProviderError(f"{action} command ran past {self.timeout_s:g} s and was killed: {tail}")
        if finished.status != 0:
            raise ProviderError(f"{action} command exited with status {finished.status}: {tail}")
        log.info("autoscaler command ran", action=action, pool=pool, workers=list(worker_ids), output=tail)


@dataclass
class _Up:
    desired: int
    alive: int
    needs: PoolNeeds


_Key = tuple[str, str]  # (call: "start" or "stop", pool): one call in flight per key, with its own backoff


class Provisioner:
    """Acts on autoscaler decisions with a provider; see the module docstring.

    Args:
        provider: starts and stops workers.
        registry, plans: the core's (read to see which workers registered and which drained out).
        max_workers: the most workers this provisioner keeps started at once.
        min_workers: started at :meth:`start`.
        notify: called with a JSON-able dict to tell admin followers (``Coordinator.autoscale_note``).
        prefix: worker ids are ``<prefix>-<n>``.
        backoff: retry spacing after a failed call (each call kind and pool gets its own of these figures).
        clock: monotonic seconds (the server's ``time.monotonic``).
        autoscaler: the core's autoscaler, told which workers this provisioner started (its ``managed``).
    """

    def __init__(
        self,
        provider: Provider,
        *,
        registry: Any,
        plans: Mapping[str, Any],
        max_workers: int,
        min_workers: int = 0,
        notify: Callable[[dict[str, Any]], None] | None = None,
        prefix: str = "auto",
        backoff: Backoff | None = None,
        clock: Callable[[], float],
        autoscaler: Any = None,
    ) -> None:
        self.provider = provider
        self.status = ProviderStatus(provider=provider.name)
        self._registry = registry
        self._plans = plans
        self.max_workers = max_workers
        self.min_workers = min_workers
        self._notify = notify
        self._prefix = prefix
        self._backoff = backoff or Backoff()  # the figures each key's backoff takes
        self._backoffs: dict[_Key, Backoff] = {}
        self._clock = clock
        self._autoscaler = autoscaler
        self._serial = 0
        self.owned: set[str] = set()  # started and not stopped
        self._started: dict[str, tuple[str, PoolNeeds]] = {}  # owned worker id -> the pool and needs it was started for
        self._up: dict[str, _Up] = {}  # pool -> the scale-up still to do
        self._stopping: dict[str, str] = {}  # worker id -> pool: drained, stopped once drained out
        self._stopping_now: set[str] = set()  # ... of those, the ones a stop call in flight is stopping
        self._replace: list[tuple[str, PoolNeeds]] = []  # local workers that exited on their own, to start again
        self._calls: dict[_Key, asyncio.Task[None]] = {}

    def start(self) -> None:
        """Start ``min_workers`` (on the event loop, in the background)."""
        if self.min_workers:
            self._up["*"] = _Up(desired=self.min_workers, alive=0, needs=PoolNeeds())
        self.step()

    def decided(self, decisions: Iterable[dict[str, Any]]) -> None:
        """Take the core's decisions; the work happens in :meth:`step`."""
        for d in decisions:
            pool = str(d.get("pool", ""))
            if d.get("action") == "scale_up":
                self._up[pool] = _Up(desired=int(d.get("desired", 0)), alive=int(d.get("alive", 0)),
                                     needs=PoolNeeds.from_dict(d.get("needs")))
            elif d.get("action") == "scale_down":
                self._up.pop(pool, None)
                for worker_id in d.get("workers", ()):
                    self._stopping[str(worker_id)] = pool
        self.step()

    def step(self) -> None:
        """Start every provider call that is due, has none of its kind in flight and whose backoff allows."""
        self._refresh()
        now = self._clock()
        stops: dict[str, list[str]] = {}
        for worker_id, pool in self._stopping.items():
            if worker_id not in self._stopping_now and drained_out(self._registry, self._plans, worker_id):
                stops.setdefault(pool, []).append(worker_id)
        for pool, ids in stops.items():
            if self._free(("stop", pool), now):
                self._stopping_now.update(ids)
                self._launch(("stop", pool), self._stop(pool, sorted(ids)))
        while self._replace and self.max_workers > len(self.owned):
            pool, needs = self._replace[0]
            if not self._free(("start", pool), now):
                break
            same = [r for r in self._replace if r == (pool, needs)][: self.max_workers - len(self.owned)]
            self._begin_start(pool, len(same), needs, None)
        for pool, up in list(self._up.items()):
            if not self._free(("start", pool), now):
                continue  # looked at again once the call in flight for the pool is done
            count = min(self.max_workers - len(self.owned), up.desired - up.alive - len(self._starting(pool)))
            if count <= 0:
                del self._up[pool]
                continue
            self._begin_start(pool, count, up.needs, up)
        self._refresh()

    async def settled(self) -> None:
        """Wait for the provider calls in flight, if any (tests, benches)."""
        while self._calls:
            await asyncio.gather(*self._calls.values(), return_exceptions=True)

    async def close(self) -> None:
        """Wait for the calls in flight, then let the provider stop what it owns."""
        await self.settled()
        await self.provider.close()

    # ------------------------------------------------------------------ internals

    def _starting(self, pool: str | None = None) -> list[str]:
        """Owned workers not registered yet (started for ``pool``, or for any pool)."""
        return [w for w in self.owned if w not in self._registry and (pool is None or self._started[w][0] == pool)]

    def _free(self, key: _Key, now: float) -> bool:
        """Whether a call of this kind may start: none in flight, and its backoff allows."""
        backoff = self._backoffs.get(key)
        return key not in self._calls and (backoff is None or backoff.ready(now))

    def _launch(self, key: _Key, call: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(call)
        self._calls[key] = task

        def forget(done: asyncio.Task[None]) -> None:
            if self._calls.get(key) is done:
                del self._calls[key]

        task.add_done_callback(forget)

    def _begin_start(self, pool: str, count: int, needs: PoolNeeds, up: _Up | None) -> None:
        ids = self._new_ids(count)
        self.owned.update(ids)  # counted as starting at once, so the next decision does not double up
        for worker_id in ids:
            self._started[worker_id] = (pool, needs)
        if up is None:
            for _ in ids:
                self._replace.remove((pool, needs))
        self._launch(("start", pool), self._start(pool, ids, needs, up))

    def _refresh(self) -> None:
        if isinstance(self.provider, LocalProvider):
            for worker_id in self.provider.exited():
                if worker_id in self.owned:
                    self.owned.discard(worker_id)
                    pool, needs = self._started.pop(worker_id, ("*", PoolNeeds()))
                    if self._stopping.pop(worker_id, None) is None:  # not one we were removing: replace it
                        self._replace.append((pool, needs))
                        self._failed(("start", pool), [worker_id], f"local worker {worker_id} exited on its own")
        starting = len(self._starting())
        draining = sum(1 for w in self.owned if w in self._stopping)
        self.status.workers = {"starting": starting, "running": len(self.owned) - starting - draining,
                               "draining": draining}
        if self._autoscaler is not None:
            self._autoscaler.managed = frozenset(self.owned)

    def _new_ids(self, count: int) -> list[str]:
        ids = []
        for _ in range(count):
            self._serial += 1
            ids.append(f"{self._prefix}-{self._serial}")
        return ids

    async def _start(self, pool: str, ids: list[str], needs: PoolNeeds, up: _Up | None) -> None:
        key = ("start", pool)
        try:
            await self.provider.start(pool, ids, needs)
        except Exception as exc:  # a provider's failure is retried, never fatal
            self.owned.difference_update(ids)
            for worker_id in ids:
                self._started.pop(worker_id, None)
            if up is None:
                self._replace.extend((pool, needs) for _ in ids)
            self._failed(key, ids, str(exc) or type(exc).__name__)
            self._refresh()
            return
        if up is not None and self._up.get(pool) is up:  # a newer decision for the pool stays to be looked at
            del self._up[pool]
        self._succeeded(key)

    async def _stop(self, pool: str, ids: list[str]) -> None:
        key = ("stop", pool)
        try:
            await self.provider.stop(pool, ids)
        except Exception as exc:  # a provider's failure is retried, never fatal
            self._failed(key, ids, str(exc) or type(exc).__name__)
            return
        finally:
            self._stopping_now.difference_update(ids)
        for worker_id in ids:
            self._stopping.pop(worker_id, None)
            self.owned.discard(worker_id)
            self._started.pop(worker_id, None)
        self._succeeded(key)

    def _succeeded(self, key: _Key) -> None:
        backoff = self._backoffs.get(key)
        if backoff is not None:
            backoff.succeeded()
        self._refresh()

    def _failed(self, key: _Key, ids: list[str], error: str) -> None:
        action, pool = key
        self.status.failures += 1
        self.status.last_error = error
        backoff = self._backoffs.setdefault(key, Backoff(self._backoff.base_s, self._backoff.cap_s))
        wait = backoff.failed(self._clock())
        log.error("autoscaler provider failed", provider=self.provider.name, action=action, pool=pool,
                  workers=ids, error=error, retry_in_s=round(wait, 3))
        if self._notify is not None:
            self._notify({"action": "provider_failed", "provider": self.provider.name, "pool": pool,
                          "call": action, "workers": ids, "error": error[:500],
                          "failures": self.status.failures, "retry_in_s": round(wait, 3)})
