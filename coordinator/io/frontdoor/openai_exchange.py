"""One OpenAI completion in flight on a core: its session, its plan, its answer (docs/OPENAI.md).

The OpenAI door (coordinator/io/frontdoor/openai_http.py) hands each admitted, parsed request
to an :class:`Exchange`: it opens a client session of the core for the key's principal, submits
the request's plan subscribed under a plan id of the door's making, turns the plan's events
into the answer as they are delivered (coordinator/openai_api/reply.py), and, once the answer is
complete or the client is gone, cancels the plan if the door gave up on it and closes the
session. Its effects reach it through the core's driver (``CoreDriver.sinks``), committed first
like any client's. The queue timeout is a timer at the reply's deadline, moved on a requeue.

Hot path (a token event): one ``Reply.event`` and one ``transport.write`` per delivered batch;
no logging.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from typing import Any, Final, Protocol

from coordinator.auth import Principal
from coordinator.io.frontdoor.core_driver import CoreDriver
from coordinator.openai_api import ApiError, DoorRequest, Reply, submit_refused
from coordinator.openai_api.limits import DoorStats
from protocol.messages import Cancel, Error, Event

__all__ = ["CANCEL_REQ", "SUBMIT_REQ", "Exchange"]

SUBMIT_REQ: Final = 1  # the req_id of a request's submit (its refusal echoes it)
CANCEL_REQ: Final = 2  # the req_id of the cancel the door sends when it gives up


class Door(Protocol):
    """What an exchange needs of the door that serves it (openai_http.py ``OpenAIDoor``)."""

    driver: CoreDriver
    queue_timeout_s: float
    durable: bool  # False: its plans are never written to the store (CoreDriver.volatile)
    clock: Callable[[], float]
    wall: Callable[[], float]

    @property
    def ids(self) -> Iterator[int]: ...  # the core session ids of the door's requests

    def new_plan_id(self) -> str: ...


class Port(Protocol):
    """What an exchange needs of the port its request came in by (openai_http.py ``OpenAIEntry``)."""

    stats: DoorStats

    def answered(self, status: int) -> None: ...


class Connection(Protocol):
    """What an exchange needs of its HTTP connection (openai_http.py ``OpenAIConnection``)."""

    closing: bool
    address: str

    @property
    def door(self) -> Port: ...

    def write(self, data: bytes) -> bool: ...

    def finished(self, keep_alive: bool) -> None: ...


class Exchange:
    """One completion in flight: a core session of its principal, its plan, its :class:`Reply`.

    ``door`` serves it (its core); ``conn.door`` counts it (the port it came in by: the same door, or
    a cluster's main port that handed it to the core of its shard).
    """

    __slots__ = ("body_bytes", "conn", "conn_id", "done", "door", "keep_alive", "plan_id", "principal", "reply",
                 "request", "started", "stats", "streaming", "timer", "wrote")

    def __init__(self, door: Door, conn: Connection, principal: Principal, request: DoorRequest,
                 keep_alive: bool, body_bytes: int, plan_id: str = "") -> None:  # fmt: skip
        self.conn = conn
        self.door = door
        self.stats = conn.door.stats
        self.principal = principal
        self.request = request
        self.keep_alive = keep_alive
        self.body_bytes = body_bytes
        self.conn_id = next(door.ids)
        self.plan_id = plan_id or door.new_plan_id()
        self.done = False
        self.streaming = False
        self.wrote = False
        self.timer: asyncio.TimerHandle | None = None
        now = self.started = door.clock()
        self.reply = Reply(request, created=int(door.wall()), now=now, queue_timeout_s=door.queue_timeout_s,
                           keep_alive=keep_alive)  # fmt: skip
        self.reply.accepted(self.plan_id)

    def start(self) -> None:
        door, driver = self.door, self.door.driver
        self.stats.in_flight += 1
        away = driver.away() if driver.away is not None else None
        if away is not None:
            self.finish_now(self.reply.refused(ApiError(503, f"{away}; send the request again", code="unavailable",
                                                        retry_after_s=1.0)).data)
            return
        submit = self.request.submit(SUBMIT_REQ)
        submit.plan_id = self.plan_id
        now = door.clock()
        driver.core.open_session(self.conn_id, "client", now, principal=self.principal.name,
                                 address=self.conn.address, admin=self.principal.admin)
        driver.sinks[self.conn_id] = self
        if not door.durable:
            driver.volatile.add(self.plan_id)  # its records are dropped: its steps wait for no commit
        driver.receive(self.conn_id, submit, now)
        driver.flush(self.body_bytes)
        self._schedule()

    def _schedule(self) -> None:
        """The queue timeout's timer, at the reply's deadline (it moves on a requeue)."""
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        deadline = self.reply.deadline
        if deadline is not None and not self.done:
            delay = max(0.0, deadline - self.door.clock())
            self.timer = asyncio.get_running_loop().call_later(delay, self._expire)

    def _expire(self) -> None:
        self.timer = None
        if not self.done:
            out = self.reply.expire(self.door.clock())
            if out.data or out.done:
                self._out(out.data, out.done, out.cancel)
            else:
                self._schedule()

    def writable(self, ok: bool) -> None:
        pass  # the pending-bytes cap decides (module docstring)

    def deliver(self, msgs: list[Any]) -> None:
        """The core's messages for this session, once committed (CoreDriver.deliver)."""
        if self.done:
            return
        reply, now = self.reply, self.door.clock()
        data = b""
        done = cancel = False
        deadline = reply.deadline
        for msg in msgs:
            kind = type(msg)
            if kind is Event:
                out = reply.event(msg.kind, msg.data, now)
            elif kind is Error and msg.req_id == SUBMIT_REQ:
                out = reply.refused(submit_refused(msg.code, msg.message, msg.retry_after_s))
            else:
                continue  # accepted, the cancel's reply
            if out.data:
                data += out.data
            if out.done:
                done, cancel = True, out.cancel
                break
        if data or done:
            self._out(data, done, cancel)
        elif reply.deadline != deadline:
            self._schedule()

    def _out(self, data: bytes, done: bool, cancel: bool) -> None:
        if data:
            self._first_byte(done)
            if not self.conn.write(data):
                done = cancel = True  # a slow consumer (aborted), or the connection is gone
        if done:
            self.done = True
            self._ended()
            if self.timer is not None:
                self.timer.cancel()
                self.timer = None
            if self.reply.status:
                self.conn.door.answered(self.reply.status)
            # Not inside the driver's delivery: the cancel and the close are new input to the core.
            asyncio.get_running_loop().call_soon(self._close, cancel)
        elif self.reply.deadline is None and self.timer is not None:
            self.timer.cancel()
            self.timer = None

    def _first_byte(self, done: bool) -> None:
        """The answer's first bytes go out: the time since the request is counted; a stream is open."""
        if self.wrote:
            return
        self.wrote = True
        self.stats.first_byte.observe(self.door.clock() - self.started)
        if not done:
            self.streaming = True
            self.stats.streams_open += 1

    def _ended(self) -> None:
        self.stats.in_flight -= 1
        if self.streaming:
            self.streaming = False
            self.stats.streams_open -= 1

    def abandon(self) -> None:
        """The connection is gone before the answer was complete: cancel the plan."""
        if not self.done:
            self.done = True
            self._ended()
            if self.timer is not None:
                self.timer.cancel()
            self._close(True)

    def finish_now(self, data: bytes) -> None:
        """Answered before the core saw the request."""
        self.done = True
        self.stats.first_byte.observe(self.door.clock() - self.started)
        self._ended()
        self.conn.door.answered(self.reply.status)
        if self.conn.write(data):
            self.conn.finished(self.keep_alive)

    def _close(self, cancel: bool) -> None:
        """Cancel the plan if asked, close the core session, and let the connection go on."""
        driver = self.door.driver
        if driver.sinks.pop(self.conn_id, None) is not None:
            now = self.door.clock()
            if cancel:
                driver.receive(self.conn_id, Cancel(plan_id=self.plan_id, req_id=CANCEL_REQ), now)
            driver.core.close_session(self.conn_id, now)
            driver.flush()
        # A later record of the plan (a worker's late done, its retention's forget) reaches the store, which skips
        # a record of a plan it never had (coordinator/io/stores/store.py).
        driver.volatile.discard(self.plan_id)
        if not self.conn.closing:
            self.conn.finished(self.keep_alive)

