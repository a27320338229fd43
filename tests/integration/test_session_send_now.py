"""A session's frame written in the releasing step (``Session.send_now``) over loopback sockets.

coordinator/io/frontdoor/connection.py: while the session's writer is parked with nothing pending, a
small batch is encoded and handed to the socket by the caller (``CoreDriver.deliver``), not a loop turn
later by the writer's task; whenever the writer holds something, or the connection would make a sender
wait, nothing is written there and the writer sends it, in order.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import pytest
from websockets.asyncio.client import ClientConnection, connect
from websockets.asyncio.server import ServerConnection, serve

from coordinator.io.frontdoor.connection import MAX_OUT_FRAME_BYTES, FailFastConnection, Session
from protocol import Codec
from protocol.messages import Event, ToClient
from tests.waiting import until
from wireio.wsbulk import BULK_MIN_BYTES

pytestmark = pytest.mark.timeout(60)

PEER = Codec("msgpack", ToClient, "coordinator")


@asynccontextmanager
async def session_pair() -> AsyncIterator[tuple[Session, ClientConnection]]:
    """A loopback server's one session, its writer running and parked, and the client reading it."""
    ready: asyncio.Future[Session] = asyncio.get_running_loop().create_future()
    done = asyncio.Event()

    async def serve_one(ws: ServerConnection) -> None:
        session = Session(1, ws, Codec("msgpack", ToClient, "client"), role="client")
        session.writer = asyncio.create_task(session.write_loop())
        ready.set_result(session)
        await done.wait()
        session.writer.cancel()

    async with serve(serve_one, "127.0.0.1", 0, create_connection=FailFastConnection, compression=None) as server:
        port = server.sockets[0].getsockname()[1]
        async with connect(f"ws://127.0.0.1:{port}/", compression=None, max_size=None) as client:
            session = await asyncio.wait_for(ready, 10)
            await until(lambda: session.parked, 10)
            try:
                yield session, client
            finally:
                done.set()


def events(first: int, count: int, data: Any = "x") -> list[Any]:
    return [Event(plan_id="p", kind="log", data=data, seq=i) for i in range(first, first + count)]


async def received(client: ClientConnection, count: int) -> list[Any]:
    msgs: list[Any] = []
    while len(msgs) < count:
        msgs += PEER.decode(await asyncio.wait_for(client.recv(), 10))
    return msgs


async def test_a_parked_writers_batch_leaves_in_the_callers_step() -> None:
    """With the writer parked and nothing pending, send_now hands one frame to the socket before returning."""
    async with session_pair() as (session, client):
        batch = events(1, 3)
        assert session.send_now(batch)
        assert session.ws.transport.get_write_buffer_size() == 0 and not session.pending
        assert session.io[2] == 1 and session.parked  # one frame out; the writer was never woken
        assert await received(client, 3) == batch


async def test_what_the_writer_holds_goes_first_and_send_now_writes_nothing() -> None:
    """Messages already pending for the woken writer: send_now declines, and the writer sends both in order."""
    async with session_pair() as (session, client):
        first, second = events(1, 2), events(3, 2)
        session.pending.extend(first)
        session.wake.set()
        assert not session.send_now(second)
        session.pending.extend(second)
        assert await received(client, 4) == first + second


async def test_a_batch_over_one_frame_is_left_to_the_writer_which_cuts_it() -> None:
    """A batch whose frame would pass the peers' limit is not written by send_now; the writer sends it in frames."""
    async with session_pair() as (session, client):
        batch = events(1, 8, data="y" * (MAX_OUT_FRAME_BYTES // 4))
        assert not session.send_now(batch) and session.io[2] == 0
        assert not session.send_now(events(9, 1, data="z" * BULK_MIN_BYTES))  # big: the writer's bulk send
        session.pending.extend(batch)
        session.wake.set()
        assert await received(client, 8) == batch
        assert session.io[2] >= 2


async def test_a_closing_or_paused_session_is_left_to_the_writer() -> None:
    """send_now writes nothing to a session the server is closing, or whose transport is over its high-water mark."""
    async with session_pair() as (session, _):
        session.ws.paused = True
        assert not session.send_now(events(1, 1))
        session.ws.paused = False
        session.close_with = (1000, "bye")
        assert not session.send_now(events(1, 1))
        assert session.io[2] == 0


async def test_one_frame_a_turn_the_rest_of_the_turn_coalesced_by_the_writer() -> None:
    """send_now writes at most one frame a loop turn: later batches of that turn go to the writer, as one frame."""
    async with session_pair() as (session, client):
        first, second, third = events(1, 2), events(3, 2), events(5, 2)
        assert session.send_now(first)
        assert not session.send_now(second)  # the same turn: a commit releasing several steps, many peers' steps
        session.pending.extend(second)
        session.wake.set()
        session.pending.extend(third)  # a third step of that turn joins the writer's frame
        assert await received(client, 6) == first + second + third
        assert session.io[2] == 2  # two frames, not three
        await until(lambda: session.parked, 10)
        assert session.send_now(events(7, 1))  # a later turn: written at once again
