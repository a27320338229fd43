"""End to end: the provisioning autoscaler with real worker processes and a real failing command."""

from __future__ import annotations

import asyncio
import json
import sys
import time
import urllib.request

import pytest

from tests.e2e.conftest import ROOT, Cluster

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(150)]


async def test_up_autoscale_starts_workers_for_a_burst_and_stops_them_after(cluster: Cluster) -> None:
    """`fleetwire up --autoscale 1..3`: a burst of sleep plans brings up 3 real workers; once done, back to 1."""
    bench = await cluster.script(ROOT / "bench" / "autoscale_trace.py", "--min", "1", "--max", "3", "--plans", "9",
                                 "--seconds", "1", "--sample", "0.2", "--json")
    assert await bench.wait(140) == 0, bench.lines
    trace = json.loads(bench.lines[-1])
    assert trace["peak_workers"] == 3
    assert len(trace["seen"]) == 3 and all(w.startswith("auto-") for w in trace["seen"])
    last = trace["samples"][-1]
    assert (last["alive"], last["draining"], last["queued"], last["running"]) == (1, 0, 0, 0)
    after = [s["alive"] for s in trace["samples"] if s["t_s"] >= trace["burst_done_s"]]
    assert after == sorted(after, reverse=True)  # once the burst is done the fleet only shrinks
    assert trace["burst_done_s"] <= trace["back_down_s"]


def _failures(url: str) -> float:
    with urllib.request.urlopen(url.replace("ws://", "http://") + "/metrics", timeout=10) as response:
        for line in response.read().decode().splitlines():
            if line.startswith('fleetwire_autoscaler_provider_failures_total{provider="command"}'):
                return float(line.rsplit(" ", 1)[1])
    return 0.0


async def test_a_failing_command_provider_is_retried_and_counted_on_metrics(cluster: Cluster) -> None:
    """A start command that exits non-zero is retried with backoff; each failure shows on /metrics."""
    failing = f"{sys.executable} -c 'raise SystemExit(7)'"
    await cluster.coordinator("--autoscale", "0..2", "--autoscale-provider", "command", "--autoscale-start", failing,
                              "--autoscale-upscale-delay", "0", "--autoscale-cooldown", "0")
    submit = await cluster.run("submit", "echo", "--args", "{}", "--detach")
    assert await submit.wait() == 0
    deadline = time.monotonic() + 60
    seen = 0.0
    while seen < 2:  # the first failure, then a retry after the 1 s backoff
        assert time.monotonic() < deadline, f"provider failures seen: {seen}"
        seen = await asyncio.to_thread(_failures, cluster.url)
        if seen < 2:
            await asyncio.sleep(0.2)
