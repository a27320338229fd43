"""Load from the engine: queued tokens, KV blocks and p50/p99 latency read from the fake engine's real /metrics."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest

from protocol.messages import Capabilities, Load
from tests.integration.test_inference import _context, fake_engine
from worker_agent.inference import EngineFigures, InferenceEngine, histogram_quantile, parse_engine_metrics
from worker_agent.telemetry import Telemetry

pytestmark = pytest.mark.timeout(30)


@pytest.fixture
def server() -> Iterator[Any]:
    """A fake vLLM engine on loopback that decodes one stream at a time (others wait), 1000 blocks of 16 tokens."""
    srv = fake_engine.FakeEngine(name="e1", model="m1", token_delay_s=0.0, max_running=1, num_gpu_blocks=1000,
                                 block_size=16, blocks_per_request=250).start()
    yield srv
    srv.stop()


@pytest.fixture
async def engine(server: Any) -> AsyncIterator[InferenceEngine]:
    """The worker's side of the engine."""
    eng = InferenceEngine(server.url)
    yield eng
    await eng.aclose()


def test_histogram_quantile_interpolates_like_prometheus() -> None:
    """Inside a bucket the quantile is linear; +Inf answers the largest finite bound; empty is None."""
    buckets = [(0.1, 0.0), (0.5, 50.0), (1.0, 90.0), (float("inf"), 100.0)]
    assert histogram_quantile(0.5, buckets) == pytest.approx(0.5)
    assert histogram_quantile(0.25, buckets) == pytest.approx(0.3)
    assert histogram_quantile(0.99, buckets) == 1.0
    assert histogram_quantile(0.5, [(1.0, 0.0), (float("inf"), 0.0)]) is None


def test_sglang_token_budget_counts_as_one_token_blocks() -> None:
    """SGLang's max_total_num_tokens is its KV budget in one-token blocks."""
    load = parse_engine_metrics("# TYPE sglang:max_total_num_tokens gauge\nsglang:max_total_num_tokens 65536\n"
                                "# TYPE sglang:token_usage gauge\nsglang:token_usage 0.25\n")
    assert (load.kv_blocks_total, load.kv_block_tokens, load.kv_cache_usage) == (65536, 1, 0.25)


async def test_figures_come_from_the_engines_metrics(engine: InferenceEngine, server: Any) -> None:
    """Waiting requests times the mean prompt give queued tokens; usage times budget gives blocks used;
    the latency histogram's new requests give p50/p99."""
    await engine.scrape_metrics()
    assert engine.figures() == EngineFigures(kv_blocks_total=1000, kv_block_tokens=16)
    events: list[tuple[str, Any, bool]] = []
    for words in (4, 8):  # two finished requests: 6 prompt tokens on average
        await engine.generate(_context(events), {"prompt": " ".join(["w"] * words)})
    server.running = 3  # one decoding (250 blocks), two waiting
    await engine.scrape_metrics()
    figures = engine.figures()
    assert (figures.queued_tokens, figures.kv_blocks_used) == (12, 250)
    # Within the histogram bucket of the slowest request the engine itself recorded (no bound on time here).
    bounds = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
    slowest = max(seconds for _, seconds in server.finished)
    ceiling_ms = next((b for b in bounds if slowest <= b), float("inf")) * 1000
    assert 0 < figures.latency_p50_ms <= figures.latency_p99_ms <= ceiling_ms
    await engine.scrape_metrics()  # nothing finished since: the last window's latency is kept
    assert engine.figures().latency_p50_ms == figures.latency_p50_ms
    server.running = 0


async def test_telemetry_reports_engine_figures_and_adopts_its_kv_budget(server: Any) -> None:
    """The load carries queued tokens, blocks used and latency; capabilities take the engine's KV budget
    unless the operator set --kv-blocks."""
    telemetry = Telemetry(engine=InferenceEngine(server.url))
    await telemetry.start()
    try:
        assert telemetry.engine is not None
        await telemetry.engine.generate(_context([]), {"prompt": "a b c d e"})
        server.running = 2
        await telemetry.engine.scrape_metrics()
        load = telemetry.load(Load(in_flight=1))
        assert (load.in_flight, load.queued_tokens, load.kv_blocks_used) == (1, 5, 250)
        assert load.latency_p50_ms > 0 and load.latency_p99_ms >= load.latency_p50_ms
        caps = telemetry.capabilities(Capabilities(ops=["generate"]))
        assert (caps.kv_blocks, caps.kv_block_tokens) == (1000, 16)
        operator = telemetry.capabilities(Capabilities(ops=["generate"], kv_blocks=64, kv_block_tokens=32))
        assert (operator.kv_blocks, operator.kv_block_tokens) == (64, 32)
    finally:
        server.running = 0
        await telemetry.stop()
