"""A worker stopped by SIGTERM shuts its tracing down within the exporter child's bound (worker_agent/agent.py).

The worker only flushed its tracer when it stopped: the exporter child (wireio/span_export.py) outlived it, still
posting to a collector that never answers (and holding the worker's stderr, so whoever read it waited on), and the
spans it held were never counted nor logged as lost. The stop now shuts the tracer down in a thread of its own: the
child is killed at its ``exit_wait_s``, its spans are counted dropped and the warning says so.

A real worker process (the CLI), its child's bound set to 1 s by a launcher (15 s by default); a coordinator and a
client in the test's process; the client's plan carries a sampled trace context, so the worker makes spans.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sys
import time
from pathlib import Path

import pytest
from opentelemetry import trace

from coordinator.io.frontdoor.server import CoordinatorServer, ServerSettings
from fleetwire import Client
from tests.waiting import until

pytestmark = pytest.mark.timeout(90)

ROOT = Path(__file__).resolve().parents[2]
EXIT_WAIT_S = 1.0  # the exporter child's bound in the worker here (15 s by default)
# The worker's CLI, each exporter child it starts bounded by EXIT_WAIT_S.
LAUNCHER = f"""
import sys
from wireio import span_export
real_init = span_export.ExportProcess.__init__
def init(self, *args, **kwargs):
    real_init(self, *args, **{{**kwargs, "exit_wait_s": {EXIT_WAIT_S}}})
span_export.ExportProcess.__init__ = init
from fleetwire.cli.main import main
sys.exit(main(sys.argv[1:]))
"""


def export_children(pid: int) -> list[int]:
    """The span exporter children of process ``pid`` (Linux /proc)."""
    found = []
    for task in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(OSError):
            for child in Path(f"/proc/{pid}/task/{task}/children").read_text().split():
                with contextlib.suppress(OSError):
                    if b"wireio.span_export" in Path(f"/proc/{child}/cmdline").read_bytes():
                        found.append(int(child))
    return found


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads the worker's children in /proc")
async def test_a_sigterm_stop_kills_the_exporter_child_at_its_bound_and_logs_the_dropped_spans(
    mute_collector: str,
) -> None:
    """A worker whose spans went to a collector that never answers, stopped by SIGTERM: it exits 0 within the
    child's bound (and its stop), its exporter child is gone with it (its stderr closes), and it logged the spans
    it could not export."""
    server = CoordinatorServer(ServerSettings(port=0, insecure=True, store="memory"))
    await server.start()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "FLEETWIRE_"))}
    env.update(PYTHONUNBUFFERED="1", OTEL_BSP_SCHEDULE_DELAY="50")  # a span goes to the child at once
    worker = await asyncio.create_subprocess_exec(
        sys.executable, "-c", LAUNCHER, "worker", "--url", server.url, "--id", "traced-1", "--otlp-endpoint",
        mute_collector, "--log-format", "json", stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        env=env, cwd=ROOT,
    )  # fmt: skip
    assert worker.stdout is not None and worker.stderr is not None
    stderr = asyncio.ensure_future(worker.stderr.read())  # to its end: every process that holds it closed it
    children: list[int] = []
    try:
        assert b"registered" in await asyncio.wait_for(worker.stdout.readline(), 30)
        sampled = trace.SpanContext(0x4BF92F3577B34DA6A3CE929D0E0E4736, 0x00F067AA0BA902B7, is_remote=True,
                                    trace_flags=trace.TraceFlags(trace.TraceFlags.SAMPLED))  # fmt: skip
        async with Client(server.url) as client:
            with trace.use_span(trace.NonRecordingSpan(sampled)):  # the plan's context: the worker's spans sampled
                plan = await client.submit("echo", args=1)
            assert await asyncio.wait_for(plan.result(), 20) == 1
        await until(lambda: export_children(worker.pid), timeout_s=20)
        children = export_children(worker.pid)
        began = time.monotonic()
        worker.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(worker.wait(), 30) == 0
        elapsed = time.monotonic() - began
        err = (await asyncio.wait_for(stderr, 5)).decode(errors="replace")  # the child held it too: not here
    finally:
        if worker.returncode is None:
            worker.kill()
            await worker.wait()
        for child in children:  # an exporter child left behind (before the fix: orphaned, still posting)
            with contextlib.suppress(ProcessLookupError):
                os.kill(child, signal.SIGKILL)
        stderr.cancel()
        await server.stop()
    assert elapsed < EXIT_WAIT_S + 10, elapsed  # the child's bound and the stop's goodbye, not the collector's 10 s
    assert children and not any(alive(child) for child in children), children
    logs = [json.loads(line) for line in err.splitlines() if line.startswith("{")]
    lost = [e for e in logs if e["event"].startswith("spans were not exported")]
    assert [(e["level"], e["service"], e["exported"]) for e in lost] == [("warning", "fleetwire-worker", 0)], err
    assert lost[0]["dropped"] >= 1, lost  # the plan's attempt and handler spans, unanswered when the child went
