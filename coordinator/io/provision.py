"""Autoscaler providers: the I/O half that starts and stops workers (docs/ROUTING.md §Autoscaler).

The core decides (coordinator/autoscaler.py): a ``scale_up`` decision says how many workers a
pool should have; a ``scale_down`` one names the workers to remove, which the core has already
drained. :class:`Provisioner` acts on them with a :class:`Provider`:

* ``local`` (:class:`LocalProvider`): ``fleetwire worker`` processes on this host
  (``fleetwire up --autoscale 1..8``). It stops only the processes it started.
* ``command`` (:class:`CommandProvider`): the operator's start and stop shell commands, run with
  ``FLEETWIRE_POOL``, ``FLEETWIRE_COUNT`` and ``FLEETWIRE_WORKER_IDS`` (space-separated) in their
  environment (a systemd template, a cloud CLI; docs/OPERATIONS.md §Autoscaling).

Rules:

* Scale-up starts ``desired - alive - starting`` workers, never more than ``max_workers`` in
  flight (started and not stopped); the core bounds each step (``max_step``) and spaces actions
  (``cooldown_s``). Worker ids are ``<prefix>-<n>``, never reused within a run.
* A ``local`` worker process that exits on its own (not stopped by us) counts as a provider
  failure: it is replaced, after the backoff.
* A worker to remove is stopped only once :func:`~coordinator.autoscaler.drained_out` says so:
  its plans are done, or the drain deadline passed and the core took them back.
* One provider call runs at a time, in its own task: a slow provider never blocks the
  coordinator. A call that fails (an exception, a command that exits non-zero or runs past
  ``timeout_s``) is retried with exponential backoff (:class:`~coordinator.autoscaler.Backoff`),
  counted in :attr:`ProviderStatus.failures` (``fleetwire_autoscaler_provider_failures_total``)
  and reported to admin followers as an ``autoscale`` event with action ``provider_failed``
  (the dashboard shows it).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import structlog

from coordinator.autoscaler import Backoff, drained_out

__all__ = ["CommandProvider", "LocalProvider", "Provider", "ProviderError", "ProviderStatus", "Provisioner"]

log = structlog.get_logger(__name__)


class ProviderError(Exception):
    """A provider could not start or stop workers; the message says why."""


class Provider(Protocol):
    """Starts and stops workers. ``name`` labels it in logs and metrics."""

    name: str

    async def start(self, pool: str, worker_ids: Sequence[str]) -> None:
        """Start these workers (they register with these ids); raise :class:`ProviderError` on failure."""
        ...

    async def stop(self, pool: str, worker_ids: Sequence[str]) -> None:
        """Stop these workers; raise :class:`ProviderError` on failure."""
        ...

    async def close(self) -> None:
        """Stop whatever this provider owns (the coordinator is stopping)."""
        ...


@dataclass
class ProviderStatus:
    """What ``/metrics`` shows of the provisioner (coordinator/io/metrics.py reads it duck-typed)."""

    provider: str
    failures: int = 0
    workers: dict[str, int] = field(default_factory=lambda: {"starting": 0, "running": 0, "draining": 0})
    last_error: str = ""


class LocalProvider:
    """Worker processes on this host.

    Args:
        argv: the command line of one worker, given its id (``fleetwire worker --id ID ...``).
        env: its environment (the worker token goes here, never on the command line).
        grace_s: how long a stopped worker has after SIGTERM before SIGKILL.
    """

    name = "local"

    def __init__(self, argv: Callable[[str], list[str]], env: Mapping[str, str], grace_s: float = 10.0) -> None:
        self._argv = argv
        self._env = dict(env)
        self.grace_s = grace_s
        self.procs: dict[str, asyncio.subprocess.Process] = {}

    async def start(self, pool: str, worker_ids: Sequence[str]) -> None:
        """Spawn one process per id; a spawn that fails raises :class:`ProviderError`."""
        for worker_id in worker_ids:
            try:
                self.procs[worker_id] = await asyncio.create_subprocess_exec(
                    *self._argv(worker_id), env=self._env, stdin=asyncio.subprocess.DEVNULL,
                    stdout=asyncio.subprocess.DEVNULL,
                )
            except OSError as exc:
                raise ProviderError(f"cannot start worker {worker_id}: {exc}") from exc
            log.info("autoscaler started a local worker", worker_id=worker_id, pool=pool,
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


class CommandProvider:
    """The operator's shell commands; see the module docstring for their environment.

    Args:
        start_command: run to start workers (None: this provider cannot scale up).
        stop_command: run to stop workers (None: drained workers are left for the operator).
        timeout_s: how long one run may take (then it is killed and counts as a failure).
    """

    name = "command"

    def __init__(self, start_command: str | None, stop_command: str | None, timeout_s: float = 120.0) -> None:
        self.start_command = start_command
        self.stop_command = stop_command
        self.timeout_s = timeout_s

    async def start(self, pool: str, worker_ids: Sequence[str]) -> None:
        """Run the start command for these workers."""
        if self.start_command is not None:
            await self._run(self.start_command, "start", pool, worker_ids)

    async def stop(self, pool: str, worker_ids: Sequence[str]) -> None:
        """Run the stop command for these workers."""
        if self.stop_command is not None:
            await self._run(self.stop_command, "stop", pool, worker_ids)

    async def close(self) -> None:
        """Nothing: the operator's machines outlive the coordinator."""

    async def _run(self, command: str, action: str, pool: str, worker_ids: Sequence[str]) -> None:
        env = {**os.environ, "FLEETWIRE_ACTION": action, "FLEETWIRE_POOL": pool,
               "FLEETWIRE_COUNT": str(len(worker_ids)), "FLEETWIRE_WORKER_IDS": " ".join(worker_ids)}
        try:
            proc = await asyncio.create_subprocess_shell(
                command, env=env, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.STDOUT,
            )
        except OSError as exc:
            raise ProviderError(f"{action} command could not start: {exc}") from exc
        try:
            output, _ = await asyncio.wait_for(proc.communicate(), self.timeout_s)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()
            raise ProviderError(f"{action} command ran past {self.timeout_s:g} s and was killed") from None
        tail = output.decode(errors="replace")[-500:].strip()
        if proc.returncode != 0:
            raise ProviderError(f"{action} command exited with status {proc.returncode}: {tail}")
        log.info("autoscaler command ran", action=action, pool=pool, workers=list(worker_ids), output=tail)


@dataclass
class _Up:
    desired: int
    alive: int


class Provisioner:
    """Acts on autoscaler decisions with a provider; see the module docstring.

    Args:
        provider: starts and stops workers.
        registry, plans: the core's (read to see which workers registered and which drained out).
        max_workers: the most workers this provisioner keeps started at once.
        min_workers: started at :meth:`start`.
        notify: called with a JSON-able dict to tell admin followers (``Coordinator.autoscale_note``).
        prefix: worker ids are ``<prefix>-<n>``.
        backoff: retry spacing after a failed call.
        clock: monotonic seconds (the server's ``time.monotonic``).
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
    ) -> None:
        self.provider = provider
        self.status = ProviderStatus(provider=provider.name)
        self._registry = registry
        self._plans = plans
        self.max_workers = max_workers
        self.min_workers = min_workers
        self._notify = notify
        self._prefix = prefix
        self._backoff = backoff or Backoff()
        self._clock = clock
        self._serial = 0
        self.owned: set[str] = set()  # started and not stopped
        self._up: dict[str, _Up] = {}  # pool -> the scale-up still to do
        self._stopping: dict[str, str] = {}  # worker id -> pool: drained, stopped once drained out
        self._replace = 0  # local workers that exited on their own, to start again
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        """Start ``min_workers`` (on the event loop, in the background)."""
        if self.min_workers:
            self._up["*"] = _Up(desired=self.min_workers, alive=0)
        self.step()

    def decided(self, decisions: Iterable[dict[str, Any]]) -> None:
        """Take the core's decisions; the work happens in :meth:`step`."""
        for d in decisions:
            pool = str(d.get("pool", ""))
            if d.get("action") == "scale_up":
                self._up[pool] = _Up(desired=int(d.get("desired", 0)), alive=int(d.get("alive", 0)))
            elif d.get("action") == "scale_down":
                self._up.pop(pool, None)
                for worker_id in d.get("workers", ()):
                    self._stopping[str(worker_id)] = pool
        self.step()

    def step(self) -> None:
        """Start the next provider call if none runs and the backoff allows (each reaper tick)."""
        self._refresh()
        if self._task is not None and not self._task.done():
            return
        if not self._backoff.ready(self._clock()):
            return
        call = self._next_call()
        if call is not None:
            self._task = asyncio.get_running_loop().create_task(call)

    async def settled(self) -> None:
        """Wait for the provider call in flight, if any (tests, benches)."""
        if self._task is not None:
            with contextlib.suppress(Exception):
                await self._task

    async def close(self) -> None:
        """Wait for the call in flight, then let the provider stop what it owns."""
        if self._task is not None:
            with contextlib.suppress(Exception):
                await self._task
        await self.provider.close()

    # ------------------------------------------------------------------ internals

    def _starting(self) -> list[str]:
        return [w for w in self.owned if w not in self._registry]

    def _refresh(self) -> None:
        if isinstance(self.provider, LocalProvider):
            for worker_id in self.provider.exited():
                if worker_id in self.owned:
                    self.owned.discard(worker_id)
                    if self._stopping.pop(worker_id, None) is None:  # not one we were removing: replace it
                        self._replace += 1
                        self._failed("start", "*", [worker_id], f"local worker {worker_id} exited on its own")
        starting = len(self._starting())
        draining = sum(1 for w in self.owned if w in self._stopping)
        self.status.workers = {"starting": starting, "running": len(self.owned) - starting - draining,
                               "draining": draining}

    def _next_call(self) -> Any:
        done = [w for w in self._stopping if drained_out(self._registry, self._plans, w)]
        if done:
            by_pool: dict[str, list[str]] = {}
            for worker_id in done:
                by_pool.setdefault(self._stopping[worker_id], []).append(worker_id)
            pool, ids = next(iter(by_pool.items()))
            return self._call("stop", pool, sorted(ids), None)
        if self._replace and self.max_workers > len(self.owned):
            count = min(self._replace, self.max_workers - len(self.owned))
            return self._call("start", "*", self._new_ids(count), None)
        for pool, up in list(self._up.items()):
            room = self.max_workers - len(self.owned)
            count = min(room, up.desired - up.alive - len(self._starting()))
            if count <= 0:
                del self._up[pool]
                continue
            return self._call("start", pool, self._new_ids(count), up)
        return None

    def _new_ids(self, count: int) -> list[str]:
        ids = []
        for _ in range(count):
            self._serial += 1
            ids.append(f"{self._prefix}-{self._serial}")
        return ids

    async def _call(self, action: str, pool: str, ids: list[str], up: _Up | None) -> None:
        try:
            if action == "start":
                self.owned.update(ids)  # counted as starting at once, so a second decision does not double up
                await self.provider.start(pool, ids)
                if up is None:
                    self._replace = max(0, self._replace - len(ids))
                elif self._up.get(pool) is up:  # a newer decision for the pool stays to be looked at
                    del self._up[pool]
            else:
                await self.provider.stop(pool, ids)
                for worker_id in ids:
                    self._stopping.pop(worker_id, None)
                    self.owned.discard(worker_id)
        except Exception as exc:  # a provider's failure is retried, never fatal
            if action == "start":
                self.owned.difference_update(ids)
            self._failed(action, pool, ids, str(exc) or type(exc).__name__)
            return
        self._backoff.succeeded()
        self._refresh()

    def _failed(self, action: str, pool: str, ids: list[str], error: str) -> None:
        self.status.failures += 1
        self.status.last_error = error
        wait = self._backoff.failed(self._clock())
        log.error("autoscaler provider failed", provider=self.provider.name, action=action, pool=pool,
                  workers=ids, error=error, retry_in_s=round(wait, 3))
        if self._notify is not None:
            self._notify({"action": "provider_failed", "provider": self.provider.name, "pool": pool,
                          "call": action, "workers": ids, "error": error[:500],
                          "failures": self.status.failures, "retry_in_s": round(wait, 3)})
