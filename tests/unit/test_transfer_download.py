"""A download's rules (protocol/transfer/download.py) driven directly: offsets in, chunk lengths and credits out."""

from __future__ import annotations

from protocol.relay import MAX_CHUNK_BYTES, VIOLATION, credit_every
from protocol.transfer import download, verdicts

READ_AHEAD = 8 * MAX_CHUNK_BYTES


def _send_all(sender: download.Sender, until: int) -> list[int]:
    """The chunk lengths the sender lets go now (each sent at once)."""
    lengths = []
    while (length := sender.next_length(until)) is not None:
        lengths.append(length)
        if sender.sent_chunk(length):
            break
    return lengths


def test_an_offset_past_the_output_is_unsatisfiable() -> None:
    """Relayed: offset > size ends the stream relay_violation; the size itself is fine (one empty last chunk)."""
    answer = download.check_offset(11, 10)
    assert answer is not None and (answer.verdict, answer.end_code) == (verdicts.UNSATISFIABLE, VIOLATION)
    assert "offset 11 is past the output's 10 bytes" in answer.message
    assert download.check_offset(10, 10) is None


def test_chunks_go_within_the_window_then_wait_for_credit() -> None:
    """A window of four chunks: four go, the fifth waits for a credit, which lets one more go per chunk credited."""
    sender = download.Sender(10 * MAX_CHUNK_BYTES, 0, 4 * MAX_CHUNK_BYTES)
    assert _send_all(sender, READ_AHEAD) == [MAX_CHUNK_BYTES] * 4
    assert sender.credit(MAX_CHUNK_BYTES)
    assert _send_all(sender, READ_AHEAD) == [MAX_CHUNK_BYTES]
    assert not sender.credit(0)  # behind the last credit
    assert not sender.credit(6 * MAX_CHUNK_BYTES)  # past what was sent


def test_the_read_ahead_bounds_what_is_queued_at_once() -> None:
    """However wide the window, no chunk starts at or past ``until`` (the driver's read-ahead)."""
    sender = download.Sender(100 * MAX_CHUNK_BYTES, 0, 64 * MAX_CHUNK_BYTES)
    assert len(_send_all(sender, 2 * MAX_CHUNK_BYTES)) == 2


def test_the_last_chunk_is_shorter_and_marked() -> None:
    """An output of 2.5 chunks: two whole chunks and a half one, the last; then nothing more."""
    sender = download.Sender(5 * MAX_CHUNK_BYTES // 2, 0, 64 * MAX_CHUNK_BYTES)
    assert _send_all(sender, READ_AHEAD) == [MAX_CHUNK_BYTES, MAX_CHUNK_BYTES, MAX_CHUNK_BYTES // 2]
    assert sender.finished and sender.next_length(READ_AHEAD) is None
    assert sender.whole


def test_an_empty_output_or_a_download_from_its_end_is_one_empty_last_chunk() -> None:
    """Size 0 (or offset == size): a single chunk of 0 bytes, marked last; not whole when it started past 0."""
    empty = download.Sender(0, 0, MAX_CHUNK_BYTES)
    assert _send_all(empty, READ_AHEAD) == [0] and empty.finished
    tail = download.Sender(10, 10, MAX_CHUNK_BYTES)
    assert _send_all(tail, READ_AHEAD) == [0] and not tail.whole


def test_a_window_narrower_than_a_chunk_still_sends_one_chunk() -> None:
    """The window is at least one chunk, so a sender never waits for a credit that cannot come."""
    sender = download.Sender(3 * MAX_CHUNK_BYTES, 0, 1)
    assert _send_all(sender, READ_AHEAD) == [MAX_CHUNK_BYTES]


def test_the_receiver_takes_chunks_in_order_and_credits_each_quarter_window() -> None:
    """A chunk at another offset is named; credits go each credit_every(window) bytes taken."""
    window = 16 * MAX_CHUNK_BYTES
    receiver = download.Receiver(0)
    assert receiver.chunk(MAX_CHUNK_BYTES, 10) == f"a chunk at {MAX_CHUNK_BYTES}, expected 0"
    credits = []
    for offset in range(0, window, MAX_CHUNK_BYTES):
        assert receiver.chunk(offset, MAX_CHUNK_BYTES) is None
        credits.append(receiver.credit(window))
    every = credit_every(window)
    assert [c for c in credits if c is not None] == [every, 2 * every, 3 * every, 4 * every]


def test_a_resumed_receiver_counts_from_its_offset() -> None:
    """Opened again from byte N: the next chunk must be at N, and credits count from there."""
    receiver = download.Receiver(5 * MAX_CHUNK_BYTES)
    assert receiver.chunk(0, MAX_CHUNK_BYTES) is not None
    assert receiver.chunk(5 * MAX_CHUNK_BYTES, MAX_CHUNK_BYTES) is None
    assert receiver.credit(4 * MAX_CHUNK_BYTES) == 6 * MAX_CHUNK_BYTES  # credit_every(4 chunks) is one chunk
