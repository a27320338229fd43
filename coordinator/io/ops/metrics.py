"""Prometheus metrics of the coordinator, collected from the core's state at scrape time.

Nothing here runs on the hot path. The core and the server keep plain integers (``core.counters``,
``core.timings``, :class:`~coordinator.stats.FrameCounters`); :class:`CoordinatorCollector` reads
them, and the registry, plans and queue, when ``/metrics`` is scraped, and turns them into metric
families. The registry is our own ``CollectorRegistry`` (never prometheus-client's global one), so
two coordinators in one process (tests) never mix their numbers.

docs/OPERATIONS.md §Metrics lists every family; :data:`METRIC_NAMES` is that list in code and the
tests check that a scrape has all of them.

Contract with other parts of the core, read duck-typed so this module never needs editing when they
change: placements are counted in ``core.counters["placements.<policy>"]``; an autoscaler, when the
core has one (``core.autoscaler``), reports ``desired_replicas() -> Mapping[pool, int]``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any, Final

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.openmetrics.exposition import CONTENT_TYPE_LATEST as OPENMETRICS_CONTENT_TYPE
from prometheus_client.openmetrics.exposition import generate_latest as openmetrics_latest
from prometheus_client.process_collector import ProcessCollector
from prometheus_client.samples import Exemplar

from coordinator.io.ops.carbon_metrics import CARBON_METRIC_NAMES, carbon_families
from coordinator.io.ops.gpu_metrics import GPU_METRIC_NAMES, gpu_families
from coordinator.io.ops.openai_metrics import OPENAI_METRIC_NAMES, openai_families
from coordinator.io.ops.sharing_metrics import SHARING_METRIC_NAMES, sharing_families
from coordinator.scopes import SCOPE_REASONS
from coordinator.stats import FrameCounters, Histogram
from protocol.messages import PlanStateName
from protocol.tracecontext import trace_id_of

if TYPE_CHECKING:
    from coordinator.core import Coordinator
    from coordinator.io.frontdoor.gate import Gatekeeper
    from coordinator.openai_api.limits import DoorStats
    from coordinator.read_policy import ReadPolicy
    from coordinator.relay import Relay

__all__ = [
    "CONTENT_TYPE", "METRIC_NAMES", "OPENMETRICS_CONTENT_TYPE", "CoordinatorCollector", "build_registry", "render",
    "render_openmetrics",
]  # fmt: skip

CONTENT_TYPE: Final = CONTENT_TYPE_LATEST

PLAN_STATES: Final[tuple[PlanStateName, ...]] = ("queued", "leased", "running", "succeeded", "failed", "cancelled")
WORKER_STATES: Final = ("alive", "suspect", "disconnected")

# (name, core counter) for the plain counters; the exposition adds ``_total``.
_CORE_COUNTERS: Final = (
    ("fleetwire_plans_submitted", "plans_submitted", "Plans accepted by submit (duplicates not counted)."),
    ("fleetwire_plans_requeued", "plans_requeued", "Plans put back in the queue after a lost worker or a reject."),
    ("fleetwire_events_forwarded", "events_forwarded", "Worker events forwarded to plan streams."),
    ("fleetwire_stale_events_dropped", "stale_dropped", "Worker messages dropped for a stale lease (fencing)."),
    ("fleetwire_protocol_errors", "protocol_errors", "Messages answered with a protocol error."),
    ("fleetwire_workers_reaped", "workers_reaped",
     "Workers dropped by the reaper: silent past the heartbeat timeout, or disconnected past the reconnect grace."),
    ("fleetwire_workers_left", "workers_left", "Workers that left on purpose (goodbye), removed at once."),
    ("fleetwire_heartbeats", "heartbeats", "Heartbeats received from workers."),
    # Security refusals the core makes (docs/OPERATIONS.md §Security); 4403 closes are fleetwire_scope_refused.
    ("fleetwire_plans_refused", "plans_refused", "Submits refused at the per-principal plan limit."),
    ("fleetwire_worker_takeovers_refused", "takeovers_refused",
     "Hellos refused for a worker id a live session holds, without its session_secret or certificate (4409)."),
    ("fleetwire_worker_reconnects_refused", "worker_reconnects_refused",
     "Hellos refused for a worker id past its reconnect budget (too_many_reconnects, 4429)."),
    ("fleetwire_store_loss_accepted", "store_loss_accepted",
     "Store damage accepted at start with --accept-store-loss (damaged plans dropped, commits lost)."),
    ("fleetwire_plans_recovered_from_client", "plans_recovered_from_client",
     "Plans the store had lost, resubmitted by their client's SDK (submit.recovered)."),
    ("fleetwire_results_recovered_from_worker", "results_recovered_from_worker",
     "Results the store had lost, re-sent by the worker that ran the plan and accepted."),
)

#: Every metric family a scrape exposes (sample names may add _total, _bucket, _sum, _count).
METRIC_NAMES: Final = (
    "fleetwire_info",
    "fleetwire_workers",
    "fleetwire_workers_connected",
    "fleetwire_workers_alive",
    "fleetwire_workers_draining",
    "fleetwire_sessions",
    "fleetwire_plans",
    "fleetwire_queue_depth",
    "fleetwire_placements",
    "fleetwire_plan_queue_wait_seconds",
    "fleetwire_plan_run_seconds",
    "fleetwire_plan_energy_joules",
    "fleetwire_plan_co2e_grams",
    "fleetwire_frames",
    "fleetwire_bytes",
    *(name for name, _, _ in _CORE_COUNTERS),
    "fleetwire_scope_refused",
    "fleetwire_plans_forgotten",
    "fleetwire_plans_retained_bytes",
    "fleetwire_refusals",
    "fleetwire_penalties",
    "fleetwire_penalty_boxed",
    "fleetwire_handshakes_pending",
    "fleetwire_handshakes_evicted",
    "fleetwire_handshakes_accepted",
    "fleetwire_handshakes_idle_dropped",
    "fleetwire_defer_accept_seconds",
    "fleetwire_refusal_logs_suppressed",
    "fleetwire_repeats_held",
    "fleetwire_cost_throttled",
    "fleetwire_replays_pending",
    "fleetwire_autoscaler_desired_replicas",
    "fleetwire_autoscaler_workers",
    "fleetwire_autoscaler_provider_failures",
    "fleetwire_worker_leases",
    "fleetwire_worker_in_flight",
    "fleetwire_worker_last_beat_age_seconds",
    "fleetwire_worker_power_watts",
    "fleetwire_worker_energy_per_token_microjoules",
    "fleetwire_worker_carbon_intensity_grams_per_kwh",
    "fleetwire_worker_engine_requests",
    "fleetwire_worker_kv_cache_usage_ratio",
    "fleetwire_relay_bytes",
    "fleetwire_relay_streams",
    "fleetwire_relay_in_flight_bytes",
    "fleetwire_relay_credit_stalls",
    "fleetwire_relay_refused",
    "fleetwire_relay_waiting_streams",
    "fleetwire_relay_idle_ends",
    "fleetwire_worker_latency_seconds",
    *GPU_METRIC_NAMES,
    *OPENAI_METRIC_NAMES,
    *SHARING_METRIC_NAMES,
    *CARBON_METRIC_NAMES,
)


def _buckets(hist: Histogram) -> list[Any]:
    buckets: list[Any] = [("+Inf" if bound == float("inf") else repr(bound), count)
                          for bound, count in hist.cumulative()]  # fmt: skip
    if hist.exemplars is not None:  # traced plans' values: each bucket links to its last trace (OpenMetrics only)
        for i, exemplar in enumerate(hist.exemplars):
            if exemplar is not None:
                buckets[i] = (*buckets[i], Exemplar({"trace_id": trace_id_of(exemplar[0])}, exemplar[1]))
    return buckets


class CoordinatorCollector:
    """A prometheus-client collector over one coordinator core.

    Args:
        core: the sans-I/O coordinator.
        frames: frame and byte counters kept by the server, if any.
        sessions: open sessions per role, if known.
        refusals: the server's refusals by answer (an HTTP status or a close code), if any.
        gate: the port's ``Gatekeeper`` (coordinator/io/frontdoor/gate.py): its penalty box,
            pending handshakes, refusal log and held repeats; None: those families read 0.
        read_policy: the port's read limits (coordinator/read_policy.py): the cost throttles.
        clock: monotonic seconds, the clock the core is driven with.
        version: the coordinator's version, exposed in ``fleetwire_info``.
        provision: the autoscaler provider's status (coordinator/io/ops/provision.py ``ProviderStatus``),
            read duck-typed: ``provider``, ``failures``, ``workers`` (by state); None without one.
        openai: the OpenAI door's counts (None: ``--no-openai``, its families read 0).
    """

    def __init__(
        self,
        core: Coordinator,
        *,
        frames: FrameCounters | None = None,
        sessions: Callable[[], Mapping[str, int]] | None = None,
        refusals: Mapping[str, int] | None = None,
        clock: Callable[[], float] = time.monotonic,
        version: str = "",
        gate: Gatekeeper | None = None,
        read_policy: ReadPolicy | None = None,
        provision: Any = None,
        openai: DoorStats | None = None,
    ) -> None:
        self._openai = openai
        self._gate = gate
        self._read_policy = read_policy
        self._provision = provision
        self._core = core
        self._frames = frames or FrameCounters()
        self._sessions = sessions
        self._refusals = refusals if refusals is not None else {}
        self._clock = clock
        self._version = version

    def describe(self) -> list[Metric]:
        """Nothing: describing would mean collecting, and registration must not scrape the core."""
        return []

    def collect(self) -> Iterator[Metric]:
        """Every family of :data:`METRIC_NAMES`, read from the core now."""
        core = self._core
        now = self._clock()
        info = GaugeMetricFamily("fleetwire_info", "The coordinator's version.", labels=["version"])
        info.add_metric([self._version or "unknown"], 1)
        yield info
        yield from self._workers(core, now)
        yield from gpu_families(core.registry)  # per worker and device (coordinator/io/ops/gpu_metrics.py)
        yield from sharing_families(core.sharing, core.counters)  # per team (coordinator/io/ops/sharing_metrics.py)
        yield from carbon_families(core, now)  # holds and forecasts (coordinator/io/ops/carbon_metrics.py)
        yield from self._plans(core)
        yield from self._io()
        for name, key, doc in _CORE_COUNTERS:
            yield CounterMetricFamily(name, doc, value=core.counters.get(key, 0))
        refusals = CounterMetricFamily(
            "fleetwire_refusals", "Connections refused by the server, by answer: HTTP status or close code.",
            labels=["answer"],
        )
        for answer, n in sorted(self._refusals.items()):
            refusals.add_metric([answer], n)
        yield refusals
        scope = CounterMetricFamily(
            "fleetwire_scope_refused", "Sessions closed 4403: a message outside the token's scope, by reason.",
            labels=["reason"],
        )
        for reason in SCOPE_REASONS:
            scope.add_metric([reason], core.counters.get(f"scope_refused.{reason}", 0))
        yield scope
        forgotten = CounterMetricFamily(
            "fleetwire_plans_forgotten", "Finished plans forgotten, by reason: past --plan-retention (time), "
            "--plan-retention-bytes (bytes) or their owner's --max-bytes-per-client (principal).", labels=["reason"],
        )
        for why in ("time", "bytes", "principal"):
            forgotten.add_metric([why], core.counters.get(f"plans_forgotten.{why}", 0))
        yield forgotten
        yield CounterMetricFamily("fleetwire_data_tickets_issued", "Data-plane tickets signed (a client's pass to a "
                                  "worker's inputs or outputs).", value=core.data.tickets_issued)
        yield from self._relay(core.relay)
        yield GaugeMetricFamily("fleetwire_plans_retained_bytes", "What the finished plans kept hold (args, result, "
                                "held events, overhead), as --plan-retention-bytes counts it.",
                                value=core.retention.retained_bytes)
        yield from self._penalty_box(now)
        desired = GaugeMetricFamily(
            "fleetwire_autoscaler_desired_replicas", "Workers the autoscaler wants per pool.", labels=["pool"]
        )
        autoscaler: Any = getattr(core, "autoscaler", None)
        if autoscaler is not None and hasattr(autoscaler, "desired_replicas"):
            for pool, replicas in sorted(autoscaler.desired_replicas().items()):
                desired.add_metric([str(pool)], replicas)
        yield desired
        yield from self._provisioning()
        yield from openai_families(self._openai)  # the OpenAI door's (coordinator/io/ops/openai_metrics.py)

    def _provisioning(self) -> Iterator[Metric]:
        status = self._provision
        workers = GaugeMetricFamily(
            "fleetwire_autoscaler_workers", "Workers the autoscaler's provider started and has not stopped, by state "
            "(starting: not registered yet; running; draining: being removed).", labels=["state"],
        )
        failures = CounterMetricFamily(
            "fleetwire_autoscaler_provider_failures", "Autoscaler provider calls that failed (retried with backoff).",
            labels=["provider"],
        )
        if status is not None:
            for state, n in sorted(status.workers.items()):
                workers.add_metric([state], n)
            failures.add_metric([status.provider], status.failures)
        yield workers
        yield failures

    @staticmethod
    def _relay(relay: Relay) -> Iterator[Metric]:
        """The relay's families (coordinator/relay.py): bytes carried, open streams, credit stalls, refusals."""
        carried = CounterMetricFamily("fleetwire_relay_bytes", "Bytes the relay carried through the coordinator: "
                                      "in = inputs (client to worker), out = outputs (worker to client).",
                                      labels=["direction"])
        carried.add_metric(["in"], relay.bytes_in)
        carried.add_metric(["out"], relay.bytes_out)
        yield carried
        yield GaugeMetricFamily("fleetwire_relay_streams", "Relayed streams open now (one input or output each).",
                                value=len(relay.streams))
        yield GaugeMetricFamily("fleetwire_relay_in_flight_bytes", "Relayed bytes sent and not yet acknowledged by "
                                "their receiver, all streams (what the coordinator may hold).", value=relay.in_flight)
        yield CounterMetricFamily("fleetwire_relay_credit_stalls", "Relayed chunks that left their stream's window "
                                  "without room for another chunk: the sender waits for the receiver's credit.",
                                  value=relay.credit_stalls)
        yield CounterMetricFamily("fleetwire_relay_refused", "Relay opens refused and streams ended for a violation "
                                  "(relay_busy, relay_violation, plan checks).", value=relay.refused)
        yield GaugeMetricFamily("fleetwire_relay_waiting_streams", "Relayed streams waiting in line for room now "
                                "(their session's, principal's or the relay's share is held by other streams).",
                                value=relay.waiting)
        yield CounterMetricFamily("fleetwire_relay_idle_ends", "Relayed streams ended because no byte moved on them "
                                  "for --relay-idle (their window went back to the relay).", value=relay.idle_ends)

    def _penalty_box(self, now: float) -> Iterator[Metric]:
        penalties = CounterMetricFamily(
            "fleetwire_penalties", "Cool-offs imposed on a peer (new connections get 429), by the close that caused "
            "them.", labels=["code"],
        )
        gate = self._gate
        for code, n in sorted(gate.penalties.items() if gate is not None else ()):
            penalties.add_metric([code], n)
        yield penalties
        yield GaugeMetricFamily("fleetwire_penalty_boxed", "Peers (principal and address, or one worker id of them) "
                                "in a cool-off now.",
                                value=gate.penalty.boxed(now) if gate is not None else 0)
        pending = gate.pending if gate is not None else None
        yield GaugeMetricFamily("fleetwire_handshakes_pending", "TCP connections still in their websocket handshake.",
                                value=len(pending) if pending is not None else 0)
        yield CounterMetricFamily("fleetwire_handshakes_evicted", "Pending handshakes dropped past "
                                  "--max-pending-handshakes (the oldest first).",
                                  value=pending.evicted if pending is not None else 0)
        yield CounterMetricFamily("fleetwire_handshakes_accepted", "TCP connections the coordinator accepted "
                                  "(after their first byte, or after --defer-accept).",
                                  value=pending.accepted if pending is not None else 0)
        yield CounterMetricFamily("fleetwire_handshakes_idle_dropped", "Accepted TCP connections dropped at "
                                  "--handshake-timeout without having sent a byte.",
                                  value=pending.idle_dropped if pending is not None else 0)
        yield GaugeMetricFamily("fleetwire_defer_accept_seconds", "How long the kernel may hold a new TCP "
                                "connection until its first byte (TCP_DEFER_ACCEPT as it reports it); 0: off.",
                                value=gate.defer_accept_s if gate is not None else 0)
        yield CounterMetricFamily("fleetwire_refusal_logs_suppressed", "Refusals summed up in a per-address summary "
                                  "line instead of logged one by one.",
                                  value=gate.refusal_log.suppressed if gate is not None else 0)
        held = CounterMetricFamily("fleetwire_repeats_held", "Answers held --penalty-hold because their address "
                                   "sent too many of them: failed authentications (401) or /metrics scrapes.",
                                   labels=["kind"])
        held.add_metric(["unauthorized"], gate.auth_failures.over_count if gate is not None else 0)
        held.add_metric(["metrics"], gate.scrapes.over_count if gate is not None else 0)
        yield held
        yield CounterMetricFamily("fleetwire_cost_throttled", "Frames after which a client principal over "
                                  "--cost-rate work units per second was read more slowly.",
                                  value=self._read_policy.cost_throttles if self._read_policy is not None else 0)
        yield GaugeMetricFamily("fleetwire_replays_pending", "Large subscribe replays being sent in slices now.",
                                value=self._core.streams.replaying)

    def _workers(self, core: Coordinator, now: float) -> Iterator[Metric]:
        states = dict.fromkeys(WORKER_STATES, 0)
        connected = alive = draining = 0
        per_worker: dict[str, GaugeMetricFamily | CounterMetricFamily] = {
            "leases": GaugeMetricFamily("fleetwire_worker_leases", "Plans the coordinator placed on the worker.",
                                        labels=["worker"]),
            "in_flight": GaugeMetricFamily("fleetwire_worker_in_flight", "Plans running, as the worker reports.",
                                           labels=["worker"]),
            "age": GaugeMetricFamily("fleetwire_worker_last_beat_age_seconds", "Seconds since the worker's last beat.",
                                     labels=["worker"]),
            "power": GaugeMetricFamily("fleetwire_worker_power_watts", "Accelerator power draw (NVML).",
                                       labels=["worker"]),
            "energy": GaugeMetricFamily("fleetwire_worker_energy_per_token_microjoules",
                                        "Energy per generated token.", labels=["worker"]),
            "carbon": GaugeMetricFamily("fleetwire_worker_carbon_intensity_grams_per_kwh",
                                        "Grid carbon intensity of the worker's zone (gCO2e/kWh).",
                                        labels=["worker", "zone"]),
            "engine": GaugeMetricFamily("fleetwire_worker_engine_requests",
                                        "Requests in the worker's inference engine.", labels=["worker", "state"]),
            "kv": GaugeMetricFamily("fleetwire_worker_kv_cache_usage_ratio",
                                    "KV-cache usage of the worker's inference engine, 0..1.", labels=["worker"]),
            "latency": GaugeMetricFamily("fleetwire_worker_latency_seconds", "Latency of the worker's recent "
                                         "plans (its engine's requests), as it reports: p50 and p99.",
                                         labels=["worker", "quantile"]),
            "data_bytes": CounterMetricFamily("fleetwire_worker_data_bytes", "Bytes through the worker's data "
                                              "endpoint since it started, as it reports: inputs in, outputs out.",
                                              labels=["worker", "direction"]),
            "data_refused": CounterMetricFamily("fleetwire_worker_data_refused", "Requests the worker's data endpoint "
                                                "refused since it started, as it reports, by HTTP status.",
                                                labels=["worker", "status"]),
        }
        registry = core.registry
        for record in registry:
            is_alive = registry.is_alive(record.id, now)
            connected += record.connected
            alive += is_alive
            draining += record.draining
            states["alive" if is_alive else "suspect" if record.connected else "disconnected"] += 1
            wid = [record.id]
            per_worker["leases"].add_metric(wid, len(record.leases))
            per_worker["age"].add_metric(wid, max(0.0, now - record.last_beat_s))
            load = record.load
            if load is None:
                continue
            per_worker["in_flight"].add_metric(wid, load.in_flight)
            per_worker["power"].add_metric(wid, load.power_w)
            per_worker["energy"].add_metric(wid, load.uj_per_token)
            per_worker["carbon"].add_metric([record.id, record.capabilities.carbon_zone], load.zone_intensity_g_per_kwh)
            per_worker["engine"].add_metric([record.id, "running"], load.engine_running)
            per_worker["engine"].add_metric([record.id, "waiting"], load.engine_waiting)
            per_worker["kv"].add_metric(wid, load.kv_cache_usage)
            if load.latency_p50_ms or load.latency_p99_ms:  # the tail an SLO alert watches
                per_worker["latency"].add_metric([record.id, "0.5"], load.latency_p50_ms / 1e3)
                per_worker["latency"].add_metric([record.id, "0.99"], load.latency_p99_ms / 1e3)
            if load.data_bytes_in or load.data_bytes_out:
                per_worker["data_bytes"].add_metric([record.id, "in"], load.data_bytes_in)
                per_worker["data_bytes"].add_metric([record.id, "out"], load.data_bytes_out)
            for status, n in sorted(load.data_refused.items()):
                per_worker["data_refused"].add_metric([record.id, status], n)
        by_state = GaugeMetricFamily("fleetwire_workers", "Registered workers by liveness.", labels=["state"])
        for state, n in states.items():
            by_state.add_metric([state], n)
        yield by_state
        yield GaugeMetricFamily("fleetwire_workers_connected", "Workers with an open session.", value=connected)
        yield GaugeMetricFamily("fleetwire_workers_alive", "Connected workers that beat within the timeout.",
                                value=alive)
        yield GaugeMetricFamily("fleetwire_workers_draining", "Workers drained by an operator.", value=draining)
        yield from per_worker.values()

    def _plans(self, core: Coordinator) -> Iterator[Metric]:
        counts = dict.fromkeys(PLAN_STATES, 0)
        for plan in core.plans.values():  # one pass per scrape; never on the hot path
            counts[plan.state] += 1
        plans = GaugeMetricFamily("fleetwire_plans", "Plans held by the coordinator, by state.", labels=["state"])
        for state, n in counts.items():
            plans.add_metric([state], n)
        yield plans
        yield GaugeMetricFamily("fleetwire_queue_depth", "Plans waiting in the queue.", value=len(core.queue))
        placements = CounterMetricFamily(
            "fleetwire_placements", "Placement decisions, by the policy that made them.", labels=["policy"]
        )
        for key, n in sorted(core.counters.items()):
            if key.startswith("placements."):
                placements.add_metric([key.removeprefix("placements.")], n)
        yield placements
        timings = core.timings
        wait = HistogramMetricFamily(
            "fleetwire_plan_queue_wait_seconds", "Time from entering the queue to the worker's accept."
        )
        wait.add_metric([], _buckets(timings.queue_wait), timings.queue_wait.sum)
        yield wait
        run = HistogramMetricFamily(
            "fleetwire_plan_run_seconds", "Time from the worker's accept to its done, by outcome.", labels=["outcome"]
        )
        for outcome, hist in timings.run_time.items():
            run.add_metric([outcome], _buckets(hist), hist.sum)
        yield run
        footprint = core.footprint  # coordinator/receipts.py: every finished attempt's receipt
        joules = CounterMetricFamily("fleetwire_plan_energy_joules", "Energy of finished plans, as their receipts "
                                     "say (measured or estimated), by principal and op.", labels=["principal", "op"])
        grams = CounterMetricFamily("fleetwire_plan_co2e_grams", "Emissions of finished plans (gCO2e), as their "
                                    "receipts say, by principal and op.", labels=["principal", "op"])
        for (principal, op), value in sorted(footprint.joules.items()):
            joules.add_metric([principal, op], value)
            grams.add_metric([principal, op], footprint.co2e_g.get((principal, op), 0.0))
        yield joules
        yield grams

    def _io(self) -> Iterator[Metric]:
        frames = CounterMetricFamily("fleetwire_frames", "Websocket frames, by session role and direction.",
                                     labels=["role", "direction"])
        sizes = CounterMetricFamily("fleetwire_bytes", "Websocket payload bytes, by session role and direction.",
                                    labels=["role", "direction"])
        f = FrameCounters
        for role, c in sorted(self._frames.by_role.items()):
            frames.add_metric([role, "in"], c[f.FRAMES_IN])
            frames.add_metric([role, "out"], c[f.FRAMES_OUT])
            sizes.add_metric([role, "in"], c[f.BYTES_IN])
            sizes.add_metric([role, "out"], c[f.BYTES_OUT])
        yield frames
        yield sizes
        sessions = GaugeMetricFamily("fleetwire_sessions", "Open websocket sessions, by role.", labels=["role"])
        open_sessions = self._sessions() if self._sessions is not None else {}
        for role in sorted({*self._frames.by_role, *open_sessions}):
            sessions.add_metric([role], open_sessions.get(role, 0))
        yield sessions


def build_registry(core: Coordinator, *, process: bool = True, **kwargs: Any) -> CollectorRegistry:
    """A fresh registry with the coordinator's collector (and the process collector: CPU, memory, fds).

    ``kwargs`` go to :class:`CoordinatorCollector`.
    """
    registry = CollectorRegistry(auto_describe=False)
    registry.register(CoordinatorCollector(core, **kwargs))
    if process:
        ProcessCollector(registry=registry)
    return registry


def render(registry: CollectorRegistry) -> bytes:
    """The Prometheus text exposition of ``registry``."""
    return generate_latest(registry)


def render_openmetrics(registry: CollectorRegistry) -> bytes:
    """The OpenMetrics exposition of ``registry``: the latency histograms' buckets carry trace exemplars."""
    body: bytes = openmetrics_latest(registry)  # type: ignore[no-untyped-call]  # prometheus-client leaves it untyped
    return body
