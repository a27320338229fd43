"""The relay's shares of its memory (issue #24 part 4, the relay hog) and its stream ids (issue #25 part 12), in the
core with a fake clock (coordinator/relay.py)."""

from __future__ import annotations

from typing import Any

from coordinator.relay import MAX_STREAMS_PER_SESSION
from protocol.messages import Cancel, DataChunk, DataCredit, DataEnd, DataOpen, Done, ErrorInfo
from protocol.relay import BUSY, CLOSED, DEFAULT_IDLE_S, DEFAULT_WINDOW_BYTES, MAX_CHUNK_BYTES, VIOLATION
from tests.unit.test_core import Harness
from tests.unit.test_relay_core import CHUNK, WINDOW, chunk, only_of, placed

SIZE = 8 * MAX_CHUNK_BYTES


def accept(h: Harness, client: int, worker: int, plan_id: str, stream: int = 0) -> DataCredit:
    """The client opens input ``x`` of ``plan_id``; its worker accepts the ticket; what the client is told."""
    h.send(client, DataOpen(plan_id=plan_id, attempt=1, name="x", ticket="t", stream=stream))
    opened = only_of(h.take(worker), DataOpen)
    h.send(worker, DataCredit(plan_id=plan_id, attempt=1, name="x", offset=0, size=SIZE, stream=opened.stream))
    return only_of(h.take(client), DataCredit)  # type: ignore[no-any-return]


def plans(h: Harness, client: int, n: int, prefix: str) -> list[tuple[int, str]]:
    return [placed(h, f"{prefix}{i}", client) for i in range(n)]


def test_a_hog_that_opens_streams_and_never_sends_holds_only_its_sessions_share() -> None:
    """Four accepted puts of one session that never send: one holds a window, three wait; another principal's
    upload gets its whole window at once (the probe's hog filled the 64 MiB relay and others got relay_busy)."""
    h = Harness()  # the defaults: 16 MiB windows, 64 MiB in all
    hog = h.client("mallory")
    held = [accept(h, hog, worker, plan_id) for worker, plan_id in plans(h, hog, 4, "h")]
    assert [c.credit for c in held] == [DEFAULT_WINDOW_BYTES, 0, 0, 0]
    assert all("--relay-session-bytes" in c.wait for c in held[1:])
    legit = h.client("alice")
    [(worker, plan_id)] = plans(h, legit, 1, "l")
    credit = accept(h, legit, worker, plan_id)
    assert (credit.credit, credit.wait) == (DEFAULT_WINDOW_BYTES, "")
    relay = h.core.relay
    assert relay.reserved == 2 * DEFAULT_WINDOW_BYTES and relay.waiting == 3


def test_one_principal_holds_at_most_its_share_across_sessions() -> None:
    """A principal's sessions together hold at most --relay-principal-bytes; another principal still gets room."""
    h = Harness(relay_window_bytes=WINDOW, relay_max_bytes=8 * WINDOW, relay_principal_bytes=2 * WINDOW,
                relay_session_bytes=WINDOW)
    sessions = [h.client("mallory") for _ in range(3)]
    credits = [accept(h, s, worker, plan_id) for s in sessions for worker, plan_id in plans(h, s, 1, f"m{s}-")]
    assert [c.credit for c in credits] == [WINDOW, WINDOW, 0]
    assert "principal 'mallory'" in credits[2].wait and "--relay-principal-bytes" in credits[2].wait
    alice = h.client("alice")
    [(worker, plan_id)] = plans(h, alice, 1, "a")
    assert accept(h, alice, worker, plan_id).credit == WINDOW


def test_a_refused_ticket_never_holds_a_window() -> None:
    """The worker refuses the ticket: the stream ends and no window was held meanwhile."""
    h = Harness(relay_window_bytes=WINDOW)
    client = h.client()
    worker, plan_id = placed(h, "w1", client)
    h.send(client, DataOpen(plan_id=plan_id, attempt=1, name="x", ticket="forged"))
    h.take(worker)
    assert h.core.relay.reserved == 0
    h.send(worker, DataEnd(plan_id=plan_id, attempt=1, name="x", code="unauthorized", message="bad signature"))
    assert only_of(h.take(client), DataEnd).code == "unauthorized"
    assert h.core.relay.streams == {} and h.core.relay.reserved == 0


def test_an_idle_window_goes_back_and_the_next_in_line_gets_it() -> None:
    """No byte moved for relay_idle_s: the stream ends relay_closed to both parties, the waiting stream holds it."""
    h = Harness(relay_window_bytes=WINDOW, relay_session_bytes=WINDOW, relay_idle_s=5.0)
    hog = h.client("mallory")
    (w1, p1), (w2, p2) = plans(h, hog, 2, "w")
    assert accept(h, hog, w1, p1).credit == WINDOW
    assert accept(h, hog, w2, p2).credit == 0
    h.tick(1.0)
    h.tick(5.9)  # quiet since the tick at 1.0: not yet
    assert h.core.relay.waiting == 1 and not h.take(hog)
    h.tick(6.0)
    msgs = h.take(hog)
    end = only_of(msgs, DataEnd)
    assert (end.plan_id, end.code) == (p1, CLOSED) and "--relay-idle" in end.message
    assert only_of(h.take(w1), DataEnd).code == CLOSED
    credit = only_of(msgs, DataCredit)
    assert (credit.plan_id, credit.credit) == (p2, WINDOW)
    assert h.core.relay.idle_ends == 1 and h.core.relay.waiting == 0 and h.core.relay.reserved == WINDOW


def test_a_stream_that_moves_is_never_idle_and_a_waiting_one_never_expires() -> None:
    """Chunks and credits between ticks keep a window; a stream waiting in line is not judged idle."""
    h = Harness(relay_window_bytes=WINDOW, relay_session_bytes=WINDOW, relay_idle_s=5.0)
    client = h.client()
    (w1, p1), (w2, p2) = plans(h, client, 2, "w")
    accept(h, client, w1, p1)
    accept(h, client, w2, p2)
    offset = 0
    for second in range(30):
        h.tick(float(second))
        if second % 4 == 0:  # a chunk every 4 s, each credited: nothing is ever still for the 5 s
            h.send(client, chunk(p1, offset))
            offset += MAX_CHUNK_BYTES
            h.send(w1, DataCredit(plan_id=p1, attempt=1, name="x", offset=offset))
    assert not [m for m in h.take(client) if isinstance(m, DataEnd)]
    assert h.core.relay.waiting == 1 and h.core.relay.idle_ends == 0


def test_a_cancelled_plan_gives_its_window_back_at_once() -> None:
    """The hog cancels its plan: its stream ends (no tick needed) and the next stream in line holds the window."""
    h = Harness(relay_window_bytes=WINDOW, relay_session_bytes=WINDOW)
    client = h.client()
    (w1, p1), (w2, p2) = plans(h, client, 2, "w")
    accept(h, client, w1, p1)
    assert accept(h, client, w2, p2).wait
    h.send(client, Cancel(plan_id=p1, req_id=99))
    msgs = h.take(client)
    assert only_of(msgs, DataEnd).plan_id == p1
    credit = only_of(msgs, DataCredit)
    assert (credit.plan_id, credit.credit) == (p2, WINDOW)
    assert only_of([m for m in h.take(w1) if isinstance(m, DataEnd)], DataEnd).code == CLOSED


def test_a_requeued_plan_gives_its_window_back_at_once() -> None:
    """A failed attempt retried (the plan back in the queue): its input's stream ends and frees its window."""
    h = Harness(relay_window_bytes=WINDOW)
    client = h.client()
    worker, plan_id = placed(h, "w1", client, retries=1)
    accept(h, client, worker, plan_id)
    assert h.core.relay.reserved == WINDOW
    h.send(worker, Done(plan_id=plan_id, attempt=1, outcome="failed", error=ErrorInfo("boom", "it broke")))
    end = only_of(h.take(client), DataEnd)
    assert end.code == CLOSED and "moved on from attempt 1" in end.message
    assert h.core.relay.streams == {} and h.core.relay.reserved == 0


def test_a_forgotten_plans_stream_goes_at_the_next_tick() -> None:
    """An output's stream outlives its plan's end, not its plan: once retention forgot the plan, a tick ends it."""
    h = Harness(relay_window_bytes=WINDOW, plan_retention_s=60.0)
    client = h.client()
    worker, plan_id = placed(h, "w1", client, outputs=["out"])
    h.send(worker, Done(plan_id=plan_id, attempt=1, outcome="succeeded"))
    h.send(client, DataOpen(plan_id=plan_id, attempt=1, name="out", direction="get"))
    assert only_of(h.take(worker), DataOpen).direction == "get"
    h.take(client)
    h.tick(30.0)
    assert h.core.relay.reserved == WINDOW
    h.tick(100.0)
    assert plan_id not in h.core.plans
    end = only_of(h.take(client), DataEnd)
    assert end.code == CLOSED and "forgotten" in end.message
    assert only_of(h.take(worker), DataEnd).code == CLOSED
    assert h.core.relay.reserved == 0


def test_a_waiting_get_is_passed_to_its_worker_only_once_it_holds_a_window() -> None:
    """A get with no room waits before its worker sees it (the worker would send at once); then it is passed on."""
    h = Harness(relay_window_bytes=WINDOW, relay_session_bytes=WINDOW)
    client = h.client()
    w1, p1 = placed(h, "w1", client)
    w2, p2 = placed(h, "w2", client, outputs=["out"])
    accept(h, client, w1, p1)
    h.send(client, DataOpen(plan_id=p2, attempt=1, name="out", direction="get", stream=7))
    wait = only_of(h.take(client), DataCredit)
    assert (wait.credit, wait.stream) == (0, 7) and wait.wait
    assert not h.take(w2)
    h.send(client, DataEnd(plan_id=p1, attempt=1, name="x", code="cancelled"))
    opened = only_of(h.take(w2), DataOpen)
    assert (opened.direction, opened.credit, opened.stream) == ("get", WINDOW, 7)
    assert only_of(h.take(client), DataCredit).credit == WINDOW


def test_a_session_opens_at_most_so_many_streams() -> None:
    """Past MAX_STREAMS_PER_SESSION streams open or waiting, another open is refused relay_busy, naming the limit."""
    h = Harness(relay_window_bytes=WINDOW, relay_max_bytes=1 << 30)  # room for all: the count is what refuses
    client = h.client()
    _, plan_id = placed(h, "w1", client, outputs=[f"o{i}" for i in range(MAX_STREAMS_PER_SESSION + 1)])
    for i in range(MAX_STREAMS_PER_SESSION):
        h.send(client, DataOpen(plan_id=plan_id, attempt=1, name=f"o{i}", direction="get"))
    h.take(client)
    h.send(client, DataOpen(plan_id=plan_id, attempt=1, name=f"o{MAX_STREAMS_PER_SESSION}", direction="get"))
    end = only_of(h.take(client), DataEnd)
    assert end.code == BUSY and str(MAX_STREAMS_PER_SESSION) in end.message


# ---------------------------------------------------------------------------- stream ids (issue #25 part 12)


def test_every_message_of_a_stream_names_its_id() -> None:
    """The id a client gives in data_open is on the worker's open, and on every credit, chunk and end it gets."""
    h = Harness(relay_window_bytes=WINDOW)
    client = h.client()
    worker, plan_id = placed(h, "w1", client)
    assert accept(h, client, worker, plan_id, stream=41).stream == 41
    h.send(client, chunk(plan_id, 0, stream=41))
    assert only_of(h.take(worker), DataChunk).stream == 41
    h.send(worker, DataCredit(plan_id=plan_id, attempt=1, name="x", offset=MAX_CHUNK_BYTES))  # a worker that gives none
    assert only_of(h.take(client), DataCredit).stream == 41
    h.close(worker)
    assert only_of(h.take(client), DataEnd).stream == 41


def test_a_late_message_of_an_older_stream_is_dropped() -> None:
    """Reopened at once: the old stream's late data_end and chunks are dropped, the new stream goes on."""
    h = Harness(relay_window_bytes=WINDOW)
    client = h.client()
    worker, plan_id = placed(h, "w1", client, outputs=["out"])
    h.send(client, DataOpen(plan_id=plan_id, attempt=1, name="out", direction="get", stream=1))
    h.send(worker, DataChunk(plan_id=plan_id, attempt=1, name="out", offset=0, data=CHUNK, direction="get",
                             size=SIZE, stream=1))
    h.take(client)
    h.take(worker)
    h.send(client, DataOpen(plan_id=plan_id, attempt=1, name="out", direction="get", offset=MAX_CHUNK_BYTES, stream=2))
    assert only_of(h.take(worker), DataOpen).stream == 2
    h.take(client)
    late: list[Any] = [
        DataChunk(plan_id=plan_id, attempt=1, name="out", offset=MAX_CHUNK_BYTES, data=CHUNK, direction="get",
                  size=SIZE, stream=1),
        DataEnd(plan_id=plan_id, attempt=1, name="out", direction="get", code=CLOSED, message="old", stream=1),
    ]
    for msg in late:
        h.send(worker, msg)
    assert not h.take(client) and h.core.relay.stale == 2
    h.send(worker, DataChunk(plan_id=plan_id, attempt=1, name="out", offset=MAX_CHUNK_BYTES, data=CHUNK,
                             direction="get", size=SIZE, stream=2))
    got = only_of(h.take(client), DataChunk)
    assert (got.offset, got.stream) == (MAX_CHUNK_BYTES, 2)
    assert not [m for m in h.take(worker) if isinstance(m, DataEnd) and m.code == VIOLATION]


def test_defaults_are_the_documented_ones() -> None:
    """The idle timeout and the shares' defaults: 10 s, half and a quarter of --relay-max-bytes."""
    relay = Harness().core.relay
    assert relay.idle_s == DEFAULT_IDLE_S == 10.0
    assert (relay.principal_bytes, relay.session_bytes) == (relay.max_bytes // 2, relay.max_bytes // 4)
