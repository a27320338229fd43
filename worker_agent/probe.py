"""What this host offers (capabilities, sent once in ``hello``) and how busy it is (load, sent
in every ``heartbeat``); docs/SEMANTICS.md §Worker session.

GPUs are found through NVML (``pynvml`` from nvidia-ml-py). A host without the NVML library or
without devices is an ordinary CPU host: the probe returns no GPUs, raises nothing, and logs only
at debug level.
"""

from __future__ import annotations

import os
import socket
import sys
from collections.abc import Iterable, Sequence

import psutil  # type: ignore[import-untyped]  # no stubs in the runtime deps
import structlog

import protocol
from worker_agent import energy
from worker_agent.devices import contradiction, parse_gpus

log = structlog.get_logger(__name__)


def probe_gpus() -> list[protocol.GpuInfo]:
    """The GPUs (and MIG instances) NVML reports, or ``[]`` when NVML is missing or finds none.

    The NVML code lives in ``worker_agent/energy.py``, with the power probes.
    """
    return energy.probe_gpus()


def check_declared_gpus(spec: str) -> None:
    """Refuse a ``--gpus`` declaration that contradicts the devices NVML sees (none seen: any is fine).

    Raises:
        ValueError: the declaration is malformed or contradicts NVML; the message says how.
    """
    declared = parse_gpus(spec)
    problem = contradiction(declared, probe_gpus())
    if problem is not None:
        raise ValueError(problem)


def _unique(items: Iterable[str]) -> list[str]:
    return list(dict.fromkeys(item for item in items if item))


def probe_capabilities(
    *,
    tags: Sequence[str],
    max_concurrency: int,
    ops: Sequence[str],
    python_envs: Sequence[str] = (),
) -> protocol.Capabilities:
    """Capabilities of this host for ``hello``.

    Args:
        tags: labels from the command line; plans can require them.
        max_concurrency: how many plans this worker runs at once.
        ops: names of the handlers this worker has.
        python_envs: interpreters beyond this one that the worker offers.
    """
    gpus = probe_gpus()
    return protocol.Capabilities(
        cpu_cores=os.cpu_count() or 1,
        ram_bytes=int(psutil.virtual_memory().total),
        gpus=gpus,
        accelerator="gpu" if gpus else "cpu",
        python_envs=_unique([sys.executable, *python_envs]),
        ops=sorted(set(ops)),
        tags=_unique(tags),
        max_concurrency=max_concurrency,
        hostname=socket.gethostname(),
        short_unsampled=True,  # the runner and Context read assign.traceparent "0" as "00" (protocol/tracecontext.py)
    )


class LoadTracker:
    """In-flight and queued plan counts and an EMA of finished plans' latency.

    Args:
        alpha: weight of the newest latency in the moving average (0 < alpha <= 1).
    """

    def __init__(self, alpha: float = 0.2) -> None:
        if not 0.0 < alpha <= 1.0:
            raise ValueError(f"alpha must be in (0, 1], got {alpha}")
        self.alpha = alpha
        self.in_flight = 0
        self.queued = 0
        self.latency_ema_ms = 0.0
        self.finished_count = 0

    def started(self) -> None:
        """A plan began running."""
        self.in_flight += 1

    def finished(self, latency_s: float) -> None:
        """A plan that ``started`` ended (any outcome) after ``latency_s`` seconds."""
        self.in_flight = max(0, self.in_flight - 1)
        latency_ms = max(0.0, latency_s) * 1000.0
        if self.finished_count == 0:
            self.latency_ema_ms = latency_ms
        else:
            self.latency_ema_ms += self.alpha * (latency_ms - self.latency_ema_ms)
        self.finished_count += 1

    def snapshot(self) -> protocol.Load:
        """The load to send in the next ``heartbeat``."""
        return protocol.Load(in_flight=self.in_flight, queued=self.queued, latency_ema_ms=round(self.latency_ema_ms, 3))
