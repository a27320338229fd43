"""Reconnect that follows the cluster: the one backoff of the worker agent and the client SDK.

Why (issue #25 part 3): both used ``U(0, min(cap, base * 2**n))`` with ``n`` reset only by a
session that fully came back. In a cluster every coordinator answers while one shard moves (a
``moved`` to an owner that is gone, 1013 "no owner yet", a 503 while the database is away), so
``n`` kept growing through answers: after a coordinator kill a worker came back in 4 s, 13 s,
then 20 s, and after a 20 s PostgreSQL freeze clients and workers had backed off to 30 s while
the shards were served again ~1 s after it resumed.

Rules (docs/OPERATIONS.md §Reconnects), for one peer dialling a list of coordinator URLs:

* **An answer resets.** Any successful connection (a websocket that opened, whatever it said
  then) and any HTTP answer to the upgrade (429, 503, ...) set ``n`` to 0: a coordinator is
  there, so the next try is cheap and soon.
* **Retry-After is the wait.** A refusal that names a wait (HTTP ``Retry-After``, an
  ``error.retry_after_s``) is waited, not a floor under a growing random delay: that wait plus
  up to 10 % (at most 1 s) of jitter, so peers refused together do not return together.
* **The first step while the list answers.** While one of the last ``len(urls)`` tries got an
  answer, the delay's ceiling is ``base`` (at most :data:`ANSWERED_CAP_S`, 5 s), however many
  tries since that answer were not answered: the cluster is reachable and a shard comes back
  within seconds, and the tries it does not answer are the dead owner's URL that a ``moved``
  named (its lease outlives it by up to the TTL) and the dead coordinator's own URL in the
  list: a refused connection, nothing the cluster pays for. (Before, ``n`` grew through those:
  a ``moved`` to the dead owner then the dead main port made the next delay ``U(0, 2 s)``, and
  clients came back 2.2 s after their shard was served again, bench/cluster_chaos.py.) Only
  when nothing answered for a whole pass over the list does the ceiling grow, from
  ``base * 2**n`` up to the configured cap (a coordinator host down, a network cut), so a dead
  cluster is not hammered.
* **Jittered.** Full jitter, ``U(0, ceiling)``.

Pure: the caller says what happened and gets the next delay; randomness comes in as a
``random.Random``. No asyncio, no clock.
"""

from __future__ import annotations

import random
from collections import deque
from typing import Final

__all__ = ["ANSWERED_CAP_S", "ReconnectBackoff"]

#: The highest delay ceiling while some coordinator of the list answers (issue #25 part 3: <= 5 s): a ``base``
#: configured above it is cut to it.
ANSWERED_CAP_S: Final = 5.0
_MAX_EXPONENT: Final = 32


class ReconnectBackoff:
    """The delay before each next dial.

    Args:
        base_s: the first ceiling (> 0).
        cap_s: the largest ceiling when nothing answers (>= base_s).
        urls: how many URLs are dialled in turn (a pass over the list is that many tries).
        rng: the jitter's source.

    Attributes:
        failures: ``n``: tries since the last answer.
    """

    def __init__(self, base_s: float, cap_s: float, *, urls: int = 1, rng: random.Random | None = None) -> None:
        if not 0 < base_s <= cap_s:
            raise ValueError(f"reconnect delays must satisfy 0 < base ({base_s:g} s) <= cap ({cap_s:g} s)")
        self.base_s = base_s
        self.cap_s = cap_s
        self.failures = 0
        self._rng = rng or random.Random()
        self._recent: deque[bool] = deque(maxlen=max(1, urls))  # the last tries: answered or not

    @property
    def answering(self) -> bool:
        """Whether one of the last tries (a pass over the list) got an answer from a coordinator."""
        return any(self._recent)

    def ceiling_s(self) -> float:
        """The jitter's ceiling for the next delay (no Retry-After): ``base`` while the list answers."""
        if self.answering:
            return min(self.base_s, ANSWERED_CAP_S)
        return min(self.cap_s, self.base_s * 2.0 ** min(self.failures, _MAX_EXPONENT))

    def answered(self, retry_after_s: float | None = None) -> float:
        """A coordinator answered (a session opened, or an HTTP refusal); the delay before the next dial.

        ``retry_after_s``: the wait the answer asked for (Retry-After, ``error.retry_after_s``);
        None or 0: none.
        """
        self._recent.append(True)
        self.failures = 0
        if retry_after_s is not None and retry_after_s > 0:
            return retry_after_s + self._rng.uniform(0.0, min(1.0, 0.1 * retry_after_s))
        return self._rng.uniform(0.0, self.ceiling_s())

    def unanswered(self) -> float:
        """Nothing answered (refused, reset, timed out at TCP or TLS); the delay before the next dial."""
        self._recent.append(False)
        self.failures = min(self.failures + 1, _MAX_EXPONENT)
        return self._rng.uniform(0.0, self.ceiling_s())
