"""A stopping coordinator shuts its tracing down in its own stop threads, not the loop's default executor.

Against an OTLP collector that accepts connections and never answers, the exporter child's close waits its whole
bound (``ExportProcess.exit_wait_s``, 15 s by default) before it kills the child. ``CoordinatorServer.stop`` ran that
in the loop's default executor, which a cluster host's every shard stop, and the loop's ``getaddrinfo``, share; it
now runs in the threads the server closes its store in (a cluster host's ``closer``, cluster/teardown.py).
"""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from coordinator.io.frontdoor.server import CoordinatorServer, ServerSettings

pytestmark = pytest.mark.timeout(60)

SAMPLED = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
EXIT_WAIT_S = 1.0  # the exporter child's bound here (15 s by default)


async def test_the_stop_shuts_tracing_down_in_its_closer_and_leaves_the_default_executor_free(
    mute_collector: str,
) -> None:
    """A span queued for a collector that never answers: stop() shuts tracing down in the server's closer threads,
    the loop's default executor (one thread here) answers a call meanwhile, and the stop ends within the exporter
    child's bound."""
    loop = asyncio.get_running_loop()
    default = ThreadPoolExecutor(max_workers=1, thread_name_prefix="default-executor")
    loop.set_default_executor(default)
    closer = ThreadPoolExecutor(max_workers=2, thread_name_prefix="test-closer")
    server = CoordinatorServer(ServerSettings(port=0, insecure=True, otlp_endpoint=mute_collector), closer=closer)
    tracing = server.tracing
    assert tracing is not None and tracing.process is not None
    tracing.process.exit_wait_s = EXIT_WAIT_S
    shutting, shut = threading.Event(), threading.Event()
    where: list[str] = []
    real_shutdown = tracing.shutdown

    def shutdown() -> None:
        where.append(threading.current_thread().name)
        shutting.set()
        try:
            real_shutdown()
        finally:
            shut.set()

    tracing.shutdown = shutdown  # type: ignore[method-assign]
    try:
        await server.start()
        tracing.record("fleetwire.queue", SAMPLED, time.time_ns() - 1_000, time.time_ns())  # for the mute collector
        began = time.monotonic()
        stopping = asyncio.ensure_future(server.stop())
        assert await loop.run_in_executor(None, shutting.wait, 20)
        # The default executor's one thread is free while the shutdown waits on the collector.
        assert await loop.run_in_executor(None, shut.is_set) is False
        await asyncio.wait_for(stopping, 20)
        assert time.monotonic() - began < EXIT_WAIT_S + 10  # its bound and the store's close, not a hang
    finally:
        closer.shutdown(wait=False)
    assert shut.is_set() and len(where) == 1 and where[0].startswith("test-closer"), where
