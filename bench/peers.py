"""The same work on Dask distributed and Ray, for bench/compare.py (each installed by bench/requirements.txt).

    python bench/peers.py dask --tasks 20000 --samples 500 --json
    python bench/peers.py ray --tasks 20000 --samples 500 --json

Work: N no-op tasks submitted at once and gathered (throughput), then S sequential
submit → result round trips (latency). Dask: ``LocalCluster`` with 2 worker processes of one
thread, scheduler and workers on 127.0.0.1, no dashboard. Ray: ``ray.init(num_cpus=2)`` on
127.0.0.1, no dashboard.

Loopback only: while the peer runs, every TCP socket of this process tree is listed (``ss``
semantics, through psutil). A socket bound or connected to anything but 127.0.0.1 (or ::1)
stops the peer *before any task is submitted*, and the result says why: the column of
compare.py then reads "excluded: ...". A peer that is not installed gives ``installed: false``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from collections.abc import Callable
from typing import Any

import _harness as h

LOOPBACK = ("127.", "::1", "::ffff:127.")


def non_loopback_sockets() -> list[str]:
    """TCP sockets of this process and its descendants bound or connected beyond loopback."""
    import psutil

    me = psutil.Process()
    procs = [me, *me.children(recursive=True)]
    pids = {p.pid for p in procs}
    bad: list[str] = []
    for conn in psutil.net_connections(kind="inet"):
        if conn.pid not in pids or not conn.laddr:
            continue
        local = conn.laddr.ip
        remote = conn.raddr.ip if conn.raddr else ""
        if local in ("0.0.0.0", "::") or not local.startswith(LOOPBACK) or (remote and not remote.startswith(LOOPBACK)):
            try:
                name = psutil.Process(conn.pid).name()
            except psutil.Error:
                name = "?"
            bad.append(f"{name}[{conn.pid}] {local}:{conn.laddr.port}"
                       + (f" -> {remote}:{conn.raddr.port}" if remote else f" ({conn.status.lower()})"))
    return sorted(set(bad))


def noop(x: Any) -> Any:
    return x


def _measure(submit_all: Callable[[int], None], one: Callable[[int], None], tasks: int, samples: int,
             warmup: int) -> dict[str, Any]:
    for i in range(warmup):
        one(i)
    t0 = time.perf_counter()
    cpu0 = h.cpu_seconds(os.getpid())
    submit_all(tasks)
    elapsed = time.perf_counter() - t0
    times = []
    for i in range(samples):
        t = time.perf_counter()
        one(i)
        times.append(time.perf_counter() - t)
    return {
        "tasks": tasks,
        "elapsed_s": round(elapsed, 4),
        "tasks_per_s": round(tasks / elapsed, 1),
        "driver_cpu_s": round(h.cpu_seconds(os.getpid()) - cpu0, 3),
        "latency": {"samples": samples, **h.summary_ms(times)},
    }


def run_dask(tasks: int, samples: int, warmup: int) -> dict[str, Any]:
    try:
        import dask
        import distributed
        from distributed import Client, LocalCluster
    except ImportError as exc:
        return {"installed": False, "why": f"not installed ({exc.name}); pip install -r bench/requirements.txt"}
    with dask.config.set({"distributed.worker.daemon": False}), LocalCluster(
        n_workers=2, threads_per_worker=1, processes=True, host="127.0.0.1", dashboard_address=None,
        silence_logs=40,
    ) as cluster, Client(cluster) as client:
        client.submit(noop, -1, pure=False).result()
        bad = non_loopback_sockets()
        if bad:
            return {"installed": True, "excluded": True, "why": f"{len(bad)} sockets beyond 127.0.0.1, e.g. {bad[0]}",
                    "sockets": bad}

        def submit_all(n: int) -> None:
            client.gather(client.map(noop, range(n), pure=False))

        def one(i: int) -> None:
            client.submit(noop, i, pure=False).result()

        result = _measure(submit_all, one, tasks, samples, warmup)
        result["sockets_checked_after"] = non_loopback_sockets() or "all on 127.0.0.1"
    return {"installed": True, "version": distributed.__version__,
            "setup": "LocalCluster(n_workers=2, threads_per_worker=1, processes=True, host=127.0.0.1)", **result}


def run_ray(tasks: int, samples: int, warmup: int) -> dict[str, Any]:
    try:
        import ray
    except ImportError as exc:
        return {"installed": False, "why": f"not installed ({exc.name}); pip install -r bench/requirements.txt"}
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")  # no usage report leaves the machine
    ray.init(num_cpus=2, _node_ip_address="127.0.0.1", include_dashboard=False, logging_level="ERROR",
             configure_logging=False, log_to_driver=False)
    try:
        bad = non_loopback_sockets()
        if bad:
            return {"installed": True, "version": ray.__version__, "excluded": True,
                    "why": f"{len(bad)} sockets beyond 127.0.0.1 even with _node_ip_address=127.0.0.1, "
                           f"e.g. {bad[0]}",
                    "sockets": bad}
        remote_noop = ray.remote(noop)

        def submit_all(n: int) -> None:
            ray.get([remote_noop.remote(i) for i in range(n)])

        def one(i: int) -> None:
            ray.get(remote_noop.remote(i))

        result = _measure(submit_all, one, tasks, samples, warmup)
        result["sockets_checked_after"] = non_loopback_sockets() or "all on 127.0.0.1"
        return {"installed": True, "version": ray.__version__, "setup": "ray.init(num_cpus=2)", **result}
    finally:
        with contextlib.suppress(Exception):
            ray.shutdown()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("peer", choices=("dask", "ray"))
    parser.add_argument("--tasks", type=int, default=20_000, help="no-op tasks for throughput (default 20000)")
    parser.add_argument("--samples", type=int, default=500, help="sequential round trips (default 500)")
    parser.add_argument("--warmup", type=int, default=50, help="untimed round trips first (default 50)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    ns = parser.parse_args(argv)
    runner = run_dask if ns.peer == "dask" else run_ray
    result = {"bench": "peer", "system": ns.peer, **runner(ns.tasks, ns.samples, ns.warmup)}
    if ns.json:
        print(json.dumps(result), flush=True)
    else:
        print(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
