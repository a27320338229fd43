"""The rules of an upload (an input's bytes into a worker's spool), for both of its ends (docs/PROTOCOL.md §11).

The receiver's rules are the worker's, whichever path the bytes take: its HTTP endpoint
(worker_agent/dataplane.py: a ``PUT`` per run of bytes) and its relay end (worker_agent/relay.py:
``data_open``, then ``data_chunk`` s) both hold the same spool entry and ask the same questions
of it. The sender's rules are the SDK's (fleetwire/direct.py, fleetwire/relay.py).

Rules (the receiver):

* An input is declared with its size and digest; its bytes arrive in order from the
  acknowledged offset (``received``), possibly over several connections (a resume), one
  connection at a time (``busy``).
* :func:`check_put` answers a ``PUT`` of ``length`` bytes from ``offset`` from its head alone,
  before any body byte is read: the declared size (``SIZE``), a failed input (``FAILED`` or
  ``DISK_FULL``), an input already whole (an empty ``PUT`` is ``VERIFIED``, bytes are ``WHOLE``),
  another connection at it (``BUSY``), another offset (``OFFSET``), bytes past the size (``OVER``);
  None: take the body.
* :func:`check_open` does the same for a relayed open, and :class:`Receiver` checks each relayed
  chunk (it must start where the last one ended, within the size) and says when to credit: once
  per ``every`` bytes stored (a quarter window, protocol/relay.py ``credit_every``), not per chunk.
* Once the last byte is stored the entry checks its digest; :func:`settled` says what that
  means: ``VERIFIED``, ``RESTART`` (a mismatch taken for damage in transit: its bytes were dropped,
  send it again from 0) or the input's failure.

Rules (the sender): :class:`Window` says how much may be sent against the receiver's credit;
protocol/transfer/retries.py how often a transfer is tried again.

No I/O: the entry's facts come in (:class:`InputFacts`), verdicts (protocol/transfer/verdicts.py)
go out; the drivers store the bytes and speak HTTP or relay messages.
"""

from __future__ import annotations

from typing import Protocol

from protocol.messages import ErrorInfo
from protocol.relay import MAX_CHUNK_BYTES
from protocol.transfer.verdicts import (
    BUSY,
    OFFSET,
    OVER,
    SIZE,
    VERIFIED,
    WHOLE,
    Answer,
    failed,
)
from protocol.transfer.verdicts import RESTART as RESTARTED

__all__ = ["InputFacts", "Receiver", "Window", "check_open", "check_put", "complete", "next_length", "settled"]


class InputFacts(Protocol):
    """What the rules read of an input as it arrives (worker_agent/spool_files.py ``InputFile``)."""

    @property
    def name(self) -> str: ...
    @property
    def size(self) -> int: ...
    @property
    def received(self) -> int:
        """The acknowledged offset: bytes stored and hashed."""
        ...
    @property
    def state(self) -> str:
        """``receiving``, ``verified`` or ``failed``."""
        ...
    @property
    def busy(self) -> bool:
        """A connection (or a relayed store) is writing it now."""
        ...
    @property
    def mismatch(self) -> str:
        """The last digest mismatch, while the input is sent again."""
        ...
    @property
    def error(self) -> ErrorInfo | None: ...


def _failure(entry: InputFacts) -> Answer:
    error = entry.error
    if error is None:
        return Answer(failed(""), "input failed", entry.received)
    return Answer(failed(error.code), error.message, entry.received, error.code)


def check_put(entry: InputFacts, offset: int, length: int, total: int) -> Answer | None:
    """A ``PUT`` of ``length`` bytes from ``offset`` of an input of ``total`` bytes, from its head: None to take
    the body, else the answer (a refusal, or ``VERIFIED`` for an empty ``PUT`` of an input already whole)."""
    name, at = entry.name, entry.received
    if total != entry.size:
        return Answer(SIZE, f"input {name!r} is declared {entry.size} bytes, not {total}", at)
    if entry.state == "failed":
        return _failure(entry)
    if entry.state == "verified":
        if length == 0 and offset <= entry.size:
            return Answer(VERIFIED, "", at)
        return Answer(WHOLE, f"input {name!r} already arrived whole", at)
    if entry.busy:
        return Answer(BUSY, f"input {name!r} is being uploaded on another connection", at)
    if offset != at:
        return Answer(OFFSET, f"input {name!r} continues at offset {at}, not {offset}", at)
    if offset + length > entry.size:
        return Answer(OVER, f"input {name!r}: {offset + length} bytes is over its declared {entry.size}", at)
    return None


def settled(entry: InputFacts) -> Answer:
    """What an input that is not receiving (or was, before its last byte was checked) comes to."""
    if entry.state == "receiving":  # its digest did not match: its bytes were dropped; it is sent again from 0
        return Answer(RESTARTED, entry.mismatch, entry.received)
    if entry.state == "verified" or entry.error is None:
        return Answer(VERIFIED, "", entry.received)
    return _failure(entry)


def complete(entry: InputFacts) -> bool:
    """Whether every declared byte is stored (the entry then checks its digest: ``finish``)."""
    return entry.received >= entry.size


def check_open(entry: InputFacts) -> Answer | None:
    """A relayed open of an input (an empty one already finished): None to credit it from ``received``."""
    if entry.state != "receiving":
        return settled(entry)
    if entry.busy:
        return Answer(BUSY, f"input {entry.name!r} is being uploaded on another connection (or its last relayed "
                      "chunks are still being stored); open it again", entry.received)
    return None


class Receiver:
    """One relayed upload's chunks: where the next must start, and when to credit what was stored.

    Args:
        every: bytes between two credits (``credit_every`` of the stream's window).
        received: the entry's acknowledged offset at the open (the first credit).
    """

    __slots__ = ("credited", "every", "expected")

    def __init__(self, every: int, received: int) -> None:
        self.every = every
        self.credited = received  # the offset last credited
        self.expected = received  # where the next chunk must start: what is stored plus what is queued

    def chunk(self, entry: InputFacts, offset: int, length: int, *, storing: bool) -> Answer | None:
        """A chunk of ``length`` bytes at ``offset``: None to store it (``expected`` moves past it), else the end.

        ``storing``: this upload's own store is writing the entry (so ``busy`` is not another's).
        """
        if entry.state != "receiving":
            return settled(entry)
        if entry.busy and not storing:
            return Answer(BUSY, f"input {entry.name!r} is being uploaded on a direct connection", entry.received)
        if offset != self.expected or self.expected + length > entry.size:
            why = f"input {entry.name!r}: a chunk at {offset}..{offset + length}; it continues at {self.expected}"
            return Answer(OFFSET, f"{why} and is {entry.size} bytes", entry.received)
        self.expected += length
        return None

    def stored(self, entry: InputFacts) -> int | None:
        """Bytes were stored: the offset to credit now (once per ``every`` bytes, not per chunk), else None."""
        if entry.received < entry.size and entry.received - self.credited >= self.every:
            self.credited = entry.received
            return entry.received
        return None

    def batch(self, entry: InputFacts) -> int:
        """How many queued bytes to store at once: those up to the next credit (at least one chunk)."""
        return max(self.every - (entry.received - self.credited), 1)


def next_length(sent: int, acked: int, window: int, size: int) -> int:
    """The length of the chunk from ``sent`` that may go now with ``acked`` credited of ``window``; 0: none."""
    length = min(MAX_CHUNK_BYTES, size - sent)
    if sent >= size or sent - acked + length > window:
        return 0
    return length


class Window:
    """What a sender may have in flight against its receiver's credit (relayed uploads and downloads alike).

    A chunk of at most :data:`~protocol.relay.MAX_CHUNK_BYTES` goes only when the whole of it fits
    in ``window - (sent - acked)``; a credit moves ``acked`` forward, never back, never past ``sent``.
    """

    __slots__ = ("acked", "size", "window")

    def __init__(self, size: int, acked: int, window: int) -> None:
        self.size = size
        self.acked = acked
        self.window = window

    def next_length(self, sent: int) -> int:
        """The length of the chunk from ``sent`` that may go now; 0: none (all sent, or wait for credit)."""
        return next_length(sent, self.acked, self.window, self.size)

    def credit(self, offset: int, sent: int) -> bool:
        """A credit up to ``offset``: whether it is one (within what was sent, not behind the last)."""
        if self.acked <= offset <= sent:
            self.acked = offset
            return True
        return False
