"""The OpenAI-compatible inference handler: op ``generate`` against a local vLLM, SGLang,
llama.cpp server or TGI, and the engine's load read from its Prometheus metrics.

Theory of operation (docs/OPERATIONS.md §Inference workers):

* ``generate`` takes ``{"messages": [...]}`` (chat, ``POST /v1/chat/completions``) or
  ``{"prompt": ...}`` (completion, ``POST /v1/completions``), plus any OpenAI request field
  (``model``, ``max_tokens``, ``temperature``, ``stop``, ...), which is passed through. The request
  always streams (``stream: true``, with ``stream_options.include_usage`` unless turned off).
* Each server-sent event ``data: {chunk}`` with text becomes an **ephemeral** ``token`` event
  ``{"text": ...}`` on the plan's stream; the rest of a chat delta (``tool_calls``, ...) an
  ephemeral ``delta`` event with those fields as sent, which the coordinator's OpenAI front door
  passes on (docs/OPENAI.md); ``data: [DONE]`` ends it. The plan's result is
  ``{"text", "finish_reason", "model", "usage": {prompt_tokens, completion_tokens, total_tokens},
  "usage_estimated", "ttft_s", "duration_s"}``. Without a usage chunk the completion tokens are
  estimated as the number of text chunks (``usage_estimated: true``).
* The completion tokens are reported to the agent (``ctx.report_tokens``), which divides the
  plan's measured GPU energy by them (worker_agent/energy.py).
* Failures are plan failures with code ``engine_error`` and a message naming the URL and the
  engine's answer; a malformed request is ``invalid_argument``. Cancelling the plan closes the
  HTTP stream, which makes vLLM, SGLang, TGI and llama.cpp abort the request. The streams go over
  kept-alive connections of worker_agent/engine_http.py (a lean client: httpx cost 1.5 ms to the
  first token per request on loopback); discovery and metrics scrapes use httpx. httpx and
  prometheus_client's parser are imported on first use, not with this module: every worker
  imports it, and they were 30-40 ms of a worker's start that only an engine worker needs.
* :meth:`InferenceEngine.poll_metrics_forever` scrapes the engine's ``/metrics`` every few
  seconds; running and waiting requests and KV-cache usage go into the worker's ``load`` frames
  (vLLM ``vllm:num_requests_running|waiting``, ``vllm:kv_cache_usage_perc`` or
  ``vllm:gpu_cache_usage_perc``; SGLang, TGI and llama.cpp equivalents in :data:`ENGINE_GAUGES`).
* From the same scrape come the figures placement needs (:meth:`InferenceEngine.figures`):

  - the KV-cache block budget (vLLM ``vllm:cache_config_info{num_gpu_blocks, block_size}``;
    SGLang ``sglang:max_total_num_tokens``, one token per block) and the blocks in use
    (usage times budget). The worker advertises the budget as ``kv_blocks``/``kv_block_tokens``
    when the operator did not set ``--kv-blocks``, so KV admission works by default;
  - ``queued_tokens``: the waiting requests times the mean prompt tokens per request (the engine's
    ``vllm:request_prompt_tokens`` / ``tgi_request_input_length`` histogram; else the prompts this
    worker sent, from their usage);
  - p50/p99 latency: quantiles of the engine's end-to-end latency histogram
    (:data:`ENGINE_HISTOGRAMS`) over the requests that finished *since the previous scrape*
    (Prometheus' ``histogram_quantile`` interpolation); without that histogram, of the last 256
    ``generate`` plans this worker ran. The last window with requests is kept while idle.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final
from urllib.parse import urlsplit

import msgspec
import structlog

from protocol import errors
from worker_agent.engine_http import EngineClient, EngineHttpError, EngineResponse
from worker_agent.handlers import Context, HandlerError

if TYPE_CHECKING:
    import httpx  # imported on first use: 30-40 ms of every worker's start, for engine workers only

log = structlog.get_logger(__name__)

__all__ = [
    "ENGINE_GAUGES",
    "ENGINE_HISTOGRAMS",
    "EngineFigures",
    "EngineLoad",
    "InferenceEngine",
    "histogram_quantile",
    "parse_engine_metrics",
]

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
#: Engine histograms per figure (buckets, sums and counts are summed over label sets).
ENGINE_HISTOGRAMS: Final[Mapping[str, tuple[str, ...]]] = {
    "latency_s": ("vllm:e2e_request_latency_seconds", "sglang:e2e_request_latency_seconds", "tgi_request_duration"),
    "prompt_tokens": ("vllm:request_prompt_tokens", "tgi_request_input_length"),
}
_OWN_WINDOW: Final = 256  # generate durations kept for the latency fallback
# Request fields the handler sets itself.
_OWN_FIELDS: Final = frozenset({"stream", "stream_options"})
_DRAIN_S: Final = 1.0  # how long the body's end is awaited after ``[DONE]`` (_sse_chunks)
_ENCODE = msgspec.json.Encoder().encode
_DECODE = msgspec.json.Decoder().decode
# A chat delta's fields that the ``token`` event carries (the rest go in a ``delta`` event).
_TEXT_FIELDS: Final = frozenset({"content", "role"})


@dataclass(frozen=True, slots=True)
class EngineLoad:
    """What the engine's metrics say about its load."""

    running: int = 0
    waiting: int = 0
    kv_cache_usage: float = 0.0  # 0..1
    kv_blocks_total: int = 0  # the engine's KV-cache block budget (0: it does not say)
    kv_block_tokens: int = 0  # tokens per block
    latency_buckets: tuple[tuple[float, float], ...] = ()  # (le seconds, cumulative count), since engine start
    prompt_tokens_sum: float = 0.0  # over every request since engine start
    prompt_tokens_count: float = 0.0


@dataclass(frozen=True, slots=True)
class EngineFigures:
    """What a worker reports from its engine in ``load`` and ``capabilities`` (0: unknown)."""

    queued_tokens: int = 0
    kv_blocks_used: int = 0
    kv_blocks_total: int = 0
    kv_block_tokens: int = 0
    latency_p50_ms: float = 0.0
    latency_p99_ms: float = 0.0


def histogram_quantile(q: float, buckets: Sequence[tuple[float, float]]) -> float | None:
    """The ``q`` quantile of cumulative ``(le, count)`` buckets, interpolated inside its bucket as
    Prometheus' ``histogram_quantile`` does; None without observations. An answer in the ``+Inf``
    bucket is the largest finite bound."""
    ordered = sorted(buckets)
    if not ordered or ordered[-1][1] <= 0:
        return None
    rank = q * ordered[-1][1]
    lower, below = 0.0, 0.0
    for bound, count in ordered:
        if count >= rank:
            if bound == float("inf"):
                return lower
            if count == below:
                return bound
            return lower + (bound - lower) * (rank - below) / (count - below)
        lower, below = bound, count
    return lower


def _quantile(q: float, values: Sequence[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def parse_engine_metrics(text: str) -> EngineLoad:
    """The engine load in a Prometheus text exposition (unknown metrics are ignored).

    Raises:
        ValueError: the text is not valid Prometheus exposition format.
    """
    wanted = {name: field for field, names in ENGINE_GAUGES.items() for name in names}
    histograms = {name: field for field, names in ENGINE_HISTOGRAMS.items() for name in names}
    sums = {"running": 0.0, "waiting": 0.0}
    kv = 0.0
    blocks = block_tokens = 0
    latency: dict[float, float] = {}
    prompt = {"sum": 0.0, "count": 0.0}
    from prometheus_client.parser import text_string_to_metric_families  # on first use (module docstring)

    for family in text_string_to_metric_families(text):
        if family.name == "vllm:cache_config_info":
            for sample in family.samples:
                with contextlib.suppress(KeyError, ValueError):
                    blocks = max(blocks, int(sample.labels["num_gpu_blocks"]))
                    block_tokens = int(sample.labels["block_size"])
            continue
        if family.name == "sglang:max_total_num_tokens":
            for sample in family.samples:
                blocks, block_tokens = max(blocks, int(sample.value)), 1
            continue
        kind = histograms.get(family.name)
        if kind is not None:
            for sample in family.samples:
                if kind == "latency_s" and sample.name == f"{family.name}_bucket" and "le" in sample.labels:
                    le = float(sample.labels["le"])
                    latency[le] = latency.get(le, 0.0) + float(sample.value)
                elif kind == "prompt_tokens" and sample.name in (f"{family.name}_sum", f"{family.name}_count"):
                    prompt[sample.name.rsplit("_", 1)[1]] += float(sample.value)
            continue
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
    return EngineLoad(
        running=int(sums["running"]), waiting=int(sums["waiting"]), kv_cache_usage=min(1.0, kv),
        kv_blocks_total=blocks, kv_block_tokens=block_tokens, latency_buckets=tuple(sorted(latency.items())),
        prompt_tokens_sum=prompt["sum"], prompt_tokens_count=prompt["count"],
    )


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
        self._client: httpx.AsyncClient | None = None  # discovery and metrics
        self._engine: EngineClient | None = None  # generate's streams (worker_agent/engine_http.py)
        self._connect_timeout_s, self._read_timeout_s = connect_timeout_s, read_timeout_s
        self._metrics_failing = False
        self._latency_ms: tuple[float, float] = (0.0, 0.0)  # p50, p99 of the last window with requests
        self._durations: deque[float] = deque(maxlen=_OWN_WINDOW)  # this worker's generate plans, seconds
        self._prompt_tokens = [0, 0]  # this worker's prompts: tokens, requests (from usage)

    def figures(self) -> EngineFigures:
        """The engine's figures for ``load`` and ``capabilities`` (module docstring)."""
        load = self.load
        if load.prompt_tokens_count > 0:
            mean_prompt = load.prompt_tokens_sum / load.prompt_tokens_count
        else:
            mean_prompt = self._prompt_tokens[0] / self._prompt_tokens[1] if self._prompt_tokens[1] else 0.0
        p50, p99 = self._latency_ms
        if not p50 and self._durations:
            p50, p99 = _quantile(0.5, self._durations) * 1000, _quantile(0.99, self._durations) * 1000
        return EngineFigures(
            queued_tokens=round(load.waiting * mean_prompt),
            kv_blocks_used=round(load.kv_cache_usage * load.kv_blocks_total),
            kv_blocks_total=load.kv_blocks_total,
            kv_block_tokens=load.kv_block_tokens,
            latency_p50_ms=round(p50, 3),
            latency_p99_ms=round(p99, 3),
        )

    def _window(self, new: EngineLoad) -> None:
        """p50/p99 over the requests that finished between the last scrape and this one."""
        before = dict(self.load.latency_buckets)
        after = new.latency_buckets
        if after and after[-1][1] < before.get(after[-1][0], 0.0):
            before = {}  # the counts went down: the engine restarted
        delta = [(le, count - before.get(le, 0.0)) for le, count in after]
        p50, p99 = histogram_quantile(0.5, delta), histogram_quantile(0.99, delta)
        if p50 is not None and p99 is not None:
            self._latency_ms = (p50 * 1000, p99 * 1000)

    def _http(self) -> httpx.AsyncClient:
        # Made on first use, on the loop that uses it; trust_env=False: no proxy for a local engine.
        if self._client is None:
            import httpx  # on first use (module docstring)

            timeout = httpx.Timeout(self._read_timeout_s, connect=self._connect_timeout_s)
            self._client = httpx.AsyncClient(timeout=timeout, headers=self._headers, trust_env=False)
        return self._client

    def _engine_client(self) -> EngineClient:
        if self._engine is None:
            self._engine = EngineClient(self.url, headers=self._headers, connect_timeout_s=self._connect_timeout_s,
                                        read_timeout_s=self._read_timeout_s)  # fmt: skip
        return self._engine

    async def aclose(self) -> None:
        """Close the HTTP connections."""
        if self._engine is not None:
            self._engine.close()
        if self._client is not None:
            client, self._client = self._client, None
            await client.aclose()

    # ------------------------------------------------------------------ discovery and load

    async def discover_models(self) -> list[str]:
        """The models the server lists (``GET /v1/models``); [] when it cannot say. Never raises."""
        import httpx  # on first use (module docstring)

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
        import httpx  # on first use (module docstring)

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
        self._window(load)
        self.load = load
        return load

    async def poll_metrics_forever(self) -> None:
        """Scrape every ``metrics_interval_s`` until cancelled (the first scrape is the caller's)."""
        while self.metrics_url is not None:
            await asyncio.sleep(self.metrics_interval_s)
            await self.scrape_metrics()

    # ------------------------------------------------------------------ the handler

    def _request(self, args: Any) -> tuple[str, dict[str, Any]]:
        """The request path (``/v1/chat/completions`` or ``/v1/completions``) and body of ``args``."""
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
        return "/v1/chat/completions" if chat else "/v1/completions", body

    async def generate(self, ctx: Context, args: Any) -> dict[str, Any]:
        """Handler for op ``generate``: stream tokens as ephemeral events, return the whole text."""
        path, body = self._request(args)
        url = f"{self.url}{path}"
        started = time.monotonic()
        ttft_s: float | None = None
        parts: list[str] = []
        chunks_with_text = 0
        finish_reason: str | None = None
        model = body.get("model")
        usage: dict[str, Any] | None = None
        try:
            # The plan's trace continues in the engine (vLLM reads W3C traceparent; docs/OPERATIONS.md §Tracing).
            headers = {"traceparent": ctx.traceparent} if ctx.traceparent else None
            async with self._engine_client().post(path, _ENCODE(body), headers) as response:
                if response.status != 200:
                    detail = (await response.read(4096)).decode(errors="replace")[:1000]
                    raise HandlerError(
                        errors.ENGINE_ERROR,
                        f"inference engine at {url} answered HTTP {response.status}: {detail}",
                        detail={"status": response.status},
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
                        if isinstance(delta, dict) and not _TEXT_FIELDS.issuperset(delta):
                            rest = {k: v for k, v in delta.items() if k not in _TEXT_FIELDS and v not in (None, [], "")}
                            if rest:  # tool calls (docs/OPENAI.md): the front door passes them on
                                ctx.emit("delta", rest, ephemeral=True)
                        finish_reason = choice.get("finish_reason") or finish_reason
        except EngineHttpError as exc:
            raise HandlerError(
                errors.ENGINE_ERROR, f"cannot reach the inference engine at {url}: {type(exc).__name__}: {exc}"
            ) from None
        estimated = usage is None or "completion_tokens" not in usage
        completion_tokens = chunks_with_text if estimated or usage is None else int(usage["completion_tokens"])
        prompt_tokens = int(usage.get("prompt_tokens", 0)) if usage else 0
        ctx.report_tokens(completion_tokens)
        self._durations.append(time.monotonic() - started)
        if prompt_tokens:
            self._prompt_tokens[0] += prompt_tokens
            self._prompt_tokens[1] += 1
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


async def _sse_chunks(response: EngineResponse, url: str) -> AsyncIterator[dict[str, Any]]:
    """The JSON objects of an OpenAI server-sent event stream, until ``[DONE]`` or its end.

    After ``[DONE]`` the body's end is read too (at most :data:`_DRAIN_S`): a response left before
    its end cannot give its connection back for the next request (worker_agent/engine_http.py).
    """
    data: list[bytes] = []
    rest = b""
    pieces = response.chunks()
    async for piece in pieces:
        *lines, rest = (rest + piece).split(b"\n")  # a UTF-8 character never holds a line feed byte
        for raw in lines:
            line = raw[:-1] if raw.endswith(b"\r") else raw
            if line.startswith(b"data:"):
                data.append(line[6:] if line.startswith(b"data: ") else line[5:])
                continue
            if line or not data:
                continue  # "event:", "id:", ": keep-alive" comments; an empty line ends an event
            payload, data = b"\n".join(data), []
            if payload.strip() == b"[DONE]":
                with contextlib.suppress(TimeoutError, EngineHttpError):  # the connection is dropped instead
                    async with asyncio.timeout(_DRAIN_S):
                        async for _ in pieces:
                            pass
                return
            yield _chunk(payload, url)
    if rest.startswith(b"data:"):  # a last line without its line feed
        data.append(rest[6:] if rest.startswith(b"data: ") else rest[5:])
    if data and b"\n".join(data).strip() != b"[DONE]":  # a last event without its blank line
        yield _chunk(b"\n".join(data), url)


def _chunk(payload: bytes, url: str) -> dict[str, Any]:
    try:
        chunk = _DECODE(payload)
    except msgspec.DecodeError:
        raise HandlerError(errors.ENGINE_ERROR, f"inference engine at {url} sent a chunk that is not JSON: "
                           f"{payload[:200].decode(errors='replace')!r}") from None
    if not isinstance(chunk, dict):
        raise HandlerError(errors.ENGINE_ERROR, f"inference engine at {url} sent a chunk that is not an object")
    if "error" in chunk:  # vLLM and llama.cpp report mid-stream failures this way
        error = chunk["error"]
        message = error.get("message", error) if isinstance(error, dict) else error
        raise HandlerError(errors.ENGINE_ERROR, f"inference engine at {url} failed mid-stream: {message}")
    return chunk
