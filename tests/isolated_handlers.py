"""Custom handlers a worker runs in a process of their own (tests/integration/test_handler_isolation.py)."""

from __future__ import annotations

import os
import time
from typing import Any

from worker_agent.handlers import HandlerError


def visible(ctx: Any, args: Any) -> dict[str, Any]:
    """What the plan's process sees of the devices; holds ``args['hold_s']`` so plans overlap."""
    ctx.emit("seen", {"cuda": os.environ.get("CUDA_VISIBLE_DEVICES")})
    ctx.report_tokens(2)
    time.sleep((args or {}).get("hold_s", 0.0))
    return {
        "cuda": os.environ.get("CUDA_VISIBLE_DEVICES"), "nvidia": os.environ.get("NVIDIA_VISIBLE_DEVICES"),
        "rocr": os.environ.get("ROCR_VISIBLE_DEVICES"), "pid": os.getpid(), "devices": list(ctx.devices),
        "token": os.environ.get("FLEETWIRE_TOKEN"),
    }  # fmt: skip


async def refuses(ctx: Any, args: Any) -> None:
    """Fails with its own code, as an in-process handler would."""
    raise HandlerError("bad_input", "refused in its own process", {"why": "test"})


def sleeps(ctx: Any, args: Any) -> None:
    """Runs until cancelled."""
    while True:
        time.sleep(0.05)
