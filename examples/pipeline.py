"""A two-step pipeline: the second plan takes the first one's output, which never passes through this client.

Run `fleetwire up --allow-shell` in one shell, paste the two `export` lines it prints into another, then:

    python examples/pipeline.py

The first plan writes a file of numbers on its worker; the second takes that file as its input (a
reference, ``numbers.ref("numbers.txt")``), waits until it exists, and runs where it is when that
worker has room: the bytes go worker to worker, never through the client or the coordinator. A plan
that runs after another without taking its data names it in ``after``. If the first fails, the second
fails at once with ``upstream_failed``, naming it.
"""

from __future__ import annotations

import asyncio
import os

from fleetwire import Client, PlanFailed


async def main() -> None:
    async with Client(os.environ["FLEETWIRE_URL"], token=os.environ["FLEETWIRE_TOKEN"]) as client:
        numbers = await client.submit(
            "shell", args={"cmd": 'seq 1 1000 > "$FLEETWIRE_OUTPUT_DIR/numbers.txt"'}, outputs=["numbers.txt"],
        )
        total = await client.submit(
            "shell",
            args={"cmd": 'awk \'{s += $1} END {print s}\' "$FLEETWIRE_INPUT_NUMBERS" > "$FLEETWIRE_OUTPUT_DIR/sum"'},
            inputs={"numbers": numbers.ref("numbers.txt")},
            outputs=["sum"],
        )
        report = await client.submit("echo", args={"done": True}, after=[total])
        await report.result()
        print("sum:", (await total.output("sum")).decode().strip())
        print("ran on:", numbers.worker_id, "then", total.worker_id)

        # An upstream that fails fails its dependants at once, naming it.
        broken = await client.submit("shell", args={"cmd": "exit 3"}, outputs=["never"])
        after_broken = await client.submit("shell", args={"cmd": "true"}, inputs={"x": broken.ref("never")})
        try:
            await after_broken.result()
        except PlanFailed as exc:
            print("failed:", exc.code, "-", exc)


if __name__ == "__main__":
    asyncio.run(main())
