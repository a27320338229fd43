"""Functions the ``python`` op runs in tests of plans that hold devices (worker_agent/pyproc.py)."""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any

from worker_agent.handlers import HandlerError


def visible(tag: str, *, ctx: Any, devices: list[str]) -> dict[str, Any]:
    """What the plan's process sees: its CUDA_VISIBLE_DEVICES, pid and devices; one event, 3 tokens."""
    ctx.emit("seen", {"tag": tag, "cuda": os.environ.get("CUDA_VISIBLE_DEVICES")})
    ctx.report_tokens(3)
    return {"cuda": os.environ.get("CUDA_VISIBLE_DEVICES"), "pid": os.getpid(), "devices": devices,
            "ctx_devices": list(ctx.devices), "tag": tag}  # fmt: skip


async def async_visible() -> str | None:
    """An async function: its CUDA_VISIBLE_DEVICES."""
    await asyncio.sleep(0)
    return os.environ.get("CUDA_VISIBLE_DEVICES")


def hold(gate: str, ctx: Any) -> str:
    """Emit the plan's device, then hold it until the file ``gate`` exists; return the device."""
    ctx.emit("device", os.environ["CUDA_VISIBLE_DEVICES"])
    while not os.path.exists(gate):
        time.sleep(0.02)
    return os.environ["CUDA_VISIBLE_DEVICES"]


def forever(ctx: Any) -> None:
    """Emit the process id, then run until stopped."""
    ctx.emit("pid", os.getpid())
    time.sleep(120)


def fail_with_code() -> None:
    """Fail with a HandlerError of its own code and detail."""
    raise HandlerError("model_missing", "no weights here", {"path": "/nowhere"})


def boom() -> None:
    """Raise a plain exception."""
    raise ValueError("boom")


def crash() -> None:
    """Die without reporting (as the OOM killer would leave it)."""
    os._exit(3)


def unencodable() -> object:
    """A result msgpack cannot carry."""
    return object()


def leave_outputs(directory: str, ctx: Any) -> str:
    """Leave two outputs from the plan's process: bytes, and a file it wrote."""
    ctx.output("raw", b"from the child")
    path = os.path.join(directory, "made.txt")
    with open(path, "w") as f:
        f.write("a file")
    ctx.output("file", path)
    return "left"
