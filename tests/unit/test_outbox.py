"""The worker's bounded outbox and how queued messages become frames."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import structlog
from structlog.testing import capture_logs

import protocol
from protocol import Codec
from worker_agent.outbox import COALESCE_TURNS, KEEP_ACKED_DONE, Outbox, SendQueue, encode_frames, write_frames


def event(plan_id: str, n: int, *, ephemeral: bool = False, attempt: int = 1) -> protocol.Event:
    return protocol.Event(plan_id=plan_id, kind="progress" if ephemeral else "log", data=n, attempt=attempt,
                          ephemeral=ephemeral)  # fmt: skip


def done(plan_id: str, attempt: int = 1) -> protocol.Done:
    return protocol.Done(plan_id=plan_id, attempt=attempt, outcome="succeeded")


def test_overflow_sheds_heartbeats_then_oldest_ephemeral_events() -> None:
    """Past the limit: stale heartbeats go first, then the oldest ephemeral events, down to 90 %."""
    box = Outbox(limit=10)
    box.append(protocol.Accept(plan_id="p", attempt=1))
    box.append(protocol.Heartbeat())
    for n in range(7):
        box.append(event("p", n, ephemeral=n % 2 == 0))
    assert box.append(done("p")) == 0 and len(box) == 10  # at the limit: nothing shed yet
    shed = box.append(event("p", 99))
    assert shed == 2 and box.dropped == 2  # the heartbeat and the oldest ephemeral event
    kept = box.take(100)
    assert kept[0] == protocol.Accept(plan_id="p", attempt=1) and done("p") in kept
    assert [m.data for m in kept if isinstance(m, protocol.Event)] == [1, 2, 3, 4, 5, 6, 99]


def test_overflow_drops_durable_events_only_when_no_ephemeral_is_left() -> None:
    """With no ephemeral events, the oldest durable events go, down to exactly the limit; done never."""
    box = Outbox(limit=4)
    box.append(done("a"))
    for n in range(4):
        box.append(event("b", n))
    assert box.take(10) == [done("a"), event("b", 1), event("b", 2), event("b", 3)]


def test_requeue_puts_messages_back_in_front_without_heartbeats() -> None:
    """Messages whose send failed go back first, in order; their heartbeats are dropped."""
    box = Outbox()
    box.append(event("p", 3))
    box.requeue([event("p", 1), protocol.Heartbeat(), event("p", 2)])
    assert box.take(10) == [event("p", 1), event("p", 2), event("p", 3)]


def test_purge_and_pending_done() -> None:
    """purge drops one plan's (attempt's) messages; pending_done lists plans whose done waits."""
    box = Outbox()
    for msg in (event("a", 1), event("a", 2, attempt=2), done("a", 2), event("b", 1), done("b")):
        box.append(msg)
    assert box.pending_done() == [
        protocol.RunningPlan(plan_id="a", attempt=2),
        protocol.RunningPlan(plan_id="b", attempt=1),
    ]
    box.purge("a", 2)
    assert box.take(10) == [event("a", 1), event("b", 1), done("b")]
    box.append(event("a", 3))
    box.purge("a")
    assert not box


def test_bad_limit_is_refused() -> None:
    """An outbox must hold at least one message."""
    with pytest.raises(ValueError, match="limit"):
        Outbox(limit=0)


def test_encode_frames_coalesces_and_splits_by_size() -> None:
    """Messages share a frame up to the size limit, and are split into several frames beyond it."""
    codec = Codec("msgpack", protocol.messages.FromWorker, "worker")
    small = [event("p", n) for n in range(3)]
    frames = encode_frames(codec, small, 8192)
    assert len(frames) == 1 and codec.decode(frames[0][0]) == small
    big = [protocol.Event(plan_id="p", kind="blob", data=b"x" * 3000) for _ in range(6)]
    frames = encode_frames(codec, big, 8192)
    assert len(frames) > 1 and all(len(frame) <= 8192 for frame, _ in frames)
    assert [m for frame, _ in frames for m in codec.decode(frame)] == big


def test_encode_frames_replaces_an_oversized_result_and_drops_an_oversized_event() -> None:
    """A done above the limit becomes a failed done saying why; an event above it is dropped."""
    codec = Codec("json", protocol.messages.FromWorker, "worker")
    huge_done = protocol.Done(plan_id="p", attempt=1, outcome="succeeded", result=[100] * 4000)
    huge_event = protocol.Event(plan_id="p", kind="blob", data=[100] * 4000)
    with capture_logs() as logs:
        frames = encode_frames(codec, [huge_event, huge_done], 8192)
    [(frame, msgs)] = frames
    [sent] = codec.decode(frame.decode())  # a JSON session reads text frames
    assert sent == msgs[0] and sent.outcome == "failed" and sent.error.code == "handler_error"
    assert "frame limit is 8192" in sent.error.message
    assert any(entry["event"] == "dropping an oversized message" for entry in logs)


# ---------------------------------------------------------------- acknowledgement (docs/SEMANTICS.md §Durability)


def numbered(plan_id: str, seq: int, *, ephemeral: bool = False) -> protocol.Event:
    msg = event(plan_id, seq, ephemeral=ephemeral)
    msg.seq = seq
    return msg


def test_sent_messages_wait_for_their_ack() -> None:
    """Sent plan messages stay unacked until ack(seq); ack drops those at or below seq, keeps the rest."""
    box = Outbox()
    msgs = [numbered("p", n) for n in (1, 2, 3)]
    box.sent([*msgs, protocol.Heartbeat()])
    assert box.unacked == 3
    assert box.ack(2) == 2 and box.unacked == 1
    box.rewind()
    assert box.take(10) == [msgs[2]]


def test_rewind_puts_unacked_messages_before_newer_ones() -> None:
    """A new session sends what was never acknowledged first, in seq order, then what was queued since."""
    box = Outbox()
    box.sent([numbered("p", 1), numbered("p", 2)])
    box.append(numbered("p", 3))
    box.rewind()
    assert [m.seq for m in box.take(10)] == [1, 2, 3]
    assert box.unacked == 0


def test_unacked_done_counts_as_pending_done_and_purge_reaches_it() -> None:
    """A sent but unacknowledged done is listed for hello; purging its plan drops it from the unacked list."""
    box = Outbox()
    finished = done("p")
    finished.seq = 4
    box.sent([finished])
    assert box.pending_done() == [protocol.RunningPlan(plan_id="p", attempt=1)]
    box.purge("p", 1)
    assert box.unacked == 0 and box.pending_done() == []


def test_unacked_list_is_bounded_and_never_sheds_done() -> None:
    """Past the limit, unacked ephemeral events go first, then events; done stays."""
    box = Outbox(limit=3)
    finished = done("q")
    finished.seq = 3
    box.sent([numbered("p", 1, ephemeral=True), numbered("p", 2), finished, numbered("p", 4), numbered("p", 5)])
    assert box.unacked == 3 and box.dropped == 2
    box.rewind()
    assert [m.seq for m in box.take(10)] == [3, 4, 5]


def test_acknowledged_dones_are_kept_for_a_coordinator_that_lost_them() -> None:
    """An acked done stays listed for hello (recent_done); welcome re-queues those the coordinator continues, in
    front, and forgets the rest; plans listed at another attempt are left out."""
    box = Outbox(limit=100)
    for n, plan_id in enumerate(["a", "b", "c"], start=1):
        msg = done(plan_id)
        msg.seq = n
        box.append(msg)
    box.sent(box.take(10))
    assert box.ack(3) == 3 and box.unacked == 0 and box.pending_done() == []
    assert [(r.plan_id, r.attempt) for r in box.recent_done(exclude={"c"})] == [("a", 1), ("b", 1)]
    box.append(event("z", 1))
    assert box.welcomed(["b", "x"]) == 1
    assert [m.plan_id for m in box.take(10)] == ["b", "z"]
    assert box.recent_done() == [] and box.welcomed(["a"]) == 0  # forgotten after one welcome


def test_only_the_newest_acknowledged_dones_are_kept() -> None:
    """At most KEEP_ACKED_DONE acknowledged dones are kept, the newest; purge drops a plan's."""
    box = Outbox(limit=10_000)
    for n in range(KEEP_ACKED_DONE + 5):
        msg = done(f"p{n}")
        msg.seq = n + 1
        box.append(msg)
    box.sent(box.take(10_000))
    box.ack(10_000)
    kept = [r.plan_id for r in box.recent_done()]
    assert len(kept) == KEEP_ACKED_DONE and kept[0] == "p5" and kept[-1] == f"p{KEEP_ACKED_DONE + 4}"
    box.purge("p5")
    assert "p5" not in [r.plan_id for r in box.recent_done()]


# ---------------------------------------------------------------- the writer (write_frames)


class Wire:
    """The transport under the writer: each frame it was given, decoded back into its messages."""

    def __init__(self) -> None:
        self.codec = Codec("msgpack", protocol.messages.FromWorker, "worker")
        self.frames: list[list[Any]] = []
        self.written_now: list[list[Any]] = []  # the frames of those that came through write_now
        self.broken = False
        self.full = False  # write_now: the buffer is over its high-water mark (the writer's send would wait)

    async def send(self, frame: bytes) -> None:
        if self.broken:
            raise ConnectionResetError("the wire broke")
        self.frames.append(self.codec.decode(frame))

    def write_now(self, frame: bytes) -> bool:
        if self.full:
            return False
        self.frames.append(self.codec.decode(frame))
        self.written_now.append(self.frames[-1])
        return True


class Writer:
    """``write_frames`` running on a :class:`Wire`, as a session runs it (``write_now``: with the wire's)."""

    def __init__(self, write_now: bool = False) -> None:
        self.queue = SendQueue(1000, structlog.get_logger())
        self.wire = Wire()
        self.finishing = False
        self.task = asyncio.ensure_future(write_frames(
            self.queue, self.wire.codec, self.wire.send, max_frame_bytes=1 << 20, max_batch=4096,
            finishing=lambda: self.finishing, write_now=self.wire.write_now if write_now else None,
        ))  # fmt: skip

    async def sent(self, count: int) -> None:
        """Loop turns until ``count`` frames went out (each turn lets every ready task run once)."""
        for _ in range(100):
            if len(self.wire.frames) >= count:
                return
            await asyncio.sleep(0)
        raise AssertionError(f"{len(self.wire.frames)} frames after 100 loop turns, waited for {count}")

    async def close(self) -> None:
        self.finishing = True
        self.queue.wakeup.set()
        await asyncio.wait_for(self.task, 5)


def token(n: int) -> protocol.Event:
    return protocol.Event(plan_id="p", kind="token", data={"text": f"t{n}"}, attempt=1, ephemeral=True)


async def test_a_lone_token_is_written_in_the_loop_turn_the_writer_wakes() -> None:
    """A stream's event queued while the writer idles goes out at once, without waiting turns for company."""
    writer = Writer()
    writer.queue.send(protocol.Accept(plan_id="p", attempt=1))
    await writer.sent(1)
    for n in range(3):  # the first token (time to first byte), and later ones spaced as a real engine's
        await asyncio.sleep(0)  # the writer idles
        msg = token(n)
        writer.queue.send(msg)  # numbers it
        await asyncio.sleep(0)  # one loop turn: the writer's
        assert writer.wire.frames[-1] == [msg]
    await writer.close()
    assert len(writer.wire.frames) == 4


async def test_a_plan_that_ends_at_once_is_still_one_frame() -> None:
    """accept, then event and done a loop turn later, wait for each other: one frame, also after spaced tokens."""
    writer = Writer()
    writer.queue.send(token(0))
    await writer.sent(1)
    for plan_id in ("a", "b"):
        writer.queue.send(protocol.Accept(plan_id=plan_id, attempt=1))
        await asyncio.sleep(0)  # the plan's task starts in the next turn and ends at once
        writer.queue.send(protocol.Event(plan_id=plan_id, kind="echo", data=1, attempt=1))
        writer.queue.send(protocol.Done(plan_id=plan_id, attempt=1, outcome="succeeded"))
        await writer.sent(len(writer.wire.frames) + 1)
        assert [type(m).__name__ for m in writer.wire.frames[-1]] == ["Accept", "Event", "Done"]
    await writer.close()
    assert len(writer.wire.frames) == 3


async def test_a_burst_of_tokens_after_the_first_is_coalesced() -> None:
    """Tokens one per loop turn: the first goes alone, the turn after it shows a burst, the rest share frames."""
    writer = Writer()
    tokens = [token(n) for n in range(4 * COALESCE_TURNS)]
    for msg in tokens:
        writer.queue.send(msg)
        await asyncio.sleep(0)
    await writer.close()
    frames = writer.wire.frames
    assert frames[0] == [tokens[0]] and [m for frame in frames for m in frame] == tokens
    assert len(frames) <= 5  # 16 tokens; one frame each were 16


async def test_a_failed_send_puts_its_messages_back_in_front() -> None:
    """The frame that could not be sent goes back to the queue, in order, and the writer raises."""
    writer = Writer()
    writer.wire.broken = True
    msgs = [protocol.Accept(plan_id="p", attempt=1), token(0)]
    for msg in msgs:
        writer.queue.send(msg)
    with pytest.raises(ConnectionResetError):
        await asyncio.wait_for(writer.task, 5)
    assert writer.queue.outbox.take(10) == msgs


# ---------------------------------------------------------------- written at once (write_frames' write_now)


async def test_a_spaced_token_is_written_by_its_sender_in_its_own_step() -> None:
    """With write_now, a token sent while the writer idles is on the wire when send returns: no writer wake-up."""
    writer = Writer(write_now=True)
    await asyncio.sleep(0)  # the writer starts and waits
    for n in range(3):  # spaced: a loop turn with nothing between them
        msg = token(n)
        writer.queue.send(msg)
        assert writer.wire.written_now[-1] == [msg] and not writer.queue.outbox
        await asyncio.sleep(0)
        await asyncio.sleep(0)
    assert writer.queue.outbox.unacked == 3  # kept until the coordinator acks them, as the writer's
    await writer.close()
    assert len(writer.wire.frames) == 3


async def test_after_a_token_written_at_once_a_burst_is_queued_and_coalesced() -> None:
    """Tokens that follow one written at once in the same turn wait for the writer, which sends them as one frame;
    once a turn passes with nothing, the next one is written at once again."""
    writer = Writer(write_now=True)
    await asyncio.sleep(0)
    burst = [token(n) for n in range(5)]
    for msg in burst:
        writer.queue.send(msg)
    assert writer.wire.written_now == [[burst[0]]]
    await writer.sent(2)
    assert writer.wire.frames == [[burst[0]], burst[1:]]
    for _ in range(COALESCE_TURNS + 2):
        await asyncio.sleep(0)
    late = token(9)
    writer.queue.send(late)
    assert writer.wire.written_now[-1] == [late]
    await writer.close()


async def test_a_plan_that_ended_in_one_turn_leaves_as_one_frame_at_the_turns_end() -> None:
    """accept, event and done queued in one turn to an idle writer: one frame, written by the turn's flush (no writer
    wake-up, no coalescing turns)."""
    writer = Writer(write_now=True)
    await asyncio.sleep(0)
    writer.queue.send(protocol.Accept(plan_id="a", attempt=1))
    writer.queue.send(protocol.Event(plan_id="a", kind="echo", data=1, attempt=1))
    writer.queue.send(protocol.Done(plan_id="a", attempt=1, outcome="succeeded"))
    await asyncio.sleep(0)  # one loop turn: the flush's
    assert [[type(m).__name__ for m in frame] for frame in writer.wire.written_now] == [["Accept", "Event", "Done"]]
    writer.queue.send(protocol.Accept(plan_id="b", attempt=1))  # parked again: the next plan is flushed the same way
    writer.queue.send(protocol.Done(plan_id="b", attempt=1, outcome="succeeded"))
    await asyncio.sleep(0)
    assert [m.seq for m in writer.wire.written_now[1]] == [4, 5] and len(writer.wire.frames) == 2
    await writer.close()


async def test_a_plan_still_running_is_coalesced_by_the_writer() -> None:
    """An accept alone at the turn's end (the plan runs on): the writer is woken and waits for its events and done."""
    writer = Writer(write_now=True)
    await asyncio.sleep(0)
    writer.queue.send(protocol.Accept(plan_id="a", attempt=1))
    await asyncio.sleep(0)  # the flush: not a done, the writer is woken
    writer.queue.send(protocol.Event(plan_id="a", kind="echo", data=1, attempt=1))
    writer.queue.send(protocol.Done(plan_id="a", attempt=1, outcome="succeeded"))
    await writer.sent(1)
    assert writer.wire.written_now == []
    assert [type(m).__name__ for m in writer.wire.frames[0]] == ["Accept", "Event", "Done"]
    await writer.close()


async def test_a_burst_of_ended_plans_is_coalesced_by_the_writer() -> None:
    """More messages than a lone plan's at the turn's end (a frame of assigns, all ended): the writer sends them,
    with what the next turns add, not the flush."""
    writer = Writer(write_now=True)
    await asyncio.sleep(0)
    for plan_id in "abcde":
        writer.queue.send(protocol.Accept(plan_id=plan_id, attempt=1))
        writer.queue.send(protocol.Done(plan_id=plan_id, attempt=1, outcome="succeeded"))
    await asyncio.sleep(0)  # the flush: too many, the writer is woken
    writer.queue.send(protocol.Accept(plan_id="f", attempt=1))
    writer.queue.send(protocol.Done(plan_id="f", attempt=1, outcome="succeeded"))
    await writer.sent(1)
    assert writer.wire.written_now == [] and len(writer.wire.frames[0]) == 12
    await writer.close()


async def test_a_flush_the_connection_cannot_take_goes_through_the_writer() -> None:
    """A finished plan's messages when the connection would make a sender wait: nothing written at once, the writer
    sends them."""
    writer = Writer(write_now=True)
    await asyncio.sleep(0)
    writer.wire.full = True
    writer.queue.send(protocol.Accept(plan_id="a", attempt=1))
    writer.queue.send(protocol.Done(plan_id="a", attempt=1, outcome="succeeded"))
    await writer.sent(1)
    assert writer.wire.written_now == []
    assert [type(m).__name__ for m in writer.wire.frames[0]] == ["Accept", "Done"]
    await writer.close()


async def test_a_token_the_connection_cannot_take_now_is_queued_for_the_writer() -> None:
    """write_now refusing (the buffer over its high-water mark) leaves the token to the writer's send, which waits."""
    writer = Writer(write_now=True)
    await asyncio.sleep(0)
    writer.wire.full = True
    msg = token(0)
    writer.queue.send(msg)
    assert writer.wire.written_now == [] and len(writer.queue.outbox) == 1
    await writer.sent(1)
    assert writer.wire.frames == [[msg]] and writer.wire.written_now == []
    await writer.close()
