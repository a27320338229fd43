"""Session resumption for the client SDK: reconnect, re-send, re-subscribe (docs/PROTOCOL.md §Resuming).

Theory of operation. When a ``Client``'s connection drops (no close frame, ``1001`` going
away, ``1011``/``1012``/``1013``/``1014``), :class:`Resumer` keeps the session alive instead of
failing every call:

* it dials again after the delay of :class:`~protocol.backoff.ReconnectBackoff`, the worker
  agent's too (reconnect that follows the cluster: full jitter; ``base`` for a pass over the list
  after a served session or a ``moved``, doubled by each refusal without a wait but the first (an
  HTTP refusal, a session closed ``1013``, or closed with nothing back on it, before it served) and
  by the silent tries once a whole pass got no answer (a dial that timed out; a connection that went
  silent: no reply to its first request within the dial's bound, fleetwire/connection.py
  ``FirstReply``); a refusal's ``Retry-After`` waited as such), for up to ``give_up_s`` without a session;
* on the new connection the ``ClientSession`` (fleetwire/session.py, ``resume``) first
  re-sends every request still waiting for its reply, in ``req_id`` order (submits are
  idempotent: the SDK always sends a plan id), then subscribes every unfinished plan again
  from the last ``seq`` it holds, so ``events()`` goes on with no gap and no duplicate;
* when the coordinator no longer holds some of those events it answers ``resync`` and the
  plan yields a ``resync`` marker event in their place (fleetwire/stream.py); when it no
  longer knows the plan at all (its store lost it), a plan this client submitted is submitted
  again with the same id and spec (``recovered``, fleetwire/session.py), and a plan it only
  watches fails.

Any other close (a close code the coordinator chose on purpose, an auth failure while
reconnecting) or the give-up deadline ends the session as before: pending calls and
unfinished plans fail with ``FleetwireConnectionError``.

The resumer does no I/O of its own: the client gives it the three things it needs of a
driver (``dial``, ``attach``, ``end``), and it never reaches into the client.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Awaitable, Callable
from typing import Final, Generic, TypeVar

from fleetwire.errors import AuthError, FleetwireConnectionError
from fleetwire.session import ClientSession
from protocol.backoff import ReconnectBackoff
from protocol.errors import CLOSE_MOVED

__all__ = ["RESUMABLE_CLOSE_CODES", "Resumer"]

log = logging.getLogger("fleetwire.client")

# None: the connection dropped without a close frame (1006). 1001: the coordinator is shutting
# down (a restart). 1011-1014: server error, restart, try again later, bad gateway.
# 4307: cluster mode's ``moved`` (the driver dials the URL it named, else the next of its list).
CLOSE_TRY_AGAIN: Final = 1013  # also a main port's "no owner yet": a session closed before it served
RESUMABLE_CLOSE_CODES: Final = frozenset({None, 1001, 1006, 1011, 1012, 1013, 1014, 4307})

C = TypeVar("C")  # the driver's connection


class Resumer(Generic[C]):
    """Keeps a client session across dropped connections.

    Args:
        session: the session to resume.
        dial: opens a new connection (raises ``AuthError`` or ``FleetwireConnectionError``).
        attach: starts the driver's reader and writer on a new connection.
        end: ends the session for good with an error.
        enabled: False: a dropped connection ends the session (the SDK's v1 behaviour).
        base_s, cap_s: the backoff's first ceiling and its cap.
        give_up_s: how long without a session before giving up; None: never.
        urls: how many coordinator URLs ``dial`` tries in turn (protocol/backoff.py: a pass over them).
    """

    def __init__(
        self,
        session: ClientSession,
        *,
        dial: Callable[[], Awaitable[C]],
        attach: Callable[[C], None],
        end: Callable[[FleetwireConnectionError], None],
        enabled: bool,
        base_s: float,
        cap_s: float,
        give_up_s: float | None,
        urls: int = 1,
    ) -> None:
        if not 0 < base_s <= cap_s:
            raise ValueError("reconnect delays must satisfy 0 < reconnect_base_s <= reconnect_cap_s")
        self.enabled = enabled
        self.base_s = base_s
        self.cap_s = cap_s
        self.give_up_s = give_up_s
        self.urls = urls
        self._session = session
        self._dial = dial
        self._attach = attach
        self._end = end
        self._task: asyncio.Task[None] | None = None
        self._rng = random.Random()
        # One backoff for the client's life: refusals without a wait add up across sessions closed before serving.
        self._backoff = ReconnectBackoff(base_s, cap_s, urls=urls, rng=self._rng)

    @property
    def resumed(self) -> int:
        """Sessions resumed so far."""
        return self._session.resumed

    @property
    def resuming(self) -> bool:
        """Whether a reconnect is in progress."""
        return self._task is not None and not self._task.done()

    def can_resume(self, error: FleetwireConnectionError) -> bool:
        """Whether a connection that ended with ``error`` is worth dialling again."""
        return self.enabled and error.close_code in RESUMABLE_CLOSE_CODES

    def start(self, error: FleetwireConnectionError, *, served: bool = True, timed_out: bool = False) -> None:
        """Reconnect in the background after the connection ended with ``error`` (see ``can_resume``).

        ``served``: the coordinator answered on that connection (a frame, a keepalive's pong); a session it
        closed unanswered (``1011`` at once, ``1014``) is a refusal, not a served session (protocol/backoff.py).
        ``timed_out``: it went silent (no reply to the first request within the dial's bound, or nothing at all
        until the keepalive gave up): a dial that timed out, unanswered, not a refusal.
        A ``moved`` (4307) is cluster mode's routine hand-off to the shard's owner, logged at debug.
        """
        if error.close_code == CLOSE_MOVED:
            log.debug("fleetwire client: %s; following it", error)
        else:
            log.warning("fleetwire client: %s; reconnecting", error)
        self._task = asyncio.create_task(self._resume(error, served, timed_out), name="fleetwire-client-resume")

    def cancel(self) -> None:
        """Stop a reconnect in progress (the client is closing)."""
        if self._task is not None:
            self._task.cancel()

    async def _resume(self, error: FleetwireConnectionError, served: bool, timed_out: bool) -> None:
        loop = asyncio.get_running_loop()
        started = loop.time()
        backoff = self._backoff
        moved = error.close_code == CLOSE_MOVED  # told where to go: the first dial goes there at once
        if moved:
            delay = backoff.moved()
        elif timed_out:  # upgraded, then silent: as a dial that timed out (connection.py FirstReply)
            delay = backoff.unanswered()
        elif error.close_code == CLOSE_TRY_AGAIN or not served:  # closed before it served ("no owner yet", 1011)
            delay = backoff.refused()
        else:  # the session that ended was served
            delay = backoff.served()
        while True:
            if not moved:
                await asyncio.sleep(delay)
            moved = False
            try:
                connection = await self._dial()
            except AuthError as exc:  # retrying cannot fix a token
                self._end(FleetwireConnectionError(f"cannot resume the session: {exc}"))
                return
            except FleetwireConnectionError as exc:
                # An HTTP refusal (503 while the database is away, 429) is an answer: its Retry-After is the wait.
                delay = backoff.refused(exc.retry_after_s) if exc.answered else backoff.unanswered()
                if self.give_up_s is not None and loop.time() - started >= self.give_up_s:
                    why = f"{error}; gave up reconnecting after {self.give_up_s:g} s: {exc}"
                    self._end(FleetwireConnectionError(why))
                    return
                log.info("fleetwire client: reconnect failed (%s); retrying", exc)
                continue
            break
        # Replies that never came are asked for again, in order, before anything else is sent.
        self._session.resume()
        self._attach(connection)
        resumed = log.debug if error.close_code == CLOSE_MOVED else log.info
        resumed("fleetwire client: session resumed after %.2f s", loop.time() - started)
