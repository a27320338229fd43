"""Stable error codes and close codes of the wire protocol, and the shared exception tree.

Codes are part of the contract (docs/PROTOCOL.md §Errors): never renamed, only added.

Exception tree::

    FleetwireError (code)
    ├── ProtocolError            a frame or message broke the protocol
    │   └── DecodeError          bytes that do not decode to a valid message
    └── RequestError             the peer answered a request with an ``error`` message
"""

from __future__ import annotations

from typing import Final

# ---- error codes carried in ``error`` messages and ``ErrorInfo``
BAD_FRAME: Final = "bad_frame"  # not valid msgpack/JSON at all
INVALID_MESSAGE: Final = "invalid_message"  # a known type whose fields do not validate
UNKNOWN_TYPE: Final = "unknown_type"  # a type this session role does not accept
NOT_REGISTERED: Final = "not_registered"  # a worker message before ``hello``
ALREADY_REGISTERED: Final = "already_registered"  # a second ``hello`` on one session
PLAN_NOT_FOUND: Final = "plan_not_found"
UNKNOWN_WORKER: Final = "unknown_worker"
STALE_LEASE: Final = "stale_lease"  # an attempt that is no longer the plan's lease
INVALID_TRANSITION: Final = "invalid_transition"
INVALID_ARGUMENT: Final = "invalid_argument"
UNKNOWN_OP: Final = "unknown_op"  # plan failure / reject: the worker has no handler
REJECTED: Final = "rejected"  # reject: the worker is full or draining
REVOKED: Final = "revoked"  # reject: the worker dropped an unstarted plan the coordinator revoked
HANDLER_ERROR: Final = "handler_error"  # plan failure: the handler raised
ENGINE_ERROR: Final = "engine_error"  # plan failure: the inference engine was unreachable or refused the request
TIMEOUT: Final = "timeout"  # plan failure: the plan's timeout_s passed
WORKER_LOST: Final = "worker_lost"  # plan failure: attempts exhausted by lost workers
CANCELLED: Final = "cancelled"
INTERNAL: Final = "internal"
TOO_MANY_PLANS: Final = "too_many_plans"  # submit: the principal has its limit of unfinished plans
FORBIDDEN: Final = "forbidden"  # an operator request (drain/undrain) from a token without the admin role
WORKER_ID_IN_USE: Final = "worker_id_in_use"  # hello: a live session holds the id and no proof was given
UNAVAILABLE: Final = "unavailable"  # submit: the store cannot take writes now (database failover); retry_after_s
TOO_MANY_RECONNECTS: Final = "too_many_reconnects"  # hello: the worker id registers too often; retry_after_s
UPSTREAM_FAILED: Final = "upstream_failed"  # plan failure: a plan whose output it uses (or runs after) did not succeed
OUTPUT_LOST: Final = "output_lost"  # plan failure: an output it uses is gone and cannot be rebuilt
TICKET_REFUSED: Final = "ticket_refused"  # plan failure: the worker holding an input refused the ticket to fetch it

ERROR_CODES: Final = (
    BAD_FRAME, INVALID_MESSAGE, UNKNOWN_TYPE, NOT_REGISTERED, ALREADY_REGISTERED,
    PLAN_NOT_FOUND, UNKNOWN_WORKER, STALE_LEASE, INVALID_TRANSITION, INVALID_ARGUMENT,
    UNKNOWN_OP, REJECTED, REVOKED, HANDLER_ERROR, ENGINE_ERROR, TIMEOUT, WORKER_LOST, CANCELLED, INTERNAL,
    TOO_MANY_PLANS, FORBIDDEN, WORKER_ID_IN_USE, UNAVAILABLE, TOO_MANY_RECONNECTS, UPSTREAM_FAILED, OUTPUT_LOST,
    TICKET_REFUSED,
)

# ---- websocket close codes (RFC 6455 §7.4; 4000-4999 are ours)
CLOSE_NORMAL: Final = 1000
CLOSE_GOING_AWAY: Final = 1001  # coordinator shutting down
CLOSE_TOO_BIG: Final = 1009  # frame above the size limit
CLOSE_INTERNAL: Final = 1011
CLOSE_PROTOCOL: Final = 4400  # repeated protocol violations
CLOSE_REVOKED: Final = 4401  # the session's token was revoked (token file reloaded without it)
CLOSE_FORBIDDEN: Final = 4403  # a message this role or token may not send (scope)
CLOSE_HEARTBEAT_TIMEOUT: Final = 4408  # the worker stopped beating and was reaped
CLOSE_REMOVED: Final = 4410  # an operator removed this worker for good (``remove_worker``): do not reconnect
CLOSE_REPLACED: Final = 4409  # the worker id moved to a newer session (with proof), or was refused to this one
CLOSE_RATE_LIMITED: Final = 4429  # the peer kept sending faster than its message rate limit, or its
# worker id registered (hello) more often than its reconnect budget (too_many_reconnects)
CLOSE_MOVED: Final = 4307  # cluster mode: another coordinator owns the shard; a ``moved`` message says where
CLOSE_SLOW_CONSUMER: Final = 4503  # the peer stopped reading; its outgoing buffer hit the limit


def retry_after_seconds(value: str | None) -> float | None:
    """The wait a refused handshake's ``Retry-After`` header asks for (HTTP 429 penalty box, 503).

    Only delay-seconds are understood (the coordinator sends nothing else); an HTTP date,
    garbage or a value outside 0..3600 s gives ``None`` (no hint).
    """
    try:
        seconds = float(value) if value is not None else None
    except ValueError:
        return None
    return seconds if seconds is not None and 0.0 <= seconds <= 3600.0 else None


class FleetwireError(Exception):
    """Base of every fleetwire exception; ``code`` is a stable wire code."""

    code: str = INTERNAL

    def __init__(self, message: str, *, code: str | None = None) -> None:
        super().__init__(message)
        if code is not None:
            self.code = code

    @property
    def message(self) -> str:
        return str(self)


class ProtocolError(FleetwireError):
    """A frame or message broke the protocol."""

    code = INVALID_MESSAGE


class DecodeError(ProtocolError):
    """Bytes that do not decode to a valid message."""

    code = BAD_FRAME


class RequestError(FleetwireError):
    """The peer answered a request with an ``error`` message."""

    def __init__(self, message: str, *, code: str, req_id: int = 0) -> None:
        super().__init__(message, code=code)
        self.req_id = req_id
