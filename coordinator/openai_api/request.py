"""An OpenAI request body becomes a ``generate`` plan: checked, with its routing hints computed here.

Rules (docs/OPENAI.md §Requests):

* ``POST /v1/chat/completions`` takes ``{"model", "messages": [...]}``, ``POST /v1/completions``
  ``{"model", "prompt"}``. The body must be one JSON object; ``model`` a non-empty string; each
  message an object with a string ``role`` and a ``content`` that is a string, a list of parts or
  null; a ``prompt`` a string or a list (of strings or token ids, passed on as sent). A wrong one
  is a 400 naming the field (``messages[2].content``) and what it must be.
* ``n`` must be 1 (or absent): the fleet streams one choice per request (send n requests).
  ``stream`` and ``stream_options.include_usage`` say how the door answers; the worker's
  inference handler sets its own (worker_agent/inference.py): they are not passed on.
  ``stream_options`` without ``stream`` is a 400, as OpenAI answers it.
* Every other field (``temperature``, ``stop``, ``tools``, ``tool_choice``, ``response_format``,
  ``seed``, ``logprobs``, fields this module never heard of...) is passed to the engine unchanged.
* The plan: op ``generate``, its args the body (less ``stream`` and ``stream_options``), the
  ``model`` as a requirement (only workers that serve it are candidates), and routing hints
  computed from the body by the SDK's own rule (protocol/prompts.py: the prompt token estimate,
  ``max_tokens`` as the output estimate, the chained prefix-block hashes of the serialised chat),
  so ``kv_aware`` keeps a conversation on the worker that holds its prefix. The session key (the
  ``session`` policy's sticky key) is the ``x-fleetwire-session`` header when sent, else ``user``.
  The placement policy is the coordinator's default.

Pure: bytes and strings in, a :class:`DoorRequest` or an :class:`~coordinator.openai_api.errors.ApiError`
out; the driver authenticates, checks the model against the fleet and submits.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Final, Literal

import msgspec

from coordinator.openai_api.errors import ApiError
from coordinator.shards import POOL_TAG
from protocol.caps import MAX_SESSION_KEY_BYTES, MAX_TAG_BYTES, too_long
from protocol.messages import Requirements, RoutingHints, Submit
from protocol.prompts import fill_hints, prefix_hashes

__all__ = ["GENERATE_OP", "MAX_MODEL_BYTES", "MAX_POOL_BYTES", "PATHS", "DoorRequest", "Kind", "check_pool",
           "parse_request"]

Kind = Literal["chat", "completion"]
#: The POST paths and the kind of request each takes.
PATHS: Final[dict[str, Kind]] = {"/v1/chat/completions": "chat", "/v1/completions": "completion"}
GENERATE_OP: Final = "generate"
MAX_MODEL_BYTES: Final = 256
MAX_POOL_BYTES: Final = MAX_TAG_BYTES - len(POOL_TAG)  # the plan's tag pool:NAME fits a tag's cap
# Fields the door reads and does not pass on: the handler streams from the engine whatever the caller asked.
_DOOR_FIELDS: Final = frozenset({"stream", "stream_options"})
_DECODE = msgspec.json.Decoder().decode


@dataclass(frozen=True, slots=True)
class DoorRequest:
    """One checked request: how to answer it, and the plan it becomes.

    Attributes:
        kind: ``chat`` (``/v1/chat/completions``) or ``completion`` (``/v1/completions``).
        model: the model asked for.
        stream: answer with server-sent events.
        include_usage: a stream ends with a usage chunk (``stream_options.include_usage``).
        args: the ``generate`` plan's args: the body less ``stream`` and ``stream_options``.
        hints: the plan's routing hints (module docstring).
        pool: the worker pool of ``x-fleetwire-pool`` ("": the default pool).
    """

    kind: Kind
    model: str
    stream: bool
    include_usage: bool
    args: dict[str, Any]
    hints: RoutingHints
    pool: str = ""

    def submit(self, req_id: int, *, timeout_s: float | None = None, max_attempts: int = 3) -> Submit:
        """The ``submit`` of this request's plan (subscribed: the door follows its events)."""
        return Submit(
            req_id=req_id, op=GENERATE_OP, args=self.args,
            requirements=Requirements(model=self.model, tags=[POOL_TAG + self.pool] if self.pool else []),
            timeout_s=timeout_s, max_attempts=max_attempts, hints=self.hints,
        )


def parse_request(
    kind: Kind, body: bytes | bytearray | memoryview, *, session: str | None = None, pool: str | None = None,
    hasher: Callable[[str], list[int]] = prefix_hashes,
) -> DoorRequest:
    """The request in ``body`` (module docstring); ``session``, ``pool``: the ``x-fleetwire-session`` and
    ``x-fleetwire-pool`` headers; ``hasher``: the prefix hashes' function (the door's remembers: the same
    hashes, fewer computed; protocol/prompts.py ``PrefixMemo``).

    Raises:
        ApiError: 400 naming what is wrong.
    """
    try:
        fields = _DECODE(body)
    except msgspec.DecodeError as exc:
        raise ApiError(400, f"the request body is not valid JSON: {exc}") from None
    if not isinstance(fields, dict):
        raise ApiError(400, f"the request body must be a JSON object, got {_json_type(fields)}")
    model = fields.get("model")
    if not isinstance(model, str) or not model:
        got = "none" if model is None else f"{_json_type(model)} {model!r}"[:80]
        raise ApiError(400, f"you must provide a model: a non-empty string (got {got})", param="model")
    problem = too_long("model", model, MAX_MODEL_BYTES)
    if problem is not None:
        raise ApiError(400, problem, param="model")
    if kind == "chat":
        _check_messages(fields.get("messages"))
    elif "prompt" not in fields or not isinstance(fields["prompt"], str | list):
        raise ApiError(400, "a completion needs a 'prompt': a string or a list of strings or token ids",
                       param="prompt")  # fmt: skip
    n = fields.get("n")
    if n is not None and (type(n) is not int or n != 1):
        raise ApiError(400, f"n must be 1 (got {n!r}): the fleet streams one choice per request; send n requests",
                       param="n")  # fmt: skip
    stream = _flag(fields, "stream")
    include_usage = False
    options = fields.get("stream_options")
    if options is not None:
        if not stream:
            raise ApiError(400, "'stream_options' is only allowed when 'stream' is true", param="stream_options")
        if not isinstance(options, dict):
            raise ApiError(400, "'stream_options' must be an object", param="stream_options")
        include_usage = _flag(options, "include_usage", "stream_options.include_usage")
    for name in ("max_tokens", "max_completion_tokens"):
        limit = fields.get(name)
        if limit is not None and (type(limit) is not int or limit < 1):
            raise ApiError(400, f"'{name}' must be a positive integer (got {limit!r})", param=name)
    user = fields.get("user")
    if user is not None and not isinstance(user, str):
        raise ApiError(400, f"'user' must be a string (got {_json_type(user)})", param="user")
    key = session if session else user or None
    problem = too_long("the session key (x-fleetwire-session, else user)", key, MAX_SESSION_KEY_BYTES)
    if problem is not None:
        raise ApiError(400, problem, param="user")
    args = fields if not _DOOR_FIELDS.intersection(fields) else {
        name: value for name, value in fields.items() if name not in _DOOR_FIELDS
    }
    hints = fill_hints(RoutingHints(session_key=key), args, hasher)
    return DoorRequest(kind, model, stream, include_usage, args, hints, check_pool(pool))


def check_pool(pool: str | None) -> str:
    """The ``x-fleetwire-pool`` header's pool ("" when not sent).

    Raises:
        ApiError: 400 for a pool name over :data:`MAX_POOL_BYTES` or with a comma or space.
    """
    if not pool:
        return ""
    problem = too_long("x-fleetwire-pool", pool, MAX_POOL_BYTES)
    if problem is not None or "," in pool or " " in pool:
        raise ApiError(400, problem or f"x-fleetwire-pool must be one pool name, got {pool[:80]!r}",
                       param="x-fleetwire-pool")  # fmt: skip
    return pool


def _check_messages(messages: Any) -> None:
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "a chat completion needs 'messages': a non-empty list of {role, content} objects",
                       param="messages")  # fmt: skip
    for index, message in enumerate(messages):
        if type(message) is not dict and not isinstance(message, Mapping):  # the ABC's check costs; JSON gives dicts
            raise ApiError(400, f"messages[{index}] must be an object with 'role' and 'content' "
                                f"(got {_json_type(message)})", param=f"messages[{index}]")  # fmt: skip
        role = message.get("role")
        if not isinstance(role, str) or not role:
            message_text = f"messages[{index}].role must be a non-empty string such as 'user' (got {role!r})"
            raise ApiError(400, message_text[:200], param=f"messages[{index}].role")
        content = message.get("content")
        if content is not None and not isinstance(content, str | list):
            raise ApiError(400, f"messages[{index}].content must be a string, a list of content parts or null "
                                f"(got {_json_type(content)})", param=f"messages[{index}].content")  # fmt: skip


def _flag(fields: Mapping[str, Any], name: str, param: str | None = None) -> bool:
    value = fields.get(name)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise ApiError(400, f"'{param or name}' must be true or false (got {value!r})"[:200], param=param or name)
    return value


def _json_type(value: Any) -> str:
    """The JSON name of a decoded value's type, for messages."""
    match value:
        case None:
            return "null"
        case bool():
            return "a boolean"
        case int() | float():
            return "a number"
        case str():
            return "a string"
        case list():
            return "an array"
        case dict():
            return "an object"
    return type(value).__name__
