"""The door's request rate per principal, and what the door counts for ``/metrics``. Sans-I/O.

Rules (docs/OPENAI.md §Limits):

* **Request rate.** Each principal (a token's name; under ``--insecure`` everyone is ``client``)
  may make ``rate`` requests per second with room for ``burst`` at once (a token bucket; 0 rate:
  no limit). A request past it is answered 429 ``rate_limit_exceeded`` with ``Retry-After``: the
  whole seconds until a request would be taken again (at least 1). Refused requests cost no
  token, so a client that waits as told gets in. ``GET /v1/models`` counts as a request. The
  table is bounded: past ``max_principals`` it is cleared (each bucket starts full again).
* **Counts** (:class:`DoorStats`): answers by status, requests in flight, streams open (a stream
  whose head was sent and whose end was not), the time from a request's last byte to the first
  byte of its answer (a histogram), requests refused by the rate, slow consumers, and requests
  a cluster's main port forwarded to another coordinator. coordinator/io/ops/openai_metrics.py
  exposes them.

Pure: ``now`` comes in.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Final

from coordinator.stats import Histogram

__all__ = ["FIRST_BYTE_BUCKETS_S", "DoorStats", "RequestRate"]

#: The first-byte histogram's bounds, seconds: a door's own share is under a millisecond, an engine's first
#: token from milliseconds to seconds, a queued request up to the queue timeout.
FIRST_BYTE_BUCKETS_S: Final = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                               10.0, 30.0)  # fmt: skip


class RequestRate:
    """Requests per second per principal (module docstring).

    Args:
        rate: requests per second a principal may make; 0: no limit.
        burst: requests a principal may make at once (0: one second's worth, at least 1).
        max_principals: buckets kept at most.
    """

    __slots__ = ("_buckets", "burst", "max_principals", "rate")

    def __init__(self, rate: float, burst: int = 0, max_principals: int = 100_000) -> None:
        if not rate >= 0:
            raise ValueError(f"the OpenAI request rate must be >= 0 requests/s (0: no limit), got {rate}")
        if burst < 0:
            raise ValueError(f"the OpenAI request burst must be >= 0 (0: one second's worth), got {burst}")
        self.rate = rate
        self.burst = float(burst or max(1, round(rate)))
        self.max_principals = max_principals
        self._buckets: dict[str, tuple[float, float]] = {}  # principal -> (tokens, at)

    def admit(self, principal: str, now: float) -> float:
        """0.0 when ``principal`` may make a request at ``now`` (one token taken); else the seconds until it may."""
        if self.rate <= 0:
            return 0.0
        entry = self._buckets.get(principal)
        if entry is None:
            if len(self._buckets) >= self.max_principals:
                self._buckets.clear()
            tokens = self.burst
        else:
            tokens = min(self.burst, entry[0] + max(0.0, now - entry[1]) * self.rate)
        if tokens >= 1.0:
            self._buckets[principal] = (tokens - 1.0, now)
            return 0.0
        self._buckets[principal] = (tokens, now)
        return (1.0 - tokens) / self.rate


@dataclass(slots=True)
class DoorStats:
    """What one door counts (module docstring)."""

    answers: dict[int, int] = field(default_factory=dict)  # requests answered, by status
    in_flight: int = 0  # completions submitted and not yet answered whole
    streams_open: int = 0  # streams whose head was sent and whose end was not
    first_byte: Histogram = field(default_factory=lambda: Histogram(FIRST_BYTE_BUCKETS_S))
    rate_limited: int = 0  # requests refused 429 by the request rate
    slow_consumers: int = 0  # connections aborted for reading too slowly
    forwarded: int = 0  # requests a cluster's main port forwarded to another coordinator

    def answered(self, status: int) -> None:
        """One request answered with ``status``."""
        self.answers[status] = self.answers.get(status, 0) + 1
