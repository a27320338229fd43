"""Multi-turn chats on an inference fleet: each turn goes back to the worker that holds the chat's KV cache.

Needs ``FLEETWIRE_URL`` and ``FLEETWIRE_TOKEN`` (a client token) and workers started with
``--inference-url`` behind a coordinator whose policy is ``kv_aware`` (``--policy kv_aware``; see
README.md beside this file). Three chats take turns, four turns each; every turn resends the whole
history, as an OpenAI client does. The SDK computes the routing hints of each ``generate``
plan itself (fleetwire/prompt_hints.py): a prompt token estimate and the prefix hashes of the
history, so the coordinator sends a turn to the worker it sent the turn's prefix to. Per turn this
prints the worker that served it and the cache-hit hint: how many of the turn's prefix blocks
the previous turn already sent (those the serving worker holds when it is the same worker).
"""

from __future__ import annotations

import asyncio
import sys

from fleetwire import Client
from fleetwire.prompt_hints import fill_hints
from protocol import RoutingHints

SYSTEM = "You are a patient teacher. You answer every question in one short sentence."
CHATS = {
    "ships": ["tell me how the big container ships are loaded and unloaded at a busy port",
              "and how are they unloaded again", "which cranes do they use for that", "how long does all of it take"],
    "bread": ["explain how a sourdough bread rises without any yeast bought from a shop",
              "why does the starter need feeding", "what flour works best for it", "how warm should the kitchen be"],
    "trains": ["describe how a high speed train keeps its wheels on the rails at full speed",
               "what happens in sharp curves", "how are the rails kept straight", "who inspects them at night"],
}  # fmt: skip


class Chat:
    """One conversation: its history, the hints of its last turn, and the worker of each turn."""

    def __init__(self, name: str, questions: list[str]) -> None:
        self.name = name
        self.questions = questions
        self.messages = [{"role": "system", "content": SYSTEM}]
        self.previous: list[int] = []
        self.workers: list[str] = []

    async def turn(self, client: Client) -> None:
        """Ask the next question with the whole history; print where it ran and its cache-hit hint."""
        turn = len(self.workers) + 1
        self.messages.append({"role": "user", "content": self.questions[turn - 1]})
        args = {"messages": list(self.messages), "max_tokens": 64}
        plan = await client.submit("generate", args=args, tags=["llm"])  # the SDK adds the hints
        result = await plan.result()
        hints = fill_hints(RoutingHints(), args)  # the hints client.submit computed and sent, to print them
        shared = 0
        while shared < min(len(self.previous), len(hints.prefix_hashes)) and (
            self.previous[shared] == hints.prefix_hashes[shared]
        ):
            shared += 1
        hit = "first turn" if turn == 1 else f"{shared} sent before, to {self.workers[-1]}"
        print(f"chat {self.name} turn {turn}: on {plan.worker_id}, ~{hints.prompt_tokens} prompt tokens, "
              f"{len(hints.prefix_hashes)} prefix blocks hinted ({hit})", flush=True)
        self.workers.append(str(plan.worker_id))
        self.previous = hints.prefix_hashes
        self.messages.append({"role": "assistant", "content": result["text"]})


async def main() -> int:
    chats = [Chat(name, questions) for name, questions in CHATS.items()]
    async with Client() as client:
        for round_ in range(len(next(iter(CHATS.values())))):
            # One turn of each chat at a time, in a rotating order: without its hints, least-busy placement
            # (every worker idle) would hand each turn to the least recently used worker, not the chat's.
            for chat in chats[round_ % len(chats):] + chats[:round_ % len(chats)]:
                await chat.turn(client)
    stayed = sum(1 for c in chats for w in c.workers[1:] if w == c.workers[0])
    print(f"{stayed} of {sum(len(c.workers) - 1 for c in chats)} follow-up turns stayed on their chat's first "
          f"worker; chats started on {sorted(c.workers[0] for c in chats)}")
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
