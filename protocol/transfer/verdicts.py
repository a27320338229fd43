"""What a transfer's receiver or sender decided, and how each path says it: one table (docs/PROTOCOL.md §11).

The worker's HTTP endpoint answers a verdict with its HTTP ``status``; its relay end sends it as
a ``data_end`` (or a ``data_credit``) with its ``code``. The SDK reads a relayed ``data_end``
back into the status the direct path would have answered (:data:`END_STATUS`), so a caller sees
the same :class:`~fleetwire.data.DataTransferError` status whichever path moved the bytes.

=================  ======  =================  ==================================================
verdict            HTTP    data_end code      when
=================  ======  =================  ==================================================
``VERIFIED``       201     ""                 the input is whole and its digest matched
``PART``           204     (a credit)         bytes were stored; more are to come
``RESTART``        409     relay_closed       the digest did not match: its bytes were dropped, send it from 0
``FAILED``         422     (the input's)      the input failed (``input_mismatch``, ``inputs_unavailable``)
``DISK_FULL``      507     worker_disk_full   no room for the input
``BUSY``           409     relay_closed       another connection is writing the input
``WHOLE``          409     ""                 bytes sent for an input that already arrived whole
``OFFSET``         409     relay_violation    bytes from another offset than the acknowledged one
``OVER``           413     relay_violation    bytes past the declared size
``SIZE``           422     relay_violation    a size other than the declared one
``NO_LENGTH``      411     invalid_argument   a ``PUT`` without ``Content-Length``
``BAD_RANGE``      400     relay_violation    a ``Content-Range`` that is not the body's
``UNAUTHORIZED``   401     unauthorized       a ticket that is not one of ours (or expired)
``FORBIDDEN``      403     forbidden          a genuine ticket out of its scope
``GONE``           404     output_gone        the worker no longer holds the output
``UNSATISFIABLE``  416     relay_violation    an offset or range outside the output
``NOT_OPEN``       0       relay_closed       a relayed chunk with no upload open (the attempt ended?)
``DROPPED``        0       relay_closed       the attempt ended while its bytes were stored
=================  ======  =================  ==================================================

No I/O.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final

from protocol import errors, relay

__all__ = [
    "BAD_RANGE",
    "BUSY",
    "DISK_FULL",
    "DROPPED",
    "END_STATUS",
    "FAILED",
    "FORBIDDEN",
    "GONE",
    "NOT_OPEN",
    "NO_LENGTH",
    "OFFSET",
    "OVER",
    "PART",
    "RESTART",
    "SIZE",
    "TABLE",
    "UNAUTHORIZED",
    "UNSATISFIABLE",
    "VERIFIED",
    "WHOLE",
    "Answer",
    "Verdict",
    "failed",
]

# The codes a worker fails an input with (worker_agent/spool_files.py, docs/PROTOCOL.md §Errors).
INPUT_MISMATCH: Final = "input_mismatch"
DISK_FULL_CODE: Final = "worker_disk_full"


@dataclass(frozen=True, slots=True)
class Verdict:
    """One row of the table: its name, the HTTP status (0: not on the HTTP path), the ``data_end`` code."""

    name: str
    status: int
    code: str


VERIFIED: Final = Verdict("verified", 201, "")
PART: Final = Verdict("part", 204, "")
RESTART: Final = Verdict("restart", 409, relay.CLOSED)
FAILED: Final = Verdict("failed", 422, INPUT_MISMATCH)
DISK_FULL: Final = Verdict("disk_full", 507, DISK_FULL_CODE)
BUSY: Final = Verdict("busy", 409, relay.CLOSED)
WHOLE: Final = Verdict("whole", 409, "")
OFFSET: Final = Verdict("offset", 409, relay.VIOLATION)
OVER: Final = Verdict("over", 413, relay.VIOLATION)
SIZE: Final = Verdict("size", 422, relay.VIOLATION)
NO_LENGTH: Final = Verdict("no_length", 411, errors.INVALID_ARGUMENT)
BAD_RANGE: Final = Verdict("bad_range", 400, relay.VIOLATION)
UNAUTHORIZED: Final = Verdict("unauthorized", 401, relay.UNAUTHORIZED)
FORBIDDEN: Final = Verdict("forbidden", 403, relay.REFUSED)
GONE: Final = Verdict("gone", 404, relay.GONE)
UNSATISFIABLE: Final = Verdict("unsatisfiable", 416, relay.VIOLATION)
NOT_OPEN: Final = Verdict("not_open", 0, relay.CLOSED)
DROPPED: Final = Verdict("dropped", 0, relay.CLOSED)

TABLE: Final = (VERIFIED, PART, RESTART, FAILED, DISK_FULL, BUSY, WHOLE, OFFSET, OVER, SIZE, NO_LENGTH, BAD_RANGE,
                UNAUTHORIZED, FORBIDDEN, GONE, UNSATISFIABLE, NOT_OPEN, DROPPED)

#: A relayed ``data_end`` code -> the status the SDK reports it with (the direct path's nearest answer;
#: the relay's own breaks are 503: open it again).
END_STATUS: Final[Mapping[str, int]] = {
    relay.UNAUTHORIZED: 401, relay.REFUSED: 403, errors.PLAN_NOT_FOUND: 404, INPUT_MISMATCH: 422, DISK_FULL_CODE: 507,
    relay.VIOLATION: 400, errors.INVALID_ARGUMENT: 400, relay.CLOSED: 503, relay.BUSY: 503, relay.GONE: 404,
}


def failed(code: str) -> Verdict:
    """The verdict of an input that failed with ``code``: no room is 507, anything else 422."""
    return DISK_FULL if code == DISK_FULL_CODE else FAILED


@dataclass(frozen=True, slots=True)
class Answer:
    """A verdict about one transfer, with what to say: the message, the acknowledged offset, and the
    ``data_end`` code when it is the input's own (a failed input's)."""

    verdict: Verdict
    message: str = ""
    offset: int = 0
    code: str = ""

    @property
    def status(self) -> int:
        """The HTTP status to answer with."""
        return self.verdict.status

    @property
    def end_code(self) -> str:
        """The ``data_end`` code to end a relayed stream with ("" : verified)."""
        return self.code or self.verdict.code
