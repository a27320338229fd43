"""What a session's reader decides about each frame it reads: data in, verdicts out.

The front door's reader (coordinator/io/frontdoor/reader.py) reads a websocket's frames and hands
each one's messages to the session it serves (a core's session, or a cluster's view session). The
decisions it takes around that are made here, with ``now`` passed in, so a unit test drives them
with a fake clock (tests/unit/test_read_policy.py). coordinator/limits.py holds the limits and the
buckets; docs/OPERATIONS.md §Security says what a peer sees.

Rules, in the order the reader applies them to one frame:

* **Message rate**, per connection (:meth:`ConnectionPolicy.admit`): each message takes a token of
  the role's bucket (``worker_rate``/``client_rate``). Within the rate: read on. Over it: the reader
  pauses after the frame until the bucket would refill. Over it for longer than ``flood_grace_s``
  without a break: the frame is dropped and the session closed 4429 (:data:`FLOOD`).
* **Frame budget** (:meth:`ReadPolicy.over_frame_budget`): once one frame's requests have cost more
  than ``frame_cost_budget`` work units, what they asked so far goes out and the rest of the frame
  waits for the next loop turn, so one frame of expensive requests never holds the loop.
* **Work units**, per client principal (:meth:`ConnectionPolicy.after`): a frame costs one unit
  per message, one per KiB of the frame, and what the session counted beyond that (rows a listing
  scanned, events a replay sent). The principal's bucket is shared by all its sessions on the
  port. Over it: the reader pauses until the bucket refills, at most :data:`MAX_PAUSE_S` at a time,
  and the frame is counted in :attr:`ReadPolicy.cost_throttles`. Workers are not charged.
* **Store backlog**: while the records waiting for the store are over their bound
  (``max_commit_backlog_bytes``), the reader waits for the store to catch up before reading on, so
  TCP holds the senders back (:attr:`Verdict.wait_for_store`).
* **Penalty box** (:func:`penalty`): a session closed for abuse (1009 oversize frame, 4400 protocol
  violations, 4429 flood) puts its peer in the penalty box (coordinator/io/frontdoor/gate.py
  ``Gatekeeper.offence``); a 4429 the core asked for (a worker id past its reconnect budget,
  coordinator/reconnects.py) boxes that worker id only. Other closes (4503 slow consumer, 4401
  revoked token, 4307 moved) do not.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

from coordinator.limits import PENALIZED_CLOSES, CostBuckets, Limits, Role, TokenBucket

__all__ = ["FLOOD", "MAX_PAUSE_S", "READ_ON", "ConnectionPolicy", "Penalty", "ReadPolicy", "Verdict", "penalty"]

#: The close of a connection over its message rate for longer than the grace (code, reason).
FLOOD: Final = (4429, "message rate limit exceeded")
#: The longest one pause for a principal over its work units (its bucket may owe more).
MAX_PAUSE_S: Final = 5.0
_CLOSE_RATE_LIMITED: Final = 4429  # literal: the pure core's limits do not import the protocol package


@dataclass(frozen=True, slots=True)
class Verdict:
    """What the reader does after handing a frame on.

    Attributes:
        pause_s: seconds to stop reading this connection (0.0: read on at once).
        wait_for_store: wait until the store's backlog is back under its bound first.
    """

    pause_s: float = 0.0
    wait_for_store: bool = False


READ_ON: Final = Verdict()


@dataclass(frozen=True, slots=True)
class Penalty:
    """A close that puts the peer in the penalty box; ``per_worker_id``: keyed by the worker id its upgrade named."""

    code: int
    per_worker_id: bool = False


def penalty(code: int, *, by_core: bool = False) -> Penalty | None:
    """Whether closing a session with ``code`` puts its peer in the penalty box, and under which key.

    ``by_core``: the core asked for the close (coordinator/effects.py ``Effects.closes``); its 4429
    is a worker id past its reconnect budget, boxed per worker id so the id's neighbours on the same
    host and token are let in (coordinator/io/frontdoor/gate.py).
    """
    if code not in PENALIZED_CLOSES:
        return None
    return Penalty(code, per_worker_id=by_core and code == _CLOSE_RATE_LIMITED)


class ReadPolicy:
    """The read limits of one listening port, shared by its connections.

    Args:
        limits: the server's limits (coordinator/limits.py).

    Attributes:
        cost_throttles: frames after which a client principal over its work-unit rate was
            throttled (``fleetwire_cost_throttled``).
    """

    def __init__(self, limits: Limits) -> None:
        self.limits = limits
        self.costs = CostBuckets(limits)
        self.cost_throttles = 0

    def connection(self, role: Role, principal: str, now: float) -> ConnectionPolicy:
        """The policy of a new ``role`` connection of ``principal``, opened at ``now``."""
        cost = self.costs.get(principal, now) if role == "client" else None
        return ConnectionPolicy(self, self.limits.bucket(role, now), cost)

    def over_frame_budget(self, units: int) -> bool:
        """Whether a frame's requests, having cost ``units`` so far, must let the loop run others first."""
        return units > self.limits.frame_cost_budget


class ConnectionPolicy:
    """One connection's verdicts: its message-rate bucket, and its principal's work-unit bucket (clients).

    Made by :meth:`ReadPolicy.connection`.
    """

    __slots__ = ("_cost", "_policy", "_rate")

    def __init__(self, policy: ReadPolicy, rate: TokenBucket | None, cost: TokenBucket | None) -> None:
        self._policy = policy
        self._rate = rate
        self._cost = cost

    def admit(self, messages: int, now: float) -> float | None:
        """Charge a frame of ``messages`` read at ``now`` to the connection's rate.

        Returns:
            0.0 within the rate; the seconds to pause after the frame when over it; None when the
            connection has been over it past the flood grace: drop the frame and close with :data:`FLOOD`.
        """
        rate = self._rate
        return 0.0 if rate is None else rate.take(messages, now)

    def after(self, messages: int, frame_bytes: int, spent: int, now: float, pause_s: float,
              store_over: bool) -> Verdict:  # fmt: skip
        """The verdict once a frame's messages were handed on.

        Args:
            messages: how many the frame held.
            frame_bytes: its size.
            spent: the work units the session counted beyond one per message (rows scanned, events replayed).
            now: when the frame was handled.
            pause_s: the pause :meth:`admit` asked for.
            store_over: the store's backlog is over its bound now.
        """
        cost = self._cost
        if cost is not None:
            owed = cost.take(messages + (frame_bytes >> 10) + spent, now)
            if owed:
                self._policy.cost_throttles += 1
                pause_s = max(pause_s, min(owed, MAX_PAUSE_S))
        if not pause_s and not store_over:
            return READ_ON
        return Verdict(pause_s, store_over)
