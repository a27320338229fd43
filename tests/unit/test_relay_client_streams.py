"""The SDK's relayed streams (fleetwire/relay.py): stream ids, waiting in line, output_gone, re-opens after progress."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest

from fleetwire.data import Grant
from fleetwire.direct import DirectTransport
from fleetwire.inputs import InputSource
from fleetwire.relay import AutoTransport, OutputGone, RelayTransport
from protocol.messages import DataChunk, DataCredit, DataEnd, DataOpen
from protocol.relay import CLOSED, GONE, MAX_CHUNK_BYTES

DATA = bytes(range(256)) * (4 * MAX_CHUNK_BYTES // 256)  # four chunks
GRANT = Grant("p", 1, "", "t")


class Link:
    """A JSON-like client link (no frames): what the transport posts, and a way to wait for the next one."""

    def __init__(self) -> None:
        self.posted: list[Any] = []
        self.changed = asyncio.Event()

    def post(self, msg: Any) -> None:
        self.posted.append(msg)
        self.changed.set()

    async def next_of(self, cls: type, after: int = 0) -> Any:
        """The first ``cls`` posted at index ``after`` or later (waits for it)."""
        while True:
            found = [m for m in self.posted[after:] if isinstance(m, cls)]
            if found:
                return found[0]
            self.changed.clear()
            await asyncio.wait_for(self.changed.wait(), 5)

    def opens(self) -> list[DataOpen]:
        return [m for m in self.posted if isinstance(m, DataOpen)]


def source() -> InputSource:
    return InputSource("x", len(DATA), "sha256:", data=memoryview(DATA))


async def test_a_late_end_of_an_earlier_open_does_not_end_the_reopened_stream() -> None:
    """Each open has its own id; the old stream's late data_end(relay_closed) after a re-open is ignored."""
    link = Link()
    relay = RelayTransport(link, stall_timeout_s=5)
    task = asyncio.create_task(relay.upload(GRANT, source()))
    first = await link.next_of(DataOpen)
    relay.receive(DataEnd(plan_id="p", attempt=1, name="x", code=CLOSED, message="session closed",
                          stream=first.stream))
    second = await link.next_of(DataOpen, link.posted.index(first) + 1)
    assert second.stream != first.stream
    relay.receive(DataEnd(plan_id="p", attempt=1, name="x", code=CLOSED, message="late", stream=first.stream))
    relay.receive(DataCredit(plan_id="p", attempt=1, name="x", offset=0, credit=len(DATA), size=len(DATA),
                             stream=second.stream))
    assert (await link.next_of(DataChunk)).stream == second.stream
    relay.receive(DataEnd(plan_id="p", attempt=1, name="x", offset=len(DATA), stream=second.stream))
    await asyncio.wait_for(task, 5)
    assert len(link.opens()) == 2


async def test_a_stream_in_line_says_why_and_is_not_a_stall(caplog: pytest.LogCaptureFixture) -> None:
    """data_credit(wait=...) is logged and kept in waits; the stall timeout does not re-open it meanwhile."""
    link = Link()
    relay = RelayTransport(link, stall_timeout_s=0.2)
    caplog.set_level(logging.INFO, "fleetwire.data")
    task = asyncio.create_task(relay.upload(GRANT, source()))
    opened = await link.next_of(DataOpen)
    why = "waiting for relay room: principal 'alice' holds 32 MiB of its share (--relay-principal-bytes)"
    relay.receive(DataCredit(plan_id="p", attempt=1, name="x", offset=0, size=len(DATA), wait=why,
                             stream=opened.stream))
    await asyncio.sleep(0.6)  # three stall timeouts pass: no re-open
    assert len(link.opens()) == 1 and relay.waits == {("p", 1, "x", "put"): why}
    assert any(why in record.getMessage() for record in caplog.records)
    assert not [m for m in link.posted if isinstance(m, DataChunk)]
    relay.receive(DataCredit(plan_id="p", attempt=1, name="x", offset=0, credit=len(DATA), size=len(DATA),
                             stream=opened.stream))
    await link.next_of(DataChunk)
    assert relay.waits == {}
    relay.receive(DataEnd(plan_id="p", attempt=1, name="x", offset=len(DATA), stream=opened.stream))
    await asyncio.wait_for(task, 5)


async def test_an_output_the_worker_no_longer_holds_is_output_gone() -> None:
    """data_end(output_gone) raises OutputGone (404) naming the output, with no re-open."""
    link = Link()
    relay = RelayTransport(link, stall_timeout_s=5)

    async def fetch() -> bytes:
        return b"".join([chunk async for chunk in relay.download(GRANT, "out")])

    task = asyncio.create_task(fetch())
    opened = await link.next_of(DataOpen)
    relay.receive(DataEnd(plan_id="p", attempt=1, name="out", direction="get", code=GONE, stream=opened.stream,
                          message="plan 'p' attempt 1 left no output 'out' on worker w1 (expired)"))
    with pytest.raises(OutputGone, match=r"output 'out' \(relayed\): output_gone: .*worker w1") as raised:
        await asyncio.wait_for(task, 5)
    assert raised.value.status == 404 and len(link.opens()) == 1


async def test_breaks_after_progress_start_the_resume_count_again() -> None:
    """A transfer that moves bytes between breaks (a slow source's idle ends) is not failed by max_resumes."""
    link = Link()
    relay = RelayTransport(link, stall_timeout_s=5, max_resumes=1)
    task = asyncio.create_task(relay.upload(GRANT, source()))
    opened = await link.next_of(DataOpen)
    offset = 0
    for _ in range(3):  # three breaks, each after one more chunk was acknowledged
        mark = len(link.posted)
        relay.receive(DataCredit(plan_id="p", attempt=1, name="x", offset=offset, credit=MAX_CHUNK_BYTES,
                                 size=len(DATA), stream=opened.stream))
        assert (await link.next_of(DataChunk, mark)).offset == offset
        offset += MAX_CHUNK_BYTES
        relay.receive(DataCredit(plan_id="p", attempt=1, name="x", offset=offset, stream=opened.stream))
        mark = len(link.posted)
        relay.receive(DataEnd(plan_id="p", attempt=1, name="x", code=CLOSED, message="idle", offset=offset,
                              stream=opened.stream))
        opened = await link.next_of(DataOpen, mark)
    relay.receive(DataCredit(plan_id="p", attempt=1, name="x", offset=offset, credit=len(DATA), size=len(DATA),
                             stream=opened.stream))
    relay.receive(DataEnd(plan_id="p", attempt=1, name="x", offset=len(DATA), stream=opened.stream))
    await asyncio.wait_for(task, 5)
    assert len(link.opens()) == 4


@pytest.mark.timeout(10)
async def test_an_upload_cancelled_as_its_stream_changes_ends() -> None:
    """An upload cancelled in the loop iteration in which its stream changes (a credit comes) ends cancelled and
    frees the coordinator's stream (on Python 3.11 asyncio.wait_for lost that cancel: the upload went on)."""
    link = Link()
    relay = RelayTransport(link, stall_timeout_s=30)
    task = asyncio.create_task(relay.upload(GRANT, source()))
    opened = await link.next_of(DataOpen)
    relay.receive(DataCredit(plan_id="p", attempt=1, name="x", offset=0, credit=MAX_CHUNK_BYTES, size=len(DATA),
                             stream=opened.stream))  # the stream changes ...
    task.cancel()  # ... and the caller gives up, in the same iteration
    done, _ = await asyncio.wait([task], timeout=2)
    if not done:  # the bug: end it with a second cancel, so nothing is left running
        task.cancel()
        await asyncio.wait([task], timeout=2)
    assert done and task.cancelled(), "the upload went on after it was cancelled"
    assert not any(isinstance(m, DataChunk) for m in link.posted)
    end = await link.next_of(DataEnd)
    assert (end.code, end.stream) == ("cancelled", opened.stream)


@pytest.mark.timeout(10)
async def test_an_auto_upload_cancelled_as_its_endpoint_answers_ends(monkeypatch: pytest.MonkeyPatch) -> None:
    """AutoTransport's upload cancelled in the loop iteration in which its reachability dial to the data endpoint
    opens ends there: no direct upload starts (on Python 3.11 asyncio.wait_for lost that cancel)."""
    accepted: list[asyncio.StreamWriter] = []
    server = await asyncio.start_server(lambda r, w: accepted.append(w), "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    auto = AutoTransport(DirectTransport(), RelayTransport(Link(), stall_timeout_s=5))
    task: asyncio.Task[None] | None = None
    open_connection = asyncio.open_connection

    async def open_then_cancel(*args: Any, **kwargs: Any) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        """The real open_connection; as the first (the reachability dial) returns, the upload is cancelled."""
        opened = await open_connection(*args, **kwargs)
        if task is not None and not task.cancelling():
            task.cancel()
        return opened

    monkeypatch.setattr(asyncio, "open_connection", open_then_cancel)
    try:
        task = asyncio.create_task(auto.upload(Grant("p", 1, f"http://127.0.0.1:{port}", "t"), source()))
        done, _ = await asyncio.wait([task], timeout=3)
        if not done:  # the bug: end it with a second cancel, so nothing is left running
            task.cancel()
            await asyncio.wait([task], timeout=2)
        assert done and task.cancelled(), "the upload went on after it was cancelled"
    finally:
        monkeypatch.undo()
        await auto.aclose()
        for writer in accepted:
            writer.close()
        server.close()
        await server.wait_closed()
