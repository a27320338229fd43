"""The coordinator's decisions, with no I/O: the sans-I/O core the asyncio server drives.

The server feeds inputs and carries out the effects:

* :meth:`Coordinator.open_session` / :meth:`~Coordinator.close_session`: a connection came
  or went (for any reason);
* :meth:`Coordinator.receive`: one decoded message (or ``DecodeFailure``) from a connection;
* :meth:`Coordinator.tick`: the clock moved; retention, drain deadlines, the autoscaler and the reaper run;
* :meth:`Coordinator.take_effects`: the frames to send (per connection, in order) and the
  connections to close, accumulated since the last call.

Time comes in as ``now`` (monotonic seconds) and plan ids from the ``new_id`` callable, so
tests drive the core with a fake clock and fixed ids. Nothing here awaits, reads a clock,
or draws a random number. docs/SEMANTICS.md is the contract; sections are cited as §Name.

This module is the wiring and the dispatch of inputs. The work is done by collaborators,
built in this order, each handed only the state and collaborators above it (calls go down,
never up; none of them imports this module)::

    state.py              CoreState       the shared tables: registry, plans, names, queue, subscriptions,
                                          sessions, quota, timings, footprint, counters, journal, ledger,
                                          placement
    effects.py            Outbox          sends, closes, refusals         <- sessions
    retention.py          Retention       forgets old finished plans      <- plans, registry, journal
    streams.py            Streams         emit, fail, replay              <- Outbox, Retention, quota
    data_plane.py         DataPlane       ticket keys, data grants        <- registry, Outbox, Streams
    relay.py              Relay           relayed bytes, credit per stream <- plans, registry, Outbox
    sharing.py            Sharing         fair share's leases, quotas,    <- registry, queue, placement, Outbox,
                                          preemption, the usage ledger       Streams (the registry tells it of leases)
    scheduling.py         Scheduler       queue <-> placement <-> leases  <- Streams, Outbox, DataPlane, Sharing
    plan_graphs.py        PlanGraphs      references, after, lineage      <- Streams, Scheduler, DataPlane
    recovery.py           Recovery        records, acks, restore, retries <- Scheduler
    operator_requests.py  OperatorRequests  list_plans, drain, undrain    <- Scheduler, Outbox
    timeouts.py           RunTimeouts     timeout_s backstop              <- registry, Outbox, Streams
    worker_sessions/      WorkerSessions  worker messages, the reaper     <- CoreState and all of the above
    client_session.py     ClientSessions  client messages                 <- CoreState, Streams, Scheduler, Outbox,
                                                                             operator
    carbon_holds.py       CarbonHolds     plans held for a greener hour   <- CoreState, Scheduler, Streams (told by
                                                                             ClientSessions, Leases, restore, tick)

The core hands ``now`` to the streams (``Streams.now``) before each input, for plans that end in it.

Invariant after every input: no queued plan has an alive worker with room that can run
it. Placement runs where that could break: on submit, on a worker's (re)registration or
return to life, on a lease release, after a requeue (coordinator/scheduling.py).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Final, assert_never, get_args

import structlog

from coordinator import scopes
from coordinator.autoscaler import AutoscaleConfig, Autoscaler, Decision, pick_removals, pool_signals, unfit_idle
from coordinator.carbon_holds import CarbonHolds
from coordinator.carbon_time import ShiftConfig
from coordinator.client_session import ClientSessions
from coordinator.data_plane import DataPlane
from coordinator.effects import Effects, Outbox
from coordinator.ledger import UsageRow
from coordinator.limits import PlanQuota
from coordinator.operator_requests import OperatorRequests
from coordinator.placement.placer import PlacementConfig
from coordinator.plan_graphs import PlanGraphs
from coordinator.plans import EVERY_PRINCIPAL, Plan, held_size
from coordinator.reconnects import ReconnectBudget
from coordinator.records import StoredPlan
from coordinator.recovery import Recovery
from coordinator.registry import WorkerRegistry
from coordinator.relay import Relay
from coordinator.retention import DEFAULT_RETENTION_BYTES, Retention
from coordinator.scheduling import Scheduler
from coordinator.sessions import Role, Session
from coordinator.sharing import Sharing, SharingConfig
from coordinator.state import CoreState
from coordinator.streams import Streams
from coordinator.teams import TeamBook
from coordinator.timeouts import DEFAULT_GRACE_S, RunTimeouts
from coordinator.worker_sessions import WorkerSessionConfig, WorkerSessions
from protocol import errors
from protocol.codec import DecodeFailure
from protocol.messages import Ack, Event, FromClient, FromWorker
from protocol.relay import DEFAULT_IDLE_S, DEFAULT_MAX_BYTES, DEFAULT_WINDOW_BYTES

__all__ = ["Coordinator", "CoreConfig", "Effects"]

log = structlog.get_logger(__name__)

# The message types each role may send, for the dispatch in Coordinator.receive.
FROM_WORKER_TYPES: Final[tuple[type[FromWorker], ...]] = get_args(FromWorker)
FROM_CLIENT_TYPES: Final[tuple[type[FromClient], ...]] = get_args(FromClient)
# The same as sets of exact types: isinstance against a tuple of msgspec Struct classes asks each class's
# metaclass in turn (about 0.3 us for a done, the sixth); a subclass still matches through isinstance.
_WORKER_KINDS: Final[frozenset[type]] = frozenset(FROM_WORKER_TYPES)
_CLIENT_KINDS: Final[frozenset[type]] = frozenset(FROM_CLIENT_TYPES)


@dataclass(frozen=True)
class CoreConfig:
    """Settings of the core; ``ServerSettings.core`` carries them (the server adds only ``version``)."""

    heartbeat_interval_s: float = 10.0
    heartbeat_timeout_s: float = 30.0
    max_protocol_errors: int = 100  # per session; reaching it closes the session with 4400
    max_plans_per_client: int = 10_000  # unfinished plans per client principal (0: no limit; coordinator/limits.py)
    max_bytes_per_client: int = 64 << 20  # ... and their bytes: args, requirements, overhead (0: no limit)
    max_events_per_plan: int = 10_000  # events held in memory per plan (coordinator/plans.py)
    max_event_bytes_per_plan: int = 64 << 20  # ... and their payload bytes (0: no byte bound)
    version: str = ""  # the coordinator's version, put in ``welcome``
    breaker_fraction: float = 0.5  # reaper circuit breaker: share of connected workers stale at once
    breaker_min_workers: int = 3  # ... among at least this many connected workers (coordinator/recovery.py)
    placement: PlacementConfig = field(default_factory=PlacementConfig)  # coordinator/placement/placer.py
    autoscale: AutoscaleConfig | None = None  # None: no autoscaler (coordinator/autoscaler.py)
    data_ticket_ttl_s: float = 3600.0  # data-plane tickets are valid this long (coordinator/data_plane.py)
    data_key_rotation_s: float = 86_400.0  # the driver rotates the ticket key this often (0: never)
    relay_window_bytes: int = DEFAULT_WINDOW_BYTES  # a relayed stream's credit (coordinator/relay.py)
    relay_max_bytes: int = DEFAULT_MAX_BYTES  # ... and all relayed streams' credit together
    relay_principal_bytes: int = 0  # ... one principal's streams' (0: half of relay_max_bytes)
    relay_session_bytes: int = 0  # ... one client session's streams' (0: a quarter of relay_max_bytes)
    relay_idle_s: float = DEFAULT_IDLE_S  # a relayed stream's window on which nothing moved this long goes back
    plan_retention_s: float = 86_400.0  # finished plans are forgotten this long after they end (0: never)
    plan_retention_bytes: int = DEFAULT_RETENTION_BYTES  # ... or, oldest first, past these retained bytes (0: none)
    run_timeout_grace_s: float = DEFAULT_GRACE_S  # a running attempt past timeout_s + this fails (timeouts.py)
    worker_reconnect_rate: float = 0.2  # registrations per second a worker id regains (0: no budget; reconnects.py)
    worker_reconnect_burst: int = 10  # ... and may make at once; past it hello gets too_many_reconnects + 4429
    # A worker whose connection closed keeps its plans this long for a reconnect (with its session secret),
    # then they are requeued: a killed worker's plans need not wait for the heartbeat timeout (registry.py).
    worker_reconnect_grace_s: float = 5.0
    # Shared fleets (coordinator/sharing.py): a preempted plan has this long to checkpoint and end, and a plan
    # runs at least this long before it may be preempted.
    preemption_grace_s: float = 30.0
    preemption_min_run_s: float = 10.0
    # Carbon time shifting (coordinator/carbon_holds.py): the planner's knobs (coordinator/carbon_time/planner.py).
    carbon: ShiftConfig = field(default_factory=ShiftConfig)


class Coordinator:
    """The coordinator state machine: registry, plans, queue, sessions and subscriptions.

    The collaborators are public attributes for tests, metrics and the server to read; the
    driver API is the methods below.

    Args:
        config: settings.
        new_id: makes a plan id when the client gives none.
        new_secret: makes a worker session's ``welcome.session_secret``; it must be unguessable
            in production (the server passes ``secrets.token_urlsafe``). The default, ``secret-1``,
            ``secret-2`` ..., is for tests and examples only.
    """

    def __init__(
        self, config: CoreConfig, new_id: Callable[[], str], new_secret: Callable[[], str] | None = None
    ) -> None:
        self.config = config
        # The tables every collaborator shares (coordinator/state.py), public by name for tests, metrics, the server.
        state = self.state = CoreState.new(
            registry=WorkerRegistry(
                config.heartbeat_timeout_s, prefetch=config.placement.prefetch,
                reconnect_grace_s=config.worker_reconnect_grace_s,
            ),
            quota=PlanQuota(config.max_plans_per_client, config.max_bytes_per_client),  # coordinator/limits.py
            placement=config.placement,
        )
        self.registry, self.plans, self.names, self.queue = state.registry, state.plans, state.names, state.queue
        self.subscriptions, self.sessions, self.quota = state.subscriptions, state.sessions, state.quota
        self.timings, self.footprint, self.counters = state.timings, state.footprint, state.counters
        self.placement = state.placement
        self.autoscaler = Autoscaler(config.autoscale) if config.autoscale is not None else None
        journal = state.journal
        # The collaborators, each built on those before it (see the module docstring).
        self.outbox = Outbox(self.sessions, self.counters, config.max_protocol_errors)
        self.retention = Retention(  # forgets old finished plans (retention.py)
            plans=self.plans, registry=self.registry, subscriptions=self.subscriptions, journal=journal,
            counters=self.counters, retention_s=config.plan_retention_s, max_bytes=config.plan_retention_bytes,
            quota=self.quota,  # a principal's finished plans share its --max-bytes-per-client budget
            names=self.names,
        )
        self.streams = Streams(
            outbox=self.outbox, subscriptions=self.subscriptions, plans=self.plans, journal=journal, quota=self.quota,
            retention=self.retention, counters=self.counters, max_events=config.max_events_per_plan,
            max_event_bytes=config.max_event_bytes_per_plan, sessions=self.sessions,
        )
        self.data = DataPlane(  # ticket keys and grants (coordinator/data_plane.py)
            registry=self.registry, outbox=self.outbox, streams=self.streams, ticket_ttl_s=config.data_ticket_ttl_s,
            rotation_s=config.data_key_rotation_s,
        )
        self.relay = Relay(  # inputs and outputs carried through the coordinator (coordinator/relay.py)
            plans=self.plans, registry=self.registry, outbox=self.outbox, window_bytes=config.relay_window_bytes,
            max_bytes=config.relay_max_bytes, principal_bytes=config.relay_principal_bytes,
            session_bytes=config.relay_session_bytes, idle_s=config.relay_idle_s, sessions=self.sessions,
        )
        self.sharing = Sharing(  # fair share's leases and capacity, quotas, preemption, the ledger (sharing.py)
            registry=self.registry, plans=self.plans, queue=state.queue, placement=self.placement,
            outbox=self.outbox, streams=self.streams, ledger=state.ledger, counters=self.counters,
            config=SharingConfig(config.preemption_grace_s, config.preemption_min_run_s),
        )
        self.registry.watcher = self.sharing  # every lease's start and end (coordinator/registry.py)
        self.streams.on_end = self._plan_ended  # the ledger's outcomes, the plan graph's ends
        self.scheduler = Scheduler(
            registry=self.registry, plans=self.plans, queue=self.queue, placement=self.placement,
            streams=self.streams, outbox=self.outbox, counters=self.counters, data=self.data, sharing=self.sharing,
        )
        self.graphs = PlanGraphs(state, streams=self.streams, scheduler=self.scheduler, data=self.data)
        self.recovery = Recovery(  # records, acks, restore, hand-back, retries (coordinator/recovery.py)
            plans=self.plans, registry=self.registry, scheduler=self.scheduler, journal=journal,
            counters=self.counters, heartbeat_timeout_s=config.heartbeat_timeout_s, names=self.names,
            breaker_fraction=config.breaker_fraction, breaker_min_workers=config.breaker_min_workers,
        )
        self.operator = OperatorRequests(  # list_plans, drain_worker, undrain_worker (operator_requests.py)
            registry=self.registry, plans=self.plans, queue=self.queue, scheduler=self.scheduler, outbox=self.outbox,
        )
        self.timeouts = RunTimeouts(  # the coordinator's own timeout_s backstop (coordinator/timeouts.py)
            plans=self.plans, registry=self.registry, outbox=self.outbox, streams=self.streams, timings=self.timings,
            grace_s=config.run_timeout_grace_s,
        )
        self.workers = WorkerSessions(  # coordinator/worker_sessions/
            state, outbox=self.outbox, streams=self.streams, scheduler=self.scheduler, recovery=self.recovery,
            operator=self.operator, config=WorkerSessionConfig(
                config.heartbeat_interval_s, config.heartbeat_timeout_s, config.version, config.placement.prefetch,
                new_secret or map("secret-{}".format, itertools.count(1)).__next__,
            ),
            data=self.data, relay=self.relay, timeouts=self.timeouts,
            reconnects=ReconnectBudget(config.worker_reconnect_rate, config.worker_reconnect_burst),
            sharing=self.sharing,
        )
        self.operator.remover = self._remove_worker  # remove_worker (operator_requests.py)
        self.clients = ClientSessions(
            state, outbox=self.outbox, streams=self.streams, scheduler=self.scheduler, operator=self.operator,
            new_id=new_id, data=self.data, relay=self.relay, version=config.version, sharing=self.sharing)
        self.carbon = self._carbon_holds(state, config)  # plans held for a greener hour (coordinator/carbon_holds.py)

    def _carbon_holds(self, state: CoreState, config: CoreConfig) -> CarbonHolds:
        """Plans with a deadline may wait for a greener hour (coordinator/carbon_holds.py); the client sessions
        hold and release them, the leases observe run times and account receipts; its driver feeds forecasts."""
        carbon = CarbonHolds(state, scheduler=self.scheduler, streams=self.streams, config=config.carbon,
                             restore_wait_s=config.heartbeat_timeout_s)  # fmt: skip
        self.clients.carbon = self.workers.leases.carbon = carbon
        return carbon

    # ================================================================== driver API

    def open_session(
        self,
        conn_id: int,
        role: Role,
        now: float,
        *,
        principal: str = "",
        address: str = "",
        admin: bool = False,
        worker_ids: str | None = None,
        identity: str = "",
        named_worker_id: str | None = None,
    ) -> None:
        """A connection was accepted. ``admin`` sessions see every principal's plans.

        ``worker_ids`` limits the ids a worker session may register (a glob; None: any).
        ``identity`` names the peer's verified client certificate (mTLS), "" when none: a
        worker session with the same identity as a live id's holder may take that id over.
        ``named_worker_id``: the id a worker's upgrade request named (``?worker_id=``, docs/PROTOCOL.md
        §1), None when none; its ``hello`` must name the same id (else 4403).

        Raises:
            ValueError: ``conn_id`` is already open (a driver bug).
        """
        if conn_id in self.sessions:
            raise ValueError(f"connection {conn_id} is already open")
        self.sessions[conn_id] = Session(
            conn_id, role, principal, address, admin, worker_ids=worker_ids, identity=identity,
            named_worker_id=named_worker_id,
        )

    def receive(self, conn_id: int, msg: FromWorker | FromClient | DecodeFailure, now: float) -> None:
        """One message from a connection: a Struct of its role's inbound union, or a DecodeFailure."""
        session = self.sessions.get(conn_id)
        if session is None or session.closing:
            return
        self.streams.now = self.sharing.now = now
        kind = type(msg)  # the exact kinds first: a failed isinstance on a Struct costs more than a set test
        if kind in _WORKER_KINDS and session.role == "worker":
            self.workers.on_message(session, msg, now)  # type: ignore[arg-type]  # a FromWorker: mypy reads no set test
        elif kind in _CLIENT_KINDS and session.role == "client":
            self.clients.on_message(session, msg, now)  # type: ignore[arg-type]  # a FromClient, as above
        elif isinstance(msg, DecodeFailure):
            if msg.code == errors.UNKNOWN_TYPE and scopes.foreign_type(session.role, msg.type):
                self.outbox.forbid(session, f"a {session.role} session may not send {msg.type!r}", "foreign_type")
            else:
                self.outbox.protocol_error(session, msg.code, msg.message, req_id=msg.req_id)
        elif session.role == "worker" and (type(msg) in _WORKER_KINDS or isinstance(msg, FROM_WORKER_TYPES)):
            self.workers.on_message(session, msg, now)  # type: ignore[arg-type]  # a FromWorker: mypy reads no set test
        elif session.role == "client" and (type(msg) in _CLIENT_KINDS or isinstance(msg, FROM_CLIENT_TYPES)):
            self.clients.on_message(session, msg, now)  # type: ignore[arg-type]  # a FromClient, as above
        else:
            self._misdirected(session, msg)
        if self.relay.streams:  # a relayed stream's plan may have ended or moved on: its window goes back at once
            self.relay.plan_moved(getattr(msg, "plan_id", ""))

    def close_session(self, conn_id: int, now: float) -> None:
        """The connection is gone, for any reason. Idempotent; an unknown id is a no-op."""
        session = self.sessions.pop(conn_id, None)
        if session is None:
            return
        self.sharing.now = now
        self.outbox.discard(conn_id)
        self.recovery.forget(conn_id)
        self.relay.connection_closed(conn_id)
        match session.role:
            case "worker":
                self.workers.detach(session, now)
            case "client":
                self.subscriptions.drop(conn_id)
                self.streams.drop_replays(conn_id)
            case _:
                assert_never(session.role)

    def tick(self, now: float) -> list[str]:
        """Reap workers silent past the timeout (§Registry); returns their ids, sorted.

        Finished plans past their retention are forgotten first (coordinator/retention.py),
        running plans past ``timeout_s`` + grace fail ``timeout`` (coordinator/timeouts.py),
        drained workers past their deadline hand their plans back, and the autoscaler is fed.
        """
        self.streams.now = self.sharing.now = now
        self.retention.sweep(now)
        self.timeouts.expire(now)  # running past timeout_s + grace: failed timeout (coordinator/timeouts.py)
        self.relay.expire(now)  # relayed streams idle past relay_idle_s give their windows back (coordinator/relay.py)
        self.operator.tick(now)
        self._autoscale(now)
        self.scheduler.catch_up_waiting(now)  # waiting reasons a refresh left past its budget (scheduling.py)
        self.carbon.tick(now)  # held plans whose greener window began are placed (coordinator/carbon_holds.py)
        reaped = self.workers.reap(now)
        self._share(now)
        self.graphs.tick(reaped, now)  # outputs the reaped workers held are lost; waits for busy holders end
        return reaped

    def _plan_ended(self, plan: Plan) -> None:
        """A plan's terminal event went out (``Streams.on_end``): the ledger and the plan graph are told."""
        self.sharing.plan_ended(plan)
        self.graphs.ended(plan, self.streams.now)

    def _remove_worker(self, worker_id: str, now: float) -> None:
        """An operator removed a worker for good: the outputs it made go with it (plan_graphs.py)."""
        self.workers.remove(worker_id, now)
        self.graphs.holder_lost(worker_id, now)

    def set_teams(self, teams: TeamBook, now: float) -> None:
        """The token file's teams, weights and quotas, at start and on each reload (coordinator/sharing.py)."""
        self.sharing.now = now
        self.sharing.set_teams(teams, now)

    def pump(self, budget: int, busy: Callable[[int], bool] | None = None) -> int:
        """Send the next slices of large replays (coordinator/streams.py); the driver calls it once per
        loop turn while ``streams.replaying``. ``busy(conn_id)``: that subscriber's replay waits.
        Returns the events sent."""
        return self.streams.pump(budget, busy)

    def take_effects(self) -> Effects:
        """What accumulated since the last call; the core forgets it."""
        send = self.outbox.send
        for conn_id, seq in self.recovery.take_acks():  # sent only once the records below are committed
            send(conn_id, Ack(seq=seq))
        effects = self.outbox.take()
        effects.records = self.recovery.take_records()
        if self.sharing.usage_due:  # once a tick: the usage ledger's changed rows (coordinator/sharing.py)
            usage = self.sharing.usage_record()
            if usage is not None:
                effects.records.append(usage)
        return effects

    def restore_usage(self, rows: Iterable[UsageRow]) -> None:
        """Load the usage ledger's rows a store kept (its ``usage`` ability), at start, before any session opens."""
        self.sharing.restore_usage(list(rows))

    def restore(self, stored: Iterable[StoredPlan], now: float) -> None:
        """Load the plans a store kept, before any session opens (coordinator/recovery.py).

        Queued plans are queued again; leased and running ones wait one heartbeat timeout,
        from ``now``, for their worker to reconnect and claim them.
        """
        self.sharing.now = now
        self.registry.restored_at = now  # a worker not back yet is awaited, not gone, for a heartbeat timeout
        queued = self.recovery.restore(stored, now)
        finished: list[Plan] = []
        for plan in self.plans.values():  # restored unfinished plans count against their owner's quota
            if not plan.terminal:
                self.quota.add(plan.owner, plan.id, held_size(plan))
            else:
                finished.append(plan)
        self.retention.restored(finished, now)  # their retention runs from their stored end time
        for plan in self.plans.values():  # references, orders and rebuilds back into the plan graph
            if plan.graphed or plan.rebuild_of is not None or plan.replicas:
                self.graphs.restored(plan)
        for plan in queued:  # no worker is connected yet: nothing is placed, reasons are kept as stored
            if plan.deadline_at is None or not self.carbon.restored(plan, now):  # held for carbon: decided later
                self.scheduler.queue_restored(plan, now)

    def set_wall_offset(self, offset_s: float) -> None:
        """Unix time minus ``now``: the driver's wall clock, for the end times stored with plans.

        The core reads no clock; the driver sets this at start and may refresh it (each tick).
        """
        self.retention.wall_offset = offset_s
        self.data.wall_offset = offset_s
        self.sharing.wall_offset = offset_s
        self.carbon.wall_offset = offset_s

    def forecast_changed(self, zones: Iterable[str], now: float) -> None:
        """A carbon forecast feed changed ``zones`` in ``carbon.book``: plans that may run there are decided again."""
        self.streams.now = self.sharing.now = now
        self.carbon.forecast_changed(zones, now)

    def summary(self, now: float) -> str:
        """``"N workers (C CPUs, G GPUs, R GB RAM)"`` over alive workers."""
        return self.registry.summary(now)

    # ================================================================== helpers

    def _misdirected(self, session: Session, msg: object) -> None:
        """A message of the other role's union (a driver that decoded it without checking the role)."""
        config = getattr(type(msg), "__struct_config__", None)
        tag = getattr(config, "tag", None) or type(msg).__name__
        if scopes.foreign_type(session.role, tag):
            self.outbox.forbid(session, f"a {session.role} session may not send {tag!r}", "foreign_type")
            return
        self.outbox.protocol_error(
            session,
            errors.UNKNOWN_TYPE,
            f"message type {tag!r} is not accepted on a {session.role} session",
            req_id=getattr(msg, "req_id", 0),
        )

    def _share(self, now: float) -> None:
        """The tick's part of shared fleets (coordinator/sharing.py): capacity, keys, preemption, overdue victims."""
        sharing = self.sharing
        sharing.refresh_capacity(now)
        self.queue.advance(now)  # the service of running leases counts up to now
        for plan_id in sharing.overdue(now):  # a worker that did not stop a preempted plan: taken back
            self.scheduler.take_back_preempted(self.plans[plan_id], now)
        sharing.preempt(now)
        sharing.tick(now)  # the ledger's changed rows go with the next effects; old hours fold hourly

    def _autoscale(self, now: float) -> None:
        """Feed the autoscaler; its decisions go to admin followers and to the server's hook command."""
        if self.autoscaler is None or not self.autoscaler.due(now):
            return
        signals = pool_signals(self.queue, self.registry, self.plans, now)
        unfit = unfit_idle(self.registry, signals, self.autoscaler.managed, now)  # the provider's idle misfits
        for decision in self.autoscaler.observe(now, signals, unfit):
            if decision.action == "scale_down":
                decision = self._name_removals(decision, now)
            data = decision.as_dict()
            self.outbox.decided(data)
            log.info("autoscaler decision", **data)
            event = Event(plan_id="", kind="autoscale", data=data, seq=self.autoscaler.decisions_made)
            for conn_id in self.subscriptions.all_followers(EVERY_PRINCIPAL):
                self.outbox.send(conn_id, event)

    def autoscale_note(self, data: dict[str, Any]) -> None:
        """Tell admin followers something the autoscaler's provider did (an ``autoscale`` event, plan_id "")."""
        if self.autoscaler is None:
            return
        event = Event(plan_id="", kind="autoscale", data=data, seq=self.autoscaler.decisions_made)
        for conn_id in self.subscriptions.all_followers(EVERY_PRINCIPAL):
            self.outbox.send(conn_id, event)

    def _name_removals(self, decision: Decision, now: float) -> Decision:
        """A scale-down names its workers (idle first, then least work lost) and drains them.

        A decision that names them already (idle workers unable to run what waits) drains those.
        """
        assert self.autoscaler is not None
        registry = self.registry
        members = [
            registry.get(w) for w in decision.workers or self.autoscaler.members(decision.pool)
            if w in registry and not registry.get(w).draining and registry.is_alive(w, now)
        ]
        count = len(members) if decision.workers else len(members) - decision.desired
        victims = pick_removals(members, count, self.plans, now)
        for worker_id in victims:
            self.operator.drain_record(registry.get(worker_id), self.autoscaler.config.drain_deadline_s, now)
        return dataclasses.replace(decision, workers=tuple(victims))
