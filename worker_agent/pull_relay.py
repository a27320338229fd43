"""A referenced input fetched through the coordinator's relay (docs/PROTOCOL.md §Plan graphs, §11 Relay).

When this worker cannot dial the worker that holds an output a plan it runs takes (the holder has no
data endpoint: ``pull.url`` is ``""``; or the dial failed: worker_agent/pull.py), it fetches the output
as a client fetches a relayed one: ``data_open(direction="get")`` with the pull's ticket over its own
coordinator session; the holder's ``data_chunk`` s come back through the coordinator, and this worker
answers ``data_credit`` s once per quarter window (protocol/relay.py ``credit_every``). The holder checks
the ticket as its HTTP endpoint would; the bytes go into the same spool entry a direct fetch writes, so a
fetch started direct goes on relayed from the bytes stored.

Rules:

* One relayed fetch of an output at a time on this worker: two attempts here that take the same output
  take turns (the coordinator knows a stream by its output, and a second open would replace the first).
  Other workers' fetches of it wait behind this one at the coordinator (coordinator/relay.py ``open_pull``).
* The coordinator's answers: ``data_credit(credit=W)`` is the window; ``data_credit(credit=0, wait=...)``
  says the stream waits in line (no stall timeout then: it waits on the relay, not the holder); chunks
  come in order from the offset asked, the last one marked ``last``; ``data_end`` ``relay_closed`` or
  ``relay_busy`` opens the stream again from the bytes stored; any other code (``output_gone``,
  ``unauthorized``, ``relay_violation`` ...) ends the fetch (:class:`RelayRefused`), and so do
  :data:`worker_agent.pull.RESUMES` reopens in a row that brought no byte.
* Chunks are stored in the order they came, a credit's worth at a time (written and hashed in a thread
  by the caller's ``store``), and credited once stored: what waits here is at most one window, which
  the coordinator holds the holder to.
* The session to the coordinator ending ends every stream (:meth:`PullRelay.reset`): each opens again,
  on the next session. A fetch cancelled (its attempt ended) ends its stream ``cancelled``.

Everything in :meth:`PullRelay.on_message` runs in the agent's reader with no await: a message is put
on its stream's queue, and the fetch's own task does the rest.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Final

import protocol
from protocol.messages import DataChunk, DataCredit, DataEnd, DataOpen
from protocol.relay import RETRYABLE, credit_every
from worker_agent.spool_files import InputFile

__all__ = ["CANCELLED", "PullRelay", "RelayRefused"]

Key = tuple[str, int, str, str]  # (plan id, attempt, output, "get")
CANCELLED: Final = "cancelled"  # the data_end code of a fetch this worker gave up on


class RelayRefused(Exception):
    """The relayed fetch cannot go on: the holder or the coordinator refused it, or it kept breaking (``code``: the
    ``data_end`` code that ended it, "" for none)."""

    def __init__(self, message: str, code: str = "") -> None:
        super().__init__(message)
        self.code = code


@dataclass(slots=True, eq=False)
class _Stream:
    id: int
    inbox: asyncio.Queue[DataChunk | DataCredit | DataEnd | None] = field(default_factory=asyncio.Queue)
    waiting: bool = False  # told to wait in line (credit 0): no stall timeout


class PullRelay:
    """This worker's relayed fetches of other plans' outputs (module docstring).

    Args:
        send: queues a message for the coordinator (the agent's send queue).
        resumes: reopens in a row that bring no byte before the fetch is refused.
    """

    def __init__(self, send: Callable[[Any], None], *, resumes: int = 3) -> None:
        self._send = send
        self._resumes = resumes
        self._streams: dict[Key, _Stream] = {}
        self._turns: dict[Key, tuple[asyncio.Lock, list[int]]] = {}  # one fetch per output at a time, and its users
        self._ids = itertools.count(1)
        self.relayed_bytes = 0
        """Bytes fetched through the relay since the worker started."""

    def on_message(self, msg: DataOpen | DataChunk | DataCredit | DataEnd) -> bool:
        """A relay message from the coordinator: True when it is one of this worker's fetches (taken here)."""
        if isinstance(msg, DataOpen) or msg.direction != "get":
            return False
        stream = self._streams.get((msg.plan_id, msg.attempt, msg.name, "get"))
        if stream is None:
            return isinstance(msg, DataChunk)  # a late chunk of a fetch that ended: a holder never gets a get's chunk
        if not msg.stream or msg.stream == stream.id:  # else of an older open of this fetch
            stream.inbox.put_nowait(msg)
        return True

    def reset(self) -> None:
        """The session to the coordinator ended, and its streams with it: each fetch opens again."""
        for stream in self._streams.values():
            stream.inbox.put_nowait(None)

    async def fetch(self, pull: protocol.Pull, entry: InputFile,
                    store: Callable[[InputFile, bytearray], Awaitable[None]], *, stall_timeout_s: float) -> None:
        """Fetch ``pull``'s output into ``entry`` from the bytes it holds to its last byte.

        Raises:
            RelayRefused: the fetch cannot go on (the message says why).
        """
        key: Key = (pull.plan_id, pull.attempt, pull.output, "get")
        lock, users = self._turns.setdefault(key, (asyncio.Lock(), [0]))
        users[0] += 1
        try:
            async with lock:
                fruitless = 0
                while True:
                    start = entry.received
                    why = await self._stream(key, pull, entry, store, stall_timeout_s)
                    if why is None:
                        return
                    fruitless = fruitless + 1 if entry.received == start else 0
                    if fruitless > self._resumes:
                        raise RelayRefused(f"{why} ({fruitless} opens in a row brought no byte)")
        finally:
            users[0] -= 1
            if not users[0]:
                del self._turns[key]

    async def _stream(self, key: Key, pull: protocol.Pull, entry: InputFile,
                      store: Callable[[InputFile, bytearray], Awaitable[None]], stall_timeout_s: float) -> str | None:
        """One open of the stream: None when the last byte is stored, else why it must be opened again."""
        stream = _Stream(next(self._ids))
        self._streams[key] = stream
        plan_id, attempt, name, _ = key
        self._send(DataOpen(plan_id=plan_id, attempt=attempt, name=name, direction="get", ticket=pull.ticket,
                            offset=entry.received, stream=stream.id, pull=True))  # the holder keeps the output
        ended = False
        try:
            every = 0  # credit every chunk until the window is known
            expected = entry.received
            batch = bytearray()
            while True:
                try:  # not asyncio.wait_for: on 3.11 it loses a cancel that comes as a message arrives
                    async with asyncio.timeout(None if stream.waiting else stall_timeout_s):
                        msg = await stream.inbox.get()
                except TimeoutError:
                    return f"nothing came through the relay for {stall_timeout_s:g} s"
                match msg:
                    case None:
                        ended = True
                        return "the session to the coordinator closed"
                    case DataCredit():
                        stream.waiting = not msg.credit and bool(msg.wait)
                        if msg.credit:
                            every = credit_every(msg.credit)
                    case DataChunk():
                        if msg.offset != expected:
                            return f"a chunk at offset {msg.offset}; the output continues at {expected}"
                        expected += len(msg.data)
                        batch += msg.data
                        if not msg.last and len(batch) < max(every, 1):
                            continue
                        if batch:
                            await store(entry, batch)
                            self.relayed_bytes += len(batch)
                            batch = bytearray()
                        if msg.last:
                            ended = True  # the coordinator and the holder closed it with its last chunk
                            if entry.received < entry.size:
                                raise RelayRefused(f"its holder's copy ended at {entry.received} of {entry.size} "
                                                   "bytes")
                            return None
                        self._send(DataCredit(plan_id=plan_id, attempt=attempt, name=name, direction="get",
                                              offset=entry.received, stream=stream.id))
                    case DataEnd():
                        ended = True
                        if msg.code in RETRYABLE:
                            return f"{msg.code}: {msg.message}"
                        raise RelayRefused(f"{msg.code or 'ended'}: {msg.message}", msg.code)
        finally:
            if self._streams.get(key) is stream:
                del self._streams[key]
            if not ended:  # this worker gives up on it (a reopen, a stall, its attempt ended): the relay frees it
                self._send(DataEnd(plan_id=plan_id, attempt=attempt, name=name, direction="get", code=CANCELLED,
                                   message="the fetching worker gave up on this stream", offset=entry.received,
                                   stream=stream.id))
