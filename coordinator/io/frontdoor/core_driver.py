"""The asyncio side of one ``Coordinator`` core: its sessions' messages in, its effects out.

Theory of operation. On a core's port every session is a :class:`CoreSession`
(a :class:`~coordinator.io.frontdoor.reader.SessionHandler`): it opens the session in the core,
feeds it each message with ``now`` and *flushes* (:meth:`CoreDriver.flush`). The effects the core
accumulated go to the store first: records to the committer (coordinator/io/stores/commit.py),
and the frames of a step only once that step's records (and every earlier step's) are committed.
Then :meth:`CoreDriver.deliver` appends each message to its target session's pending list and
wakes its writer (coordinator/io/frontdoor/connection.py), so frames to one connection coalesce
while a send is in flight; a message many sessions get is encoded once per encoding. A session
already at its pending cap when more arrives is closed 4503 (slow consumer, coordinator/limits.py);
the closes the core asks for are passed on, and its abusive ones (4400, a worker id's 4429) box
the peer (coordinator/read_policy.py). Large replays go out in slices between everyone else's
frames (:meth:`CoreDriver.pump`).

Within one frame, once its requests have cost the frame budget (coordinator/read_policy.py), what
they asked so far goes out and the rest waits for the next loop turn. In cluster mode a shard's
core moves a session whose message belongs to another shard (``redirect``: a ``moved``, then
4307); while the store's database is away a ``submit`` is answered ``unavailable``.

Parts (issue 29). With a store whose writes leave the loop (SQLite: its writer thread and process), a
frame is also cut after :data:`DURABLE_PART_MESSAGES` messages (:attr:`CoreDriver.part_messages`): a
worker's frame of a thousand plans' results is then committed in parts, each part's records handed to
the writer while the loop runs the next, and each part's frames (the new leases) released as soon as
that part and every earlier one is committed, instead of all of them after one commit of the whole
frame. Parts that queue while the writer is busy are merged into one transaction (commit.py), so a
busy writer does not fsync per part. The memory store commits at once and takes whole frames. A part
costs a frame to every session its step sends to: a session whose last step sent to more than
:data:`PART_MAX_SESSIONS` (a fan-out, one plan's events to its subscribers: bench/fanout.py's deliveries
fell by a third in parts of 500) has its frames taken whole until a step of it is narrow again.
What the writer reported committed is released at each part's hand-over (``GroupCommitter.reap``), and
within a part every :data:`REAP_EVERY_MASK` + 1 messages when a report is in: the earlier parts' frames go out
~1.5 ms after their commit instead of at the end of the part the loop is in (4-7 ms at load 10: the workers'
leases waited that long, and the loop then slept with frames held for a commit), with no more parts or groups
than before (cutting the part at a report instead made ~50 % more groups and cost more than it gave). A delivery
within a part is that of earlier, committed steps, between two of this session's messages: the core is
between inputs, and a session it closes (a slow consumer) is fed no more.
A client's parts yield the loop too, although its ``accepted`` are of no use to it before the last of its
frame's (``submit_many`` waits for all): fed one after another (tried, 0fb8458), a 5,000-plan chunk was
accepted ~1.5x sooner, but its groups reached the writer as one burst and the workers' groups, whose
leases keep them busy, waited behind all of them (the loop asleep with frames held for a commit 9-13 %
of the window against 4-6 %, and fewer plans/s: docs/PERFORMANCE.md §D29).

Acks (issue 29). The core owes a worker ``ack(seq)`` after each step with its numbered messages, released with
the step's frames once its records are committed (coordinator/recovery.py). An ack that would leave alone (the
step sent that worker nothing else: its ``done``'s, in a sequential round trip) is held instead and rides at the
front of the worker's next frame (the next ``assign``), which is released after its own step's commit and so after
the ack's; without one it leaves alone once a run of the ack timer found it held, :data:`ACK_HOLD_S` to twice that
after it was held, or at once when it acks :data:`ACK_HOLD_MESSAGES` more messages than the one first held (the
worker keeps every unacknowledged message for a replay, worker_agent/outbox.py). A newer ack replaces a held one
(acks are cumulative); one for a session gone since is dropped (the worker re-sends, the coordinator drops the
copies); a graceful stop lets the steps whose commit is pending out first (their acks with them, up to
:data:`ACK_FLUSH_WAIT_S`), then sends those held, before it closes the sessions (:meth:`CoreDriver.flush_acks`).
A worker reads one frame a sequential round trip, not two (docs/PERFORMANCE.md §D29f).

Plans in :attr:`CoreDriver.volatile` (the OpenAI door's under ``--openai-durable off``) are never
written: their records are dropped before the committer, so a step that touched only them has no
records and goes out at once, or behind the batches already waiting (order is kept), never behind
a commit of its own.
"""

from __future__ import annotations

import asyncio
import time
import traceback
from collections.abc import Awaitable, Callable
from typing import Any, Final, Protocol

import msgspec
import structlog

from coordinator.core import Coordinator, Effects
from coordinator.io.frontdoor.connection import Session
from coordinator.io.frontdoor.door import FrontDoor
from coordinator.io.frontdoor.gate import peer_identity
from coordinator.io.ops.hooks import HookRunner
from coordinator.io.ops.provision import Provisioner
from coordinator.io.ops.tracing import PlanSpans
from coordinator.io.stores.commit import GroupCommitter
from coordinator.io.stores.pg_commit import PipelinedCommitter
from coordinator.limits import Limits
from protocol import errors as codes
from protocol.messages import Ack, Assign, Error, Hello, Moved, Ok, Submit, Unsubscribe
from protocol.urls import named_worker_id
from wireio.spin import SPIN

__all__ = [
    "ACK_FLUSH_WAIT_S", "ACK_HOLD_MESSAGES", "ACK_HOLD_S",
    "DURABLE_PART_MESSAGES", "PART_MAX_SESSIONS", "REAP_EVERY_MASK", "REPLAY_BACKLOG_BYTES", "UNAVAILABLE_RETRY_S",
    "CoreDriver", "CoreSession", "Redirect", "Sink",
]

log = structlog.get_logger("coordinator.io.frontdoor.server")

REPLAY_BACKLOG_BYTES: Final = 1 << 20  # a replay's next slice waits while its subscriber has more than this unsent
#: A durable store's part of a frame (module docstring, §Parts): after this many messages what they asked goes to the
#: writer and the rest of the frame waits for the next loop turn. 500 while a writer thread took each part (a
#: hand-over each way); 250 since the loop sends it to the writer process itself (docs/PERFORMANCE.md §D29b).
DURABLE_PART_MESSAGES: Final = 250
#: ... unless the session's last step sent to more sessions than this (module docstring, §Parts).
PART_MAX_SESSIONS: Final = 8
#: Within a part, every this + 1 messages, what the writer reported committed is released (module docstring §Parts).
REAP_EVERY_MASK: Final = 63
UNAVAILABLE_RETRY_S: Final = 1.0  # the retry_after_s of an ``unavailable`` answer (the store is away)
#: A worker's lone ``ack`` waits for its next frame at most 2 x this (module docstring §Acks, docs/PROTOCOL.md ``ack``).
ACK_HOLD_S: Final = 0.005
#: ... and goes at once when it acks this many messages more than the first one held (the worker keeps them all).
ACK_HOLD_MESSAGES: Final = 256
#: A graceful stop waits at most this long for the steps whose commit is pending, so that their acks go too (§Acks).
ACK_FLUSH_WAIT_S: Final = 1.0

#: Cluster mode, one core per shard (coordinator/io/cluster/host.py): called with a session's role and
#: message, for a ``submit`` or a ``hello`` only (no other message moves a session: ``CoreSession.take``
#: skips the call for the rest); a ``Moved`` answer ends the session with it and 4307.
Redirect = Callable[[str, Any], Moved | None]
Committer = GroupCommitter[Effects] | PipelinedCommitter[Effects]


class Sink(Protocol):
    """A core session that is no websocket: it takes its messages as they are (``CoreDriver.sinks``)."""

    def deliver(self, msgs: list[Any]) -> None:
        """The messages of one committed step for this session, in order."""


class CoreDriver:
    """Feeds a core and hands its effects on: to the committer, then to the door's sessions (module docstring).

    Args:
        core: the sans-I/O coordinator.
        door: the port's front door (its sessions, closes and penalty box).
        limits: the server's limits (the pending caps, the frame budget of a replay slice).
        committer: makes the committer given the driver's :meth:`deliver` (the store's own, or a
            ``GroupCommitter``).
        hook: runs the autoscaler's decisions as a command (None: none).
        provisioner: acts on the autoscaler's decisions (None: none).
        away: why the store cannot take a write now (None: a store that is never away).
        redirect: cluster mode's check of each message (None: a single coordinator).

    Attributes:
        unavailable_answers: submits answered ``unavailable`` while the store was away.
    """

    def __init__(
        self, core: Coordinator, door: FrontDoor, limits: Limits,
        committer: Callable[[Callable[[Effects], None]], Committer], *,
        hook: HookRunner | None = None, provisioner: Provisioner | None = None,
        away: Callable[[], str | None] | None = None, redirect: Redirect | None = None,
    ) -> None:  # fmt: skip
        self.core = core
        self.door = door
        self.limits = limits
        self.committer = committer(self.deliver)
        self.hook = hook
        self.provisioner = provisioner
        self.away = away
        self.redirect = redirect
        self.unavailable_answers = 0
        # Messages of a frame per part (module docstring §Parts); 0: whole frames (a store that commits on the loop;
        # PostgreSQL's pipelined committer, not measured with parts).
        committer_ = self.committer
        self.part_messages = (
            DURABLE_PART_MESSAGES if isinstance(committer_, GroupCommitter) and committer_.store.blocking else 0
        )
        self.part_max_sessions = PART_MAX_SESSIONS
        self.step_sessions = 0  # the sessions the last flushed step sent to
        # Parts' commits released at each hand-over, not behind the loop's queue (coordinator/io/stores/commit.py);
        # PostgreSQL's committed groups too, whose release waits for a callback (coordinator/io/stores/pg_commit.py).
        reaps = isinstance(committer_, PipelinedCommitter) or (
            self.part_messages > 0 and isinstance(committer_, GroupCommitter)
        )
        self._reap = committer_.reap if reaps else None
        # ... and within a part, every REAP_EVERY_MASK + 1 messages, when the writer reported one (None: no parts).
        self.reported = committer_.reported if reaps else None
        # Sessions of the core that are no websocket (the OpenAI door's requests, frontdoor/openai_http.py): their
        # messages are handed to ``deliver(msgs)`` as Structs, once committed like everyone's.
        self.sinks: dict[int, Sink] = {}
        # Plans never written to the store (the OpenAI door's under --openai-durable off, docs/OPENAI.md
        # §Durability): their records are dropped here, so a step of theirs alone waits for no commit.
        self.volatile: set[str] = set()
        self._pumping = False  # a replay pump is scheduled (coordinator/streams.py ``pump``)
        self.spans: PlanSpans | None = None  # traced plans' spans (coordinator/io/ops/tracing.py; the server sets it)
        # Cluster mode: a submit naming upstreams this core does not hold first waits for the look-up in the other
        # shards (coordinator/io/cluster/remote_refs.py); None back: nothing to look up. The look-up's answer: why it
        # could not be made (the submit is answered ``unavailable``), or None.
        self.upstreams: Callable[[int, Submit], Awaitable[str | None] | None] | None = None
        # Workers' acks held for their next frame (module docstring §Acks): connection -> (the seq first held, the
        # newest ack); those held since the timer's last run, and those held across it (sent at its next run).
        self._acks_new: dict[int, tuple[int, Ack]] = {}
        self._acks_due: dict[int, tuple[int, Ack]] = {}
        self._ack_timer: asyncio.TimerHandle | None = None
        self.ack_hold_s = ACK_HOLD_S

    def receive(self, conn_id: int, msg: Any, now: float) -> None:
        """One message into the core; a bug in the core costs this message an error frame, never the process."""
        try:
            self.core.receive(conn_id, msg, now)
        except Exception:
            # No traceback reaches the wire: log it here, answer with a bare internal error.
            log.error(
                "core failed on a message", conn_id=conn_id, type=type(msg).__name__,
                exception=traceback.format_exc(),  # never exc_info: frames hold the message (fleetwire/cli/logs.py)
            )
            session = self.door.sessions.get(conn_id)
            if session is not None:
                session.pending.append(Error(code=codes.INTERNAL, message="internal error; see coordinator log"))
                session.wake.set()

    def flush(self, size: int = 0) -> None:
        """Hand the core's effects on: records to the committer, frames out once committed.

        ``size``: the bytes of the frame that caused them (the committer's backlog bound).
        """
        effects = self.core.take_effects()
        if self.volatile and effects.records:
            volatile = self.volatile
            effects.records = [record for record in effects.records if getattr(record, "plan_id", None) not in volatile]
        if effects.traces is not None and self.spans is not None:
            self.spans.flushed(effects.traces)
        if effects.decisions and self.hook is not None:
            self.hook.run(effects.decisions)
        if effects.decisions and self.provisioner is not None:
            self.provisioner.decided(effects.decisions)
        # Frames go out only once the records of their step (and of every step before) are committed.
        committer = self.committer
        self.step_sessions = len(effects.sends)
        self.reap()
        if effects.records:
            committer.submit(effects.records, effects, size)
        elif committer.pending:
            committer.after(effects)
        else:
            self.deliver(effects)
        if not self._pumping and self.core.streams.replaying:
            self._pumping = True
            asyncio.get_running_loop().call_soon(self.pump)

    def reap(self) -> None:
        """Release the parts the writer reported committed whose callback has not run yet (module docstring §Parts)."""
        if self._reap is not None:
            self._reap()

    def pump(self) -> None:
        """One slice of the large replays under way, then the loop runs everyone else (issue 17 finding 1).

        A subscriber with more than a slow reader's share unsent waits (its writer catches up first);
        when every one waits, the pump looks again a little later.
        """
        sent = self.core.pump(self.limits.frame_cost_budget // 4, self._busy)
        self.flush()  # _pumping is still set: it schedules nothing
        if not self.core.streams.replaying:
            self._pumping = False
        elif sent:
            asyncio.get_running_loop().call_soon(self.pump)
        else:  # every subscriber still reads its backlog: look again shortly instead of spinning
            asyncio.get_running_loop().call_later(0.005, self.pump)

    def _busy(self, conn_id: int) -> bool:
        session = self.door.sessions.get(conn_id)
        return session is not None and session.out_bytes() > REPLAY_BACKLOG_BYTES

    def deliver(self, effects: Effects) -> None:
        """A step's frames to their sessions' writers, its closes to the sessions (its records are committed)."""
        if effects.traces is not None and self.spans is not None:
            self.spans.delivered(effects.traces)
        sessions = self.door.sessions
        cap = self.limits.max_pending_messages
        cap_bytes = self.limits.max_pending_bytes
        slow: list[Session] = []
        sends = effects.sends
        if len(sends) > 2:  # fan-out: one event to many subscribers is encoded once, not per session
            sends = _encode_shared(sends, sessions)
        later: list[tuple[Session, list[Any]]] = []
        for conn_id, msgs in sends.items():
            session = sessions.get(conn_id)
            if session is None and (sink := self.sinks.get(conn_id)) is not None:
                sink.deliver(msgs)
            elif session is not None and not session.killed:
                if session.role == "worker":  # its acks ride with its next frame, or leave within the bound (§Acks)
                    if type(msgs[0]) is Ack and len(msgs) == 1:
                        if self._hold_ack(conn_id, msgs[0]):
                            continue
                    elif self._acks_new or self._acks_due:
                        held = self._acks_new.pop(conn_id, None) or self._acks_due.pop(conn_id, None)
                        if held is not None:
                            msgs.insert(0, held[1])
                # Already at the cap before this batch: the peer is not reading. Bytes are the
                # writer's encoded frames not yet sent and the socket's buffer, measured, plus the
                # messages not yet encoded, estimated (coordinator/io/frontdoor/connection.py ``out_bytes``).
                backlog = len(session.pending)
                if backlog >= cap or (
                    (backlog >= 64 or session.unsent > cap_bytes >> 2) and session.out_bytes() >= cap_bytes
                ):
                    slow.append(session)
                    session.pending.extend(msgs)
                    session.wake.set()
                # A worker's ``assign`` goes first: it is on the plan's critical path; the client's
                # ``accepted``/``leased`` are not. A session whose writer is parked with nothing pending is
                # written to here (send_now: no wake-up of its task, no loop turn before the frame leaves);
                # else its writer is woken, writers running in the order they are woken.
                elif session.role == "worker" and any(type(m) is Assign for m in msgs):
                    if not session.send_now(msgs):
                        session.pending.extend(msgs)
                        session.wake.set()
                else:
                    later.append((session, msgs))
        for session, msgs in later:
            if not session.send_now(msgs):
                session.pending.extend(msgs)
                session.wake.set()
        if sends:  # an answer (a worker's done, a client's next submit) may come before the loop would sleep
            SPIN.sent()
        for conn_id, code, reason in effects.closes:
            session = sessions.get(conn_id)
            if session is not None:
                session.close_with = (code, reason)
                session.wake.set()
                # Repeated violations, or a worker id past its reconnect budget (4429): the penalty box,
                # the latter keyed by the id the upgrade named too (gate.py), so its neighbours get in.
                self.door.penalize(session, code)
        for session in slow:
            self.door.kill(session, codes.CLOSE_SLOW_CONSUMER, "slow consumer: too much waiting for it to read")

    def _hold_ack(self, conn_id: int, ack: Ack) -> bool:
        """Keep a worker's lone ``ack`` for its next frame; False: it goes now (it acks too many more messages)."""
        due = self._acks_due
        held = due.get(conn_id) or self._acks_new.get(conn_id)
        if held is None:
            self._acks_new[conn_id] = (ack.seq, ack)
            if self._ack_timer is None:
                self._ack_timer = asyncio.get_running_loop().call_later(self.ack_hold_s, self._release_acks)
            return True
        if ack.seq - held[0] >= ACK_HOLD_MESSAGES:  # the worker keeps all those for a replay: acked now
            due.pop(conn_id, None)
            self._acks_new.pop(conn_id, None)
            return False
        (due if conn_id in due else self._acks_new)[conn_id] = (held[0], ack)  # as old as the first one held
        return True

    def _release_acks(self) -> None:
        """The ack timer: the acks held since its last run or before go out alone; those held since wait one more.

        An ack thus leaves with its worker's next frame, or alone ``ack_hold_s`` to 2 x ``ack_hold_s`` after it was
        held; the timer runs only while acks are held."""
        self._ack_timer = None
        due, self._acks_due, self._acks_new = self._acks_due, self._acks_new, {}
        sessions = self.door.sessions
        for conn_id, (_first, ack) in due.items():
            session = sessions.get(conn_id)
            if session is not None and not session.killed and not session.send_now([ack]):
                session.pending.append(ack)
                session.wake.set()
        if self._acks_due:
            self._ack_timer = asyncio.get_running_loop().call_later(self.ack_hold_s, self._release_acks)

    async def flush_acks(self) -> None:
        """A graceful stop, before it closes the sessions: the steps whose commit is pending are let out first, then
        those the sessions made meanwhile (their acks are held or sent then; up to :data:`ACK_FLUSH_WAIT_S` in all),
        then every held ack goes now, ahead of the close (the worker would otherwise send those messages again after
        it reconnects; it still does for the steps made after that, or still committing at the close)."""
        committer = self.committer
        if committer.pending and committer.failed is None:
            try:
                async with asyncio.timeout(ACK_FLUSH_WAIT_S):
                    # The sessions are open until the close: the steps they made meanwhile are waited for too, once
                    # (under a steady load there are always more). False: the store failed (the core stops).
                    if await committer.settled() and committer.pending:
                        await committer.settled()
            except TimeoutError:
                log.warning("steps still committing at the stop; their acks are left to the workers' replay",
                            pending=committer.pending, waited_s=ACK_FLUSH_WAIT_S)  # fmt: skip
        if self._ack_timer is not None:
            self._ack_timer.cancel()
        self._acks_due.update(self._acks_new)
        self._acks_new = {}
        self._release_acks()  # all of them due: no timer again

    def unavailable(self, session: Session, msg: Submit, why: str) -> None:
        """The store is away (a database failover): the submit is not processed; the client sends it again."""
        self.unavailable_answers += 1
        session.pending.append(Error(code=codes.UNAVAILABLE, message=f"{why}; send the submit again",
                                     req_id=msg.req_id, plan_id=msg.plan_id, retry_after_s=UNAVAILABLE_RETRY_S))
        session.wake.set()

    @staticmethod
    def move(session: Session, moved: Moved) -> None:
        """Cluster mode: the session belongs to another shard; tell it where, then close it 4307."""
        session.killed = True  # what it still sends is dropped
        session.pending.append(moved)
        session.close_with = (codes.CLOSE_MOVED, f"shard {moved.shard} is served elsewhere")
        session.wake.set()


class CoreSession:
    """One session of a core's port, as the reader drives it (coordinator/io/frontdoor/reader.py).

    Opens the session in the core with what the upgrade said (principal, address, the worker's
    certificate and named id), feeds each frame's messages within the frame budget, and closes it
    in the core when the connection ends or the server closes it.

    A client's first message that is the SDK's probe (an ``unsubscribe`` naming nothing, fleetwire/connection.py
    ``FirstReply``: it changes nothing) is answered ``ok`` here, ahead of the commit queue, not by the core: every
    reply of the core leaves after its step's commit, so behind a store slower than the client's first reply's bound
    (a frozen PostgreSQL, a loaded disk) a new connection would be left, and its requests sent again, where it hurts
    most. Nothing was sent to the session before (opening a client session sends nothing), so the order holds.
    """

    __slots__ = ("clock", "driver", "fresh", "session", "whole")

    def __init__(self, driver: CoreDriver, session: Session, clock: Callable[[], float] = time.monotonic) -> None:
        self.driver = driver
        self.session = session
        self.clock = clock
        self.whole = False  # its last step fanned out (module docstring §Parts): its frames are not cut
        self.fresh = False  # a client session whose first message is still to come (the probe: class docstring)

    def opened(self, now: float) -> None:
        session = self.session
        ws, principal = session.ws, session.principal
        assert ws.request is not None and principal is not None
        worker = session.role == "worker"
        self.driver.core.open_session(
            session.conn_id, "worker" if worker else "client", now, principal=principal.name,
            address=f"{ws.remote_address[0]}:{ws.remote_address[1]}" if ws.remote_address else "",
            admin=principal.admin, worker_ids=principal.worker_ids, identity=peer_identity(ws) if worker else "",
            named_worker_id=named_worker_id(ws.request.path) if worker else None,
        )
        self.fresh = not worker
        self.driver.flush()

    async def received(self, msgs: list[Any], frame_bytes: int, now: float) -> int:
        index, spent = self.take(msgs, frame_bytes, now)
        if index < len(msgs):
            spent += await self.finish(msgs, index, frame_bytes)
        return spent

    def take(self, msgs: list[Any], frame_bytes: int, now: float, start: int = 0, looked_up: bool = False,
             ) -> tuple[int, int]:  # fmt: skip
        """Feed ``msgs[start:]`` to the core until one needs waiting; (where it stopped, work units spent).

        It stops before a submit whose upstreams need a look-up (``looked_up``: ``msgs[start]``'s was
        done), and after the message that spent the frame budget; either way what was fed goes out.
        Called from ``data_received`` itself while the reader is idle (coordinator/io/frontdoor/reader.py).
        """
        SPIN.received()  # a frame came: the spin after this process's last send ends (wireio/spin.py)
        if self.fresh:  # a client's first frame: its probe is answered ahead of the commit queue (class docstring)
            self.fresh = False
            if start == 0 and msgs and _is_probe(msgs[0]):
                self.session.pending.append(Ok(req_id=msgs[0].req_id))
                self.session.wake.set()
                if len(msgs) == 1:
                    return 1, 0
                start = 1
        driver, session = self.driver, self.session
        outbox = driver.core.outbox
        redirect = driver.redirect
        away = driver.away() if driver.away is not None else None
        upstreams = driver.upstreams
        budget = driver.door.policy.over_frame_budget
        work = outbox.work
        index, count = start, len(msgs)
        part = driver.part_messages
        end = start + part if part and not self.whole else count  # a durable store's part
        reported = driver.reported
        while index < count:
            msg = msgs[index]
            index += 1
            if redirect is not None and ((kind := type(msg)) is Submit or kind is Hello) and (
                    moved := redirect(session.role, msg)) is not None:
                driver.move(session, moved)
                index = count  # the rest of the frame is dropped with the session
                break
            if away is not None and type(msg) is Submit:
                driver.unavailable(session, msg, away)
                continue
            if upstreams is not None and type(msg) is Submit and (msg.inputs or msg.after) and not (
                    looked_up and index == start + 1):
                index -= 1  # what it asked so far goes out; this one and the later ones wait for the look-up
                break
            driver.receive(session.conn_id, msg, now)
            if reported is not None and not (index - start) & REAP_EVERY_MASK and reported():
                driver.reap()  # earlier steps' frames whose commit was reported go now (module docstring §Parts)
                if session.killed:  # a slow consumer, closed by that delivery: the rest of its frame is dropped
                    break
            if budget(outbox.work - work) or index >= end:
                # What it asked so far goes out; the rest waits for the next loop turn (others' frames run meanwhile).
                break
        driver.flush(frame_bytes if start == 0 and index == count else frame_bytes * (index - start) // count)
        if part:
            self.whole = driver.step_sessions > driver.part_max_sessions
        return index, outbox.work - work

    async def finish(self, msgs: list[Any], index: int, frame_bytes: int) -> int:
        """Feed ``msgs[index:]`` where :meth:`take` stopped: after a look-up, or a loop turn (the frame budget)."""
        driver, session = self.driver, self.session
        spent = 0
        while index < len(msgs) and not session.killed:
            msg = msgs[index]
            if driver.upstreams is not None and type(msg) is Submit and (msg.inputs or msg.after):
                lookup = driver.upstreams(session.conn_id, msg)
                if lookup is not None:
                    failed = await lookup
                    if session.killed:
                        break
                    if failed is not None:
                        driver.unavailable(session, msg, failed)
                        index, units = self.take(msgs, frame_bytes, self.clock(), index + 1)
                        spent += units
                        continue
                index, units = self.take(msgs, frame_bytes, self.clock(), index, looked_up=True)
            else:
                await asyncio.sleep(0)
                if session.killed:
                    break
                index, units = self.take(msgs, frame_bytes, self.clock(), index)
            spent += units
        return spent

    def closed(self, now: float, code: int | None) -> None:
        self.driver.core.close_session(self.session.conn_id, now)
        if code is None:
            self.driver.flush()
        else:  # the server closed it, maybe in the middle of a delivery: what that changed goes out after it
            asyncio.get_running_loop().call_soon(self.driver.flush)


def _is_probe(msg: Any) -> bool:
    """Whether ``msg`` is the SDK's first-reply probe: an ``unsubscribe`` naming nothing (it changes nothing)."""
    return type(msg) is Unsubscribe and not msg.plan_ids and not msg.all


def _encode_shared(sends: dict[int, list[Any]], sessions: dict[int, Session]) -> dict[int, list[Any]]:
    """``sends`` with every message that goes to several sessions encoded once per encoding.

    The core hands the same Struct to every subscriber of a plan; the writers would encode it
    once each. Here each such message becomes a ``msgspec.Raw`` (its encoded bytes, which the
    codec copies into a frame as they are), made once per encoding and shared by all sessions.
    """
    counts: dict[int, int] = {}
    for conn_id, msgs in sends.items():
        if conn_id not in sessions:
            continue  # a sink's (the OpenAI door's requests): it takes the Structs as they are, nothing to encode
        for msg in msgs:
            key = id(msg)
            counts[key] = counts.get(key, 0) + 1
    if len(counts) == sum(counts.values()):
        return sends  # nothing is shared
    raws: dict[tuple[int, str], msgspec.Raw] = {}
    out: dict[int, list[Any]] = {}
    for conn_id, msgs in sends.items():
        session = sessions.get(conn_id)
        if session is None:  # a sink's (CoreDriver.sinks), or gone: as they are
            out[conn_id] = msgs
            continue
        codec = session.codec
        encoded: list[Any] = []
        for msg in msgs:
            key = id(msg)
            if counts[key] < 2:
                encoded.append(msg)
                continue
            raw = raws.get((key, codec.encoding))
            if raw is None:
                try:
                    raw = raws[(key, codec.encoding)] = codec.encode_raw(msg)
                except Exception:  # left to each session's writer, which closes only that session
                    encoded.append(msg)
                    continue
            encoded.append(raw)
        out[conn_id] = encoded
    return out
