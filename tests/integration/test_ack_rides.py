"""A worker's lone ``ack`` rides with its next frame, or leaves alone within the bound (core_driver.py §Acks).

Raw protocol peers against the coordinator's server over loopback sockets; the worker's frames are read
one at a time, so what shares a frame shows.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import AsyncIterator
from typing import Any

import pytest
import websockets

from coordinator.core import CoreConfig
from coordinator.io.frontdoor import core_driver
from coordinator.io.frontdoor.connection import Session
from coordinator.io.frontdoor.server import CoordinatorServer, ServerSettings
from coordinator.io.stores.store import MemoryStore
from protocol.messages import Accept, Ack, Assign, Done, Event, Submit
from tests.integration.test_server import CLIENT_TOKEN, WORKER_TOKEN, Peer, open_peer, register
from tests.waiting import until

pytestmark = pytest.mark.timeout(30)


@pytest.fixture
async def server() -> AsyncIterator[CoordinatorServer]:
    """A coordinator whose workers need no heartbeat during a test (they send none)."""
    srv = CoordinatorServer(ServerSettings(
        port=0, worker_tokens=(WORKER_TOKEN,), client_tokens=(CLIENT_TOKEN,),
        core=CoreConfig(heartbeat_interval_s=60.0, heartbeat_timeout_s=180.0),
    ))  # fmt: skip
    await srv.start()
    yield srv
    await srv.stop()


async def frame(peer: Peer) -> list[Any]:
    """The worker's next frame, whole."""
    assert not peer.inbox
    return peer.codec.decode(await asyncio.wait_for(peer.ws.recv(), 5))


async def one_plan_done(server: CoordinatorServer, hold_s: float) -> tuple[Peer, Peer]:
    """A worker and a client, the client's first plan run and its result read; the worker's done sent (seq 2)."""
    server.driver.ack_hold_s = hold_s
    worker = await register(server, "w1", ["echo"])
    client = await open_peer(server, "client", CLIENT_TOKEN)
    await client.send(Submit(req_id=1, op="echo", args=1))
    (assign,) = await frame(worker)
    assert type(assign) is Assign
    await worker.send(
        Accept(plan_id=assign.plan_id, attempt=1, seq=1),
        Done(plan_id=assign.plan_id, attempt=1, outcome="succeeded", result=1, seq=2),
    )
    await client.recv_until(lambda m: type(m) is Event and m.kind == "succeeded")
    return worker, client


async def test_a_done_s_ack_and_the_next_assign_arrive_in_one_frame(server: CoordinatorServer) -> None:
    """The ack of a sequential plan's done is not a frame of its own: it leads the next assign's frame."""
    worker, client = await one_plan_done(server, hold_s=60.0)  # the timer cannot release it during the test
    await client.send(Submit(req_id=2, op="echo", args=2))
    msgs = await frame(worker)
    assert [type(m) for m in msgs] == [Ack, Assign]
    assert msgs[0].seq == 2


async def test_a_held_ack_leaves_alone_with_no_further_traffic(server: CoordinatorServer) -> None:
    """With nothing more to send the worker, the held ack still comes, alone, once the ack timer found it held."""
    worker, _client = await one_plan_done(server, hold_s=0.01)
    assert await frame(worker) == [Ack(seq=2)]
    await until(lambda: server.driver._ack_timer is None, 5)  # nothing held: the timer stops


async def test_an_ack_of_many_more_messages_leaves_at_once(server: CoordinatorServer) -> None:
    """A held ack is not replaced past ACK_HOLD_MESSAGES more messages: that ack goes now (the worker keeps them)."""
    server.driver.ack_hold_s = 60.0
    worker = await register(server, "w1", ["echo"])
    client = await open_peer(server, "client", CLIENT_TOKEN)
    await client.send(Submit(req_id=1, op="echo", args=1))
    (assign,) = await frame(worker)
    await worker.send(Accept(plan_id=assign.plan_id, attempt=1, seq=1))
    await until(lambda: bool(server.driver._acks_new), 5)  # held: the timer is an hour away
    count = core_driver.ACK_HOLD_MESSAGES
    await worker.send(*[
        Event(plan_id=assign.plan_id, attempt=1, kind="log", data=i, seq=2 + i) for i in range(count)
    ])  # fmt: skip
    assert await frame(worker) == [Ack(seq=1 + count)]


@pytest.mark.parametrize("now", [True, False], ids=["written-at-once", "by-the-writer"])
async def test_a_graceful_stop_sends_the_held_ack_before_the_close(now: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """A stop right after a done: the worker reads its ack, then the close (1001), whether the ack is written in the
    stop's step (Session.send_now) or left to the session's writer."""
    if not now:
        monkeypatch.setattr(Session, "send_now", lambda self, msgs: False)
    srv = CoordinatorServer(ServerSettings(
        port=0, worker_tokens=(WORKER_TOKEN,), client_tokens=(CLIENT_TOKEN,),
        core=CoreConfig(heartbeat_interval_s=60.0, heartbeat_timeout_s=180.0),
    ))  # fmt: skip
    await srv.start()
    try:
        worker, _client = await one_plan_done(srv, hold_s=60.0)  # held: the timer cannot release it
        assert srv.driver._acks_new or srv.driver._acks_due
    finally:
        await srv.stop()
    assert await frame(worker) == [Ack(seq=2)]
    with pytest.raises(websockets.ConnectionClosed) as closed:
        await asyncio.wait_for(worker.ws.recv(), 5)
    assert closed.value.rcvd is not None and closed.value.rcvd.code == 1001


class GatedStore(MemoryStore):
    """The memory store, written by the committer's writer thread (as a durable store is), whose writes wait while
    the test's gate is closed."""

    blocking = True

    def __init__(self) -> None:
        super().__init__()
        self.gate, self.entered = threading.Event(), threading.Event()
        self.gate.set()

    def write(self, records: Any) -> None:
        if not self.gate.is_set():
            self.entered.set()
            self.gate.wait(30)
        super().write(records)


@contextlib.asynccontextmanager
async def stopping_on_a_pending_commit() -> AsyncIterator[tuple[CoordinatorServer, Peer, asyncio.Future[None]]]:
    """A coordinator whose stop began while a worker's done was still being committed (a memory store written by the
    writer thread, its write held): yields it, the worker and the stop, still waiting; on exit the commit ends and
    the stop is awaited. test_stop_listener.py shares it."""
    store = GatedStore()
    srv = CoordinatorServer(ServerSettings(
        port=0, worker_tokens=(WORKER_TOKEN,), client_tokens=(CLIENT_TOKEN,),
        core=CoreConfig(heartbeat_interval_s=60.0, heartbeat_timeout_s=180.0),
    ), store=store)  # fmt: skip
    await srv.start()
    stopping: asyncio.Future[None] | None = None
    try:
        srv.driver.ack_hold_s = 60.0  # held: the timer cannot release it
        worker = await register(srv, "w1", ["echo"])
        client = await open_peer(srv, "client", CLIENT_TOKEN)
        await client.send(Submit(req_id=1, op="echo", args=1))
        (assign,) = await frame(worker)
        store.gate.clear()
        await worker.send(
            Accept(plan_id=assign.plan_id, attempt=1, seq=1),
            Done(plan_id=assign.plan_id, attempt=1, outcome="succeeded", result=1, seq=2),
        )
        assert await asyncio.to_thread(store.entered.wait, 10)  # the done's step is being committed
        stopping = asyncio.ensure_future(srv.stop())
        await until(lambda: srv.readiness_problem() == "shutting down", 5)
        yield srv, worker, stopping
        store.gate.set()  # the commit ends once the stop has begun
        await asyncio.wait_for(stopping, 20)
    finally:
        store.gate.set()
        if stopping is None:
            await srv.stop()


async def test_a_graceful_stop_sends_the_acks_of_the_steps_whose_commit_is_pending() -> None:
    """A stop while a worker's done is still being committed: that commit ends before the sessions close, and the
    worker reads the done's ack, then the close (1001), instead of the close alone (it would send the done again)."""
    async with stopping_on_a_pending_commit() as (_, worker, _stopping):
        pass
    assert await frame(worker) == [Ack(seq=2)]
    with pytest.raises(websockets.ConnectionClosed) as closed:
        await asyncio.wait_for(worker.ws.recv(), 5)
    assert closed.value.rcvd is not None and closed.value.rcvd.code == 1001
