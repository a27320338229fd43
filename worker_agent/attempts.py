"""Which plan attempts a worker takes bytes for (docs/PROTOCOL.md §Data plane, ``410 Gone``).

A ticket (protocol/tickets.py) proves that the coordinator once granted a plan attempt on this
worker; it says nothing of whether the attempt is still alive, and it is valid for its whole
lifetime (an hour by default). The worker answers for that part: its data endpoint takes the
bytes of an attempt only while the attempt is *live* here, and refuses every other request with
``410 Gone`` and the reason ("plan 'p' attempt 2 was cancelled"), before reading a body byte. A
cancelled plan's ticket thus expires with its attempt, not an hour later.

Theory of operation:

* An attempt is *live* from its ``assign`` (running, or prefetched and waiting for a slot) until
  it ends here: ``cancel``, ``revoke`` (answered ``reject``), a ``reject`` of the assign, its
  ``done``, a newer attempt of the plan, or the coordinator taking it back (``stale_lease``,
  ``abandon_plans``, a silenced plan). The agent (worker_agent/agent.py) reports each of these,
  from the messages it reads and from what the runner sends; the first reason given is kept.
* An upload may reach the worker *before* its ``assign`` (the client hears ``data_ready`` at the
  moment of the lease, the worker its ``assign``). An attempt the worker never heard of is
  therefore *held* from its first request for :attr:`Attempts.early_hold_s`: its bytes are taken
  and kept in the spool as usual. Its assign makes it live; otherwise, at the end of the hold, it
  ends ("is not assigned to this worker") and its bytes go. At most :attr:`Attempts.max_early`
  attempts are held at once; a request for one more is answered ``503`` with ``Retry-After``.
* When an attempt ends, ``on_end(plan_id, attempt)`` runs (the agent drops its inputs from the
  spool unless a running plan still holds them; the runner drops those when the plan ends).
* Memory is bounded: one live attempt per plan (the coordinator's assigns: running plus
  prefetched), at most ``max_early`` held ones, and the reasons of the last ``max_ended`` ended
  ones (an older one forgotten is treated as never heard of: held, then refused).

Pure bookkeeping, no I/O: the clock is handed in.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Final

__all__ = ["Attempts", "Refusal"]

EARLY_HOLD_S: Final = 60.0
MAX_EARLY: Final = 64
MAX_ENDED: Final = 4096


class Refusal:
    """Why a request for an attempt's bytes is refused: the HTTP ``status`` (410, or 503 with ``retry_after_s``)."""

    __slots__ = ("reason", "retry_after_s", "status")

    def __init__(self, status: int, reason: str, retry_after_s: float = 0.0) -> None:
        self.status = status
        self.reason = reason
        self.retry_after_s = retry_after_s


class Attempts:
    """The plan attempts one worker takes bytes for (see the module docstring).

    Args:
        early_hold_s: how long an attempt not (yet) assigned here is held from its first request.
        max_early: attempts held at once.
        max_ended: ended attempts whose reason is remembered.
        clock: monotonic seconds.
        on_end: called with (plan id, attempt) once an attempt ended here.
    """

    def __init__(
        self,
        *,
        early_hold_s: float = EARLY_HOLD_S,
        max_early: int = MAX_EARLY,
        max_ended: int = MAX_ENDED,
        clock: Callable[[], float] = time.monotonic,
        on_end: Callable[[str, int], None] | None = None,
    ) -> None:
        self.early_hold_s = early_hold_s
        self.max_early = max_early
        self.max_ended = max_ended
        self.on_end = on_end
        #: Whether why each attempt ended is kept (for :meth:`check` and :meth:`reason`, the data endpoint's); a
        #: worker without one sets it False: its plans' ends then cost no reason (what is live, on_end as before).
        self.keeps_reasons = True
        self._clock = clock
        self._live: dict[str, int] = {}  # plan id -> its live attempt here
        self._early: dict[tuple[str, int], float] = {}  # held before an assign: since when (oldest first)
        self._ended: OrderedDict[tuple[str, int], str] = OrderedDict()  # why each ended, oldest first

    def __len__(self) -> int:
        """Attempts live here now."""
        return len(self._live)

    @property
    def held(self) -> int:
        """Attempts held before their assign now."""
        return len(self._early)

    def live(self, plan_id: str, attempt: int) -> bool:
        """Whether the attempt runs here or is about to (assigned, not ended)."""
        return self._live.get(plan_id) == attempt

    def keeps(self, plan_id: str, attempt: int) -> bool:
        """Whether the attempt's inputs are to be kept: live, or held before its assign."""
        return self._live.get(plan_id) == attempt or (plan_id, attempt) in self._early

    def assigned(self, plan_id: str, attempt: int) -> None:
        """The coordinator assigned the attempt here (an older one of the plan ends superseded; an older assign is
        stale and changes nothing)."""
        current = self._live.get(plan_id)
        if current is not None and current >= attempt:
            return
        if current is not None:
            self.ended(plan_id, current, f"was superseded by attempt {attempt}")
        if self._ended:  # (none without a data endpoint)
            self._ended.pop((plan_id, attempt), None)
        if self._early:  # (none held: the usual case)
            self._early.pop((plan_id, attempt), None)
        self._live[plan_id] = attempt

    def ended(self, plan_id: str, attempt: int, why: str) -> None:
        """The attempt ended here (``attempt`` 0: the plan's live one, if any).

        ``why`` completes "plan P attempt N ...", e.g. "was cancelled"; the first one given stands (kept only while
        :attr:`keeps_reasons`).
        """
        if not attempt:
            current = self._live.get(plan_id)
            if current is None:
                return
            attempt = current
        if self._live.get(plan_id) == attempt:
            del self._live[plan_id]
        if not self.keeps_reasons:  # no data endpoint: nothing held before an assign, no reason read
            if self.on_end is not None:
                self.on_end(plan_id, attempt)
            return
        key = (plan_id, attempt)
        if self._early:
            self._early.pop(key, None)
        if key in self._ended:
            return  # the first reason stands
        self._ended[key] = why
        while len(self._ended) > self.max_ended:
            self._ended.popitem(last=False)
        if self.on_end is not None:
            self.on_end(plan_id, attempt)

    def check(self, plan_id: str, attempt: int) -> Refusal | None:
        """None when the attempt's bytes are taken now (an unknown attempt starts being held), else why not."""
        if self._live.get(plan_id) == attempt:
            return None
        why = self._ended.get((plan_id, attempt))
        if why is not None:
            return Refusal(410, f"plan {plan_id!r} attempt {attempt} {why}; this worker takes no more of its bytes")
        current = self._live.get(plan_id)
        if current is not None and current > attempt:
            return Refusal(410, f"plan {plan_id!r} attempt {attempt} is not assigned to this worker "
                                f"(it runs attempt {current} here)")
        now = self._clock()
        since = self._early.get((plan_id, attempt))
        if since is None:
            self.expire()
            if len(self._early) >= self.max_early:
                return Refusal(503, f"this worker holds the uploads of {self.max_early} plan attempts not yet "
                                    "assigned to it; try again shortly", retry_after_s=1.0)
            self._early[(plan_id, attempt)] = now
            return None
        if now - since <= self.early_hold_s:
            return None
        self.expire()
        return self.check(plan_id, attempt)

    def expire(self) -> list[tuple[str, int]]:
        """End the attempts held past :attr:`early_hold_s` without an assign; returns them."""
        now = self._clock()
        expired = []
        for key, since in self._early.items():  # oldest first
            if now - since <= self.early_hold_s:
                break
            expired.append(key)
        why = (f"is not assigned to this worker (no assign for it arrived within {self.early_hold_s:g} s of its "
               "first upload)")
        for plan_id, attempt in expired:
            self.ended(plan_id, attempt, why)
        return expired

    def reason(self, plan_id: str, attempt: int) -> str | None:
        """Why the attempt ended here, if it did and is still remembered."""
        return self._ended.get((plan_id, attempt))
