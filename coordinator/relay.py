"""The relay: plans' inputs and outputs carried through the coordinator, credit per stream (docs/PROTOCOL.md §11).

When a client cannot reach a worker's data endpoint (the worker has none, it is behind NAT, a
firewall is in the way) or asks for it, the bytes travel over the two websocket sessions the
client and the worker already have with the coordinator, in ``data_chunk`` messages of at most
256 KiB. This module is the pure bookkeeping: which streams are open, who may send on each,
how many bytes each may have in flight, and who gets the relay's memory when it is short.

Theory of operation:

* A *stream* is one input (``put``: client -> worker) or output (``get``: worker -> client) of
  one plan attempt, named by (plan id, attempt, name, direction) and by the id its client gave
  it (``data_open.stream``, echoed in every message of the stream; 0: a peer that gives none).
  The client opens it (``data_open`` with the grant's ticket); the coordinator checks it against
  the plan (the session's principal owns it, the attempt is current, the name is a declared
  input or an output the plan declared or left) and passes it to the plan's worker with
  ``credit``: the stream's *window* ``W``. The worker checks the ticket (as its HTTP endpoint
  does) and answers: a ``put`` with ``data_credit`` (the offset it holds: where the client
  starts), a ``get`` with its first chunks; the client of a ``get`` is told the window too (a
  ``data_credit``), so both receivers credit once per quarter window (protocol/relay.py
  ``credit_every``), not per chunk. A newer open of the same stream replaces it; a message that
  names an older stream id is dropped (it was under way when the stream was opened again).
* Credit: the sender may have at most ``W`` bytes sent and not yet acknowledged by the receiver
  (``data_credit.offset``). The coordinator checks every chunk: in order (its offset is where
  the previous one ended), at most 256 KiB, within the declared size, within the window. A chunk
  that breaks one of these ends the stream (``data_end(relay_violation)`` to both sides); it is
  never queued. So the bytes of a stream inside the coordinator never exceed its window, and a
  slow receiver slows only its own sender: nothing else waits on it.
* Memory, and who gets it (issue #24; its limits, shares and line: coordinator/relay_room.py): a
  stream's window is *held* only from the moment bytes may flow: a ``put``'s once the worker
  accepted the ticket (its first ``data_credit``), a ``get``'s when the open is passed to the
  worker (the worker answers a ``get`` with its bytes). A stream with no room waits *in line*: its client gets
  ``data_credit(credit=0, wait=<why>)`` and nothing may flow; when room comes, the ``put``'s
  worker credit (or the ``get``'s open) goes on as usual. A window goes back at once when its
  stream ends, when its plan ends (a ``put``), is requeued or moves to another attempt, when a
  party's session closes, and when no byte moved on it for ``idle_s`` (``--relay-idle``): then
  it ends ``relay_closed`` (its sender opens it again when it goes on; the worker's spool keeps
  what arrived). Idleness is judged at the driver's ticks (:meth:`Relay.expire`, with ``now``):
  a stream is idle from the first tick after the last chunk or credit it passed, so it goes back
  between ``idle_s`` and ``idle_s`` plus one tick after it.
* Chunks are not held here: each is handed on to the receiver's outbox as the same message, its
  ``data`` a view into the frame it came in (copied out only when that frame held more than the
  chunk: ``compact``, so a window of chunks is that many bytes, not frames); a chunk that came
  alone in its frame goes out as that frame, unencoded (protocol/chunkview.py,
  coordinator/io/frontdoor/connection.py).
* A stream ends with ``data_end`` from either party (passed on to the other), after the last
  chunk of a ``get``, or as above (``relay_closed`` to the parties, which may open it again).
* A worker may be a stream's client too (:meth:`Relay.open_pull`): a plan it runs takes another plan's
  output whose holder it cannot dial (no data endpoint, or the dial failed), so it opens a ``get`` of
  that output over its own session with the pull's ticket (docs/PROTOCOL.md §Plan graphs). Its
  window counts against the plan's owner and the worker's session. While another party's stream of
  that output is open, the pull waits behind it (told with ``data_credit(credit=0, wait=...)``) and
  opens when it ends, so consumers of one output take turns instead of replacing each other.
* A stream is keyed by its plan's key; a client that knows the plan by another id (its owner's
  name, docs/SEMANTICS.md §Plan ids) is sent that id (:attr:`RelayStream.shown`), and its own
  messages come here with the key (coordinator/client_session.py resolves both).

Depends on the plans (what a stream may carry), the registry (the plan's worker's connection)
and the outbox (where chunks, credits and ends go). Reads no clock: ``now`` comes with each tick.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import msgspec

from coordinator.relay_room import RelayRoom
from protocol import errors
from protocol.chunkview import compact
from protocol.messages import DataChunk, DataCredit, DataEnd, DataOpen
from protocol.relay import (
    BUSY,
    CLOSED,
    DEFAULT_IDLE_S,
    DEFAULT_MAX_BYTES,
    DEFAULT_WINDOW_BYTES,
    GONE,
    MAX_CHUNK_BYTES,
    VIOLATION,
)

if TYPE_CHECKING:
    from coordinator.effects import Outbox
    from coordinator.plans import Plan
    from coordinator.registry import WorkerRegistry
    from coordinator.sessions import Session, SessionTable

__all__ = ["MAX_STREAMS_PER_SESSION", "Relay", "RelayStream", "StreamKey"]

StreamKey = tuple[str, int, str, str]  # (plan id, attempt, name, direction)
DataMessage = DataChunk | DataCredit | DataEnd
StreamState = Literal["opening", "waiting", "open"]
MAX_STREAMS_PER_SESSION = 64  # relayed streams one client session may have open or waiting; past it relay_busy


@dataclass(slots=True, eq=False)
class RelayStream:
    """One relayed stream.

    Attributes:
        client, worker: the connection ids of its two parties.
        principal: the client session's principal (whose share its window counts against).
        size: the input's declared size (``put``) or the output's size once the worker says (``get``; -1 before).
        window: bytes its sender may have unacknowledged, once the window is held.
        id: the client's id for it (``data_open.stream``; 0: none given).
        state: ``opening`` (a ``put`` passed to its worker, not yet accepted), ``waiting`` (in line for
            room), ``open`` (its window is held: bytes may flow).
        sent: where the next chunk must start (the end of what has passed through).
        acked: what the receiver acknowledged.
        opened: a waiting ``get``'s open, passed to the worker once the window is held.
        moved: a chunk or credit passed since the last tick (idleness, :meth:`Relay.expire`).
        quiet_since: ``now`` of the first tick that found it still; None while it moves.
        shown: the plan id its client knows the plan by, when that is not the key (``""``: the key).
    """

    key: StreamKey
    client: int
    worker: int
    principal: str
    size: int
    window: int
    id: int = 0
    state: StreamState = "opening"
    sent: int = 0
    acked: int = 0
    opened: DataOpen | None = None
    moved: bool = True
    quiet_since: float | None = None
    shown: str = ""

    @property
    def direction(self) -> str:
        return self.key[3]

    @property
    def in_flight(self) -> int:
        """Bytes sent and not acknowledged: the most of this stream the coordinator may hold."""
        return self.sent - self.acked

    def sender(self) -> int:
        return self.client if self.key[3] == "put" else self.worker

    def receiver(self) -> int:
        return self.worker if self.key[3] == "put" else self.client


class Relay:
    """The relayed streams, their credit and the shares of the relay's memory.

    Args:
        plans: the core's plans by id.
        registry: the workers (a plan's worker's connection).
        outbox: where messages go.
        window_bytes: a stream's window (unacknowledged bytes in flight).
        max_bytes: the windows held by all streams together.
        principal_bytes: ... by one principal's streams (0: half of ``max_bytes``).
        session_bytes: ... by one client session's streams (0: a quarter of ``max_bytes``).
        idle_s: a held window on which nothing moved this long goes back (its stream ends ``relay_closed``).
        sessions: the open sessions (a pull that waited behind another stream of its output opens from its own).
    """

    def __init__(
        self,
        *,
        plans: dict[str, Plan],
        registry: WorkerRegistry,
        outbox: Outbox,
        window_bytes: int = DEFAULT_WINDOW_BYTES,
        max_bytes: int = DEFAULT_MAX_BYTES,
        principal_bytes: int = 0,
        session_bytes: int = 0,
        idle_s: float = DEFAULT_IDLE_S,
        sessions: SessionTable | None = None,
    ) -> None:
        self.room: RelayRoom[RelayStream] = RelayRoom(window_bytes=window_bytes, max_bytes=max_bytes,
                                                      principal_bytes=principal_bytes, session_bytes=session_bytes)
        if not idle_s > 0:
            raise ValueError(f"the relay's idle timeout must be > 0 seconds, got {idle_s}")
        self._plans = plans
        self._registry = registry
        self._outbox = outbox
        self._sessions = sessions
        self.max_bytes = self.room.max_bytes
        self.principal_bytes = self.room.principal_bytes
        self.session_bytes = self.room.session_bytes
        self.idle_s = idle_s
        self.window_bytes = self.room.window_bytes  # every stream's window
        self.streams: dict[StreamKey, RelayStream] = {}
        self._by_conn: dict[int, set[StreamKey]] = {}
        self._by_plan: dict[str, set[StreamKey]] = {}
        self._behind: dict[StreamKey, dict[int, DataOpen]] = {}  # pulls waiting for a stream of theirs to end
        self.bytes_relayed = 0
        self.bytes_in = 0  # of inputs (put: client -> worker); bytes_relayed = bytes_in + bytes_out
        self.bytes_out = 0  # of outputs (get: worker -> client)
        self.credit_stalls = 0  # chunks after which their sender had used its whole window (it waits for credit)
        self.refused = 0  # opens refused and streams ended for a violation
        self.waits = 0  # streams that waited in line for room
        self.idle_ends = 0  # streams ended because nothing moved on their window for idle_s
        self.stale = 0  # messages of an older stream id, dropped

    @property
    def in_flight(self) -> int:
        """Bytes of all streams sent and not acknowledged (what the coordinator may hold of them)."""
        return sum(stream.in_flight for stream in self.streams.values())

    @property
    def reserved(self) -> int:
        """The windows held, together."""
        return self.room.reserved

    @property
    def waiting(self) -> int:
        """Streams waiting in line for room."""
        return self.room.waiting

    # ------------------------------------------------------------------ from a client

    def open(self, s: Session, msg: DataOpen, plan: Plan | None, now: float | None = None) -> None:
        """A client opens a stream: checked against the plan, then passed on to its worker (or in line).

        ``plan``: the plan ``msg.plan_id`` names for this session (None: none it may see, which is
        answered as a plan that does not exist, whoever's it is).
        """
        problem: tuple[str, str] | None = None
        if plan is None:
            problem = (errors.PLAN_NOT_FOUND, f"plan {msg.plan_id!r} does not exist")
        else:
            problem = self._open_problem(plan, msg)
        self._open(s, msg, plan, problem, s.principal, now)

    def open_pull(self, s: Session, msg: DataOpen) -> None:
        """A worker opens a ``get`` of another plan's output that a plan it runs takes (a relayed pull).

        The worker is the stream's client; the plan is named by its key (``assign.pulls``) and its
        window counts against the plan's owner. The holder checks the ticket as for any ``get``.
        While another party's stream of the same output is open, the pull waits behind it (its
        worker told ``data_credit(credit=0, wait=...)``) instead of replacing it, so consumers
        fetching one output take turns rather than end each other's streams.
        """
        plan = self._plans.get(msg.plan_id)
        problem: tuple[str, str] | None = None
        if msg.direction != "get":
            problem = (errors.INVALID_ARGUMENT, "a worker opens only get streams (another plan's output it pulls)")
        elif plan is None:
            problem = (errors.PLAN_NOT_FOUND, f"plan {msg.plan_id!r} does not exist")
        else:
            problem = self._open_problem(plan, msg)
        key: StreamKey = (msg.plan_id, msg.attempt, msg.name, msg.direction)
        old = self.streams.get(key)
        if problem is None and old is not None and old.client != s.conn_id:
            line = self._behind.setdefault(key, {})
            line.pop(s.conn_id, None)
            line[s.conn_id] = msg
            self.waits += 1
            self._outbox.send(s.conn_id, DataCredit(
                plan_id=msg.plan_id, attempt=msg.attempt, name=msg.name, direction="get", offset=max(0, msg.offset),
                credit=0, stream=msg.stream,
                wait=f"waiting for another relayed fetch of this output to end; {len(line) - 1} fetches ahead"))
            return
        self._open(s, msg, plan, problem, plan.owner if plan is not None else s.principal)

    def _open(self, s: Session, msg: DataOpen, plan: Plan | None, problem: tuple[str, str] | None,
              principal: str, now: float | None = None) -> None:
        worker_conn = None
        if problem is None:
            assert plan is not None and plan.worker_id is not None
            worker_conn = self._registry.get(plan.worker_id).conn_id if plan.worker_id in self._registry else None
            if (worker_conn is None and msg.direction == "get" and now is not None
                    and self._registry.awaiting_restored(now) is not None):  # not back yet since a restart: awaited
                problem = (CLOSED, f"worker {plan.worker_id} of plan {msg.plan_id!r} has not come back since the "
                           "coordinator restarted")
            elif worker_conn is None and msg.direction == "get" and plan.worker_id not in self._registry:
                # Reaped or removed: it is not coming back with this output (a retry would wait for nothing).
                problem = (GONE, f"worker {plan.worker_id} of plan {msg.plan_id!r} is gone, and its outputs with it")
            elif worker_conn is None:
                problem = (CLOSED, f"worker {plan.worker_id} of plan {msg.plan_id!r} is not connected now")
        asked: StreamKey = (msg.plan_id, msg.attempt, msg.name, msg.direction)
        key = asked if plan is None or plan.id == msg.plan_id else (plan.id, *asked[1:])
        old = self.streams.get(key)
        mine = self._by_conn.get(s.conn_id, ())
        if problem is None and len(mine) - (old is not None and key in mine) >= MAX_STREAMS_PER_SESSION:
            problem = (BUSY, f"this session has {MAX_STREAMS_PER_SESSION} relayed streams open or waiting, the most "
                       "one session may; open it again once one of them ended")
        if problem is not None:
            self.refused += 1
            self._outbox.send(s.conn_id, _end(asked, *problem, stream_id=msg.stream))
            return
        assert plan is not None and worker_conn is not None
        if old is not None:  # a newer open (a resumed transfer) replaces the stream
            self._drop(old, serve=False)
            if old.client != s.conn_id:
                self._to_client(old, _end(key, CLOSED, "replaced by a newer open of the same stream",
                                          stream_id=old.id))
        size = -1
        if msg.direction == "put":
            size = next(spec.size for spec in plan.inputs if spec.name == msg.name)
        stream = RelayStream(key, s.conn_id, worker_conn, principal, size, self.window_bytes, msg.stream)
        if plan.id != msg.plan_id:
            stream.shown = msg.plan_id
        self.streams[key] = stream
        self._by_conn.setdefault(s.conn_id, set()).add(key)
        self._by_conn.setdefault(worker_conn, set()).add(key)
        self._by_plan.setdefault(plan.id, set()).add(key)
        opened = msgspec.structs.replace(msg, plan_id=plan.id, credit=stream.window, offset=max(0, msg.offset))
        if msg.direction == "put":  # the worker checks the ticket first; its first credit asks for the window
            self._outbox.send(worker_conn, opened)
            return
        stream.sent = stream.acked = opened.offset
        stream.opened = opened
        why = self.room.no_room(stream)
        if why is None:
            self._hold(stream)
        else:
            self._wait(stream, why)

    def _open_problem(self, plan: Plan, msg: DataOpen) -> tuple[str, str] | None:
        plan_id = msg.plan_id  # as the client knows it
        if msg.attempt != plan.attempt or plan.worker_id is None:
            return (CLOSED, f"plan {plan_id!r} is at attempt {plan.attempt}, not {msg.attempt}")
        if msg.direction == "put":
            if plan.terminal:
                return (errors.INVALID_ARGUMENT, f"plan {plan_id!r} already ended {plan.state}; it takes no inputs")
            if not any(spec.name == msg.name for spec in plan.inputs):
                return (errors.INVALID_ARGUMENT, f"plan {plan_id!r} declared no input {msg.name!r}")
        elif msg.name not in plan.outputs and not any(spec.name == msg.name for spec in plan.produced):
            return (errors.INVALID_ARGUMENT, f"plan {plan_id!r} has no output {msg.name!r}")
        if msg.offset < 0:
            return (errors.INVALID_ARGUMENT, f"data_open.offset must be >= 0 (got {msg.offset})")
        return None

    # ------------------------------------------------------------------ from either party

    def on_data(self, conn_id: int, msg: DataMessage) -> None:
        """A chunk, credit or end from a client or a worker session."""
        key: StreamKey = (msg.plan_id, msg.attempt, msg.name, msg.direction)
        stream = self.streams.get(key)
        if stream is None or conn_id not in (stream.client, stream.worker):
            if isinstance(msg, DataEnd) and key in self._behind:  # a pull that gave up waiting behind the stream
                line = self._behind[key]
                if line.pop(conn_id, None) is not None and not line:
                    del self._behind[key]
            if isinstance(msg, DataChunk):  # credits and ends of a stream that just ended are normal; chunks are not
                self._outbox.send(conn_id, _end(key, CLOSED, "no open relay stream; open it again (data_open)",
                                                stream_id=msg.stream))
            return
        if msg.stream and msg.stream != stream.id:  # of an older open of this stream, under way when it was replaced
            self.stale += 1
            return
        match msg:
            case DataChunk():
                self._chunk(conn_id, stream, msg)
            case DataCredit():
                self._credit(conn_id, stream, msg)
            case DataEnd():
                self._drop(stream)
                if conn_id == stream.client:
                    self._outbox.send(stream.worker, _stamped(msg, stream.id))
                else:
                    self._to_client(stream, _stamped(msg, stream.id))

    def _chunk(self, conn_id: int, stream: RelayStream, msg: DataChunk) -> None:
        n = len(msg.data)
        problem = None
        if conn_id != stream.sender():
            problem = "a chunk from the receiving side of the stream"
        elif stream.state != "open":
            problem = ("a chunk before the worker's first data_credit" if stream.state == "opening"
                       else "a chunk while the stream waits for relay room (no credit given yet)")
        elif n > MAX_CHUNK_BYTES:
            problem = f"a chunk of {n} bytes; at most {MAX_CHUNK_BYTES}"
        elif msg.offset != stream.sent:
            problem = f"a chunk at offset {msg.offset}; the stream continues at {stream.sent}"
        elif stream.direction == "get" and msg.size >= 0:
            stream.size = msg.size
        if problem is None and stream.size >= 0 and msg.offset + n > stream.size:
            problem = f"{msg.offset + n} bytes, over the declared size of {stream.size}"
        if problem is None and stream.in_flight + n > stream.window:
            problem = f"{stream.in_flight + n} bytes unacknowledged, over the stream's credit of {stream.window}"
        if problem is not None:
            plan_id = stream.shown or msg.plan_id  # as its client knows the plan
            self._violation(stream, f"{msg.direction} {msg.name!r} of plan {plan_id!r}: {problem}")
            return
        stream.moved = True
        stream.sent += n
        self.bytes_relayed += n
        if stream.direction == "put":
            self.bytes_in += n
        else:
            self.bytes_out += n
        if stream.window - stream.in_flight < MAX_CHUNK_BYTES and not msg.last:
            self.credit_stalls += 1  # no room for another whole chunk until the receiver credits
        msg = compact(msg)  # held: its bytes, not a bigger frame they came in
        if stream.shown and stream.direction == "get":  # to a client that knows the plan by its name
            msg = msgspec.structs.replace(msg, plan_id=stream.shown)
        self._outbox.send(stream.receiver(), msg if msg.stream == stream.id else _stamped(msg, stream.id))
        if msg.last and stream.direction == "get":  # the whole output passed: the client's last credits are moot
            self._drop(stream)

    def _credit(self, conn_id: int, stream: RelayStream, msg: DataCredit) -> None:
        if conn_id != stream.receiver():
            self._violation(stream, f"a data_credit from the sending side of {msg.name!r}")
            return
        if stream.state == "opening":  # the worker accepted a put's ticket: where the client starts
            stream.sent = stream.acked = msg.offset
            if msg.size >= 0:
                stream.size = msg.size
            why = self.room.no_room(stream)
            if why is None:
                self._hold(stream)
            else:
                self._wait(stream, why)
            return
        if stream.state == "waiting":
            return  # nothing flowed yet, so nothing to acknowledge
        if msg.offset < stream.acked or msg.offset > stream.sent:
            self._violation(stream, f"a data_credit at offset {msg.offset}, outside {stream.acked}..{stream.sent}")
            return
        stream.moved = True
        stream.acked = msg.offset
        if stream.shown and stream.direction == "put":  # to a client that knows the plan by its name
            msg = msgspec.structs.replace(msg, plan_id=stream.shown)
        self._outbox.send(stream.sender(), msgspec.structs.replace(msg, credit=stream.window, stream=stream.id))

    # ------------------------------------------------------------------ the driver's clock, plans, sessions

    def expire(self, now: float) -> None:
        """A tick: streams of plans that ended or moved on end, and windows idle past ``idle_s`` go back."""
        for stream in list(self.streams.values()):
            if self.streams.get(stream.key) is not stream:
                continue  # ended by an earlier one in this loop
            if self._moved_on(stream):
                continue
            if stream.state == "waiting":
                continue  # it waits on the relay, not the other way round
            if stream.moved:
                stream.moved, stream.quiet_since = False, now
            elif stream.quiet_since is not None and now - stream.quiet_since >= self.idle_s:
                self.idle_ends += 1
                what = "its window" if stream.state == "open" else "the worker's answer to its open"
                self._end_both(stream, CLOSED, f"no byte moved on it for {self.idle_s:g} s (--relay-idle): "
                               f"{what} went back to the relay; open it again to go on")

    def plan_moved(self, plan_id: str) -> None:
        """A message about ``plan_id`` was handled: its streams end if the plan ended or moved to another attempt."""
        keys = self._by_plan.get(plan_id)
        if keys:
            for key in list(keys):
                stream = self.streams.get(key)
                if stream is not None:
                    self._moved_on(stream)

    def connection_closed(self, conn_id: int) -> None:
        """A session closed: its streams end, and the other party of each is told (``relay_closed``)."""
        if self._behind:
            for key, line in list(self._behind.items()):
                if line.pop(conn_id, None) is not None and not line:
                    del self._behind[key]
        keys = self._by_conn.pop(conn_id, None)
        if not keys:
            return
        for key in list(keys):
            stream = self.streams.get(key)
            if stream is None:
                continue
            self._drop(stream)
            if conn_id == stream.client:
                self._outbox.send(stream.worker, _end(key, CLOSED, "the client's session closed", stream.acked,
                                                      stream.id))
            else:
                self._to_client(stream, _end(key, CLOSED, "the worker's session closed", stream.acked, stream.id))

    # ------------------------------------------------------------------ room

    def _hold(self, stream: RelayStream) -> None:
        """Hold ``stream``'s window (there is room) and let bytes flow."""
        self.room.hold(stream)
        self._opened(stream)

    def _opened(self, stream: RelayStream) -> None:
        """``stream``'s window is held: bytes may flow, and its parties are told."""
        stream.state = "open"
        stream.moved = True
        window = stream.window
        _, attempt, name, _ = stream.key
        plan_id = stream.shown or stream.key[0]  # as its client knows the plan
        if stream.direction == "put":  # the worker's first credit goes on: the client starts at its offset
            self._outbox.send(stream.client, DataCredit(plan_id=plan_id, attempt=attempt, name=name, direction="put",
                                                        offset=stream.acked, credit=window, size=stream.size,
                                                        stream=stream.id))
            return
        assert stream.opened is not None
        self._outbox.send(stream.worker, stream.opened)
        stream.opened = None
        # the receiving client learns the window too, so it may credit once per quarter of it
        self._outbox.send(stream.client, DataCredit(plan_id=plan_id, attempt=attempt, name=name, direction="get",
                                                    offset=stream.sent, credit=window, stream=stream.id))

    def _wait(self, stream: RelayStream, why: str) -> None:
        """No room for ``stream``: it waits in line, and its client is told why."""
        stream.state = "waiting"
        ahead = self.room.wait(stream)
        self.waits += 1
        _, attempt, name, direction = stream.key
        plan_id = stream.shown or stream.key[0]  # as its client knows the plan
        self._outbox.send(stream.client, DataCredit(
            plan_id=plan_id, attempt=attempt, name=name, direction="put" if direction == "put" else "get",
            offset=stream.acked, credit=0, size=stream.size, stream=stream.id,
            wait=f"waiting for relay room: {why}; {ahead} streams ahead"))

    def _serve_line(self) -> None:
        """Room came back: the waiting streams that fit now hold their windows, oldest first."""
        for stream in self.room.served():
            self._opened(stream)

    # ------------------------------------------------------------------ helpers

    def _moved_on(self, stream: RelayStream) -> bool:
        """End ``stream`` if its plan is gone, ended (a ``put``) or at another attempt; whether it did."""
        attempt = stream.key[1]
        plan = self._plans.get(stream.key[0])
        plan_id = stream.shown or stream.key[0]  # named in the reason as its client knows it
        if plan is None:
            why = f"plan {plan_id!r} was forgotten"
        elif plan.attempt != attempt or plan.worker_id is None:
            why = f"plan {plan_id!r} moved on from attempt {attempt} ({plan.state})"
        elif stream.direction == "put" and plan.terminal:
            why = f"plan {plan_id!r} ended {plan.state}; it takes no inputs"
        else:
            return False
        self._end_both(stream, CLOSED, why)
        return True

    def _violation(self, stream: RelayStream, why: str) -> None:
        self.refused += 1
        self._end_both(stream, VIOLATION, why)

    def _end_both(self, stream: RelayStream, code: str, why: str) -> None:
        self._drop(stream)
        end = _end(stream.key, code, why, stream.acked, stream.id)
        self._to_client(stream, end)
        if stream.state != "waiting" or stream.direction == "put":  # a waiting get was never passed to its worker
            self._outbox.send(stream.worker, end)

    def _to_client(self, stream: RelayStream, msg: DataMessage) -> None:
        """Send ``msg`` to ``stream``'s client, naming the plan as the client knows it."""
        if stream.shown:
            msg = msgspec.structs.replace(msg, plan_id=stream.shown)
        self._outbox.send(stream.client, msg)

    def _drop(self, stream: RelayStream, *, serve: bool = True) -> None:
        """Forget ``stream`` and give its window back; a pull waiting behind it opens (unless ``serve`` is False:
        a newer open of the same stream takes its place)."""
        key = stream.key
        if self.streams.get(key) is not stream:
            return
        self._forget(stream)
        if serve and key in self._behind:
            self._next_behind(key)

    def _next_behind(self, key: StreamKey) -> None:
        """The stream ``key`` ended: the oldest pull waiting behind it opens now (as the worker asked it)."""
        line = self._behind[key]
        conn_id, msg = next(iter(line.items()))
        del line[conn_id]
        if not line:
            del self._behind[key]
        session = self._sessions.get(conn_id) if self._sessions is not None else None
        if session is not None:
            self.open_pull(session, msg)

    def _forget(self, stream: RelayStream) -> None:
        key = stream.key
        del self.streams[key]
        for conn_id in (stream.client, stream.worker):
            keys = self._by_conn.get(conn_id)
            if keys is not None:
                keys.discard(key)
                if not keys:
                    del self._by_conn[conn_id]
        keys = self._by_plan.get(key[0])
        if keys is not None:
            keys.discard(key)
            if not keys:
                del self._by_plan[key[0]]
        if stream.state == "waiting":
            self.room.leave_line(stream)
        elif stream.state == "open":
            self.room.give_back(stream)
            if self.room.waiting:
                self._serve_line()


def _stamped(msg: DataMessage, stream_id: int) -> DataMessage:
    """``msg`` naming ``stream_id`` (a peer that gives no stream id: the other party still gets it)."""
    return msg if msg.stream == stream_id else msgspec.structs.replace(msg, stream=stream_id)


def _end(key: StreamKey, code: str, message: str, offset: int = 0, stream_id: int = 0) -> DataEnd:
    direction: Literal["put", "get"] = "put" if key[3] == "put" else "get"
    return DataEnd(plan_id=key[0], attempt=key[1], name=key[2], direction=direction, code=code, message=message,
                   offset=offset, stream=stream_id)
