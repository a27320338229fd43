"""The lone round trip's busy-poll: a loop that polls without sleeping for a short window after a send (issue #29).

Why. A sequential round trip passes through three processes (the client, the coordinator, a worker) and two
commits; between them each process sleeps in its loop's ``epoll_wait``, and on a VM whose idle vCPUs halt
(``/sys/module/haltpoll/parameters/guest_halt_poll_ns`` 0) the frame that ends the sleep pays the vCPU's wake-up
as well as the process's (docs/PERFORMANCE.md §D29c point 2, §D29h). A loop that keeps polling its sockets for the
little while its answer takes never sleeps, so neither its process nor its vCPU has to be woken.

What. :meth:`Spin.sent` after a frame that expects an answer soon (the client's lone submit, the coordinator's
frames of a step, the worker's ``done``): until :attr:`Spin.window_s` has passed, or :meth:`Spin.received` says a
frame came, the loop is handed a callback each turn (``call_soon``, which re-arms itself), so it polls its
descriptors with a zero timeout instead of sleeping; each such turn yields the core (``os.sched_yield``), so a
process that needs it (the peer the frame woke, on the same core) runs first.

Rules (what keeps it from costing where it does not pay):

* The window is short (``--spin-us``; :data:`SPIN_WINDOW_S` by default) and each spin ends at the window or at the
  answer, whichever comes first: an idle process spins at most one window after its last send, then sleeps as before.
* Adaptive. A spin the window ran out on (no answer within it) is a *miss*: the next 1, 2, 4 ... up to
  :data:`MAX_SKIP` sends spin not, until an answer within the window resets it. A process whose answers come later
  than the window (a worker between plans) soon spins on one send in :data:`MAX_SKIP`.
* Busy. An answer already there at the spin's first turn (the loop had work: steady throughput) is no use to a
  spin: the next :data:`BUSY_SKIP` sends spin not. A spin during which the thread was switched out for someone
  else (``ru_nivcsw`` grew: others need this core) stops there, and the next 8 sends spin not, doubling while it
  happens again (misses count in the same row) up to :data:`CONTENDED_SKIP`: on a busy machine the spin's CPU time
  would only make the scheduler run this process later; a kernel thread now and then costs a few spins.
* Off: a window of 0 (``FLEETWIRE_SPIN_US=0``, the coordinator's and the worker's ``--spin-us 0``).

One :class:`Spin` a process (:data:`SPIN`): the sends and answers of all its sessions arm and end the same spin,
as they share the one loop that sleeps or not.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import resource
import time
import warnings
from collections.abc import Callable
from typing import Final

__all__ = [
    "BUSY_SKIP", "CONTENDED_FIRST_SKIP", "CONTENDED_SKIP", "ENV", "MAX_SKIP", "SPIN", "SPIN_WINDOW_S", "Spin",
    "add_spin_argument", "apply_spin_argument", "window_from_env",
]  # fmt: skip

#: The longest a spin lasts after a send, by default: 0, off (docs/PERFORMANCE.md §D29h: on a quiet 2-vCPU VM the
#: durable p50 at 300 µs fell in 6 latency.py pairs of 7 but rose in 3 compare.py pairs of 4, whose throughput fell in
#: 2 of 4; not settled). ``--spin-us 300`` covers a worker's turn.
SPIN_WINDOW_S: Final = 0.0
#: The environment variable that sets the window, in µs (0: off); the CLI's ``--spin-us`` sets it too.
ENV: Final = "FLEETWIRE_SPIN_US"
#: After misses in a row, this many sends at most spin not (doubling from 1).
MAX_SKIP: Final = 64
#: After a spin whose answer was there at once (a busy loop), this many sends spin not.
BUSY_SKIP: Final = 16
#: After a spin others' work switched out, this many sends spin not, doubling in a row up to :data:`CONTENDED_SKIP`.
CONTENDED_FIRST_SKIP: Final = 8
CONTENDED_SKIP: Final = 256


def window_from_env(default_s: float = SPIN_WINDOW_S, env: str = ENV) -> float:
    """The spin window the variable ``env`` (:data:`ENV` unless told) asks for, in µs, as seconds; ``default_s`` when
    unset; 0 when off or unreadable (with a warning that names the value)."""
    value = os.environ.get(env)
    if value is None or not value.strip():
        return default_s
    try:
        us = float(value)
    except ValueError:  # said, not silently dropped: the busy-poll is off, the process goes on
        warnings.warn(f"{env}={value!r} is not a number of microseconds: the busy-poll is off", stacklevel=2)
        return 0.0
    return us / 1e6 if us > 0 else 0.0


def _switched_out() -> int:
    """The calling thread's involuntary context switches so far (a yield that let another task run counts)."""
    return resource.getrusage(resource.RUSAGE_THREAD).ru_nivcsw


class Spin:
    """One process's busy-poll after its sends (module docstring).

    Attributes:
        window_s: the longest spin (0: off).
        spins, hits, misses, busy, contended, polls: counts since start (tests, benchmarks).
    """

    __slots__ = (
        "_clock", "_deadline", "_handle", "_misses_in_row", "_nivcsw", "_polls_now", "_skip", "_switched", "_yield",
        "busy", "contended", "hits", "misses", "polls", "spins", "window_s",
    )  # fmt: skip

    def __init__(
        self, window_s: float = SPIN_WINDOW_S, *, clock: Callable[[], float] = time.perf_counter,
        switched: Callable[[], int] = _switched_out, yield_core: Callable[[], None] = os.sched_yield,
    ) -> None:  # fmt: skip
        self.window_s = window_s
        self._clock = clock
        self._yield = yield_core
        self._switched = switched
        self._deadline = 0.0  # 0: not spinning
        self._handle: asyncio.Handle | None = None
        self._skip = 0  # sends that spin not before the next spin
        self._misses_in_row = 0
        self._nivcsw = 0  # the thread's involuntary switches when this spin began
        self._polls_now = 0  # this spin's turns
        self.spins = self.hits = self.misses = self.busy = self.contended = self.polls = 0

    @property
    def spinning(self) -> bool:
        """Whether a spin is under way (the loop will not sleep before it ends)."""
        return self._deadline > 0.0

    def sent(self) -> None:
        """A frame that expects an answer soon went out: spin for the window, unless the rules say not."""
        if self.window_s <= 0.0:
            return
        if self._deadline:  # already spinning: the window starts again from this send
            self._deadline = self._clock() + self.window_s
            return
        if self._skip:
            self._skip -= 1
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # no loop in this thread: nothing to keep awake
            return
        self.spins += 1
        self._polls_now = 0
        self._nivcsw = self._switched()
        self._deadline = self._clock() + self.window_s
        self._handle = loop.call_soon(self._poll)

    def received(self) -> None:
        """A frame came: the spin under way (if any) ends; an answer within the window resets the misses."""
        if not self._deadline:
            return
        self._deadline = 0.0
        handle = self._handle
        if handle is not None:
            self._handle = None
            handle.cancel()
        if self._polls_now == 0:  # the answer was there before the spin's first turn: the loop was busy anyway
            self.busy += 1
            self._skip = BUSY_SKIP
        elif self._switched() != self._nivcsw:
            self._contended()
        else:
            self.hits += 1
            self._misses_in_row = 0

    def stop(self) -> None:
        """End a spin under way without counting it (the session ends)."""
        self._deadline = 0.0
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None

    def _poll(self) -> None:
        """One turn of the spin: again next turn (yielding the core first) until the window ends."""
        if self._clock() < self._deadline:
            if self._polls_now and self._switched() != self._nivcsw:  # someone else ran here: stop spinning
                self._deadline = 0.0
                self._handle = None
                self._contended()
                return
            self._polls_now += 1
            self.polls += 1
            self._handle = asyncio.get_running_loop().call_soon(self._poll)
            self._yield()
            return
        self._deadline = 0.0
        self._handle = None
        self.misses += 1
        self._misses_in_row += 1
        self._skip = min(1 << (self._misses_in_row - 1), MAX_SKIP)

    def _contended(self) -> None:
        """Others needed this core during the spin: a miss that backs off more (8, 16 ... up to 256 sends)."""
        self.contended += 1
        self._misses_in_row += 1
        self._skip = min(CONTENDED_FIRST_SKIP << (self._misses_in_row - 1), CONTENDED_SKIP)


#: The process's spin: its window from :data:`ENV` (the CLI's ``--spin-us`` sets ``window_s``).
SPIN: Final = Spin(window_from_env())


def add_spin_argument(parser: argparse.ArgumentParser) -> None:
    """``--spin-us`` of the coordinator's and the worker's commands (docs/OPERATIONS.md §Busy-poll)."""
    parser.add_argument(
        "--spin-us", type=float, default=None, metavar="US",
        help="after a frame that expects a quick answer, poll this many microseconds before sleeping, while answers "
             "come that soon and the cores are free (a lone round trip's wake-ups; 0: off; default: "
             f"${ENV}, else {SPIN_WINDOW_S * 1e6:.0f})",
    )  # fmt: skip


def apply_spin_argument(ns: argparse.Namespace) -> None:
    """Set :data:`SPIN`'s window from ``--spin-us`` when given (else :data:`ENV`'s or the default stays)."""
    spin_us = getattr(ns, "spin_us", None)
    if spin_us is not None:
        SPIN.window_s = spin_us / 1e6 if spin_us > 0 else 0.0
