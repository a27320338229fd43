"""Stream tokens from an inference fleet: submit chat plans (op ``generate``) and print tokens live.

Needs ``FLEETWIRE_URL`` and ``FLEETWIRE_TOKEN`` (a client token), and workers started with
``--inference-url`` (see README.md beside this file). Every plan is submitted first, so the fleet
runs them side by side; then each plan's tokens are printed as they arrive (or from the replay
buffer, if it already finished), followed by its result and the worker that served it.
"""

from __future__ import annotations

import asyncio
import sys

from fleetwire import Client

PROMPTS = [
    "fleetwire routes plans to workers",
    "each worker fronts an inference engine",
    "tokens stream back as events",
    "the result carries the whole text",
]


async def main() -> int:
    async with Client() as client:
        plans = [
            await client.submit(
                "generate",
                args={"messages": [{"role": "user", "content": prompt}], "max_tokens": 64},
                tags=["llm"],
            )
            for prompt in PROMPTS
        ]
        for plan in plans:
            worker = "?"
            print(f"plan {plan.id}: ", end="", flush=True)
            async for event in plan.events():
                if event.kind == "token":
                    print(event.data["text"], end="", flush=True)
                elif event.kind == "running":
                    worker = event.data["worker_id"]
            result = await plan.result()
            usage = result["usage"]
            print(f"\n  -> on {worker}: {usage['completion_tokens']} tokens, finish_reason={result['finish_reason']}, "
                  f"ttft={result['ttft_s']}s", flush=True)
        reply = await client.workers()
        for w in reply.workers:
            load = w.load
            engine = f"engine running={load.engine_running} waiting={load.engine_waiting}" if load else "no load yet"
            print(f"worker {w.id}: models={w.capabilities.models} {engine}")
        print(reply.summary)
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
