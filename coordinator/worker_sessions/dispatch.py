"""The worker session's dispatch (docs/SEMANTICS.md §Worker session): each message to its owner.

What it owns: nothing but the routing. :class:`WorkerSessions` builds the registration, the
lease traffic and the liveness of worker sessions (coordinator/worker_sessions/), sends every
message a worker sends to the one that handles it, and is what the core calls.

Rules:

* Nothing but ``hello`` is accepted before the session has registered a worker id
  (``not_registered``).
* ``accept``/``reject``/``event``/``done`` carry a ``seq``: a re-send of one already applied
  (after a reconnect) is acked and dropped before it reaches its handler (coordinator/recovery.py).
* ``data_chunk``/``data_credit``/``data_end`` go to the relay (coordinator/relay.py), untouched; a
  ``data_open`` is a relayed pull (``Relay.open_pull``: a plan it runs takes another plan's output).

Depends on the collaborators it is handed, which it passes on, and the core's shared state
(coordinator/state.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, assert_never

from coordinator.worker_sessions.leases import Leases
from coordinator.worker_sessions.liveness import Liveness
from coordinator.worker_sessions.registration import Identities, Registration, WorkerSessionConfig
from protocol import errors
from protocol.messages import (
    Accept,
    DataChunk,
    DataCredit,
    DataEnd,
    DataOpen,
    Done,
    Event,
    FromWorker,
    Goodbye,
    Heartbeat,
    Hello,
    Reject,
)

if TYPE_CHECKING:
    from coordinator.data_plane import DataPlane
    from coordinator.effects import Outbox
    from coordinator.operator_requests import OperatorRequests
    from coordinator.reconnects import ReconnectBudget
    from coordinator.recovery import Recovery
    from coordinator.relay import Relay
    from coordinator.scheduling import Scheduler
    from coordinator.sessions import Session
    from coordinator.sharing import Sharing
    from coordinator.state import CoreState
    from coordinator.streams import Streams
    from coordinator.timeouts import RunTimeouts

__all__ = ["WorkerSessions"]

# The worker messages that carry a ``seq`` and are acked, most frequent first: isinstance tries them in
# order, and each miss on a msgspec Struct class goes through its metaclass.
NUMBERED = (Done, Event, Accept, Reject)


class WorkerSessions:
    """Handles worker sessions' messages, their detach, and the reaper.

    Args:
        state: the core's shared tables (coordinator/state.py).
        outbox: replies, closes and refusals.
        streams: plans' lifecycle events.
        scheduler: fills workers with room, requeues lost leases, refreshes waiting reasons.
        recovery: de-duplication, hand-back, retries and the reaper's breaker.
        operator: tells a drained worker again after its ``welcome``.
        config: the settings said in ``welcome`` (heartbeat interval and timeout, version, prefetch, secrets).
        data: the data-plane ticket keys, put in ``welcome``.
        relay: carries the worker's ``data_chunk``/``data_credit``/``data_end`` (coordinator/relay.py).
        timeouts: starts a running attempt's ``timeout_s`` clock (coordinator/timeouts.py).
        reconnects: each worker id's registration budget (coordinator/reconnects.py); None: none.
        sharing: preempted attempts and the usage ledger's receipts (coordinator/sharing.py); None: none.

    Attributes:
        registration: hello, goodbye, removal (coordinator/worker_sessions/registration.py).
        leases: accept, reject, event, done (coordinator/worker_sessions/leases.py).
        liveness: heartbeats, detach, the reaper (coordinator/worker_sessions/liveness.py).
    """

    def __init__(
        self,
        state: CoreState,
        *,
        outbox: Outbox,
        streams: Streams,
        scheduler: Scheduler,
        recovery: Recovery,
        operator: OperatorRequests,
        config: WorkerSessionConfig,
        data: DataPlane | None = None,
        relay: Relay | None = None,
        timeouts: RunTimeouts | None = None,
        reconnects: ReconnectBudget | None = None,
        sharing: Sharing | None = None,
    ) -> None:
        self._state = state
        self._outbox = outbox
        self._recovery = recovery
        self._relay = relay
        identities = Identities()
        self.leases = Leases(
            state, outbox=outbox, streams=streams, scheduler=scheduler, recovery=recovery, timeouts=timeouts,
            sharing=sharing,
        )
        if scheduler.graphs is not None:  # a success held for copies of its outputs ends here (plan_graphs.py)
            scheduler.graphs.finish = self.leases.finish
        self.registration = Registration(
            state, outbox=outbox, scheduler=scheduler, recovery=recovery, operator=operator, config=config,
            identities=identities, adopted=self.leases.adopted, data=data, timeouts=timeouts, reconnects=reconnects,
        )
        self.liveness = Liveness(
            state, outbox=outbox, scheduler=scheduler, recovery=recovery, identities=identities,
            heartbeat_timeout_s=config.heartbeat_timeout_s,
        )

    def on_message(self, s: Session, msg: FromWorker, now: float) -> None:
        """One message from a worker session."""
        # A plan's own three messages are told apart by their exact type first: compiled (setup.py), each
        # isinstance test that fails on a msgspec Struct takes the metaclass's slow path (~600 instructions).
        # Their checks are inlined here (_registered), and Recovery.lease de-duplicates and finds the lease at once.
        if type(msg) is Done or type(msg) is Accept or type(msg) is Event:
            worker_id = s.worker_id
            if worker_id is None or self._state.registry.record_of(worker_id) is None:
                self._registered(s, msg)  # answers not_registered
                return
            lease = self._recovery.lease(s.conn_id, worker_id, msg)  # the plan, or True for a re-send
            if lease is True:
                return  # a re-send of a message already applied (after a reconnect): acked, not applied twice
            plan = None if lease is False else lease  # None: Leases._lease checks it and answers
            if type(msg) is Done:
                self.leases.done(s, worker_id, msg, now, plan)
            elif type(msg) is Accept:
                self.leases.accept(s, worker_id, msg, now, plan)
            elif type(msg) is Event:  # (always, here: spelled out for the type checker)
                self.leases.event(s, worker_id, msg, now, plan)
            return
        if isinstance(msg, Hello):
            self.registration.hello(s, msg, now)
            return
        worker_id = self._registered(s, msg)
        if worker_id is None:
            return
        if isinstance(msg, NUMBERED) and self._recovery.duplicate(s.conn_id, worker_id, msg):
            return  # a re-send of a message already applied (after a reconnect): acked, not applied twice
        match msg:  # each case is an isinstance test (a subclass of the three above comes here too)
            case Done():
                self.leases.done(s, worker_id, msg, now)
            case Accept():
                self.leases.accept(s, worker_id, msg, now)
            case Event():
                self.leases.event(s, worker_id, msg, now)
            case Heartbeat():
                self.liveness.heartbeat(worker_id, msg, now)
            case Reject():
                self.leases.reject(s, worker_id, msg, now)
            case Goodbye():
                self.registration.goodbye(s, worker_id, msg, now)
            case DataChunk() | DataCredit() | DataEnd():
                if self._relay is not None:
                    self._relay.on_data(s.conn_id, msg)
            case DataOpen():  # a relayed pull: another plan's output, for a plan it runs (PROTOCOL.md §Plan graphs)
                if self._relay is not None:
                    self._relay.open_pull(s, msg)
            case _:
                assert_never(msg)

    def _registered(self, s: Session, msg: FromWorker) -> str | None:
        """The session's worker id; None, with a ``not_registered`` error sent, before its ``hello``."""
        worker_id = s.worker_id
        if worker_id is None or self._state.registry.record_of(worker_id) is None:
            what = type(msg).__name__.lower()
            self._outbox.protocol_error(
                s, errors.NOT_REGISTERED, f"send hello before {what}; this session has no worker id"
            )
            return None
        return worker_id

    def remove(self, worker_id: str, now: float) -> None:
        """An operator removed the worker for good (``remove_worker``; coordinator/worker_sessions/registration.py)."""
        self.registration.remove(worker_id, now)

    def detach(self, s: Session, now: float) -> None:
        """The session no longer speaks for its worker (coordinator/worker_sessions/liveness.py)."""
        self.liveness.detach(s, now)

    def reap(self, now: float) -> list[str]:
        """Reap silent or long-gone workers; returns their ids, sorted (coordinator/worker_sessions/liveness.py)."""
        return self.liveness.reap(now)
