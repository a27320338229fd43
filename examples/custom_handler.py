"""A worker with a handler of your own.

Start a coordinator (`fleetwire up` prints the worker token line), then run this worker:

    FLEETWIRE_URL=ws://127.0.0.1:8765 FLEETWIRE_WORKER_TOKEN=<worker token> python examples/custom_handler.py

(``FLEETWIRE_TOKEN`` is used when ``FLEETWIRE_WORKER_TOKEN`` is not set; a client's token is refused
with one line and exit status 1), and submit plans to it from another shell:

    fleetwire submit word_count --args '{"text": "to be or not to be"}' --follow
"""

from __future__ import annotations

import asyncio
import os
import sys
from collections import Counter
from typing import Any

from worker_agent import Agent, AuthError, Context

token = os.environ.get("FLEETWIRE_WORKER_TOKEN") or os.environ.get("FLEETWIRE_TOKEN")
agent = Agent(os.environ["FLEETWIRE_URL"], token, worker_id="word-counter", tags=["text"])


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


async def main() -> int:
    run = asyncio.create_task(agent.run())
    registered = asyncio.create_task(agent.registered.wait())
    # run() ends by itself only when the coordinator refuses the token: wait for either.
    await asyncio.wait((run, registered), return_when=asyncio.FIRST_COMPLETED)
    if registered.done():
        print(f"worker {agent.worker_id} registered", flush=True)
    registered.cancel()
    try:
        await run
    except AuthError as exc:  # e.g. a client's token: it cannot serve plans
        print(f"custom_handler.py: {exc}", file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
