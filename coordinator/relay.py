"""The relay: plans' inputs and outputs carried through the coordinator, credit per stream (docs/PROTOCOL.md §11).

When a client cannot reach a worker's data endpoint (the worker has none, it is behind NAT, a
firewall is in the way) or asks for it, the bytes travel over the two websocket sessions the
client and the worker already have with the coordinator, in ``data_chunk`` messages of at most
256 KiB. This module is the pure bookkeeping: which streams are open, who may send on each,
and how many bytes each may have in flight.

Theory of operation:

* A *stream* is one input (``put``: client -> worker) or output (``get``: worker -> client) of
  one plan attempt, named by (plan id, attempt, name, direction). The client opens it
  (``data_open`` with the grant's ticket); the coordinator checks it against the plan (the
  session's principal owns it, the attempt is current, the name is a declared input or an
  output the plan declared or left) and passes it to the plan's worker with ``credit``: the
  stream's *window*. The worker checks the ticket (as its HTTP endpoint does) and answers: a
  ``put`` with ``data_credit`` (the offset it holds: where the client starts), a ``get`` with
  its first chunks; the client of a ``get`` is told the window too (a ``data_credit``), so both
  receivers credit once per quarter window (protocol/relay.py ``credit_every``), not per chunk.
* Credit: the sender may have at most ``window`` bytes sent and not yet acknowledged by the
  receiver (``data_credit.offset``). The coordinator checks every chunk: in order (its offset is
  where the previous one ended), at most 256 KiB, within the declared size, within the window.
  A chunk that breaks one of these ends the stream (``data_end(relay_violation)`` to both
  sides); it is never queued. So the bytes of a stream inside the coordinator never exceed its
  window, and a slow receiver slows only its own sender: nothing else waits on it.
* Memory: the windows of all open streams together stay within ``max_bytes``
  (``--relay-max-bytes``): a stream opened when less than a window is free gets what is free,
  at least one chunk, or is refused ``relay_busy`` (the SDK retries it). Chunks are not held
  here: each is handed on to the receiver's outbox as the same message, its ``data`` a view into
  the frame it came in (copied out only when that frame held more than the chunk: ``compact``,
  so a window of chunks is that many bytes, not frames); a chunk that came alone in its frame
  goes out as that frame, unencoded (protocol/chunkview.py, coordinator/io/connection.py).
* A stream ends with ``data_end`` from either party (passed on to the other), after the last
  chunk of a ``get``, or when either party's session closes (``relay_closed`` to the other,
  which may open it again: the worker's spool keeps what arrived).

Depends on the plans (what a stream may carry), the registry (the plan's worker's connection)
and the outbox (where chunks, credits and ends go).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import msgspec

from protocol import errors
from protocol.chunkview import compact
from protocol.messages import DataChunk, DataCredit, DataEnd, DataOpen
from protocol.relay import BUSY, CLOSED, DEFAULT_MAX_BYTES, DEFAULT_WINDOW_BYTES, MAX_CHUNK_BYTES, VIOLATION

if TYPE_CHECKING:
    from coordinator.effects import Outbox
    from coordinator.plans import Plan
    from coordinator.registry import WorkerRegistry
    from coordinator.sessions import Session

__all__ = ["Relay", "RelayStream", "StreamKey"]

StreamKey = tuple[str, int, str, str]  # (plan id, attempt, name, direction)
DataMessage = DataChunk | DataCredit | DataEnd


@dataclass(slots=True, eq=False)
class RelayStream:
    """One open relayed stream.

    Attributes:
        client, worker: the connection ids of its two parties.
        size: the input's declared size (``put``) or the output's size once the worker says (``get``; -1 before).
        window: bytes its sender may have unacknowledged.
        sent: where the next chunk must start (the end of what has passed through).
        acked: what the receiver acknowledged.
        ready: the receiver (``put``: the worker's first credit) or sender (``get``) answered the open.
    """

    key: StreamKey
    client: int
    worker: int
    size: int
    window: int
    sent: int = 0
    acked: int = 0
    ready: bool = False

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
    """The relayed streams and their credit.

    Args:
        plans: the core's plans by id.
        registry: the workers (a plan's worker's connection).
        outbox: where messages go.
        window_bytes: a stream's window (unacknowledged bytes in flight).
        max_bytes: the windows of all streams together.
    """

    def __init__(
        self,
        *,
        plans: dict[str, Plan],
        registry: WorkerRegistry,
        outbox: Outbox,
        window_bytes: int = DEFAULT_WINDOW_BYTES,
        max_bytes: int = DEFAULT_MAX_BYTES,
    ) -> None:
        if window_bytes < MAX_CHUNK_BYTES or max_bytes < MAX_CHUNK_BYTES:
            raise ValueError(f"the relay's window and max bytes must be at least one chunk ({MAX_CHUNK_BYTES} bytes)")
        self._plans = plans
        self._registry = registry
        self._outbox = outbox
        self.window_bytes = window_bytes
        self.max_bytes = max_bytes
        self.streams: dict[StreamKey, RelayStream] = {}
        self._by_conn: dict[int, set[StreamKey]] = {}
        self.reserved = 0  # the windows of the open streams, together
        self.bytes_relayed = 0
        self.bytes_in = 0  # of inputs (put: client -> worker); bytes_relayed = bytes_in + bytes_out
        self.bytes_out = 0  # of outputs (get: worker -> client)
        self.credit_stalls = 0  # chunks after which their sender had used its whole window (it waits for credit)
        self.refused = 0  # opens refused and streams ended for a violation

    @property
    def in_flight(self) -> int:
        """Bytes of all streams sent and not acknowledged (what the coordinator may hold of them)."""
        return sum(stream.in_flight for stream in self.streams.values())

    # ------------------------------------------------------------------ from a client

    def open(self, s: Session, msg: DataOpen) -> None:
        """A client opens a stream: checked against the plan, then passed on to its worker."""
        key: StreamKey = (msg.plan_id, msg.attempt, msg.name, msg.direction)
        plan = self._plans.get(msg.plan_id)
        problem: tuple[str, str] | None = None
        if plan is None or not (s.admin or plan.owner == s.principal):
            what = "belongs to another principal" if plan is not None else "does not exist"
            problem = (errors.PLAN_NOT_FOUND, f"plan {msg.plan_id!r} {what}")
        else:
            problem = self._open_problem(plan, msg)
        worker_conn = None
        if problem is None:
            assert plan is not None and plan.worker_id is not None
            worker_conn = self._registry.get(plan.worker_id).conn_id if plan.worker_id in self._registry else None
            if worker_conn is None:
                problem = (CLOSED, f"worker {plan.worker_id} of plan {msg.plan_id!r} is not connected now")
        old = self.streams.get(key)
        free = self.max_bytes - self.reserved + (old.window if old is not None else 0)
        window = min(self.window_bytes, free)
        if problem is None and window < MAX_CHUNK_BYTES:
            problem = (BUSY, f"the relay carries {self.reserved} bytes in flight, its limit (--relay-max-bytes)")
        if problem is not None:
            self.refused += 1
            self._outbox.send(s.conn_id, _end(key, *problem))
            return
        assert plan is not None and worker_conn is not None
        if old is not None:  # a newer open (a resumed transfer) replaces the stream
            self._drop(old)
            if old.client != s.conn_id:
                self._outbox.send(old.client, _end(key, CLOSED, "replaced by a newer open of the same stream"))
        size = -1
        if msg.direction == "put":
            size = next(spec.size for spec in plan.inputs if spec.name == msg.name)
        stream = RelayStream(key, s.conn_id, worker_conn, size, window)
        self.streams[key] = stream
        self.reserved += window
        self._by_conn.setdefault(s.conn_id, set()).add(key)
        self._by_conn.setdefault(worker_conn, set()).add(key)
        self._outbox.send(worker_conn, msgspec.structs.replace(msg, credit=window, offset=max(0, msg.offset)))
        if msg.direction == "get":
            stream.sent = stream.acked = max(0, msg.offset)
            # the receiving client learns the window too, so it may credit once per quarter of it
            self._outbox.send(s.conn_id, DataCredit(plan_id=msg.plan_id, attempt=msg.attempt, name=msg.name,
                                                    direction="get", offset=stream.sent, credit=window))

    def _open_problem(self, plan: Plan, msg: DataOpen) -> tuple[str, str] | None:
        if msg.attempt != plan.attempt or plan.worker_id is None:
            return (CLOSED, f"plan {plan.id!r} is at attempt {plan.attempt}, not {msg.attempt}")
        if msg.direction == "put":
            if plan.terminal:
                return (errors.INVALID_ARGUMENT, f"plan {plan.id!r} already ended {plan.state}; it takes no inputs")
            if not any(spec.name == msg.name for spec in plan.inputs):
                return (errors.INVALID_ARGUMENT, f"plan {plan.id!r} declared no input {msg.name!r}")
        elif msg.name not in plan.outputs and not any(spec.name == msg.name for spec in plan.produced):
            return (errors.INVALID_ARGUMENT, f"plan {plan.id!r} has no output {msg.name!r}")
        if msg.offset < 0:
            return (errors.INVALID_ARGUMENT, f"data_open.offset must be >= 0 (got {msg.offset})")
        return None

    # ------------------------------------------------------------------ from either party

    def on_data(self, conn_id: int, msg: DataMessage) -> None:
        """A chunk, credit or end from a client or a worker session."""
        key: StreamKey = (msg.plan_id, msg.attempt, msg.name, msg.direction)
        stream = self.streams.get(key)
        if stream is None or conn_id not in (stream.client, stream.worker):
            if isinstance(msg, DataChunk):  # credits and ends of a stream that just ended are normal; chunks are not
                self._outbox.send(conn_id, _end(key, CLOSED, "no open relay stream; open it again (data_open)"))
            return
        match msg:
            case DataChunk():
                self._chunk(conn_id, stream, msg)
            case DataCredit():
                self._credit(conn_id, stream, msg)
            case DataEnd():
                self._drop(stream)
                other = stream.worker if conn_id == stream.client else stream.client
                self._outbox.send(other, msg)

    def _chunk(self, conn_id: int, stream: RelayStream, msg: DataChunk) -> None:
        n = len(msg.data)
        problem = None
        if conn_id != stream.sender():
            problem = "a chunk from the receiving side of the stream"
        elif not stream.ready and stream.direction == "put":
            problem = "a chunk before the worker's first data_credit"
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
            self._violation(stream, f"{msg.direction} {msg.name!r} of plan {msg.plan_id!r}: {problem}")
            return
        stream.ready = True
        stream.sent += n
        self.bytes_relayed += n
        if stream.direction == "put":
            self.bytes_in += n
        else:
            self.bytes_out += n
        if stream.window - stream.in_flight < MAX_CHUNK_BYTES and not msg.last:
            self.credit_stalls += 1  # no room for another whole chunk until the receiver credits
        self._outbox.send(stream.receiver(), compact(msg))  # held: its bytes, not a bigger frame they came in
        if msg.last and stream.direction == "get":  # the whole output passed: the client's last credits are moot
            self._drop(stream)

    def _credit(self, conn_id: int, stream: RelayStream, msg: DataCredit) -> None:
        if conn_id != stream.receiver():
            self._violation(stream, f"a data_credit from the sending side of {msg.name!r}")
            return
        if not stream.ready and stream.direction == "put":  # the worker answers the open: where the client starts
            stream.ready = True
            stream.sent = stream.acked = msg.offset
            if msg.size >= 0:
                stream.size = msg.size
        elif msg.offset < stream.acked or msg.offset > stream.sent:
            self._violation(stream, f"a data_credit at offset {msg.offset}, outside {stream.acked}..{stream.sent}")
            return
        stream.acked = msg.offset
        self._outbox.send(stream.sender(), msgspec.structs.replace(msg, credit=stream.window))

    # ------------------------------------------------------------------ sessions

    def connection_closed(self, conn_id: int) -> None:
        """A session closed: its streams end, and the other party of each is told (``relay_closed``)."""
        keys = self._by_conn.pop(conn_id, None)
        if not keys:
            return
        for key in list(keys):
            stream = self.streams.get(key)
            if stream is None:
                continue
            self._drop(stream)
            other = stream.worker if conn_id == stream.client else stream.client
            who = "client" if conn_id == stream.client else "worker"
            self._outbox.send(other, _end(key, CLOSED, f"the {who}'s session closed", stream.acked))

    # ------------------------------------------------------------------ helpers

    def _violation(self, stream: RelayStream, why: str) -> None:
        self.refused += 1
        self._drop(stream)
        end = _end(stream.key, VIOLATION, why, stream.acked)
        self._outbox.send(stream.client, end)
        self._outbox.send(stream.worker, end)

    def _drop(self, stream: RelayStream) -> None:
        if self.streams.get(stream.key) is not stream:
            return
        del self.streams[stream.key]
        self.reserved -= stream.window
        for conn_id in (stream.client, stream.worker):
            keys = self._by_conn.get(conn_id)
            if keys is not None:
                keys.discard(stream.key)
                if not keys:
                    del self._by_conn[conn_id]


def _end(key: StreamKey, code: str, message: str, offset: int = 0) -> DataEnd:
    direction: Literal["put", "get"] = "put" if key[3] == "put" else "get"
    return DataEnd(plan_id=key[0], attempt=key[1], name=key[2], direction=direction, code=code, message=message,
                   offset=offset)
