"""Exceptions the client SDK raises, rooted in ``protocol.errors.FleetwireError``.

Every exception carries ``code``: the wire code from docs/PROTOCOL.md §Errors when the
coordinator sent one, or one of the SDK's own codes (``connection_lost``,
``unauthorized``, ``forbidden``) for failures that never reach the wire.

Exception tree::

    FleetwireError (code)                       protocol.errors
    ├── ProtocolError                           a frame or message broke the protocol
    │   └── DecodeError                         bytes that do not decode to a valid message
    ├── RequestError (code, req_id)             the coordinator answered with ``error``
    │   ├── PlanNotFound (plan_id)              ``plan_not_found``
    │   └── InvalidArgument                     ``invalid_argument`` (a submit it refused)
    ├── AuthError (status)                      HTTP 401/403 at the handshake
    ├── FleetwireConnectionError (close_code)   also a ``ConnectionError``: could not
    │                                           connect, or the session ended
    └── PlanError (plan_id)                     a plan ended without a result
        ├── PlanFailed (code, detail, worker_id, attempt)
        └── PlanCancelled (reason)

``AuthError`` is deliberately not a ``ConnectionError``: retrying with the same token
cannot succeed, so code that retries on ``ConnectionError`` must not loop on it.
"""

from __future__ import annotations

from typing import Any, Final

from protocol import errors as codes
from protocol.errors import DecodeError, FleetwireError, ProtocolError, RequestError

__all__ = [
    "AuthError",
    "DecodeError",
    "FleetwireConnectionError",
    "FleetwireError",
    "InvalidArgument",
    "PlanCancelled",
    "PlanError",
    "PlanFailed",
    "PlanNotFound",
    "ProtocolError",
    "RequestError",
    "request_error",
]

# SDK-local codes: these never travel on the wire.
CONNECTION_LOST: Final = "connection_lost"
UNAUTHORIZED: Final = "unauthorized"
FORBIDDEN: Final = "forbidden"


class PlanNotFound(RequestError):
    """The coordinator has no plan with this id (or none this client may see)."""

    code = codes.PLAN_NOT_FOUND

    def __init__(self, message: str, *, plan_id: str | None, req_id: int = 0) -> None:
        super().__init__(message, code=codes.PLAN_NOT_FOUND, req_id=req_id)
        self.plan_id = plan_id


class InvalidArgument(RequestError):
    """The coordinator refused a request's arguments (e.g. ``max_attempts`` 0)."""

    code = codes.INVALID_ARGUMENT


def request_error(code: str, message: str, *, req_id: int = 0, plan_id: str | None = None) -> RequestError:
    """The exception for an ``error`` reply: the most specific class for its code."""
    if code == codes.PLAN_NOT_FOUND:
        return PlanNotFound(message, plan_id=plan_id, req_id=req_id)
    if code == codes.INVALID_ARGUMENT:
        return InvalidArgument(message, code=code, req_id=req_id)
    return RequestError(message, code=code, req_id=req_id)


class AuthError(FleetwireError):
    """The coordinator refused the token at the handshake (HTTP 401 or 403)."""

    code = UNAUTHORIZED

    def __init__(self, message: str, *, status: int) -> None:
        super().__init__(message, code=UNAUTHORIZED if status == 401 else FORBIDDEN)
        self.status = status


class FleetwireConnectionError(FleetwireError, ConnectionError):
    """The session could not be opened, or it ended while a call or a plan waited on it.

    ``close_code`` and ``close_reason`` are the websocket close frame's, when there was one
    (docs/PROTOCOL.md §Close codes), else ``None`` and ``""``. ``retry_after_s`` is the wait a
    refused handshake asked for (HTTP 429 or 503 with ``Retry-After``), else ``None``.
    ``answered``: a coordinator answered the dial (an HTTP refusal) rather than nothing at all; the
    reconnect backoff counts it as a refusal, not a dial nobody answered (protocol/backoff.py).
    """

    code = CONNECTION_LOST

    def __init__(
        self,
        message: str,
        *,
        close_code: int | None = None,
        close_reason: str = "",
        retry_after_s: float | None = None,
        answered: bool = False,
    ) -> None:
        super().__init__(message)
        self.close_code = close_code
        self.close_reason = close_reason
        self.retry_after_s = retry_after_s
        self.answered = answered


class PlanError(FleetwireError):
    """A plan ended without a result."""

    def __init__(self, message: str, *, plan_id: str, code: str | None = None) -> None:
        super().__init__(message, code=code)
        self.plan_id = plan_id


class PlanFailed(PlanError):
    """The plan ended ``failed``; ``code``, ``message`` and ``detail`` come from its ``failed`` event."""

    def __init__(
        self,
        message: str,
        *,
        plan_id: str,
        code: str,
        detail: Any = None,
        worker_id: str | None = None,
        attempt: int = 0,
    ) -> None:
        super().__init__(message, plan_id=plan_id, code=code)
        self.detail = detail
        self.worker_id = worker_id
        self.attempt = attempt

    def __str__(self) -> str:
        return f"plan {self.plan_id} failed ({self.code}): {self.message}"

    @property
    def message(self) -> str:
        return str(self.args[0])


class PlanCancelled(PlanError):
    """The plan ended ``cancelled``; ``reason`` says by whom or why, when known."""

    code = codes.CANCELLED

    def __init__(self, plan_id: str, reason: str = "") -> None:
        text = f"plan {plan_id} was cancelled" + (f": {reason}" if reason else "")
        super().__init__(text, plan_id=plan_id)
        self.reason = reason
