"""``fleetwire coordinator`` in cluster mode: a main port plus one core per owned shard.

See coordinator/io/cluster_host.py and docs/CLUSTER.md.
"""

from __future__ import annotations

import asyncio
import signal
import sys
from typing import Any

__all__ = ["run_cluster_coordinator"]


async def run_cluster_coordinator(settings: Any, version: str) -> int:
    """Serve as one coordinator of the cluster until SIGINT/SIGTERM (exit 0; the shards are handed over)."""
    from coordinator.io.cluster_host import ClusterHost
    from coordinator.io.integrity import StoreError

    def announce(line: str) -> None:
        print(f"fleetwire coordinator {line}", flush=True)

    try:
        host = ClusterHost(settings, version=version, announce=announce)
    except (ValueError, StoreError) as exc:
        print(f"fleetwire: error: {exc}", file=sys.stderr, flush=True)
        return 2
    try:
        await host.start()
    except OSError as exc:
        host.control.close()
        print(f"fleetwire: error: cannot listen on {settings.host}:{settings.port}: {exc.strerror or exc}",
              file=sys.stderr, flush=True)  # fmt: skip
        return 2
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGHUP, host.reload_tokens)
    print(f"fleetwire coordinator listening on {host.url} (store {host.control.description}; cluster "
          f"{settings.cluster.name!r}, {settings.cluster.shards} shards, owner {host.owner})", flush=True)  # fmt: skip
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
        await host.stop()
    return 0
