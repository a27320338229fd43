"""When the SDK tries a transfer again, for both of its paths (docs/PROTOCOL.md §11 *Retries the SDK makes*).

Rules:

* A transfer that breaks without an answer (a dropped connection, a relayed stream that ended
  ``relay_closed``/``relay_busy``, nothing heard for the stall timeout) is resumed from the offset
  the worker acknowledged, after ``min(2, base * 2**breaks)`` seconds, at most ``limit`` breaks
  (:class:`Resumes`; a relayed open that moved bytes starts the count again).
* The direct path's answers to a ``PUT`` (:class:`PutRetries`): ``200``/``201`` done; ``204`` (a
  part), ``409`` (another offset, or a digest mismatch: from 0) and ``503`` (not yet: wait, then
  ``PUT`` from 0 unasked) try again, counted as breaks; anything else fails with its status.
* A relayed stream's end (:func:`end_step`): ``relay_closed``/``relay_busy`` try again, ``""``
  is done when the stream may end there, anything else fails with the status of
  protocol/transfer/verdicts.py ``END_STATUS``.
* A ``401`` in the middle of a transfer gets a fresh ticket at most :data:`TICKET_REFRESHES`
  times; an output whose digest does not match is fetched again at most :data:`MISMATCH_RETRIES` times.

No clock and no sleeping here: the waits are returned.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final, Literal

from protocol.relay import RETRYABLE
from protocol.transfer.verdicts import END_STATUS

__all__ = ["MISMATCH_RETRIES", "TICKET_REFRESHES", "PutRetries", "Resumes", "Step", "end_step"]

TICKET_REFRESHES: Final = 2  # fresh tickets one transfer asks for after 401s (a coordinator restart: new keys)
MISMATCH_RETRIES: Final = 2  # downloads of an output again after its digest did not match (damage in transit)
BREAK_BASE_S: Final = 0.05  # the first wait after a break
NOT_YET_BASE_S: Final = 0.25  # the first wait after a 503 (the worker holds too many uploads not yet assigned)
MAX_WAIT_S: Final = 2.0


class Resumes:
    """Breaks of one transfer in a row, and the wait before the next try.

    Args:
        limit: breaks after which the transfer fails (``max_resumes``).
    """

    __slots__ = ("failures", "limit")

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.failures = 0

    def broke(self, *, progressed: bool = False, base_s: float = BREAK_BASE_S) -> float | None:
        """One more break (the first of a new run when the broken try ``progressed``): the wait, or None: give up."""
        self.failures = 1 if progressed else self.failures + 1
        if self.failures > self.limit:
            return None
        return min(MAX_WAIT_S, base_s * (1 << self.failures))


@dataclass(frozen=True, slots=True)
class Step:
    """What a sender does after an answer: ``done``, ``again`` (after ``wait_s``, asking the offset first
    when ``ask``) or ``fail`` (with the answer's status)."""

    action: Literal["done", "again", "fail"]
    wait_s: float = 0.0
    ask: bool = True


class PutRetries(Resumes):
    """The direct path's answers to one input's ``PUT`` s (see the module docstring)."""

    __slots__ = ()

    def answered(self, status: int) -> Step:
        """The worker answered ``status``: what next."""
        if status in (200, 201):
            return Step("done")
        if status not in (204, 409, 503):
            return Step("fail")
        wait = self.broke(base_s=NOT_YET_BASE_S)
        if wait is None:
            return Step("fail")
        if status == 503:  # refused from the head: the next PUT goes from 0 unasked again
            return Step("again", wait, ask=False)
        return Step("again")


def end_step(code: str, *, done_ok: bool) -> tuple[Literal["done", "retry", "fail"], int]:
    """A relayed stream ended with ``code``: (what next, the status to fail with).

    ``done_ok``: the stream may end here (an upload's ``""`` is its input verified; a download's
    ends only with its last chunk, so an early ``""`` is a break).
    """
    if code in RETRYABLE:
        return "retry", 0
    if not code:
        return ("done", 0) if done_ok else ("retry", 0)
    return "fail", END_STATUS.get(code, 0)
