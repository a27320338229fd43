"""Reconnect that follows the cluster: the one backoff of the worker agent and the client SDK.

Why (issue #25 part 3): both used ``U(0, min(cap, base * 2**n))`` with ``n`` reset only by a
session that fully came back. In a cluster every coordinator answers while one shard moves (a
``moved`` to an owner that is gone, 1013 "no owner yet", a 503 while the database is away), so
``n`` kept growing through answers: after a coordinator kill a worker came back in 4 s, 13 s,
then 20 s, and after a 20 s PostgreSQL freeze clients and workers had backed off to 30 s while
the shards were served again ~1 s after it resumed.

The caller says what each try came to (docs/OPERATIONS.md §Reconnects):

==================  =====================================================  ==================
outcome             what it is                                             the next delay
==================  =====================================================  ==================
:meth:`served`      a session was served (the worker registered; the       ``U(0, base)``
                    client's got a frame or a pong back and ended other
                    than by 1013) and ended
:meth:`moved`       a ``moved`` named the shard's owner                    0: go there at once
:meth:`refused`     an answer that served nothing, naming a wait           that wait + jitter
(with a wait)       (``Retry-After``, ``error.retry_after_s``)
:meth:`refused`     an answer that served nothing and named no wait (an    the ceiling
(without)           HTTP refusal without ``Retry-After``; a websocket
                    that closed before registering: 1013 "no owner yet",
                    a client's that ended with nothing back: 1011)
:meth:`unanswered`  nothing answered (refused, reset, timed out at TCP     the ceiling
                    or TLS; upgraded, then silent: a worker's
                    ``welcome`` or a client's first reply not within
                    the dial's bound)
==================  =====================================================  ==================

Rules:

* **Only a served session or a ``moved`` holds the ceiling at base.** For the pass over the
  list that follows one (``len(urls)`` tries, that one included) the ceiling is ``base`` (at
  most :data:`ANSWERED_CAP_S`, 5 s), however many of those tries were not answered: after a
  coordinator ``kill -9`` they are the dead owner a ``moved`` named (its lease outlives it) and
  the dead coordinator's own URL in the list, a refused connection that costs the cluster
  nothing. (Before 93c5df1, ``n`` grew through those: a ``moved`` to the dead owner then the dead
  main port made the next delay ``U(0, 2 s)``, and clients came back 2.2-2.8 s after their
  shard was served again, bench/cluster_chaos.py.) A refusal without a wait in that pass ends
  the hold. The price, while a killed owner's lease lasts: a ``moved`` handshake per peer about
  every ``base`` at the live main ports (bench/reconnect_storm.py: 26k/s per 10,000 peers, 10k/s
  under the rule before 93c5df1), for peers back within ~1 s of their shard served again.
* **A refusal without a wait grows the ceiling**: from the second since the last served session,
  each doubles it. It costs the coordinator a handshake and tells the peer nothing about when to
  come back, so a coordinator that keeps answering but refusing (while the rest of the list
  refuses TCP) is not dialled at ``U(0, base)`` for ever (93c5df1 held that one at base too: x1.5
  (two URLs) to x7.5 (ten) the dials of the rule before it, bench/reconnect_storm.py). The first
  is free: a failover's 1013 "no owner yet" (the lease expired, the new owner's URL not yet
  known, ~0.1 s) would otherwise double the ceiling of a peer whose session was just lost. A
  ``moved`` does not undo them; only a served session does.
* **Retry-After is the wait.** A refusal that names a wait is waited, not a floor under a
  growing random delay: that wait plus up to 10 % (at most 1 s) of jitter, so peers refused
  together do not return together. It neither grows nor resets the refusals' doublings.
* **Unanswered tries grow it only when the list is silent.** While some try of the last pass
  got an answer (of any kind), a refused connection adds nothing; once a whole pass got none (a
  coordinator host down, a network cut) each unanswered try doubles the ceiling, ``n`` the tries
  since the last answer, so a dead cluster is not hammered. The ceiling is
  ``min(cap, base * 2**(max(0, refusals - 1) + n))`` outside a hold (``n`` 0 while the list answers).
* **Jittered.** Full jitter, ``U(0, ceiling)``.

Pure: the caller says what happened and gets the next delay; randomness comes in as a
``random.Random``. No asyncio, no clock.
"""

from __future__ import annotations

import random
from typing import Final

__all__ = ["ANSWERED_CAP_S", "ReconnectBackoff"]

#: The highest delay ceiling while a served session or a ``moved`` holds it (issue #25 part 3: <= 5 s): a
#: ``base`` configured above it is cut to it.
ANSWERED_CAP_S: Final = 5.0
_MAX_EXPONENT: Final = 32


class ReconnectBackoff:
    """The delay before each next dial.

    Args:
        base_s: the first ceiling (> 0).
        cap_s: the largest ceiling (>= base_s).
        urls: how many URLs are dialled in turn (a pass over the list is that many tries).
        rng: the jitter's source.

    Attributes:
        refusals: answers that refused without a wait since the last served session.
        silent: tries since the last answer of any kind (all of them unanswered).
    """

    def __init__(self, base_s: float, cap_s: float, *, urls: int = 1, rng: random.Random | None = None) -> None:
        if not 0 < base_s <= cap_s:
            raise ValueError(f"reconnect delays must satisfy 0 < base ({base_s:g} s) <= cap ({cap_s:g} s)")
        self.base_s = base_s
        self.cap_s = cap_s
        self.urls = max(1, urls)
        self.refusals = 0
        self.silent = 0
        self._rng = rng or random.Random()
        self._hold = 0  # tries of the pass that a served session or a moved holds at base, still to come

    @property
    def held(self) -> bool:
        """Whether a served session or a ``moved`` of the last pass holds the ceiling at base."""
        return self._hold > 0

    @property
    def answering(self) -> bool:
        """Whether one of the last tries (a pass over the list) got an answer from a coordinator."""
        return self.silent < self.urls

    @property
    def failures(self) -> int:
        """The doublings of the ceiling outside a hold: the refusals but the first, and the silent tries once a
        whole pass was silent."""
        return min(max(0, self.refusals - 1) + (0 if self.answering else self.silent), _MAX_EXPONENT)

    def ceiling_s(self) -> float:
        """The jitter's ceiling for the next delay (no Retry-After)."""
        if self.held:
            return min(self.base_s, ANSWERED_CAP_S)
        return min(self.cap_s, self.base_s * 2.0**self.failures)

    def served(self) -> float:
        """A session was served (registered, attached) and has ended; the delay before the next dial."""
        self.refusals = self.silent = 0
        self._hold = self.urls
        return self._rng.uniform(0.0, self.ceiling_s())

    def moved(self) -> float:
        """A ``moved`` named the shard's owner: dial it at once (0.0); the pass from here is held at base."""
        self.silent = 0
        self._hold = self.urls
        return 0.0

    def refused(self, retry_after_s: float | None = None) -> float:
        """A coordinator answered but served nothing (an HTTP refusal, a session closed before registering).

        ``retry_after_s``: the wait the answer asked for (Retry-After, ``error.retry_after_s``);
        that wait plus a little jitter is the delay. None or 0: none; the refusal ends a hold, and doubles the
        ceiling unless it is the first since the last served session.
        """
        self.silent = 0
        if retry_after_s is not None and retry_after_s > 0:
            self._hold = max(0, self._hold - 1)
            return retry_after_s + self._rng.uniform(0.0, min(1.0, 0.1 * retry_after_s))
        self._hold = 0
        self.refusals = min(self.refusals + 1, _MAX_EXPONENT)
        return self._rng.uniform(0.0, self.ceiling_s())

    def unanswered(self) -> float:
        """Nothing answered (refused, reset, timed out at TCP or TLS); the delay before the next dial."""
        self._hold = max(0, self._hold - 1)
        self.silent += 1
        return self._rng.uniform(0.0, self.ceiling_s())
