"""A graceful stop closes the listening socket before it waits for pending commits (server.py ``stop``)."""

from __future__ import annotations

import asyncio

import pytest

from coordinator.core import CoreConfig
from coordinator.io.frontdoor.server import CoordinatorServer, ServerSettings
from protocol.messages import Accept, Ack, Done, Submit
from tests.integration.test_ack_rides import GatedStore, frame
from tests.integration.test_server import CLIENT_TOKEN, WORKER_TOKEN, open_peer, register
from tests.waiting import until

pytestmark = pytest.mark.timeout(30)


async def test_a_connection_during_the_stops_wait_for_commits_is_refused() -> None:
    """While the stop waits for a commit still pending (flush_acks), a new TCP connection is refused; the open
    worker still reads its ack once the commit ends."""
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
        assert not stopping.done()  # still in the wait for the held commit
        with pytest.raises(ConnectionRefusedError):
            await asyncio.open_connection("127.0.0.1", srv.port)
        store.gate.set()
        await asyncio.wait_for(stopping, 20)
    finally:
        store.gate.set()
        if stopping is None:
            await srv.stop()
    assert await frame(worker) == [Ack(seq=2)]
