"""The per-connection driver: reads a session's frames and feeds them to what serves it.

Theory of operation. Every websocket session the front door (coordinator/io/frontdoor/door.py)
admits is served by a :class:`SessionHandler`: on a core's port, the core's session
(coordinator/io/frontdoor/core_driver.py ``CoreSession``); on a cluster's main port, a view session
across shards (coordinator/io/cluster/sessions.py) or a session moved to its shard's owner
(coordinator/io/cluster/host.py). :func:`read_frames` is the same loop for all of them, like
websockets' ``data_received``: decode a frame, ask the read policy (coordinator/read_policy.py),
hand the messages on, apply the verdict. What it never does: decide what a message means (the
handler's), send frames (the session's writer, coordinator/io/frontdoor/connection.py), or keep
counts of sessions (the door's).

The contract of a handler, in the order the door and the reader call it:

* ``opened(now)`` once, right after the upgrade, before any frame is read;
* ``await received(msgs, frame_bytes, now)`` for each frame within the message rate, never two at
  once; it returns the work units the messages cost beyond one each (coordinator/limits.py: rows
  a listing scanned, events a replay sent), and may yield to the loop (a frame over the frame
  budget). An exception it raises ends the connection;
* ``closed(now, code)`` exactly once: when the connection ended (``code`` None), or at once when
  the server closed it (``code``: 4429 flood, 4503 slow consumer, 4401 revoked token); from then
  on what the peer still sends is dropped and the handler is told nothing more.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, Protocol

from coordinator.io.frontdoor.connection import Session
from coordinator.io.stores.backlog import Backlog
from coordinator.read_policy import FLOOD, READ_ON, ConnectionPolicy

__all__ = ["SessionHandler", "read_frames"]


class SessionHandler(Protocol):
    """The server side of one websocket session, as :func:`read_frames` and the door drive it (module docstring)."""

    def opened(self, now: float) -> None:
        """The upgrade is done; no frame has been read yet."""

    async def received(self, msgs: list[Any], frame_bytes: int, now: float) -> int:
        """One frame's messages, decoded, read at ``now``; returns the work units spent beyond one per message."""

    def closed(self, now: float, code: int | None) -> None:
        """The session ended (``code`` None), or the server closed it with ``code``; called once."""


async def read_frames(
    session: Session, handler: SessionHandler, policy: ConnectionPolicy, *,
    kill: Callable[[Session, int, str], None], store: Backlog[Any] | None, clock: Callable[[], float],
) -> None:  # fmt: skip
    """Feed ``session``'s frames to ``handler`` within ``policy``'s verdicts until the connection ends.

    ``kill``: the door's close of a session (a flood: :data:`~coordinator.read_policy.FLOOD`);
    ``store``: the records waiting for the store, which readers wait on when over their bound
    (coordinator/io/stores/backlog.py; None: no store behind this port). Raises
    ``ConnectionClosed`` when the peer goes away mid-frame; the door handles it.
    """
    ws, codec, io = session.ws, session.codec, session.io
    async for frame in ws:
        io[0] += 1  # FrameCounters.FRAMES_IN, BYTES_IN
        io[1] += len(frame)
        if session.killed:
            continue  # closing: what it still sends is dropped
        now = clock()
        msgs = codec.decode(frame)
        pause = policy.admit(len(msgs), now)
        if pause is None:
            kill(session, *FLOOD)
            continue
        spent = await handler.received(msgs, len(frame), now)
        # Charged when handed on (a handler may have yielded, or waited on a database read).
        verdict = policy.after(len(msgs), len(frame), spent, clock(), pause, store is not None and store.over)
        if verdict is READ_ON:
            continue
        if verdict.wait_for_store and store is not None:
            await store.drained()  # the disk is behind: stop reading until it catches up
        if verdict.pause_s:
            await asyncio.sleep(verdict.pause_s)  # throttle: stop reading until the buckets refill
