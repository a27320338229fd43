"""A worker with a handler of your own.

Start a coordinator (`fleetwire up` prints the worker token line), then run this worker:

    FLEETWIRE_URL=ws://127.0.0.1:8765 FLEETWIRE_TOKEN=<worker token> python examples/custom_handler.py

and submit plans to it from another shell:

    fleetwire submit word_count --args '{"text": "to be or not to be"}' --follow
"""

from __future__ import annotations

import asyncio
import os
from collections import Counter
from typing import Any

from worker_agent import Agent, Context

agent = Agent(os.environ["FLEETWIRE_URL"], os.environ["FLEETWIRE_TOKEN"], worker_id="word-counter", tags=["text"])


@agent.handler("word_count")
async def word_count(ctx: Context, args: Any) -> dict[str, int]:
    """Count words, reporting progress per line; the return value is the plan's result."""
    lines = str(args["text"]).splitlines() or [""]
    counts: Counter[str] = Counter()
    for i, line in enumerate(lines, 1):
        counts.update(line.split())
        ctx.progress(i / len(lines), f"line {i}")
    return dict(counts)


@agent.handler()
def shout(ctx: Context, args: Any) -> str:
    """A plain function works too: it runs in a thread, off the event loop."""
    return str(args).upper()


async def main() -> None:
    run = asyncio.create_task(agent.run())
    await agent.registered.wait()
    print(f"worker {agent.worker_id} registered", flush=True)
    await run


if __name__ == "__main__":
    asyncio.run(main())
