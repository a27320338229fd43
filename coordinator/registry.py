"""The worker registry: who is connected, what they offer, what they hold.

Semantics are the seed's (docs/SEMANTICS.md §Registry):

* ``alive`` = connected and ``now - last_beat <= heartbeat_timeout_s``. A disconnected
  worker is never alive however fresh its beat; registering the id again reconnects it
  and refreshes its beat.
* Leases are the coordinator's own count of plans placed on a worker. ``claim`` is
  idempotent, ``release`` frees, and either on an unknown worker raises
  :class:`~coordinator.errors.UnknownWorker` rather than being ignored.
* Capacity = ``len(leases) < max_concurrency + prefetch`` (``prefetch``: leases a worker
  may hold unstarted in a local queue, the coordinator's ``--prefetch``); a *free slot* is
  ``len(leases) < max_concurrency``. ``max_concurrency`` 0 never has room.
* The reaper drops every worker whose last beat is older than the timeout, connected or
  not, and every worker whose session closed longer than ``reconnect_grace_s`` ago without
  it registering again (a closed connection is news: a killed worker's plans need not wait
  for the heartbeat timeout; docs/SEMANTICS.md §Registry). A disconnected worker keeps its
  leases until then, so a quick reconnect can continue its plans. Every beat and every
  disconnect goes into a heap by time, so finding the stale workers costs O(log W) per beat
  and O(stale) per tick, not a pass over every worker.
* Per signature, the connected workers that meet it are cached as a
  :class:`~coordinator.capacity.Pool`, kept up to date on every registration, disconnect
  and reap, with an index of the members that have room, kept up to date on every claim
  and release (coordinator/capacity.py).
* Its ``watcher`` (fair share's usage, coordinator/sharing.py) is told of every new lease and of
  every lease's end: a release, or the record dropped with its leases (reaped, removed).

Ownership and invariants:

* The registry owns the workers' records (:class:`~coordinator.workers.WorkerRecord`): it
  alone adds, reconnects, disconnects and reaps them, changes their leases, beats and
  reports, and counts the prompt tokens placed on them (:meth:`WorkerRegistry.count_placed_tokens`).
* After each of those changes a record's cached report flags (``plain``, ``has_energy``,
  ``has_carbon``, ``has_latency``) equal the predicates of coordinator/workers.py, and every
  cached pool the worker belongs to has been told through the pool's own methods (the pool
  writes its counts and indexes itself).
* A worker is in ``_pools_of[id]`` exactly for the cached pools that hold it as a member;
  a pool dropped from the cache is retired (:meth:`~coordinator.capacity.Pool.retire`).

Time comes in as ``now`` (monotonic seconds); nothing here reads a clock.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Collection, Hashable, Iterable, Iterator, Sequence
from typing import Protocol

import structlog

from coordinator.capacity import Pool
from coordinator.devices import GpuNeed, pick
from coordinator.errors import UnknownWorker
from coordinator.workers import WorkerRecord, has_carbon, has_energy, has_latency, is_plain, latency_ms
from protocol.messages import Capabilities, Load, WorkerInfo

# WorkerRecord is defined in coordinator/workers.py; it is named here too for the callers that
# meet it through the registry.
__all__ = ["WorkerRecord", "WorkerRegistry"]

log = structlog.get_logger(__name__)


def _figures(record: WorkerRecord) -> tuple[float, float, float] | None:
    """The figures the policies' indexes key on: µJ/token, zone intensity, latency (None: no report)."""
    load = record.load
    if load is None:
        return None
    return load.uj_per_token, load.zone_intensity_g_per_kwh, latency_ms(record)


def _by_id(record: WorkerRecord) -> str:
    return record.id


class LeaseWatcher(Protocol):
    """Told of every lease's start and end, whatever ends it (fair share's usage: coordinator/sharing.py)."""

    def lease_claimed(self, record: WorkerRecord, plan_id: str) -> None:
        """A new lease: ``plan_id`` on the worker of ``record``."""

    def lease_released(self, record: WorkerRecord, plan_id: str) -> None:
        """The lease ended: released, or its worker's record was dropped (reaped, removed) with it."""


class WorkerRegistry:
    """Every known worker, keyed by id.

    Args:
        heartbeat_timeout_s: how long after its last beat a worker stops being alive
            and becomes reapable.
        prefetch: leases each worker may hold beyond its concurrency (a local queue).
        reconnect_grace_s: how long after its session closed a worker becomes reapable
            (when :meth:`disconnect` is given the time); None: only the heartbeat timeout.
    """

    def __init__(
        self, heartbeat_timeout_s: float = 30.0, prefetch: int = 0, reconnect_grace_s: float | None = None
    ) -> None:
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.prefetch = prefetch
        self.reconnect_grace_s = reconnect_grace_s
        #: When the core restored plans from a store (Coordinator.restore); see :meth:`awaiting_restored`.
        self.restored_at: float | None = None
        self._workers: dict[str, WorkerRecord] = {}
        self.record_of: Callable[[str], WorkerRecord | None] = self._workers.get
        """The record of a worker id, None if it is not registered: the dict's own ``get`` (no Python frame), for
        the per-message paths (coordinator/worker_sessions/); ``_workers`` is never rebound."""
        self._claims = 0
        self._matching: dict[tuple[Hashable, object], Pool] = {}  # see matching()
        self._beats: list[tuple[float, str]] = []  # (a beat's time, worker id); see stale()
        self._overdue: dict[str, float] = {}  # worker id -> the beat found overdue, until it beats again
        self._gone: list[tuple[float, str, float]] = []  # (grace over at, worker id, disconnected at); see stale()
        self._grace_over: dict[str, float] = {}  # worker id -> its disconnect whose grace is over, until reaped
        self._pools_of: dict[str, list[Pool]] = {}  # worker id -> the cached pools it is a member of
        self._connected = 0
        self.generation = 0  # bumped whenever membership or connection changes (caches key on it)
        self.releases = 0  # leases released so far: a release is the other way room appears
        self.watcher: LeaseWatcher | None = None  # told of every lease's start and end (coordinator/sharing.py)

    def __contains__(self, worker_id: object) -> bool:
        return worker_id in self._workers

    def __len__(self) -> int:
        return len(self._workers)

    def __iter__(self) -> Iterator[WorkerRecord]:
        """Every record, connected or not, in id order."""
        return iter([self._workers[wid] for wid in sorted(self._workers)])

    # ------------------------------------------------------------------ membership

    def register(
        self,
        worker_id: str,
        capabilities: Capabilities,
        now: float,
        *,
        address: str = "",
        conn_id: int | None = None,
    ) -> WorkerRecord:
        """Add a worker, or reconnect a known one.

        A known id keeps its leases (its plans may continue) and takes the new
        capabilities, address and session; its beat is refreshed either way.

        Returns:
            The worker's record.
        """
        self.generation += 1
        heapq.heappush(self._beats, (now, worker_id))
        record = self._workers.get(worker_id)
        if record is None:
            record = WorkerRecord(
                worker_id, capabilities, address=address, conn_id=conn_id, last_beat_s=now, prefetch=self.prefetch
            )
            self._workers[worker_id] = record
            self._connected += 1
            record.short_unsampled = capabilities.short_unsampled
        else:
            self._leave_pools(record)
            self._connected += not record.connected
            record.capabilities = capabilities
            record.short_unsampled = capabilities.short_unsampled
            record.address = address
            record.conn_id = conn_id
            record.connected = True
            record.disconnected_at_s = None  # back within its grace: its pending reap entry goes stale
            record.last_beat_s = now
            _recount_devices(record)  # its device list may have changed with the new capabilities
        self._join_pools(record)
        return record

    def _join_pools(self, record: WorkerRecord) -> None:
        """Add a (re)registered worker to the cached pools it meets; many pools: drop them instead."""
        pools = self._matching
        if len(pools) > 64:  # a test per pool per registration would cost more than rebuilding
            self._drop_pools()
            return
        joined = [pool for pool in pools.values() if pool.meets(record)]
        for pool in joined:
            pool.add(record)
        if joined:
            self._pools_of[record.id] = joined

    def _leave_pools(self, record: WorkerRecord) -> None:
        for pool in self._pools_of.pop(record.id, ()):
            pool.remove_member(record)

    def _drop_pools(self) -> None:
        for pool in self._matching.values():
            pool.retire()
        self._matching.clear()
        self._pools_of.clear()

    def _room_changed(self, record: WorkerRecord) -> None:
        """A claim or release: index the worker's new room in its pools."""
        for pool in self._pools_of.get(record.id, ()):
            pool.changed(record)

    def _reflag(self, record: WorkerRecord, *, figures: bool) -> None:
        """Bring the record's cached report flags up to date, recounting it in its pools if one changed.

        With ``figures`` False only plainness is recomputed (placed tokens move nothing else).
        """
        plain = is_plain(record)
        if figures:
            energy, carbon, latency = has_energy(record), has_carbon(record), has_latency(record)
        else:
            energy, carbon, latency = record.has_energy, record.has_carbon, record.has_latency
        if (
            plain == record.plain
            and energy == record.has_energy
            and carbon == record.has_carbon
            and latency == record.has_latency
        ):
            return
        pools = self._pools_of.get(record.id, ())
        for pool in pools:
            pool.tally(record, -1)
        record.plain, record.has_energy, record.has_carbon, record.has_latency = plain, energy, carbon, latency
        for pool in pools:
            pool.tally(record, 1)

    def count_placed_tokens(self, worker_id: str, tokens: int) -> None:
        """Prompt tokens were placed on the worker that its next load report will count.

        They add to its queued-token estimate until that report, and make it not plain (its
        pools recount it).

        Raises:
            UnknownWorker: the id is not registered.
        """
        record = self.get(worker_id)
        record.pending_tokens += tokens
        self._reflag(record, figures=False)

    def connected_count(self) -> int:
        """How many workers are connected now (O(1))."""
        return self._connected

    def heartbeat(self, worker_id: str, load: Load, now: float) -> WorkerRecord:
        """Record a beat and the load it carried.

        Raises:
            UnknownWorker: the id is not registered (never was, or was reaped).
        """
        record = self.get(worker_id)
        if record.load is not None:
            record.learn_drain_rate(record.load.queued_tokens + record.pending_tokens, load.queued_tokens, now)
        before = _figures(record)
        record.load = load
        record.last_beat_s = now
        if load.devices or record.gpu_blocked:  # a worker that reports device health (docs/OPERATIONS.md §GPU health)
            blocked = tuple(d.index for d in load.devices if d.state == "quarantined")
            if blocked != record.gpu_blocked:
                _block_devices(record, blocked)
                self._room_changed(record)
        record.pending_tokens = 0  # this report counts what was placed before it
        heapq.heappush(self._beats, (now, worker_id))
        self._reflag(record, figures=True)
        if _figures(record) != before:  # the figure heaps hold keys of the old figures: index the new
            for pool in self._pools_of.get(record.id, ()):
                pool.figures_changed(record)
        return record

    def disconnect(self, worker_id: str, now: float | None = None) -> None:
        """Mark a worker's session gone; its record and leases stay until reaped.

        With ``now`` (its connection closed at that time) and a ``reconnect_grace_s``, it is
        reaped once the grace is over unless it registers again first; without, only its
        heartbeat timeout reaps it (a restored lease's placeholder, a worker leaving for good).

        Raises:
            UnknownWorker: the id is not registered.
        """
        record = self.get(worker_id)
        grace = self.reconnect_grace_s
        if now is not None and grace is not None and record.connected:
            record.disconnected_at_s = now
            heapq.heappush(self._gone, (now + grace, worker_id, now))
        self._connected -= record.connected
        record.connected = False
        record.conn_id = None
        self._leave_pools(record)
        self.generation += 1

    def awaiting_restored(self, now: float) -> float | None:
        """Seconds left at ``now`` of the first heartbeat timeout after a restore, None past it or without one.

        Meanwhile a worker not back yet is awaited, not gone (it may come back with its spool): the plan graphs'
        holders (coordinator/plan_graphs.py) and a relayed get's worker (coordinator/relay.py) are asked for again.
        """
        if self.restored_at is None:
            return None
        left = self.restored_at + self.heartbeat_timeout_s - now
        return left if left > 0 else None

    def in_grace(self, worker_id: str, now: float) -> float | None:
        """Seconds left of the worker's reconnect grace at ``now``; None when it is connected, unknown or has none.

        Its session closed and it has not registered again: the id is still its own (its leases
        wait for it; docs/SEMANTICS.md §Worker identity).
        """
        record = self._workers.get(worker_id)
        if record is None or record.connected or record.disconnected_at_s is None or self.reconnect_grace_s is None:
            return None
        left = record.disconnected_at_s + self.reconnect_grace_s - now
        return left if left > 0 else None

    def get(self, worker_id: str) -> WorkerRecord:
        """The record of ``worker_id``.

        Raises:
            UnknownWorker: the id is not registered.
        """
        try:
            return self._workers[worker_id]
        except KeyError:
            raise UnknownWorker(worker_id) from None

    # ------------------------------------------------------------------ liveness

    def is_alive(self, worker_id: str, now: float) -> bool:
        """Whether the worker is connected and beat within the timeout; False if unknown."""
        record = self._workers.get(worker_id)
        # _alive, inlined: this runs several times per plan.
        return record is not None and record.connected and now - record.last_beat_s <= self.heartbeat_timeout_s

    def _alive(self, record: WorkerRecord, now: float) -> bool:
        return record.connected and now - record.last_beat_s <= self.heartbeat_timeout_s

    def alive(self, now: float) -> list[WorkerRecord]:
        """Every alive worker, in id order."""
        return [r for r in self if self._alive(r, now)]

    def iter_alive(self, now: float) -> Iterator[WorkerRecord]:
        """Every alive worker, in no particular order: placement breaks ties itself and skips the sort."""
        return (r for r in self._workers.values() if self._alive(r, now))

    def find(self, tags: Iterable[str], now: float) -> list[WorkerRecord]:
        """Alive workers that have all of ``tags``, in id order."""
        wanted = set(tags)
        return [r for r in self.alive(now) if wanted.issubset(r.capabilities.tags)]

    def matching(self, key: Hashable, meets: Callable[[WorkerRecord], bool]) -> Pool:
        """Connected workers for which ``meets`` holds, cached under ``key`` and ``meets``.

        Placement asks this on every submit. The pool is kept up to date as workers
        register (``meets`` is applied to them), disconnect or are reaped, and indexes its
        members' room (coordinator/capacity.py). Liveness and draining change without the
        registry knowing, so callers check those themselves.
        """
        # One key asked with two tests (a signature's admits and meets) is two pools. A bound
        # method compares its object by identity, and each submit builds a new signature: key on
        # the function.
        cache_key = (key, getattr(meets, "__func__", meets))
        found = self._matching.get(cache_key)
        if found is None:
            if len(self._matching) >= 4096:  # many one-off keys: start over rather than grow
                self._drop_pools()
            members = [r for r in self._workers.values() if r.connected and meets(r)]
            found = self._matching[cache_key] = Pool(members, meets)
            pools_of = self._pools_of
            for record in members:
                pools_of.setdefault(record.id, []).append(found)
        return found

    def stale(self, now: float) -> list[WorkerRecord]:
        """Workers :meth:`reap` would drop at ``now``, in id order (nothing is removed).

        The reaper asks every tick. Beats are in a heap by time: the beats older than the
        timeout are popped, and a popped beat that is still its worker's latest makes the
        worker overdue until it beats again or is reaped. A tick costs O(stale), not a pass
        over every worker.
        """
        timeout = self.heartbeat_timeout_s
        beats, overdue, workers = self._beats, self._overdue, self._workers
        while beats and now - beats[0][0] > timeout:
            beat, worker_id = heapq.heappop(beats)
            record = workers.get(worker_id)
            if record is not None and record.last_beat_s == beat:
                overdue[worker_id] = beat
        found: dict[str, WorkerRecord] = {}
        for worker_id, beat in list(overdue.items()):
            record = workers.get(worker_id)
            if record is None or record.last_beat_s != beat:
                del overdue[worker_id]  # reaped, or it beat again (that beat is in the heap)
            elif now - beat > timeout:  # a clock read earlier than a past tick keeps it pending
                found[worker_id] = record
        grace, gone, grace_over = self.reconnect_grace_s, self._gone, self._grace_over
        while gone and gone[0][0] < now:
            _, worker_id, at = heapq.heappop(gone)
            record = workers.get(worker_id)
            if record is not None and record.disconnected_at_s == at:
                grace_over[worker_id] = at
        for worker_id, at in list(grace_over.items()):
            record = workers.get(worker_id)
            if record is None or record.disconnected_at_s != at:
                del grace_over[worker_id]  # reaped, or it registered again
            elif grace is not None and now - at > grace:
                found[worker_id] = record
        return sorted(found.values(), key=_by_id)

    def reap(self, now: float, only: Collection[str] | None = None) -> list[str]:
        """Drop every worker whose last beat is older than the timeout (of ``only``, when given).

        Returns:
            The dropped ids, sorted.
        """
        dropped = [r.id for r in self.stale(now) if only is None or r.id in only]
        for worker_id in dropped:
            record = self._workers.pop(worker_id)
            self._connected -= record.connected
            self._overdue.pop(worker_id, None)
            self._grace_over.pop(worker_id, None)
            self._leave_pools(record)
            self._let_go(record)
        if dropped:
            self.generation += 1
            log.warning("workers reaped", worker_ids=dropped, heartbeat_timeout_s=self.heartbeat_timeout_s,
                        reconnect_grace_s=self.reconnect_grace_s)  # fmt: skip
        return dropped

    def remove(self, worker_id: str) -> WorkerRecord:
        """Drop a worker that left on purpose (``goodbye``), whatever its last beat; returns its record.

        Raises:
            UnknownWorker: the id is not registered.
        """
        record = self.get(worker_id)
        del self._workers[worker_id]
        self._connected -= record.connected
        record.connected = False
        record.conn_id = None
        record.disconnected_at_s = None
        self._overdue.pop(worker_id, None)
        self._grace_over.pop(worker_id, None)
        self._leave_pools(record)
        self._let_go(record)
        self.generation += 1
        return record

    def _let_go(self, record: WorkerRecord) -> None:
        """A dropped record's leases end with it, as far as the watcher is concerned (the record keeps them)."""
        watcher = self.watcher
        if watcher is not None:
            for plan_id in sorted(record.leases):
                watcher.lease_released(record, plan_id)

    # ------------------------------------------------------------------ leases

    def claim(
        self, worker_id: str, plan_id: str, gpus: GpuNeed | None = None, devices: Sequence[int] = ()
    ) -> bool:
        """Count ``plan_id`` against the worker's capacity. Idempotent.

        Capacity is not checked here: placement checks it before claiming, and a
        cancelled plan's lease must stay counted whatever the worker's room.
        With ``gpus`` the lease also holds devices (coordinator/devices.py): ``devices`` when
        given (a worker says which it runs the plan on), else those :func:`~coordinator.devices.pick`
        chooses; when none are free (a restore, a worker that disagrees) it holds none and the
        worker's own allocator keeps plans apart.

        Returns:
            True if the lease is new, False if it was already held.

        Raises:
            UnknownWorker: the id is not registered.
        """
        record = self._workers.get(worker_id)  # self.get, inlined: once per plan
        if record is None:
            raise UnknownWorker(worker_id)
        if plan_id in record.leases:
            return False
        record.leases.add(plan_id)
        if gpus is not None:
            _hold_devices(record, plan_id, gpus, devices)
        self._claims += 1
        record.last_assigned = self._claims
        for pool in self._pools_of.get(worker_id, ()):  # self._room_changed, inlined: once per plan
            pool.changed(record)
        if self.watcher is not None:
            self.watcher.lease_claimed(record, plan_id)
        return True

    def release(self, worker_id: str, plan_id: str) -> bool:
        """Free a lease. Releasing one not held is a no-op.

        Returns:
            True if the lease was held.

        Raises:
            UnknownWorker: the id is not registered.
        """
        record = self._workers.get(worker_id)  # self.get, inlined: once per plan
        if record is None:
            raise UnknownWorker(worker_id)
        if plan_id not in record.leases:
            return False
        record.leases.discard(plan_id)
        held = record.gpu_held.pop(plan_id, None)
        if held:
            use = record.gpu_use
            for i in held:
                if i < len(use):
                    use[i] = max(0, use[i] - 1)
        self.releases += 1
        for pool in self._pools_of.get(worker_id, ()):  # self._room_changed, inlined: once per plan
            pool.changed(record)
        if self.watcher is not None:
            self.watcher.lease_released(record, plan_id)
        return True

    def has_capacity(self, worker_id: str) -> bool:
        """Whether the worker can take one more lease.

        Raises:
            UnknownWorker: the id is not registered.
        """
        return self.get(worker_id).has_capacity()

    @staticmethod
    def least_loaded(candidates: Iterable[WorkerRecord]) -> WorkerRecord | None:
        """The candidate with the fewest leases; ties go to the least recently assigned, then the lowest id.

        Lease counts are the coordinator's own, so they are exact even when a worker's
        last load report is seconds old.
        """
        return min(candidates, key=lambda r: (len(r.leases), r.last_assigned, r.id), default=None)

    def hold_devices(self, worker_id: str, plan_id: str, gpus: GpuNeed, devices: Sequence[int] = ()) -> None:
        """A lease the worker says it runs holds devices (``devices`` when the worker named them);
        a no-op when the lease already holds some or is not the worker's."""
        record = self._workers.get(worker_id)
        if record is not None and plan_id in record.leases and plan_id not in record.gpu_held:
            _hold_devices(record, plan_id, gpus, devices)

    def devices_of(self, worker_id: str, plan_id: str) -> tuple[int, ...]:
        """The devices a lease holds on the worker (empty: none, or an unknown worker)."""
        record = self._workers.get(worker_id)
        return () if record is None else record.gpu_held.get(plan_id, ())

    # ------------------------------------------------------------------ reporting

    def info(self, worker_id: str, now: float) -> WorkerInfo:
        """The ``list_workers`` row of one worker.

        Raises:
            UnknownWorker: the id is not registered.
        """
        r = self.get(worker_id)
        return WorkerInfo(
            id=r.id,
            capabilities=r.capabilities,
            load=r.load,
            leases=len(r.leases),
            connected=r.connected,
            alive=self._alive(r, now),
            last_beat_age_s=max(0.0, now - r.last_beat_s),
            address=r.address,
            draining=r.draining,
            version=r.version,
            gpu_use=_lease_use(r),
        )

    def summary(self, now: float) -> str:
        """``"N workers (C CPUs, G GPUs, R GB RAM)"`` over alive workers; GB = 10^9 bytes."""
        alive = self.alive(now)
        cpus = sum(r.capabilities.cpu_cores for r in alive)
        gpus = sum(len(r.capabilities.gpus) for r in alive)
        ram_gb = sum(r.capabilities.ram_bytes for r in alive) / 1e9
        return f"{len(alive)} workers ({cpus} CPUs, {gpus} GPUs, {ram_gb:.1f} GB RAM)"


def _lease_use(record: WorkerRecord) -> list[int]:
    """Leases holding each device (a quarantine's count taken out)."""
    use = [record.gpu_use[i] if i < len(record.gpu_use) else 0 for i in range(len(record.capabilities.gpus))]
    if record.gpu_blocked:
        share = max(1, record.capabilities.gpu_share)
        for i in record.gpu_blocked:
            use[i] = max(0, use[i] - share)
    return use


def _hold_devices(record: WorkerRecord, plan_id: str, need: GpuNeed, devices: Sequence[int]) -> None:
    """Take devices for a new lease: ``devices`` when they are the worker's, else :func:`pick`'s."""
    count = len(record.capabilities.gpus)
    use = record.gpu_use
    if len(use) < count:
        use.extend([0] * (count - len(use)))
    chosen: tuple[int, ...] | None = tuple(sorted(set(devices))) if devices else None
    if chosen is not None and not all(0 <= i < count for i in chosen):
        chosen = None
    if chosen is None:
        chosen = pick(need, record.capabilities, use)
    if not chosen:
        return
    record.gpu_held[plan_id] = chosen
    for i in chosen:
        use[i] += 1


def _block_devices(record: WorkerRecord, blocked: tuple[int, ...]) -> None:
    """Quarantined devices (the worker's load says so) count as fully held: no lease takes one, none is
    free (``gpu_use`` adds ``gpu_share`` to each; ``info`` shows the leases' count only)."""
    share = max(1, record.capabilities.gpu_share)
    use = record.gpu_use
    count = len(record.capabilities.gpus)
    if len(use) < count:
        use.extend([0] * (count - len(use)))
    for i in record.gpu_blocked:
        if i < len(use):
            use[i] = max(0, use[i] - share)
    record.gpu_blocked = tuple(i for i in blocked if 0 <= i < count)
    for i in record.gpu_blocked:
        use[i] += share


def _recount_devices(record: WorkerRecord) -> None:
    """Rebuild ``gpu_use`` from ``gpu_held`` for the record's (new) device list."""
    count = len(record.capabilities.gpus)
    use = [0] * count
    for plan_id, held in list(record.gpu_held.items()):
        kept = tuple(i for i in held if i < count)
        if kept:
            record.gpu_held[plan_id] = kept
        else:
            del record.gpu_held[plan_id]
        for i in kept:
            use[i] += 1
    record.gpu_use = use
    blocked, record.gpu_blocked = record.gpu_blocked, ()
    if blocked:
        _block_devices(record, blocked)
