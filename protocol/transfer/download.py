"""The rules of a download (an output's bytes from a worker's spool), for both of its ends (docs/PROTOCOL.md §11).

Rules:

* An output is whole on the worker when it is offered: its size and digest are known. A
  download starts at an offset within it (``Range: bytes=N-`` on the HTTP path, protocol/transfer/ranges.py;
  ``data_open.offset`` relayed, where an offset past the size is ``UNSATISFIABLE``: :func:`check_offset`).
* Relayed, the worker (:class:`Sender`) sends chunks of at most
  :data:`~protocol.relay.MAX_CHUNK_BYTES` while the client's credit allows
  (protocol/transfer/upload.py :class:`~protocol.transfer.upload.Window`), and no further ahead of
  what its writer has sent than the driver's read-ahead; the last chunk is marked ``last`` (an empty
  output, or a download from its end, is one empty last chunk). A download from byte 0 to the end
  is ``whole``: the worker keeps the output only a short grace more (worker_agent/spool.py ``fetched``).
* The client (:class:`Receiver`) takes chunks in order (a chunk at another offset is an error,
  400) and credits what it took once per quarter window (protocol/relay.py ``credit_every``).
* A digest that does not match what the worker reported is fetched again from 0
  (protocol/transfer/retries.py ``MISMATCH_RETRIES``).

No I/O: offsets in, lengths and verdicts out.
"""

from __future__ import annotations

from protocol.relay import MAX_CHUNK_BYTES, credit_every
from protocol.transfer.upload import Window
from protocol.transfer.verdicts import UNSATISFIABLE, Answer

__all__ = ["Receiver", "Sender", "check_offset"]


def check_offset(offset: int, size: int) -> Answer | None:
    """A relayed download from ``offset`` of an output of ``size`` bytes: None, or ``UNSATISFIABLE``."""
    if offset > size:
        return Answer(UNSATISFIABLE, f"offset {offset} is past the output's {size} bytes")
    return None


class Sender:
    """The worker's side of one relayed download: which chunk may go next, and which credits count.

    Args:
        size: the output's size.
        start: the offset asked for.
        window: the stream's credit (at least one chunk).
    """

    __slots__ = ("finished", "sent", "start", "window")

    def __init__(self, size: int, start: int, window: int) -> None:
        self.start = start
        self.sent = start
        self.finished = False  # the last chunk went
        self.window = Window(size, start, max(window, MAX_CHUNK_BYTES))

    @property
    def size(self) -> int:
        return self.window.size

    @property
    def whole(self) -> bool:
        """Whether this download is of the whole output (from byte 0)."""
        return self.start == 0

    def next_length(self, until: int) -> int | None:
        """The length of the chunk that may be read and sent now (0: the one empty last chunk); None: wait.

        ``until``: the offset the driver reads ahead to (more once its writer has sent what was queued).
        """
        if self.finished:
            return None
        length = min(MAX_CHUNK_BYTES, self.size - self.sent)
        if self.sent - self.window.acked + length > self.window.window or self.sent >= until:
            return None
        return length

    def sent_chunk(self, length: int) -> bool:
        """A chunk of ``length`` went: whether it was the last."""
        self.sent += length
        self.finished = self.sent >= self.size
        return self.finished

    def credit(self, offset: int) -> bool:
        """The client took the bytes up to ``offset``: whether that is a credit (within what was sent)."""
        return self.window.credit(offset, self.sent)


class Receiver:
    """The client's side of one open of a relayed download: chunks in order, and when to credit them.

    Args:
        received: the offset the open asked for (bytes already received).
    """

    __slots__ = ("credited", "received")

    def __init__(self, received: int) -> None:
        self.received = received
        self.credited = received

    def chunk(self, offset: int, length: int) -> str | None:
        """A chunk of ``length`` bytes at ``offset``: None when it is the next one (taken), else what is wrong."""
        if offset != self.received:
            return f"a chunk at {offset}, expected {self.received}"
        self.received += length
        return None

    def credit(self, window: int) -> int | None:
        """The offset to credit now (once per quarter of the stream's ``window``), else None."""
        if self.received - self.credited >= credit_every(window):
            self.credited = self.received
            return self.received
        return None
