"""The OpenAI front door's errors: one exception, OpenAI's error shape, the status of each case.

Exception tree (one class: the status and the ``type``/``code`` say the case)::

    ApiError (status, message, type, code, param, retry_after_s)

Every refusal the door answers is an :class:`ApiError`, written as OpenAI writes its errors
(docs/OPENAI.md §Errors)::

    {"error": {"message": str, "type": str, "param": str | null, "code": str | null}}

with the HTTP status OpenAI's clients map to their exception classes (the ``openai`` package raises
``BadRequestError`` for 400, ``AuthenticationError`` 401, ``PermissionDeniedError`` 403,
``NotFoundError`` 404, ``RateLimitError`` 429, ``InternalServerError`` for 5xx).

==========  ========================  =========================================================
status      type                      when
==========  ========================  =========================================================
400         invalid_request_error     the body is not JSON, a field is wrong, ``n`` > 1, the
                                      handler or the engine refused the request as malformed
401         authentication_error      no ``Authorization: Bearer`` key, or an unknown one
403         permission_error          a worker's key (only client and admin keys submit)
404         invalid_request_error     ``model_not_found``: no connected worker serves the model;
                                      an unknown path
405         invalid_request_error     a method the path does not take
411         invalid_request_error     a body sent without ``Content-Length``
413         invalid_request_error     the body is over the door's limit
421         invalid_request_error     cluster mode: a shard's own port was sent a request of
                                      another shard's pool (send it to a main port)
431         invalid_request_error     the request head is over the door's limit
429         rate_limit_error          the principal's unfinished plans or its request rate are
                                      at their limit (``Retry-After``)
500         server_error              the coordinator failed (its log says why)
502         server_error              the engine failed or could not be reached
503         server_error              no worker took the request within the queue timeout, the
                                      worker was lost, the store is away (``Retry-After``)
504         server_error              the plan's ``timeout_s`` passed
==========  ========================  =========================================================

:func:`plan_failure` maps a plan's ``failed`` event (its stable code, docs/PROTOCOL.md §8) to
one of these. Pure: no I/O.
"""

from __future__ import annotations

from typing import Any, Final

import msgspec

from protocol import errors as codes

__all__ = ["TYPES", "ApiError", "plan_failure", "submit_refused"]

#: The ``type`` of an error of each status (module docstring).
TYPES: Final[dict[int, str]] = {
    400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
    404: "invalid_request_error", 405: "invalid_request_error", 411: "invalid_request_error",
    413: "invalid_request_error", 421: "invalid_request_error", 431: "invalid_request_error",
    429: "rate_limit_error", 500: "server_error", 502: "server_error", 503: "server_error", 504: "server_error",
}

_ENCODE = msgspec.json.Encoder().encode


class ApiError(Exception):
    """A request the door refuses, or a plan that ended without an answer (module docstring).

    Args:
        status: the HTTP status.
        message: what was wrong, for a person.
        code: OpenAI's ``code`` (``invalid_api_key``, ``model_not_found``, ...) or a fleetwire
            plan code (``engine_error``, ``worker_lost``, ...); None: none.
        param: the request field at fault (``messages[2].content``); None: none.
        retry_after_s: sent as ``Retry-After`` (429, 503); 0: not sent.
    """

    def __init__(
        self, status: int, message: str, *, code: str | None = None, param: str | None = None,
        retry_after_s: float = 0.0,
    ) -> None:  # fmt: skip
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param
        self.retry_after_s = retry_after_s

    @property
    def type(self) -> str:
        """OpenAI's error ``type`` for the status."""
        return TYPES.get(self.status, "server_error" if self.status >= 500 else "invalid_request_error")

    def shape(self) -> dict[str, Any]:
        """``{"error": {...}}`` as OpenAI answers it."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def body(self) -> bytes:
        """:meth:`shape` as JSON bytes."""
        return _ENCODE(self.shape())

    def __repr__(self) -> str:
        return f"ApiError({self.status}, {self.message!r}, code={self.code!r}, param={self.param!r})"


def plan_failure(data: Any) -> ApiError:
    """The answer for a plan's ``failed`` event data ``{"code", "message", "detail"}``.

    The handler's ``invalid_argument`` is the request's fault (400); an engine that answered
    with a 4xx status said the same (its status is kept: 400, 404 for a model it does not
    serve, 413, 422, 429); any other engine failure is 502, a plan past its ``timeout_s`` 504,
    a lost worker 503 and the rest 500.
    """
    if not isinstance(data, dict):
        data = {}
    code = str(data.get("code") or codes.INTERNAL)
    message = str(data.get("message") or "the plan failed")
    detail = data.get("detail")
    if code in (codes.INVALID_ARGUMENT, codes.UNKNOWN_OP):
        return ApiError(400, message, code=code)
    if code == codes.ENGINE_ERROR:
        status = detail.get("status") if isinstance(detail, dict) else None
        if isinstance(status, int) and 400 <= status < 500 and status not in (401, 403):
            # The engine's own 401/403 is the worker's key, not the caller's: a 502 for the caller.
            return ApiError(status, message, code=code, retry_after_s=1.0 if status == 429 else 0.0)
        return ApiError(502, message, code=code)
    if code == codes.TIMEOUT:
        return ApiError(504, message, code=code)
    if code == codes.WORKER_LOST:
        return ApiError(503, message, code=code, retry_after_s=1.0)
    return ApiError(500, message, code=code)


def submit_refused(code: str, message: str, retry_after_s: float = 0.0) -> ApiError:
    """The answer when the core refused the plan's ``submit`` (an ``error`` reply with ``code``)."""
    if code == codes.TOO_MANY_PLANS:
        return ApiError(429, message, code="rate_limit_exceeded", retry_after_s=retry_after_s or 1.0)
    if code == codes.UNAVAILABLE:
        return ApiError(503, message, code=code, retry_after_s=retry_after_s or 1.0)
    if code in (codes.INVALID_ARGUMENT, codes.INVALID_MESSAGE):
        return ApiError(400, message, code=code)
    if code == codes.FORBIDDEN:
        return ApiError(403, message, code=code)
    return ApiError(500, message, code=code)
