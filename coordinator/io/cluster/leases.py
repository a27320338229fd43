"""Shard lease rows in PostgreSQL, and the loop that keeps them (cluster mode, docs/CLUSTER.md).

The state machine is pure (coordinator/shards.py); this module runs its statements. Every
time comparison is PostgreSQL's ``now()``: a lease is free when ``expires_at < now()``, and is
held until ``now() + ttl`` of the statement that last renewed it. No advisory locks (a session
lock held by a vanished host outlives it by ``tcp_keepalives_idle``, 2 h by default) and no
comparison of two hosts' clocks.

* **Acquire or renew** (one statement over every wanted slot, :data:`ACQUIRE`): a slot that
  expired, or that this owner holds, becomes this owner's until ``now() + ttl``; the epoch grows
  by one when the owner changes. The owner id is unique per process run, so a restarted
  coordinator takes a new epoch too.
* **Fence** (:data:`FENCE`, run by the store in every group commit's own transaction): the
  slots written must still be this owner's, at the epochs it was given, unexpired. ``FOR SHARE``
  orders the commit against a takeover's UPDATE of the same row: a commit either lands before
  the takeover (and the new owner's load sees it) or finds the row changed and fails.
* **Release** (:data:`RELEASE`, on SIGTERM after the last flush): ``expires_at = now()``, so a
  standby takes the slots at its next scan instead of after the TTL.

:class:`LeaseKeeper` drives :class:`~coordinator.shards.ShardLeases` on the server's loop and
reports to the server: ``on_acquired`` once it holds every slot (load and serve), ``on_fenced``
when it lost one or could not renew in time (fail-stop: the process exits
:data:`EXIT_SHARD_FENCED`).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

import structlog

from coordinator.io.stores.integrity import StoreError
from coordinator.shards import ClusterConfig, LeaseState, Outcome, ShardLeases

__all__ = ["ACQUIRE", "EXIT_SHARD_FENCED", "FENCE", "RELEASE", "LeaseKeeper", "LeaseStore", "ShardFenced"]

log = structlog.get_logger(__name__)

EXIT_SHARD_FENCED = 4
"""Exit status of a coordinator that stopped because it lost a shard lease (fail-stop)."""

ACQUIRE = """
UPDATE shard_leases SET
    epoch = CASE WHEN owner = $1 THEN epoch ELSE epoch + 1 END,
    acquired_at = CASE WHEN owner = $1 THEN acquired_at ELSE now() END,
    owner = $1, owner_url = $2,
    expires_at = now() + make_interval(secs => $3)
WHERE shard = ANY($4::int[]) AND (owner = $1 OR expires_at < now())
RETURNING shard, epoch
"""
FENCE = """
SELECT l.shard FROM shard_leases l JOIN unnest($1::int[], $2::bigint[]) AS f(shard, epoch)
    ON l.shard = f.shard AND l.epoch = f.epoch
WHERE l.owner = $3 AND l.expires_at > now()
FOR SHARE OF l
"""
RELEASE = "UPDATE shard_leases SET expires_at = now() WHERE owner = $1 AND shard = ANY($2::int[]) RETURNING shard"


class ShardFenced(StoreError):
    """A group commit or a lease renewal found that this coordinator no longer holds its shard."""


class LeaseStore(Protocol):
    """What the keeper needs from the store: its lease statements and the fence it applies."""

    description: str
    fence: dict[int, int]
    owner: str

    def call(self, make: Callable[[Any], Awaitable[Any]]) -> asyncio.Future[Any]:
        """Run ``make(lease_connection)`` on the store's connection loop; its result as a future."""
        ...


class LeaseKeeper:
    """Acquires, renews and releases this coordinator's shard leases.

    Args:
        store: a PostgreSQL store (coordinator/io/stores/postgres.py).
        config: the cluster settings.
        owner: this process run's unique id (host, pid, random).
        url: where this coordinator serves (kept in the lease row for phase 2's topology).
        on_acquired: called once, on the loop, when every slot is held.
        on_fenced: called once, on the loop, with a :class:`ShardFenced` when a held slot is lost.
    """

    def __init__(
        self,
        store: LeaseStore,
        config: ClusterConfig,
        owner: str,
        *,
        on_acquired: Callable[[], None],
        on_fenced: Callable[[BaseException], None],
        url: str = "",
    ) -> None:
        self.store = store
        self.config = config
        self.leases = ShardLeases(config, owner)
        store.owner = owner
        self.url = url
        self._on_acquired = on_acquired
        self._on_fenced = on_fenced
        self._task: asyncio.Task[None] | None = None
        self.acquired_at: float | None = None  # monotonic time the slots were all held
        self.errors = 0  # attempts that got no answer

    @property
    def owner(self) -> str:
        return self.leases.owner

    @property
    def serving(self) -> bool:
        return self.leases.state is LeaseState.OWNER

    async def attempt(self) -> Outcome:
        """One acquire-or-renew round trip (also what :meth:`run` does each period)."""
        leases = self.leases
        wanted = leases.attempt(time.monotonic())
        try:
            rows = await self.store.call(
                lambda conn: conn.fetch(ACQUIRE, leases.owner, self.url, self.config.lease_ttl_s, wanted)
            )
        except Exception as exc:  # the database is away or refused: judged by the lease's own clock
            self.errors += 1
            log.warning("shard lease attempt failed", store=self.store.description,
                        error=f"{type(exc).__name__}: {exc}")  # fmt: skip
            return self._act(leases.failed(time.monotonic()))
        return self._act(leases.result([(r[0], r[1]) for r in rows], time.monotonic()))

    def _act(self, outcome: Outcome) -> Outcome:
        leases = self.leases
        if outcome is Outcome.ACQUIRED:
            self.store.fence = dict(leases.held)
            self.acquired_at = time.monotonic()
            log.info("shard leases acquired: serving", shards=len(leases.held), owner=leases.owner,
                     epochs=_epochs(leases.held))  # fmt: skip
            self._on_acquired()
        elif outcome is Outcome.FENCED:
            self.store.fence = {}
            self._on_fenced(ShardFenced(f"{leases.why} (owner {leases.owner}); this coordinator stops serving"))
        elif outcome is Outcome.GIVE_BACK:
            held = sorted(leases.held)
            task = asyncio.ensure_future(self._release(held))
            task.add_done_callback(lambda t: t.exception() if not t.cancelled() else None)
        elif leases.state is LeaseState.OWNER:
            self.store.fence = dict(leases.held)
        return outcome

    async def run(self) -> None:
        """Attempt at every due time and self-demote when renewals stop succeeding; until cancelled or fenced."""
        leases = self.leases
        while leases.state in (LeaseState.STANDBY, LeaseState.OWNER):
            # Sleep until the next attempt, but wake for the self-demotion deadline if it comes first.
            now = time.monotonic()
            wait = leases.due(now)
            if leases.state is LeaseState.OWNER:
                wait = min(wait, max(0.0, leases.valid_until - now))
            if wait:
                await asyncio.sleep(wait)
            if self._act(leases.check(time.monotonic())) is Outcome.FENCED:
                return
            now = time.monotonic()
            if leases.due(now) == 0:
                # A renewal that hangs (a network partition) must not hold self-demotion back. In this task under
                # asyncio.timeout, not under asyncio.wait_for: on Python 3.11 wait_for loses a cancel that arrives
                # as the attempt ends, and stop() then waited for this loop for ever (test_cluster_stop.py).
                timeout = max(0.0, leases.valid_until - now) if leases.state is LeaseState.OWNER else None
                try:
                    async with asyncio.timeout(timeout):
                        await self.attempt()
                except TimeoutError:
                    self._act(leases.check(time.monotonic()))

    def start(self) -> None:
        """Run :meth:`run` in a task (call on the loop)."""
        if self._task is None:
            self._task = asyncio.create_task(self.run())

    async def stop(self, *, release: bool) -> None:
        """Stop renewing; with ``release``, give every held slot back at once (``expires_at = now()``)."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        self.store.fence = {}
        if release and self.leases.held and self.leases.state is not LeaseState.FENCED:
            await self._release(sorted(self.leases.held))

    async def _release(self, shards: list[int]) -> None:
        owner = self.leases.owner
        try:
            rows = await self.store.call(lambda conn: conn.fetch(RELEASE, owner, shards))
        except Exception as exc:
            log.warning("shard leases not released; they expire after the TTL", error=f"{type(exc).__name__}: {exc}")
            return
        self.leases.released()
        log.info("shard leases released", shards=len(rows), owner=owner)


def _epochs(held: dict[int, int]) -> str:
    epochs = sorted(set(held.values()))
    return str(epochs[0]) if len(epochs) == 1 else f"{epochs[0]}..{epochs[-1]}"
