"""An application that traced its plans exits within its tracer's bound when the collector never answers.

The client's tracer is the process's (fleetwire/tracing.py ``client_tracing``: every ``Client`` shares it, so
``Client.close`` leaves it running) and is shut down at the interpreter's exit. It exports in a thread of the
application (wireio/tracing.py), whose shutdown joined that thread, then posted every batch still queued, each
post waiting out the OTLP exporter's timeout (10 s by default) against a collector that never answers: the exit
waited for them all. The shutdown now gives the exporter thread ``exit_wait_s`` (15 s by default), then leaves it
and counts what it had not exported dropped, as the daemons' exporter child (wireio/span_export.py).

A real application process, its bound set to 1 s, each span a batch of its own and the exporter's timeout 3 s;
a coordinator in the test's process.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from pathlib import Path

import pytest

from coordinator.io.frontdoor.server import CoordinatorServer, ServerSettings

pytestmark = pytest.mark.timeout(90)

ROOT = Path(__file__).resolve().parents[2]
EXIT_WAIT_S = 1.0  # the client tracer's bound here (15 s by default)
PLANS = 3
APPLICATION = f"""
import asyncio, sys
import structlog
from fleetwire import Client
from fleetwire.tracing import client_tracing

structlog.configure(processors=[structlog.processors.add_log_level, structlog.processors.JSONRenderer()])

async def main(url):
    async with Client(url) as client:
        for i in range({PLANS}):
            await client.submit("echo", args=i)  # each a sampled root: a submit span, ended when accepted
    client_tracing().exit_wait_s = {EXIT_WAIT_S}
    print("closed", flush=True)

asyncio.run(main(sys.argv[1]))
"""


async def test_an_application_exits_within_its_tracers_bound_and_logs_the_dropped_spans(mute_collector: str) -> None:
    """Three sampled plans whose spans went to a collector that never answers (a batch each, 3 s a post): the
    application exits within its tracer's bound (1 s, not three posts' 9 s) after its client closed, and logs the
    three spans as not exported."""
    server = CoordinatorServer(ServerSettings(port=0, insecure=True, store="memory"))
    await server.start()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "FLEETWIRE_"))}
    env.update(PYTHONUNBUFFERED="1", OTEL_EXPORTER_OTLP_ENDPOINT=mute_collector, OTEL_BSP_MAX_EXPORT_BATCH_SIZE="1",
               OTEL_EXPORTER_OTLP_TIMEOUT="3")  # fmt: skip
    app = await asyncio.create_subprocess_exec(
        sys.executable, "-c", APPLICATION, server.url, stdout=asyncio.subprocess.PIPE, env=env, cwd=ROOT
    )
    assert app.stdout is not None
    try:
        assert await asyncio.wait_for(app.stdout.readline(), 30) == b"closed\n"
        closed = time.monotonic()
        out = await asyncio.wait_for(app.stdout.read(), 30)
        assert await asyncio.wait_for(app.wait(), 5) == 0
        elapsed = time.monotonic() - closed
    finally:
        if app.returncode is None:
            app.kill()
            await app.wait()
        await server.stop()
    assert elapsed < EXIT_WAIT_S + 4, elapsed  # its bound (and the interpreter's exit), not 3 s a queued batch
    logs = [json.loads(line) for line in out.decode().splitlines() if line.startswith("{")]
    lost = [e for e in logs if e["event"].startswith("spans were not exported")]
    assert [(e["level"], e["service"], e["dropped"], e["exported"]) for e in lost] == [
        ("warning", "fleetwire-client", PLANS, 0)
    ], out
