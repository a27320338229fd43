"""``fleetwire coordinator`` in cluster mode: a main port plus one core per owned shard.

See coordinator/io/cluster/host.py and docs/CLUSTER.md. Each shard's core listens on a port of
its own: any free one, or one of ``--shard-ports`` (a range a firewall can open).
"""

from __future__ import annotations

import asyncio
import signal
import sys
from typing import Any

__all__ = ["parse_shard_ports", "run_cluster_coordinator"]


def parse_shard_ports(text: str, shards: int) -> tuple[int, int]:
    """``--shard-ports``: ``FIRST-LAST``, or ``FIRST`` for the ``shards`` ports from FIRST on.

    Raises:
        ValueError: one line naming the flag and what is wrong with the value.
    """
    low_text, dash, high_text = text.strip().partition("-")
    try:
        low = int(low_text)
        high = int(high_text) if dash else low + shards - 1
    except ValueError:
        raise ValueError(f"--shard-ports takes a port range FIRST-LAST (or FIRST: {shards} ports from it), "
                         f"e.g. 9100-{9100 + shards - 1}; got {text!r}") from None  # fmt: skip
    if not 0 < low <= high <= 65535:
        raise ValueError(f"--shard-ports {low}-{high}: ports run from 1 to 65535, FIRST no larger than LAST")
    return low, high


async def run_cluster_coordinator(settings: Any, version: str, shard_ports: str | None = None,
                                  secret_file: str | None = None) -> int:
    """Serve as one coordinator of the cluster until SIGINT/SIGTERM (exit 0; the shards are handed over).

    ``shard_ports``: the ``--shard-ports`` text (None: each shard's core on any free port). ``secret_file``: the
    ``--cluster-secret-file`` (coordinator/io/cluster/shared_keys.py).
    """
    from coordinator.io.cluster.host import ClusterHost
    from coordinator.io.cluster.shared_keys import ClusterSecretMismatch, read_secret
    from coordinator.io.stores.integrity import StoreError

    def announce(line: str) -> None:
        print(f"fleetwire coordinator {line}", flush=True)

    try:
        ports = None if shard_ports is None else parse_shard_ports(shard_ports, settings.cluster.shards)
        secret = None if secret_file is None else read_secret(secret_file)
        host = ClusterHost(settings, version=version, announce=announce, shard_ports=ports, cluster_secret=secret)
    except (ValueError, StoreError) as exc:
        print(f"fleetwire: error: {exc}", file=sys.stderr, flush=True)
        return 2
    if secret is None:
        print("fleetwire: warning: no --cluster-secret-file: the key that signs data-plane tickets across shards is "
              "kept in plain text in the database, so whoever can read the database (a backup, a read-only role) "
              "can read or overwrite any plan's data on any worker (docs/OPERATIONS.md §Data plane)",
              file=sys.stderr, flush=True)  # fmt: skip
    try:
        await host.start()
    except ClusterSecretMismatch as exc:  # another --cluster-secret-file than the cluster's keys were made with
        if host.control is not None:
            host.control.close()
        print(f"fleetwire: error: {exc}", file=sys.stderr, flush=True)
        return 2
    except OSError as exc:
        if host.control is not None:
            host.control.close()
        print(f"fleetwire: error: cannot listen on {settings.host}:{settings.port}: {exc.strerror or exc}",
              file=sys.stderr, flush=True)  # fmt: skip
        return 2
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGHUP, host.reload_tokens)
    print(f"fleetwire coordinator listening on {host.url} (store {host.description}; cluster "
          f"{settings.cluster.name!r}, {settings.cluster.shards} shards, owner {host.owner})", flush=True)  # fmt: skip
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    assert host.fatal is not None
    stopping = asyncio.ensure_future(stop.wait())
    try:
        # A database that cannot be reached is waited for (/readyz 503); one that refuses this coordinator
        # (another cluster's, a newer schema) is a configuration error: exit 2 (docs/OPERATIONS.md §Exit statuses).
        await asyncio.wait((stopping, host.fatal), return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopping.cancel()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
        await host.stop()
    if host.fatal.done():
        print(f"fleetwire: error: {host.fatal.result()}", file=sys.stderr, flush=True)
        return 2
    return 0
