"""The front door's reader over loopback sockets: frames go to an idle handler from ``data_received`` itself.

coordinator/io/frontdoor/reader.py ``FrameReader``: an ``InlineHandler``'s frames are taken where the
connection parsed them (no task woken: ``asyncio.current_task()`` is None there); whatever needs
waiting (a pause, the rest of a frame, a fragmented message) goes to the session's task, with every
frame behind it queued, so order holds and the read policy's verdicts still apply.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import pytest
from websockets.asyncio.client import ClientConnection, connect
from websockets.asyncio.server import ServerConnection, serve

from coordinator.io.frontdoor.connection import FailFastConnection, Session
from coordinator.io.frontdoor.reader import read_frames
from coordinator.limits import Limits
from coordinator.read_policy import FLOOD, ReadPolicy
from protocol import Codec
from protocol.messages import FromClient, ListWorkers

pytestmark = pytest.mark.timeout(60)

CODEC = Codec("msgpack", FromClient, "client")


class Recorder:
    """An ``InlineHandler`` that notes each message's req_id and whether a task handed it on.

    ``stop_after``: ``take`` stops after this many messages of a frame (as the frame budget does), so the
    reader's task must ``finish`` the rest.
    """

    def __init__(self, stop_after: int = 0) -> None:
        self.seen: list[int] = []
        self.in_task: list[bool] = []
        self.stop_after = stop_after
        self.closed_with: list[int | None] = []
        self.want = 0
        self.got = asyncio.Event()

    def opened(self, now: float) -> None:
        pass

    async def received(self, msgs: list[Any], frame_bytes: int, now: float) -> int:
        self._note(msgs)
        return 0

    def take(self, msgs: list[Any], frame_bytes: int, now: float) -> tuple[int, int]:
        count = len(msgs) if not self.stop_after else min(len(msgs), self.stop_after)
        self._note(msgs[:count])
        return count, 0

    async def finish(self, msgs: list[Any], index: int, frame_bytes: int) -> int:
        await asyncio.sleep(0)
        self._note(msgs[index:])
        return 0

    def closed(self, now: float, code: int | None) -> None:
        self.closed_with.append(code)

    def _note(self, msgs: list[Any]) -> None:
        task = asyncio.current_task() is not None
        for msg in msgs:
            self.seen.append(msg.req_id)
            self.in_task.append(task)
        if self.want and len(self.seen) >= self.want:
            self.got.set()


@asynccontextmanager
async def reading(handler: Recorder, limits: Limits) -> AsyncIterator[tuple[Callable[[], ClientConnection], list[int]]]:
    """A loopback server whose one session's frames ``read_frames`` feeds to ``handler``; yields (client, kills)."""
    kills: list[int] = []
    closing: list[asyncio.Task[None]] = []
    policy = ReadPolicy(limits)

    def kill(session: Session, code: int, reason: str) -> None:  # as the door's: told at once, then closed
        session.killed = True
        kills.append(code)
        handler.closed_with.append(code)
        handler.got.set()
        closing.append(asyncio.create_task(session.ws.close(code, reason)))

    async def serve_one(ws: ServerConnection) -> None:
        session = Session(1, ws, CODEC, role="client")
        handler.opened(time.monotonic())
        await read_frames(session, handler, policy.connection("client", "p", time.monotonic()), kill=kill,
                          store=None, clock=time.monotonic)  # fmt: skip

    async with serve(serve_one, "127.0.0.1", 0, create_connection=FailFastConnection, compression=None) as server:
        port = server.sockets[0].getsockname()[1]
        async with connect(f"ws://127.0.0.1:{port}/", compression=None) as client:
            yield (lambda: client), kills


def frame(*req_ids: int) -> bytes:
    return CODEC.encode([ListWorkers(req_id=i) for i in req_ids])


async def test_an_idle_readers_frames_reach_the_handler_in_order_from_data_received() -> None:
    """Frames to an idle reader are handed on in data_received (no task), each once, in the order sent."""
    handler = Recorder()
    handler.want = 300
    async with reading(handler, Limits(client_rate=1e9, client_burst=10**9)) as (client, kills):
        for first in range(1, 301, 3):
            await client().send(frame(first, first + 1, first + 2))
        await asyncio.wait_for(handler.got.wait(), 10)
    assert handler.seen == list(range(1, 301))
    assert not any(handler.in_task) and not kills


async def test_a_frame_the_handler_stopped_in_is_finished_by_the_task_with_later_frames_behind_it() -> None:
    """take() stopping mid-frame (the frame budget): the task finishes it, and frames read meanwhile follow it."""
    handler = Recorder(stop_after=2)
    handler.want = 300
    async with reading(handler, Limits(client_rate=1e9, client_burst=10**9)) as (client, _):
        for first in range(1, 301, 5):
            await client().send(frame(*range(first, first + 5)))
        await asyncio.wait_for(handler.got.wait(), 10)
    assert handler.seen == list(range(1, 301))
    assert handler.in_task[2] and not handler.in_task[0]  # the rest of the first frame: by the task


async def test_a_flood_is_throttled_in_order_by_the_task_then_closed_4429() -> None:
    """Over the message rate the reader pauses (later frames wait for the task, in order), then kills it 4429."""
    handler = Recorder()
    limits = Limits(client_rate=500.0, client_burst=20, flood_grace_s=0.3)
    async with reading(handler, limits) as (client, kills):
        sender = asyncio.create_task(_flood(client()))
        await asyncio.wait_for(handler.got.wait(), 20)  # set by the kill
        sender.cancel()
    assert kills == [FLOOD[0]] and handler.closed_with == [FLOOD[0]]
    assert handler.seen == list(range(1, len(handler.seen) + 1))  # in order, none twice, none skipped
    assert not handler.in_task[0]  # within the burst: from data_received
    assert any(handler.in_task)  # past it: paused, then by the task
    assert len(handler.seen) <= 20 + 500 * 2.0  # throttled: the burst and about the grace's worth at the rate


async def _flood(client: ClientConnection) -> None:
    req_id = 0
    while True:
        req_id += 1
        await client.send(frame(req_id))


async def test_a_fragmented_message_turns_reading_over_to_the_library_in_order() -> None:
    """A fragmented message goes through websockets' queue, and every frame after it, in the order sent."""
    handler = Recorder()
    handler.want = 30
    async with reading(handler, Limits(client_rate=1e9, client_burst=10**9)) as (client, _):
        for req_id in range(1, 11):
            await client().send(frame(req_id))
        whole = frame(11, 12, 13, 14, 15, 16, 17, 18, 19, 20)
        await client().send([whole[:5], whole[5:9], whole[9:]])  # one message in three fragments
        for req_id in range(21, 31):
            await client().send(frame(req_id))
        await asyncio.wait_for(handler.got.wait(), 10)
    assert handler.seen == list(range(1, 31))
    assert not handler.in_task[0] and all(handler.in_task[10:])
