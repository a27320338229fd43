"""Handlers the benchmarks load into real workers (``fleetwire worker --handler NAME=_bench_handlers:FN``).

``bench/`` is on the workers' ``PYTHONPATH`` (see ``_harness.bench_env``).
"""

from __future__ import annotations

import asyncio
from typing import Any


async def stream(ctx: Any, args: Any) -> dict[str, int]:
    """Emit ``args["count"]`` ephemeral ``tok`` events as fast as the worker sends them.

    Yields to the loop every ``args["yield_every"]`` events so the writer drains the outbox
    (the outbox sheds ephemeral events past its bound, which would make the count short).
    """
    count = int(args.get("count", 10_000))
    every = max(1, int(args.get("yield_every", 256)))
    for i in range(count):
        ctx.emit("tok", i, ephemeral=True)
        if i % every == every - 1:
            await asyncio.sleep(0)
    return {"emitted": count}


async def data_sink(ctx: Any, args: Any) -> dict[str, Any]:
    """The size and digest of input ``data`` (the worker verified the digest as it arrived; nothing is reread)."""
    data = ctx.inputs["data"]
    return {"size": data.size, "digest": data.digest}


async def data_source(ctx: Any, args: Any) -> dict[str, Any]:
    """Leave the file at ``args["path"]`` as output ``out`` (copied into the spool; not part of the timing)."""
    spec = await asyncio.to_thread(ctx.output, "out", args["path"])
    return {"size": spec.size}
