"""A small OpenAI-compatible inference server that speaks like vLLM, for trying the fleet anywhere.

It is a real HTTP/1.1 server (standard library only) with the endpoints a fleetwire worker uses:

* ``POST /v1/chat/completions`` and ``POST /v1/completions``: with ``"stream": true`` it streams
  server-sent events, one ``data: {chunk}`` per token, a last chunk with ``finish_reason``, a usage
  chunk when ``stream_options.include_usage`` is set, then ``data: [DONE]`` — the OpenAI format vLLM,
  SGLang, TGI and llama.cpp share. Without ``stream`` it answers one JSON object.
* ``GET /v1/models``: the one model it "serves".
* ``GET /metrics``: vLLM's gauges ``vllm:num_requests_running``, ``vllm:num_requests_waiting`` and
  ``vllm:kv_cache_usage_perc`` from the streams open right now (beyond ``max_running`` they wait,
  like vLLM's scheduler; each running stream holds ``blocks_per_request`` KV blocks), its
  ``vllm:cache_config_info`` (``num_gpu_blocks``, ``block_size``), and the histograms
  ``vllm:request_prompt_tokens`` and ``vllm:e2e_request_latency_seconds`` of finished requests.

The "model" answers with the words of the prompt, reversed, then ``[from <name>]``: deterministic,
so tests can check every token. A chat request with ``tools`` is answered with a call of the first
tool instead (``finish_reason: tool_calls``; streamed as OpenAI streams it, the arguments
``{"words": <the prompt's word count>}`` in two parts). Replace it with a real engine, e.g.
``vllm serve Qwen/Qwen2.5-0.5B-Instruct --port 8000``, and nothing else changes.

Usage: ``python fake_engine.py --port 8001 --name engine-a`` (prints ``fake engine listening on
http://127.0.0.1:8001`` once it accepts connections).
"""

from __future__ import annotations

import argparse
import json
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


class FakeEngine:
    """The server and its state; :meth:`start` runs it in a thread (for tests), :meth:`serve` in this one.

    Args:
        host: interface to bind (loopback by default).
        port: TCP port; 0 picks a free one (see :attr:`url`).
        name: appended to every answer, so a client can tell engines apart.
        model: the model id it reports.
        token_delay_s: pause before each streamed token, like a real decoder's step.
        max_running: streams decoded at once; more wait (counted in ``vllm:num_requests_waiting``).
        num_gpu_blocks, block_size: the KV-cache budget it reports (``vllm:cache_config_info``).
        blocks_per_request: KV blocks each running stream holds.
    """

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        name: str = "fake",
        model: str = "fake-model",
        token_delay_s: float = 0.01,
        max_running: int = 1_000_000,
        num_gpu_blocks: int = 2560,
        block_size: int = 16,
        blocks_per_request: int = 256,
    ) -> None:
        self.name = name
        self.model = model
        self.token_delay_s = token_delay_s
        self.max_running = max_running
        self.num_gpu_blocks = num_gpu_blocks
        self.block_size = block_size
        self.blocks_per_request = blocks_per_request
        self.finished: list[tuple[int, float]] = []  # (prompt tokens, seconds) of each finished stream
        self.running = 0  # streams open now (vllm:num_requests_running)
        self.requests: list[dict[str, Any]] = []  # every request body received, for tests
        self.traceparents: list[str] = []  # each request's W3C traceparent header ("": none), as vLLM would read it
        self.disconnects = 0  # streams the client closed before the end
        self._lock = threading.Condition()
        engine = self

        class Handler(_Handler):
            fake = engine

        self._server = ThreadingHTTPServer((host, port), Handler)
        self._server.daemon_threads = True
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> FakeEngine:
        """Serve in a daemon thread; returns self."""
        self._thread = threading.Thread(
            target=self._server.serve_forever,
            kwargs={"poll_interval": 0.05},  # stop() returns within 50 ms
            name=f"fake-engine-{self.name}",
            daemon=True,
        )
        self._thread.start()
        return self

    def serve(self) -> None:
        """Serve in this thread until interrupted."""
        self._server.serve_forever()

    def stop(self) -> None:
        """Stop serving (when :meth:`start` ran) and close the socket."""
        if self._thread is not None:
            self._server.shutdown()
            self._thread.join()
        self._server.server_close()

    def reply_tokens(self, prompt: str, max_tokens: int | None) -> tuple[list[str], str]:
        """The tokens of the answer to ``prompt`` and the finish reason."""
        words = [*prompt.split()[::-1], f"[from {self.name}]"]
        tokens = [word if i == 0 else " " + word for i, word in enumerate(words)]
        if max_tokens is not None and len(tokens) > max_tokens:
            return tokens[:max_tokens], "length"
        return tokens, "stop"

    def metrics(self) -> str:
        with self._lock:
            open_streams, finished = self.running, list(self.finished)
        running, waiting = min(open_streams, self.max_running), max(0, open_streams - self.max_running)
        usage = min(1.0, running * self.blocks_per_request / max(1, self.num_gpu_blocks))
        label = f'model_name="{self.model}"'
        return (
            "# HELP vllm:num_requests_running Number of requests in model execution batches.\n"
            "# TYPE vllm:num_requests_running gauge\n"
            f"vllm:num_requests_running{{{label}}} {float(running)}\n"
            "# HELP vllm:num_requests_waiting Number of requests waiting to be processed.\n"
            "# TYPE vllm:num_requests_waiting gauge\n"
            f"vllm:num_requests_waiting{{{label}}} {float(waiting)}\n"
            "# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.\n"
            "# TYPE vllm:kv_cache_usage_perc gauge\n"
            f"vllm:kv_cache_usage_perc{{{label}}} {usage}\n"
            "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig\n"
            "# TYPE vllm:cache_config_info gauge\n"
            f'vllm:cache_config_info{{block_size="{self.block_size}",num_gpu_blocks="{self.num_gpu_blocks}"}} 1.0\n'
            + _histogram("vllm:request_prompt_tokens", "Number of prefill tokens processed.", label,
                         [float(p) for p, _ in finished], (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000))
            + _histogram("vllm:e2e_request_latency_seconds", "Histogram of end to end request latency in seconds.",
                         label, [s for _, s in finished],
                         (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0))
        )

    def _track(self, delta: int) -> None:
        with self._lock:
            self.running += delta
            self._lock.notify_all()

    def wait_idle(self, timeout_s: float) -> bool:
        """Wait until no stream is open (a cancelled client's stream ends at the next write)."""
        with self._lock:
            return self._lock.wait_for(lambda: self.running == 0, timeout_s)


def _histogram(name: str, help_text: str, label: str, values: list[float], bounds: tuple[float, ...]) -> str:
    """A Prometheus histogram exposition of ``values`` (cumulative buckets, sum and count)."""
    lines = [f"# HELP {name} {help_text}", f"# TYPE {name} histogram"]
    for bound in (*bounds, float("inf")):
        le = "+Inf" if bound == float("inf") else repr(float(bound))
        lines.append(f'{name}_bucket{{{label},le="{le}"}} {float(sum(1 for v in values if v <= bound))}')
    lines += [f"{name}_sum{{{label}}} {float(sum(values))}", f"{name}_count{{{label}}} {float(len(values))}"]
    return "\n".join(lines) + "\n"


def _tool_call_of(body: dict[str, Any], prompt: str) -> dict[str, Any] | None:
    """The call of the request's first tool, whole (``tools`` in a chat request), or None."""
    tools = body.get("tools")
    if not isinstance(tools, list) or not tools or not isinstance(tools[0], dict):
        return None
    name = str((tools[0].get("function") or {}).get("name", "tool"))
    arguments = json.dumps({"words": len(prompt.split())})
    return {"id": f"call_{name}", "type": "function", "function": {"name": name, "arguments": arguments}}


def _prompt_of(body: dict[str, Any], chat: bool) -> str:
    if chat:
        messages = body.get("messages") or []
        users = [m.get("content", "") for m in messages if isinstance(m, dict) and m.get("role") == "user"]
        return str(users[-1]) if users else ""
    prompt = body.get("prompt", "")
    return " ".join(map(str, prompt)) if isinstance(prompt, list) else str(prompt)


class _Handler(BaseHTTPRequestHandler):
    fake: FakeEngine
    protocol_version = "HTTP/1.1"  # keep-alive and chunked streams, as real engines answer
    disable_nagle_algorithm = True  # each chunk goes out at once, as uvicorn's (vLLM's server) do

    def log_message(self, format: str, *args: Any) -> None:
        pass  # quiet: tests and the example print what matters themselves

    def _json(self, status: int, payload: Any) -> None:
        body = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        if self.path == "/v1/models":
            self._json(200, {"object": "list", "data": [{"id": self.fake.model, "object": "model"}]})
        elif self.path == "/metrics":
            body = self.fake.metrics().encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        else:
            self._json(404, {"error": {"message": f"no route {self.path}", "type": "not_found"}})

    def do_POST(self) -> None:
        chat = self.path == "/v1/chat/completions"
        if not chat and self.path != "/v1/completions":
            self._json(404, {"error": {"message": f"no route {self.path}", "type": "not_found"}})
            return
        try:
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", "0"))) or b"{}")
            assert isinstance(body, dict)
        except (ValueError, AssertionError):
            self._json(400, {"error": {"message": "request body must be a JSON object", "type": "invalid_request"}})
            return
        self.fake.requests.append(body)
        self.fake.traceparents.append(self.headers.get("traceparent", ""))
        if body.get("model", self.fake.model) != self.fake.model:
            message = f"The model `{body['model']}` does not exist."
            self._json(404, {"error": {"message": message, "type": "NotFoundError", "code": 404}})
            return
        prompt = _prompt_of(body, chat)
        tokens, finish = self.fake.reply_tokens(prompt, body.get("max_tokens"))
        call = _tool_call_of(body, prompt) if chat else None
        if call is not None:
            tokens, finish = [], "tool_calls"
        ident = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:12]}"
        usage = {"prompt_tokens": len(prompt.split()), "completion_tokens": len(tokens),
                 "total_tokens": len(prompt.split()) + len(tokens)}
        if not body.get("stream"):
            choice: dict[str, Any] = {"index": 0, "finish_reason": finish}
            if chat:
                choice["message"] = {"role": "assistant", "content": "".join(tokens)}
                if call is not None:
                    choice["message"] = {"role": "assistant", "content": None, "tool_calls": [call]}
            else:
                choice["text"] = "".join(tokens)
            self._json(200, {"id": ident, "model": self.fake.model, "choices": [choice], "usage": usage})
            return
        self._stream(chat, ident, tokens, finish, usage, bool((body.get("stream_options") or {}).get("include_usage")),
                     call)

    def _stream(
        self, chat: bool, ident: str, tokens: list[str], finish: str, usage: dict[str, int], include_usage: bool,
        call: dict[str, Any] | None = None,
    ) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        kind = "chat.completion.chunk" if chat else "text_completion"
        base = {"id": ident, "object": kind, "created": int(time.time()), "model": self.fake.model}

        def choice(text: str | None, finish_reason: str | None) -> dict[str, Any]:
            if chat:
                delta = {} if text is None else {"content": text}
                return {"index": 0, "delta": delta, "finish_reason": finish_reason}
            return {"index": 0, "text": text or "", "finish_reason": finish_reason}

        events: list[dict[str, Any] | str] = []
        if chat:
            events.append({**base, "choices": [{"index": 0, "delta": {"role": "assistant"}, "finish_reason": None}]})
        events += [{**base, "choices": [choice(token, None)]} for token in tokens]
        if call is not None:  # OpenAI's way: the call's id and name first, then its arguments in parts
            arguments = call["function"]["arguments"]
            half = len(arguments) // 2
            first = {"index": 0, "id": call["id"], "type": "function",
                     "function": {"name": call["function"]["name"], "arguments": ""}}
            parts = [first, *({"index": 0, "function": {"arguments": a}} for a in (arguments[:half], arguments[half:]))]
            for part in parts:
                delta = {"tool_calls": [part]}
                events.append({**base, "choices": [{"index": 0, "delta": delta, "finish_reason": None}]})
        events.append({**base, "choices": [choice(None, finish)]})
        if include_usage:
            events.append({**base, "choices": [], "usage": usage})
        events.append("[DONE]")
        self.fake._track(+1)
        started = time.monotonic()
        counted = False
        try:
            for event in events:
                if self.fake.token_delay_s and isinstance(event, dict) and event["choices"]:
                    time.sleep(self.fake.token_delay_s)
                payload = event if isinstance(event, str) else json.dumps(event)
                data = f"data: {payload}\n\n".encode()
                self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
                self.wfile.flush()
            # Counted finished before the body's end goes out: a client that read the end and then scrapes
            # /metrics sees this request among the finished ones, not still running.
            counted = True
            self._finished(usage["prompt_tokens"], started)
            self.wfile.write(b"0\r\n\r\n")
            self.wfile.flush()
        except (BrokenPipeError, ConnectionResetError):
            self.fake.disconnects += 1  # the client went away: a real engine aborts the request here
            self.close_connection = True
        finally:
            if not counted:
                self._finished(usage["prompt_tokens"], started)

    def _finished(self, prompt_tokens: int, started: float) -> None:
        self.fake._track(-1)
        with self.fake._lock:
            self.fake.finished.append((prompt_tokens, time.monotonic() - started))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000, help="0 picks a free port")
    parser.add_argument("--name", default="fake", help="added to every answer")
    parser.add_argument("--model", default="fake-model")
    parser.add_argument("--token-delay", type=float, default=0.02, metavar="S", help="pause before each token")
    ns = parser.parse_args()
    engine = FakeEngine(ns.host, ns.port, name=ns.name, model=ns.model, token_delay_s=ns.token_delay)
    print(f"fake engine listening on {engine.url}", flush=True)
    try:
        engine.serve()
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
