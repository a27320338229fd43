"""One request's answer, made from its plan's events: OpenAI's JSON, or its server-sent event stream.

Theory of operation (docs/OPENAI.md §Answers). The door submits the request's ``generate`` plan
subscribed, and hands each event of that plan to the request's :class:`Reply`, which answers
with the bytes to write (an HTTP/1.1 head, the body, the chunks of a stream) and whether the
answer is complete or the door must cancel the plan. The events are the ones every client
sees (docs/PROTOCOL.md §6): the worker's inference handler (worker_agent/inference.py) emits
``token`` ``{"text"}`` per chunk of text and ``delta`` for the rest of a chat delta (tool
calls), both ephemeral, and the plan ends ``succeeded`` with the whole text, the finish reason
and the usage in its result and the energy receipt beside it; or ``failed``, or ``cancelled``.

States, and what moves them (an event of another kind changes nothing)::

    waiting --token/delta (stream)--> streaming --succeeded--> done   [DONE], usage, receipt
    waiting --succeeded-------------> done        200, the whole answer (a stream: all of it at once)
    waiting --failed/cancelled------> done        the error's status (errors.py), OpenAI's error shape
    waiting --expire(now)-----------> done        503 + Retry-After: no worker took it in time; cancel
    streaming --failed/cancelled----> done        ``data: {"error": ...}``, no [DONE]: never a silent cut
    streaming --requeued------------> done        the same, and cancel: the text sent cannot be resumed
    waiting --requeued--------------> waiting     resumed on another worker: nothing was sent yet

* **Queue timeout.** A request waits for a worker at most ``queue_timeout_s``, counted from its
  submit and again from each requeue, until its plan is leased; past it (:meth:`Reply.expire`)
  it is answered 503 with the plan's last waiting reason and its plan is cancelled. A request
  for a model no worker serves never gets here: the door answers 404 before it submits.
* **Stream head.** The 200 head of a stream is sent with its first text, not at once, so a
  request that fails before it gets a real status (a 503 or a 502 an OpenAI client raises as
  such) and one whose worker was lost before it resumes elsewhere, unseen.
* **Chunks.** Each ``token`` is one chunk, its JSON made from a prefix and a suffix computed once
  per request and the text encoded alone. A chat stream opens with the assistant's role. The
  last chunk carries ``finish_reason``; with ``include_usage`` a usage chunk (no choices)
  follows, as OpenAI sends it; the last of them carries the ``fleetwire`` extension.
* **The fleetwire extension** (on the answer, or the last chunk): the plan id, the worker, the
  attempt, and the receipt's ``joules`` and ``gco2e`` (null when no receipt came), whether they
  were estimated and how. Every answer has ``x-fleetwire-plan-id`` and ``x-request-id``.

Pure: no clock (``now`` comes in), no I/O; the wall-clock ``created`` is the driver's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Final, Literal

import msgspec

from coordinator.openai_api.errors import ApiError, plan_failure
from coordinator.openai_api.request import DoorRequest
from protocol.transfer.http1 import LAST_CHUNK, format_chunk, format_response

__all__ = ["REASONS", "Out", "Reply", "error_response", "json_response"]

#: Reasons of the statuses the door answers with.
REASONS: Final[dict[int, str]] = {
    200: "OK", 400: "Bad Request", 401: "Unauthorized", 403: "Forbidden", 404: "Not Found",
    405: "Method Not Allowed", 411: "Length Required", 413: "Content Too Large", 421: "Misdirected Request",
    429: "Too Many Requests",
    431: "Request Header Fields Too Large",
    500: "Internal Server Error", 502: "Bad Gateway", 503: "Service Unavailable", 504: "Gateway Timeout",
}
_ENCODE = msgspec.json.Encoder().encode
_DONE: Final = b"data: [DONE]\n\n"

State = Literal["waiting", "streaming", "done"]


@dataclass(frozen=True, slots=True)
class Out:
    """What the door does after one input: write ``data``; then the answer is complete (``done``);
    cancel the plan (``cancel``: the door gave up on it)."""

    data: bytes = b""
    done: bool = False
    cancel: bool = False


_NOTHING: Final = Out()  # most events change nothing the client sees


def _head(status: int, content_type: str, extra: dict[str, str], *, keep_alive: bool, length: int | None) -> bytes:
    headers = {"Content-Type": content_type}
    if length is None:
        headers["Transfer-Encoding"] = "chunked"
        headers["Cache-Control"] = "no-cache"
    else:
        headers["Content-Length"] = str(length)
    headers.update(extra)
    if not keep_alive:
        headers["Connection"] = "close"
    return format_response(status, headers, REASONS.get(status, "Status"))


def _stream_head(keep_alive: bool) -> tuple[bytes, bytes, bytes]:
    """The 200 head of a stream, cut where the plan id goes twice (``x-fleetwire-plan-id``, ``x-request-id``)."""
    head = _head(200, "text/event-stream", {"x-fleetwire-plan-id": "\0", "x-request-id": "\0"},
                 keep_alive=keep_alive, length=None)  # fmt: skip
    before, between, after = head.split(b"\0")
    return before, between, after


#: A stream's head is the same for every request but its plan id: made once, not per request (a hot path).
_STREAM_HEADS: Final = {keep_alive: _stream_head(keep_alive) for keep_alive in (True, False)}
_CHUNK_TAIL: Final = b',"logprobs":null,"finish_reason":'
_ROLE_DELTA: Final = b'{"role":"assistant","content":""}' + _CHUNK_TAIL + b"null}]}\n\n"


def json_response(
    status: int, payload: Any, *, keep_alive: bool = True, headers: dict[str, str] | None = None,
) -> bytes:
    """A whole JSON answer: head and body."""
    body = _ENCODE(payload)
    return _head(status, "application/json", headers or {}, keep_alive=keep_alive, length=len(body)) + body


def error_response(error: ApiError, *, keep_alive: bool = True, headers: dict[str, str] | None = None) -> bytes:
    """``error`` as OpenAI answers it (errors.py), with ``Retry-After`` when it says one."""
    extra = dict(headers or {})
    if error.retry_after_s > 0:
        extra["Retry-After"] = str(max(1, round(error.retry_after_s)))
    if error.status == 401:
        extra["WWW-Authenticate"] = 'Bearer realm="fleetwire"'
    return json_response(error.status, error.shape(), keep_alive=keep_alive, headers=extra)


def _field(receipt: Any, name: str) -> Any:
    """A receipt's field, whether it came as the core's Struct or as decoded JSON."""
    return receipt.get(name) if isinstance(receipt, dict) else getattr(receipt, name, None)


class Reply:
    """The answer to one request (module docstring).

    Args:
        request: the checked request.
        created: Unix seconds, OpenAI's ``created`` (the driver's wall clock).
        now: monotonic seconds at the submit.
        queue_timeout_s: how long the request may wait for a worker.
        keep_alive: the connection serves another request after this one (else ``Connection: close``).
    """

    # One per open request: slots keep it small (bench/openai_door.py, memory per open stream).
    __slots__ = ("_open", "_prefix", "_suffix", "_tool_calls", "attempt", "chunks", "created", "deadline",
                 "keep_alive", "plan_id", "queue_timeout_s", "request", "state", "status", "waiting_reason",
                 "worker_id")  # fmt: skip

    def __init__(
        self, request: DoorRequest, *, created: int, now: float, queue_timeout_s: float, keep_alive: bool = True,
    ) -> None:  # fmt: skip
        self.request = request
        self.created = created
        self.queue_timeout_s = queue_timeout_s
        self.keep_alive = keep_alive
        self.state: State = "waiting"
        self.plan_id = ""
        self.worker_id = ""
        self.attempt = 0
        self.waiting_reason = ""
        self.deadline: float | None = now + queue_timeout_s  # None: placed, or answered
        self.chunks = 0  # stream chunks of text sent
        self.status = 0  # the answer's HTTP status once its head was made (0: not yet)
        self._open = b""  # a chat chunk up to its delta (accepted())
        self._prefix = b""
        self._suffix = b""
        self._tool_calls: dict[int, dict[str, Any]] = {}  # a chat's tool calls from ``delta`` events, by index

    # ------------------------------------------------------------------ inputs

    def accepted(self, plan_id: str) -> None:
        """The core accepted the plan under ``plan_id``; the chunk templates are made for it.

        Raises:
            ValueError: a plan id with a line break (it goes into the answer's head).
        """
        if "\r" in plan_id or "\n" in plan_id:
            raise ValueError(f"plan id {plan_id!r} has a line break in it")
        self.plan_id = plan_id
        request = self.request
        model = _ENCODE(request.model)
        if request.kind == "chat":
            self._open = (b'data: {"id":%b,"object":"chat.completion.chunk","created":%d,"model":%b,'
                          b'"choices":[{"index":0,"delta":' % (_ENCODE("chatcmpl-" + plan_id), self.created, model))
            self._prefix = self._open + b'{"content":'
            self._suffix = b'},"finish_reason":null}]}\n\n'
        else:
            self._prefix = (b'data: {"id":%b,"object":"text_completion","created":%d,"model":%b,'
                            b'"choices":[{"index":0,"text":' % (_ENCODE("cmpl-" + plan_id), self.created, model))
            self._suffix = b',"logprobs":null,"finish_reason":null}]}\n\n'

    def refused(self, error: ApiError) -> Out:
        """The plan could not be submitted, or the door gives up on it: answer with ``error``."""
        return self._fail(error, cancel=False)

    def event(self, kind: str, data: Any, now: float) -> Out:
        """One event of the request's plan."""
        if self.state == "done":
            return _NOTHING
        match kind:
            case "token":
                text = data.get("text") if isinstance(data, dict) else None
                if not self.request.stream or not isinstance(text, str) or not text:
                    return _NOTHING
                chunk = self._prefix + _ENCODE(text) + self._suffix
                if self.state == "streaming":  # the hot path: one chunk more
                    self.chunks += 1
                    return Out(format_chunk(chunk))
                return self._stream(chunk)
            case "delta":
                return self._delta(data)
            case "leased" | "running":
                self.deadline = None
                if isinstance(data, dict):
                    self.worker_id = str(data.get("worker_id", self.worker_id))
                    attempt = data.get("attempt")
                    self.attempt = attempt if isinstance(attempt, int) else self.attempt
                return _NOTHING
            case "waiting":
                if isinstance(data, dict):
                    self.waiting_reason = str(data.get("reason", ""))
                return _NOTHING
            case "requeued":
                if self.state == "streaming":
                    reason = data.get("reason", "") if isinstance(data, dict) else ""
                    message = (f"the worker was lost after {self.chunks} chunks were sent ({reason}); "
                               "the answer cannot be resumed: send the request again")  # fmt: skip
                    return self._fail(ApiError(503, message, code="worker_lost", retry_after_s=1.0), cancel=True)
                self.deadline = now + self.queue_timeout_s  # resumed elsewhere: nothing was sent
                self._tool_calls.clear()
                return _NOTHING
            case "succeeded":
                return self._succeeded(data)
            case "failed":
                return self._fail(plan_failure(data), cancel=False)
            case "cancelled":
                reason = data.get("reason", "") if isinstance(data, dict) else ""
                return self._fail(ApiError(503, f"the plan was cancelled: {reason}", code="cancelled"), cancel=False)
        return _NOTHING

    def expire(self, now: float) -> Out:
        """Past the queue timeout with no worker: 503 and cancel the plan; before it, nothing."""
        if self.state != "waiting" or self.deadline is None or now < self.deadline:
            return _NOTHING
        why = f" ({self.waiting_reason})" if self.waiting_reason else ""
        model, wait = self.request.model, self.queue_timeout_s
        message = f"no worker serving model {model!r} took the request within {wait:g} s{why}"
        return self._fail(ApiError(503, message, code="no_capacity", retry_after_s=1.0), cancel=True)

    # ------------------------------------------------------------------ outputs

    def _headers(self) -> dict[str, str]:
        return {"x-fleetwire-plan-id": self.plan_id, "x-request-id": self.plan_id} if self.plan_id else {}

    def _stream(self, chunk: bytes) -> Out:
        """Text of the stream: the head and the role first (module docstring), then the chunk."""
        if chunk:
            self.chunks += 1
        if self.state == "streaming":
            return Out(format_chunk(chunk))
        self.state = "streaming"
        self.deadline = None
        self.status = 200
        if self.plan_id:
            before, between, after = _STREAM_HEADS[self.keep_alive]
            plan_id = self.plan_id.encode("latin-1")
            head = before + plan_id + between + plan_id + after
        else:
            head = _head(200, "text/event-stream", {}, keep_alive=self.keep_alive, length=None)
        if self.request.kind == "chat":
            chunk = self._open + _ROLE_DELTA + chunk
        return Out(head + format_chunk(chunk) if chunk else head)  # an empty chunk would end the body

    def _chat_chunk(self, delta: dict[str, Any], finish_reason: str | None, fleetwire: Any = None) -> bytes:
        """A chat chunk (``chat.completion.chunk``) with ``delta``, made on the template of :meth:`accepted`."""
        extension = b',"fleetwire":%b' % _ENCODE(fleetwire) if fleetwire is not None else b""
        return b"%b%b%b%b}]%b}\n\n" % (self._open, _ENCODE(delta), _CHUNK_TAIL, _ENCODE(finish_reason), extension)

    def _delta(self, data: Any) -> Out:
        """A chat delta with no text (tool calls): passed on as sent in a stream, gathered otherwise."""
        if self.request.kind != "chat" or not isinstance(data, dict) or not data:
            return _NOTHING
        if self.request.stream:
            return self._stream(self._chat_chunk(data, None))
        for call in data.get("tool_calls") or ():
            if not isinstance(call, dict):
                continue
            index = call.get("index", 0)
            held = self._tool_calls.setdefault(index if isinstance(index, int) else 0, {})
            for name in ("id", "type"):
                if call.get(name):
                    held[name] = call[name]
            function = call.get("function")
            if isinstance(function, dict):
                into = held.setdefault("function", {"name": "", "arguments": ""})
                if function.get("name"):
                    into["name"] = function["name"]
                if isinstance(function.get("arguments"), str):
                    into["arguments"] += function["arguments"]
        return _NOTHING

    def _extension(self, data: dict[str, Any], result: dict[str, Any]) -> dict[str, Any]:
        """The ``fleetwire`` extension (module docstring)."""
        receipt = data.get("receipt")
        worker = data.get("worker_id", self.worker_id)
        attempt = data.get("attempt", self.attempt)
        extension: dict[str, Any] = {
            "plan_id": self.plan_id, "worker_id": worker, "attempt": attempt, "joules": None, "gco2e": None,
        }
        if receipt is not None:
            extension.update(
                joules=_field(receipt, "joules") or 0.0, gco2e=_field(receipt, "co2e_g") or 0.0,
                energy_estimated=bool(_field(receipt, "estimated")), energy_source=_field(receipt, "source") or "",
            )
        if result.get("usage_estimated"):
            extension["usage_estimated"] = True
        return extension

    def _succeeded(self, data: Any) -> Out:
        data = data if isinstance(data, dict) else {}
        result = data.get("result")
        result = result if isinstance(result, dict) else {}
        text = result.get("text")
        text = text if isinstance(text, str) else ""
        finish = result.get("finish_reason") or ("tool_calls" if self._tool_calls else "stop")
        usage = _usage(result.get("usage"))
        extension = self._extension(data, result)
        request = self.request
        if not request.stream:
            self.state, self.status = "done", 200
            return Out(json_response(200, self._whole(text, str(finish), usage, extension),
                                     keep_alive=self.keep_alive, headers=self._headers()), done=True)  # fmt: skip
        out = b""
        if self.state == "waiting":  # no text was streamed (an empty answer, or a handler that does not stream)
            first = self._stream(self._prefix + _ENCODE(text) + self._suffix) if text else self._stream(b"")
            out = first.data
        self.state = "done"
        last = extension if not request.include_usage else None
        if request.kind == "chat":
            end = self._chat_chunk({}, str(finish), last)
        else:
            payload = {"id": f"cmpl-{self.plan_id}", "object": "text_completion", "created": self.created,
                       "model": request.model, "choices": [{"index": 0, "text": "", "logprobs": None,
                                                            "finish_reason": str(finish)}]}  # fmt: skip
            if last:
                payload["fleetwire"] = last
            end = b"data: %b\n\n" % _ENCODE(payload)
        if request.include_usage:
            kind = "chat.completion.chunk" if request.kind == "chat" else "text_completion"
            prefix = "chatcmpl" if request.kind == "chat" else "cmpl"
            end += b"data: %b\n\n" % _ENCODE({
                "id": f"{prefix}-{self.plan_id}", "object": kind, "created": self.created, "model": request.model,
                "choices": [], "usage": usage, "fleetwire": extension,
            })
        return Out(out + format_chunk(end + _DONE) + LAST_CHUNK, done=True)

    def _whole(self, text: str, finish: str, usage: dict[str, int], extension: dict[str, Any]) -> dict[str, Any]:
        """A non-streamed answer (``chat.completion`` or ``text_completion``)."""
        request = self.request
        if request.kind == "chat":
            message: dict[str, Any] = {"role": "assistant", "content": text}
            if self._tool_calls:
                message["tool_calls"] = [self._tool_calls[index] for index in sorted(self._tool_calls)]
                message["content"] = text or None
            choice: dict[str, Any] = {"index": 0, "message": message, "logprobs": None, "finish_reason": finish}
            kind, prefix = "chat.completion", "chatcmpl"
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
            kind, prefix = "text_completion", "cmpl"
        return {
            "id": f"{prefix}-{self.plan_id}", "object": kind, "created": self.created, "model": request.model,
            "choices": [choice], "usage": usage, "fleetwire": extension,
        }

    def _fail(self, error: ApiError, *, cancel: bool) -> Out:
        """An error: its own answer before any text, an error event ending the stream after (module docstring)."""
        if self.state == "done":
            return _NOTHING
        streaming = self.state == "streaming"
        self.state = "done"
        self.deadline = None
        if streaming:
            return Out(format_chunk(b"data: %b\n\n" % error.body()) + LAST_CHUNK, done=True, cancel=cancel)
        self.status = error.status
        return Out(error_response(error, keep_alive=self.keep_alive, headers=self._headers()), done=True, cancel=cancel)


def _usage(value: Any) -> dict[str, int]:
    """OpenAI's usage from the handler's (worker_agent/inference.py); a missing or bad figure is 0."""
    usage = value if isinstance(value, dict) else {}
    figures = {}
    for name in ("prompt_tokens", "completion_tokens"):
        figure = usage.get(name)
        figures[name] = figure if type(figure) is int and figure >= 0 else 0
    figures["total_tokens"] = figures["prompt_tokens"] + figures["completion_tokens"]
    return figures
