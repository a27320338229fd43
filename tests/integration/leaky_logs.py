"""Run by tests/integration/test_operator_experience.py in a child process (logging is per process):
a coordinator and an agent whose handlers hold a secret in args, events, locals and results.

``python -m tests.integration.leaky_logs FORMAT SECRET``: FORMAT json or console (fleetwire's
``configure_logging`` at debug), or default (structlog left as a library user would: its own
defaults, rich tracebacks with locals). Exit 0 when both plans ended as expected.
"""

from __future__ import annotations

import asyncio
import sys
from typing import Any

from coordinator.io.frontdoor.server import CoordinatorServer, ServerSettings
from fleetwire import Client
from fleetwire.cli.logs import configure_logging
from fleetwire.errors import PlanFailed
from worker_agent import Agent

WORKER_TOKEN = "worker-token-0123456789"
CLIENT_TOKEN = "client-token-0123456789"


def leaky(ctx: Any, args: dict[str, Any]) -> None:
    """Holds the secret in a local and an event, then raises."""
    api_key = args["api_key"]
    ctx.emit("progress", {"fraction": 0.5, "key": api_key})
    raise RuntimeError("the upstream API refused the request")


def reveals(ctx: Any, args: dict[str, Any]) -> dict[str, str]:
    """Returns the secret as its result."""
    return {"echo": args["api_key"]}


async def main(secret: str) -> None:
    server = CoordinatorServer(
        ServerSettings(port=0, worker_tokens=(WORKER_TOKEN,), client_tokens=(CLIENT_TOKEN,), store="memory")
    )
    await server.start()
    agent = Agent(server.url, WORKER_TOKEN, worker_id="w1")
    agent.add_handler("leaky", leaky)
    agent.add_handler("reveals", reveals)
    task = asyncio.create_task(agent.run())
    try:
        await asyncio.wait_for(agent.registered.wait(), 10)
        async with Client(server.url, token=CLIENT_TOKEN) as client:
            plan = await client.submit("leaky", args={"api_key": secret})
            try:
                await asyncio.wait_for(plan.result(), 10)
                raise SystemExit("the leaky plan succeeded")
            except PlanFailed as exc:
                assert "RuntimeError" in str(exc), exc
            plan = await client.submit("reveals", args={"api_key": secret})
            assert (await asyncio.wait_for(plan.result(), 10)) == {"echo": secret}
    finally:
        agent.stop()
        await asyncio.wait_for(task, 10)
        await server.stop()


if __name__ == "__main__":
    fmt, secret = sys.argv[1], sys.argv[2]
    if fmt != "default":
        configure_logging(fmt, "debug")  # type: ignore[arg-type]
    asyncio.run(main(secret))
