"""Which session may send what: the per-message scope rules the core enforces (close 4403).

Rules (docs/SEMANTICS.md §Scopes; docs/OPERATIONS.md §Test matrix row 14):

* A client session that sends a worker message (``hello``, ``heartbeat``, ``accept``, ...)
  or a worker session that sends a client message (``submit``, ``cancel``, ...) is not
  confused, it is overstepping its token: the session is closed with 4403. A type that
  belongs to neither role (a typo, or a coordinator-to-peer type) stays an ordinary
  protocol error, ``error(unknown_type)``.
* A worker token may carry a glob of the worker ids it may register as (``gpu-*``); a
  ``hello`` with another id is closed with 4403 (Kubernetes' NodeRestriction, in small).
* A worker that names the *current* attempt of a lease held by another worker is acting on
  another worker's lease: closed with 4403. An older attempt, its own or not, cannot be
  told apart from a worker that is late after a partition, so it stays ``stale_lease``.

Every check here is a pure function of the message and the coordinator's state; none
changes anything, so a refusal leaves the state exactly as it was. The core logs the
refusal once, with the connection's identity, and closes the session.
"""

from __future__ import annotations

from fnmatch import fnmatchcase
from typing import Final, Literal

from protocol.messages import FromClient, FromWorker, type_names

__all__ = ["FOREIGN_TYPES", "SCOPE_REASONS", "ScopeReason", "foreign_type", "lease_of_another", "worker_id_refused"]

Role = Literal["worker", "client"]

#: Why a session was closed 4403, the ``reason`` label of ``fleetwire_scope_refused_total``:
#: a message only the other role may send, a ``hello`` with a worker id outside the token's
#: glob, a message about another worker's current lease.
ScopeReason = Literal["foreign_type", "worker_id", "foreign_lease"]
SCOPE_REASONS: Final[tuple[ScopeReason, ...]] = ("foreign_type", "worker_id", "foreign_lease")

# The message types each role may send; a type of the other role's list is a scope breach.
_SENT_BY: Final[dict[Role, frozenset[str]]] = {"worker": type_names(FromWorker), "client": type_names(FromClient)}
FOREIGN_TYPES: Final[dict[Role, frozenset[str]]] = {
    "worker": _SENT_BY["client"] - _SENT_BY["worker"],
    "client": _SENT_BY["worker"] - _SENT_BY["client"],
}


def foreign_type(role: Role, mtype: str | None) -> bool:
    """Whether ``mtype`` is a message only the *other* role may send."""
    return mtype is not None and mtype in FOREIGN_TYPES[role]


def worker_id_refused(allowed: str | None, worker_id: str) -> str | None:
    """Why a token limited to the worker ids ``allowed`` (a glob) may not register ``worker_id``.

    Returns:
        None when it may (no limit, or the id matches), else the reason in words.
    """
    if allowed is None or fnmatchcase(worker_id, allowed):
        return None
    return f"this token may only register worker ids matching {allowed!r}, not {worker_id!r}"


def lease_of_another(
    plan_worker_id: str | None, plan_attempt: int, worker_id: str, attempt: int, *, held: bool = True
) -> str | None:
    """Why a message from ``worker_id`` about ``attempt`` acts on another worker's lease.

    Args:
        plan_worker_id: the worker of the plan's current (or last) lease; None while queued.
        plan_attempt: the plan's current (or last) attempt.
        worker_id: the worker that sent the message.
        attempt: the attempt the message names.
        held: whether ``plan_worker_id`` still holds that lease. A plan that finished (its
            worker's ``done`` arrived) or was requeued has no lease: a message about its last
            attempt is late, not a trespass (``stale_lease``).

    Returns:
        None when the message is not about another worker's current lease, else the reason.
    """
    if not held or attempt != plan_attempt or plan_worker_id is None or plan_worker_id == worker_id:
        return None
    return f"attempt {attempt} is leased to another worker"
