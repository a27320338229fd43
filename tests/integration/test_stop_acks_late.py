"""A graceful stop also lets out the steps that arrive during its wait for pending commits
(coordinator/io/frontdoor/core_driver.py ``flush_acks``).

The sessions stay open while the stop waits (up to ACK_FLUSH_WAIT_S) for the steps whose commit was pending when it
began; a worker's ``done`` read meanwhile is a step too, and its ack went only if its commit ended before the first
ones' did: else the close came first and the worker sent the done again after it reconnected.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest
import websockets

from coordinator.core import CoreConfig
from coordinator.io.frontdoor.server import CoordinatorServer, ServerSettings
from coordinator.io.stores.store import MemoryStore
from protocol.messages import Accept, Ack, Assign, Done, Event, Submit
from tests.integration.test_server import CLIENT_TOKEN, WORKER_TOKEN, open_peer, register
from tests.waiting import until

pytestmark = pytest.mark.timeout(30)


class GatedWrites(MemoryStore):
    """The memory store, written by the committer's writer thread (as a durable store is); once ``holding``, its next
    two writes each wait for a gate of their own (``gates``, in order; ``entered`` set as each begins)."""

    blocking = True

    def __init__(self) -> None:
        super().__init__()
        self.holding = False
        self.gates: list[threading.Event] = []
        self.entered = [threading.Event(), threading.Event()]

    def write(self, records: Any) -> None:
        if self.holding and len(self.gates) < 2:
            gate = threading.Event()
            self.gates.append(gate)
            self.entered[len(self.gates) - 1].set()
            gate.wait(20)
        super().write(records)

    def open_all(self) -> None:
        self.holding = False
        for gate in self.gates:
            gate.set()


async def test_a_stop_sends_the_ack_of_a_done_that_arrived_during_its_wait_for_commits() -> None:
    """A stop begins while one worker's done is being committed; another worker's done arrives during the stop's
    wait and is committed after the first: that worker too reads its done's ack before the close (1001)."""
    store = GatedWrites()
    srv = CoordinatorServer(ServerSettings(
        port=0, worker_tokens=(WORKER_TOKEN,), client_tokens=(CLIENT_TOKEN,),
        core=CoreConfig(heartbeat_interval_s=60.0, heartbeat_timeout_s=180.0),
    ), store=store)  # fmt: skip
    await srv.start()
    stopping: asyncio.Future[None] | None = None
    try:
        srv.driver.ack_hold_s = 60.0  # held: only the stop releases them
        client = await open_peer(srv, "client", CLIENT_TOKEN)
        assigns = []
        for i, worker_id in enumerate(("w1", "w2"), 1):
            worker = await register(srv, worker_id, ["echo"])
            await client.send(Submit(req_id=i, op="echo", args=i))
            assign = (await worker.recv_until(lambda m: type(m) is Assign))[-1]
            await worker.send(Accept(plan_id=assign.plan_id, attempt=1, seq=1))
            await client.recv_until(lambda m: type(m) is Event and m.kind == "running")  # its commit ended
            assigns.append((worker, assign))
        (w1, one), (w2, two) = assigns
        store.holding = True
        await w1.send(Done(plan_id=one.plan_id, attempt=1, outcome="succeeded", result=1, seq=2))
        assert await asyncio.to_thread(store.entered[0].wait, 10)  # w1's done's step is being committed
        stopping = asyncio.ensure_future(srv.stop())
        await until(lambda: srv.readiness_problem() == "shutting down", 5)
        committer = srv.driver.committer
        submitted = committer.submitted
        await w2.send(Done(plan_id=two.plan_id, attempt=1, outcome="succeeded", result=2, seq=2))
        await until(lambda: committer.submitted > submitted, 10)  # w2's done's step waits behind w1's
        store.gates[0].set()  # w1's commit ends; w2's write is held next
        assert await asyncio.to_thread(store.entered[1].wait, 10)
        second = committer.submitted
        listener = srv._server
        assert listener is not None
        # Either the stop waits for w2's step (its settled() for that ticket) or it went on to close the sessions.
        await until(lambda: listener.close_task is not None or any(t >= second for t, _ in committer._settling), 10)
        store.gates[1].set()
        await asyncio.wait_for(stopping, 20)
    finally:
        store.open_all()
        if stopping is None:
            await srv.stop()
    for name, worker in (("w1", w1), ("w2", w2)):
        acks: list[int] = []
        with pytest.raises(websockets.ConnectionClosed) as closed:
            while True:
                frame = worker.codec.decode(await asyncio.wait_for(worker.ws.recv(), 5))
                acks += [m.seq for m in frame if type(m) is Ack]
        assert closed.value.rcvd is not None and closed.value.rcvd.code == 1001
        assert acks == [2], f"the acks {name} read before the close: {acks}"
