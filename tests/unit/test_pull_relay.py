"""The consumer's side of a relayed pull (worker_agent/pull_relay.py), driven message by message: no sockets."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from protocol.messages import DataChunk, DataCredit, DataEnd, DataOpen, InputSpec, OutputRef, Pull
from protocol.relay import CLOSED, GONE
from tests.integration.data_helpers import digest
from worker_agent.pull_relay import CANCELLED, PullRelay, RelayRefused
from worker_agent.spool import Spool
from worker_agent.spool_files import InputFile

DATA = bytes(range(256)) * 40  # 10,240 bytes
PULL = Pull("x", "p1", 1, "y", "w1", ticket="t")


class Wire:
    """What the relay sends, and a way to wait for the next message of a type."""

    def __init__(self) -> None:
        self.sent: list[Any] = []
        self.changed = asyncio.Event()

    def send(self, msg: Any) -> None:
        self.sent.append(msg)
        self.changed.set()

    async def next(self, cls: type, after: int) -> Any:
        async with asyncio.timeout(5):
            while True:
                found = [m for m in self.sent[after:] if isinstance(m, cls)]
                if found:
                    return found[0]
                self.changed.clear()
                await self.changed.wait()


def chunk(opened: DataOpen, offset: int, size: int, *, last: bool = False) -> DataChunk:
    return DataChunk(plan_id="p1", attempt=1, name="y", offset=offset, data=DATA[offset:offset + size],
                     direction="get", last=last, size=len(DATA), stream=opened.stream)


async def store(entry: InputFile, data: bytearray) -> None:
    entry.store(data)


@pytest.fixture
async def entry(tmp_path: Path) -> InputFile:
    spool = Spool(tmp_path, memory_bytes=1 << 20)
    return spool.plan_data("p2", 1, [InputSpec("x", len(DATA), digest(DATA), ref=OutputRef("p1", "y"))]).entries["x"]


async def test_a_closed_stream_opens_again_from_the_bytes_stored_and_stale_chunks_are_dropped(entry: InputFile) -> None:
    """relay_closed mid-way: the fetch opens again at the offset it stored, a chunk of the old open is dropped, and
    the output arrives whole; credits name the bytes stored."""
    wire = Wire()
    relay = PullRelay(wire.send)
    task = asyncio.create_task(relay.fetch(PULL, entry, store, stall_timeout_s=5))
    first = await wire.next(DataOpen, 0)
    assert (first.direction, first.offset, first.ticket, first.name) == ("get", 0, "t", "y")
    assert relay.on_message(DataCredit(plan_id="p1", attempt=1, name="y", direction="get", offset=0, credit=4096,
                                       stream=first.stream))
    relay.on_message(chunk(first, 0, 4096))
    credit = await wire.next(DataCredit, 1)
    assert credit.offset == 4096
    relay.on_message(DataEnd(plan_id="p1", attempt=1, name="y", direction="get", code=CLOSED, stream=first.stream))
    n = len(wire.sent)
    again = await wire.next(DataOpen, n)
    assert again.offset == 4096 and again.stream != first.stream
    assert relay.on_message(chunk(first, 4096, 4096))  # the old open's: taken here, dropped
    relay.on_message(chunk(again, 4096, len(DATA) - 4096, last=True))
    await asyncio.wait_for(task, 5)
    assert entry.received == len(DATA) and relay.relayed_bytes == len(DATA)
    assert not any(isinstance(m, DataEnd) for m in wire.sent)  # both opens ended as the coordinator said


async def test_output_gone_ends_the_fetch_and_a_cancelled_fetch_ends_its_stream(entry: InputFile) -> None:
    """output_gone is not retried (RelayRefused naming it); a fetch cancelled mid-way ends its stream cancelled."""
    wire = Wire()
    relay = PullRelay(wire.send)
    task = asyncio.create_task(relay.fetch(PULL, entry, store, stall_timeout_s=5))
    opened = await wire.next(DataOpen, 0)
    relay.on_message(DataEnd(plan_id="p1", attempt=1, name="y", direction="get", code=GONE, message="expired",
                             stream=opened.stream))
    with pytest.raises(RelayRefused, match="output_gone: expired") as refused:
        await asyncio.wait_for(task, 5)
    assert refused.value.code == GONE  # the puller tells a refused ticket from a lost output by it
    task = asyncio.create_task(relay.fetch(PULL, entry, store, stall_timeout_s=5))
    opened = await wire.next(DataOpen, 1)
    task.cancel()
    end = await wire.next(DataEnd, 2)
    assert (end.code, end.stream) == (CANCELLED, opened.stream)
    assert not relay.on_message(DataCredit(plan_id="p1", attempt=1, name="y", direction="get", offset=0))


async def test_a_fetch_gives_up_after_reopens_that_bring_nothing(entry: InputFile) -> None:
    """Reopened streams that each close before a byte came: after the resumes the fetch is refused, saying so."""
    wire = Wire()
    relay = PullRelay(wire.send, resumes=2)
    task = asyncio.create_task(relay.fetch(PULL, entry, store, stall_timeout_s=5))
    seen = 0
    for _ in range(3):
        opened = await wire.next(DataOpen, seen)
        seen = wire.sent.index(opened) + 1
        relay.on_message(DataEnd(plan_id="p1", attempt=1, name="y", direction="get", code=CLOSED, message="gone",
                                 stream=opened.stream))
    with pytest.raises(RelayRefused, match="3 opens in a row brought no byte"):
        await asyncio.wait_for(task, 5)


@pytest.mark.timeout(10)
async def test_a_fetch_cancelled_as_a_message_arrives_ends(entry: InputFile) -> None:
    """A fetch cancelled in the loop iteration in which a message reaches its stream ends cancelled (on Python 3.11
    asyncio.wait_for lost that cancel: the fetch went on waiting for the stream, and whoever awaited it hung)."""
    wire = Wire()
    relay = PullRelay(wire.send)
    task = asyncio.create_task(relay.fetch(PULL, entry, store, stall_timeout_s=30))
    opened = await wire.next(DataOpen, 0)
    relay.on_message(DataCredit(plan_id="p1", attempt=1, name="y", direction="get", offset=0, credit=4096,
                                stream=opened.stream))  # a message arrives ...
    task.cancel()  # ... and the attempt ends, in the same iteration
    done, _ = await asyncio.wait([task], timeout=2)
    if not done:  # the bug: end it with a second cancel, so nothing is left running
        task.cancel()
        await asyncio.wait([task], timeout=2)
    assert done and task.cancelled(), "the fetch went on after it was cancelled"
    end = await wire.next(DataEnd, 1)
    assert (end.code, end.stream) == (CANCELLED, opened.stream)
