"""A listener's discipline, shared by the coordinator's ports and the worker's data endpoint.

* :func:`raise_fd_limit`: the soft open-file limit raised to the hard one;
* :data:`LISTEN_BACKLOG` and :func:`defer_accept`: the kernel holds a new connection until its
  first byte (``TCP_DEFER_ACCEPT``), so idle sockets cost the server nothing for a while;
* :class:`Repeats`: events per peer host in windows: the coordinator counts failed
  authentications and scrapes (coordinator/io/frontdoor/admission.py), the worker its data
  endpoint's refusals (worker_agent/dataplane.py); past the burst each further one is held, so a
  loop of refused requests from one host costs a held socket, not a core.
"""

from __future__ import annotations

import contextlib
import math
import resource
import socket
import time
from collections.abc import Callable, Iterable
from typing import Any, Final

__all__ = ["LISTEN_BACKLOG", "Repeats", "defer_accept", "raise_fd_limit"]

#: The listen backlog asked for (the kernel caps it at ``net.core.somaxconn``): room for the
#: connections ``TCP_DEFER_ACCEPT`` holds back, which count against it, and for bursts of real ones.
LISTEN_BACKLOG: Final = 4096


def raise_fd_limit() -> tuple[int, int]:
    """Raise the soft open-file limit to the hard one (a shell's 1,024 is the usual soft default).

    Returns (soft before, soft now); an infinite hard limit is capped at 1,048,576, and a refusal
    by the OS leaves the limit as it was (returned twice).
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = 1 << 20 if hard == resource.RLIM_INFINITY else hard
    if soft != resource.RLIM_INFINITY and soft < target:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            return soft, target
    return soft, soft


def defer_accept(sockets: Iterable[Any], seconds: float) -> int:
    """Ask the kernel to hold each listening TCP socket's new connections until their first byte.

    ``seconds``: how long at most (rounded up to whole seconds, then by the kernel to its SYN-ACK
    retransmit schedule: 1, 3, 7, 15 s), after which an idle connection is accepted after all.
    Returns the seconds the kernel reports; 0 when off (``seconds`` <= 0), unavailable (not
    Linux) or refused, or for no TCP socket.
    """
    option = getattr(socket, "TCP_DEFER_ACCEPT", None)
    if option is None or seconds <= 0:
        return 0
    applied = 0
    for sock in sockets:
        if sock.family not in (socket.AF_INET, socket.AF_INET6):
            continue
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.IPPROTO_TCP, option, max(1, math.ceil(seconds)))
            applied = max(applied, int(sock.getsockopt(socket.IPPROTO_TCP, option)))
    return applied


class Repeats:
    """Events per peer host in windows of ``interval_s``: which ones are past ``burst``.

    Args:
        burst: events per host and window that are not over.
        interval_s: the window.
        max_hosts: hosts tracked at once; past it the table is cleared (at worst a loop gets one more burst).
        clock: monotonic seconds.
    """

    def __init__(
        self, *, burst: int, interval_s: float, max_hosts: int = 10_000, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.burst = burst
        self.interval_s = interval_s
        self.max_hosts = max_hosts
        self.over_count = 0  # events past the burst (tests, /metrics)
        self._clock = clock
        self._windows: dict[str, tuple[float, int]] = {}  # host -> (window start, events in it)

    def over(self, host: str) -> bool:
        """Count one event from ``host``; whether it is past the burst of its window."""
        now = self._clock()
        windows = self._windows
        start, count = windows.get(host, (now, 0))
        if now - start >= self.interval_s:
            start, count = now, 0
        elif count == 0 and len(windows) >= self.max_hosts:
            windows.clear()
        count += 1
        windows[host] = (start, count)
        if count <= self.burst:
            return False
        self.over_count += 1
        return True
