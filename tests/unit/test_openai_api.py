"""The OpenAI front door's pure part (coordinator/openai_api/): requests to plans, events to answers, limits."""

from __future__ import annotations

import json
from typing import Any

import msgspec
import pytest

from coordinator.openai_api import (
    ApiError,
    HttpRequest,
    ModelTable,
    Reply,
    RequestReader,
    error_response,
    parse_request,
    plan_failure,
    submit_refused,
)
from coordinator.openai_api.limits import RequestRate
from coordinator.openai_api.relay import ResponseRelay, upstream_request
from coordinator.openai_api.request import DoorRequest
from coordinator.workers import WorkerRecord
from protocol import errors as codes
from protocol.messages import Capabilities, Receipt, RoutingHints
from protocol.prompts import BLOCK_TOKENS, fill_hints, prefix_hashes, prompt_text
from protocol.transfer.http1 import format_response, head_end, parse_response

CHAT = {"model": "m1", "messages": [{"role": "user", "content": "hello " * 40}]}


def body(fields: dict[str, Any]) -> bytes:
    return json.dumps(fields).encode()


def http(data: bytes) -> tuple[int, dict[str, str], bytes]:
    """A whole HTTP response: status, headers, the body (de-chunked)."""
    end = head_end(data, 1 << 16)
    head = parse_response(data[:end])
    rest = data[end:]
    if head.headers.get("transfer-encoding") != "chunked":
        assert len(rest) == head.content_length
        return head.status, head.headers, rest
    out = b""
    while True:
        size_line, rest = rest.split(b"\r\n", 1)
        size = int(size_line, 16)
        if size == 0:
            assert rest == b"\r\n", "nothing may follow the last chunk"
            return head.status, head.headers, out
        out, rest = out + rest[:size], rest[size + 2:]


def sse(data: bytes) -> list[Any]:
    """The ``data:`` payloads of an event stream, JSON-decoded ([DONE] as the string)."""
    events = [line[len("data: "):] for line in data.decode().split("\n\n") if line]
    return [e if e == "[DONE]" else json.loads(e) for e in events]


def reply(fields: dict[str, Any] | None = None, kind: Any = "chat", *, timeout_s: float = 30.0) -> Reply:
    request = parse_request(kind, body(fields or CHAT))
    answer = Reply(request, created=1_700_000_000, now=0.0, queue_timeout_s=timeout_s)
    answer.accepted("p1")
    return answer


def succeeded(text: str = "hi there", finish: str = "stop", receipt: Any = None) -> dict[str, Any]:
    data: dict[str, Any] = {
        "result": {"text": text, "finish_reason": finish, "model": "m1",
                   "usage": {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7}},
        "worker_id": "w1", "attempt": 1,
    }
    if receipt is not None:
        data["receipt"] = receipt
    return data


# ---------------------------------------------------------------------------------------------- requests


def test_chat_request_becomes_a_generate_plan_with_hints_by_the_sdk_rule() -> None:
    """A chat request is a generate plan: args without the door's fields, the model required, hints as the SDK's."""
    fields = {**CHAT, "stream": True, "stream_options": {"include_usage": True}, "max_tokens": 64,
              "temperature": 0.2, "tools": [{"type": "function", "function": {"name": "f"}}], "frobnicate": {"x": 1}}
    request = parse_request("chat", body(fields))
    assert request.stream and request.include_usage and request.model == "m1"
    assert "stream" not in request.args and "stream_options" not in request.args
    assert request.args["frobnicate"] == {"x": 1} and request.args["tools"] == fields["tools"]  # passed through
    submit = request.submit(7)
    assert submit.op == "generate" and submit.requirements.model == "m1" and submit.req_id == 7
    assert submit.hints == fill_hints(RoutingHints(), request.args)  # the SDK's own hints for the same args
    assert submit.hints.max_output_tokens == 64 and submit.hints.prompt_tokens > 60
    text, _ = prompt_text(request.args) or ("", 0)
    assert submit.hints.prefix_hashes == prefix_hashes(text) and submit.hints.prefix_block_tokens == BLOCK_TOKENS


def test_next_turn_of_a_chat_repeats_the_previous_turns_prefix_hashes() -> None:
    """Turn two's leading prefix hashes are turn one's: kv_aware sends it where turn one went."""
    first = [{"role": "system", "content": "You are terse. " * 10}, {"role": "user", "content": "Name a prime. " * 8}]
    second = [*first, {"role": "assistant", "content": "Seven. " * 6}, {"role": "user", "content": "Another. " * 8}]
    one = parse_request("chat", body({"model": "m", "messages": first})).hints.prefix_hashes
    two = parse_request("chat", body({"model": "m", "messages": second})).hints.prefix_hashes
    assert len(one) >= 4 and two[:len(one) - 1] == one[:-1]  # the last block of turn one may be partial there


def test_session_key_is_the_header_else_user() -> None:
    """x-fleetwire-session wins over user; without either there is no session key."""
    assert parse_request("chat", body({**CHAT, "user": "alice"})).hints.session_key == "alice"
    assert parse_request("chat", body({**CHAT, "user": "alice"}), session="conv-9").hints.session_key == "conv-9"
    assert parse_request("chat", body(CHAT)).hints.session_key is None


@pytest.mark.parametrize(("raw", "param", "fragment"), [
    (b"{not json", None, "not valid JSON"),
    (b"[1, 2]", None, "must be a JSON object, got an array"),
    (body({"messages": CHAT["messages"]}), "model", "you must provide a model"),
    (body({"model": 5, "messages": CHAT["messages"]}), "model", "a number"),
    (body({"model": "m" * 300, "messages": CHAT["messages"]}), "model", "at most 256 bytes"),
    (body({"model": "m"}), "messages", "non-empty list"),
    (body({"model": "m", "messages": []}), "messages", "non-empty list"),
    (body({"model": "m", "messages": ["hi"]}), "messages[0]", "got a string"),
    (body({"model": "m", "messages": [{"content": "x"}]}), "messages[0].role", "non-empty string"),
    (body({"model": "m", "messages": [{"role": "user", "content": 5}]}), "messages[0].content", "got a number"),
    (body({**CHAT, "n": 2}), "n", "n must be 1"),
    (body({**CHAT, "stream": "yes"}), "stream", "true or false"),
    (body({**CHAT, "stream_options": {"include_usage": True}}), "stream_options", "only allowed when 'stream'"),
    (body({**CHAT, "max_tokens": 0}), "max_tokens", "positive integer"),
    (body({**CHAT, "user": 3}), "user", "must be a string"),
    (body({**CHAT, "user": "u" * 300}), "user", "at most 256 bytes"),
])
def test_bad_chat_requests_are_400_naming_the_field(raw: bytes, param: str | None, fragment: str) -> None:
    """Each malformed request is a 400 whose param names the field and whose message says what it must be."""
    with pytest.raises(ApiError) as caught:
        parse_request("chat", raw)
    assert caught.value.status == 400 and caught.value.param == param
    assert fragment in caught.value.message
    shape = json.loads(caught.value.body())
    assert shape["error"]["type"] == "invalid_request_error" and shape["error"]["param"] == param


def test_completion_needs_a_prompt_and_passes_a_list_prompt_on_without_hints() -> None:
    """A completion needs a prompt; a list prompt goes to the engine as sent, with no prefix hints."""
    with pytest.raises(ApiError, match="needs a 'prompt'"):
        parse_request("completion", body({"model": "m"}))
    request = parse_request("completion", body({"model": "m", "prompt": [1, 2, 3]}))
    assert request.args["prompt"] == [1, 2, 3] and request.hints.prefix_hashes == []


# ---------------------------------------------------------------------------------------------- answers


def test_non_streamed_chat_answer_has_usage_and_the_receipt_extension() -> None:
    """succeeded -> 200 chat.completion with the text, usage, plan id headers and joules/gCO2e from the receipt."""
    answer = reply()
    answer.event("leased", {"worker_id": "w1", "attempt": 1}, 0.1)
    out = answer.event("succeeded", succeeded(receipt=Receipt(joules=12.5, co2e_g=0.75, source="nvml_counter")), 0.2)
    assert out.done and not out.cancel
    status, headers, raw = http(out.data)
    assert status == 200 and headers["x-fleetwire-plan-id"] == "p1" and headers["x-request-id"] == "p1"
    answer_json = json.loads(raw)
    assert answer_json["object"] == "chat.completion" and answer_json["id"] == "chatcmpl-p1"
    assert answer_json["choices"] == [{"index": 0, "message": {"role": "assistant", "content": "hi there"},
                                       "logprobs": None, "finish_reason": "stop"}]
    assert answer_json["usage"] == {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7}
    fleetwire = answer_json["fleetwire"]
    assert fleetwire["joules"] == 12.5 and fleetwire["gco2e"] == 0.75 and fleetwire["worker_id"] == "w1"
    assert fleetwire["energy_source"] == "nvml_counter" and fleetwire["energy_estimated"] is False


def test_streamed_chat_sends_role_then_chunks_then_finish_usage_and_done() -> None:
    """A stream: head with the first text, role chunk, one chunk per token, finish, usage + receipt, [DONE]."""
    answer = reply({**CHAT, "stream": True, "stream_options": {"include_usage": True}})
    assert answer.event("queued", {}, 0.0).data == b""
    first = answer.event("token", {"text": "hi"}, 0.1)
    assert first.data.startswith(b"HTTP/1.1 200 OK\r\n") and b"text/event-stream" in first.data
    rest = answer.event("token", {"text": " \"there\"\n"}, 0.2).data
    end = answer.event("succeeded", succeeded(text="hi \"there\"\n", receipt={"joules": 3.0, "co2e_g": 0.1}), 0.3)
    assert end.done
    status, _, raw = http(first.data + rest + end.data)
    events = sse(raw)
    assert status == 200 and events[-1] == "[DONE]"
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert [e["choices"][0]["delta"]["content"] for e in events[1:3]] == ["hi", " \"there\"\n"]
    assert all(e["id"] == "chatcmpl-p1" and e["object"] == "chat.completion.chunk" for e in events[:-1])
    assert events[3]["choices"][0]["finish_reason"] == "stop" and "fleetwire" not in events[3]
    assert events[4]["choices"] == [] and events[4]["usage"]["total_tokens"] == 7
    assert events[4]["fleetwire"]["joules"] == 3.0 and events[4]["fleetwire"]["gco2e"] == 0.1


def test_streamed_completion_without_usage_carries_the_receipt_on_the_finish_chunk() -> None:
    """A completion stream's chunks are text_completion; without include_usage the finish chunk has the extension."""
    answer = reply({"model": "m1", "prompt": "say", "stream": True}, "completion")
    data = answer.event("token", {"text": "ok"}, 0.1).data + answer.event("succeeded", succeeded("ok"), 0.2).data
    events = sse(http(data)[2])
    assert events[0]["choices"][0]["text"] == "ok" and events[0]["object"] == "text_completion"
    assert events[1]["choices"][0]["finish_reason"] == "stop" and events[1]["fleetwire"]["plan_id"] == "p1"
    assert events[1]["fleetwire"]["joules"] is None  # no receipt came
    assert events[2] == "[DONE]" and len(events) == 3


def test_stream_whose_plan_ends_without_tokens_still_gets_the_text() -> None:
    """A streamed request whose handler sent no token events gets the result's text as one chunk."""
    answer = reply({**CHAT, "stream": True})
    events = sse(http(answer.event("succeeded", succeeded("whole"), 0.1).data)[2])
    assert [e["choices"][0]["delta"].get("content") for e in events[:2]] == ["", "whole"]
    assert events[-1] == "[DONE]"


@pytest.mark.parametrize(("data", "status", "code"), [
    ({"code": codes.ENGINE_ERROR, "message": "engine down"}, 502, codes.ENGINE_ERROR),
    ({"code": codes.ENGINE_ERROR, "message": "no such model", "detail": {"status": 404}}, 404, codes.ENGINE_ERROR),
    ({"code": codes.ENGINE_ERROR, "message": "engine key", "detail": {"status": 401}}, 502, codes.ENGINE_ERROR),
    ({"code": codes.INVALID_ARGUMENT, "message": "n must be 1"}, 400, codes.INVALID_ARGUMENT),
    ({"code": codes.TIMEOUT, "message": "too slow"}, 504, codes.TIMEOUT),
    ({"code": codes.WORKER_LOST, "message": "lost"}, 503, codes.WORKER_LOST),
    ({"code": codes.HANDLER_ERROR, "message": "boom"}, 500, codes.HANDLER_ERROR),
    ("garbage", 500, codes.INTERNAL),
])
def test_failed_plan_before_any_text_is_an_http_error_of_its_status(data: Any, status: int, code: str) -> None:
    """A plan failing before any text is answered with the status of its code and OpenAI's error shape."""
    answer = reply({**CHAT, "stream": True})
    out = answer.event("failed", data, 1.0)
    got_status, headers, raw = http(out.data)
    assert out.done and got_status == status and headers["x-fleetwire-plan-id"] == "p1"
    assert json.loads(raw)["error"]["code"] == code
    assert plan_failure(data).status == status


def test_failure_mid_stream_is_an_error_event_and_never_done() -> None:
    """After text was streamed a failure ends the stream with an error event and no [DONE]."""
    answer = reply({**CHAT, "stream": True})
    data = answer.event("token", {"text": "par"}, 0.1).data
    out = answer.event("failed", {"code": codes.ENGINE_ERROR, "message": "engine died"}, 0.2)
    events = sse(http(data + out.data)[2])
    assert out.done and events[-1]["error"]["message"] == "engine died" and "[DONE]" not in events


def test_worker_lost_before_any_text_resumes_unseen_and_after_text_fails_and_cancels() -> None:
    """requeued before the first text: the request waits again; after it: an error event, and the plan is cancelled."""
    answer = reply({**CHAT, "stream": True}, timeout_s=10.0)
    answer.event("leased", {"worker_id": "w1", "attempt": 1}, 1.0)
    assert answer.deadline is None
    assert answer.event("requeued", {"reason": "worker lost", "attempt": 2}, 5.0).data == b""
    assert answer.state == "waiting" and answer.deadline == 15.0  # the queue timeout starts again
    data = answer.event("token", {"text": "a"}, 6.0).data
    out = answer.event("requeued", {"reason": "worker w2 lost", "attempt": 3}, 7.0)
    assert out.done and out.cancel
    error = sse(http(data + out.data)[2])[-1]["error"]
    assert error["code"] == "worker_lost" and "after 1 chunks" in error["message"]


def test_queue_timeout_answers_503_with_the_waiting_reason_and_cancels() -> None:
    """No worker took it within the timeout: 503 + Retry-After naming why it waited; the door cancels the plan."""
    answer = reply(timeout_s=2.0)
    answer.event("waiting", {"reason": "all matching workers are at capacity"}, 0.1)
    assert answer.expire(1.9).data == b""
    out = answer.expire(2.0)
    status, headers, raw = http(out.data)
    assert out.done and out.cancel and status == 503 and headers["retry-after"] == "1"
    assert "within 2 s (all matching workers are at capacity)" in json.loads(raw)["error"]["message"]
    assert answer.expire(3.0).data == b"" and answer.event("succeeded", succeeded(), 3.0).data == b""


def test_queue_timeout_stops_once_the_plan_is_leased() -> None:
    """A leased plan is not timed out by the door (its own timeout_s applies)."""
    answer = reply(timeout_s=2.0)
    answer.event("leased", {"worker_id": "w1", "attempt": 1}, 1.0)
    assert answer.expire(100.0).data == b""


def test_tool_call_deltas_stream_as_sent_and_are_gathered_without_stream() -> None:
    """delta events pass on in a stream and become message.tool_calls (arguments joined) in a whole answer."""
    parts = [{"tool_calls": [{"index": 0, "id": "call_1", "type": "function",
                              "function": {"name": "count", "arguments": ""}}]},
             {"tool_calls": [{"index": 0, "function": {"arguments": '{"wo'}}]},
             {"tool_calls": [{"index": 0, "function": {"arguments": 'rds": 3}'}}]}]
    streamed = reply({**CHAT, "stream": True})
    data = b"".join(streamed.event("delta", p, 0.1).data for p in parts)
    data += streamed.event("succeeded", succeeded("", "tool_calls"), 0.2).data
    events = sse(http(data)[2])
    assert [e["choices"][0]["delta"] for e in events[1:4]] == parts
    assert events[4]["choices"][0]["finish_reason"] == "tool_calls"
    whole = reply()
    for p in parts:
        whole.event("delta", p, 0.1)
    message = json.loads(http(whole.event("succeeded", succeeded("", "tool_calls"), 0.2).data)[2])["choices"][0]
    assert message["finish_reason"] == "tool_calls" and message["message"]["content"] is None
    assert message["message"]["tool_calls"] == [{"id": "call_1", "type": "function",
                                                 "function": {"name": "count", "arguments": '{"words": 3}'}}]


def test_cancelled_by_someone_else_is_an_error_and_refusals_map_to_statuses() -> None:
    """An operator's cancel is a 503; refused submits map to 429 (plan limit), 503 (store away), 400."""
    out = reply().event("cancelled", {"reason": "cancelled by an admin"}, 1.0)
    assert http(out.data)[0] == 503 and not out.cancel
    assert submit_refused(codes.TOO_MANY_PLANS, "limit").status == 429
    assert submit_refused(codes.TOO_MANY_PLANS, "limit").retry_after_s > 0
    assert submit_refused(codes.UNAVAILABLE, "away").status == 503
    assert submit_refused(codes.INVALID_ARGUMENT, "bad").status == 400
    assert http(reply().refused(ApiError(401, "bad key", code="invalid_api_key")).data)[1]["www-authenticate"]


def test_connection_close_is_said_when_the_connection_ends_after_the_answer() -> None:
    """keep_alive=False adds Connection: close to the head."""
    request = parse_request("chat", body(CHAT))
    answer = Reply(request, created=0, now=0.0, queue_timeout_s=1.0, keep_alive=False)
    answer.accepted("p9")
    assert http(answer.event("succeeded", succeeded(), 0.1).data)[1]["connection"] == "close"


@pytest.mark.parametrize("keep_alive", [True, False])
def test_a_streams_head_is_the_head_codecs_for_its_plan_id(keep_alive: bool) -> None:
    """A stream's 200 head, made once and given each request's plan id, is byte for byte the head the HTTP codec
    makes with that plan id's headers."""
    request = parse_request("chat", body({**CHAT, "stream": True}))
    answer = Reply(request, created=0, now=0.0, queue_timeout_s=1.0, keep_alive=keep_alive)
    answer.accepted("oai-5f3a")
    headers = {"Content-Type": "text/event-stream", "Transfer-Encoding": "chunked", "Cache-Control": "no-cache",
               "x-fleetwire-plan-id": "oai-5f3a", "x-request-id": "oai-5f3a"}
    if not keep_alive:
        headers["Connection"] = "close"
    assert answer.event("token", {"text": "x"}, 0.1).data.startswith(format_response(200, headers))


def test_chat_chunks_are_the_json_of_openais_chunk_objects() -> None:
    """The chunks made on the request's template (role, text, finish with the extension) are byte for byte the
    JSON of OpenAI's chunk objects."""
    answer = reply({**CHAT, "stream": True})
    data = answer.event("token", {"text": "a\"b"}, 0.1).data + answer.event("succeeded", succeeded("a\"b"), 0.2).data
    _, _, raw = http(data)
    lines = [line for line in raw.split(b"\n\n") if line.startswith(b"data: {")]
    head = {"id": "chatcmpl-p1", "object": "chat.completion.chunk", "created": 1_700_000_000, "model": "m1"}

    def chunk(delta: dict[str, Any], finish: str | None, **extra: Any) -> bytes:
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        return b"data: " + msgspec.json.encode({**head, "choices": [choice], **extra})

    extension = json.loads(lines[2][6:])["fleetwire"]
    assert lines[0] == chunk({"role": "assistant", "content": ""}, None)
    assert lines[1] == b"data: " + msgspec.json.encode({**head, "choices": [{"index": 0, "delta": {"content": "a\"b"},
                                                                              "finish_reason": None}]})  # fmt: skip
    assert lines[2] == chunk({}, "stop", fleetwire=extension) and extension["plan_id"] == "p1"


def test_a_plan_id_with_a_line_break_never_reaches_a_head() -> None:
    """A plan id that would split the answer's head is refused (ValueError), not written."""
    request = parse_request("chat", body({**CHAT, "stream": True}))
    with pytest.raises(ValueError, match="line break"):
        Reply(request, created=0, now=0.0, queue_timeout_s=1.0).accepted("p1\r\nSet-Cookie: x=1")


def test_door_request_is_frozen() -> None:
    """A checked request cannot be changed after its plan was made from it."""
    request = parse_request("chat", body(CHAT))
    assert isinstance(request, DoorRequest)
    with pytest.raises(AttributeError):
        request.model = "other"  # type: ignore[misc]


# ---------------------------------------------------------------------------------------------- HTTP intake


def post(path: str, payload: bytes, **headers: str) -> bytes:
    lines = [f"POST {path} HTTP/1.1", "Host: x", f"Content-Length: {len(payload)}"]
    lines += [f"{k.replace('_', '-')}: {v}" for k, v in headers.items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + payload


def test_intake_cuts_pipelined_requests_fed_byte_by_byte() -> None:
    """Two pipelined requests fed one byte at a time come out whole, in order, with their bodies."""
    reader = RequestReader()
    data = post("/v1/chat/completions", b'{"a": 1}', Authorization="Bearer k") + post("/v1/models", b"")
    got: list[Any] = []
    for i in range(len(data)):
        got += reader.feed(data[i:i + 1])
    assert [(r.method, r.path, r.body) for r in got] == [("POST", "/v1/chat/completions", b'{"a": 1}'),
                                                          ("POST", "/v1/models", b"")]
    assert got[0].headers["authorization"] == "Bearer k" and reader.buffered == 0


def test_intake_cuts_the_same_requests_wherever_the_bytes_are_split() -> None:
    """Three pipelined requests fed in two pieces, split at every byte, come out as fed whole (and fed alone)."""
    requests = [post("/v1/chat/completions", b'{"a": 1}'), post("/v1/models", b""), post("/v1/completions", b"xyz")]
    data = b"".join(requests)

    def cut(*pieces: bytes) -> list[tuple[str, bytes]]:
        reader = RequestReader()
        got = [request for piece in pieces for request in reader.feed(piece)]
        assert reader.buffered == 0
        return [(r.path, r.body) for r in got]  # type: ignore[union-attr]

    whole = cut(data)
    assert whole == [("/v1/chat/completions", b'{"a": 1}'), ("/v1/models", b""), ("/v1/completions", b"xyz")]
    assert cut(*requests) == whole
    for at in range(1, len(data)):
        assert cut(data[:at], data[at:]) == whole, at


def test_intake_answers_expect_continue_before_the_body() -> None:
    """Expect: 100-continue gets 100 Continue once the head is read, then the request when its body came."""
    reader = RequestReader()
    data = post("/v1/completions", b"x" * 2000, Expect="100-continue")
    head_len = data.index(b"\r\n\r\n") + 4
    first = reader.feed(data[:head_len])
    assert first == [b"HTTP/1.1 100 Continue\r\n\r\n"]
    assert [r.body for r in reader.feed(data[head_len:])] == [b"x" * 2000]  # type: ignore[union-attr]


@pytest.mark.parametrize(("data", "status"), [
    (post("/v1/chat/completions", b"", Content_Length="99999999999").replace(b"Content-Length: 0\r\n", b""), 413),
    (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n", 411),
    (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\n", 400),
    (b"GARBAGE\r\n\r\n", 400),
    (b"GET /" + b"a" * 20_000, 431),
])
def test_intake_refuses_bad_heads_with_their_status(data: bytes, status: int) -> None:
    """An oversize body (from its head), a body without a length, a malformed or huge head: 413, 411, 400, 431."""
    with pytest.raises(ApiError) as caught:
        RequestReader().feed(data)
    assert caught.value.status == status


def test_http_1_0_closes_unless_asked_to_keep_alive() -> None:
    """An HTTP/1.0 request is not kept alive without Connection: keep-alive."""
    (request,) = RequestReader().feed(b"GET /v1/models HTTP/1.0\r\n\r\n")
    assert not request.keep_alive  # type: ignore[union-attr]


# ---------------------------------------------------------------------------------------------- models


def worker(worker_id: str, models: list[str], *, ops: tuple[str, ...] = ("generate",), draining: bool = False) -> Any:
    record = WorkerRecord(id=worker_id, capabilities=Capabilities(models=models, ops=list(ops)))
    record.draining = draining
    return record


def test_models_lists_what_alive_generate_workers_serve_with_counts() -> None:
    """/v1/models: each model of a worker with op generate, its workers and the undrained ones; others not."""
    fleet = [worker("a", ["m1", "m2"]), worker("b", ["m1"], draining=True), worker("c", ["m3"], ops=("echo",))]
    listing = ModelTable(lambda now: fleet).listing(0.0)
    assert listing["object"] == "list"
    assert [(m["id"], m["fleetwire"]) for m in listing["data"]] == [
        ("m1", {"workers": 2, "available": 1}), ("m2", {"workers": 1, "available": 1})]


def test_model_table_scans_at_most_every_interval_and_again_on_an_old_miss() -> None:
    """Hits reuse the table for a second; a miss rebuilds it once 0.1 s old; a miss loop costs one scan per 0.1 s."""
    fleet = [worker("a", ["m1"])]
    table = ModelTable(lambda now: fleet)
    assert table.serves("m1", 0.0) and table.scans == 1
    assert table.serves("m1", 0.9) and table.scans == 1
    fleet.append(worker("b", ["m2"]))
    assert not table.serves("m2", 0.05) and table.scans == 1  # the table is 50 ms old: no rescan yet
    assert table.serves("m2", 0.15) and table.scans == 2  # a miss on an older table looks again
    for step in range(100):
        table.serves("nope", 0.15 + step * 0.001)
    assert table.scans == 2


def test_a_pool_header_narrows_the_model_check_and_the_listing_to_that_pools_workers() -> None:
    """x-fleetwire-pool: a model only another pool serves is not served for it; the listing shows the pool's."""
    gpu = worker("a", ["m1"])
    gpu.capabilities = Capabilities(models=["m1"], ops=["generate"], tags=["pool:gpu"])
    table = ModelTable(lambda now: [gpu, worker("b", ["m2"])])
    assert table.serves("m1", 0.0) and table.serves("m1", 0.0, "gpu") and not table.serves("m1", 0.0, "")
    assert table.serves("m2", 0.0, "") and not table.serves("m2", 0.0, "gpu")
    assert [m["id"] for m in table.listing(0.0, pool="gpu")["data"]] == ["m1"]


def test_a_pool_header_makes_the_plan_require_the_pools_tag() -> None:
    """The plan of a request with x-fleetwire-pool requires pool:NAME (its shard's pool in cluster mode); a pool
    name with a comma is a 400 naming the header."""
    assert parse_request("chat", body(CHAT), pool="gpu").submit(1).requirements.tags == ["pool:gpu"]
    assert parse_request("chat", body(CHAT)).submit(1).requirements.tags == []
    with pytest.raises(ApiError) as caught:
        parse_request("chat", body(CHAT), pool="a,b")
    assert caught.value.status == 400 and caught.value.param == "x-fleetwire-pool"


# ---------------------------------------------------------------------------------------------- request rate


def test_request_rate_refuses_past_the_burst_with_the_wait_and_refills() -> None:
    """2 requests/s with a burst of 2: the third at once waits 0.5 s; refused ones cost no token; principals apart."""
    rate = RequestRate(2.0, 2)
    assert rate.admit("alice", 0.0) == 0.0 and rate.admit("alice", 0.0) == 0.0
    assert rate.admit("alice", 0.0) == pytest.approx(0.5)
    assert rate.admit("alice", 0.1) == pytest.approx(0.4)  # the refusal took nothing: the wait only shrinks
    assert rate.admit("bob", 0.1) == 0.0
    assert rate.admit("alice", 0.5) == 0.0
    assert RequestRate(0.0).admit("alice", 0.0) == 0.0  # 0: no limit


def test_request_rate_table_is_bounded() -> None:
    """Past max_principals the buckets are forgotten: each starts full again."""
    rate = RequestRate(1.0, 1, max_principals=2)
    assert rate.admit("a", 0.0) == 0.0 and rate.admit("a", 0.0) > 0
    rate.admit("b", 0.0)
    rate.admit("c", 0.0)  # the table was full: cleared
    assert rate.admit("a", 0.0) == 0.0


# ---------------------------------------------------------------------------------------------- cluster relay


def test_upstream_request_drops_hop_by_hop_headers_and_asks_to_close() -> None:
    """The forwarded request keeps the key and the fleetwire headers, drops Connection/Expect, closes after."""
    data = upstream_request("POST", "/v1/chat/completions", {"authorization": "Bearer k", "expect": "100-continue",
                            "connection": "keep-alive", "x-fleetwire-session": "s1"}, b"{}", client="10.0.0.1")
    (request,) = RequestReader().feed(data)
    assert isinstance(request, HttpRequest) and not request.keep_alive and request.body == b"{}"
    assert request.headers["authorization"] == "Bearer k" and request.headers["x-fleetwire-session"] == "s1"
    assert "expect" not in request.headers and request.headers["x-forwarded-for"] == "10.0.0.1"


def test_response_relay_passes_a_stream_on_as_it_comes_and_knows_its_end() -> None:
    """A chunked answer: the head again without the upstream's Connection: close, the body byte for byte, complete
    only after the last chunk, however the bytes are cut."""
    reply = Reply(parse_request("chat", body({**CHAT, "stream": True})), created=1, now=0.0, queue_timeout_s=30,
                  keep_alive=False)  # fmt: skip
    reply.accepted("p1")
    upstream = reply.event("token", {"text": "hi"}, 0.0).data
    upstream += reply.event("succeeded", {"result": {"text": "hi"}}, 0.0).data
    relay = ResponseRelay(keep_alive=True)
    most = upstream[:-1]
    out = b"".join(relay.feed(most[i:i + 7]) for i in range(0, len(most), 7))
    assert not relay.complete and out.split(b"\r\n\r\n", 1)[1] == most.split(b"\r\n\r\n", 1)[1]  # byte for byte
    out += relay.feed(upstream[-1:])
    assert relay.complete and relay.status == 200
    status, headers, streamed = http(out)
    assert status == 200 and "connection" not in headers and b"data: [DONE]" in streamed


def test_response_relay_keeps_the_clients_close_and_refuses_a_non_http_answer() -> None:
    """A client that said close gets Connection: close on a whole answer; garbage from upstream is a 502."""
    relay = ResponseRelay(keep_alive=False)
    out = relay.feed(error_response(ApiError(404, "no such model")))
    assert relay.complete and relay.status == 404
    assert http(out)[1]["connection"] == "close"
    with pytest.raises(ApiError) as caught:
        ResponseRelay(keep_alive=True).feed(b"SSH-2.0-OpenSSH\r\n\r\n")
    assert caught.value.status == 502
