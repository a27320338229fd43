"""Submit plans from Python and stream their events.

Run `fleetwire up` in one shell, paste the two `export` lines it prints into another, then:

    python examples/submit_and_stream.py
"""

from __future__ import annotations

import asyncio
import os

from fleetwire import Client, PlanCancelled, PlanFailed


async def main() -> None:
    async with Client(os.environ["FLEETWIRE_URL"], token=os.environ["FLEETWIRE_TOKEN"]) as client:
        # One plan, every event as it happens.
        plan = await client.submit("echo", args={"x": 1})
        async for event in plan.events():
            print(f"{plan.id} [{event.seq}] {event.kind} {event.data}")
        print("result:", await plan.result())

        # Many plans at once: submit them all, then collect the results.
        plans = [await client.submit("sleep", args={"seconds": 0.2 * i}) for i in range(4)]
        for p in plans:
            print(p.id, "->", await p.result())

        # A failure comes back as an exception with a stable code.
        slow = await client.submit("sleep", args={"seconds": 5}, timeout_s=0.5)
        try:
            await slow.result()
        except PlanFailed as exc:
            print("failed:", exc.code, exc)

        # A plan no worker can run waits in the queue, and its stream says why.
        orphan = await client.submit("no-such-op")
        async for event in orphan.events():
            if event.kind == "waiting":
                print("waiting:", event.data["reason"])
                await client.cancel(orphan.id)
        try:
            await orphan.result()
        except PlanCancelled:
            print("cancelled:", orphan.id)

        reply = await client.workers()
        print(reply.summary)


if __name__ == "__main__":
    asyncio.run(main())
