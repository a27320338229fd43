"""The OpenAI-compatible inference handler: op ``generate`` against a local vLLM, SGLang,
llama.cpp server or TGI, and the engine's load read from its Prometheus metrics.

Theory of operation (docs/OPERATIONS.md §Inference workers):

* ``generate`` takes ``{"messages": [...]}`` (chat, ``POST /v1/chat/completions``) or
  ``{"prompt": ...}`` (completion, ``POST /v1/completions``), plus any OpenAI request field
  (``model``, ``max_tokens``, ``temperature``, ``stop``, ...), which is passed through. The request
  always streams (``stream: true``, with ``stream_options.include_usage`` unless turned off).
* Each server-sent event ``data: {chunk}`` with text becomes an **ephemeral** ``token`` event
  ``{"text": ...}`` on the plan's stream; ``data: [DONE]`` ends it. The plan's result is
  ``{"text", "finish_reason", "model", "usage": {prompt_tokens, completion_tokens, total_tokens},
  "usage_estimated", "ttft_s", "duration_s"}``. Without a usage chunk the completion tokens are
  estimated as the number of text chunks (``usage_estimated: true``).
* The completion tokens are reported to the agent (``ctx.report_tokens``), which divides the
  plan's measured GPU energy by them (worker_agent/energy.py).
* Failures are plan failures with code ``engine_error`` and a message naming the URL and the
  engine's answer; a malformed request is ``invalid_argument``. Cancelling the plan closes the
  HTTP stream, which makes vLLM, SGLang, TGI and llama.cpp abort the request.
* :meth:`InferenceEngine.poll_metrics_forever` scrapes the engine's ``/metrics`` every few
  seconds; running and waiting requests and KV-cache usage go into the worker's ``load`` frames
  (vLLM ``vllm:num_requests_running|waiting``, ``vllm:kv_cache_usage_perc`` or
  ``vllm:gpu_cache_usage_perc``; SGLang, TGI and llama.cpp equivalents in :data:`ENGINE_GAUGES`).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final
from urllib.parse import urlsplit

import httpx
import structlog
from prometheus_client.parser import text_string_to_metric_families

from protocol import errors
from worker_agent.handlers import Context, HandlerError

log = structlog.get_logger(__name__)

__all__ = ["ENGINE_GAUGES", "EngineLoad", "InferenceEngine", "parse_engine_metrics"]

#: Engine metric names per load field. Values of one field are summed over label sets (several
#: models or engines behind one URL), except KV-cache usage, which takes the largest.
ENGINE_GAUGES: Final[Mapping[str, tuple[str, ...]]] = {
    "running": (
        "vllm:num_requests_running", "sglang:num_running_reqs", "tgi_batch_current_size",
        "llamacpp:requests_processing",
    ),
    "waiting": (
        "vllm:num_requests_waiting", "sglang:num_queue_reqs", "tgi_queue_size", "llamacpp:requests_deferred",
    ),
    "kv_cache": (
        "vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc", "sglang:token_usage", "llamacpp:kv_cache_usage_ratio",
    ),
}
# Request fields the handler sets itself.
_OWN_FIELDS: Final = frozenset({"stream", "stream_options"})


@dataclass(frozen=True, slots=True)
class EngineLoad:
    """What the engine's metrics say about its load."""

    running: int = 0
    waiting: int = 0
    kv_cache_usage: float = 0.0  # 0..1


def parse_engine_metrics(text: str) -> EngineLoad:
    """The engine load in a Prometheus text exposition (unknown metrics are ignored).

    Raises:
        ValueError: the text is not valid Prometheus exposition format.
    """
    wanted = {name: field for field, names in ENGINE_GAUGES.items() for name in names}
    sums = {"running": 0.0, "waiting": 0.0}
    kv = 0.0
    for family in text_string_to_metric_families(text):
        field = wanted.get(family.name)
        if field is None:
            continue
        for sample in family.samples:
            if sample.name != family.name:  # e.g. _created siblings
                continue
            if field == "kv_cache":
                kv = max(kv, float(sample.value))
            else:
                sums[field] += float(sample.value)
    return EngineLoad(running=int(sums["running"]), waiting=int(sums["waiting"]), kv_cache_usage=min(1.0, kv))


def _base_url(url: str) -> str:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ValueError(f"inference URL must look like http://host:port, got {url!r}")
    base = url.rstrip("/")
    return base.removesuffix("/v1")


class InferenceEngine:
    """An OpenAI-compatible server this worker fronts.

    Args:
        url: the server, e.g. ``http://127.0.0.1:8000`` (a trailing ``/v1`` is accepted).
        model: the model to request when a plan names none; default: the first one the
            server lists at ``/v1/models``.
        api_key: sent as ``Authorization: Bearer`` (llama.cpp ``--api-key``, vLLM ``--api-key``).
        metrics_url: the engine's Prometheus endpoint; default ``<url>/metrics``; None: don't scrape.
        metrics_interval_s: seconds between scrapes.
        include_usage: ask for a final usage chunk (``stream_options.include_usage``).
        connect_timeout_s: how long connecting may take.
        read_timeout_s: the longest silence between two chunks of a stream.
    """

    def __init__(
        self,
        url: str,
        *,
        model: str | None = None,
        api_key: str | None = None,
        metrics_url: str | None = "",
        metrics_interval_s: float = 2.0,
        include_usage: bool = True,
        connect_timeout_s: float = 5.0,
        read_timeout_s: float = 300.0,
    ) -> None:
        if not metrics_interval_s > 0:
            raise ValueError(f"engine metrics interval must be > 0 s, got {metrics_interval_s}")
        self.url = _base_url(url)
        self.model = model
        self.metrics_url = f"{self.url}/metrics" if metrics_url == "" else metrics_url
        self.metrics_interval_s = metrics_interval_s
        self.include_usage = include_usage
        self.load = EngineLoad()
        self.models: list[str] = [model] if model else []
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._timeout = httpx.Timeout(read_timeout_s, connect=connect_timeout_s)
        self._client: httpx.AsyncClient | None = None
        self._metrics_failing = False

    def _http(self) -> httpx.AsyncClient:
        # Made on first use, on the loop that uses it; trust_env=False: no proxy for a local engine.
        if self._client is None:
            self._client = httpx.AsyncClient(timeout=self._timeout, headers=self._headers, trust_env=False)
        return self._client

    async def aclose(self) -> None:
        """Close the HTTP connections."""
        if self._client is not None:
            client, self._client = self._client, None
            await client.aclose()

    # ------------------------------------------------------------------ discovery and load

    async def discover_models(self) -> list[str]:
        """The models the server lists (``GET /v1/models``); [] when it cannot say. Never raises."""
        try:
            response = await self._http().get(f"{self.url}/v1/models", timeout=5.0)
            response.raise_for_status()
            listed = [str(m["id"]) for m in response.json().get("data", []) if isinstance(m, dict) and "id" in m]
        except (httpx.HTTPError, ValueError, KeyError, TypeError, AttributeError) as exc:
            log.warning("cannot list the inference engine's models", url=self.url, error=f"{type(exc).__name__}: {exc}")
            return []
        self.models = list(dict.fromkeys([*self.models, *listed]))
        if self.model is None and listed:
            self.model = listed[0]
        return listed

    async def scrape_metrics(self) -> EngineLoad | None:
        """Read the engine's metrics once into :attr:`load`; None (and the old load kept) on failure."""
        if self.metrics_url is None:
            return None
        try:
            response = await self._http().get(self.metrics_url, timeout=5.0)
            response.raise_for_status()
            load = await asyncio.to_thread(parse_engine_metrics, response.text)  # a big exposition parses off-loop
        except (httpx.HTTPError, ValueError) as exc:
            if not self._metrics_failing:  # say it once per outage, not every few seconds
                error = f"{type(exc).__name__}: {exc}"
                log.warning("cannot read the engine's metrics", url=self.metrics_url, error=error)
            self._metrics_failing = True
            return None
        if self._metrics_failing:
            log.info("engine metrics readable again", url=self.metrics_url)
        self._metrics_failing = False
        self.load = load
        return load

    async def poll_metrics_forever(self) -> None:
        """Scrape every ``metrics_interval_s`` until cancelled (the first scrape is the caller's)."""
        while self.metrics_url is not None:
            await asyncio.sleep(self.metrics_interval_s)
            await self.scrape_metrics()

    # ------------------------------------------------------------------ the handler

    def _request(self, args: Any) -> tuple[str, dict[str, Any]]:
        if not isinstance(args, Mapping):
            got = type(args).__name__
            raise HandlerError(errors.INVALID_ARGUMENT, f"generate takes a map of OpenAI request fields, got {got}")
        chat, completion = "messages" in args, "prompt" in args
        if chat == completion:
            raise HandlerError(
                errors.INVALID_ARGUMENT, "generate needs exactly one of 'messages' (chat) or 'prompt' (completion)"
            )
        if chat and not isinstance(args["messages"], Sequence | list):
            raise HandlerError(errors.INVALID_ARGUMENT, "'messages' must be a list of {role, content} maps")
        if args.get("n", 1) != 1:
            raise HandlerError(errors.INVALID_ARGUMENT, "generate streams one choice: 'n' must be 1")
        body = {key: value for key, value in args.items() if key not in _OWN_FIELDS}
        if "model" not in body and self.model is not None:
            body["model"] = self.model
        body["stream"] = True
        if self.include_usage:
            body["stream_options"] = {"include_usage": True}
        path = "/v1/chat/completions" if chat else "/v1/completions"
        return f"{self.url}{path}", body

    async def generate(self, ctx: Context, args: Any) -> dict[str, Any]:
        """Handler for op ``generate``: stream tokens as ephemeral events, return the whole text."""
        url, body = self._request(args)
        started = time.monotonic()
        ttft_s: float | None = None
        parts: list[str] = []
        chunks_with_text = 0
        finish_reason: str | None = None
        model = body.get("model")
        usage: dict[str, Any] | None = None
        try:
            async with self._http().stream("POST", url, json=body) as response:
                if response.status_code != 200:
                    detail = (await response.aread()).decode(errors="replace")[:1000]
                    raise HandlerError(
                        errors.ENGINE_ERROR,
                        f"inference engine at {url} answered HTTP {response.status_code}: {detail}",
                        detail={"status": response.status_code},
                    )
                async for chunk in _sse_chunks(response, url):
                    model = chunk.get("model", model)
                    if isinstance(chunk.get("usage"), dict):
                        usage = chunk["usage"]
                    for choice in chunk.get("choices") or ():
                        if not isinstance(choice, dict) or choice.get("index", 0) != 0:
                            continue
                        delta = choice.get("delta")
                        text = delta.get("content") if isinstance(delta, dict) else choice.get("text")
                        if text:
                            if ttft_s is None:
                                ttft_s = time.monotonic() - started
                            parts.append(text)
                            chunks_with_text += 1
                            ctx.emit("token", {"text": text}, ephemeral=True)
                        finish_reason = choice.get("finish_reason") or finish_reason
        except httpx.HTTPError as exc:
            raise HandlerError(
                errors.ENGINE_ERROR, f"cannot reach the inference engine at {url}: {type(exc).__name__}: {exc}"
            ) from None
        estimated = usage is None or "completion_tokens" not in usage
        completion_tokens = chunks_with_text if estimated or usage is None else int(usage["completion_tokens"])
        prompt_tokens = int(usage.get("prompt_tokens", 0)) if usage else 0
        ctx.report_tokens(completion_tokens)
        return {
            "text": "".join(parts),
            "finish_reason": finish_reason,
            "model": model,
            "usage": {
                "prompt_tokens": prompt_tokens,
                "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens,
            },
            "usage_estimated": estimated,
            "ttft_s": None if ttft_s is None else round(ttft_s, 6),
            "duration_s": round(time.monotonic() - started, 6),
        }


async def _sse_chunks(response: httpx.Response, url: str) -> AsyncIterator[dict[str, Any]]:
    """The JSON objects of an OpenAI server-sent event stream, until ``[DONE]`` or its end."""
    data: list[str] = []
    async for line in response.aiter_lines():
        if line.startswith("data:"):
            data.append(line[5:].removeprefix(" "))
            continue
        if line or not data:
            continue  # "event:", "id:", ": keep-alive" comments; an empty line ends an event
        payload, data = "\n".join(data), []
        if payload.strip() == "[DONE]":
            return
        yield _chunk(payload, url)
    if data and "\n".join(data).strip() != "[DONE]":  # a last event without its blank line
        yield _chunk("\n".join(data), url)


def _chunk(payload: str, url: str) -> dict[str, Any]:
    try:
        chunk = json.loads(payload)
    except json.JSONDecodeError:
        raise HandlerError(errors.ENGINE_ERROR, f"inference engine at {url} sent a chunk that is not JSON: "
                           f"{payload[:200]!r}") from None
    if not isinstance(chunk, dict):
        raise HandlerError(errors.ENGINE_ERROR, f"inference engine at {url} sent a chunk that is not an object")
    if "error" in chunk:  # vLLM and llama.cpp report mid-stream failures this way
        error = chunk["error"]
        message = error.get("message", error) if isinstance(error, dict) else error
        raise HandlerError(errors.ENGINE_ERROR, f"inference engine at {url} failed mid-stream: {message}")
    return chunk
