"""The worker reconnect budget: a worker id that registers in a tight loop is refused (issue 17 finding 5).

Every ``hello`` that registers a worker costs the coordinator a websocket upgrade, a
registration, a ``welcome``, and at its disconnect a re-explanation of the waiting reasons of
the queued plans of its ops; a worker that connects and disconnects in a loop (a crash loop, a
careless script, a hostile peer with a worker token) makes every other peer wait for that.
A legitimate worker registers once per session and reconnects after a back-off.

Rules:

* Each worker id has a token bucket: ``burst`` registrations at once, refilled at ``rate`` per
  second. A registration (a ``hello`` that is welcomed) takes one token.
* A ``hello`` that finds less than one token is refused before anything changes:
  ``error(too_many_reconnects)`` naming the flags and ``retry_after_s``, then close ``4429``;
  the driver puts the token, address and the id the upgrade named (``?worker_id=``; token and
  address alone when it named none) in the penalty box (coordinator/io/frontdoor/gate.py), so the loop's
  next upgrades cost an HTTP 429, not a session, and its neighbours' do not. A refused ``hello``
  takes no token.
* ``rate`` 0 turns the budget off. Memory is bounded: at most ``max_keys`` ids are kept, the
  least recently registered forgotten first (it starts again with a full bucket).

Plain computation with time passed in: the pure core uses it (coordinator/worker_sessions/registration.py).
"""

from __future__ import annotations

__all__ = ["ReconnectBudget"]

_EPSILON = 1e-9  # refills summed in floats land a hair under a whole token


class ReconnectBudget:
    """Registrations per worker id: ``burst`` at once, then ``rate`` per second.

    Args:
        rate: registrations per second a worker id regains; 0: no budget.
        burst: registrations a worker id may make at once.
        max_keys: worker ids remembered at most.
    """

    def __init__(self, rate: float, burst: int, max_keys: int = 100_000) -> None:
        self.rate = rate
        self.burst = burst
        self.max_keys = max_keys
        self._buckets: dict[str, tuple[float, float]] = {}  # id -> (tokens, at); least recent first

    def _tokens(self, key: str, now: float) -> float:
        entry = self._buckets.get(key)
        if entry is None:
            return float(self.burst)
        tokens, at = entry
        return min(float(self.burst), tokens + max(0.0, now - at) * self.rate)

    def wait_s(self, key: str, now: float) -> float:
        """Seconds until ``key`` may register again; 0.0 if it may now."""
        if self.rate <= 0:
            return 0.0
        tokens = self._tokens(key, now)
        return 0.0 if tokens >= 1.0 - _EPSILON else (1.0 - tokens) / self.rate

    def spend(self, key: str, now: float) -> None:
        """``key`` registered at ``now``: one token less (never below zero)."""
        if self.rate <= 0:
            return
        tokens = max(0.0, self._tokens(key, now) - 1.0)
        self._buckets.pop(key, None)
        self._buckets[key] = (tokens, now)  # re-inserted last: the most recent
        while len(self._buckets) > self.max_keys:
            del self._buckets[next(iter(self._buckets))]
