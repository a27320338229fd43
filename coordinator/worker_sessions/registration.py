"""Worker registration (docs/SEMANTICS.md §Worker session, §Worker identity): hello, goodbye, removal.

What it owns: the answer to a ``hello`` — refused, or registered with the worker's listed leases
continued or abandoned and a ``welcome`` — a worker's ``goodbye``, an operator's removal, and
:class:`Identities`, the facts about a worker id that outlive its sessions.

Rules:

* A second ``hello`` on a session is ``already_registered``; a ``hello`` of another protocol
  version is refused and the session stays unregistered; the id must be one the session's token
  may register (4403 otherwise). A session whose upgrade named its id (``?worker_id=``, the key
  of the driver's penalty box) must say the same id in ``hello`` (4403 otherwise).
* A live worker id is not taken over without proof (docs/SEMANTICS.md §Worker identity): a
  ``hello`` for an id whose session is still open must carry the id's ``session_secret`` (from
  its last ``welcome``) or come with the holder's client certificate (mTLS identity), unless the
  holder has been silent for two heartbeat intervals; otherwise the newcomer is refused
  (``error(worker_id_in_use)`` naming the holder's address, then 4409) and the holder keeps its
  session. With proof, the newer session takes the id and the older one is closed 4409; the
  record, its leases and its drain mark carry over. Leases the worker does not list in ``hello.running`` are lost
  as if it had died; listed ones whose plan was cancelled meanwhile are cancelled again.
* Within the reconnect grace of a closed session (``--worker-reconnect-grace-s``,
  coordinator/registry.py) the id stays its holder's: a ``hello`` without its ``session_secret``
  (or the holder's client certificate) is refused ``error(worker_id_in_use)`` with
  ``retry_after_s`` = the grace left, then 4409, so a worker token cannot take the id, and its
  plans' continuations, while the holder reconnects.
* A listed lease of a plan the coordinator has queued at an older attempt was lost with the
  store's tail (or the plan was, and its client resubmitted it): it is leased back to the worker
  and continued, so its result is not lost nor the plan run twice (§Recovery from clients and
  workers); its ``done`` counts in ``results_recovered_from_worker`` (coordinator/worker_sessions/leases.py).
* A worker id that registers in a tight loop is refused (coordinator/reconnects.py): past its
  reconnect budget a ``hello`` gets ``error(too_many_reconnects)`` with ``retry_after_s`` and the
  session is closed 4429 (the driver's penalty box then answers its upgrades 429), before
  anything changes; the holder of a live id keeps it.
* A clean stop is not a crash: ``goodbye`` hands the worker's unfinished plans back and removes
  it (``workers_left``, not ``workers_reaped``). An operator's drain mark outlives the goodbye:
  the id comes back drained. An id an operator removed (``remove_worker``) is refused (4410)
  until the coordinator restarts.

Depends on the collaborators it is handed (the outbox, scheduler, recovery, operator requests,
data plane, run timeouts and reconnect budget) and the core's shared state (coordinator/state.py).
"""

from __future__ import annotations

import hmac
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import structlog

from coordinator import scopes
from protocol import caps, errors
from protocol.messages import PROTOCOL_VERSION, Cancel, Error, Goodbye, Hello, RunningPlan, Welcome

if TYPE_CHECKING:
    from coordinator.data_plane import DataPlane
    from coordinator.effects import Outbox
    from coordinator.operator_requests import OperatorRequests
    from coordinator.reconnects import ReconnectBudget
    from coordinator.recovery import Recovery
    from coordinator.scheduling import Scheduler
    from coordinator.sessions import Session
    from coordinator.state import CoreState
    from coordinator.timeouts import RunTimeouts
    from coordinator.workers import WorkerRecord

__all__ = ["MAX_DRAINED_GONE", "Identities", "Registration", "WorkerSessionConfig"]

log = structlog.get_logger(__name__)

MAX_DRAINED_GONE = 4096  # drained ids remembered after their goodbye; beyond this the oldest are forgotten


@dataclass(frozen=True)
class WorkerSessionConfig:
    """The settings of the worker sessions, said in each ``welcome``.

    Attributes:
        heartbeat_interval_s: put in ``welcome``.
        heartbeat_timeout_s: put in ``welcome``; silence past it gets a worker reaped.
        version: the coordinator's version, put in ``welcome``.
        prefetch: leases a worker may hold beyond its concurrency, put in ``welcome``.
        new_secret: makes a ``welcome.session_secret`` (unguessable: the core's ``new_secret``).
    """

    heartbeat_interval_s: float
    heartbeat_timeout_s: float
    version: str = ""
    prefetch: int = 0
    new_secret: Callable[[], str] = lambda: ""

    @property
    def silent_takeover_s(self) -> float:
        """A holder silent this long (two missed beats) may be replaced without proof: a restarted
        worker whose old connection is half-open gets its id back before the reaper's timeout."""
        return min(self.heartbeat_timeout_s, 2 * self.heartbeat_interval_s)


@dataclass(eq=False)
class Identities:
    """What the core knows of worker ids beyond their records: proofs, stops, removals.

    Attributes:
        secrets: worker id -> the ``session_secret`` of its last ``welcome``.
        certificates: worker id -> the client certificate (mTLS identity) of its last holder.
        leaving: ids drained by their own ``heartbeat.leaving``, not by an operator.
        drained_gone: operator-drained ids that left with ``goodbye`` (oldest first, bounded).
        removed: ids an operator removed (``remove_worker``); their ``hello`` is refused (oldest first, bounded).
    """

    secrets: dict[str, str] = field(default_factory=dict)
    certificates: dict[str, str] = field(default_factory=dict)
    leaving: set[str] = field(default_factory=set)
    drained_gone: dict[str, None] = field(default_factory=dict)
    removed: dict[str, None] = field(default_factory=dict)

    def forget(self, worker_id: str) -> None:
        """The id's record is gone (goodbye, removal, reaped): its proofs and its own stop go with it."""
        self.secrets.pop(worker_id, None)
        self.certificates.pop(worker_id, None)
        self.leaving.discard(worker_id)


def _remember(ids: dict[str, None], worker_id: str) -> None:
    """Add ``worker_id`` to a bounded, oldest-first table of ids."""
    ids[worker_id] = None
    while len(ids) > MAX_DRAINED_GONE:
        del ids[next(iter(ids))]


class Registration:
    """Answers ``hello`` and ``goodbye``, and removes workers for an operator.

    Args:
        state: the core's shared tables (coordinator/state.py).
        outbox: replies, closes and refusals.
        scheduler: fills a registered worker, requeues lost leases, adopts recovered ones.
        recovery: hands a leaving or removed worker's plans back.
        operator: tells a drained worker again after its ``welcome``.
        config: the settings put in ``welcome``.
        identities: the ids' proofs and marks (shared with coordinator/worker_sessions/liveness.py).
        adopted: leases recovered from their worker -> attempt (their done is counted:
            coordinator/worker_sessions/leases.py).
        data: the data-plane ticket keys, put in ``welcome``.
        timeouts: a continued plan's ``timeout_s`` clock starts again (coordinator/timeouts.py).
        reconnects: each worker id's registration budget (coordinator/reconnects.py); None: none.
    """

    def __init__(
        self,
        state: CoreState,
        *,
        outbox: Outbox,
        scheduler: Scheduler,
        recovery: Recovery,
        operator: OperatorRequests,
        config: WorkerSessionConfig,
        identities: Identities,
        adopted: dict[str, int],
        data: DataPlane | None = None,
        timeouts: RunTimeouts | None = None,
        reconnects: ReconnectBudget | None = None,
    ) -> None:
        self._state = state
        self._outbox = outbox
        self._scheduler = scheduler
        self._recovery = recovery
        self._operator = operator
        self._config = config
        self._identities = identities
        self._adopted = adopted
        self._data = data
        self._timeouts = timeouts
        self._reconnects = reconnects

    # ------------------------------------------------------------------ hello

    def hello(self, s: Session, msg: Hello, now: float) -> None:
        """Register ``msg.worker_id`` on ``s`` and welcome it, or refuse it and change nothing (module docstring)."""
        if not self._admissible(s, msg, now):
            return
        worker_id, registry = msg.worker_id, self._state.registry
        reconnect = worker_id in registry
        secret = self._identities.secrets.get(worker_id, "")
        proven = bool(secret) and hmac.compare_digest(msg.session_secret.encode(), secret.encode())
        # Without proof, a hello does not continue the leases of an id this coordinator issued a
        # secret for: the worker that holds them would have presented it (a restarted process runs
        # nothing; an impostor must not receive them). After a coordinator restart no secret exists.
        may_continue = proven or not secret
        if reconnect and not self._may_take(s, worker_id, proven, bool(secret), now):
            return
        if self._reconnects is not None:
            self._reconnects.spend(worker_id, now)  # a refused takeover above took none
        old_ops = registry.get(worker_id).capabilities.ops if reconnect else []  # their groups' reasons change too
        record = registry.register(worker_id, msg.capabilities, now, address=s.address, conn_id=s.conn_id)
        secret = self._registered(s, record, msg, proven)
        keep, abandon = self._continued(record, msg.running, may_continue)
        log.info(
            "worker registered",
            worker_id=worker_id,
            reconnect=reconnect,
            ops=msg.capabilities.ops,
            max_concurrency=msg.capabilities.max_concurrency,
            continue_plans=keep,
            abandon_plans=abandon,
        )
        self._welcome(s, record, keep, abandon, secret, now)
        self._scheduler.refresh_waiting(now, [*record.capabilities.ops, *old_ops])

    def _admissible(self, s: Session, msg: Hello, now: float) -> bool:
        """Whether ``msg`` may register its id on ``s`` at all; if not, the refusal is sent."""
        if s.worker_id is not None:
            self._outbox.protocol_error(s, errors.ALREADY_REGISTERED, f"this session is already worker {s.worker_id!r}")
            return False
        if msg.protocol != PROTOCOL_VERSION:  # docs/PROTOCOL.md §5: the session stays unregistered
            self._outbox.protocol_error(
                s, errors.INVALID_ARGUMENT,
                f"hello.protocol is {msg.protocol}; this coordinator speaks fleetwire protocol {PROTOCOL_VERSION} "
                "only: run a worker of the coordinator's major version",
            )
            return False
        worker_id = msg.worker_id
        if not worker_id:
            self._outbox.protocol_error(s, errors.INVALID_MESSAGE, "hello.worker_id must not be empty")
            return False
        too_long = caps.too_long("hello.worker_id", worker_id, caps.MAX_WORKER_ID_BYTES)
        if too_long is not None:
            self._outbox.protocol_error(s, errors.INVALID_ARGUMENT, too_long)
            return False
        refused = scopes.worker_id_refused(s.worker_ids, worker_id)
        if refused is None and s.named_worker_id is not None and worker_id != s.named_worker_id:
            # The upgrade named another id: the penalty box keyed it so; a hello may not switch ids.
            refused = (f"hello.worker_id {worker_id!r} is not the id {s.named_worker_id!r} this connection's "
                       "upgrade named (?worker_id=)")  # fmt: skip
        if refused is not None:
            self._outbox.forbid(s, refused, "worker_id")
            return False
        if worker_id in self._identities.removed:  # an operator removed it for good (remove_worker)
            log.warning("refused: removed worker id", worker_id=worker_id, address=s.address)
            why = f"removed by an operator; refused until the coordinator restarts: worker {worker_id}"
            self._outbox.close(s, errors.CLOSE_REMOVED, why[:120])
            return False
        reconnects = self._reconnects
        if reconnects is not None and (wait_s := reconnects.wait_s(worker_id, now)) > 0:
            self._refuse_reconnect(s, worker_id, wait_s)
            return False
        return True

    def _may_take(self, s: Session, worker_id: str, proven: bool, issued: bool, now: float) -> bool:
        """Whether ``s`` may take the registered id ``worker_id`` (``proven``: it showed the id's secret;
        ``issued``: this coordinator issued one). A live holder it replaces is closed 4409; a refusal is sent."""
        registry = self._state.registry
        held_by = registry.get(worker_id).conn_id
        older = self._state.sessions.get(held_by) if held_by is not None else None
        if older is not None and older is not s:
            if not (proven or (s.identity and s.identity == older.identity)):
                silent_s = now - registry.get(worker_id).last_beat_s
                if silent_s <= self._config.silent_takeover_s:
                    self._refuse_takeover(s, older, worker_id, silent_s)
                    return False
                log.warning("worker id taken over from a silent session", worker_id=worker_id,
                            holder=older.address, newcomer=s.address, silent_s=round(silent_s, 3))  # fmt: skip
            older.worker_id = None  # its close must not disconnect the new session
            why = f"worker id {worker_id!r} registered on a newer session"
            self._outbox.close(older, errors.CLOSE_REPLACED, why)
        elif issued and not proven and not (s.identity and s.identity == self._identities.certificates.get(worker_id)):
            left_s = registry.in_grace(worker_id, now)
            if left_s is not None:  # its holder may be reconnecting: the id and its plans stay its own
                self._refuse_in_grace(s, worker_id, left_s, now)
                return False
        return True

    def _registered(self, s: Session, record: WorkerRecord, msg: Hello, proven: bool) -> str:
        """The id is ``s``'s now: its marks and facts are set; returns the secret its ``welcome`` carries."""
        worker_id, identities = record.id, self._identities
        identities.certificates[worker_id] = s.identity
        if worker_id in identities.leaving:  # it announced a stop, then came back: its own drain is over
            identities.leaving.discard(worker_id)
            record.draining = False
        if worker_id in identities.drained_gone:  # drained by the operator, left with goodbye: still drained
            del identities.drained_gone[worker_id]
            record.draining = True
        if not proven:  # a new holder without the old secret: the old secret proves nothing any more
            identities.secrets[worker_id] = self._config.new_secret()
        record.data_url = msg.data_url
        record.version = msg.version
        self._state.placement.registered(record)
        s.worker_id = worker_id
        return identities.secrets[worker_id]

    def _continued(
        self, record: WorkerRecord, running: Sequence[RunningPlan], may_continue: bool
    ) -> tuple[list[str], list[str]]:
        """Which of the plans a registering worker lists it continues, and which it abandons."""
        plans, worker_id = self._state.plans, record.id
        keep: list[str] = []
        abandon: list[str] = []
        for listed in running:
            plan = plans.get(listed.plan_id)
            ours = plan is not None and plan.worker_id == worker_id and plan.attempt == listed.attempt
            ours = ours and may_continue
            if plan is not None and not ours and plan.state == "queued" and plan.attempt < listed.attempt:
                # An attempt this coordinator never handed out as far as it knows: a store loss took
                # the lease (or the whole plan, resubmitted since by its client). The worker runs it
                # or holds its done: lease it back rather than run the plan twice.
                log.warning("lease recovered from its worker: the store had lost it",
                            plan_id=plan.id, worker_id=worker_id, attempt=listed.attempt)  # fmt: skip
                self._scheduler.adopt(plan, record, listed.attempt, listed.devices)
                self._adopted[plan.id] = listed.attempt
                ours = True
            (keep if ours and listed.plan_id in record.leases else abandon).append(listed.plan_id)
            if ours and plan is not None and plan.gpus is not None:  # a restore: the devices it runs on
                self._state.registry.hold_devices(worker_id, plan.id, plan.gpus, listed.devices)
        return keep, abandon

    def _welcome(
        self, s: Session, record: WorkerRecord, keep: list[str], abandon: list[str], secret: str, now: float
    ) -> None:
        """Send ``welcome``, then settle the leases it did not continue and fill the worker."""
        config, plans, worker_id = self._config, self._state.plans, record.id
        self._outbox.send(
            s.conn_id,
            Welcome(
                worker_id=worker_id,
                heartbeat_interval_s=config.heartbeat_interval_s,
                heartbeat_timeout_s=config.heartbeat_timeout_s,
                continue_plans=keep,
                abandon_plans=abandon,
                version=config.version,
                prefetch=config.prefetch,
                data_keys=self._data.worker_keys(worker_id) if self._data is not None else [],
                session_secret=secret,
            ),
        )
        self._operator.registered(record, now)  # a drained worker stays drained across reconnects
        # Leases it did not list are gone on its side (an assign lost in flight, a restart):
        # those attempts are lost exactly as if the worker had died.
        missing = [plans[pid] for pid in record.leases.difference(keep) if pid in plans]
        for plan in sorted(missing, key=lambda p: (-p.priority, p.order)):
            self._state.registry.release(worker_id, plan.id)
            self._scheduler.lease_lost(plan, worker_id, f"worker {worker_id} reconnected without it", now)
        for plan_id in keep:
            plan = plans[plan_id]
            if plan.terminal:  # cancelled while it was away: the first cancel went to the old session
                self._outbox.send(s.conn_id, Cancel(plan_id=plan_id, attempt=plan.attempt))
            elif self._timeouts is not None and plan.timeout_s is not None:
                self._timeouts.watch(plan, now)  # after a coordinator restart its clock starts now
        # A worker that registers again may have new handlers or have stopped draining:
        # the plans it rejected may be offered to it once more.
        for plan_id in self._state.queue.forgive(worker_id):
            plans[plan_id].avoid -= {worker_id}
        self._scheduler.fill_worker(record, now)

    # ------------------------------------------------------------------ refusals

    def _refuse_takeover(self, s: Session, holder: Session, worker_id: str, silent_s: float) -> None:
        """Refuse ``s`` the live id ``worker_id``: error(worker_id_in_use) naming the holder, then 4409."""
        counters = self._state.counters
        counters["takeovers_refused"] = counters.get("takeovers_refused", 0) + 1
        message = (
            f"worker id {worker_id!r} is held by a live session from {holder.address or 'an unknown address'} "
            f"(last beat {silent_s:.1f} s ago); only that worker may take it over (hello.session_secret from its "
            f"welcome, or the same client certificate). Give each worker its own id (--id); a restarted worker "
            f"gets its id once the old session closes or stays silent for {self._config.silent_takeover_s:g} s"
        )
        log.warning("refused hello: worker id held by a live session", worker_id=worker_id, holder=holder.address,
                    newcomer=s.address)  # fmt: skip
        self._outbox.send(s.conn_id, Error(code=errors.WORKER_ID_IN_USE, message=message))
        self._outbox.close(s, errors.CLOSE_REPLACED, f"worker id in use by a live session from {holder.address}"[:120])

    def _refuse_in_grace(self, s: Session, worker_id: str, left_s: float, now: float) -> None:
        """Refuse ``s`` the id of a worker whose session closed within the reconnect grace: error(worker_id_in_use)
        with ``retry_after_s`` = the grace left, then 4409."""
        counters = self._state.counters
        counters["takeovers_refused"] = counters.get("takeovers_refused", 0) + 1
        record = self._state.registry.get(worker_id)
        gone_s = now - (record.disconnected_at_s or now)
        message = (
            f"worker id {worker_id!r} belongs to a worker from {record.address or 'an unknown address'} whose "
            f"connection closed {gone_s:.1f} s ago: it may reconnect for {left_s:.1f} s more and continue its "
            "plans, and only it may take the id back (hello.session_secret from its welcome, or the same client "
            f"certificate). Retry in {left_s:.1f} s; give each worker its own id (--id)"
        )
        log.warning("refused hello: worker id held for its reconnecting holder", worker_id=worker_id,
                    holder=record.address, newcomer=s.address, grace_left_s=round(left_s, 3))  # fmt: skip
        self._outbox.send(s.conn_id, Error(code=errors.WORKER_ID_IN_USE, message=message, retry_after_s=left_s))
        self._outbox.close(s, errors.CLOSE_REPLACED, f"worker id {worker_id} is held for its reconnecting holder"[:120])

    def _refuse_reconnect(self, s: Session, worker_id: str, wait_s: float) -> None:
        """Refuse ``s`` the id ``worker_id``, past its reconnect budget: error(too_many_reconnects), then 4429."""
        counters = self._state.counters
        counters["worker_reconnects_refused"] = counters.get("worker_reconnects_refused", 0) + 1
        budget = self._reconnects
        assert budget is not None
        message = (
            f"worker id {worker_id!r} registered more often than its reconnect budget allows ({budget.burst} at once, "
            f"then {budget.rate:g} per second: coordinator flags --worker-reconnect-burst, --worker-reconnect-rate); "
            f"a worker that reconnects in a loop is refused. Retry in {wait_s:.1f} s, and find out why its sessions "
            "end (its log, the coordinator's close codes)"
        )
        log.warning("refused hello: worker reconnects too often", worker_id=worker_id, address=s.address,
                    retry_after_s=round(wait_s, 3))  # fmt: skip
        self._outbox.send(s.conn_id, Error(code=errors.TOO_MANY_RECONNECTS, message=message, retry_after_s=wait_s))
        self._outbox.close(s, errors.CLOSE_RATE_LIMITED, f"worker {worker_id} reconnects too often; retry in "
                                                           f"{wait_s:.1f} s"[:120])

    # ------------------------------------------------------------------ goodbye and removal

    def goodbye(self, s: Session, worker_id: str, msg: Goodbye, now: float) -> None:
        """The worker leaves on purpose: its plans go back to the queue and its record goes at once."""
        log.info("worker said goodbye", worker_id=worker_id, reason=msg.reason)
        registry, identities = self._state.registry, self._identities
        record = registry.get(worker_id)
        ours = record.conn_id == s.conn_id
        if ours:  # not alive from here: the hand-back below must not place its plans back on it
            registry.disconnect(worker_id)
        self._recovery.hand_back(worker_id, now)  # its unfinished plans: requeued now, no attempt spent
        s.worker_id = None
        self._outbox.close(s, errors.CLOSE_NORMAL, "goodbye")
        if not ours:
            return  # a newer session holds the id
        if record.draining and worker_id not in identities.leaving:  # the operator's mark: kept for its return
            _remember(identities.drained_gone, worker_id)
        registry.remove(worker_id)
        identities.forget(worker_id)
        self._state.placement.forget([worker_id])
        self._state.counters["workers_left"] += 1
        log.info("worker left", worker_id=worker_id, leases=sorted(record.leases))
        self._scheduler.refresh_waiting(now, record.capabilities.ops)  # only its ops' groups can change their reason

    def remove(self, worker_id: str, now: float) -> None:
        """An operator removed the worker for good (``remove_worker``; the id is registered).

        Its live attempts are cancelled on the worker and the plans requeued at no cost in
        attempts (as after ``goodbye``); its session is closed 4410 and a later ``hello`` with
        its id is refused the same way (the last :data:`MAX_DRAINED_GONE` ids are remembered).
        """
        registry, plans, identities = self._state.registry, self._state.plans, self._identities
        record = registry.get(worker_id)
        session = self._state.sessions.get(record.conn_id) if record.conn_id is not None else None
        if record.conn_id is not None:
            for plan_id in sorted(record.leases):
                plan = plans.get(plan_id)
                if plan is not None and not plan.terminal and plan.worker_id == worker_id:
                    self._outbox.send(record.conn_id, Cancel(plan_id=plan_id, attempt=plan.attempt))
            registry.disconnect(worker_id)  # not alive from here: the hand-back must not place plans on it
        leases = sorted(record.leases)
        self._recovery.hand_back(worker_id, now, removed=True)
        if session is not None and session.worker_id == worker_id:
            session.worker_id = None
            self._outbox.close(session, errors.CLOSE_REMOVED, "removed by an operator")
        _remember(identities.removed, worker_id)
        identities.drained_gone.pop(worker_id, None)
        registry.remove(worker_id)
        identities.forget(worker_id)
        self._state.placement.forget([worker_id])
        log.info("worker removed by an operator", worker_id=worker_id, leases=leases)
        self._scheduler.refresh_waiting(now, record.capabilities.ops)
