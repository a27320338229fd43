"""One registered worker (:class:`WorkerRecord`) and the predicates over its load report.

This module owns the shape of a worker's record and what its reports mean to placement:

* :func:`is_plain`: the worker reports no load figure a policy reads, so every policy ranks
  it as least busy does (by lease count);
* :func:`has_energy`, :func:`has_carbon`, :func:`has_latency`: it reports the figure
  ``joule_weighted``, ``carbon_weighted`` or ``latency_weighted`` uses as is (finite, > 0);
* :func:`latency_ms`: the latency ``latency_weighted`` reads.

Invariants:

* The registry (coordinator/registry.py) is the only writer of a record's membership, lease,
  beat and report fields. It keeps the cached flags ``plain``, ``has_energy``, ``has_carbon``
  and ``has_latency`` equal to the predicates above after every change that can move them (a
  load report, tokens placed since it), because the pools count their members by those flags
  (coordinator/capacity.py). The operator's drain fields are set by the operator
  requests (coordinator/operator_requests.py); placement reads them when it checks a worker.
* Nothing here imports the registry or placement: they import this module.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field

from protocol.messages import Capabilities, Load

__all__ = ["WorkerRecord", "has_carbon", "has_energy", "has_latency", "is_plain", "latency_ms"]


@dataclass(eq=False)
class WorkerRecord:
    """One registered worker.

    Attributes:
        id: the worker's id (from its ``hello``).
        capabilities: what the host offers.
        address: the peer address of its session, for operators.
        conn_id: the session currently holding this id, or None once disconnected.
        load: the latest load report; None until the first heartbeat.
        leases: ids of the plans placed on it that it has not finished.
        last_beat_s: monotonic time of the last register or heartbeat.
        connected: whether a session holds the id now.
        disconnected_at_s: monotonic time its session closed, while it is disconnected and its
            reconnect grace runs (None: connected, or disconnected without a grace, as the
            placeholder of a restored lease); the registry reaps it when the grace is over.
        last_assigned: order number of its latest claim (0 = never); placement breaks
            ties by least recently assigned, and a counter (not ``now``) keeps two claims
            at the same instant ordered.
        draining: an operator drained it (``drain_worker``): it takes no new plans until
            undrained; kept across reconnects, forgotten when it is reaped.
        drain_deadline_s: monotonic time at which its remaining plans are requeued, if any.
        prefetch: leases it may hold beyond ``max_concurrency``, unstarted (the registry's
            setting, copied at registration).
        pending_tokens: prompt tokens placed on it since its last load report, which that
            report could not count yet.
        drain_tokens_per_s: how fast it works off queued tokens, learned from its reports
            (0 until learned); lets the coordinator age its estimate between reports.
        plain: :func:`is_plain` as of its last change (its pools count it).
        has_energy: :func:`has_energy` as of its last report (likewise).
        has_carbon: :func:`has_carbon` as of its last report (likewise).
        has_latency: :func:`has_latency` as of its last report (likewise).
        gpu_use: how many leases hold each of ``capabilities.gpus`` (by position), per
            coordinator/devices.py; the registry takes and gives back devices with leases.
        gpu_held: the devices each lease holds (leases without devices are absent).
        gpu_blocked: its quarantined devices, as its last load said (docs/OPERATIONS.md §GPU health): each
            counts ``gpu_share`` more in ``gpu_use``, so placement takes none of them.
        short_unsampled: its ``capabilities.short_unsampled`` as of its registration (the registry sets it): an
            assign's test a plan, a field of this record, not an attribute of a message struct (§T32n).
    """

    id: str
    capabilities: Capabilities
    address: str = ""
    data_url: str = ""  # its data endpoint, from ``hello`` (coordinator/data_plane.py)
    version: str = ""  # its fleetwire version, from ``hello`` (shown in ``list_workers`` for rolling upgrades)
    conn_id: int | None = None
    load: Load | None = None
    leases: set[str] = field(default_factory=set)
    last_beat_s: float = 0.0
    connected: bool = True
    disconnected_at_s: float | None = None
    last_assigned: int = 0
    draining: bool = False
    drain_deadline_s: float | None = None
    prefetch: int = 0
    pending_tokens: int = 0
    drain_tokens_per_s: float = 0.0
    plain: bool = True
    has_energy: bool = False
    has_carbon: bool = False
    has_latency: bool = False
    gpu_use: list[int] = field(default_factory=list)
    gpu_held: dict[str, tuple[int, ...]] = field(default_factory=dict)
    gpu_blocked: tuple[int, ...] = ()  # quarantined devices, from its load (counted as held in gpu_use)
    short_unsampled: bool = False  # capabilities.short_unsampled, copied at registration (False: "00", always valid)

    def gpus_free(self) -> int:
        """Devices no lease holds now."""
        use = self.gpu_use
        return sum(1 for i in range(len(self.capabilities.gpus)) if i >= len(use) or use[i] == 0)

    def has_capacity(self) -> bool:
        """Whether it can take one more lease: not draining, and fewer leases than its concurrency + prefetch."""
        limit = self.capabilities.max_concurrency
        if limit <= 0 or self.draining:
            return False
        return len(self.leases) < limit + self.prefetch

    def has_free_slot(self) -> bool:
        """Whether it can start one more plan now: not draining, and fewer leases than its concurrency."""
        return len(self.leases) < self.capabilities.max_concurrency and not self.draining

    def queued_tokens(self, now: float) -> float:
        """Prompt tokens it has yet to work through, as the coordinator estimates them at ``now``.

        The last report plus what was placed since, less what the learned drain rate has
        worked off since the report.
        """
        reported = self.load.queued_tokens if self.load is not None else 0
        drained = self.drain_tokens_per_s * max(0.0, now - self.last_beat_s)
        return max(0.0, reported + self.pending_tokens - drained)

    def learn_drain_rate(self, had_tokens: float, has_tokens: int, now: float) -> None:
        """Update :attr:`drain_tokens_per_s` from two reports: it had ``had_tokens``, it has ``has_tokens``.

        An interval that ended with tokens still queued shows the worker's full rate (moving
        average); one that ended empty only shows a lower bound.
        """
        interval = now - self.last_beat_s
        if interval <= 0:
            return
        sample = max(0.0, had_tokens - has_tokens) / interval
        if has_tokens > 0:
            rate = self.drain_tokens_per_s
            self.drain_tokens_per_s = sample if rate == 0 else rate + 0.2 * (sample - rate)
        elif sample > self.drain_tokens_per_s:
            self.drain_tokens_per_s = sample

    def backlog(self) -> int:
        """Leases beyond its concurrency: plans waiting unstarted in its local queue."""
        return max(0, len(self.leases) - self.capabilities.max_concurrency)

    def has_tags(self, tags: Iterable[str]) -> bool:
        """Whether it has every one of ``tags``."""
        return set(tags).issubset(self.capabilities.tags)


def is_plain(worker: WorkerRecord) -> bool:
    """Whether no policy can tell the worker from another with the same lease count.

    A plain worker reports no queued tokens, µJ/token, zone intensity or latency, and has had
    nothing placed on it since its last report.
    """
    if worker.pending_tokens:
        return False
    load = worker.load
    return load is None or not (
        load.queued_tokens
        or load.uj_per_token
        or load.zone_intensity_g_per_kwh
        or load.latency_p50_ms
        or load.latency_ema_ms
    )


def has_energy(worker: WorkerRecord) -> bool:
    """Whether the worker reports a µJ/token that ``joule_weighted`` uses as is (finite and > 0)."""
    load = worker.load
    return load is not None and 0 < load.uj_per_token < math.inf


def has_carbon(worker: WorkerRecord) -> bool:
    """Whether the worker reports both figures ``carbon_weighted`` uses as is: a µJ/token and a zone intensity."""
    load = worker.load
    return load is not None and has_energy(worker) and 0 < load.zone_intensity_g_per_kwh < math.inf


def latency_ms(worker: WorkerRecord) -> float:
    """The latency ``latency_weighted`` reads: the reported p50, else the moving average (0: none)."""
    load = worker.load
    if load is None:
        return 0.0
    return load.latency_p50_ms or load.latency_ema_ms


def has_latency(worker: WorkerRecord) -> bool:
    """Whether the worker reports a latency ``latency_weighted`` uses as is (finite and > 0)."""
    return 0 < latency_ms(worker) < math.inf
