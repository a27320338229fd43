"""The core's view of its connections: one :class:`Session` per open connection, keyed by conn id.

What it owns: the per-connection facts the core's handlers read and update (role, principal,
admin, the worker id a worker session speaks for, protocol-error and refusal counts, whether a
close was asked for).

Rules:

* The :class:`~coordinator.core.Coordinator` alone adds and removes sessions
  (``open_session``/``close_session``); every other part of the core reads the table it is
  handed, or changes fields of a session it was given.
* ``closing`` is set once, by :meth:`coordinator.effects.Outbox.close`: from then on nothing is
  sent to the session and its input is ignored.
* ``worker_id`` names the worker this session speaks for; it is cleared when the worker
  registers on a newer session, is reaped, or the session detaches, so that closing the old
  session never disconnects the worker's new one.
"""

from __future__ import annotations

from dataclasses import dataclass

from coordinator.scopes import Role

__all__ = ["Role", "Session", "SessionTable"]


@dataclass(eq=False)
class Session:
    """One connection, as the core sees it."""

    conn_id: int
    role: Role
    principal: str
    address: str
    admin: bool = False
    worker_id: str | None = None  # set by ``hello``; cleared when the id moves on
    closing: bool = False  # a close was asked for; later input is ignored
    protocol_errors: int = 0
    worker_ids: str | None = None  # the glob of worker ids its token may register (coordinator/scopes.py)
    quota_refusals: int = 0
    identity: str = ""  # the SHA-256 of the peer's verified client certificate (mTLS); "": none
    named_worker_id: str | None = None  # the id its upgrade named (?worker_id=); its hello must say the same


SessionTable = dict[int, Session]
"""The open sessions by conn id (the driver's connection ids)."""
