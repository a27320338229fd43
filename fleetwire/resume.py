"""Session resumption for the client SDK: reconnect, re-send, re-subscribe (docs/PROTOCOL.md §Resuming).

Theory of operation. When a ``Client``'s connection drops (no close frame, ``1001`` going
away, ``1011``/``1012``/``1013``/``1014``), :class:`Resumer` keeps the session alive instead of
failing every call:

* it dials again after ``U(0, min(cap, base * 2**n))`` seconds (full jitter, the worker
  agent's backoff), for up to ``give_up_s`` without a session;
* on the new connection it first re-sends every request still waiting for its reply, in
  ``req_id`` order (submits are idempotent: the SDK always sends a plan id), then subscribes
  every unfinished plan again from the last ``seq`` it holds, so ``events()`` goes on with no
  gap and no duplicate (the plan drops a ``seq`` it already has);
* when the coordinator no longer holds some of those events it answers ``resync`` and the
  plan yields a ``resync`` marker event in their place (``fleetwire/plan.py``); when it no
  longer knows the plan at all (a coordinator without a durable store), that plan fails.

Any other close (a close code the coordinator chose on purpose, an auth failure while
reconnecting) or the give-up deadline ends the session as before: pending calls and
unfinished plans fail with ``FleetwireConnectionError``.
"""

from __future__ import annotations

import asyncio
import logging
import random
from typing import TYPE_CHECKING, Final

from fleetwire.errors import AuthError, FleetwireConnectionError, PlanNotFound
from protocol.messages import Subscribe, Subscribed

if TYPE_CHECKING:
    from fleetwire.client import Client
    from fleetwire.plan import Plan

__all__ = ["RESUMABLE_CLOSE_CODES", "Resumer"]

log = logging.getLogger("fleetwire.client")

# None: the connection dropped without a close frame (1006). 1001: the coordinator is shutting
# down (a restart). 1011-1014: server error, restart, try again later, bad gateway.
RESUMABLE_CLOSE_CODES: Final = frozenset({None, 1001, 1006, 1011, 1012, 1013, 1014})


class Resumer:
    """Keeps a ``Client`` session across dropped connections.

    Args:
        client: the client it serves.
        enabled: False: a dropped connection ends the session (the SDK's v1 behaviour).
        base_s, cap_s: the backoff's first ceiling and its cap.
        give_up_s: how long without a session before giving up; None: never.
    """

    def __init__(
        self, client: Client, *, enabled: bool, base_s: float, cap_s: float, give_up_s: float | None
    ) -> None:
        if not 0 < base_s <= cap_s:
            raise ValueError("reconnect delays must satisfy 0 < reconnect_base_s <= reconnect_cap_s")
        self.enabled = enabled
        self.base_s = base_s
        self.cap_s = cap_s
        self.give_up_s = give_up_s
        self.resumed = 0  # sessions resumed so far
        self._client = client
        self._task: asyncio.Task[None] | None = None
        self._rng = random.Random()

    @property
    def resuming(self) -> bool:
        """Whether a reconnect is in progress."""
        return self._task is not None and not self._task.done()

    def session_lost(self, error: FleetwireConnectionError) -> None:
        """The reader saw its connection end with ``error``: resume, or end the session."""
        client = self._client
        if not self.enabled or client._closing or error.close_code not in RESUMABLE_CLOSE_CODES:
            client._end(error)
            return
        log.warning("fleetwire client: %s; reconnecting", error)
        if client._writer is not None:  # it may hold a batch for the dead socket: pending requests are re-sent
            client._writer.cancel()
        self._task = asyncio.create_task(self._resume(error), name="fleetwire-client-resume")

    def cancel(self) -> None:
        """Stop a reconnect in progress (the client is closing)."""
        if self._task is not None:
            self._task.cancel()

    async def _resume(self, error: FleetwireConnectionError) -> None:
        client = self._client
        loop = asyncio.get_running_loop()
        started = loop.time()
        failures = 0
        floor_s = 0.0  # a refusal's Retry-After: the next try waits at least that long
        while True:
            await asyncio.sleep(max(floor_s, self._rng.uniform(0.0, min(self.cap_s, self.base_s * 2**failures))))
            try:
                ws = await client._dial()
            except AuthError as exc:  # retrying cannot fix a token
                client._end(FleetwireConnectionError(f"cannot resume the session: {exc}"))
                return
            except FleetwireConnectionError as exc:
                failures = min(failures + 1, 32)
                floor_s = exc.retry_after_s or 0.0
                if self.give_up_s is not None and loop.time() - started >= self.give_up_s:
                    why = f"{error}; gave up reconnecting after {self.give_up_s:g} s: {exc}"
                    client._end(FleetwireConnectionError(why))
                    return
                log.info("fleetwire client: reconnect failed (%s); retrying", exc)
                continue
            break
        self.resumed += 1
        # Replies that never came are asked for again, in order, before anything else is sent.
        pending = sorted(client._pending.items())
        client._outbox[:] = [p.raw for _, p in pending if p.raw is not None]
        client._attach(ws)
        log.info("fleetwire client: session resumed after %.2f s", loop.time() - started)
        live = [plan for plans in client._plans.values() for plan in plans if plan._live and not plan.done()]
        await asyncio.gather(*(self._resubscribe(plan) for plan in live), return_exceptions=True)

    async def _resubscribe(self, plan: Plan) -> None:
        client = self._client
        msg = Subscribe(req_id=next(client._req_ids), plan_ids=[plan.id], from_seq=plan.last_seq)
        try:
            await client._request(msg, Subscribed)
        except PlanNotFound:
            plan._fail(
                FleetwireConnectionError(
                    f"the coordinator no longer knows plan {plan.id!r} after the reconnect "
                    "(was it restarted without a durable store?)"
                )
            )
            client._unregister(plan)
