"""A shutdown whose exporter thread waits in its write to a child that takes nothing ends at the child's bound.

Against a collector that never answers, a busy daemon's exporter child reads a batch, then waits out the OTLP
exporter's timeout (10 s) on its post before it reads the next: its pipe fills and the tracer's exporter thread
waits in its write, one batch a timeout (each write given up only past the child's ``stuck_s``, 30 s). The shutdown
joined that thread before its close's ``exit_wait_s`` began: 8 batches queued here held it 61 s (a full queue,
65,536 spans, 32 batches: ~5 minutes), and a daemon's stop (a worker's SIGTERM) with it. Past ``exit_wait_s`` the
shutdown now kills the child: the write fails at once and the spans count dropped (1.2 s).
"""

from __future__ import annotations

import asyncio
import fcntl
import struct
import sys
import termios
import time

import pytest
from structlog.testing import capture_logs

from tests.waiting import until
from wireio.tracing import SERVICE_WORKER, Tracing

pytestmark = [
    pytest.mark.timeout(60),
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads the pipe's fill (Linux ioctl)"),
]

SAMPLED = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
EXIT_WAIT_S = 1.0  # the child's close bound here (15 s by default)
STUCK_S = 20.0  # how long a write waits on a full pipe before it kills the child (30 s by default)
SPANS = 400  # of ~20 kB each: 8 MB, past the child's pipe (1 MB) and its read buffer (1 MB)
F_GETPIPE_SZ = 1032


def pipe_full(fd: int) -> bool:
    """Whether the pipe whose write end is ``fd`` is full (its writer waits)."""
    unread = struct.unpack("i", fcntl.ioctl(fd, termios.FIONREAD, b"\0" * 4))[0]
    return bool(unread >= fcntl.fcntl(fd, F_GETPIPE_SZ))


async def test_a_shutdown_kills_a_child_that_takes_nothing_at_its_bound_and_counts_its_spans_dropped(
    mute_collector: str,
) -> None:
    """8 MB of spans for a mute collector: the child posts the first batch and its pipe fills, the exporter thread
    waits in its write; the shutdown ends within the child's bound (1 s), not a post's timeout a batch, with every
    span dropped, none exported, and one warning."""
    environ = {"OTEL_BSP_SCHEDULE_DELAY": "600000", "OTEL_BSP_MAX_EXPORT_BATCH_SIZE": "50"}
    tracing = Tracing(SERVICE_WORKER, endpoint=mute_collector, environ=environ, export_process=True)
    process = tracing.process
    assert process is not None and process.proc is not None and process.proc.stdin is not None
    process.exit_wait_s, process.stuck_s = EXIT_WAIT_S, STUCK_S
    child, fd = process.proc, process.proc.stdin.fileno()
    blob = "x" * 20_000
    for i in range(SPANS):  # a full batch wakes the exporter thread at once
        tracing.record("fleetwire.queue", SAMPLED, i, i + 1, {"blob": blob})
    await until(lambda: pipe_full(fd), timeout_s=30)  # the thread waits in its write
    began = time.monotonic()
    with capture_logs() as logs:
        await asyncio.to_thread(tracing.shutdown)
    elapsed = time.monotonic() - began
    assert elapsed < EXIT_WAIT_S + 5, elapsed
    assert child.returncode is not None and process.proc is None
    assert (tracing.exported, tracing.dropped) == (0, SPANS)
    warnings = [e for e in logs if e["log_level"] == "warning"]
    assert [(e["dropped"], e["exported"]) for e in warnings] == [(SPANS, 0)], logs
