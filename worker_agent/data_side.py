"""The worker's data side, wired: the spool, the relay's end, the data endpoint and the spool's sweeper.

What it owns: starting and stopping, with ``Agent.run()`` (worker_agent/agent.py), the parts that
hold plans' bytes (worker_agent/spool.py, relay.py, dataplane.py), and the watch on the runner's
messages that tells them which attempts still take bytes (worker_agent/attempts.py).

Rules:

* The relay's end is always started: a worker without a data endpoint gets its bytes relayed. The
  data endpoint is started only with ``settings.data_listen``, after the open-file limit is raised
  (idle sockets at the endpoint must not starve the session's file descriptors).
* An attempt that ended before it ran drops its unclaimed inputs at once. Every
  ``min(10 s, output_retention_s / 4)`` the sweeper forgets attempts held for an assign that never
  came, and sweeps the spool (stale inputs, expired outputs), keeping the live attempts' files.
* A ``done``, a ``reject`` or a plan the runner stops speaking for ends its attempt
  (:class:`WatchedOutbound`): the data endpoint takes no more of its bytes.
* Stopping cancels the sweeper, closes the endpoint, resets the relay's end and closes the spool.
"""

from __future__ import annotations

import asyncio
import tempfile
from collections.abc import Callable
from typing import Any

import protocol
from protocol import errors
from worker_agent.attempts import Attempts
from worker_agent.dataplane import DataServer, server_tls, stale_input_seconds
from worker_agent.http_conn import raise_fd_limit
from worker_agent.outbox import SendQueue
from worker_agent.relay import RelayEndpoint
from worker_agent.settings import AgentSettings
from worker_agent.spool import Spool

__all__ = ["DataSide", "WatchedOutbound"]


class DataSide:
    """The worker's spool, relay end, data endpoint and sweeper, from ``start()`` to ``stop()``.

    Args:
        settings: the agent's settings (spool, data endpoint, retention, input timeout).
        worker_id: the worker's id (the spool's temporary directory, tickets' scope).
        attempts: which attempts the endpoint and the spool take bytes for.
        send: queues a message to the coordinator (the relay's ``data_*``).
        log: the agent's bound logger.

    Attributes:
        relay: the relay's end (worker_agent/relay.py), once started.
        server: the data endpoint (worker_agent/dataplane.py), once started with ``settings.data_listen``.
    """

    def __init__(
        self,
        settings: AgentSettings,
        worker_id: str,
        attempts: Attempts,
        send: Callable[[Any], None],
        log: Any,
    ) -> None:
        self._settings = settings
        self._worker_id = worker_id
        self._attempts = attempts
        self._send = send
        self._log = log
        self._sweeper: asyncio.Task[None] | None = None
        self.relay: RelayEndpoint | None = None
        self.server: DataServer | None = None

    async def start(self) -> Spool:
        """Start the spool, the relay's end, the data endpoint (``settings.data_listen``) and the sweeper.

        Raises:
            OSError: the data endpoint cannot listen where it was told to.
        """
        settings = self._settings
        root = settings.spool_dir or tempfile.mkdtemp(prefix=f"fleetwire-spool-{self._worker_id}-")
        spool = Spool(
            root, memory_bytes=settings.spool_memory_bytes, capacity_bytes=settings.spool_capacity_bytes,
            output_retention_s=settings.output_retention_s,
        )
        self._attempts.on_end = spool.drop_unclaimed  # an attempt that ended before it ran: its inputs go now
        self._attempts.keeps_reasons = settings.data_listen is not None  # read by the data endpoint's 410s only
        self.relay = RelayEndpoint(spool, worker_id=self._worker_id, send=self._send)
        if settings.data_listen is not None:
            before, now = raise_fd_limit()  # idle sockets at the data endpoint must not starve the session's fds
            if now != before:
                self._log.info("raised the open-file limit", soft_before=before, soft=now)
            host, _, port = settings.data_listen.rpartition(":")
            tls = None
            if settings.data_tls_cert and settings.data_tls_key:
                tls = server_tls(settings.data_tls_cert, settings.data_tls_key)
            server = DataServer(
                spool, worker_id=self._worker_id, host=host.strip("[]"), port=int(port),
                advertise=settings.data_advertise, tls=tls, stall_timeout_s=settings.upload_stall_timeout_s,
                attempts=self._attempts,
            )
            await server.start()
            self.server = server
        self._sweeper = asyncio.create_task(self._sweep(spool))
        return spool

    async def _sweep(self, spool: Spool) -> None:
        settings, attempts = self._settings, self._attempts
        while True:
            await asyncio.sleep(min(10.0, settings.output_retention_s / 4))
            attempts.expire()  # held before an assign that never came: their inputs go
            spool.sweep(stale_input_seconds(settings.input_timeout_s), keep=attempts.keeps)

    async def stop(self) -> None:
        """Stop the sweeper, close the endpoint, reset the relay's end and close the spool."""
        if self._sweeper is not None:
            self._sweeper.cancel()
        server, self.server = self.server, None
        if server is not None:
            await server.close()
        relay, self.relay = self.relay, None
        if relay is not None:
            relay.reset()
            relay.spool.close()


class WatchedOutbound:
    """The runner's outbound (the send queue), watched: a ``reject``, a ``done`` or a silenced plan ends its attempt
    in :class:`~worker_agent.attempts.Attempts` (its data endpoint takes no more of its bytes)."""

    def __init__(self, queue: SendQueue, attempts: Attempts) -> None:
        self._queue = queue
        self._attempts = attempts
        self.send_event = queue.send  # an event ends no attempt: the runner's events go straight to the queue

    def send(self, msg: Any) -> None:
        if type(msg) is protocol.Done:
            attempts = self._attempts  # its reason made only where it is kept (a worker with a data endpoint)
            attempts.ended(msg.plan_id, msg.attempt, f"ended {msg.outcome}" if attempts.keeps_reasons else "")
        elif type(msg) is protocol.Reject:
            why = "was revoked (to be placed again)" if msg.code == errors.REVOKED else f"was handed back: {msg.reason}"
            self._attempts.ended(msg.plan_id, msg.attempt, why)
        self._queue.send(msg)

    def forget(self, plan_id: str, attempt: int | None = None) -> None:
        self._attempts.ended(plan_id, attempt or 0, "is no longer run by this worker (taken back or handed back)")
        self._queue.forget(plan_id, attempt)
