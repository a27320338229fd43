"""End to end: the provisioning autoscaler with real worker processes and a real failing command."""

from __future__ import annotations

import asyncio
import json
import sys
import time
import urllib.request
from typing import Any

import pytest

from tests.e2e.conftest import ADMIN_TOKEN, ROOT, Cluster
from worker_agent.session import EXIT_REMOVED

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


BUSY_PLAN_S = 10  # each plan's length in the busy scale-down test (its comment says why)


def changes(samples: list[dict[str, Any]]) -> list[tuple[float, int, int, int, int]]:
    """The samples where (alive, draining, queued, running) changed, as (t_s, alive, draining, queued, running)."""
    rows: list[tuple[float, int, int, int, int]] = []
    for s in samples:
        row = (s["t_s"], s["alive"], s["draining"], s["queued"], s["running"])
        if not rows or rows[-1][1:] != row[1:]:
            rows.append(row)
    return rows


async def test_a_busy_worker_named_by_scale_down_is_stopped_only_after_its_plan(cluster: Cluster) -> None:
    """Two busy workers, desired 1: the one with the least run time is drained while its plan runs, and is
    stopped only once the plan is done; no plan is requeued."""
    # The 4 plans of PLAN_S on workers of one slot: the first worker runs two from 0 s, the second, started by the
    # scale-up, two from its start lag L. The queue empties (ongoing 2: desired 1) when the second one's first plan
    # ends, at L + PLAN_S; the drain follows 2-3 s later (the 2 s downscale delay, the autoscaler's 1 s samples).
    # Both still run then only if L + 3 < PLAN_S: with plans of 6 s a second worker up at 3.3 s (load 10) was
    # drained idle, and the test failed (a whole-suite run at load 10-14); 10 s leaves L up to ~7 s.
    bench = await cluster.script(ROOT / "bench" / "autoscale_trace.py", "--min", "1", "--max", "2", "--target", "2",
                                 "--plans", "4", "--seconds", str(BUSY_PLAN_S), "--sample", "0.2", "--json")
    assert await bench.wait(140) == 0, bench.lines
    trace = json.loads(bench.lines[-1])
    assert trace["peak_workers"] == 2 and trace["attempts"] == [1, 1, 1, 1]
    drained_busy = [s for s in trace["samples"] if s["draining"] == 1 and s["running"] == 2]
    assert drained_busy, changes(trace["samples"])  # drained while both plans still ran
    stopped = next(s for s in trace["samples"] if s["t_s"] > drained_busy[0]["t_s"] and s["draining"] == 0)
    assert stopped["running"] <= 1  # it went once its plan was done (attempts all 1: nothing was taken back)


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


async def test_bad_autoscale_flags_are_refused_with_a_clear_error(cluster: Cluster) -> None:
    """A malformed range, or start/stop commands without the command provider, exit non-zero naming the flag."""
    bad_range = await cluster.run("up", "--port", "0", "--autoscale", "1-8", name="up")
    assert await bad_range.wait() != 0
    no_provider = await cluster.run("coordinator", "--port", "0", "--insecure", "--autoscale",
                                    "--autoscale-start", "true", name="coordinator")
    assert await no_provider.wait() != 0


async def test_fleetwire_remove_takes_a_worker_out_for_good(cluster: Cluster) -> None:
    """`fleetwire remove` (admin): the worker's running plan moves to another worker, the removed agent exits,
    and a client token is refused."""
    await cluster.coordinator()
    w1 = await cluster.worker("w1")
    submit = await cluster.run("submit", "sleep", "--args", '{"seconds": 30}', "--detach")
    plan_id = (await submit.wait_for_line(r"plan (\S+) submitted")).group(1)
    assert await submit.wait() == 0
    refused = await cluster.run("remove", "w1")
    assert await refused.wait() != 0
    removed = await cluster.run("remove", "w1", env=cluster.env(FLEETWIRE_TOKEN=ADMIN_TOKEN))
    assert await removed.wait() == 0
    assert "w1 removed" in removed.lines[-1]
    assert await w1.wait(30) == EXIT_REMOVED  # closed 4410: the agent stops instead of reconnecting
    w2 = await cluster.worker("w2")
    workers = await cluster.run("workers", "--json")
    assert await workers.wait() == 0
    assert "w1" not in "\n".join(workers.lines) and "w2" in "\n".join(workers.lines)
    cancel = await cluster.run("cancel", plan_id, "--json")  # its reply names the plan's worker now
    assert await cancel.wait() == 0
    assert '"worker_id":"w2"' in "".join(cancel.lines).replace(" ", ""), cancel.lines
    w2.stop()


async def test_up_autoscale_starts_a_worker_with_the_tags_the_waiting_plan_requires(cluster: Cluster) -> None:
    """`up --autoscale 0..2`, a plan requiring tag cpu: the local provider starts a worker carrying cpu; it runs."""
    up = await cluster.run("up", "--port", "0", "--autoscale", "0..2", "--autoscale-upscale-delay", "0",
                           "--autoscale-cooldown", "0", "--log-level", "warning", name="up")
    url = (await up.wait_for_line(r"export FLEETWIRE_URL=(\S+)", 60)).group(1)
    token = (await up.wait_for_line(r"export FLEETWIRE_TOKEN=(\S+)")).group(1)
    env = cluster.env(FLEETWIRE_URL=url, FLEETWIRE_TOKEN=token)
    submit = await cluster.run("submit", "echo", "--args", '{"n": 1}', "--tags", "cpu", env=env)
    assert await submit.wait(90) == 0, submit.lines
    workers = await cluster.run("workers", "--json", env=env)
    assert await workers.wait() == 0
    [worker] = json.loads("".join(workers.lines))["workers"]
    assert worker["id"] == "auto-1" and {"cpu", "local"} <= set(worker["capabilities"]["tags"])
