"""References across shards (cluster mode): one shard's driver reads the upstreams its consumers need from other shards.

Theory of operation (docs/SEMANTICS.md §Graphs, docs/CLUSTER.md §Shards and pools). A shard's core holds only its
own shard's plans, and it does no I/O; the rows of every shard are in PostgreSQL. So:

* **At submit.** Before a ``submit`` whose references or ``after`` name an id the core does not know for that
  session (``PlanGraphs.unknown_upstreams``: one dict look-up per id, only for submits that have some) goes to
  the core, :meth:`RemoteRefs.before_submit` looks the id up as the cross-shard views do (``views.plan_shard``:
  the caller's own plan of that id in any shard, an admin's by key), reads its row and tells the core
  (``PlanGraphs.remote_seen``). The session's later messages wait behind it (its order is kept); other sessions
  do not. The core then resolves the id to the remote upstream, or refuses it as before (no shard holds it, or
  it is another principal's). When the database cannot be read the submit is answered ``unavailable``
  (``retry_after_s``), and the SDK sends it again, as while the store is away.
* **While they run.** While some remote upstream has not ended, one query every ``interval_s`` reads all of
  their rows by store key (``views.read_watched``, no events rows) and tells the core each; a row gone
  (forgotten there) is ``PlanGraphs.remote_gone``. A succeeded one's ``data_ready`` event (the holder's data
  endpoint) is read with its events once. Nothing runs while none waits.
* **Restart and failover.** A consumer's reference is stored with the upstream's store key
  (coordinator/graphs/remote.py): a new owner's core restores a placeholder for it, and the loop reads it.
* **The ticket key.** A pull from a worker served by another shard's core is signed with a key every core of the
  cluster shares (``DataPlane.shared``), rotated and derived from the cluster secret: shared_keys.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable
from contextlib import AbstractAsyncContextManager
from typing import TYPE_CHECKING, Any, Final

import structlog

from coordinator.graphs.remote import RemotePlan, remote_key, remote_row
from coordinator.io.cluster.views import plan_shard, read_watched
from coordinator.views import Watched
from protocol.messages import Submit

if TYPE_CHECKING:
    from coordinator.io.frontdoor.server import CoordinatorServer
    from coordinator.plans import Plan

__all__ = ["INTERVAL_S", "RemoteRefs", "remote_plan"]

log = structlog.get_logger(__name__)

INTERVAL_S: Final = 0.5
"""How often the rows of unfinished remote upstreams are read."""

_NO_EVENTS: Final = 2**31 - 1  # a ``since`` past every events row: the plan's row alone

Connect = Callable[[], AbstractAsyncContextManager[Any]]


def remote_plan(row: int, shard: int, plan: Plan) -> RemotePlan:
    """What a shard's core is told of a plan of another shard read from its row (``row``: its store key)."""
    url = ""
    for event in reversed(plan.events):
        data = event.data
        if event.kind == "data_ready" and isinstance(data, dict) and data.get("attempt") == plan.attempt:
            url = str(data.get("url") or "")
            break
    return RemotePlan(remote_key(row), plan.owner, plan.name or plan.id, shard=shard, key=plan.id, state=plan.state,
                      attempt=plan.attempt, worker_id=plan.worker_id, produced=tuple(plan.produced), error=plan.error,
                      data_url=url)  # fmt: skip


class RemoteRefs:
    """One shard's reader of its consumers' remote upstreams (module docstring).

    Args:
        server: the shard's server (its core, and its driver's flush).
        shard: the shard it serves (an id found in it is the core's own, not remote).
        connect: a connection of the views' pool (``ViewSessions.conn``).
        interval_s: how often unfinished remote upstreams are read.
    """

    def __init__(self, server: CoordinatorServer, shard: int, connect: Connect, *,
                 interval_s: float = INTERVAL_S) -> None:  # fmt: skip
        self.server = server
        self.shard = shard
        self.connect = connect
        self.interval_s = interval_s
        self.lookups = 0  # submits that waited for a look-up (tests, metrics)
        self.reads = 0  # rounds of the loop that read rows
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        server.driver.upstreams = self.before_submit  # from the core's first submit on

    def start(self) -> None:
        """Start the loop once the core has loaded its plans (the restored consumers' remote upstreams are read)."""
        self._task = asyncio.ensure_future(self._loop())

    async def stop(self) -> None:
        self.server.driver.upstreams = None
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task

    # ------------------------------------------------------------------ at submit

    def before_submit(self, conn_id: int, msg: Submit) -> Awaitable[str | None] | None:
        """None when the core knows every upstream ``msg`` names; else the look-up to wait for first (its answer:
        why the database could not be read, or None)."""
        core = self.server.core
        session = core.sessions.get(conn_id)
        if session is None:
            return None
        unknown = core.graphs.unknown_upstreams(msg, session.principal, session.admin)
        if not unknown:
            return None
        self.lookups += 1
        return self._look_up(unknown, None if session.admin else session.principal)

    async def _look_up(self, ids: list[str], owner: str | None) -> str | None:
        try:
            async with self.connect() as conn:
                found: list[tuple[int, int]] = []
                for plan_id in ids:
                    where = await plan_shard(conn, plan_id, owner)
                    if where is not None and where[0] != self.shard:
                        found.append((where[2], where[0]))
                plans = await read_watched(conn, [Watched(row, "", shard, 0, 0) for row, shard in found])
        except Exception as exc:  # the submit is answered unavailable: the client sends it again
            log.warning("cannot look up a submit's upstreams in the other shards", error=f"{type(exc).__name__}: {exc}")
            return f"cannot look up its upstreams in the other shards now ({type(exc).__name__})"
        self._tell({row: (shard, plans.get(row)) for row, shard in found})
        self._wake.set()
        return None

    # ------------------------------------------------------------------ while they run

    def _tell(self, rows: dict[int, tuple[int, Plan | None]]) -> None:
        """Hand the rows read to the core and send what that changed."""
        core = self.server.core
        graphs, now = core.graphs, time.monotonic()
        for row, (shard, plan) in rows.items():
            if plan is None:
                graphs.remote_gone(remote_key(row), now)
            else:
                graphs.remote_seen(remote_plan(row, shard, plan), now)
        self.server.driver.flush()

    async def _loop(self) -> None:
        while True:
            graphs = self.server.core.graphs
            waiting = {row: plan.shard for plan in graphs.remotes.unfinished()
                       if (row := remote_row(plan.id)) is not None}  # fmt: skip
            if not waiting:
                self._wake.clear()
                await self._wake.wait()
                continue
            try:
                await self._read(waiting)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # read again next time
                log.warning("cannot read the remote upstreams' rows", error=f"{type(exc).__name__}: {exc}")
            await asyncio.sleep(self.interval_s)

    async def _read(self, waiting: dict[int, int]) -> None:
        async with self.connect() as conn:
            plans = await read_watched(conn, [Watched(row, "", 0, 0, _NO_EVENTS) for row in waiting])
            ended = [row for row, plan in plans.items() if plan.state == "succeeded"]
            if ended:  # its data_ready event names the holder's endpoint
                plans.update(await read_watched(conn, [Watched(row, "", 0, 0, 0) for row in ended]))
        self.reads += 1
        self._tell({row: (shard if shard >= 0 else -1, plans.get(row)) for row, shard in waiting.items()})
